"""Tensor parallelism across processes: rank 0 runs the engine, ranks 1..N-1 follow its steps.

This module is the group (joining it, its store) and rank 0's side of it (starting the other
ranks, watching them); a follower rank's process is service/engine/rank_main.py, and what each
rank's runner does beside the step is its role (service/engine/roles.py).

Rank 0 is the process that builds the engine (the engine process, or the caller of service.llm.LLM):
it schedules, samples and publishes. It starts one process per other rank (`python -m
service.engine.rank_main`, the config on stdin), and every rank joins one torch.distributed group:
NCCL on CUDA (rank r on cuda:r), gloo on the CPU. Per step rank 0 sends the step's inputs (token
ids, positions, KV slots, prompt chunks, the rows to feed back from the previous step) to the
others with one broadcast of a fixed-size int64 buffer over a gloo group of its own (host memory,
so no rank syncs its device to read it); every rank then runs the same runner forward, whose
collectives (service.model.parallel) meet in the same order; rank 0 samples and broadcasts the
tokens, which the next step may feed back on the device.

CUDA graphs (the all-reduces captured inside) are per rank, and their collectives only meet when
every rank captures, replays and releases the same graphs in the same order. Rank 0's graph cache
decides everything (what to capture, evict, replay; the budget, which is per rank; the stats and
the warm start) and the step's message carries it: the graph operations to run before the step,
in order, and the graph the step replays. The other ranks follow with a GraphMirror
(cache_manager/mirror.py). Captures run inline on every rank's engine thread, at the same point in
the step sequence (NCCL communicators are not thread-safe, and a warm-up's collectives beside a
step's could deadlock across ranks): the engine stalls for each capture, as `stall_ms` shows.
Operations decided between steps (warm start, graphctl) go out in a message without a step. The
other ranks publish the bytes their graphs hold to the group's store (rank_memory.py), where rank 0
reads them for the admin state.

A rank that dies or hangs ends the engine: rank 0 watches the other processes and fails its next
step (the engine then fails every stream and the server exits as on any engine failure);
collectives with a dead peer raise (gloo) or time out. Every other rank sets a heartbeat in the
store each second from a thread of its own; one that misses them for `--watchdog-timeout` (a
stopped process, an interpreter that never lets go of the GIL) is killed and counts as dead, so a
stuck collective ends in seconds, not at the collective timeout. A rank whose rank 0 is gone exits:
the kernel kills it (a parent-death signal, which reaches a stopped process too) and a watch thread
checks its parent as well.

Nothing listens beyond loopback: rank 0's store listens on a socket bound to 127.0.0.1, and gloo
(the step channel, and CPU collectives) binds the loopback interface unless GLOO_SOCKET_IFNAME says
otherwise. The ranks share one host.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import pathlib
import pickle
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import structlog
import torch

from service.engine.rank_memory import RankMemory, read_memory
from service.engine.step_channel import StepChannel, StepInputs
from service.model.parallel import TensorParallel

log = structlog.get_logger("graphserve.ranks")

# Collectives of a step are quick; a peer that is alive but stuck fails the step after this long.
# Loading is included (the first collective waits for every rank's load).
_COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=5)
# The step channel waits for the next step however long the server is idle.
_IDLE_TIMEOUT = datetime.timedelta(days=3650)
_WATCH_INTERVAL_S = 0.2


class RankDied(RuntimeError):
    """A tensor-parallel rank's process exited: the engine cannot run another step."""


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank r's device: cuda:r on CUDA (the visible GPUs in order), the CPU otherwise."""
    if device.type != "cuda":
        return device
    torch.cuda.set_device(rank)
    return torch.device("cuda", rank)


def host_store(world_size: int, port: int = 0) -> Any:
    """Rank 0: the group's TCPStore, listening on a loopback socket (port 0: a free one). It also
    carries the ranks' heartbeats and graph memory (service.engine.rank_memory)."""
    import torch.distributed as dist

    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", port))
    listener.listen(128)
    port = listener.getsockname()[1]
    # The store owns the descriptor from here on: detach it so that Python never closes it.
    return dist.TCPStore("127.0.0.1", port, world_size, is_master=True, timeout=_COLLECTIVE_TIMEOUT,
                         wait_for_workers=False, master_listen_fd=listener.detach())


def group_store(rank: int, world_size: int, port: int) -> Any:
    """The group's TCPStore (rank 0 hosts it on `port`, the others connect), with this rank marked
    as started."""
    import torch.distributed as dist

    if rank == 0:
        store = host_store(world_size, port)
    else:
        store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=_COLLECTIVE_TIMEOUT)
    store.set(_joined_key(rank), "1")
    return store


