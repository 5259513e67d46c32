"""The in-process Python API: the server's engine, runner and graph cache, without gRPC.

    from service import LLM, SamplingParams

    with LLM(model="builtin:tiny") as llm:
        out = llm.generate(["Explain CUDA graphs"], SamplingParams(temperature=0, max_tokens=20))
        print(out[0].text)

The keywords are checked by the server's config validation (service/config.py); the model, runner,
graph cache and engine are built by the same builder as the server's engine process
(service/engine/builder.py), and the engine runs on its own thread. `generate` hands every prompt
(each of its n samples) to the engine at once (continuous batching) and returns when all are done,
in prompt order.
"""

from __future__ import annotations

import dataclasses
import gc
import itertools
import os
import queue
import random
import re
import threading
import time
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from service.chat import ChatMessage, Conversation, chat_prompt
from service.config import ConfigError, ServeConfig, default_max_running_seqs
from service.engine import request as engine_request
from service.engine.constraint_limits import InvalidConstraint
from service.engine.request import Constraint  # noqa: F401 - exported: SamplingParams(constraint=Constraint(...))
from service.server.validation import (
    MAX_SAMPLES,
    Fields,
    Limits,
    RequestValues,
    check_constraint,
    check_prompt_ids,
    check_samples,
    check_sampling,
    constraint_message,
    generation_request,
    samples,
)

log = structlog.get_logger("graphserve.llm")

PromptInput = str | Sequence[int]
# How the Python API's messages name what they check.
LLM_FIELDS = Fields("SamplingParams.", "SamplingParams.", "prompt", "max_seq_len")
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


