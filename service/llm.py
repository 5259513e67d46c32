"""The in-process Python API: the server's engine, runner and graph cache, without gRPC.

    from service import LLM, SamplingParams

    with LLM(model="builtin:tiny") as llm:
        out = llm.generate(["Explain CUDA graphs"], SamplingParams(temperature=0, max_tokens=20))
        print(out[0].outputs[0].text)

The keywords are checked by the server's config validation (service/config.py); the model, runner,
graph cache and engine are built by the same builder as the server's engine process
(service/engine/builder.py), and the engine runs on its own thread. The LLM reaches it only as an
`EngineClient` (service/engine_client/), as the server's streams do. `generate` hands every prompt
(each of its n samples) to the engine at once (continuous batching) and returns when all are done,
in prompt order, as vLLM's RequestOutputs (service/outputs.py).
"""

from __future__ import annotations

import dataclasses
import gc
import itertools
import queue
import random
import threading
import time
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import structlog

from service.chat import ChatMessage, Conversation, chat_prompt
from service.config import ServeConfig
from service.engine import request as engine_request
from service.engine.constraint_limits import InvalidConstraint
from service.engine.request import Constraint  # noqa: F401 - exported: SamplingParams(constraint=Constraint(...))
from service.engine.sampling_params import PYTHON_FIELDS, SamplingParams
from service.engine.validation import (
    Limits,
    check_prompt_ids,
    constraint_message,
    generation_request,
    samples,
)
from service.engine_client.calls import CheckConstraint, ReadSnapshot
from service.engine_client.client import EngineClient
from service.llm_config import config_of
from service.outputs import CompletionOutput, RequestOutput, Timings, finish_reason, logprob_dicts

log = structlog.get_logger("graphserve.llm")

# A prompt: text, token ids, or vLLM's {"prompt": text} / {"prompt_token_ids": ids}.
PromptInput = str | Sequence[int] | Mapping[str, Any]
PROMPT_KEYS = ("prompt", "prompt_token_ids")
# How the Python API's messages name what they check.
LLM_FIELDS = PYTHON_FIELDS
# generate() shows a progress bar from this many prompts on (use_tqdm=None).
TQDM_MIN_PROMPTS = 8


