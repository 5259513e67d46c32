"""vLLM's engine protocol (`vllm.grpc.engine.VllmEngine`, from smg-grpc-proto), beside graphserve.v1.

What gateways speak to vLLM workers: the Shepherd Model Gateway (smg) sends tokenized prompts,
detokenizes, applies stop strings and chat templates itself, balances replicas on GetLoads, and
fetches the tokenizer with GetTokenizer, and routes by cache contents on SubscribeKvEvents (the
prefix cache's stored / removed / cleared blocks, kv_event_hub.py). The checks are engine/validation.py's (shared with graphserve.v1
and the Python API); the stream's life is streams.py's.

Semantics follow vLLM's servicer: chunks carry the new token ids (a delta) and their count; the
complete message carries every output id, the finish reason as vLLM names it ("stop" for EOS, a stop
string or a stop token; "length"; "abort") and the matched stop, and each token's logprobs when
asked, the prompt logprobs (in the first chunk, or in complete when not streaming), n samples (each
message tagged with its index) and structured outputs. What graphserve does not do yet (structural
tags, LoRA by name) is refused with INVALID_ARGUMENT naming the field; what it will not do (embeddings,
multimodal inputs, prefill/decode disaggregation, the profiler) with UNIMPLEMENTED or INVALID_ARGUMENT.
"""

from __future__ import annotations

import asyncio
import datetime
import hashlib
import importlib.metadata
import io
import json
import time
import zipfile
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import structlog
from google.protobuf.unknown_fields import UnknownFieldSet
from smg_grpc_proto.generated import common_pb2, vllm_engine_pb2, vllm_engine_pb2_grpc

from service.engine.kv_events import DEVICE, HOST, BlockRemoved, BlockStored
from service.engine.request import Finish, FinishReason, GenerationRequest, TokenDelta, TokenLogprobs
from service.engine.validation import (
    Fields,
    Limits,
    SamplingParams,
    check_prompt_ids,
    constraint_of,
    encode_capped,
    generation_request,
    need,
    samples,
)
from service.engine_client.calls import ReadKvState, ResetPrefixCache
from service.server.kv_event_hub import KvBatch, KvEventHub, Subscription
from service.server.streams import Stream, Streams, answers_rejections

log = structlog.get_logger("graphserve.vllm")

PROTO_VERSION = importlib.metadata.version("smg-grpc-proto")
SERVICE_NAME = vllm_engine_pb2.DESCRIPTOR.services_by_name["VllmEngine"].full_name
FIELDS = Fields("sampling_params.", "sampling_params.", "tokenized.input_ids", "--max-seq-len", "sampling_params.n")
INLINE_TOKENIZE_BYTES = 16 * 1024  # text prompts above this are tokenized off the event loop
TOKENIZER_CHUNK_BYTES = 64 * 1024
HIT_RATE_WAIT_S = 0.5  # GetLoads answers without a fresh hit rate rather than wait longer for the engine
# The files a gateway needs to tokenize, detokenize and render chats as the worker would (smg's list).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "config.json", "generation_config.json",
                   "special_tokens_map.json", "vocab.json", "merges.txt", "tokenizer.model", "tiktoken.model",
                   "chat_template.json", "chat_template.jinja")

_FINISH_REASONS = {FinishReason.LENGTH: "length", FinishReason.EOS: "stop", FinishReason.STOP: "stop",
                   FinishReason.ABORT: "abort"}


@dataclass(frozen=True)
class ModelFacts:
    """What GetModelInfo and GetServerInfo report, fixed at load."""

    served_model_name: str
    model_path: str
    model_type: str
    architectures: tuple[str, ...]
    vocab_size: int
    max_seq_len: int
    eos_token_ids: tuple[int, ...]
    bos_token_id: int
    pad_token_id: int
    max_running_seqs: int
    dtype: str
    block_size: int = 16  # tokens per KV block: loads report blocks as tokens
    kv_cache_dtype: str = ""  # what the KV cache stores ("": dtype)

    @classmethod
    def read(cls, served_model_name: str, model_path: str, spec: Any, max_seq_len: int, max_running_seqs: int,
             dtype: str, block_size: int = 16, kv_cache_dtype: str = "") -> ModelFacts:
        config_file = Path(model_path) / "config.json"
        hf = json.loads(config_file.read_text()) if config_file.is_file() else {}
        pad = hf.get("pad_token_id")
        return cls(served_model_name, model_path, str(hf.get("model_type") or ""), (spec.architecture,),
                   spec.vocab_size, max_seq_len, tuple(spec.eos_token_ids), int(spec.bos_token_id or 0),
                   int(pad) if isinstance(pad, int) else 0, max_running_seqs, dtype, block_size, kv_cache_dtype)


