"""The running service: loads the model, starts the engine, serves gRPC, drains on SIGTERM.

Start-up order: the gRPC port opens at once with health NOT_SERVING (Kubernetes probes get an
answer while the model loads); the model loads off the event loop; one eager step runs; then
health turns SERVING. Shutdown: health NOT_SERVING, new calls UNAVAILABLE, in-flight streams get
up to --drain-timeout to finish, the rest are aborted (finish_reason abort, ended here if the engine
does not answer), the engine gets --engine-stop-timeout to stop and save the stats, else it is
killed; exit 0 only when it stopped cleanly with its stats saved.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from smg_grpc_proto.generated import vllm_engine_pb2_grpc

from service.config import ServeConfig
from service.engine.validation import Limits
from service.engine_client.calls import ReadMetrics, ReadSnapshot
from service.engine_client.client import EngineFacts
from service.engine_client.faults import Faults
from service.engine_client.messages import WorkerSpec
from service.engine_client.process import EngineProcess, EngineStartError, read_tokenizer, read_tokenizer_early
from service.model.spec import ModelLoadError
from service.proto import inference_pb2, inference_pb2_grpc
from service.server.admin_server import start_admin_server
from service.server.decoding import RequestDecodingInterceptor
from service.server.inference_servicer import InferenceServicer
from service.server.kv_event_hub import KvEventHub
from service.server.streams import AdmissionLimits, Streams
from service.server.transport import add_port
from service.server.vllm_servicer import SERVICE_NAME as VLLM_SERVICE
from service.server.vllm_servicer import ModelFacts, VllmEngineServicer
from service.telemetry import startup
from service.telemetry.gc_pauses import freeze_startup_heap, watch_gc_pauses
from service.telemetry.metrics import Metrics

log = structlog.get_logger("graphserve.app")

INFERENCE_SERVICE = inference_pb2.DESCRIPTOR.services_by_name["Inference"].full_name


async def _in_daemon_thread(fn: Callable[..., Any], *args: Any) -> Any:
    """Run blocking start-up work (model loading) off the event loop in a daemon thread, so that a
    SIGTERM during a long load can exit without waiting for it, as asyncio.to_thread would."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if future.done():  # the awaiting task was cancelled (shutdown during loading)
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    def work() -> None:
        result, error = None, None
        try:
            result = fn(*args)
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting coroutine
            error = exc
        try:
            loop.call_soon_threadsafe(settle, result, error)
        except RuntimeError:  # the loop is closed: the process is exiting
            pass

    threading.Thread(target=work, name="graphserve-load", daemon=True).start()
    return await future


