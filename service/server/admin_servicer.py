"""GraphCacheAdmin: the operator's view and control of the graph cache, over gRPC.

A thin edge over the engine client (`EngineClient`): each RPC sends its typed engine call
(engine_client/calls.py); reads are snapshots taken where the engine runs, operations run on its
engine thread between steps (one at a time, through `engine.call`), and their per-size results and
errors are turned into protobuf and status codes here. Every call into the engine runs off the
event loop. Sizes are checked against the allowed list before anything else, so a wrong size is
INVALID_ARGUMENT whatever the device.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable
from typing import Any

import grpc
import structlog

from cache_manager import (
    BatchDescriptor,
    BucketCounters,
    BucketEntry,
    BucketState,
    CacheSnapshot,
    CudaGraphMode,
    GraphFamily,
    GraphsUnavailableError,
    OpResult,
)
from service.engine.adapters import (
    AdapterError,
    AdapterExists,
    AdapterInUse,
    AdapterLimit,
    AdapterNotFound,
    InvalidAdapterName,
)
from service.engine.block_pool import PoolStats
from service.engine.rank_memory import RankMemory
from service.engine_client.calls import (
    Capture,
    EngineCall,
    Evict,
    ListAdapters,
    LoadAdapter,
    ReadGraphMemory,
    ReadKvState,
    ReadPersistedStats,
    ReadRankMemory,
    ReadSnapshot,
    ReadTotalMemory,
    ResetStats,
    SetBudget,
    UnloadAdapter,
)
from service.engine_client.client import EngineClient
from service.model.lora import LoraError, LoraPathError
from service.proto import admin_pb2, admin_pb2_grpc

log = structlog.get_logger("graphserve.admin")

# Above this a budget is a typo, not a plan (no device has a pebibyte of memory).
MAX_BUDGET_BYTES = 1 << 50
# Values listed in one error message, at most.
_SHOWN_VALUES = 8

# Adapter errors (ValueErrors) by what the caller must change; the first match wins.
_ADAPTER_STATUS = (
    (AdapterNotFound, grpc.StatusCode.NOT_FOUND),
    (AdapterExists, grpc.StatusCode.ALREADY_EXISTS),
    (AdapterInUse, grpc.StatusCode.FAILED_PRECONDITION),  # streams use it: unload after they end
    (AdapterLimit, grpc.StatusCode.RESOURCE_EXHAUSTED),  # --max-cpu-loras adapters are loaded
    (InvalidAdapterName, grpc.StatusCode.INVALID_ARGUMENT),
    (LoraPathError, grpc.StatusCode.PERMISSION_DENIED),  # outside --lora-root
    (LoraError, grpc.StatusCode.INVALID_ARGUMENT),  # the files do not fit
    (AdapterError, grpc.StatusCode.FAILED_PRECONDITION),  # e.g. no adapter slots, or no --lora-root
)

_STATES = {
    BucketState.NOT_CAPTURED: admin_pb2.BUCKET_STATE_NOT_CAPTURED,
    BucketState.CAPTURING: admin_pb2.BUCKET_STATE_CAPTURING,
    BucketState.CAPTURED: admin_pb2.BUCKET_STATE_CAPTURED,
    BucketState.EVICTED: admin_pb2.BUCKET_STATE_EVICTED,
    BucketState.FAILED: admin_pb2.BUCKET_STATE_FAILED,
}


class GraphCacheAdminServicer(admin_pb2_grpc.GraphCacheAdminServicer):
    def __init__(self, engine: EngineClient) -> None:
        self.engine = engine

    def _ask(self, call: EngineCall) -> Callable[[], Any]:
        """The engine's reply to `call`, as a function to run off the event loop."""
        return lambda: self.engine.request(call)

    # ---- reads --------------------------------------------------------------------------------

    async def GetCacheState(self, request: admin_pb2.GetCacheStateRequest,
                            context: grpc.aio.ServicerContext) -> admin_pb2.CacheState:
        facts = self.engine.facts
        snap = await self._read(context, self._ask(ReadSnapshot()))
        ranks = await self._read(context, self._ask(ReadRankMemory()))
        kv = await self._read(context, self._ask(ReadKvState()))
        # One cache: the LoRA family's entries fill the lora fields, as when they were a cache of their own.
        return admin_pb2.CacheState(
            mode=snap.mode, device=snap.device, budget_bytes=snap.budget_bytes,
            used_bytes=snap.used_bytes - snap.lora_used_bytes,
            capture_sizes=list(snap.capture_sizes), max_batch=snap.max_batch,
            buckets=[_bucket_entry(b) for b in snap.buckets if not b.lora], piecewise_sizes=list(snap.piecewise_sizes),
            lora_buckets=[_bucket_entry(b) for b in snap.buckets if b.lora], lora_used_bytes=snap.lora_used_bytes,
            ranks=[_rank_memory(r) for r in ranks],
            kv_cache=_kv_cache_state(kv, facts.kv_cache_dtype or facts.dtype) if kv is not None else None,
            architecture=facts.architecture,
        )

    async def GetCaptureStats(self, request: admin_pb2.GetCaptureStatsRequest,
                              context: grpc.aio.ServicerContext) -> admin_pb2.CaptureStats:
        snap = await self._read(context, self._ask(ReadSnapshot()))
        persisted = await self._read(context, self._ask(ReadPersistedStats()))
        return admin_pb2.CaptureStats(
            since_start=_stats_view(snap, snap.requested_since_start, "since_start",
                                    _sum_reasons(r.eager_fallbacks for r in snap.requested_detail)),
            persisted=_stats_view(snap, snap.requested_persisted, "persisted",
                                  _sum_reasons(c.eager for c in persisted.requested.values())),
            stats_file=snap.stats_file or "",
            last_save_unix=snap.last_save_time or 0.0,
        )

    # ---- operations (on the engine thread) ----------------------------------------------------

    async def Capture(self, request: admin_pb2.SizesRequest,
                      context: grpc.aio.ServicerContext) -> admin_pb2.OperationResponse:
        sizes, family = await self._checked_sizes(request, context)
        return await self._operate(context, "capture",
                                   self._ask(Capture(tuple(sizes), family.mode.value, family.lora)),
                                   kind=str(family), sizes=sizes)

    async def Evict(self, request: admin_pb2.SizesRequest,
                    context: grpc.aio.ServicerContext) -> admin_pb2.OperationResponse:
        sizes, family = await self._checked_sizes(request, context)
        return await self._operate(context, "evict",
                                   self._ask(Evict(tuple(sizes), family.mode.value, family.lora)),
                                   kind=str(family), sizes=sizes)

    async def SetBudget(self, request: admin_pb2.SetBudgetRequest,
                        context: grpc.aio.ServicerContext) -> admin_pb2.OperationResponse:
        budget = request.budget_bytes
        if budget == 0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                "budget_bytes must be > 0; to run without graphs start with --cudagraph-mode none")
        if budget > MAX_BUDGET_BYTES:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"budget_bytes {budget} is absurd (more than {MAX_BUDGET_BYTES} bytes)")

        def set_budget() -> dict[Any, OpResult]:
            total = self.engine.request(ReadTotalMemory()) if self.engine.facts.has_graph_backend else None
            if total is not None and budget > total:
                raise ValueError(f"budget_bytes {budget} exceeds the device's {total} bytes of memory")
            return self.engine.request(SetBudget(int(budget)))

        return await self._operate(context, "set_budget", set_budget, requested_budget=budget)

    async def ResetStats(self, request: admin_pb2.ResetStatsRequest,
                         context: grpc.aio.ServicerContext) -> admin_pb2.ResetStatsResponse:
        await self._on_engine(context, "reset_stats", self._ask(ResetStats()))
        log.info("admin_stats_reset")
        return admin_pb2.ResetStatsResponse()

    # ---- LoRA adapters --------------------------------------------------------------------------

    async def LoadAdapter(self, request: admin_pb2.LoadAdapterRequest,
                          context: grpc.aio.ServicerContext) -> admin_pb2.AdapterInfo:
        if not request.name or not request.path:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                "give the adapter's name and the path of its PEFT directory on the server")
        # On a thread of its own, not the one that runs admin calls one at a time: reading the files
        # must not hold up the other admin calls (the engine process reads one adapter at a time).
        info = await self._adapter_call(context, "load_adapter",
                                        self._ask(LoadAdapter(request.name, request.path)), own_thread=True)
        log.info("admin_adapter_loaded", name=info.name, path=info.path, rank=info.rank)
        return _adapter_info(info)

    async def UnloadAdapter(self, request: admin_pb2.UnloadAdapterRequest,
                            context: grpc.aio.ServicerContext) -> admin_pb2.UnloadAdapterResponse:
        await self._adapter_call(context, "unload_adapter", self._ask(UnloadAdapter(request.name)))
        log.info("admin_adapter_unloaded", name=request.name)
        return admin_pb2.UnloadAdapterResponse()

    async def ListAdapters(self, request: admin_pb2.ListAdaptersRequest,
                           context: grpc.aio.ServicerContext) -> admin_pb2.ListAdaptersResponse:
        infos = await self._adapter_call(context, "list_adapters", self._ask(ListAdapters()))
        facts = self.engine.facts
        return admin_pb2.ListAdaptersResponse(adapters=[_adapter_info(i) for i in infos],
                                              max_loras=facts.max_loras, max_lora_rank=facts.max_lora_rank)

    async def _adapter_call(self, context: grpc.aio.ServicerContext, op: str, fn: Callable[[], Any],
                            own_thread: bool = False) -> Any:
        """fn off the event loop, with the adapter errors as status codes that say what to change."""
        try:
            if own_thread:
                return await asyncio.to_thread(fn)
            return await asyncio.wrap_future(self.engine.call(fn))
        except (AdapterError, LoraError) as exc:
            code = next(c for kind, c in _ADAPTER_STATUS if isinstance(exc, kind))
            await context.abort(code, f"{op}: {exc}")
        except Exception as exc:
            await self._failed(context, op, exc)

    # ---- helpers ------------------------------------------------------------------------------

    async def _checked_sizes(
        self, request: admin_pb2.SizesRequest, context: grpc.aio.ServicerContext
    ) -> tuple[list[int], GraphFamily]:
        """Unique sizes in request order and the graph family the kind names ("full", "piecewise",
        "full+lora", "piecewise+lora"); INVALID_ARGUMENT (naming the allowed ones) otherwise."""
        try:
            family = GraphFamily.parse(request.kind or "full")
        except ValueError:
            family = None
        if family is None or family.query_tokens != 1:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"kind {request.kind!r}: use full, piecewise, full+lora or piecewise+lora")
        kind = str(family)
        if family.lora and not self.engine.facts.max_loras:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"kind {kind}: this server has no adapter slots, so no LoRA graphs "
                                "(start with --max-loras or --lora-modules)")
        unique = list(dict.fromkeys(request.sizes))
        config = self.engine.facts.graph_config
        allowed = config.sizes if family.mode.value == "full" else config.piecewise_sizes  # LoRA or not
        if not unique:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"give at least one size; allowed: {_few(allowed)}")
        bad = [s for s in unique if s not in allowed]
        if bad:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"sizes {_few(bad)} are not {kind} capture sizes; allowed: {_few(allowed)}")
        return unique, family

    async def _read(self, context: grpc.aio.ServicerContext, fn: Callable[[], Any]) -> Any:
        try:
            return await asyncio.to_thread(fn)
        except Exception as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"the engine did not answer ({exc}); retry shortly")

    async def _operate(self, context: grpc.aio.ServicerContext, op: str, fn: Callable[[], dict[Any, OpResult]],
                       kind: str = "full", **fields: Any) -> admin_pb2.OperationResponse:
        """fn's results are keyed by size (of `kind`) or by (size, kind) (set_budget: any kind; the
        engine process names the LoRA graphs' kinds "full+lora" / "piecewise+lora")."""
        def run() -> tuple[dict[Any, OpResult], int, int]:
            results = fn()
            return results, *self.engine.request(ReadGraphMemory())

        results, budget, used = await self._on_engine(context, op, run)
        keys = {s: _size_and_kind(s, kind) for s in results}
        log.info("admin_operation", op=op, **fields,
                 results={f"{keys[s][1]}:{keys[s][0]}": r.outcome.value for s, r in results.items()},
                 used_bytes=used, budget_bytes=budget)
        return admin_pb2.OperationResponse(
            results=[admin_pb2.SizeResult(size=keys[s][0], kind=keys[s][1], outcome=r.outcome.value,
                                          message=r.message, bytes=r.bytes)
                     for s, r in results.items()],
            budget_bytes=budget, used_bytes=used,
        )

    async def _on_engine(self, context: grpc.aio.ServicerContext, op: str, fn: Callable[[], Any]) -> Any:
        """Run fn on the engine thread between steps; map its errors to status codes."""
        try:
            return await asyncio.wrap_future(self.engine.call(fn))
        except GraphsUnavailableError as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"{op}: CUDA graphs are unavailable on this server ({exc.reason}, "
                                f"device {self.engine.facts.graphs_device})")
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{op}: {exc}")
        except Exception as exc:
            await self._failed(context, op, exc)

    async def _failed(self, context: grpc.aio.ServicerContext, op: str, exc: Exception) -> None:
        if not self.engine.alive:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"{op}: the engine is not running ({exc})")
        log.exception("admin_operation_failed", op=op)
        await context.abort(grpc.StatusCode.INTERNAL, f"{op} failed: {type(exc).__name__}: {exc}")


