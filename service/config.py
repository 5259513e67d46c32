"""One typed configuration, built once at start from flags and GRAPHSERVE_* environment variables.

Every flag `--some-flag` can also be set as `GRAPHSERVE_SOME_FLAG`; a flag on the command line wins.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

ENV_PREFIX = "GRAPHSERVE_"
SECRET_FIELDS = ("admin_token",)


class ConfigError(ValueError):
    """A configuration value is invalid; the message says which flag and what to change."""


@dataclass(frozen=True)
class ConstraintLimits:
    """Budgets for structured outputs (flags of the same names, `--max-constraint-bytes` ...): what a
    constraint of a few bytes may cost (service/engine/constraint_limits.py checks its size,
    constraint_prepare.py and mask_fill.py hold its compile and its masks to the CPU budgets)."""

    # Text of a regex, a grammar or a JSON schema, or all choices together, in UTF-8 bytes.
    max_constraint_bytes: int = 64 * 1024
    # Entries of a choice list (the grammar library keeps at most 2,000 items in one row).
    max_constraint_choices: int = 1024
    # Nesting of a JSON schema's objects and arrays (brackets deep).
    max_constraint_depth: int = 64
    # CPU seconds for compiling a constraint and computing its first token mask, on a grammar worker.
    constraint_compile_timeout: float = 2.0
    # CPU milliseconds for one row's token mask in one step; a row over it fails, the step goes on.
    # Measured with a 128k vocabulary on a 2-core host: legitimate masks p99 0.6 ms, max 4.4 ms (a
    # 1,000-entry choice's second step); a row also fails if it keeps using over a quarter of this.
    constraint_mask_timeout_ms: float = 10.0
    # Bytes of compiled constraints kept for reuse (each measured when compiled; one over an eighth of
    # this is never kept). Typical JSON schemas take well under a MB.
    constraint_cache_bytes: int = 64 << 20
    # Compiles waiting or running at once; more are refused (RESOURCE_EXHAUSTED, retry later). A request
    # being compiled counts as waiting: the server's default is half of --max-waiting-requests, so that
    # a flood of slow constraints leaves the other half to requests without one, while a burst of cheap
    # ones (a few ms each) queues instead of being refused (at 32, 25-60 of 96 were, on 2 cores).
    max_pending_constraints: int = 128

    def validate(self) -> None:
        """ValueError naming the flag of the first bad value."""
        for name in ("max_constraint_bytes", "max_constraint_choices", "max_constraint_depth",
                     "constraint_cache_bytes", "max_pending_constraints"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        for name in ("constraint_compile_timeout", "constraint_mask_timeout_ms"):
            value = getattr(self, name)
            if not 0 < value < float("inf"):
                raise ValueError(f"--{name.replace('_', '-')} must be a finite number > 0, got {value}")


GRAPH_MODES = ("none", "full", "piecewise", "full_and_piecewise")
KV_CACHE_DTYPES = ("auto", "fp8")  # auto: the model's dtype
SPECULATIVE_METHODS = ("ngram", "suffix", "draft_layers", "draft_model")
MAX_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True)
class SpeculativeConfig:
    """`--speculative-config`: the JSON object vLLM takes, checked once at start.

    method "ngram": prompt lookup over the request's own prompt and output; "suffix": the same,
    then a bounded corpus of recent outputs of this server; "draft_layers": the target's own first
    num_draft_layers layers with its final norm and LM head draft greedily (self-speculation, as
    LayerSkip; fewer than the model's layers, checked when the model is known); "draft_model": a second,
    smaller checkpoint `model` (a directory, builtin:<name> or a cached Hub id) sharing the target's
    tokenizer drafts greedily, loaded by the same engine on the target's device and dtype (vLLM's
    older spelling, `model` with no method, means draft_model; `model` "ngram" means ngram). Each decode proposes at most
    num_speculative_tokens tokens, from a match of the last n tokens, prompt_lookup_min <= n <=
    prompt_lookup_max (the longest first). How many a decode is offered per step adapts to its
    measured acceptance and to the batch size (service/engine/spec/adaptive.py): a step's decodes
    and draft tokens stay within verify_token_budget, and none speculates in a step of more than
    disable_by_batch_size decodes (vLLM's field; None: only the budget limits)."""

    method: str = "ngram"
    num_speculative_tokens: int = 3
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    # suffix: the corpus's cap in tokens (oldest outputs evicted first).
    suffix_corpus_tokens: int = 1 << 20
    verify_token_budget: int = 64
    disable_by_batch_size: int | None = None
    # draft_layers: how many of the target's first layers draft (required by that method only).
    num_draft_layers: int | None = None
    # draft_model: the draft checkpoint (required by that method only).
    model: str | None = None

    @classmethod
    def parse(cls, value: str | dict[str, Any] | SpeculativeConfig | None) -> SpeculativeConfig | None:
        """A JSON text or a dict (vLLM's keys); None or "" is off. ValueError naming the field."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            if not value.strip():
                return None
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"speculative_config is not JSON: {exc}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a JSON object, got {type(value).__name__}")
        known = {f for f in cls.__dataclass_fields__}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown field(s) {unknown}; known: {sorted(known)}")
        if value.get("method") is None and value.get("model") is not None:
            # vLLM's older spelling: a model and no method is a draft model ("ngram" names that method)
            value = {**value, "method": "ngram" if value["model"] in ("ngram", "[ngram]") else "draft_model"}
            if value["method"] == "ngram":
                value.pop("model")
        if value.get("method") is None:
            raise ValueError(f"speculative_config.method is required ({', '.join(SPECULATIVE_METHODS)})")
        config = cls(**value)
        config.validate()
        return config

    def validate(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_config.method {self.method!r} is not one of {list(SPECULATIVE_METHODS)}")
        for name, low, high in (("num_speculative_tokens", 1, MAX_SPECULATIVE_TOKENS),
                                ("prompt_lookup_min", 1, 64), ("prompt_lookup_max", 1, 64),
                                ("suffix_corpus_tokens", 1, 1 << 30), ("verify_token_budget", 2, 1 << 20),
                                ("disable_by_batch_size", 1, 1 << 20), ("num_draft_layers", 1, 1 << 10)):
            v = getattr(self, name)
            if name in ("disable_by_batch_size", "num_draft_layers") and v is None:
                continue
            if isinstance(v, bool) or not isinstance(v, int) or not low <= v <= high:
                raise ValueError(f"speculative_config.{name} must be an integer in [{low}, {high}], got {v!r}")
        if self.method == "draft_layers" and self.num_draft_layers is None:
            raise ValueError("speculative_config.num_draft_layers is required by method draft_layers: how many "
                             "of the model's first layers draft (fewer than its layers)")
        if self.method != "draft_layers" and self.num_draft_layers is not None:
            raise ValueError(f"speculative_config.num_draft_layers is for method draft_layers, not {self.method!r}")
        if self.method == "draft_model" and (not isinstance(self.model, str) or not self.model.strip()):
            raise ValueError("speculative_config.model is required by method draft_model: the draft checkpoint "
                             f"(a directory, builtin:<name> or a cached Hub id), got {self.model!r}")
        if self.method != "draft_model" and self.model is not None:
            raise ValueError(f"speculative_config.model is for method draft_model, not {self.method!r} "
                             "(draft_layers drafts with the target's own first layers)")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative_config.prompt_lookup_min ({self.prompt_lookup_min}) is above "
                             f"prompt_lookup_max ({self.prompt_lookup_max})")


@dataclass(frozen=True)
class ServeConfig:
    model: str = "builtin:tiny"
    served_model_name: str | None = None  # the model's name to clients and gateways (default: --model)
    model_cache_dir: Path | None = None
    device: str = "auto"  # auto | cpu | cuda
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    tensor_parallel_size: int = 1  # ranks (processes, GPUs) one model is split across
    host: str = "0.0.0.0"
    port: int = 50051
    max_running_seqs: int = 32
    max_seq_len: int = 2048
    # Tokens per engine step (one forward pass): every running decode plus prompt chunks.
    max_num_batched_tokens: int = 2048
    default_max_tokens: int = 256
    # Paged KV cache: tokens per block; its memory ("auto", bytes such as 8GiB, or a fraction of the
    # device's memory); prefix caching of full blocks across requests
    block_size: int = 16
    kv_cache_memory: str = "auto"
    # auto (the model's dtype) | fp8: keys and values in FP8 E4M3 with per-layer scales (service.model.kv_quant)
    kv_cache_dtype: str = "auto"
    prefix_caching: bool = True
    # Host memory under the prefix cache (bytes such as 16GiB; 0: off): cached blocks the device pool
    # evicts are kept there and copied back on a hit (service/engine/host_tier.py)
    kv_host_cache_memory: str = "0"
    overlap_steps: bool = True  # launch step t+1 before reading step t's tokens
    # Speculative decoding: vLLM's JSON object (SpeculativeConfig above), e.g.
    # {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}; None: off
    speculative_config: str | None = None
    # Every request's tokens independent of the other requests in its step and of chunking
    # (batch-invariant matmul, attention and norms; service.model.kernels.invariant)
    batch_invariant: bool = False
    # none | fp8: the decoder's projections in FP8 E4M3 with per-channel scales (service.model.fp8)
    quantization: str = "none"
    # LoRA adapters: "NAME=PATH[,NAME=PATH...]" loaded at start; device slots; the largest rank served
    lora_modules: str | None = None
    max_loras: int = 0  # 0: 4 slots when --lora-modules is given, else no adapter support
    max_lora_rank: int = 16
    lora_kernel: str = "stacked"  # stacked | gather (service.model.lora)
    # Adapters load only from under this directory (symlinks resolved); None: only --lora-modules, from
    # anywhere, and LoadAdapter is refused
    lora_root: Path | None = None
    max_cpu_loras: int = 32  # adapters registered at once (their weights held in host memory)
    # Graph cache
    cudagraph_mode: str = "full_and_piecewise"  # none | full | piecewise | full_and_piecewise (CPU runs none)
    capture_sizes: str | None = None
    graph_memory_budget: str | None = None
    stats_file: Path | None = None
    warm_start: bool = True
    # Before SERVING: every allowed size run once eagerly, then the warm-start graphs captured, for at
    # most this long (seconds); what is left is captured in the background. 0: all in the background.
    startup_graph_timeout: float = 60.0
    # The kernels' self-check results and Triton's compiled kernels, kept across starts (None:
    # <model cache dir>/compile; service.model.kernels.compile_cache)
    compile_cache_dir: Path | None = None
    # Admin, metrics, operations
    admin_host: str = "127.0.0.1"
    admin_port: int = 50052
    admin_token_file: Path | None = None
    admin_token: str | None = None  # from GRAPHSERVE_ADMIN_TOKEN or the token file; never logged
    metrics_port: int = 9464
    drain_timeout: float = 30.0
    engine_stop_timeout: float = 10.0  # after the drain: the engine's own stop, then it is killed
    watchdog_timeout: float = 60.0
    log_format: str = "auto"  # auto | json | console
    log_level: str = "info"
    # Limits (admission control)
    max_tokens_limit: int = 4096
    max_prompt_bytes: int = 1 << 20  # a text prompt, or a whole chat conversation as sent (roles and framing too)
    max_chat_messages: int = 1024
    allow_chat_special_tokens: bool = False  # special tokens in chat content act as control tokens (off: text)
    max_stop_strings: int = 16
    max_stop_string_bytes: int = 256
    max_stop_token_ids: int = 64
    max_waiting_requests: int = 256
    max_waiting_tokens: int = 1 << 20
    max_concurrent_streams: int = 1024
    # HTTP/2 SETTINGS_MAX_CONCURRENT_STREAMS (at most half of max_concurrent_streams): room far above what one
    # client holds, as a client that opens streams past it, or while the server closes the last ones, is refused
    max_streams_per_connection: int = 512
    max_stream_backlog_tokens: int = 128  # undelivered tokens per stream before it is paused
    # SubscribeKvEvents: batches (one per engine step with KV events) kept for subscribers that resume
    # from a sequence number; batches queued for one subscriber that reads too slowly before it is dropped
    kv_events_history: int = 4096
    kv_events_buffer: int = 1024
    # An engine step whose host work takes longer is logged (slow_step, at most one line per 10 s); 0: never
    slow_step_threshold_ms: float = 100.0
    # Structured outputs (service/engine/constraint_limits.py): sizes checked before any compile, CPU
    # budgets of the compile (with the first mask) and of each row's mask per step, the compiled cache
    max_constraint_bytes: int = ConstraintLimits.max_constraint_bytes
    max_constraint_choices: int = ConstraintLimits.max_constraint_choices
    max_constraint_depth: int = ConstraintLimits.max_constraint_depth
    constraint_compile_timeout: float = ConstraintLimits.constraint_compile_timeout
    constraint_mask_timeout_ms: float = ConstraintLimits.constraint_mask_timeout_ms
    constraint_cache_bytes: int = ConstraintLimits.constraint_cache_bytes
    max_pending_constraints: int = ConstraintLimits.max_pending_constraints
    stream_stall_timeout: float = 30.0  # seconds a client may accept no data before its stream is aborted
    # Messages per second the server writes across all streams: each of S open streams gets one at most
    # every S / rate seconds, its tokens in between merged (0: no limit). A write is most of the gRPC
    # process's work, so this keeps it below saturation, where it would hold the engine back instead.
    stream_message_rate: float = 6000.0
    max_receive_message_bytes: int = 4 << 20
    # Transport security
    tls_cert: Path | None = None
    tls_key: Path | None = None
    tls_client_ca: Path | None = None

    @property
    def speculation(self) -> SpeculativeConfig | None:
        """--speculative-config parsed (validate() has checked it)."""
        return SpeculativeConfig.parse(self.speculative_config)

    @property
    def max_prefill_tokens(self) -> int:
        """Deprecated name of max_num_batched_tokens (the per-step prompt budget it replaced)."""
        return self.max_num_batched_tokens

    @property
    def model_name(self) -> str:
        """What clients and gateways call the model."""
        return self.served_model_name or self.model

    @property
    def streams_per_connection(self) -> int:
        """HTTP/2 SETTINGS_MAX_CONCURRENT_STREAMS: --max-streams-per-connection, but at most half of
        --max-concurrent-streams, so that one connection that reads nothing cannot hold every stream."""
        return max(1, min(self.max_streams_per_connection, self.max_concurrent_streams // 2))

    @property
    def constraint_limits(self) -> ConstraintLimits:
        return ConstraintLimits(**{f.name: getattr(self, f.name) for f in fields(ConstraintLimits)})

    @property
    def kv_host_cache_bytes(self) -> int:
        """--kv-host-cache-memory in bytes (0: off); ValueError for a value that is not bytes."""
        if str(self.kv_host_cache_memory).strip() in ("0", ""):
            return 0
        from cache_manager.budget import parse_memory_budget

        value = parse_memory_budget(self.kv_host_cache_memory)
        if isinstance(value, float):
            raise ValueError(f"{self.kv_host_cache_memory!r} is a fraction: give bytes such as 16GiB")
        return value

    @property
    def lora_slots(self) -> int:
        """Adapter slots on the device (0: adapters are off)."""
        return self.max_loras or (4 if self.lora_modules else 0)

    def lora_module_paths(self) -> list[tuple[str, Path]]:
        """--lora-modules as (name, path) pairs; ConfigError naming the bad entry otherwise."""
        return parse_lora_modules(self.lora_modules or "")

    def redacted(self) -> dict[str, object]:
        """The config as plain data with secrets masked, for the start-up log."""
        data = {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(self).items()}
        for name in SECRET_FIELDS:
            if data.get(name):
                data[name] = "<redacted>"
        return data

    def validate(self) -> None:
        def need(ok: bool, message: str) -> None:
            if not ok:
                raise ConfigError(message)

        need(self.served_model_name is None or (self.served_model_name.strip() != "" and self.served_model_name.isprintable()),
             f"--served-model-name must be printable, non-empty text, got {self.served_model_name!r}")
        need(self.device in ("auto", "cpu", "cuda"), f"--device must be auto, cpu or cuda, not {self.device!r}")
        need(
            self.dtype in ("auto", "float32", "bfloat16", "float16"),
            f"--dtype must be auto, float32, bfloat16 or float16, not {self.dtype!r}",
        )
        need(self.cudagraph_mode.lower() in GRAPH_MODES,
             f"--cudagraph-mode must be one of {', '.join(GRAPH_MODES)} (any case), not {self.cudagraph_mode!r}")
        need(self.log_format in ("auto", "json", "console"), "--log-format must be auto, json or console")
        for name in ("port", "admin_port", "metrics_port"):
            value = getattr(self, name)
            need(0 <= value <= 65535, f"--{name.replace('_', '-')} must be a port in 0..65535, got {value}")
        positive = (
            "tensor_parallel_size",
            "max_running_seqs", "max_seq_len", "max_num_batched_tokens", "default_max_tokens", "max_tokens_limit",
            "max_prompt_bytes", "max_chat_messages", "max_stop_string_bytes", "max_waiting_requests", "max_waiting_tokens",
            "max_concurrent_streams", "max_receive_message_bytes", "max_streams_per_connection",
            "max_stream_backlog_tokens", "block_size", "kv_events_history", "kv_events_buffer",
        )
        for name in positive:
            need(getattr(self, name) >= 1, f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        for name in ("max_stop_strings", "max_stop_token_ids"):
            need(getattr(self, name) >= 0, f"--{name.replace('_', '-')} must be >= 0")
        need(self.max_seq_len >= 2, "--max-seq-len must be at least 2")
        # Decodes are never held back: a step must hold one token of every running sequence.
        need(self.max_num_batched_tokens >= self.max_running_seqs,
             f"--max-num-batched-tokens ({self.max_num_batched_tokens}) must be >= --max-running-seqs "
             f"({self.max_running_seqs}): every running sequence may decode in the same step")
        need(self.default_max_tokens <= self.max_tokens_limit, "--default-max-tokens must be <= --max-tokens-limit")
        need(self.max_loras >= 0, f"--max-loras must be >= 0 (0: adapters off), got {self.max_loras}")
        need(self.tensor_parallel_size == 1 or not (self.max_loras or self.lora_modules),
             "LoRA adapters are not served with tensor parallelism yet: use --tensor-parallel-size 1 with "
             "--lora-modules / --max-loras, or no adapters")
        need(not self.batch_invariant or self.tensor_parallel_size == 1,
             "--batch-invariant is not served with tensor parallelism (NCCL's all-reduce algorithm depends on "
             "the message size, so a row's sum would depend on the batch): use --tensor-parallel-size 1, or "
             "drop --batch-invariant")
        need(not self.batch_invariant or not (self.max_loras or self.lora_modules),
             "--batch-invariant is not served with LoRA adapters (their products are not batch-invariant "
             "yet): drop --lora-modules and --max-loras, or drop --batch-invariant")
        need(self.quantization in ("none", "fp8"), f"--quantization must be none or fp8, not {self.quantization!r}")
        need(self.quantization == "none" or not self.batch_invariant,
             "--batch-invariant is not served with --quantization fp8 (the FP8 products are not batch-invariant): "
             "drop one of them")
        need(self.quantization == "none" or self.device != "cpu",
             "--quantization fp8 needs an NVIDIA GPU of compute capability 8.9+ (Ada, Hopper): use --device cuda, "
             "or drop --quantization")
        need(self.kv_cache_dtype in KV_CACHE_DTYPES,
             f"--kv-cache-dtype must be auto (the model's dtype) or fp8, not {self.kv_cache_dtype!r}")
        need(self.max_lora_rank >= 1, f"--max-lora-rank must be >= 1, got {self.max_lora_rank}")
        need(self.lora_kernel in ("stacked", "gather"), f"--lora-kernel must be stacked or gather, not {self.lora_kernel!r}")
        try:
            speculation = self.speculation
        except (ValueError, TypeError) as exc:
            raise ConfigError(f"--speculative-config: {exc}") from None
        need(speculation is None or self.tensor_parallel_size == 1,
             "--speculative-config is not served with tensor parallelism yet: use --tensor-parallel-size 1")
        modules = self.lora_module_paths()
        need(self.max_cpu_loras >= max(1, len(modules)),
             f"--max-cpu-loras must be >= 1 and >= the {len(modules)} --lora-modules, got {self.max_cpu_loras}")
        if self.lora_root is not None:
            need(Path(self.lora_root).is_dir(), f"--lora-root {self.lora_root}: no such directory")
            root = Path(os.path.realpath(self.lora_root))
            for name, path in modules:
                real = Path(os.path.realpath(path))
                need(real == root or root in real.parents,
                     f"--lora-modules {name}={path}: outside --lora-root {self.lora_root}")
        try:
            self.constraint_limits.validate()
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        need(self.drain_timeout >= 0, "--drain-timeout must be >= 0 seconds")
        need(math.isfinite(self.startup_graph_timeout) and self.startup_graph_timeout >= 0,
             "--startup-graph-timeout must be a finite number of seconds >= 0")
        need(self.watchdog_timeout > 0, "--watchdog-timeout must be > 0 seconds")
        need(self.engine_stop_timeout > 0, "--engine-stop-timeout must be > 0 seconds")
        need(self.stream_stall_timeout > 0, "--stream-stall-timeout must be > 0 seconds")
        need(math.isfinite(self.slow_step_threshold_ms) and self.slow_step_threshold_ms >= 0,
             "--slow-step-threshold-ms must be a finite number of milliseconds >= 0 (0: no slow_step warnings)")
        need(math.isfinite(self.stream_message_rate) and self.stream_message_rate >= 0,
             "--stream-message-rate must be a number of messages per second >= 0 (0: no limit)")
        need(
            (self.tls_cert is None) == (self.tls_key is None), "--tls-cert and --tls-key must be given together"
        )
        need(self.tls_client_ca is None or self.tls_cert is not None, "--tls-client-ca needs --tls-cert and --tls-key")
        need(self.log_level.upper() in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"),
             f"--log-level must be debug, info, warning, error or critical, not {self.log_level!r}")
        # The graph-cache values are parsed by the graph cache; parse them here too, so a typo fails
        # at start with the flag's name instead of after the model has loaded.
        from cache_manager.budget import parse_memory_budget
        from cache_manager.sizes import parse_capture_sizes

        if self.graph_memory_budget is not None:
            try:
                parse_memory_budget(self.graph_memory_budget)
            except ValueError as exc:
                raise ConfigError(f"--graph-memory-budget: {exc}") from None
        if self.kv_cache_memory != "auto":
            try:
                parse_memory_budget(self.kv_cache_memory)
            except ValueError as exc:
                raise ConfigError(f"--kv-cache-memory: {exc} (or auto)") from None
        try:
            host_bytes = self.kv_host_cache_bytes
        except ValueError as exc:
            raise ConfigError(f"--kv-host-cache-memory: {exc} (or 0: off)") from None
        need(not host_bytes or self.prefix_caching, "--kv-host-cache-memory keeps prefix-cache blocks: it needs "
             "--prefix-caching")
        need(not host_bytes or self.tensor_parallel_size == 1,
             "--kv-host-cache-memory is not served with tensor parallelism yet")
        need(self.block_size & (self.block_size - 1) == 0 and self.block_size <= 256,
             f"--block-size must be a power of two up to 256, got {self.block_size}")
        if self.capture_sizes is not None:
            try:
                sizes = parse_capture_sizes(self.capture_sizes, max(self.max_running_seqs, self.max_num_batched_tokens))
            except ValueError as exc:
                raise ConfigError(f"--capture-sizes: {exc}") from None
            need(self.quantization != "fp8" or 1 in sizes,
                 f"--capture-sizes: {self.capture_sizes!r} lacks 1, which --quantization fp8 needs: a lone request's "
                 "step is computed otherwise than a batch's and never pads into a larger graph (README: FP8 weights)")
            need(min(sizes) <= self.max_running_seqs,
                 f"--capture-sizes: {self.capture_sizes!r} holds no size for a decode batch (<= --max-running-seqs "
                 f"{self.max_running_seqs})")
        for name in ("tls_cert", "tls_key", "tls_client_ca", "admin_token_file"):
            path = getattr(self, name)
            need(path is None or Path(path).is_file(), f"--{name.replace('_', '-')}: no such file: {path}")


CUDA_MAX_RUNNING_SEQS = 256


def default_max_pending_constraints(max_waiting_requests: int) -> int:
    """Half of the waiting requests may be compiling their constraints (ConstraintLimits says why)."""
    return max(1, max_waiting_requests // 2)


def default_max_running_seqs(device: str) -> int:
    """--max-running-seqs when not given: 256 on CUDA (KV memory follows the tokens, not the rows, so
    many rows cost little), ServeConfig's 32 on a CPU."""
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    return CUDA_MAX_RUNNING_SEQS if device == "cuda" else ServeConfig.max_running_seqs


def parse_lora_modules(text: str) -> list[tuple[str, Path]]:
    """"NAME=PATH[,NAME=PATH...]" -> [(name, path)]: names unique, paths existing directories."""
    pairs: list[tuple[str, Path]] = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        name, sep, path = part.partition("=")
        name, path = name.strip(), path.strip()
        if not sep or not name or not path:
            raise ConfigError(f"--lora-modules: {part!r} is not NAME=PATH (e.g. --lora-modules sql=/adapters/sql)")
        if any(name == n for n, _ in pairs):
            raise ConfigError(f"--lora-modules: the name {name!r} is given twice")
        if not Path(path).is_dir():
            raise ConfigError(f"--lora-modules: {name}={path}: no such directory (a PEFT adapter directory holds "
                              "adapter_config.json and adapter_model.safetensors)")
        pairs.append((name, Path(path)))
    return pairs


def _bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


class HelpFormatter(argparse.HelpFormatter):
    """Each flag's help ends with its default once: written into the help where it needs words (it
    depends on the device, or is the absence of a file), else taken from the parser."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        absent = action.default is None or action.default is False or action.default == [] or action.default == argparse.SUPPRESS
        if "default" in text or absent or not action.option_strings:
            return text
        return text + " (default: %(default)s)"


# vLLM's names for flags whose meaning is the same here (`vllm serve` command lines keep working).
VLLM_ALIASES = {"--max-seq-len": "--max-model-len", "--max-running-seqs": "--max-num-seqs",
                "--prefix-caching": "--enable-prefix-caching"}
# vLLM flags with no equal here: refused with what to use instead, never taken for something else.
VLLM_WITHOUT_EQUAL = {
    "--gpu-memory-utilization": "graphserve sizes the KV cache alone, after the weights and the graph budget: "
                                "--kv-cache-memory auto (the default) takes what is free less 5% of the device; give "
                                "a fraction of device memory (--kv-cache-memory 0.4) or bytes (--kv-cache-memory 20GiB)",
    "--trust-remote-code": "graphserve runs its own model code and never a checkpoint's: drop the flag",
}


class _Refused(argparse.Action):
    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: object,
                 option_string: str | None = None) -> None:
        parser.error(f"{option_string} (vLLM's) has no equal in graphserve: {VLLM_WITHOUT_EQUAL[option_string or '']}")


def _switch(group: argparse._ArgumentGroup, flag: str, default: bool, help: str) -> None:  # noqa: A002
    """--flag / --no-flag (and vLLM's name and its negation, where VLLM_ALIASES has one)."""
    names = [flag] + ([VLLM_ALIASES[flag]] if flag in VLLM_ALIASES else [])
    group.add_argument(*names, dest=flag[2:].replace("-", "_"), action=argparse.BooleanOptionalAction,
                       default=default, help=help)


def build_parser() -> argparse.ArgumentParser:
    """The parser of `graphserve serve`. Defaults come from ServeConfig; vLLM's flag names are aliases
    where the meaning is the same (VLLM_ALIASES, --enforce-eager)."""
    d = ServeConfig()
    p = argparse.ArgumentParser(
        prog="graphserve serve",
        description="Serve a model over gRPC (graphserve.v1 and vLLM's engine protocol on one port). Every flag can "
                    "also be set as GRAPHSERVE_<FLAG> (--max-seq-len: GRAPHSERVE_MAX_SEQ_LEN); the command line wins.",
        formatter_class=HelpFormatter,
    )
    p.add_argument("--version", action="version", version=f"graphserve {version()}")
    g = p.add_argument_group("model")
    g.add_argument("model_arg", nargs="?", metavar="MODEL", default=None,
                   help="the model, as `vllm serve MODEL` takes it: the same as --model")
    g.add_argument("--model", default=d.model, help="builtin:<name> or a local Hugging Face directory")
    g.add_argument("--served-model-name", default=None,
                   help="the model's name in the vLLM engine protocol and on vllm: metrics (default: --model)")
    g.add_argument("--model-cache-dir", type=Path, default=None,
                   help="where built-in models are generated (default: $XDG_CACHE_HOME/graphserve, ~/.cache/graphserve)")
    g.add_argument("--device", default=d.device, choices=["auto", "cpu", "cuda"], help="auto: cuda if visible, else cpu")
    g.add_argument("--dtype", default=d.dtype, choices=["auto", "float32", "bfloat16", "float16"],
                   help="auto: bfloat16 on cuda, float32 on cpu")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=d.tensor_parallel_size,
                   help="split the model across N ranks (one process each; N GPUs on cuda, gloo on cpu)")
    g = p.add_argument_group("server")
    g.add_argument("--host", default=d.host, help="address of the Inference, vLLM engine and health services")
    g.add_argument("--port", type=int, default=d.port, help="their gRPC port")
    g.add_argument("--max-running-seqs", VLLM_ALIASES["--max-running-seqs"], dest="max_running_seqs", type=int,
                   default=None, help="sequences running at once, the largest decode batch (default: 256 on cuda, "
                                      f"{d.max_running_seqs} on cpu)")
    g.add_argument("--max-seq-len", VLLM_ALIASES["--max-seq-len"], dest="max_seq_len", type=int, default=d.max_seq_len,
                   help="prompt + completion tokens of one sequence")
    g.add_argument("--max-num-batched-tokens", "--max-prefill-tokens", dest="max_num_batched_tokens", type=int,
                   default=d.max_num_batched_tokens,
                   help="tokens per engine step: every running decode plus prompt chunks; a longer prompt is "
                        "prefilled over several steps (>= --max-running-seqs; --max-prefill-tokens is deprecated)")
    g.add_argument("--default-max-tokens", type=int, default=d.default_max_tokens,
                   help="completion tokens of a request that sets no max_tokens")
    _switch(g, "--overlap-steps", d.overlap_steps, "launch step t+1 on the device before the host reads step t's tokens")
    g.add_argument("--speculative-config", default=None,
                   help='speculative decoding, a JSON object as vLLM\'s: {"method": "ngram" | "suffix" | '
                        '"draft_layers" | "draft_model", "num_speculative_tokens": 3, "prompt_lookup_min": 1, '
                        '"prompt_lookup_max": 4} (suffix also takes "suffix_corpus_tokens", draft_layers needs '
                        '"num_draft_layers", draft_model the draft checkpoint "model"; k adapts '
                        'within "verify_token_budget" and "disable_by_batch_size"); turns --overlap-steps off; see README')
    _switch(g, "--batch-invariant", d.batch_invariant,
            "every request's results independent of the other requests in its batch and of chunked prefill "
            "(batch-invariant matmul, attention and norms); slower, see README")
    g.add_argument("--quantization", "-q", choices=["none", "fp8"], default=d.quantization,
                   help="fp8: the decoder's projection weights in FP8 E4M3 with one scale per output channel, "
                        "quantized at load (half their memory; NVIDIA compute capability 8.9+); see README")
    g.add_argument("--slow-step-threshold-ms", type=float, default=d.slow_step_threshold_ms,
                   help="an engine step whose host work takes longer is a slow step: at most one slow_step warning "
                        "per 10 s, with the count and the slowest; 0: none")
    g = p.add_argument_group("KV cache")
    g.add_argument("--block-size", type=int, default=d.block_size, help="tokens per KV block (a power of two)")
    g.add_argument("--kv-cache-memory", default=d.kv_cache_memory,
                   help="KV block memory: bytes (8GiB), a fraction of device memory (0.5), or auto: on CUDA the "
                        "memory free after the weights less the graph budget and 5%% of the device; on CPU what "
                        "--max-running-seqs sequences of --max-seq-len need, at most 1 GiB")
    g.add_argument("--kv-host-cache-memory", default=d.kv_host_cache_memory,
                   help="host memory under the prefix cache, in bytes (16GiB): full cached blocks the device pool "
                        "evicts are copied there (LRU within this bound) and copied back when a prompt needs them "
                        "again, instead of recomputed; pinned on CUDA. 0 (the default): off")
    g.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default=d.kv_cache_dtype,
                   help="what the KV cache stores: auto, the model's dtype; fp8, E4M3 with one scale per layer for "
                        "keys and one for values (the checkpoint's k_scale/v_scale, else 1.0): half the bytes per "
                        "token, twice the tokens in the same --kv-cache-memory (GPUs: compute capability 8.9+)")
    _switch(g, "--prefix-caching", d.prefix_caching,
            "reuse the KV of full blocks a prompt shares with earlier ones (same tokens from the start, same adapter)")
    g = p.add_argument_group("LoRA adapters")
    g.add_argument("--lora-modules", default=None,
                   help="PEFT adapter directories loaded at start, NAME=PATH[,NAME=PATH...]; requests pick one by name")
    g.add_argument("--max-loras", type=int, default=d.max_loras,
                   help="adapter slots on the device (default 0: 4 when --lora-modules is given, else adapters are "
                        "off); more adapters than slots take turns (least recently used slot not in use)")
    g.add_argument("--max-lora-rank", type=int, default=d.max_lora_rank, help="the largest adapter rank served")
    g.add_argument("--lora-kernel", default=d.lora_kernel, choices=["stacked", "gather"],
                   help="how the batched LoRA products run (bench/lora_bench.py compares them)")
    g.add_argument("--lora-root", type=Path, default=None,
                   help="adapters load only from under this directory (symlinks resolved; relative LoadAdapter "
                        "paths are taken under it); default none: only --lora-modules load, and LoadAdapter is "
                        "refused")
    g.add_argument("--max-cpu-loras", type=int, default=d.max_cpu_loras,
                   help="adapters registered at once, their weights in host memory")
    g = p.add_argument_group("graph cache")
    g.add_argument("--cudagraph-mode", default=d.cudagraph_mode, type=str.lower, choices=GRAPH_MODES,
                   help="full: a graph per uniform-decode batch; piecewise: per-layer graphs of any step, attention "
                        "eager between them; full_and_piecewise: full for decode, piecewise for the rest; none: "
                        "eager (any case; a CPU always runs none)")
    g.add_argument("--enforce-eager", dest="cudagraph_mode", action="store_const", const="none",
                   help="vLLM's name for --cudagraph-mode none: no CUDA graphs")
    g.add_argument("--capture-sizes", default=None,
                   help="comma-separated token counts; full graphs use those <= --max-running-seqs, piecewise "
                        "those <= --max-num-batched-tokens (default: 1,2,4,8,16,24,...,max-running-seqs for full; "
                        "1,2,4,...,2048 for piecewise)")
    g.add_argument("--graph-memory-budget", default=None,
                   help="bytes (8GiB) or a fraction of device memory (default: 0.1 of device memory)")
    g.add_argument("--stats-file", type=Path, default=None,
                   help="capture-size statistics, kept across restarts (default: none, every start is cold)")
    _switch(g, "--warm-start", d.warm_start,
            "pre-capture the hot sizes of the last run (--stats-file), else the largest size of each kind")
    g.add_argument("--compile-cache-dir", type=Path, default=None,
                   help="the kernels' self-check results and Triton's compiled kernels, kept across starts and "
                        "reused while the GPU, driver, versions and model shape are the same (default: "
                        "<--model-cache-dir>/compile; TRITON_CACHE_DIR, when set, keeps Triton's elsewhere)")
    g.add_argument("--startup-graph-timeout", type=float, default=d.startup_graph_timeout,
                   help="seconds before SERVING for the kernel warm-up and the warm-start graphs "
                        "(the largest sizes on a cold start); 0: everything in the background")
    g = p.add_argument_group("operations")
    g.add_argument("--admin-host", default=d.admin_host, help="address of the GraphCacheAdmin service")
    g.add_argument("--admin-port", type=int, default=d.admin_port, help="its port (open only with an admin token)")
    g.add_argument("--admin-token-file", type=Path, default=None,
                   help="the admin bearer token, or GRAPHSERVE_ADMIN_TOKEN (default: none, the admin port stays closed)")
    g.add_argument("--metrics-port", type=int, default=d.metrics_port, help="Prometheus /metrics; 0 disables it")
    g.add_argument("--drain-timeout", type=float, default=d.drain_timeout,
                   help="seconds in-flight streams get to finish after SIGTERM")
    g.add_argument("--engine-stop-timeout", type=float, default=d.engine_stop_timeout,
                   help="seconds the engine gets to stop after the drain before it is killed")
    g.add_argument("--watchdog-timeout", type=float, default=d.watchdog_timeout,
                   help="seconds without engine progress, with work pending, before health is NOT_SERVING")
    g.add_argument("--log-format", default=d.log_format, choices=["auto", "json", "console"],
                   help="auto: readable on a terminal, JSON lines otherwise")
    g.add_argument("--log-level", default=d.log_level, help="debug, info, warning, error or critical")
    g = p.add_argument_group("limits")
    for name, text in LIMIT_HELP.items():
        g.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(d, name), help=text)
    g.add_argument("--stream-stall-timeout", type=float, default=d.stream_stall_timeout,
                   help="seconds a client may accept no data before its stream is aborted")
    g.add_argument("--stream-message-rate", type=float, default=d.stream_message_rate,
                   help="messages per second written across all streams: with S streams open each gets one at "
                        "most every S/rate seconds, the tokens in between merged; 0: no limit")
    _switch(g, "--allow-chat-special-tokens", d.allow_chat_special_tokens,
            "special tokens written in chat message content (e.g. <|eot_id|>) become control tokens; off, they are "
            "tokenized as plain text so a user cannot forge turns")
    g = p.add_argument_group("structured outputs")
    g.add_argument("--max-constraint-bytes", type=int, default=d.max_constraint_bytes,
                   help="bytes of a regex, grammar or JSON schema, or of all choices together; checked before "
                        "any compile")
    g.add_argument("--max-constraint-choices", type=int, default=d.max_constraint_choices,
                   help="entries of a choice list")
    g.add_argument("--max-constraint-depth", type=int, default=d.max_constraint_depth,
                   help="nesting of a JSON schema's objects and arrays")
    g.add_argument("--constraint-compile-timeout", type=float, default=d.constraint_compile_timeout,
                   help="CPU seconds to compile a constraint and compute its first token mask, on a grammar "
                        "worker; over it the request fails with INVALID_ARGUMENT")
    g.add_argument("--constraint-mask-timeout-ms", type=float, default=d.constraint_mask_timeout_ms,
                   help="CPU milliseconds for one request's token mask in one step; a request over it fails "
                        "(INVALID_ARGUMENT) and the step goes on without waiting for it")
    g.add_argument("--constraint-cache-bytes", type=int, default=d.constraint_cache_bytes,
                   help="bytes of compiled constraints kept for reuse (each measured when compiled)")
    g.add_argument("--max-pending-constraints", type=int, default=None,
                   help="constraints compiling or queued at once; more are refused with RESOURCE_EXHAUSTED "
                        "(default: half of --max-waiting-requests)")
    g = p.add_argument_group("transport security")
    g.add_argument("--tls-cert", type=Path, default=None, help="PEM certificate: TLS on the main and admin ports")
    g.add_argument("--tls-key", type=Path, default=None, help="PEM private key of --tls-cert")
    g.add_argument("--tls-client-ca", type=Path, default=None, help="require client certificates signed by this CA (mTLS)")
    for flag in VLLM_WITHOUT_EQUAL:  # not in --help: refused with what to use instead
        p.add_argument(flag, action=_Refused, nargs="?", help=argparse.SUPPRESS)
    return p


