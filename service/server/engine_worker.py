"""The engine process: loads the model, runs the engine loop and the graph cache, talks over a pipe.

The gRPC process does the network and the engine process does the device; each has its own GIL,
so 64 streams of message writing no longer take turns with the engine's per-step Python. Messages
are plain tuples whose first item is a tag (below). Per step the engine sends one "events"
message with every token delta of that step, so the gRPC process wakes once per step, not once
per token. The engine's metrics stay here (EngineMetrics observes the engine on its thread); the
gRPC process reads their families when Prometheus scrapes it.

The worker ignores SIGINT and SIGTERM: the gRPC process owns the shutdown (drain first) and sends
"stop". When the pipe closes (the gRPC process died) the worker stops the same way; while it is
still loading, a watcher notices the gRPC process is gone and exits at once.

The pipe thread only reads: replies are sent from another thread. If it also sent, a full pipe
towards the gRPC process (its loop busy) would stop it reading, the gRPC process would then block
sending to it, and neither side would read again.
"""

from __future__ import annotations

import concurrent.futures
import os
import pickle
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from service.server.gil import shorten_switch_interval  # torch-free, like everything imported at the top here
from service.telemetry.engine_metrics import EngineMetrics

# Parent -> worker
SUBMIT, ABORT, PAUSE, CALL, STOP = "submit", "abort", "pause", "call", "stop"
# Worker -> parent
READY, LOAD_FAILED, EVENTS, STATUS, RESULT, STOPPED = "ready", "load_failed", "events", "status", "result", "stopped"
# Event kinds inside an EVENTS message: (kind, key, payload)
DELTA, FINISH, ERROR = "d", "f", "e"

# Calls the gRPC process may make: reads (the engine's metric families, the graph cache's snapshot,
# every tensor-parallel rank's graph memory) run on the worker's reply thread, graph-cache
# operations on the engine thread between two steps.
READS = frozenset({"metrics", "snapshot", "lora_snapshot", "rank_memory", "kv_state"})
GRAPH_OPS = frozenset({"capture", "evict", "set_budget", "reset_stats", "persisted_stats", "budget_bytes",
                       "used_bytes", "total_memory"})
# Capture and evict kinds that name the LoRA graph cache's graphs ("full+lora", "piecewise+lora").
LORA_SUFFIX = "+lora"
# Adapter operations: a load's files are read on a thread of their own (one load at a time), the
# registry changes on the engine thread between two steps (a load costs the engine one short call,
# not the disk read).
ADAPTER_OPS = frozenset({"load_adapter", "unload_adapter", "list_adapters"})

_STATUS_INTERVAL_S = 0.2
_RANK_DEATH_GRACE_S = 10.0


@dataclass(frozen=True)
class WorkerSpec:
    config: Any  # ServeConfig
    faults: Any  # Faults
    # Taken in the gRPC process: the worker may start after that process already died (and it was
    # re-parented), so its own os.getppid() at start would not tell.
    parent_pid: int = field(default_factory=os.getpid)


@dataclass(frozen=True)
class WorkerReady:
    """What the gRPC process needs to serve: the model's description and the graph cache's shape."""

    model_path: str
    spec: Any  # ModelSpec
    max_seq_len: int
    device: str
    dtype: str
    graph_config: Any  # GraphCacheConfig
    graph_mode: str
    graphs_device: str
    has_graph_backend: bool
    adapters: tuple[str, ...] = ()  # loaded at start (--lora-modules)
    max_loras: int = 0  # adapter slots; 0: adapters are off
    max_lora_rank: int = 0


@dataclass(frozen=True)
class WorkerStatus:
    """The engine's counters, sent with every step and every _STATUS_INTERVAL_S."""

    received: int  # submits the worker has handed to the engine
    received_tokens: int
    num_running: int
    num_free_slots: int
    kv_blocks_used: int
    kv_blocks_total: int
    num_waiting: int
    waiting_prompt_tokens: int
    has_work: bool
    last_progress: float  # time.monotonic(), the same clock in both processes
    error: str | None


class _KeySink:
    """The engine's sink for one request: it only names the request; `_Publisher` ships the event."""

    __slots__ = ("key",)

    def __init__(self, key: str) -> None:
        self.key = key

    def __call__(self, event: Any) -> None:  # never called: the publisher reads .key instead
        raise AssertionError("events leave through the publisher")