@dataclass(frozen=True)
class SamplingParams:
    """How to sample the completions of a prompt and when to stop each.

    temperature 0 is greedy. top_k 0 (or -1) and top_p 1 disable those filters. The same seed, prompt
    and parameters give the same tokens whatever else shares the batch; seed None draws one (or
    takes the next of the LLM's `seed`). max_tokens None is the LLM's `default_max_tokens`, capped by
    the room the context leaves. Generation stops before a `stop` string (not included in the text)
    and after a token of `stop_token_ids` or the model's end-of-sequence token (unless ignore_eos).

    As in vLLM: min_p drops tokens below min_p x the top token's probability; presence_penalty and
    frequency_penalty (OpenAI's, in [-2, 2]) lower the logits of tokens the completion holds (once, and
    per occurrence); repetition_penalty (transformers', > 0, 1 is off) divides the positive logits and
    multiplies the negative ones of every token in the prompt or the completion; min_tokens keeps EOS,
    the stop token ids and the stop strings from ending the completion earlier; logit_bias adds a
    value in [-100, 100] to a token's logit. logprobs: the log-probability of each completion token and
    of the `logprobs` most likely ones (0 to 20), the model's own (before the processing above);
    prompt_logprobs: the same for each prompt token after the first (such a prompt takes nothing
    from the prefix cache).
    constraint: the completion follows a JSON schema, any JSON object, a regex, an EBNF grammar or one
    of a list of choices (Constraint, exported here), and ends when the grammar is complete.
    n: independent completions of the prompt (1 to 16), completion i sampled with seed + i; they share
    the prompt's prefill through the prefix cache.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    max_tokens: int | None = None
    stop: str | Sequence[str] | None = None
    stop_token_ids: Sequence[int] | None = None
    ignore_eos: bool = False
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    logit_bias: dict[int, float] | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    # Structured output, e.g. Constraint("json_schema", schema_text), Constraint("choice", ("yes", "no"))
    constraint: engine_request.Constraint | None = None
    n: int = 1

    def __post_init__(self) -> None:
        # Python types here; the values are checked by the server's own checks (validation.py).
        t, p = self.temperature, self.top_p
        _need(isinstance(t, int | float) and not isinstance(t, bool),
              f"SamplingParams.temperature must be a finite number >= 0 (0 is greedy), got {t!r}")
        _need(isinstance(p, int | float) and not isinstance(p, bool), f"SamplingParams.top_p must be in (0, 1], got {p!r}")
        _need(_is_int(self.top_k) and self.top_k >= -1, f"SamplingParams.top_k must be an int >= 0 (0 or -1: off), got {self.top_k!r}")
        _need(self.seed is None or _is_int(self.seed), f"SamplingParams.seed must be None or an int in [0, 2**64), got {self.seed!r}")
        _need(self.max_tokens is None or (_is_int(self.max_tokens) and self.max_tokens >= 1),
              f"SamplingParams.max_tokens must be None or an int >= 1, got {self.max_tokens!r}")
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        _need(all(isinstance(s, str) and s for s in stop), f"SamplingParams.stop must hold non-empty strings, got {self.stop!r}")
        _need(isinstance(self.ignore_eos, bool), f"SamplingParams.ignore_eos must be True or False, got {self.ignore_eos!r}")
        ids = tuple(self.stop_token_ids or ())
        _need(all(_is_int(i) and i >= 0 for i in ids), f"SamplingParams.stop_token_ids must hold token ids >= 0, got {ids!r}")
        for name in ("min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            value = getattr(self, name)
            _need(isinstance(value, int | float) and not isinstance(value, bool),
                  f"SamplingParams.{name} must be a number, got {value!r}")
        _need(_is_int(self.min_tokens), f"SamplingParams.min_tokens must be an int >= 0, got {self.min_tokens!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _need(value is None or _is_int(value), f"SamplingParams.{name} must be None or an int in [0, 20], got {value!r}")
        bias = dict(self.logit_bias or {})
        _need(all(_is_int(t) and isinstance(b, int | float) and not isinstance(b, bool) for t, b in bias.items()),
              f"SamplingParams.logit_bias must map token ids to numbers, got {self.logit_bias!r}")
        object.__setattr__(self, "logit_bias", bias)
        _need(self.constraint is None or isinstance(self.constraint, engine_request.Constraint),
              f"SamplingParams.constraint must be None or a Constraint, got {self.constraint!r}")
        object.__setattr__(self, "top_k", max(0, self.top_k))
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "stop_token_ids", ids)
        _need(_is_int(self.n), f"SamplingParams.n must be an int in [1, {MAX_SAMPLES}], got {self.n!r}")
        check_sampling(self.values(), LLM_FIELDS)
        check_samples(self.n, "SamplingParams.n")

    def values(self) -> RequestValues:
        return RequestValues(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, seed=self.seed,
                             max_tokens=self.max_tokens, stop=self.stop, stop_token_ids=self.stop_token_ids,
                             ignore_eos=self.ignore_eos, min_p=self.min_p, presence_penalty=self.presence_penalty,
                             frequency_penalty=self.frequency_penalty, repetition_penalty=self.repetition_penalty,
                             min_tokens=self.min_tokens, logit_bias=tuple(self.logit_bias.items()),
                             logprobs=self.logprobs, constraint=self.constraint, prompt_logprobs=self.prompt_logprobs)


@dataclass(frozen=True)
class Timings:
    queue_seconds: float  # from submit to the first scheduling step
    time_to_first_token_seconds: float
    total_seconds: float


@dataclass(frozen=True)
class Completion:
    """One of a prompt's n completions (SamplingParams.n)."""

    index: int  # 0 to n - 1
    text: str
    token_ids: list[int]  # the completion's tokens; a stop token or EOS that ended it is not included
    finish_reason: str  # "length", "eos", "stop" or "abort"
    stop_reason: str | int | None  # the stop string or stop token id that ended it
    seed: int  # the seed that drove sampling: the first completion's + index
    timings: Timings
    # Per completion token, when SamplingParams.logprobs asked: its log-probability and the top ones.
    logprobs: list[engine_request.TokenLogprobs] | None = None


@dataclass(frozen=True)
class GenerationOutput:
    """One prompt's completions. text, token_ids, finish_reason, stop_reason, seed, timings and
    logprobs are those of completions[0] (the only one when n is 1)."""

    prompt: str | None  # the text (for chat: as the template rendered it); None for token ids
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str
    stop_reason: str | int | None
    seed: int
    timings: Timings
    logprobs: list[engine_request.TokenLogprobs] | None = None
    cached_tokens: int = 0  # prompt tokens found in the prefix cache (by the first completion)
    completions: list[Completion] = dataclasses.field(default_factory=list)  # all n, in index order
    # Per prompt token, when SamplingParams.prompt_logprobs asked: None for the first, then its
    # log-probability given the tokens before it and the top ones there (as vLLM returns them).
    prompt_logprobs: list[engine_request.TokenLogprobs | None] | None = None