LIMIT_HELP = {
    "max_tokens_limit": "the largest max_tokens a request may ask for",
    "max_prompt_bytes": "bytes of a text prompt, or of a whole chat conversation as sent",
    "max_chat_messages": "messages of one chat request",
    "max_stop_strings": "stop strings of one request",
    "max_stop_string_bytes": "bytes of one stop string",
    "max_stop_token_ids": "stop token ids of one request",
    "max_waiting_requests": "requests queued for admission; more are refused with RESOURCE_EXHAUSTED",
    "max_waiting_tokens": "prompt tokens queued for admission; more are refused with RESOURCE_EXHAUSTED",
    "max_concurrent_streams": "open streams of all clients; more are refused with RESOURCE_EXHAUSTED",
    "max_receive_message_bytes": "bytes of one request message",
    "max_streams_per_connection": "open streams of one HTTP/2 connection (at most half of --max-concurrent-streams)",
    "max_stream_backlog_tokens": "tokens a stream's client has not read before its sequence pauses",
    "kv_events_history": "KV event batches kept for SubscribeKvEvents subscribers that resume from a sequence number",
    "kv_events_buffer": "KV event batches queued for one SubscribeKvEvents subscriber that reads too slowly; past "
                        "it the subscriber is dropped (it resubscribes from its last sequence number)",
}


