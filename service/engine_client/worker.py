"""The engine process: loads the model, runs the engine loop and the graph cache, talks over a pipe.

The gRPC process does the network and the engine process does the device; each has its own GIL,
so 64 streams of message writing no longer take turns with the engine's per-step Python. The
messages are messages.py's. Per step the engine sends one `Events` message with every
token delta of that step, so the gRPC process wakes once per step, not once per token. The
engine's metrics stay here (EngineMetrics observes the engine on its thread); the gRPC process
reads their families when Prometheus scrapes it. Its typed calls (calls.py) run themselves here.

The worker ignores SIGINT and SIGTERM: the gRPC process owns the shutdown (drain first) and sends
`Stop`. When the pipe closes (the gRPC process died) the worker stops the same way; while it is
still loading, a watcher notices the gRPC process is gone and exits at once.

The pipe thread only reads: replies are sent from another thread. If it also sent, a full pipe
towards the gRPC process (its loop busy) would stop it reading, the gRPC process would then block
sending to it, and neither side would read again.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import pickle
import signal
import threading
import time
from typing import Any

from service.engine_client.client import EngineFacts, facts_of
from service.engine_client.gil import shorten_switch_interval  # torch-free, like everything imported at the top here
from service.engine_client.host import EngineHost
from service.engine_client.messages import (
    DELTA,
    ERROR,
    FINISH,
    KV,
    Abort,
    Call,
    Events,
    FromWorker,
    LoadFailed,
    Pause,
    Reply,
    Stop,
    Stopped,
    Submit,
    WorkerSpec,
    WorkerStatus,
)
from service.telemetry import startup
from service.telemetry.engine_metrics import EngineMetrics
from service.telemetry.gc_pauses import freeze_startup_heap, watch_gc_pauses

_STATUS_INTERVAL_S = 0.2
_RANK_DEATH_GRACE_S = 10.0


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
        self.metrics = EngineMetrics(model_name=spec.config.model_name, max_seq_len=spec.config.max_seq_len,
                                     capturing=lambda: self.graphs is not None and self.graphs.capturing)
        self.received = 0
        self.received_tokens = 0
        self.replies = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="graphserve-reply")
        self.host: EngineHost | None = None  # once loaded

    def send(self, message: FromWorker) -> None:
        with self.send_lock:
            self.conn.send(message)

    def send_events(self, events: list[tuple[str, str, Any]]) -> None:
        """A step's events with the engine's counters, taken under the send lock so that statuses
        reach the gRPC process in the order they were taken."""
        with self.send_lock:
            self.conn.send(self.status(events))

    def send_status(self) -> None:
        """The engine's counters alone (every _STATUS_INTERVAL_S, and at the end)."""
        with self.send_lock:
            self.conn.send(self.status())

    def status(self, events: list[tuple[str, str, Any]] | None = None) -> WorkerStatus:
        """The engine's counters; with a step's events, that step's message."""
        e = self.engine
        error = None if e.error is None else repr(e.error)
        if error is None and not e.thread_alive:
            error = "the engine thread stopped"
        used, total = e.kv_cache_usage
        counters = (self.received, self.received_tokens, e.num_running, e.num_free_slots, used, total, e.num_waiting,
                    e.waiting_prompt_tokens, e.has_pending_work(), e.last_progress, error)
        return WorkerStatus(*counters) if events is None else Events(*counters, events)

    # ---- engine thread ------------------------------------------------------------------------

    def publish(self, pairs: list[tuple[Any, Any]]) -> None:
        self.send_events(encode_events(pairs))

    # ---- start --------------------------------------------------------------------------------

    def load(self) -> EngineFacts:
        from cache_manager import EngineHooks
        from service.engine.builder import load_runner, new_engine
        from service.engine_client.faults import wrap_decode
        from service.telemetry.log import route_library_logs

        c, faults = self.spec.config, self.spec.faults
        if faults.load_delay_s:  # a slow load, as a big checkpoint would be (tests only)
            time.sleep(faults.load_delay_s)
        lr = load_runner(c, EngineHooks(capture_stall=self.metrics.graph_capture_stall.observe), self.on_rank_death)
        route_library_logs()  # transformers is imported now: its log lines go through structlog
        if faults.decode_raise_after is not None:
            wrap_decode(lr.runner, faults.decode_raise_after)
        self.graphs = lr.graphs
        self.runner = lr
        self.engine = new_engine(c, lr, publish=self.publish, observer=self.metrics)
        self.engine.publish_kv_events(_KeySink(""))  # shipped to the gRPC process's KV event hub
        self.host = EngineHost(self.engine, lr, self.metric_families, reads=self.replies)
        blocks = self.engine.scheduler.block_stats()
        self.metrics.set_cache_config(blocks.block_size, c.kv_cache_dtype, c.prefix_caching, blocks.num_blocks)
        return facts_of(c, lr)

    def on_rank_death(self) -> None:
        """A tensor-parallel rank died: the engine fails at its next step boundary. A step stuck in a
        collective with the dead rank may not get there: then this process exits, as a dead engine.
        (While loading, there is no engine yet: the load fails with the rank's death.)"""
        if self.engine is None:
            return
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
            match message:
                case Submit(key, request):
                    self.received += 1
                    self.received_tokens += len(request.prompt_token_ids)
                    try:
                        self.engine.submit(request, _KeySink(key), key=key)
                    except Exception as exc:  # noqa: BLE001 - EngineStopped: the stream must still end
                        self.replies.submit(self.send_events, [(ERROR, key, f"the engine is not running ({exc})")])
                case Abort(key):
                    self.engine.abort(key)
                case Pause(key, paused):
                    self.engine.pause(key, paused)
                case Call(call_id, call):
                    self._reply_when_done(call_id, self.host.start(call))
                case Stop():
                    return

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
        if blocks.host is not None:
            self.metrics.set_host_cache(blocks.host, blocks.block_size)
        if e.constraints is not None:
            self.metrics.set_constraint_masks(e.constraints.masks.sat_out_rows, e.constraints.masks.failed_rows)
        adapters = self.runner.adapters
        if adapters is not None:
            self.metrics.set_lora_requests(*adapters.request_adapters(), max_lora=adapters.max_loras)
        stats = self.graphs.stats
        self.metrics.set_stats_saves(stats.save_failures, stats.save_stalled)
        return self.metrics.families()

    def _reply_when_done(self, call_id: int, future: concurrent.futures.Future) -> None:
        # The callback runs where the future completes: on this thread, if it already has; the reply
        # is sent from the reply thread.
        future.add_done_callback(lambda f: self.replies.submit(self._reply, call_id, f.result))

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
            self.send(Reply(call_id, ok, value))
        except Exception as exc:  # noqa: BLE001 - e.g. an exception that does not pickle
            self.send(Reply(call_id, False, RuntimeError(f"{type(value).__name__}: {value} ({exc})")))

    def report_status(self, stop: threading.Event) -> None:
        while not stop.wait(_STATUS_INTERVAL_S):
            try:
                self.send_status()
            except (OSError, EOFError, ValueError):
                return

    def shutdown(self) -> bool:
        """Stop the engine and save the stats; returns whether the stats were saved."""
        from service.engine.builder import close_engine

        saved = close_engine(self.engine, self.graphs)
        self.host.close()
        return saved