class VllmEngineServicer(vllm_engine_pb2_grpc.VllmEngineServicer):
    """Serves the engine protocol once `attach` gave it a tokenizer, limits and the model's facts.

    Request ids are scoped to the client's connection, as on graphserve.v1: Abort (which a gateway
    sends on a call of its own, over the same connection) ends only that connection's streams, and no
    client can abort another's or learn which ids it uses.
    """

    def __init__(self, streams: Streams, kv_events: KvEventHub | None = None) -> None:
        self.streams = streams
        self.kv_events = kv_events if kv_events is not None else KvEventHub()
        self.tokenizer: Any = None
        self.limits: Limits | None = None
        self.facts: ModelFacts | None = None
        self.started = time.time()
        self._tokenizer_zip: tuple[bytes, str] | None = None
        self._hit_rate = 0.0  # GetLoads' cache_hit_rate as last read

    def attach(self, tokenizer: Any, limits: Limits, facts: ModelFacts) -> None:
        self.tokenizer, self.limits, self.facts = tokenizer, limits, facts

    # ---- generation ----------------------------------------------------------------------------

    @answers_rejections
    async def Generate(self, request: vllm_engine_pb2.GenerateRequest, context: grpc.aio.ServicerContext) -> None:
        streams = self.streams
        request_id = await streams.begin(context, request.request_id, lambda: _estimated_tokens(request),
                                         request.sampling_params.n)

        writer = _Writer(request.stream)

        async def prepare(stream: Stream) -> list[GenerationRequest]:
            check_supported(request)
            prompt = await self._prompt_ids(request)
            writer.prompt = prompt
            # Its messages carry token ids only: the engine decodes text only for stop strings.
            return samples(generation_request(request_id, prompt, sampling_params_of(request.sampling_params, self.limits),
                                              self.limits, FIELDS, arrival_time=stream.arrival, stream_text=False))

        await streams.serve(context, _scope(context, request_id), prepare, writer, FIELDS)

    async def _prompt_ids(self, request: vllm_engine_pb2.GenerateRequest) -> list[int]:
        kind = request.WhichOneof("input")
        need(kind is not None, "input: set tokenized.input_ids or text")
        if kind == "tokenized":
            return check_prompt_ids(request.tokenized.input_ids, self.limits, FIELDS)
        size = len(request.text.encode("utf-8", "surrogatepass"))
        need(size > 0, "text is empty: send at least one character")
        need(size <= self.limits.max_prompt_bytes,
             f"text is {size} bytes, over the limit of {self.limits.max_prompt_bytes} bytes (--max-prompt-bytes)")
        encode = (self.tokenizer, request.text, self.limits.max_seq_len - 1, "text")
        ids = await asyncio.to_thread(encode_capped, *encode) if size > INLINE_TOKENIZE_BYTES else encode_capped(*encode)
        need(len(ids) > 0, "text encodes to no tokens")
        return ids

    async def Abort(self, request: vllm_engine_pb2.AbortRequest, context: grpc.aio.ServicerContext
                    ) -> vllm_engine_pb2.AbortResponse:
        """Abort these requests of this connection; ids that are not streaming on it (finished, unknown,
        another client's) are ignored, as vLLM ignores unknown ids."""
        for request_id in request.request_ids:
            stream = self.streams.active.get(_scope(context, request_id))
            if stream is not None:
                stream.abort()
        return vllm_engine_pb2.AbortResponse()

    async def Embed(self, request: vllm_engine_pb2.EmbedRequest, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED,
                            "graphserve serves text generation only; embeddings are not available")

    # ---- state ---------------------------------------------------------------------------------

    async def HealthCheck(self, request: vllm_engine_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext
                          ) -> vllm_engine_pb2.HealthCheckResponse:
        s = self.streams
        if s.engine is None:
            return vllm_engine_pb2.HealthCheckResponse(healthy=False, message="the model is still loading")
        if s.draining:
            return vllm_engine_pb2.HealthCheckResponse(healthy=False, message="the server is shutting down")
        if not s.engine.alive or not s.serving:
            return vllm_engine_pb2.HealthCheckResponse(healthy=False, message="the engine is not making progress")
        return vllm_engine_pb2.HealthCheckResponse(healthy=True, message="serving")

    async def GetModelInfo(self, request: vllm_engine_pb2.GetModelInfoRequest, context: grpc.aio.ServicerContext
                           ) -> vllm_engine_pb2.GetModelInfoResponse:
        f = await self._facts(context)
        return vllm_engine_pb2.GetModelInfoResponse(
            model_path=f.model_path, is_generation=True, max_context_length=f.max_seq_len, vocab_size=f.vocab_size,
            supports_vision=False, served_model_name=f.served_model_name, tokenizer_path=f.model_path,
            model_type=f.model_type, architectures=list(f.architectures), eos_token_ids=list(f.eos_token_ids),
            pad_token_id=f.pad_token_id, bos_token_id=f.bos_token_id, max_req_input_len=f.max_seq_len - 1,
        )

    async def GetServerInfo(self, request: vllm_engine_pb2.GetServerInfoRequest, context: grpc.aio.ServicerContext
                            ) -> vllm_engine_pb2.GetServerInfoResponse:
        f = await self._facts(context)
        return vllm_engine_pb2.GetServerInfoResponse(
            active_requests=len(self.streams.active), is_paused=False,
            last_receive_timestamp=self.streams.last_received, uptime_seconds=time.time() - self.started,
            server_type="graphserve", data_parallel_size=1, max_num_seqs=f.max_running_seqs,
            model_dtype=f.dtype, kv_cache_dtype=f.kv_cache_dtype or f.dtype,
        )

    async def GetLoads(self, request: vllm_engine_pb2.GetLoadsRequest, context: grpc.aio.ServicerContext
                       ) -> vllm_engine_pb2.GetLoadsResponse:
        f = await self._facts(context)
        try:  # the prefix cache's counts, read in the engine process beside its steps
            stats = asyncio.to_thread(self.streams.engine.request, ReadKvState())
            self._hit_rate = (await asyncio.wait_for(stats, HIT_RATE_WAIT_S)).hit_rate
        except Exception:  # noqa: BLE001 - the engine is stopping or slow to answer: the last rate, and the loads, still help
            pass
        hit_rate = self._hit_rate
        engine = self.streams.engine
        running, waiting = engine.num_running, engine.num_waiting
        used, total = engine.kv_cache_usage  # KV blocks held by requests, of the pool's
        load = vllm_engine_pb2.SchedulerLoad(
            dp_rank=0, num_running_reqs=running, num_waiting_reqs=waiting, num_total_reqs=running + waiting,
            num_used_tokens=used * f.block_size, max_total_num_tokens=total * f.block_size,
            token_usage=used / total if total else 0.0, max_running_requests=f.max_running_seqs,
            num_waiting_uncached_tokens=engine.waiting_prompt_tokens, cache_hit_rate=hit_rate,
        )
        return vllm_engine_pb2.GetLoadsResponse(
            timestamp=datetime.datetime.now(datetime.UTC).isoformat(), version="graphserve", dp_rank_count=1,
            loads=[load],
        )

    async def GetTokenizer(self, request: common_pb2.GetTokenizerRequest, context: grpc.aio.ServicerContext
                           ) -> AsyncIterator[common_pb2.GetTokenizerChunk]:
        """The model's tokenizer files as one zip, in chunks; the last carries the zip's SHA-256."""
        f = await self._facts(context)
        if self._tokenizer_zip is None:
            try:
                self._tokenizer_zip = await asyncio.to_thread(tokenizer_zip, Path(f.model_path))
            except OSError as exc:
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"the tokenizer cannot be served: {exc}")
        data, sha256 = self._tokenizer_zip
        for start in range(0, len(data), TOKENIZER_CHUNK_BYTES):
            end = min(start + TOKENIZER_CHUNK_BYTES, len(data))
            yield common_pb2.GetTokenizerChunk(data=data[start:end], sha256=sha256 if end == len(data) else "")

    async def FlushCache(self, request: common_pb2.FlushCacheRequest, context: grpc.aio.ServicerContext
                         ) -> common_pb2.FlushCacheResponse:
        await self._facts(context)
        if await asyncio.to_thread(self.streams.engine.request, ResetPrefixCache()):
            return common_pb2.FlushCacheResponse(success=True, message="the prefix cache is empty")
        return common_pb2.FlushCacheResponse(
            success=False, message="requests are running and hold KV blocks: flush again when the server is idle")

    async def SubscribeKvEvents(self, request: common_pb2.SubscribeKvEventsRequest,
                                context: grpc.aio.ServicerContext) -> AsyncIterator[common_pb2.KvEventBatch]:
        """The prefix cache's events from `start_sequence_number` (0: the cached blocks now, as a
        snapshot), then live until the client goes, falls `--kv-events-buffer` batches behind, or
        the server drains."""
        await self._facts(context)
        sub = self.kv_events.subscribe(request.start_sequence_number)
        log.info("kv_events_subscribed", peer=context.peer(), start=request.start_sequence_number,
                 snapshot=sub.snapshot, batches=sub.pending, subscribers=len(self.kv_events.subscribers))
        try:
            await context.send_initial_metadata(())  # the subscriber's call resolves before the first event
            while (batch := await sub.next()) is not None:
                yield _kv_batch_message(batch)
            await self._end_subscription(sub, context)
        finally:
            sub.close()

    async def _end_subscription(self, sub: Subscription, context: grpc.aio.ServicerContext) -> None:
        if sub.dropped:
            log.warning("kv_events_subscriber_dropped", peer=context.peer(), buffer=self.kv_events.buffer)
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"this subscriber read KV events too slowly ({self.kv_events.buffer} batches behind, "
                                "--kv-events-buffer): subscribe again from the last sequence number applied")
        await context.abort(grpc.StatusCode.UNAVAILABLE, "the server is shutting down")

    async def StartProfile(self, request: common_pb2.StartProfileRequest, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "the profiler is not served over gRPC; see bench/ for profiles")

    async def StopProfile(self, request: common_pb2.StopProfileRequest, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "the profiler is not served over gRPC; see bench/ for profiles")

    async def _facts(self, context: grpc.aio.ServicerContext) -> ModelFacts:
        if self.facts is None:
            await self.streams.abort(context, grpc.StatusCode.UNAVAILABLE, "loading",
                                     "the model is still loading; retry shortly")
        return self.facts