def _few(values: Iterable[int], shown: int = _SHOWN_VALUES) -> str:
    """A list for an error message, capped: the first few values and how many more (a status message
    that lists thousands overflows the client's metadata limit)."""
    values = list(values)
    if len(values) <= shown:
        return str(values)
    return f"[{', '.join(map(str, values[:shown]))}, ... and {len(values) - shown} more]"


def _size_and_kind(key: int | tuple[int, str], kind: str) -> tuple[int, str]:
    return key if isinstance(key, tuple) else (key, kind)


def _bucket_entry(b: BucketEntry) -> admin_pb2.BucketEntry:
    """State counters are since this process started; bytes and capture time are the latest measured."""
    c = b.since_start
    reason = ""
    if b.state is BucketState.FAILED and b.retry_at is not None:
        reason = f"capture failed; lazy capture retries in {max(0.0, b.retry_at - time.time()):.0f} s"
    return admin_pb2.BucketEntry(
        size=b.size, kind=b.kind, state=_STATES[b.state], bytes=b.bytes, capture_ms=b.capture_ms,
        replays=c.replays, padded_rows=c.padded_rows, eager_fallbacks=sum(c.eager_fallbacks.values()),
        failures=c.failures, captures=c.captures, evictions=c.evictions,
        last_use_unix=b.last_use or 0.0, failure_reason=reason, kept=b.kept, lora=b.lora,
    )


