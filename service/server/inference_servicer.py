"""The graphserve.v1 Inference servicer: protobuf in, checked domain request to the engine, protobuf out.

The checks are engine/validation.py's (shared with the vLLM protocol and the Python API); the stream's life
(admission, back-pressure, stall timeout, abort, drain) is streams.py's.
"""

from __future__ import annotations

import asyncio
from typing import Any

import grpc

from service.chat import ChatError, chat_prompt_ids
from service.engine.request import Finish, FinishReason, GenerationRequest, TokenDelta, TokenLogprobs
from service.engine.validation import (
    GRAPHSERVE_FIELDS,
    MAX_STREAM_INTERVAL,
    InvalidRequest,
    Limits,
    SamplingParams,
    check_adapter,
    check_prompt_ids,
    constraint_of,
    encode_capped,
    generation_request,
    need,
    samples,
)
from service.proto import inference_pb2, inference_pb2_grpc
from service.server.streams import Stream, Streams, answers_rejections

# Text prompts above this many bytes are tokenized off the event loop; chats always are (rendering
# the template is Python work per message).
INLINE_TOKENIZE_BYTES = 16 * 1024

_FINISH_REASONS = {
    FinishReason.LENGTH: inference_pb2.FINISH_REASON_LENGTH,
    FinishReason.EOS: inference_pb2.FINISH_REASON_EOS,
    FinishReason.STOP: inference_pb2.FINISH_REASON_STOP,
    FinishReason.ABORT: inference_pb2.FINISH_REASON_ABORT,
}


class InferenceServicer(inference_pb2_grpc.InferenceServicer):
    """Serves Generate once `attach` gave it a tokenizer and limits (the engine is the Streams').

    Request ids are scoped to the client's connection: an id is refused as a duplicate only while
    the same connection streams it, so no client can probe which ids another client uses.
    """

    def __init__(self, streams: Streams) -> None:
        self.streams = streams
        self.tokenizer: Any = None
        self.limits: Limits | None = None
        self.model_info = inference_pb2.ModelInfo()
        self.adapter_names: set[str] = set()  # the LoRA adapters loaded now (admin load/unload updates it)

    def attach(self, tokenizer: Any, limits: Limits, model_info: inference_pb2.ModelInfo) -> None:
        self.tokenizer, self.limits, self.model_info = tokenizer, limits, model_info

    async def GetModelInfo(self, request: inference_pb2.GetModelInfoRequest, context: grpc.aio.ServicerContext
                           ) -> inference_pb2.ModelInfo:
        if self.streams.engine is None:
            await self.streams.abort(context, grpc.StatusCode.UNAVAILABLE, "loading",
                                     "the model is still loading; retry shortly")
        return self.model_info

    @answers_rejections
    async def Generate(self, request: inference_pb2.GenerateRequest, context: grpc.aio.ServicerContext) -> None:
        streams = self.streams
        request_id = await streams.begin(context, request.request_id, lambda: _estimated_tokens(request),
                                         request.n if request.HasField("n") else 1)

        async def prepare(stream: Stream) -> list[GenerationRequest]:
            size = check_prompt_size(request, self.limits)
            check_adapter(request.adapter, self.adapter_names)  # a set lookup: before any tokenization
            if size > INLINE_TOKENIZE_BYTES or request.WhichOneof("prompt") == "messages":
                prompt = await asyncio.to_thread(prompt_ids, request, self.tokenizer, self.limits)
            else:
                prompt = prompt_ids(request, self.tokenizer, self.limits)
            return samples(to_generation_request(request, request_id, prompt, self.limits, arrival_time=stream.arrival))

        await streams.serve(context, (context.peer(), request_id), prepare, _Writer(request_id), GRAPHSERVE_FIELDS)


def _token_logprob(lp: TokenLogprobs) -> inference_pb2.TokenLogprob:
    return inference_pb2.TokenLogprob(logprob=lp.logprob,
                                      top=[inference_pb2.TopLogprob(token_id=t, logprob=v) for t, v in lp.top])


class _Writer:
    def __init__(self, request_id: str) -> None:
        self.request_id = request_id

    def chunk(self, delta: TokenDelta, index: int) -> inference_pb2.GenerateResponse:
        chunk = inference_pb2.Chunk(token_ids=delta.token_ids, text=delta.text, index=index)
        if delta.logprobs is not None:
            chunk.logprobs.extend(map(_token_logprob, delta.logprobs))
        if delta.prompt_logprobs is not None:
            chunk.prompt_logprobs.extend(map(_token_logprob, delta.prompt_logprobs))
        return inference_pb2.GenerateResponse(request_id=self.request_id, chunk=chunk)

    def finished(self, f: Finish, index: int) -> list[inference_pb2.GenerateResponse]:
        msg = inference_pb2.Finished(
            index=index,
            finish_reason=_FINISH_REASONS[f.reason],
            usage=inference_pb2.Usage(prompt_tokens=f.prompt_tokens, completion_tokens=f.completion_tokens,
                                      cached_prompt_tokens=f.cached_tokens),
            timings=inference_pb2.Timings(
                queue_seconds=f.queue_seconds,
                time_to_first_token_seconds=f.time_to_first_token_seconds,
                total_seconds=f.total_seconds,
            ),
            seed=f.seed,
        )
        if isinstance(f.matched_stop, str):
            msg.stop_string = f.matched_stop
        elif isinstance(f.matched_stop, int):
            msg.stop_token_id = f.matched_stop
        last = [] if f.final_delta is None else [self.chunk(f.final_delta, index)]
        return [*last, inference_pb2.GenerateResponse(request_id=self.request_id, finished=msg)]