class _Writer:
    """vLLM's messages: a chunk per delta (streaming), then a complete message per sample, each
    tagged with the sample's index (n > 1)."""

    def __init__(self, stream: bool) -> None:
        self.stream = stream
        self.output_ids: dict[int, list[int]] = {}
        self.logprobs: dict[int, list[TokenLogprobs]] = {}  # a whole completion's, for its complete message
        self.prompt: list[int] = []
        # Per sample, prompt logprobs not sent in a chunk (not streaming, or a first delta without
        # tokens): they go in its complete message.
        self.prompt_logprobs: dict[int, list[TokenLogprobs]] = {}

    def chunk(self, delta: TokenDelta, index: int) -> vllm_engine_pb2.GenerateResponse | None:
        self.output_ids.setdefault(index, []).extend(delta.token_ids)
        if not self.stream:
            self.logprobs.setdefault(index, []).extend(delta.logprobs or ())
        if not self.stream or not delta.token_ids:
            if delta.prompt_logprobs is not None:
                self.prompt_logprobs[index] = delta.prompt_logprobs
            return None
        chunk = vllm_engine_pb2.GenerateStreamChunk(
            token_ids=delta.token_ids, prompt_tokens=len(self.prompt), completion_tokens=len(delta.token_ids),
            index=index)
        if delta.logprobs is not None:
            chunk.output_logprobs.CopyFrom(_output_logprobs(delta.token_ids, delta.logprobs))
        if delta.prompt_logprobs is not None:
            chunk.input_logprobs.CopyFrom(_input_logprobs(self.prompt, delta.prompt_logprobs))
        return vllm_engine_pb2.GenerateResponse(chunk=chunk)

    def finished(self, f: Finish, index: int) -> list[vllm_engine_pb2.GenerateResponse]:
        last = None if f.final_delta is None else self.chunk(f.final_delta, index)
        output_ids = self.output_ids.get(index, [])
        complete = vllm_engine_pb2.GenerateComplete(
            output_ids=output_ids, finish_reason=_FINISH_REASONS[f.reason], prompt_tokens=f.prompt_tokens,
            completion_tokens=f.completion_tokens, cached_tokens=f.cached_tokens, index=index)
        if self.logprobs.get(index):  # streamed ones went out with their chunks
            complete.output_logprobs.CopyFrom(_output_logprobs(output_ids, self.logprobs[index]))
        if index in self.prompt_logprobs:
            complete.input_logprobs.CopyFrom(_input_logprobs(self.prompt, self.prompt_logprobs.pop(index)))
        if isinstance(f.matched_stop, str):
            complete.matched_stop_str = f.matched_stop
        elif isinstance(f.matched_stop, int):
            complete.matched_token_id = f.matched_stop
        return [*([last] if last is not None else []), vllm_engine_pb2.GenerateResponse(complete=complete)]