def _exit_when_orphaned(parent_pid: int) -> None:
    """The pipe tells a serving worker that the gRPC process died; a loading one is not reading it,
    and would hold device memory until the load ends."""
    while os.getppid() == parent_pid:
        time.sleep(0.5)
    os._exit(1)


def worker_main(conn: Any, parent_pid: int) -> None:
    """The engine process's entry point (multiprocessing, spawn). It imports torch and the engine's
    modules first, then waits for its WorkerSpec on the pipe: the server starts it before its own
    pre-flight checks (which import the model package too), so the two imports overlap. If a check
    fails, the pipe closes and this process ends without having loaded anything. parent_pid is taken
    in the gRPC process: this one may start after that process died (and was re-parented), so its own
    os.getppid() would not tell."""
    startup.record()
    from service.engine.grammar_threads import limit_malloc_arenas

    limit_malloc_arenas()  # before any thread starts, each of which would get an arena of its own
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    shorten_switch_interval()  # the pipe reader must not wait 5 ms behind the engine thread per request
    threading.Thread(target=_exit_when_orphaned, args=(parent_pid,), name="graphserve-orphan-watch",
                     daemon=True).start()
    import cache_manager  # noqa: F401 - torch and the engine's modules, before the spec arrives
    import service.engine.builder  # noqa: F401
    import service.telemetry.log  # noqa: F401

    startup.mark("imports")
    try:
        spec: WorkerSpec = conn.recv()
    except (EOFError, OSError):  # the server did not start (a pre-flight check failed) or died
        os._exit(0)
    startup.mark("start_checks")  # waiting for the server's pre-flight checks
    from service.telemetry.log import configure_logging

    configure_logging(spec.config.log_format, spec.config.log_level)
    import structlog

    log = structlog.get_logger("graphserve.engine_worker")
    worker = _Worker(conn, spec)
    try:
        ready = worker.load()
    except BaseException as exc:  # noqa: BLE001 - reported to the gRPC process, which decides the exit code
        from service.model.spec import ModelLoadError

        model = isinstance(exc, ModelLoadError)
        message = str(exc) if model else f"{type(exc).__name__}: {exc}"
        if not model:
            log.error("engine_load_failed", error=message, exc_info=True)
        try:
            conn.send(LoadFailed(message, model))
        finally:
            os._exit(0)
    # As in the gRPC process: what loading made is out of every later collection; long pauses are logged.
    freeze_startup_heap()
    watch_gc_pauses("engine")
    worker.engine.start()
    startup.mark("engine_started")
    worker.send(dataclasses.replace(ready, startup=startup.phases()))
    stop = threading.Event()
    threading.Thread(target=worker.report_status, args=(stop,), name="graphserve-status", daemon=True).start()
    try:
        worker.serve()
    finally:
        stop.set()
        saved = worker.shutdown()
        try:
            worker.send_status()
            worker.send(Stopped(saved))
        except (OSError, EOFError, ValueError):
            pass
        worker.replies.shutdown(wait=False)
        conn.close()


def encode_events(pairs: list[tuple[Any, Any]]) -> list[tuple[str, str, Any]]:
    """A step's (sink, event) pairs as the pipe carries them: a delta as a plain tuple, a finish or
    an error as itself (an error's type, e.g. AdapterGone, decides the gRPC status), the step's KV
    events as plain tuples (kv_events.to_wire)."""
    from service.engine.kv_events import KvEventBatch, to_wire
    from service.engine.request import Finish, TokenDelta

    events = []
    for sink, event in pairs:
        if isinstance(event, TokenDelta):
            events.append((DELTA, sink.key, (event.token_ids, event.text, event.logprobs, event.prompt_logprobs)))
        elif isinstance(event, KvEventBatch):
            events.append((KV, "", to_wire(event)))
        else:
            events.append((FINISH if isinstance(event, Finish) else ERROR, sink.key, event))
    return events