@dataclass(frozen=True)
class _Options:
    """LLM's keywords besides `model`. The seed's vLLM-style names map onto the server's config."""

    tensor_parallel_size: int = 1
    # LoRA adapter directories (PEFT): "PATH" (its name is the path as given) or "NAME=PATH", or a list
    lora_weights: str | Path | Sequence[str | Path] | None = None
    max_loras: int = 0  # device slots (0: 4, or as many adapters as lora_weights names, whichever is more)
    max_lora_rank: int = ServeConfig.max_lora_rank
    cudagraph_mode: str = ServeConfig.cudagraph_mode  # any case: "FULL", "full", "none"
    cudagraph_capture_sizes: Sequence[int] | None = None
    device: str = ServeConfig.device
    dtype: Any = ServeConfig.dtype  # "auto", "float32", ... or a torch.dtype
    max_running_seqs: int | None = None  # default: the server's, raised to the largest capture size
    max_seq_len: int = ServeConfig.max_seq_len
    max_num_batched_tokens: int = ServeConfig.max_num_batched_tokens
    default_max_tokens: int = ServeConfig.default_max_tokens
    overlap_steps: bool = ServeConfig.overlap_steps
    # Each prompt's tokens independent of the other prompts and of chunking (ServeConfig.batch_invariant)
    batch_invariant: bool = ServeConfig.batch_invariant
    # Paged KV (ServeConfig.block_size, kv_cache_memory, prefix_caching; vLLM's enable_prefix_caching)
    block_size: int = ServeConfig.block_size
    kv_cache_memory: str | int | float = ServeConfig.kv_cache_memory
    kv_cache_dtype: str = ServeConfig.kv_cache_dtype  # "auto" (the model's dtype) or "fp8", as vLLM's
    enable_prefix_caching: bool = ServeConfig.prefix_caching
    graph_memory_budget: str | None = None
    stats_file: str | Path | None = None
    warm_start: bool = ServeConfig.warm_start
    model_cache_dir: str | Path | None = None
    seed: int | None = None  # seeds the seeds of requests that give none
    log_level: str = "warning"  # used only when the program has not configured structlog


VALID_KEYWORDS = ("model", *(f.name for f in dataclasses.fields(_Options)))
# Config flags whose LLM keyword has another name (for error messages).
_KEYWORD_OF_FLAG = {"capture-sizes": "cudagraph_capture_sizes", "lora-modules": "lora_weights",
                    "prefix-caching": "enable_prefix_caching"}


def _config_of(model: str, o: _Options) -> ServeConfig:
    """The server's config for these keywords, validated by the server's own checks."""
    sizes = None if o.cudagraph_capture_sizes is None else ",".join(str(s) for s in o.cudagraph_capture_sizes)
    max_running = o.max_running_seqs
    if max_running is None:  # capture sizes above the default batch would be refused: raise the batch
        largest = max((s for s in o.cudagraph_capture_sizes or () if _is_int(s)), default=0)
        max_running = max(default_max_running_seqs(o.device), largest)
    mode = o.cudagraph_mode.value if hasattr(o.cudagraph_mode, "value") else o.cudagraph_mode
    dtype = o.dtype if isinstance(o.dtype, str) else str(o.dtype).removeprefix("torch.")
    config = ServeConfig(
        model=str(model), model_cache_dir=None if o.model_cache_dir is None else Path(o.model_cache_dir),
        device=o.device, dtype=dtype, tensor_parallel_size=o.tensor_parallel_size,
        max_running_seqs=max_running, max_seq_len=o.max_seq_len,
        max_num_batched_tokens=o.max_num_batched_tokens, default_max_tokens=o.default_max_tokens,
        max_tokens_limit=max(ServeConfig.max_tokens_limit, o.default_max_tokens), overlap_steps=o.overlap_steps,
        batch_invariant=o.batch_invariant, block_size=o.block_size, kv_cache_memory=str(o.kv_cache_memory),
        kv_cache_dtype=o.kv_cache_dtype, prefix_caching=o.enable_prefix_caching,
        cudagraph_mode=str(mode).lower(), capture_sizes=sizes,
        graph_memory_budget=None if o.graph_memory_budget is None else str(o.graph_memory_budget),
        stats_file=None if o.stats_file is None else Path(o.stats_file), warm_start=o.warm_start,
        log_level=o.log_level, lora_modules=_lora_modules(o.lora_weights),
        max_loras=o.max_loras or (max(4, len(_lora_entries(o.lora_weights))) if o.lora_weights else 0),
        max_lora_rank=o.max_lora_rank,
    )
    try:
        config.validate()
    except ConfigError as exc:  # the server names its flags; name the keywords instead
        message = re.sub(r"--([a-z][a-z-]*)", lambda m: _KEYWORD_OF_FLAG.get(m[1], m[1].replace("-", "_")), str(exc))
        raise ConfigError(message) from None
    return config