def _input_logprobs(prompt: list[int], logprobs: list[TokenLogprobs]) -> vllm_engine_pb2.InputLogProbs:
    """vLLM's prompt logprobs: one entry per prompt token, the first without a value."""
    values = [vllm_engine_pb2.InputTokenLogProb()] + [vllm_engine_pb2.InputTokenLogProb(value=lp.logprob)
                                                      for lp in logprobs]
    top = [vllm_engine_pb2.TopLogProbs()] + [_top(lp) for lp in logprobs]
    return vllm_engine_pb2.InputLogProbs(token_logprobs=values, token_ids=prompt, top_logprobs=top)


def _top(lp: TokenLogprobs) -> vllm_engine_pb2.TopLogProbs:
    return vllm_engine_pb2.TopLogProbs(values=[v for _, v in lp.top], token_ids=[t for t, _ in lp.top])


def _output_logprobs(ids: list[int], logprobs: list[TokenLogprobs]) -> vllm_engine_pb2.OutputLogProbs:
    return vllm_engine_pb2.OutputLogProbs(
        token_logprobs=[lp.logprob for lp in logprobs], token_ids=ids,
        top_logprobs=[_top(lp) for lp in logprobs])


# ---- KV events -> smg.grpc.common -------------------------------------------------------------

def _kv_batch_message(batch: KvBatch) -> common_pb2.KvEventBatch:
    """A batch as the protocol carries it, made once for every subscriber. Event ids count within
    the batch (a snapshot's are 0, as the protocol asks)."""
    if batch.wire is None:
        message = common_pb2.KvEventBatch(sequence_number=batch.sequence_number, timestamp=batch.timestamp, dp_rank=0)
        for i, event in enumerate(batch.events):
            message.events.append(_kv_event_message(event, 0 if batch.snapshot is not None else i + 1))
        if batch.snapshot is not None:
            s = batch.snapshot
            message.snapshot.CopyFrom(common_pb2.KvSnapshotChunk(index=s.index, count=s.count, blocks=s.blocks))
        batch.wire = message
    return batch.wire