# ---- graphserve.v1 request -> checked values ----------------------------------------------------

def prompt_bytes(request: inference_pb2.GenerateRequest) -> int:
    """Bytes of a text prompt, or of a whole chat as sent (contents, roles and each message's framing:
    what it costs to hold and render); 0 for token ids."""
    kind = request.WhichOneof("prompt")
    if kind == "text":
        return len(request.text.encode("utf-8", "surrogatepass"))
    if kind == "messages":
        return request.messages.ByteSize()
    return 0


def _estimated_tokens(request: inference_pb2.GenerateRequest) -> int:
    """Prompt tokens before tokenization: exact for token ids, at most one token per byte for text."""
    return len(request.token_ids.ids) if request.WhichOneof("prompt") == "token_ids" else prompt_bytes(request)


def check_prompt_size(request: inference_pb2.GenerateRequest, limits: Limits) -> int:
    """Cheap checks done before any tokenization; returns the prompt's bytes (0 for token ids)."""
    kind = request.WhichOneof("prompt")
    need(kind is not None, "prompt: set text, token_ids or messages")
    if kind == "messages":
        count = len(request.messages.messages)
        need(count > 0, "prompt.messages is empty: send at least one message")
        need(count <= limits.max_chat_messages,
             f"prompt.messages holds {count} messages; at most {limits.max_chat_messages} are allowed "
             "(--max-chat-messages)")
        size = prompt_bytes(request)
        need(size <= limits.max_prompt_bytes,
             f"prompt.messages hold {size} bytes (contents, roles and per-message framing), over the limit of "
             f"{limits.max_prompt_bytes} bytes (--max-prompt-bytes)")
    elif kind == "text":
        size = prompt_bytes(request)
        need(size > 0, "prompt.text is empty: send at least one character")
        need(size <= limits.max_prompt_bytes,
             f"prompt.text is {size} bytes, over the limit of {limits.max_prompt_bytes} bytes (--max-prompt-bytes)")
    else:
        count = len(request.token_ids.ids)
        need(count > 0, "prompt.token_ids is empty: send at least one token id")
        need(count < limits.max_seq_len,
             f"prompt.token_ids has {count} tokens; the context holds {limits.max_seq_len} (--max-seq-len)")
        size = 0
    return size


def prompt_ids(request: inference_pb2.GenerateRequest, tokenizer: Any, limits: Limits) -> list[int]:
    kind = request.WhichOneof("prompt")
    if kind == "token_ids":
        return check_prompt_ids(request.token_ids.ids, limits, GRAPHSERVE_FIELDS)
    if kind == "messages":
        try:
            return chat_prompt_ids(tokenizer, list(request.messages.messages), model="this model",
                                   max_tokens=limits.max_seq_len - 1, max_messages=limits.max_chat_messages,
                                   special_tokens_in_content=limits.allow_chat_special_tokens)
        except ChatError as exc:
            raise InvalidRequest(str(exc)) from None
    ids = encode_capped(tokenizer, request.text, limits.max_seq_len - 1)
    need(len(ids) > 0, "prompt.text encodes to no tokens")
    return ids


def to_generation_request(request: inference_pb2.GenerateRequest, request_id: str, prompt: list[int], limits: Limits,
                          arrival_time: float | None = None) -> GenerationRequest:
    s, t = request.sampling, request.stopping
    params = SamplingParams(
        n=request.n if request.HasField("n") else 1,
        temperature=s.temperature if s.HasField("temperature") else 1.0,
        top_p=s.top_p if s.HasField("top_p") else 1.0,
        top_k=s.top_k,  # unsigned on the wire; 0 disables it
        seed=s.seed if s.HasField("seed") else None,
        max_tokens=t.max_tokens if t.HasField("max_tokens") else None,
        stop=tuple(t.stop), stop_token_ids=tuple(t.stop_token_ids), ignore_eos=t.ignore_eos,
        min_p=s.min_p, presence_penalty=s.presence_penalty, frequency_penalty=s.frequency_penalty,
        repetition_penalty=s.repetition_penalty if s.HasField("repetition_penalty") else 1.0,
        min_tokens=t.min_tokens, logit_bias=tuple(s.logit_bias.items()),
        logprobs=s.logprobs if s.HasField("logprobs") else None,
        constraint=constraint_of(s, limits, GRAPHSERVE_FIELDS),
        prompt_logprobs=s.prompt_logprobs if s.HasField("prompt_logprobs") else None,
        fields=GRAPHSERVE_FIELDS,
    )
    return generation_request(request_id, prompt, params, limits, GRAPHSERVE_FIELDS, adapter=request.adapter,
                              stream_interval=_stream_interval(request), arrival_time=arrival_time)


def _stream_interval(request: inference_pb2.GenerateRequest) -> int:
    if not request.HasField("stream_interval"):
        return 1
    value = request.stream_interval
    need(1 <= value <= MAX_STREAM_INTERVAL, f"stream_interval must be in [1, {MAX_STREAM_INTERVAL}], got {value}")
    return value