def version() -> str:
    """The installed package's version (the source tree's pyproject when run uninstalled)."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        return installed("graphserve")
    except PackageNotFoundError:
        import tomllib

        return tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]["version"]


def _env_argv(parser: argparse.ArgumentParser, environ: Mapping[str, str]) -> list[str]:
    """Flags from GRAPHSERVE_* variables, placed before the command line so the command line wins. An
    on/off flag takes true or false (GRAPHSERVE_WARM_START=false is --no-warm-start)."""
    argv: list[str] = []
    for action in parser._actions:  # noqa: SLF001 - argparse has no public walk of its actions
        if isinstance(action, (_Refused, argparse._HelpAction, argparse._VersionAction)):  # noqa: SLF001
            continue
        for flag in (s for s in action.option_strings if s.startswith("--")):  # aliases too
            negated = isinstance(action, argparse.BooleanOptionalAction) and flag.startswith("--no-")
            value = None if negated else environ.get(ENV_PREFIX + flag[2:].replace("-", "_").upper())
            if value is None:
                continue
            if isinstance(action, argparse.BooleanOptionalAction):
                argv.append(flag if _bool(value) else "--no-" + flag[2:])
            elif action.nargs == 0:  # --enforce-eager
                argv += [flag] if _bool(value) else []
            else:
                argv += [flag, value]
    return argv


def load_config(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> ServeConfig:
    environ = os.environ if environ is None else environ
    parser = build_parser()
    ns = parser.parse_intermixed_args(_env_argv(parser, environ) + list(argv or []))
    if ns.model_arg is not None:
        if "--model" in (argv or []) or any(a.startswith("--model=") for a in argv or []):
            raise ConfigError(f"the model is given twice: as MODEL ({ns.model_arg}) and as --model: give one")
        ns.model = ns.model_arg
    values = {f.name: getattr(ns, f.name) for f in fields(ServeConfig) if hasattr(ns, f.name)}
    if values.get("max_running_seqs") is None:
        values["max_running_seqs"] = default_max_running_seqs(values.get("device", "auto"))
    if values.get("max_pending_constraints") is None:
        values["max_pending_constraints"] = default_max_pending_constraints(values["max_waiting_requests"])
    # Trimmed like the file: a Kubernetes Secret exposed as a variable often ends in a newline.
    token = environ.get(ENV_PREFIX + "ADMIN_TOKEN", "").strip()
    source = ENV_PREFIX + "ADMIN_TOKEN"
    if values.get("admin_token_file") is not None:
        path = Path(values["admin_token_file"])
        if not path.is_file():
            raise ConfigError(f"--admin-token-file: no such file: {path}")
        token = path.read_text().strip()
        source = f"--admin-token-file {path}"
        if not token:
            raise ConfigError(f"--admin-token-file {path} is empty")
    if token and not all("!" <= ch <= "~" for ch in token):
        # gRPC metadata values are visible ASCII: no client could ever send this token.
        raise ConfigError(f"{source}: the admin token must be visible ASCII characters (no spaces, control or "
                          "non-ASCII characters), or no client can send it as gRPC metadata")
    values["admin_token"] = token or None
    config = ServeConfig(**values)
    config.validate()
    return config