_INT_KEYWORDS = ("tensor_parallel_size", "max_loras", "max_lora_rank", "max_seq_len", "max_num_batched_tokens",
                 "default_max_tokens", "block_size")
_BOOL_KEYWORDS = ("overlap_steps", "batch_invariant", "warm_start", "enable_prefix_caching")


def _check_types(o: _Options) -> None:
    """TypeError for a keyword of the wrong type, before any is used: the server's flags are parsed
    as their type, so neither takes "8" for 8 nor "no" (a true string) for False."""
    def need(ok: bool, name: str, what: str) -> None:
        if not ok:
            value = getattr(o, name)
            raise TypeError(f"{name} must be {what}, got {value!r} ({type(value).__name__})")

    for name in _INT_KEYWORDS:
        need(_is_int(getattr(o, name)), name, "an int")
    for name in ("max_running_seqs", "seed"):
        need(getattr(o, name) is None or _is_int(getattr(o, name)), name, "an int or None")
    for name in _BOOL_KEYWORDS:
        need(isinstance(getattr(o, name), bool), name, "True or False")
    for name in ("device", "log_level", "kv_cache_dtype"):
        need(isinstance(getattr(o, name), str), name, "a string")
    sizes = o.cudagraph_capture_sizes
    need(sizes is None or (isinstance(sizes, Sequence) and not isinstance(sizes, str | bytes)
                           and all(_is_int(s) for s in sizes)), "cudagraph_capture_sizes", "None or a list of ints")
    kv = o.kv_cache_memory
    need(isinstance(kv, str | int | float) and not isinstance(kv, bool), "kv_cache_memory",
         "'auto', bytes ('8GiB', 8 << 30) or a fraction of device memory (0.5)")
    budget = o.graph_memory_budget
    need(budget is None or (isinstance(budget, str | int | float) and not isinstance(budget, bool)),
         "graph_memory_budget", "None, bytes ('8GiB', 8 << 30) or a fraction of device memory (0.2)")
    for name in ("stats_file", "model_cache_dir"):
        need(getattr(o, name) is None or isinstance(getattr(o, name), str | os.PathLike), name, "None or a path")


def _check_unavailable(o: _Options) -> None:
    tp = o.tensor_parallel_size
    if not _is_int(tp) or tp < 1:
        raise ValueError(f"tensor_parallel_size must be an int >= 1, got {tp!r}")
    for _, path in _lora_entries(o.lora_weights):
        if not Path(path).is_dir():
            raise ConfigError(f"lora_weights: {path!r} is not a directory; give PEFT adapter directories "
                              "(adapter_config.json + adapter_model.safetensors), as 'PATH' or 'NAME=PATH'")


def _lora_entries(weights: str | Path | Sequence[str | Path] | None) -> list[tuple[str, str]]:
    """lora_weights as (name, path): "NAME=PATH" names it, a bare path is its own name."""
    if weights is None:
        return []
    items = [weights] if isinstance(weights, str | Path) else list(weights)
    entries = []
    for item in map(str, items):
        name, sep, path = item.partition("=")
        entries.append((name, path) if sep and name and not Path(item).is_dir() else (item, item))
    return entries


def _lora_modules(weights: str | Path | Sequence[str | Path] | None) -> str | None:
    entries = _lora_entries(weights)
    return ",".join(f"{name}={path}" for name, path in entries) or None


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


