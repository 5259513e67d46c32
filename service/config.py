"""One typed configuration, built once at start from flags and GRAPHSERVE_* environment variables.

Every flag `--some-flag` can also be set as `GRAPHSERVE_SOME_FLAG`; a flag on the command line wins.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path

ENV_PREFIX = "GRAPHSERVE_"
SECRET_FIELDS = ("admin_token",)


class ConfigError(ValueError):
    """A configuration value is invalid; the message says which flag and what to change."""


@dataclass(frozen=True)
class ServeConfig:
    model: str = "builtin:tiny"
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
    overlap_steps: bool = True  # launch step t+1 before reading step t's tokens
    # Graph cache
    cudagraph_mode: str = "full"  # none | full (CPU always runs none)
    capture_sizes: str | None = None
    graph_memory_budget: str | None = None
    stats_file: Path | None = None
    warm_start: bool = True
    # Admin, metrics, operations
    admin_host: str = "127.0.0.1"
    admin_port: int = 50052
    admin_token_file: Path | None = None
    admin_token: str | None = None  # from GRAPHSERVE_ADMIN_TOKEN or the token file; never logged
    metrics_port: int = 9464
    drain_timeout: float = 30.0
    watchdog_timeout: float = 60.0
    log_format: str = "auto"  # auto | json | console
    log_level: str = "info"
    # Limits (admission control)
    max_tokens_limit: int = 4096
    max_prompt_bytes: int = 1 << 20
    max_stop_strings: int = 16
    max_stop_string_bytes: int = 256
    max_stop_token_ids: int = 64
    max_waiting_requests: int = 256
    max_waiting_tokens: int = 1 << 20
    max_concurrent_streams: int = 1024
    max_receive_message_bytes: int = 4 << 20
    # Transport security
    tls_cert: Path | None = None
    tls_key: Path | None = None
    tls_client_ca: Path | None = None

    @property
    def max_prefill_tokens(self) -> int:
        """Deprecated name of max_num_batched_tokens (the per-step prompt budget it replaced)."""
        return self.max_num_batched_tokens

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

        need(self.device in ("auto", "cpu", "cuda"), f"--device must be auto, cpu or cuda, not {self.device!r}")
        need(
            self.dtype in ("auto", "float32", "bfloat16", "float16"),
            f"--dtype must be auto, float32, bfloat16 or float16, not {self.dtype!r}",
        )
        need(self.cudagraph_mode in ("none", "full"), f"--cudagraph-mode must be none or full, not {self.cudagraph_mode!r}")
        need(self.log_format in ("auto", "json", "console"), "--log-format must be auto, json or console")
        for name in ("port", "admin_port", "metrics_port"):
            value = getattr(self, name)
            need(0 <= value <= 65535, f"--{name.replace('_', '-')} must be a port in 0..65535, got {value}")
        positive = (
            "tensor_parallel_size",
            "max_running_seqs", "max_seq_len", "max_num_batched_tokens", "default_max_tokens", "max_tokens_limit",
            "max_prompt_bytes", "max_stop_string_bytes", "max_waiting_requests", "max_waiting_tokens",
            "max_concurrent_streams", "max_receive_message_bytes",
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
        need(self.drain_timeout >= 0, "--drain-timeout must be >= 0 seconds")
        need(self.watchdog_timeout > 0, "--watchdog-timeout must be > 0 seconds")
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
        if self.capture_sizes is not None:
            try:
                parse_capture_sizes(self.capture_sizes, self.max_running_seqs)
            except ValueError as exc:
                raise ConfigError(f"--capture-sizes: {exc}") from None
        for name in ("tls_cert", "tls_key", "tls_client_ca", "admin_token_file"):
            path = getattr(self, name)
            need(path is None or Path(path).is_file(), f"--{name.replace('_', '-')}: no such file: {path}")


def _bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def build_parser() -> argparse.ArgumentParser:
    """The parser of `graphserve serve`. Defaults come from ServeConfig."""
    d = ServeConfig()
    p = argparse.ArgumentParser(
        prog="graphserve serve",
        description="Serve a model over gRPC. Every flag can also be set as GRAPHSERVE_<FLAG>.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    g = p.add_argument_group("model")
    g.add_argument("--model", default=d.model, help="builtin:<name> or a local Hugging Face directory")
    g.add_argument("--model-cache-dir", type=Path, default=None, help="where built-in models are generated")
    g.add_argument("--device", default=d.device, choices=["auto", "cpu", "cuda"])
    g.add_argument("--dtype", default=d.dtype, choices=["auto", "float32", "bfloat16", "float16"])
    g.add_argument("--tensor-parallel-size", type=int, default=d.tensor_parallel_size,
                   help="split the model across N ranks (one process each; N GPUs on cuda, gloo on cpu)")
    g = p.add_argument_group("server")
    g.add_argument("--host", default=d.host)
    g.add_argument("--port", type=int, default=d.port)
    g.add_argument("--max-running-seqs", type=int, default=d.max_running_seqs, help="KV slots = max batch")
    g.add_argument("--max-seq-len", type=int, default=d.max_seq_len, help="prompt + completion tokens")
    g.add_argument("--max-num-batched-tokens", "--max-prefill-tokens", dest="max_num_batched_tokens", type=int,
                   default=d.max_num_batched_tokens,
                   help="tokens per engine step: every running decode plus prompt chunks; a longer prompt is "
                        "prefilled over several steps (>= --max-running-seqs; --max-prefill-tokens is deprecated)")
    g.add_argument("--default-max-tokens", type=int, default=d.default_max_tokens)
    g.add_argument("--overlap-steps", dest="overlap_steps", action="store_true", default=d.overlap_steps,
                   help="launch step t+1 on the device before the host reads step t's tokens")
    g.add_argument("--no-overlap-steps", dest="overlap_steps", action="store_false")
    g = p.add_argument_group("graph cache")
    g.add_argument("--cudagraph-mode", default=d.cudagraph_mode, choices=["none", "full"])
    g.add_argument("--capture-sizes", default=None, help="comma-separated batch sizes (default 1,2,4,8,16,...)")
    g.add_argument("--graph-memory-budget", default=None, help="bytes (8GiB) or a fraction of device memory")
    g.add_argument("--stats-file", type=Path, default=None, help="capture-size statistics, kept across restarts")
    g.add_argument("--warm-start", dest="warm_start", action="store_true", default=d.warm_start)
    g.add_argument("--no-warm-start", dest="warm_start", action="store_false")
    g = p.add_argument_group("operations")
    g.add_argument("--admin-host", default=d.admin_host)
    g.add_argument("--admin-port", type=int, default=d.admin_port)
    g.add_argument("--admin-token-file", type=Path, default=None, help="or GRAPHSERVE_ADMIN_TOKEN")
    g.add_argument("--metrics-port", type=int, default=d.metrics_port, help="0 disables /metrics")
    g.add_argument("--drain-timeout", type=float, default=d.drain_timeout, help="seconds")
    g.add_argument("--watchdog-timeout", type=float, default=d.watchdog_timeout, help="seconds")
    g.add_argument("--log-format", default=d.log_format, choices=["auto", "json", "console"])
    g.add_argument("--log-level", default=d.log_level)
    g = p.add_argument_group("limits")
    for name in (
        "max_tokens_limit", "max_prompt_bytes", "max_stop_strings", "max_stop_string_bytes", "max_stop_token_ids",
        "max_waiting_requests", "max_waiting_tokens", "max_concurrent_streams", "max_receive_message_bytes",
    ):
        g.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(d, name))
    g = p.add_argument_group("transport security")
    g.add_argument("--tls-cert", type=Path, default=None)
    g.add_argument("--tls-key", type=Path, default=None)
    g.add_argument("--tls-client-ca", type=Path, default=None, help="require client certificates (mTLS)")
    return p


def _env_argv(parser: argparse.ArgumentParser, environ: Mapping[str, str]) -> list[str]:
    """Flags from GRAPHSERVE_* variables, placed before the command line so the command line wins."""
    argv: list[str] = []
    for action in parser._actions:  # noqa: SLF001 - argparse has no public walk of its actions
        for flag in (s for s in action.option_strings if s.startswith("--")):  # aliases too
            if flag in ("--help", "--no-warm-start"):
                continue
            value = environ.get(ENV_PREFIX + flag[2:].replace("-", "_").upper())
            if value is None:
                continue
            if flag == "--warm-start":
                argv.append("--warm-start" if _bool(value) else "--no-warm-start")
            else:
                argv += [flag, value]
    return argv


def load_config(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> ServeConfig:
    environ = os.environ if environ is None else environ
    parser = build_parser()
    ns = parser.parse_args(_env_argv(parser, environ) + list(argv or []))
    values = {f.name: getattr(ns, f.name) for f in fields(ServeConfig) if hasattr(ns, f.name)}
    token = environ.get(ENV_PREFIX + "ADMIN_TOKEN")
    if values.get("admin_token_file") is not None:
        path = Path(values["admin_token_file"])
        if not path.is_file():
            raise ConfigError(f"--admin-token-file: no such file: {path}")
        token = path.read_text().strip()
        if not token:
            raise ConfigError(f"--admin-token-file {path} is empty")
    values["admin_token"] = token or None
    config = ServeConfig(**values)
    config.validate()
    return config