def _kv_cache_state(kv: PoolStats, dtype: str) -> admin_pb2.KVCacheState:
    return admin_pb2.KVCacheState(
        block_size=kv.block_size, total_blocks=kv.num_blocks, used_blocks=kv.used, free_blocks=kv.free,
        cached_blocks=kv.cached, prefix_caching=kv.prefix_caching, prefix_query_tokens=kv.prefix_queries,
        prefix_hit_tokens=kv.prefix_hits, preemptions=kv.preemptions, dtype=dtype)


def _rank_memory(r: RankMemory) -> admin_pb2.RankMemory:
    """Unknown numbers (not published yet, or not measured on the CPU) are 0; `reported` tells which."""
    return admin_pb2.RankMemory(rank=r.rank, graph_bytes=r.graph_bytes or 0, device_free_bytes=r.device_free_bytes or 0,
                                device_total_bytes=r.device_total_bytes or 0, reported=r.graph_bytes is not None)


def _adapter_info(a: Any) -> admin_pb2.AdapterInfo:
    return admin_pb2.AdapterInfo(name=a.name, path=a.path, rank=a.rank, target_modules=list(a.targets), slot=a.slot,
                                 active_streams=a.active_streams)


def _reason_counts(counts: dict[str, int]) -> list[admin_pb2.ReasonCount]:
    return [admin_pb2.ReasonCount(reason=r, count=n) for r, n in sorted(counts.items())]