_TIERS = {DEVICE: common_pb2.KV_CACHE_TIER_DEVICE, HOST: common_pb2.KV_CACHE_TIER_HOST}


def _kv_event_message(event: Any, event_id: int) -> common_pb2.KvCacheEvent:
    if isinstance(event, BlockStored):
        bs = event.block_size
        stored = common_pb2.KvBlocksStored(
            blocks=[common_pb2.KvBlock(block_hash=wire_hash(h), token_ids=event.token_ids[i * bs:(i + 1) * bs],
                                       block_size=bs)
                    for i, h in enumerate(event.block_hashes)],
            tier=_TIERS[event.medium], medium=event.medium)
        if event.parent_block_hash is not None:
            stored.parent_block_hash = wire_hash(event.parent_block_hash)
        if event.lora_name:
            stored.lora_name = event.lora_name
        return common_pb2.KvCacheEvent(event_id=event_id, stored=stored)
    if isinstance(event, BlockRemoved):
        return common_pb2.KvCacheEvent(event_id=event_id, removed=common_pb2.KvBlocksRemoved(
            block_hashes=[wire_hash(h) for h in event.block_hashes], tier=_TIERS[event.medium], medium=event.medium))
    return common_pb2.KvCacheEvent(event_id=event_id, cleared=common_pb2.KvCacheCleared())


def wire_hash(digest: bytes) -> int:
    """A block's hash as the protocol's int64: its first 8 bytes, big-endian, signed (the router
    takes it as the block's identity; it hashes the tokens itself)."""
    return int.from_bytes(digest[:8], "big", signed=True)


# ---- vllm.grpc.engine request -> checked values -------------------------------------------------

def _estimated_tokens(request: vllm_engine_pb2.GenerateRequest) -> int:
    if request.WhichOneof("input") == "tokenized":
        return len(request.tokenized.input_ids)
    return len(request.text.encode("utf-8", "surrogatepass"))