def _need(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_not_bytes(prompt: object, name: str) -> None:
    # bytes are a sequence of ints: they would pass for token ids.
    if isinstance(prompt, bytes | bytearray | memoryview):
        raise TypeError(f"{name} is {type(prompt).__name__}: give text (decode it first, e.g. "
                        ".decode('utf-8')) or a list of token ids")


class _Collector:
    """The engine's sink for one sample of a prompt (called on the engine thread): gathers its tokens
    and text, and reports the prompt's index to `done` when it ends."""

    __slots__ = ("index", "done", "token_ids", "text", "logprobs", "prompt_logprobs", "finish", "error")

    def __init__(self, index: int, done: queue.SimpleQueue) -> None:
        self.index, self.done = index, done
        self.token_ids: list[int] = []
        self.text = ""
        self.logprobs: list[engine_request.TokenLogprobs] | None = None
        self.prompt_logprobs: list[engine_request.TokenLogprobs | None] | None = None
        self.finish: engine_request.Finish | None = None
        self.error: engine_request.EngineError | None = None

    def __call__(self, event: engine_request.RequestEvent) -> None:
        if isinstance(event, engine_request.TokenDelta):
            self._add(event)
            return
        if isinstance(event, engine_request.Finish):
            if event.final_delta is not None:
                self._add(event.final_delta)
            self.finish = event
        else:
            self.error = event
        self.done.put(self.index)

    def _add(self, delta: engine_request.TokenDelta) -> None:
        self.token_ids += delta.token_ids
        self.text += delta.text
        if delta.logprobs is not None:
            self.logprobs = (self.logprobs or []) + delta.logprobs
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = [None, *delta.prompt_logprobs]


_open_lock = threading.Lock()
_num_open = 0  # LLMs whose engine is not released yet


def _opened() -> None:
    global _num_open
    with _open_lock:
        _num_open += 1


def _release(held: dict[str, EngineClient]) -> None:
    """Stop the engine and free what it holds. The runner's warm-up froze every object alive then
    (gc.freeze, so that collections while serving skip the model), the model's reference cycles
    included: only a collection after gc.unfreeze() frees them. What other open LLMs hold is frozen
    again."""
    global _num_open
    engine = held["engine"]
    engine.stop()
    held.clear()
    del engine
    with _open_lock:
        _num_open -= 1
        others = _num_open
    gc.unfreeze()
    gc.collect()
    if others:
        gc.freeze()
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()


class LLM:
    """A model served in this process: `generate` for prompts, `chat` for conversations.

    Keywords (besides `model`, "builtin:<name>" or a local Hugging Face directory): llm_config.KEYWORDS;
    an unknown one is a TypeError. The device is held until `close()` (or the end of a `with` block).
    """

    def __init__(self, model: str = ServeConfig.model, **options: Any) -> None:
        self.config = config = config_of(model, options)
        if not structlog.is_configured():
            from service.telemetry.log import configure_logging

            configure_logging("console", config.log_level)
        from service.engine_client.in_process import InProcessEngine

        t0 = time.monotonic()
        engine = InProcessEngine.load(config)
        facts = engine.facts
        self.adapters: tuple[str, ...] = facts.adapters
        # The engine (its thread, runner, model, KV cache and graphs) is released once: by close(), when
        # this LLM is garbage-collected, or at interpreter exit, whichever comes first.
        self._held: dict[str, EngineClient] = {"engine": engine}
        self._finalizer = weakref.finalize(self, _release, self._held)
        _opened()
        engine.start()
        self.tokenizer = engine.tokenizer
        self.max_seq_len = facts.max_seq_len
        self.vocab_size = facts.spec.vocab_size
        # The server's request limits; no server cap on max_tokens beyond the context.
        self._limits = dataclasses.replace(Limits.from_config(config, self.vocab_size),
                                           max_seq_len=self.max_seq_len, max_tokens_limit=2**31)
        seed = options.get("seed")
        self._seeds = random.Random(seed) if seed is not None else None
        self._ids = itertools.count()
        log.info("llm_ready", model=config.model, device=facts.device, graph_mode=facts.graph_mode,
                 seconds=round(time.monotonic() - t0, 2))

    # ---- generation ---------------------------------------------------------------------------

    def generate(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool | None = None,
        lora_adapter_names: Sequence[str] | None = None,
    ) -> list[RequestOutput]:
        """Complete a prompt or each of a list of prompts: text, token-id lists, or vLLM's
        {"prompt": text} and {"prompt_token_ids": ids}. One RequestOutput per prompt, in order. A
        progress bar shows from TQDM_MIN_PROMPTS prompts on (use_tqdm=None). lora_adapter_names: one
        adapter name (of lora_weights) for every prompt, or one per prompt; "" is the base model."""
        _check_not_bytes(prompts, "prompts")
        if not isinstance(prompts, Sequence | Mapping):
            raise TypeError(f"prompts must be a string, a list of token ids, a {{'prompt_token_ids': ids}} dict "
                            f"or a list of those, not {type(prompts).__name__}")
        items = [prompts] if isinstance(prompts, str | Mapping) or (
            prompts and all(_is_int(t) for t in prompts)) else list(prompts)
        encoded = [self._encode(i, p) for i, p in enumerate(items)]
        return self._run(encoded, sampling_params, use_tqdm, self._adapter_names(lora_adapter_names, len(encoded)))

    def _encode(self, index: int, prompt: PromptInput) -> tuple[str | None, list[int]]:
        """(text or None, token ids) of one prompt."""
        if isinstance(prompt, Mapping):
            unknown = sorted(set(prompt) - set(PROMPT_KEYS))
            _need(not unknown, f"prompt {index}: {', '.join(map(repr, unknown))} not supported (graphserve serves "
                               "text-only models); give 'prompt' (text) or 'prompt_token_ids'")
            _need(len(prompt) == 1, f"prompt {index}: give one of 'prompt' (text) or 'prompt_token_ids'")
            [(key, prompt)] = prompt.items()
            _need(isinstance(prompt, str) == (key == "prompt"),
                  f"prompt {index}: 'prompt' takes text and 'prompt_token_ids' a list of token ids, "
                  f"not {type(prompt).__name__}")
        _check_not_bytes(prompt, f"prompt {index}")
        if isinstance(prompt, str):
            _need(prompt != "", f"prompt {index} is empty")
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=True)
        _need(isinstance(prompt, Sequence) and all(_is_int(t) for t in prompt),
              f"prompt {index} must be a string or a list of token ids, not {type(prompt).__name__}")
        return None, list(prompt)

    def get_tokenizer(self) -> Any:
        """The model's tokenizer (a transformers tokenizer), the one generate() encodes text with."""
        return self.tokenizer

    def _adapter_names(self, names: str | Sequence[str] | None, count: int) -> list[str]:
        if names is None:
            return [""] * count
        names = [names] if isinstance(names, str) else list(names)
        _need(len(names) in (1, count), f"{len(names)} lora_adapter_names for {count} prompts: give one, or one per prompt")
        for name in names:
            _need(name == "" or name in self.adapters,
                  f"lora adapter {name!r} is not loaded; loaded: {list(self.adapters) or 'none'} (lora_weights)")
        return names * count if len(names) == 1 else names

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool | None = None,
    ) -> list[RequestOutput]:
        """Answer a conversation (a list of {"role", "content"} messages) or each of a list of them,
        rendered with the model's chat template and its generation prompt."""
        many = isinstance(messages, Sequence) and bool(messages) and not isinstance(messages[0], Mapping | ChatMessage)
        conversations = list(messages) if many else [messages]
        encoded: list[tuple[str | None, list[int]]] = [
            chat_prompt(self.tokenizer, conversation, model=self.config.model) for conversation in conversations]
        return self._run(encoded, sampling_params, use_tqdm)

    def _run(self, encoded: list[tuple[str | None, list[int]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None,
             use_tqdm: bool | None, adapters: list[str] | None = None) -> list[RequestOutput]:
        self._check_open()
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(encoded)
        else:
            params = list(sampling_params)
            _need(len(params) == len(encoded),
                  f"{len(params)} SamplingParams for {len(encoded)} prompts: give one, or one per prompt")
        adapters = adapters or [""] * len(encoded)
        # Every prompt is checked before any is submitted: a bad one must not leave the others running.
        requests = [self._samples(i, ids, p, adapter)
                    for i, ((_, ids), p, adapter) in enumerate(zip(encoded, params, adapters))]
        engine = self._engine  # held here: close() from another thread may run while we wait
        done: queue.SimpleQueue = queue.SimpleQueue()
        collectors = [[_Collector(i, done) for _ in prompt_samples] for i, prompt_samples in enumerate(requests)]
        sequences = [(r, c) for rs, cs in zip(requests, collectors) for r, c in zip(rs, cs)]
        show = len(requests) >= TQDM_MIN_PROMPTS if use_tqdm is None else use_tqdm
        keys: list[str] = []
        try:
            for request, collector in sequences:
                keys.append(engine.submit(request, collector))
            self._wait(engine, done, [len(rs) for rs in requests], show)
        except BaseException:  # KeyboardInterrupt, a failed engine: nothing keeps running for us
            for key, (_, collector) in zip(keys, sequences):
                if collector.finish is None:
                    engine.abort(key)
            raise
        return [self._output(rs[0].request_id, prompt, rs[0].prompt_token_ids, cs, p)
                for (prompt, _), rs, cs, p in zip(encoded, requests, collectors, params)]

    def _samples(self, index: int, ids: list[int], p: SamplingParams,
                 adapter: str) -> list[engine_request.GenerationRequest]:
        """The engine's requests of one prompt, one per sample (seed, seed + 1, ...), checked by the
        server's checks (validation.py): ValueError naming the field."""
        fields = dataclasses.replace(LLM_FIELDS, prompt_ids=f"prompt {index}")
        if p.seed is None and self._seeds is not None:
            p = dataclasses.replace(p, seed=self._seeds.getrandbits(63))
        if p.truncate_prompt_tokens is not None:  # vLLM's: the last k tokens (-1: as many as the context holds)
            ids = ids[-(self.max_seq_len if p.truncate_prompt_tokens == -1 else p.truncate_prompt_tokens):]
        request = generation_request(f"llm-{next(self._ids)}", check_prompt_ids(ids, self._limits, fields), p,
                                     self._limits, fields, adapter=adapter)
        if p.constraint is not None:  # compiled now (bounded, cached): a bad one fails before any submit
            try:
                self._engine.request(CheckConstraint(p.constraint))
            except InvalidConstraint as exc:
                raise ValueError(constraint_message(p.constraint.kind, str(exc), fields)) from None
        # Nothing streams: the text arrives in one piece with the finish.
        return samples(dataclasses.replace(request, stream_interval=request.sampling.max_tokens))

    @staticmethod
    def _wait(engine: EngineClient, done: queue.SimpleQueue, samples_per_prompt: list[int], show: bool) -> None:
        """Until every sample ended; the bar counts the prompts whose samples all ended."""
        from tqdm.auto import tqdm

        left = list(samples_per_prompt)
        with tqdm(total=len(left), desc="Generating", unit="prompt", disable=not show) as bar:
            running = sum(left)
            while running:
                try:
                    index = done.get(timeout=1.0)
                except queue.Empty:
                    if not engine.alive:
                        raise RuntimeError(f"the engine stopped: {engine.error!r}") from None
                    continue
                running -= 1
                left[index] -= 1
                if not left[index]:
                    bar.update(1)

    def _output(self, request_id: str, prompt: str | None, ids: list[int], collectors: list[_Collector],
                params: SamplingParams) -> RequestOutput:
        outputs = [self._completion(i, c, params) for i, c in enumerate(collectors)]
        prompt_logprobs = collectors[0].prompt_logprobs
        if prompt_logprobs is not None:
            prompt_logprobs = [None, *logprob_dicts(ids[1:], prompt_logprobs[1:], self._decode_token)]
        return RequestOutput(request_id=request_id, prompt=prompt, prompt_token_ids=ids,
                             prompt_logprobs=prompt_logprobs, outputs=outputs, finished=True,
                             num_cached_tokens=collectors[0].finish.cached_tokens)

    def _completion(self, index: int, c: _Collector, params: SamplingParams) -> CompletionOutput:
        if c.finish is None and not self._finalizer.alive:
            raise RuntimeError("this LLM was closed (close(), or the interpreter exiting) while generate() ran")
        if isinstance(c.error, engine_request.ConstraintFailed):  # the request's fault, as a bad argument is
            raise ValueError(constraint_message(c.error.kind, c.error.message, LLM_FIELDS))
        if c.finish is None:
            raise RuntimeError(c.error.message if c.error else "the engine ended the request without a result")
        f = c.finish
        text = c.text if params.detokenize else ""
        if params.include_stop_str_in_output and isinstance(f.matched_stop, str):
            text += f.matched_stop
        logprobs = cumulative = None
        if params.logprobs is not None:
            decode = self._decode_token if params.detokenize else lambda _: None
            logprobs = logprob_dicts(c.token_ids, c.logprobs or [], decode)
            cumulative = sum(lp.logprob for lp in c.logprobs or [])
        return CompletionOutput(
            index=index, text=text, token_ids=c.token_ids, cumulative_logprob=cumulative, logprobs=logprobs,
            finish_reason=finish_reason(f.reason), stop_reason=f.matched_stop, seed=f.seed,
            timings=Timings(f.queue_seconds, f.time_to_first_token_seconds, f.total_seconds),
        )

    def _decode_token(self, token_id: int) -> str:
        """A token's text alone, as vLLM's Logprob.decoded_token."""
        return self.tokenizer.decode([token_id])

    # ---- graph cache and lifetime -------------------------------------------------------------

    def graph_cache_state(self) -> Any:
        """The graph cache's state (cache_manager.CacheSnapshot), as the admin RPC reports it: mode,
        device, budget and used bytes, capture sizes and each bucket's state and counters."""
        self._check_open()
        return self._engine.request(ReadSnapshot())

    def close(self) -> None:
        """Stop the engine, save the graph statistics and release the model, the KV cache and the
        graphs (host and device memory). Idempotent."""
        self._finalizer()

    @property
    def _engine(self) -> EngineClient:
        return self._held["engine"]

    def _check_open(self) -> None:
        if not self._finalizer.alive:
            raise RuntimeError("this LLM is closed; create a new one")

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