def _sum_reasons(tables: Iterable[dict[str, int]]) -> dict[str, int]:
    total: dict[str, int] = {}
    for table in tables:
        for reason, count in table.items():
            total[reason] = total.get(reason, 0) + count
    return total


def _bucket_counters(b: BucketEntry, c: BucketCounters) -> admin_pb2.BucketCounters:
    """A LoRA graph's kind is spelled with its family ("full+lora"), as in a capture or evict."""
    return admin_pb2.BucketCounters(
        size=b.size, kind=str(GraphFamily(CudaGraphMode(b.kind), b.lora)), replays=c.replays,
        captures=c.captures, evictions=c.evictions, failures=c.failures,
        padded_rows=c.padded_rows, eager_fallbacks=_reason_counts(c.eager_fallbacks),
        capture_ms=b.capture_ms, bytes=b.bytes,
    )


def _stats_view(snap: CacheSnapshot, requested: dict[BatchDescriptor, int], which: str,
                eager: dict[str, int]) -> admin_pb2.StatsView:
    return admin_pb2.StatsView(
        requested_sizes=[admin_pb2.SizeCount(size=k.padded_size, kind=str(k.family), count=c)
                         for k, c in sorted(requested.items())],
        buckets=[_bucket_counters(b, getattr(b, which)) for b in snap.buckets],
        eager_fallbacks=_reason_counts(eager),
    )