def store_connection(port: int) -> Any:
    """A connection of its own to the group's store (rank 0 hosts it on `port`)."""
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=_COLLECTIVE_TIMEOUT)


def bind_gloo_to_loopback() -> None:
    """Gloo listens on the interface of the host name unless told otherwise: every rank is on this
    host, so it listens on loopback (an operator's GLOO_SOCKET_IFNAME wins)."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")


def join_group(rank: int, world_size: int, port: int, device: torch.device,
               store: Any = None) -> tuple[TensorParallel, Any]:
    """Joins the process group (rank 0 hosts the store on `port`, or passes one it already hosts); returns this rank's
    TensorParallel (the model's collectives) and the gloo group of the step channel."""
    import torch.distributed as dist

    bind_gloo_to_loopback()
    if store is None:
        store = group_store(rank, world_size, port)
    backend = "nccl" if device.type == "cuda" else "gloo"
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=_COLLECTIVE_TIMEOUT,
                            **kwargs)
    channel_group = dist.new_group(list(range(world_size)), backend="gloo", timeout=_IDLE_TIMEOUT)
    return TensorParallel(rank, world_size, dist.group.WORLD), channel_group


class Ranks:
    """Rank 0's side: the other ranks' processes, the step channel, and a watch on their lives."""

    def __init__(self, procs: list[subprocess.Popen], channel: StepChannel, store: Any,
                 hang_timeout_s: float, on_death: Callable[[], None] | None = None) -> None:
        self.procs = procs
        self.channel = channel
        self.store = store  # rank 0 hosts the group's store: it lives as long as the group
        self.hang_timeout_s = hang_timeout_s  # a rank without a heartbeat this long is killed
        self.dead: str | None = None  # which rank died and how, once one has
        self._on_death = on_death  # (the watch thread) e.g. wake the engine so it fails now
        self._closing = False
        # The watch reads heartbeats on a connection of its own: the store's is the engine thread's.
        self._beats = store_connection(store.port)
        self._watch = threading.Thread(target=self._watch_loop, name="graphserve-ranks-watch", daemon=True)
        self._watch.start()

    def memory(self, own: RankMemory) -> list[RankMemory]:
        """Every rank's graph memory: rank 0's own (`own`), then what the others last published."""
        return read_memory(self.store, len(self.procs) + 1, own)

    def send(self, inputs: StepInputs) -> None:
        self.check()
        self.channel.send(inputs)

    def check(self) -> None:
        """Raises RankDied once any other rank's process has exited."""
        if self.dead is not None:
            raise RankDied(self.dead)

    def explain(self, exc: BaseException, wait_s: float = 1.0) -> BaseException:
        """The error a failed step reports: RankDied when a rank's exit caused it (a collective
        with a dead peer fails as soon as its connection closes, maybe before the exit is reaped,
        so this waits up to wait_s for it), else exc."""
        deadline = time.monotonic() + wait_s
        while True:
            if self.dead is not None:  # the watch's reason says more than an exit code (a hung rank killed)
                return RankDied(self.dead)
            for rank, p in enumerate(self.procs, start=1):
                if p.poll() is not None:
                    return RankDied(_exit_reason(rank, p))
            if time.monotonic() > deadline:
                return exc
            time.sleep(0.02)

    def _watch_loop(self) -> None:
        keys = [beat_key(rank) for rank in range(1, len(self.procs) + 1)]
        seen = [b""] * len(self.procs)
        changed = [time.monotonic()] * len(self.procs)
        while not self._closing:
            now = time.monotonic()
            for i, p in enumerate(self.procs):
                rank = i + 1
                code = p.poll()
                if code is not None:
                    self._died(_exit_reason(rank, p), rank=rank, pid=p.pid, exit_code=code)
                    return
                beat = self._beats.get(keys[i]) if self._beats.check([keys[i]]) else b""
                if beat != seen[i]:
                    seen[i], changed[i] = beat, now
                elif now - changed[i] > self.hang_timeout_s:
                    self._died(f"tensor-parallel rank {rank} (pid {p.pid}) sent no heartbeat for "
                               f"{now - changed[i]:.0f} s (--watchdog-timeout {self.hang_timeout_s:g}): "
                               "it was stopped or hung, and was killed", kill=p, rank=rank, pid=p.pid, hung=True)
                    return
            time.sleep(_WATCH_INTERVAL_S)

    def _died(self, reason: str, kill: subprocess.Popen | None = None, **fields: Any) -> None:
        if self._closing:
            return
        self.dead = reason  # before a kill: a step failing of it reports this reason (explain)
        if kill is not None:
            kill.kill()  # a stopped process dies of SIGKILL too; its sockets close, so collectives fail
            kill.wait()
        log.error("rank_died", reason=reason, **fields)
        if self._on_death is not None:
            self._on_death()

    def kill(self) -> None:
        """Kill every other rank at once (this process is about to exit without a stop)."""
        self._closing = True
        for p in self.procs:
            p.kill()

    def close(self, send_stop: bool, timeout: float = 10.0) -> None:
        """Stop the other ranks (a stop message when the channel is free, else a kill) and leave the group."""
        import torch.distributed as dist

        self._closing = True
        if not send_stop:  # a rank may be waiting in a collective that will never complete
            for p in self.procs:
                p.kill()
        elif self.dead is None:
            try:
                self.channel.send(None)
            except Exception as exc:  # noqa: BLE001 - a rank died meanwhile: kill below
                log.warning("rank_stop_failed", error=repr(exc))
        deadline = time.monotonic() + timeout
        for p in self.procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("rank_kill", pid=p.pid, reason=f"did not stop within {timeout} s")
                p.kill()
                p.wait(5)
        if dist.is_initialized() and self.dead is None and send_stop:
            dist.destroy_process_group()


