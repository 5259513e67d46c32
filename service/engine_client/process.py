"""The gRPC process's handle on the engine process (see worker.py): an `EngineClient` over a pipe
whose messages are messages.py's; `request` sends a typed call (calls.py), which runs itself in the
engine process, and waits for its reply. The event loop itself reads the pipe (`loop.add_reader`):
each step's message becomes (sink, event) pairs delivered at once. No reader thread: a second
Python thread in this process would wait for the GIL behind the loop, the pipe would fill, and the
engine would stall. The engine's metrics are not sent per step: a scrape asks for them.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import multiprocessing
import multiprocessing.connection
import pathlib
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import structlog

from service.engine.interfaces import EngineStopped, Sink, deliver
from service.engine.kv_events import from_wire
from service.engine.request import EngineError, GenerationRequest, TokenDelta
from service.engine_client.calls import EngineCall
from service.engine_client.client import EngineFacts
from service.engine_client.messages import (
    DELTA,
    FINISH,
    KV,
    Abort,
    Call,
    Events,
    LoadFailed,
    Pause,
    Reply,
    Stop,
    Stopped,
    Submit,
    ToWorker,
    WorkerSpec,
    WorkerStatus,
)
from service.engine_client.spawn import take_process
from service.model.spec import ModelLoadError

log = structlog.get_logger("graphserve.engine_process")

T = TypeVar("T")

# The engine process sends its status every 0.2 s: silence this long means it is hung (or stopped).
_SILENT_S = 2.0


class EngineStartError(RuntimeError):
    """The engine process could not start (no such device, a crash while loading, ...)."""


class EngineProcess:
    """An EngineClient whose engine runs in an engine process of its own; `facts` and
    `adapter_names` are there once `start` returned."""

    def __init__(self, spec: WorkerSpec, loop: asyncio.AbstractEventLoop,
                 on_kv_events: Callable[[Any], None] | None = None) -> None:
        self._spec = spec
        self.process: Any = None  # the engine process, once start() began
        self._conn: Any = None
        self.loop = loop
        self._lock = threading.Lock()  # guards sends and the tables below
        self._sinks: dict[str, Sink] = {}
        self._keys = itertools.count()
        self._submitted = 0
        self._submitted_tokens = 0
        # Until the engine's first status: idle, every slot free.
        self._status = WorkerStatus(0, 0, 0, spec.config.max_running_seqs, 0, 0, 0, 0, False, time.monotonic(), None)
        self._calls: dict[int, concurrent.futures.Future] = {}
        self._call_ids = itertools.count()
        self._ops = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="graphserve-engine-call")
        self._reading = False
        self._exited = threading.Event()
        self._ready = False
        self._stopping = False
        self.error: BaseException | None = None
        self.last_progress = time.monotonic()
        self.stats_saved = False  # the engine process said so as it stopped
        self._last_message_at = time.monotonic()
        self.on_kv_events = on_kv_events  # each step's KvEventBatch, on the event loop
        self.facts: EngineFacts | None = None
        self.adapter_names: set[str] = set()

    # ---- start --------------------------------------------------------------------------------

    def start(self) -> EngineFacts:
        """Start the engine process and wait until its model is loaded (blocking: call it off the event
        loop). Raises ModelLoadError when the model cannot be loaded, EngineStartError otherwise."""
        self.process, self._conn = take_process()
        log.info("engine_process_started", pid=self.process.pid)
        try:
            self._conn.send(self._spec)
        except OSError:  # it died while importing: the reads below say so
            pass
        while True:
            try:
                if not self._conn.poll(0.5):
                    if self.process.is_alive():
                        continue
                    raise EOFError
                message = self._conn.recv()
            except (EOFError, OSError):
                self.process.join(5)
                raise EngineStartError(f"the engine process exited with code {self.process.exitcode} while "
                                       "loading; see its log above") from None
            if isinstance(message, EngineFacts):
                break
            if isinstance(message, LoadFailed):
                self.process.join(10)
                raise ModelLoadError(message.message) if message.model else EngineStartError(message.message)
        self.facts, self.adapter_names = message, set(message.adapters)
        with self._lock:
            self._ready = not self._stopping
        self.loop.call_soon_threadsafe(self._start_reading)
        return message

    # ---- what the servicers use ---------------------------------------------------------------

    @property
    def alive(self) -> bool:
        return self._ready and self.error is None and self.process.is_alive()

    @property
    def num_running(self) -> int:
        return self._status.num_running

    @property
    def num_free_slots(self) -> int:
        return self._status.num_free_slots

    @property
    def kv_cache_usage(self) -> tuple[int, int]:
        """(used, total) KV blocks as of the engine's last status."""
        return self._status.kv_blocks_used, self._status.kv_blocks_total

    @property
    def num_waiting(self) -> int:
        """The engine's queue plus the submits it has not received yet, less the free slots that
        those will take: a burst to an idle server fills the slots first, then the queue."""
        s = self._status
        return max(0, s.num_waiting + max(0, self._submitted - s.received) - s.num_free_slots)

    def waiting_after(self, samples: int) -> int:
        """Requests that would wait if `samples` more were submitted now (those that find a free slot do not)."""
        s = self._status
        return max(0, s.num_waiting + max(0, self._submitted - s.received) + samples - s.num_free_slots)

    @property
    def waiting_prompt_tokens(self) -> int:
        s = self._status
        return s.waiting_prompt_tokens + max(0, self._submitted_tokens - s.received_tokens)

    @property
    def responsive(self) -> bool:
        """The engine process spoke recently (a hung one would not read what is sent to it either)."""
        return time.monotonic() - self._last_message_at < _SILENT_S

    def has_pending_work(self) -> bool:
        """Work the engine should be making progress on: streams paused for back-pressure are not."""
        s = self._status
        return bool(self._calls or s.has_work or self._submitted > s.received)

    def submit(self, request: GenerationRequest, sink: Sink) -> str:
        with self._lock:
            if not self._ready or self.error is not None or self._stopping:
                raise EngineStopped("the engine is not running")
            key = f"{request.request_id}#{next(self._keys)}"
            self._sinks[key] = sink
            self._submitted += 1
            self._submitted_tokens += len(request.prompt_token_ids)
            self._send(Submit(key, request))
        return key

    def abort(self, key: str) -> None:
        with self._lock:
            if self._ready and self.error is None:
                self._send(Abort(key))

    def pause(self, key: str, paused: bool) -> None:
        with self._lock:
            if self._ready and self.error is None:
                self._send(Pause(key, paused))

    def call(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        """Run fn on a thread of this process, one call at a time; fn reaches the engine through `request`."""
        if not self.alive or self._stopping:
            future: concurrent.futures.Future = concurrent.futures.Future()
            future.set_exception(RuntimeError("the engine is not running"))
            return future
        return self._ops.submit(fn)

    def request(self, call: EngineCall[T], timeout: float | None = None) -> T:
        """The engine process's reply to `call` (which runs itself there); blocking, so never on the
        event loop, which is the thread that reads the reply."""
        if self._on_loop():
            raise RuntimeError("EngineProcess.request blocks: call it off the event loop")
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if not self._ready or self.error is not None or self._stopping:
                raise RuntimeError("the engine is not running")
            call_id = next(self._call_ids)
            self._calls[call_id] = future
            self._send(Call(call_id, call))
        try:
            reply = future.result(call.timeout_s if timeout is None else timeout)
        finally:
            with self._lock:
                self._calls.pop(call_id, None)
        call.on_reply(self, reply)
        return reply

    def stop(self, timeout: float = 10.0) -> bool:
        """Stop the engine process: running requests end with an EngineError, the graph cache saves
        its stats and frees its graphs. Kills the process if it does not exit within `timeout`.
        Returns whether it stopped cleanly with its stats saved (True for one stopped while loading:
        nothing to save)."""
        with self._lock:
            self._stopping = True
            ready = self._ready

        def send_stop() -> None:
            # On a thread of its own: to a hung engine with a full pipe the send blocks until the kill.
            with self._lock:
                try:
                    self._send(Stop())
                except OSError:
                    pass

        if ready and self.process.is_alive():
            threading.Thread(target=send_stop, name="graphserve-engine-stop", daemon=True).start()
        if self.process is None:  # never started
            return True
        if not self._ready:  # still loading: nothing to save, do not wait for the load
            self.process.kill()
            self.process.join(5)
            self._ops.shutdown(wait=False, cancel_futures=True)
            return True
        # The sentinel, not is_alive(): another thread's is_alive() may reap the process first, and
        # then a racing is_alive() here reports a process that has exited as alive.
        killed = not multiprocessing.connection.wait([self.process.sentinel], timeout)
        if killed:
            log.warning("engine_process_kill", reason=f"did not stop within {timeout:g} s (--engine-stop-timeout)")
            self.process.kill()
        self.process.join(5)
        self._exited.wait(5)  # the loop has read the last events
        self._ops.shutdown(wait=False, cancel_futures=True)
        if not killed and not self.stats_saved:
            log.warning("engine_stats_not_saved")
        return not killed and self.stats_saved

    def _on_loop(self) -> bool:
        try:
            return asyncio.get_running_loop() is self.loop
        except RuntimeError:
            return False

    # ---- pipe ------------------------------------------------------------------------

    def _send(self, message: ToWorker) -> None:
        self._conn.send(message)  # the caller holds self._lock

    def _start_reading(self) -> None:
        self._reading = True
        self.loop.add_reader(self._conn.fileno(), self._on_readable)

    def _on_readable(self) -> None:
        """On the event loop: every message that has arrived, in order."""
        try:
            while self._conn.poll():
                message = self._conn.recv()
                self._last_message_at = time.monotonic()
                match message:
                    case Events():  # a step's: its events, then the counters after it
                        self._on_events(message.events)
                        self._on_status(message)
                    case WorkerStatus():
                        self._on_status(message)
                    case Stopped(saved):
                        self.stats_saved = saved
                    case Reply(call_id, ok, value):
                        with self._lock:
                            future = self._calls.pop(call_id, None)
                        if future is not None:
                            future.set_result(value) if ok else future.set_exception(value)
        except (EOFError, OSError):
            self._stop_reading()
        except BaseException:  # noqa: BLE001 - a broken message must not leave streams hanging
            log.error("engine_reader_failed", exc_info=True)
            self._stop_reading()

    def _stop_reading(self) -> None:
        if self._reading:
            self._reading = False
            self.loop.remove_reader(self._conn.fileno())
            self._on_exit()

    def _on_events(self, events: list[tuple]) -> None:
        pairs: list[tuple[Sink, Any]] = []
        kv = []
        with self._lock:
            for kind, key, payload in events:
                if kind == KV:
                    kv.append(from_wire(payload))
                    continue
                sink = self._sinks.get(key) if kind == DELTA else self._sinks.pop(key, None)
                if sink is None:
                    continue
                if kind == DELTA:
                    pairs.append((sink, TokenDelta(*payload)))
                elif kind == FINISH:
                    pairs.append((sink, payload))
                else:
                    pairs.append((sink, payload if isinstance(payload, EngineError) else EngineError(payload)))
        if pairs:
            deliver(pairs)
        for batch in kv if self.on_kv_events is not None else ():
            self.on_kv_events(batch)

    def _on_status(self, status: WorkerStatus) -> None:
        self._status = status
        self.last_progress = status.last_progress
        if status.error is not None and self.error is None and not self._stopping:
            self.error = RuntimeError(status.error)

    def _on_exit(self) -> None:
        """The pipe closed: the engine process exited. Every open stream and call ends now."""
        self.process.join(0.5)
        with self._lock:
            if self.error is None and not self._stopping:
                self.error = RuntimeError(f"the engine process exited with code {self.process.exitcode}")
            sinks, self._sinks = self._sinks, {}
            calls, self._calls = self._calls, {}
        message = "the server is shutting down" if self.error is None else (
            f"the engine failed: {self.error}; the server is shutting down")
        for future in calls.values():
            future.set_exception(RuntimeError(message))
        deliver([(sink, EngineError(message)) for sink in sinks.values()])
        self._exited.set()


def read_tokenizer_early(model: str, cache_dir: pathlib.Path | None) -> tuple[str, Any] | None:
    """(its path, the tokenizer) of a model already on disk, read while the engine process loads the
    model; None where that cannot be done now (the tokenizer is then read once the engine is ready,
    and any error said from there)."""
    from service.model.loader import existing_model_dir

    try:
        path = existing_model_dir(model, cache_dir)
        return (str(path), read_tokenizer(str(path))) if path is not None else None
    except Exception:  # noqa: BLE001 - read again, and reported, after the engine loaded
        return None


def read_tokenizer(path: str) -> Any:
    from service.model.loader import read_tokenizer as read
    from service.telemetry.log import route_library_logs

    tokenizer = read(pathlib.Path(path))
    route_library_logs()
    return tokenizer