class _Worker:
    def __init__(self, conn: Any, spec: WorkerSpec) -> None:
        self.conn = conn
        self.spec = spec
        self.send_lock = threading.Lock()
        self.engine: Any = None
        self.graphs: Any = None
        self.runner: Any = None  # LoadedRunner
        self.metrics = EngineMetrics(model_name=spec.config.model_name)
        self.received = 0
        self.received_tokens = 0
        self.replies = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="graphserve-reply")
        self.adapter_reads = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="graphserve-adapter-read")

    def send(self, message: tuple, with_status: bool = False) -> None:
        """Send a message; with_status appends the engine's counters, taken under the send lock so
        that statuses reach the gRPC process in the order they were taken."""
        with self.send_lock:
            self.conn.send((*message, self.status()) if with_status else message)

    def status(self) -> WorkerStatus:
        e = self.engine
        error = None if e.error is None else repr(e.error)
        if error is None and not e.thread_alive:
            error = "the engine thread stopped"
        used, total = e.kv_cache_usage
        return WorkerStatus(self.received, self.received_tokens, e.num_running, e.num_free_slots, used, total,
                            e.num_waiting,
                            e.waiting_prompt_tokens, e.has_pending_work(), e.last_progress, error)

    # ---- engine thread ------------------------------------------------------------------------

    def publish(self, pairs: list[tuple[Any, Any]]) -> None:
        self.send((EVENTS, encode_events(pairs)), with_status=True)

    # ---- start --------------------------------------------------------------------------------

    def load(self) -> WorkerReady:
        from service.engine.builder import load_runner, new_engine
        from service.server.faults import wrap_decode
        from service.telemetry.log import route_library_logs

        c, faults = self.spec.config, self.spec.faults
        if faults.load_delay_s:  # a slow load, as a big checkpoint would be (tests only)
            time.sleep(faults.load_delay_s)
        lr = load_runner(c)
        route_library_logs()  # transformers is imported now: its log lines go through structlog
        if faults.decode_raise_after is not None:
            wrap_decode(lr.runner, faults.decode_raise_after)
        self.graphs = graphs = lr.graphs
        self.runner = lr
        self.engine = new_engine(c, lr, publish=self.publish, observer=self.metrics)
        graphs.on_capture_stall = self.metrics.graph_capture_stall.observe
        caches = lr.runner.graph_caches
        self.metrics.capturing = lambda: any(cache.capturing for cache in caches)
        if lr.runner.ranks is not None:
            lr.runner.ranks.on_death = self.on_rank_death
        loaded = lr.loaded
        return WorkerReady(
            model_path=str(loaded.path), spec=loaded.spec, max_seq_len=lr.max_seq_len, device=str(loaded.device),
            dtype=str(loaded.dtype).removeprefix("torch."), graph_config=graphs.config, graph_mode=lr.mode.value,
            graphs_device=str(graphs.device), has_graph_backend=graphs.backend is not None,
            adapters=tuple(lr.adapters.names) if lr.adapters is not None else (), max_loras=c.lora_slots,
            max_lora_rank=c.max_lora_rank if lr.adapters is not None else 0,
        )

    def on_rank_death(self) -> None:
        """A tensor-parallel rank died: the engine fails at its next step boundary. A step stuck in a
        collective with the dead rank may not get there: then this process exits, as a dead engine."""
        self.engine.wake()

        def exit_if_stuck() -> None:
            time.sleep(_RANK_DEATH_GRACE_S)
            if self.engine.thread_alive and self.engine.error is None:
                self.runner.runner.ranks.kill()  # no rank outlives this process
                os._exit(1)

        threading.Thread(target=exit_if_stuck, name="graphserve-rank-death", daemon=True).start()

    # ---- pipe thread --------------------------------------------------------------------------

    def serve(self) -> None:
        while True:
            try:
                message = self.conn.recv()
            except (EOFError, OSError):
                return  # the gRPC process is gone
            tag = message[0]
            if tag == SUBMIT:
                _, key, request = message
                self.received += 1
                self.received_tokens += len(request.prompt_token_ids)
                try:
                    self.engine.submit(request, _KeySink(key), key=key)
                except Exception as exc:  # noqa: BLE001 - EngineStopped: the stream must still end
                    self.replies.submit(self.send, (EVENTS, [(ERROR, key, f"the engine is not running ({exc})")]),
                                        True)
            elif tag == ABORT:
                self.engine.abort(message[1])
            elif tag == PAUSE:
                self.engine.pause(message[1], message[2])
            elif tag == CALL:
                self.call(*message[1:])
            elif tag == STOP:
                return

    def call(self, call_id: int, name: str, args: tuple) -> None:
        if name in READS:  # the snapshot may wait for the graph cache's lock (a capture): not on this thread
            self.replies.submit(self._reply, call_id, lambda: self._read(name, args))
        elif name in GRAPH_OPS:
            future = self.engine.call(lambda: self._graph_op(name, args))
            # The callback runs where the future completes: here, if the engine has stopped.
            future.add_done_callback(lambda f: self._reply_when_done(call_id, f))
        elif name == "reset_prefix_cache":
            future = self.engine.call(self.engine.scheduler.reset_prefix_cache)
            future.add_done_callback(lambda f: self._reply_when_done(call_id, f))
        elif name == "load_adapter":  # reads files: on its own thread, so list and unload never queue behind it
            self.adapter_reads.submit(self._adapter_op, call_id, name, args)
        elif name in ADAPTER_OPS:  # only queues a call on the engine thread
            self._adapter_op(call_id, name, args)
        else:
            self.replies.submit(self.send, (RESULT, call_id, False, ValueError(f"unknown engine call {name!r}")))

    def _adapter_op(self, call_id: int, name: str, args: tuple) -> None:
        """On the adapter thread: read the files (load), then change the registry on the engine thread."""
        lr = self.runner
        try:
            if name == "load_adapter":
                adapter = lr.read_adapter(*args, remote=True)
                future = self.engine.call(lambda: (lr.adapters.register(adapter), _info(lr, adapter.name))[1])
            elif lr.adapters is None:
                from service.engine.adapters import AdaptersOff

                future = concurrent.futures.Future()
                future.set_result([]) if name == "list_adapters" else future.set_exception(AdaptersOff())
            elif name == "unload_adapter":
                future = self.engine.call(lambda: lr.adapters.unregister(*args))
            else:
                future = self.engine.call(lr.adapters.list)
        except Exception as exc:  # noqa: BLE001 - the caller gets it as its call's exception
            future = concurrent.futures.Future()
            # Without its traceback: the frames it holds (a refused adapter's tensors) go now, not at a gc.
            future.set_exception(exc.with_traceback(None))
        future.add_done_callback(lambda f: self._reply_when_done(call_id, f))

    def _read(self, name: str, args: tuple) -> Any:
        if name == "metrics":
            return self.metric_families()
        if name == "lora_snapshot":
            lora_graphs = self.runner.lora_graphs
            return None if lora_graphs is None else lora_graphs.snapshot()
        if name == "rank_memory":
            return self.runner.runner.rank_memory()
        if name == "kv_state":
            return self.engine.scheduler.block_stats()
        return getattr(self.graphs, name)(*args)

    def metric_families(self) -> list[Any]:
        """The engine's metrics for a scrape of the gRPC process. The gauges (with the KV-cache usage
        and the adapters of running and waiting requests) are set from the engine's state first:
        on_step comes after a step's events went out, so a client that saw its stream end could
        otherwise scrape the counts of the step before."""
        e = self.engine
        self.metrics.set_queue(e.num_running, e.num_waiting)
        self.metrics.set_kv_cache_usage(*e.kv_cache_usage)
        blocks = e.scheduler.block_stats()
        self.metrics.set_kv_blocks(blocks.used, blocks.free, blocks.cached, blocks.prefix_queries, blocks.prefix_hits,
                                   blocks.preemptions)
        adapters = self.runner.adapters
        if adapters is not None:
            self.metrics.set_lora_requests(*adapters.request_adapters(), max_lora=adapters.max_loras)
        stats = self.graphs.stats
        self.metrics.set_stats_saves(stats.save_failures, stats.save_stalled)
        return self.metrics.families()

    def _graph_op(self, name: str, args: tuple) -> Any:
        g, lora = self.graphs, self.runner.lora_graphs
        if name == "budget_bytes":
            return g.budget_bytes
        if name == "used_bytes":  # what counts against the one budget: the LoRA cache's graphs too
            return g.used_bytes + (lora.used_bytes if lora is not None else 0)
        if name == "total_memory":
            return g.backend.total_memory() if g.backend is not None else None
        # Capture, evict and set_budget finish on the capture thread: never wait here.
        if name in ("capture", "evict"):
            sizes, kind = args
            if kind.endswith(LORA_SUFFIX):  # "full+lora": the graphs of steps with adapter rows
                if lora is None:
                    raise ValueError("this server has no adapter slots (start with --max-loras or --lora-modules)")
                g, kind = lora, kind.removesuffix(LORA_SUFFIX)
            return getattr(g, f"{name}_async")(sizes, kind)
        if name == "set_budget":
            return _budget_results(g.set_shared_budget_async(*args), lora is not None)
        return getattr(g, name)(*args)

    def _reply_when_done(self, call_id: int, future: concurrent.futures.Future) -> None:
        """Reply with the call's result; an operation that finishes on the capture thread returned a
        future of its own, whose result is the reply."""
        if not future.cancelled() and future.exception() is None and isinstance(future.result(),
                                                                                 concurrent.futures.Future):
            future.result().add_done_callback(lambda inner: self._reply_when_done(call_id, inner))
            return
        self.replies.submit(self._reply, call_id, future.result)

    def _reply(self, call_id: int, fn: Any) -> None:
        try:
            value, ok = fn(), True
        except Exception as exc:  # noqa: BLE001 - the caller gets it as its call's exception
            value, ok = exc, False
            try:  # an exception that pickles but does not unpickle would break the gRPC process's reader
                pickle.loads(pickle.dumps(value))
            except Exception:  # noqa: BLE001
                value = RuntimeError(f"{type(exc).__name__}: {exc}")
        try:
            self.send((RESULT, call_id, ok, value))
        except Exception as exc:  # noqa: BLE001 - e.g. an exception that does not pickle
            self.send((RESULT, call_id, False, RuntimeError(f"{type(value).__name__}: {value} ({exc})")))

    def report_status(self, stop: threading.Event) -> None:
        while not stop.wait(_STATUS_INTERVAL_S):
            try:
                self.send((STATUS,), with_status=True)
            except (OSError, EOFError, ValueError):
                return

    def shutdown(self) -> bool:
        """Stop the engine and save the stats; returns whether the stats were saved."""
        from service.engine.builder import close_engine

        saved = close_engine(self.engine, self.runner.runner.graph_caches)
        self.adapter_reads.shutdown(wait=False)
        return saved


