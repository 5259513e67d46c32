"""A follower rank's process (tensor parallelism, rank > 0): `python -m service.engine.rank_main`.

Rank 0 starts it (service/engine/ranks.py, start_ranks) with the rank, the world size, the port of
the group's store, rank 0's pid and whether to arm a parent-death signal as arguments, and the
config on stdin. It joins the group, loads its shards into a runner that follows rank 0's graphs,
then runs rank 0's steps until rank 0 says stop. Beside that loop it sets a heartbeat in the store
each second (rank 0 kills a rank that misses them) and exits when rank 0 is gone.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import pickle
import signal
import sys
import threading
import time
from typing import Any

import structlog
import torch

from service.engine.builder import build_runner
from service.engine.rank_memory import MemoryPublisher
from service.engine.ranks import beat_key, group_store, join_group, rank_device, store_connection
from service.engine.roles import Follower
from service.engine.runner import ModelRunner
from service.engine.step_channel import StepChannel, StepInputs
from service.telemetry.log import configure_logging

log = structlog.get_logger("graphserve.ranks")

_BEAT_INTERVAL_S = 1.0
_PR_SET_PDEATHSIG = 1  # prctl(2)


def follow(rank: int, world_size: int, port: int, c: Any, device_type: str) -> None:
    """Join the group, load this rank's shards, then run rank 0's steps until it stops."""
    device = rank_device(torch.device(device_type), rank)
    store = group_store(rank, world_size, port)
    tp, channel_group = join_group(rank, world_size, port, device, store=store)
    lr = build_runner(c, device, tp, follower=True)
    channel = StepChannel(channel_group, StepInputs.capacity(c.max_running_seqs, c.max_num_batched_tokens, c.block_size))
    log.info("rank_ready", rank=rank, device=str(device))
    follow_steps(lr.runner, channel, MemoryPublisher(store, rank, device))
    log.info("rank_stopped", rank=rank)


def follow_steps(runner: ModelRunner, channel: StepChannel, memory: MemoryPublisher | None = None) -> None:
    """Run rank 0's steps (and graph operations) with `runner` until it stops; `memory` publishes the
    mirror's bytes at the start and after each message with graph operations."""
    follower = runner.role
    assert isinstance(follower, Follower), "a follower's runner mirrors rank 0's graphs (ModelRunner.follow)"
    mirror = follower.mirror
    publish = memory.publish if memory is not None else lambda graph_bytes: None
    publish(mirror.held_bytes)
    previous = torch.zeros(0, dtype=torch.long, device=runner.device)
    with torch.inference_mode():
        while (inputs := channel.recv()) is not None:
            if not inputs.runs_forward:  # graph operations decided between steps
                mirror.apply(inputs.graph_ops)
                publish(mirror.held_bytes)
                continue
            runner.forward(inputs, previous)
            if inputs.num_sampling:  # rank 0's sampled tokens, which the next step may feed back
                previous = runner.tp.broadcast(torch.empty(inputs.num_sampling, dtype=torch.long, device=runner.device))
            if inputs.graph_ops:  # run before the forward; published after its collectives, not between them
                publish(mirror.held_bytes)


def _exit_when_orphaned(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(0.5)
    os._exit(1)


def _die_with_parent(parent_pid: int) -> None:
    """Linux: SIGKILL from the kernel when the parent's thread that started this process ends."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent_pid:  # it ended before the signal was armed
        os._exit(1)


def _beat(rank: int, port: int) -> None:
    """Sets this rank's heartbeat each second, on a store connection of its own."""
    store = store_connection(port)
    count = 0
    while True:
        count += 1
        store.set(beat_key(rank), str(count))
        time.sleep(_BEAT_INTERVAL_S)


def main(argv: list[str]) -> None:
    rank, world_size, port, parent_pid, pdeathsig = (int(a) for a in argv)
    if pdeathsig:
        _die_with_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # rank 0 owns the shutdown
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    threading.Thread(target=_exit_when_orphaned, args=(parent_pid,), daemon=True).start()
    threading.Thread(target=_beat, args=(rank, port), name="graphserve-rank-beat", daemon=True).start()
    c, device_type = pickle.loads(sys.stdin.buffer.read())
    configure_logging(c.log_format, c.log_level)
    try:
        follow(rank, world_size, port, c, device_type)
    except BaseException as exc:  # noqa: BLE001 - rank 0 sees the exit and fails its engine
        log.error("rank_failed", rank=rank, error=repr(exc))
        os._exit(1)
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1:])