def _release(held: dict[str, Any]) -> None:
    """Stop the engine and free what it holds. The runner's warm-up froze every object alive then
    (gc.freeze, so that collections while serving skip the model), the model's reference cycles
    included: only a collection after gc.unfreeze() frees them. What other open LLMs hold is frozen
    again."""
    global _num_open
    from service.engine.builder import close_engine

    engine = held["engine"]
    close_engine(engine, engine.runner.graphs)
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

    Keywords (besides `model`, "builtin:<name>" or a local Hugging Face directory): see VALID_KEYWORDS;
    an unknown one is a TypeError. The device is held until `close()` (or the end of a `with` block).
    """

    def __init__(self, model: str = ServeConfig.model, **options: Any) -> None:
        unknown = sorted(set(options) - set(VALID_KEYWORDS))
        if unknown:
            raise TypeError(f"LLM() got unexpected keyword argument(s) {', '.join(map(repr, unknown))}; "
                            f"valid keywords: {', '.join(VALID_KEYWORDS)}")
        o = _Options(**options)
        _check_types(o)
        _check_unavailable(o)
        self.config = config = _config_of(model, o)
        if not structlog.is_configured():
            from service.telemetry.log import configure_logging

            configure_logging("console", config.log_level)
        from service.engine.builder import load_runner, new_engine

        t0 = time.monotonic()
        lr = load_runner(config)
        self.adapters: tuple[str, ...] = tuple(lr.adapters.names) if lr.adapters is not None else ()
        # The engine (its thread, runner, model, KV cache and graphs) is released once: by close(), when
        # this LLM is garbage-collected, or at interpreter exit, whichever comes first.
        self._held: dict[str, Any] = {"engine": new_engine(config, lr)}
        self._finalizer = weakref.finalize(self, _release, self._held)
        _opened()
        self._engine.start()
        self.tokenizer = lr.loaded.tokenizer
        self.max_seq_len = lr.max_seq_len
        self.vocab_size = lr.loaded.spec.vocab_size
        # The server's request limits; no server cap on max_tokens beyond the context.
        self._limits = dataclasses.replace(Limits.from_config(config, self.vocab_size),
                                           max_seq_len=self.max_seq_len, max_tokens_limit=2**31)
        self._seeds = random.Random(o.seed) if o.seed is not None else None
        self._ids = itertools.count()
        log.info("llm_ready", model=config.model, device=str(lr.loaded.device), graph_mode=lr.mode.value,
                 seconds=round(time.monotonic() - t0, 2))

    # ---- generation ---------------------------------------------------------------------------

    def generate(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool | None = None,
        lora_adapter_names: Sequence[str] | None = None,
    ) -> list[GenerationOutput]:
        """Complete a prompt or each of a list of prompts (text, or token-id lists). One output per
        prompt, in order. A progress bar shows from TQDM_MIN_PROMPTS prompts on (use_tqdm=None).
        lora_adapter_names: one adapter name (of lora_weights) for every prompt, or one per prompt;
        "" is the base model."""
        _check_not_bytes(prompts, "prompts")
        if not isinstance(prompts, Sequence):
            raise TypeError(f"prompts must be a string, a list of token ids or a list of those, "
                            f"not {type(prompts).__name__}")
        items = [prompts] if isinstance(prompts, str) or (
            prompts and all(_is_int(t) for t in prompts)) else list(prompts)
        encoded = []
        for i, p in enumerate(items):
            _check_not_bytes(p, f"prompt {i}")
            if isinstance(p, str):
                _need(p != "", f"prompt {i} is empty")
                encoded.append((p, self.tokenizer.encode(p, add_special_tokens=True)))
            else:
                _need(isinstance(p, Sequence) and all(_is_int(t) for t in p),
                      f"prompt {i} must be a string or a list of token ids, not {type(p).__name__}")
                encoded.append((None, list(p)))
        return self._run(encoded, sampling_params, use_tqdm, self._adapter_names(lora_adapter_names, len(encoded)))

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
    ) -> list[GenerationOutput]:
        """Answer a conversation (a list of {"role", "content"} messages) or each of a list of them,
        rendered with the model's chat template and its generation prompt."""
        many = isinstance(messages, Sequence) and bool(messages) and not isinstance(messages[0], Mapping | ChatMessage)
        conversations = list(messages) if many else [messages]
        encoded: list[tuple[str | None, list[int]]] = [
            chat_prompt(self.tokenizer, conversation, model=self.config.model) for conversation in conversations]
        return self._run(encoded, sampling_params, use_tqdm)

    def _run(self, encoded: list[tuple[str | None, list[int]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None,
             use_tqdm: bool | None, adapters: list[str] | None = None) -> list[GenerationOutput]:
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
        return [self._output(prompt, ids, cs, p) for (prompt, ids), cs, p in zip(encoded, collectors, params)]

    def _samples(self, index: int, ids: list[int], p: SamplingParams,
                 adapter: str) -> list[engine_request.GenerationRequest]:
        """The engine's requests of one prompt, one per sample (seed, seed + 1, ...), checked by the
        server's checks (validation.py): ValueError naming the field."""
        fields = dataclasses.replace(LLM_FIELDS, prompt_ids=f"prompt {index}")
        values = p.values()
        if values.seed is None and self._seeds is not None:
            values = dataclasses.replace(values, seed=self._seeds.getrandbits(63))
        check_constraint(values, self._limits, fields)
        if values.constraint is not None:  # compiled now (bounded, cached): a bad one fails before any submit
            try:
                self._engine.constraints.preparer.prepare_now(values.constraint)
            except InvalidConstraint as exc:
                raise ValueError(constraint_message(values.constraint.kind, str(exc), fields)) from None
        request = generation_request(f"llm-{next(self._ids)}", check_prompt_ids(ids, self._limits, fields), values,
                                     self._limits, fields, adapter=adapter)
        # Nothing streams: the text arrives in one piece with the finish.
        request = dataclasses.replace(request, stream_interval=request.stopping.max_tokens)
        return samples(request, p.n, "SamplingParams.n")

    @staticmethod
    def _wait(engine: Any, done: queue.SimpleQueue, samples_per_prompt: list[int], show: bool) -> None:
        """Until every sample ended; the bar counts the prompts whose samples all ended."""
        from tqdm.auto import tqdm

        left = list(samples_per_prompt)
        with tqdm(total=len(left), desc="Generating", unit="prompt", disable=not show) as bar:
            running = sum(left)
            while running:
                try:
                    index = done.get(timeout=1.0)
                except queue.Empty:
                    if not engine.thread_alive:
                        raise RuntimeError(f"the engine stopped: {engine.error!r}") from None
                    continue
                running -= 1
                left[index] -= 1
                if not left[index]:
                    bar.update(1)

    def _output(self, prompt: str | None, ids: list[int], collectors: list[_Collector],
                params: SamplingParams) -> GenerationOutput:
        completions = [self._completion(i, c, params) for i, c in enumerate(collectors)]
        first = completions[0]
        return GenerationOutput(
            prompt=prompt, prompt_token_ids=ids, text=first.text, token_ids=first.token_ids,
            finish_reason=first.finish_reason, stop_reason=first.stop_reason, seed=first.seed, timings=first.timings,
            logprobs=first.logprobs, cached_tokens=collectors[0].finish.cached_tokens, completions=completions,
            prompt_logprobs=collectors[0].prompt_logprobs,
        )

    def _completion(self, index: int, c: _Collector, params: SamplingParams) -> Completion:
        if c.finish is None and not self._finalizer.alive:
            raise RuntimeError("this LLM was closed (close(), or the interpreter exiting) while generate() ran")
        if isinstance(c.error, engine_request.ConstraintFailed):  # the request's fault, as a bad argument is
            raise ValueError(constraint_message(c.error.kind, c.error.message, LLM_FIELDS))
        if c.finish is None:
            raise RuntimeError(c.error.message if c.error else "the engine ended the request without a result")
        f = c.finish
        return Completion(
            index=index, text=c.text, token_ids=c.token_ids, finish_reason=f.reason.value, stop_reason=f.matched_stop,
            seed=f.seed, timings=Timings(f.queue_seconds, f.time_to_first_token_seconds, f.total_seconds),
            logprobs=c.logprobs if c.logprobs is not None or params.logprobs is None else [],
        )

    # ---- graph cache and lifetime -------------------------------------------------------------

    def graph_cache_state(self) -> Any:
        """The graph cache's state (cache_manager.CacheSnapshot), as the admin RPC reports it: mode,
        device, budget and used bytes, capture sizes and each bucket's state and counters."""
        self._check_open()
        return self._engine.runner.graphs.snapshot()

    def close(self) -> None:
        """Stop the engine, save the graph statistics and release the model, the KV cache and the
        graphs (host and device memory). Idempotent."""
        self._finalizer()

    @property
    def _engine(self) -> Any:
        return self._held["engine"]

    def _check_open(self) -> None:
        if not self._finalizer.alive:
            raise RuntimeError("this LLM is closed; create a new one")

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