class App:
    def __init__(self, config: ServeConfig, environ: dict[str, str] | None = None) -> None:
        self.config = config
        self.faults = Faults.from_env(os.environ if environ is None else environ)
        if self.faults.active:
            log.warning("test_faults_enabled", faults=str(self.faults))
        self.server: grpc.aio.Server | None = None
        self.health = health.aio.HealthServicer()
        self.metrics = Metrics()
        self.metrics_port: int | None = None
        # One set of streams behind both protocols: the limits and the drain count them all.
        self.streams = Streams(
            AdmissionLimits(config.max_waiting_requests, config.max_waiting_tokens, config.max_concurrent_streams,
                            config.stream_stall_timeout, config.max_stream_backlog_tokens,
                            config.stream_message_rate, config.max_running_seqs),
            metrics=self.metrics,
        )
        self.servicer = InferenceServicer(self.streams)
        self.kv_events = KvEventHub(config.kv_events_history, config.kv_events_buffer)  # SubscribeKvEvents'
        self.vllm_servicer = VllmEngineServicer(self.streams, self.kv_events)
        self.engine: EngineProcess | None = None
        self.model: EngineFacts | None = None  # the loaded model's description, from the engine process
        self.tokenizer: Any = None
        self.admin_server: grpc.aio.Server | None = None
        self.admin_port: int | None = None
        self.port: int | None = None
        self.ready = asyncio.Event()
        self.stopping = asyncio.Event()
        self.exit_code = 0
        self._gc_watch: Any = None
        # The entry point's start-up phases so far (none in-process), then this server's and the engine's
        self.timeline = startup.Timeline(phases=list(startup.phases()))

    # ---- start --------------------------------------------------------------------------------

    async def start(self) -> None:
        c = self.config
        options = [
            ("grpc.max_receive_message_length", c.max_receive_message_bytes),
            ("grpc.so_reuseport", 0),
            # Per connection, at most half the global cap: one connection cannot take every stream slot.
            ("grpc.max_concurrent_streams", c.streams_per_connection),
        ]
        self.server = grpc.aio.server(options=options,
                                      interceptors=[RequestDecodingInterceptor(self.metrics.undecodable)])
        inference_pb2_grpc.add_InferenceServicer_to_server(self.servicer, self.server)
        vllm_engine_pb2_grpc.add_VllmEngineServicer_to_server(self.vllm_servicer, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            (INFERENCE_SERVICE, VLLM_SERVICE, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
             reflection.SERVICE_NAME),
            self.server,
        )
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        self.port = add_port(self.server, f"{c.host}:{c.port}", c)
        await self.server.start()
        if c.metrics_port:
            self.metrics_port = self.metrics.serve(c.host, c.metrics_port)
        log.info("grpc_listening", address=f"{c.host}:{self.port}", tls=c.tls_cert is not None)
        self.timeline.mark("grpc_listening")

    async def load(self) -> None:
        """Start the engine process (it loads the model and runs one eager step), then SERVING."""
        c = self.config
        t0 = time.monotonic()
        self.engine = EngineProcess(WorkerSpec(c, self.faults), asyncio.get_running_loop(), self.kv_events.publish)
        # The tokenizer of a model already on disk is read while the engine process loads the model.
        early = asyncio.ensure_future(_in_daemon_thread(read_tokenizer_early, c.model, c.model_cache_dir))
        try:
            self.model = ready = await _in_daemon_thread(self.engine.start)
        except BaseException:
            early.cancel()
            raise
        self.timeline.merge(ready.startup, prefix="engine.")
        self.timeline.mark("engine_ready")
        read = await early
        if read is not None and read[0] == ready.model_path:
            self.tokenizer = read[1]
        else:
            self.tokenizer = await _in_daemon_thread(read_tokenizer, ready.model_path)
        self.timeline.mark("tokenizer")
        spec = ready.spec
        log.info("model_loaded", model=c.model, architecture=spec.architecture, device=ready.device,
                 dtype=ready.dtype, seconds=round(time.monotonic() - t0, 2), engine_pid=self.engine.process.pid)
        engine = self.engine
        self.metrics.set_model(c.model, spec.architecture)
        self.metrics.set_engine_source(lambda: engine.request(ReadMetrics()))
        self.metrics.set_graph_source(lambda: engine.request(ReadSnapshot()))
        self.admin_server, self.admin_port = await start_admin_server(c, engine, self.metrics)
        limits = Limits.from_config(dataclasses.replace(c, max_seq_len=ready.max_seq_len), vocab_size=spec.vocab_size)
        self.streams.attach(self.engine)
        self.servicer.attach(self.tokenizer, limits, self._model_info(ready))
        self.vllm_servicer.attach(self.tokenizer, limits, ModelFacts.read(
            c.model_name, ready.model_path, spec, ready.max_seq_len, c.max_running_seqs, ready.dtype, c.block_size,
            ready.kv_cache_dtype))
        self.servicer.adapter_names = engine.adapter_names
        # What start-up made lives as long as the process: out of every collection from now on, so a
        # full collection does not stop the event loop (and, through the pipe, the engine) for long.
        frozen = freeze_startup_heap()
        # Watched from here: a start-up collection (that one included) pauses no stream.
        self._gc_watch = watch_gc_pauses("grpc")
        self.streams.on_first_token = self._first_token
        await self._set_health(health_pb2.HealthCheckResponse.SERVING)
        self.timeline.mark("serving")
        self.ready.set()
        log.info("serving", model=c.model, port=self.port, graph_mode=ready.graph_mode, gc_frozen_objects=frozen)
        # One event for the whole start: the phases' ends and lengths, seconds since this process started.
        log.info("startup_timeline", seconds=self.timeline.seconds(), durations=self.timeline.durations(),
                 serving_s=self.timeline.seconds()["serving"])

    def _first_token(self) -> None:
        """The start's last mark: the first token this server wrote to a client (a cold pod's first user)."""
        self.timeline.mark("first_token")
        seconds = self.timeline.seconds()
        log.info("startup_first_token", seconds=seconds["first_token"],
                 after_serving_s=round(seconds["first_token"] - seconds["serving"], 3))

    def _model_info(self, ready: EngineFacts) -> inference_pb2.ModelInfo:
        c, spec = self.config, ready.spec
        return inference_pb2.ModelInfo(
            model=c.model, architecture=spec.architecture, vocab_size=spec.vocab_size,
            max_sequence_length=ready.max_seq_len, max_running_sequences=c.max_running_seqs, device=ready.device,
            dtype=ready.dtype, eos_token_ids=list(spec.eos_token_ids),
            max_tokens_limit=c.max_tokens_limit, default_max_tokens=c.default_max_tokens,
            adapters=sorted(ready.adapters), batch_invariant=c.batch_invariant,
        )

    async def _set_health(self, status: int) -> None:
        self.streams.serving = status == health_pb2.HealthCheckResponse.SERVING
        for name in ("", INFERENCE_SERVICE, VLLM_SERVICE):
            await self.health.set(name, status)

    # ---- run and stop -------------------------------------------------------------------------

    async def run(self) -> int:
        """Serve until SIGTERM/SIGINT or an engine failure; returns the process exit code."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stopping.set)
        await self.start()
        watchdog = asyncio.create_task(self._watchdog())
        loader = asyncio.create_task(self.load())
        stop_wait = asyncio.create_task(self.stopping.wait())
        try:
            await asyncio.wait({loader, stop_wait}, return_when=asyncio.FIRST_COMPLETED)
            if loader.done() and loader.exception() is not None:
                raise loader.exception()
            await self.stopping.wait()
        except ModelLoadError as exc:
            log.error("model_load_failed", model=self.config.model, error=str(exc))
            self.exit_code = 2
        except EngineStartError as exc:
            log.error("engine_start_failed", model=self.config.model, error=str(exc))
            self.exit_code = 1
        finally:
            # A SIGTERM during loading must not wait for the load: the load runs in a daemon thread.
            for task in (loader, stop_wait, watchdog):
                task.cancel()
            await self.shutdown()
        return self.exit_code

    async def _watchdog(self) -> None:
        """NOT_SERVING while the engine makes no progress with work pending; exit non-zero if it died."""
        stuck = False
        while True:
            await asyncio.sleep(0.5)
            engine = self.engine
            if engine is None or not self.ready.is_set():
                continue
            if not engine.alive:
                log.error("engine_dead", error=repr(engine.error))
                await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
                self.exit_code = 1
                self.stopping.set()
                return
            idle_for = time.monotonic() - engine.last_progress
            now_stuck = engine.has_pending_work() and idle_for > self.config.watchdog_timeout
            if now_stuck != stuck and not self.streams.draining:
                stuck = now_stuck
                log.warning("engine_stalled" if stuck else "engine_recovered", seconds_without_progress=round(idle_for, 1))
                await self._set_health(
                    health_pb2.HealthCheckResponse.NOT_SERVING if stuck else health_pb2.HealthCheckResponse.SERVING
                )

    async def shutdown(self) -> None:
        """Bounded: --drain-timeout for the streams, then --engine-stop-timeout for the engine (the
        aborts it has not answered, its own stop and stats save), then it is killed."""
        c = self.config
        log.info("draining", timeout_s=c.drain_timeout, open_streams=len(self.streams.active))
        self.streams.draining = True
        self.kv_events.end_all()
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        engine_deadline = None
        if self.streams.active and not await self._streams_idle_within(c.drain_timeout):
            log.warning("drain_timeout", aborted=len(self.streams.active))
            engine_deadline = time.monotonic() + c.engine_stop_timeout
            responsive = self.engine is not None and self.engine.responsive
            if responsive:  # a hung engine reads no aborts: sending them could block the loop
                self.streams.abort_all()
            if not responsive or not await self._streams_idle_within(c.engine_stop_timeout / 2):
                # The engine does not answer the aborts: end the streams here, as aborted.
                log.warning("engine_not_answering", streams_ended=self.streams.end_all_locally())
                await self._streams_idle_within(1.0)
        if self.admin_server is not None:
            await self.admin_server.stop(grace=1.0)
        if self.engine is not None:  # the engine process saves the stats and frees the graphs
            timeout = c.engine_stop_timeout if engine_deadline is None else max(1.0, engine_deadline - time.monotonic())
            if not await asyncio.to_thread(self.engine.stop, timeout) and self.exit_code == 0:
                self.exit_code = 1  # killed, or the stats were not saved: the log above says which
        if self.server is not None:
            await self.server.stop(grace=1.0)
        self.metrics.close()
        if self._gc_watch in gc.callbacks:
            gc.callbacks.remove(self._gc_watch)
        log.info("stopped", exit_code=self.exit_code)

    async def _streams_idle_within(self, seconds: float) -> bool:
        try:
            await asyncio.wait_for(self.streams.idle.wait(), seconds)
            return True
        except TimeoutError:
            return False