def _scope(context: grpc.aio.ServicerContext, request_id: str) -> tuple[str, str]:
    """A stream's key among every protocol's: this protocol, this connection, this id."""
    return f"{SERVICE_NAME} {context.peer()}", request_id


def check_supported(request: vllm_engine_pb2.GenerateRequest) -> None:
    """Refuse, naming the field, what graphserve cannot honour: never drop a field silently.

    Fields at their neutral value (as gateways send them on every request) pass; fields of a newer
    protocol version than this worker reads are refused by number.
    """
    for message, name in ((request, "GenerateRequest"), (request.sampling_params, "SamplingParams"),
                          (request.tokenized, "TokenizedInput")):
        unknown = sorted({f.field_number for f in UnknownFieldSet(message)})
        need(not unknown, f"{name} field {unknown[0] if unknown else ''} is not part of the engine protocol this "
                          f"worker reads (smg-grpc-proto {PROTO_VERSION}): leave it unset or upgrade graphserve")
    need(not request.HasField("mm_inputs") and not request.extra_mm_inputs and not request.HasField("media_refs"),
         "mm_inputs / media_refs: graphserve serves text-only models; multimodal inputs are not supported")
    need(not request.HasField("kv_transfer_params") and not request.HasField("kv_transfer_params_json"),
         "kv_transfer_params: prefill/decode disaggregation is not supported; send the whole request to one worker")
    need(not request.HasField("data_parallel_rank") or request.data_parallel_rank == 0,
         f"data_parallel_rank is {request.data_parallel_rank}: this worker has one data-parallel rank (0)")
    p = request.sampling_params
    unsupported = {
        "truncate_prompt_tokens": p.HasField("truncate_prompt_tokens"),
        "include_stop_str_in_output": p.include_stop_str_in_output,
    }
    unsupported["structural_tag"] = p.WhichOneof("constraint") == "structural_tag"
    named = [name for name, used in unsupported.items() if used]
    need(not named, f"sampling_params.{named[0] if named else ''} is not supported by graphserve yet: leave it unset "
                    "(supported: temperature, top_p, top_k, min_p, seed, max_tokens, min_tokens, stop, stop_token_ids, "
                    "ignore_eos, presence_penalty, frequency_penalty, repetition_penalty, logit_bias, logprobs, prompt_logprobs, n, "
                    "json_schema, json_object, regex, grammar, choice)")


def sampling_params_of(p: vllm_engine_pb2.SamplingParams, limits: Limits) -> SamplingParams:
    return SamplingParams(
        n=max(1, p.n),  # 0 is unset on the wire
        temperature=p.temperature if p.HasField("temperature") else 1.0,
        top_p=p.top_p if p.top_p != 0 else 1.0,  # not optional on the wire: 0 is unset
        top_k=p.top_k,
        # int32 on the wire: a negative seed is taken as its 32-bit two's-complement value
        seed=(p.seed & 0xFFFFFFFF) if p.HasField("seed") else None,
        max_tokens=p.max_tokens if p.HasField("max_tokens") else None,
        stop=tuple(p.stop), stop_token_ids=tuple(p.stop_token_ids), ignore_eos=p.ignore_eos,
        min_p=p.min_p, presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty,
        repetition_penalty=p.repetition_penalty if p.repetition_penalty != 0 else 1.0,  # 0 is unset on the wire
        min_tokens=p.min_tokens, logit_bias=tuple(p.logit_bias.items()),
        logprobs=p.logprobs if p.HasField("logprobs") else None,
        constraint=constraint_of(p, limits, FIELDS),
        prompt_logprobs=p.prompt_logprobs if p.HasField("prompt_logprobs") else None,
        fields=FIELDS,
    )



def tokenizer_zip(model_dir: Path) -> tuple[bytes, str]:
    """The tokenizer files of a model directory as zip bytes, and their SHA-256 (hex)."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        names = [n for n in TOKENIZER_FILES if (model_dir / n).is_file()]
        names += sorted(p.name for p in model_dir.glob("*.jinja") if p.is_file() and p.name not in names)
        if not any(n in names for n in ("tokenizer.json", "tokenizer.model", "vocab.json", "tiktoken.model")):
            raise FileNotFoundError(f"{model_dir} holds no tokenizer file")
        for name in names:
            archive.write(model_dir / name, name)
    data = buffer.getvalue()
    return data, hashlib.sha256(data).hexdigest()