def _budget_results(futures: list[concurrent.futures.Future], with_lora: bool) -> concurrent.futures.Future:
    """One future of the base and LoRA caches' evictions (set_shared_budget_async's futures, base
    first), keyed (size, kind) with the LoRA graphs' kinds "full+lora" / "piecewise+lora"."""
    suffixes = ["", LORA_SUFFIX] if with_lora else [""]
    merged: concurrent.futures.Future = concurrent.futures.Future()
    lock = threading.Lock()

    def on_done(_: concurrent.futures.Future) -> None:
        with lock:
            if merged.done() or not all(f.done() for f in futures):
                return
            try:
                merged.set_result({(k.padded_size, k.mode.value + suffix): r
                                   for f, suffix in zip(futures, suffixes, strict=True) for k, r in f.result().items()})
            except Exception as exc:  # noqa: BLE001 - the caller gets it as its call's exception
                merged.set_exception(exc)

    for f in futures:
        f.add_done_callback(on_done)
    return merged


def _info(lr: Any, name: str) -> Any:
    return next(a for a in lr.adapters.list() if a.name == name)


def _exit_when_orphaned(parent_pid: int) -> None:
    """The pipe tells a serving worker that the gRPC process died; a loading one is not reading it,
    and would hold device memory until the load ends."""
    while os.getppid() == parent_pid:
        time.sleep(0.5)
    os._exit(1)