def start_ranks(c: Any, device: torch.device,
                on_death: Callable[[], None] | None = None) -> tuple[Ranks, TensorParallel, torch.device]:
    """Rank 0: start ranks 1..N-1 for config `c` and join the group with them. Returns the ranks
    (which call `on_death` when one of them dies), rank 0's TensorParallel and its device."""

    n = c.tensor_parallel_size
    if device.type == "cuda" and torch.cuda.device_count() < n:
        raise RuntimeError(f"--tensor-parallel-size {n} needs {n} GPUs; {torch.cuda.device_count()} are visible")
    device = rank_device(device, 0)
    store = host_store(n)
    root = str(pathlib.Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    payload = pickle.dumps((c, str(device.type)))
    # The parent-death signal fires when the thread that started the process ends: only the main
    # thread (the engine process's, or an LLM built on it) lives as long as the ranks must.
    pdeathsig = int(threading.current_thread() is threading.main_thread())
    procs = []
    for rank in range(1, n):
        p = subprocess.Popen([sys.executable, "-m", "service.engine.rank_main", str(rank), str(n), str(store.port),
                              str(os.getpid()), str(pdeathsig)], stdin=subprocess.PIPE, env=env, cwd=root)
        assert p.stdin is not None
        with contextlib.suppress(BrokenPipeError):  # it exited already: _wait_for_ranks says so
            p.stdin.write(payload)
        with contextlib.suppress(BrokenPipeError):  # closes the pipe even when the flush fails
            p.stdin.close()
        procs.append(p)
    log.info("ranks_started", world_size=n, pids=[p.pid for p in procs], port=store.port)
    try:
        _wait_for_ranks(store, procs)
        tp, channel_group = join_group(0, n, store.port, device, store=store)
    except BaseException:
        for p in procs:
            p.kill()
        raise
    channel = StepChannel(channel_group, StepInputs.capacity(c.max_running_seqs, c.max_num_batched_tokens, c.block_size))
    return Ranks(procs, channel, store, c.watchdog_timeout, on_death), tp, device


def _wait_for_ranks(store: Any, procs: list[subprocess.Popen]) -> None:
    """Until every other rank has reached the store: a rank that exits first (a broken install, no
    such device) fails the start at once, instead of init_process_group waiting out its timeout."""
    keys = [_joined_key(rank) for rank in range(1, len(procs) + 1)]
    deadline = time.monotonic() + _COLLECTIVE_TIMEOUT.total_seconds()
    while not store.check(keys):
        for rank, p in enumerate(procs, start=1):
            if p.poll() is not None:
                raise RuntimeError(f"tensor-parallel rank {rank} exited with code {p.returncode} while starting; "
                                   "see its log above")
        if time.monotonic() > deadline:
            raise RuntimeError(f"tensor-parallel ranks did not start within {_COLLECTIVE_TIMEOUT}")
        time.sleep(0.05)


def _joined_key(rank: int) -> str:
    return f"graphserve/rank{rank}/started"


def _exit_reason(rank: int, process: subprocess.Popen) -> str:
    return f"tensor-parallel rank {rank} (pid {process.pid}) exited with code {process.returncode}"


def beat_key(rank: int) -> str:
    """Where rank > 0 sets its heartbeat (service/engine/rank_main.py) and rank 0's watch reads it."""
    return f"graphserve/rank{rank}/beat"