def worker_main(conn: Any, spec: WorkerSpec) -> None:
    """The engine process's entry point (multiprocessing, spawn)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    shorten_switch_interval()  # the pipe reader must not wait 5 ms behind the engine thread per request
    threading.Thread(target=_exit_when_orphaned, args=(spec.parent_pid,), name="graphserve-orphan-watch",
                     daemon=True).start()
    from service.telemetry.log import configure_logging

    configure_logging(spec.config.log_format, spec.config.log_level)
    import structlog

    log = structlog.get_logger("graphserve.engine_worker")
    worker = _Worker(conn, spec)
    try:
        ready = worker.load()
    except BaseException as exc:  # noqa: BLE001 - reported to the gRPC process, which decides the exit code
        from service.model.spec import ModelLoadError

        kind = "model" if isinstance(exc, ModelLoadError) else "error"
        message = str(exc) if kind == "model" else f"{type(exc).__name__}: {exc}"
        if kind == "error":
            log.error("engine_load_failed", error=message, exc_info=True)
        try:
            conn.send((LOAD_FAILED, kind, message))
        finally:
            os._exit(0)
    worker.engine.start()
    worker.send((READY, ready))
    stop = threading.Event()
    threading.Thread(target=worker.report_status, args=(stop,), name="graphserve-status", daemon=True).start()
    try:
        worker.serve()
    finally:
        stop.set()
        saved = worker.shutdown()
        try:
            worker.send((STATUS,), with_status=True)
            worker.send((STOPPED, saved))
        except (OSError, EOFError, ValueError):
            pass
        worker.replies.shutdown(wait=False)
        conn.close()


def encode_events(pairs: list[tuple[Any, Any]]) -> list[tuple[str, str, Any]]:
    """A step's (sink, event) pairs as the pipe carries them: a delta as a plain tuple, a finish or
    an error as itself (an error's type, e.g. AdapterGone, decides the gRPC status)."""
    from service.engine.request import Finish, TokenDelta

    events = []
    for sink, event in pairs:
        if isinstance(event, TokenDelta):
            events.append((DELTA, sink.key, (event.token_ids, event.text, event.logprobs, event.prompt_logprobs)))
        else:
            events.append((FINISH if isinstance(event, Finish) else ERROR, sink.key, event))
    return events
