"""Start-up checks of `graphserve serve` and `graphserve gateway`, before any process, port or model
load starts: each problem is one line naming the flag, and the command exits 2.

The cheap checks (ports, the model directory's files) run first; the architecture check reads the
model's config.json through the model package (transformers: seconds), which the server imports
next anyway.
"""

from __future__ import annotations

import errno
import json
import socket
from pathlib import Path

from service.config import ServeConfig


def port_problem(flag: str, host: str, port: int) -> str | None:
    """Why host:port cannot be bound now, or None. Bound as the servers bind it (address reuse on,
    so a port left in TIME_WAIT by the last run is free)."""
    if port == 0:
        return None
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        return f"{flag}: the host {host!r} does not resolve ({exc.strerror})"
    for family, kind, proto, _, address in infos[:1]:
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind(address)
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    return f"{flag}: {host}:{port} is in use (another graphserve?); pick another port with {flag}"
                if exc.errno == errno.EADDRNOTAVAIL:
                    return f"{flag}: {host} is not an address of this machine"
                if exc.errno == errno.EACCES:
                    return f"{flag}: binding port {port} needs privileges; pick a port above 1023"
                return f"{flag}: cannot bind {host}:{port}: {exc.strerror}"
    return None


def port_problems(ports: list[tuple[str, str, int]]) -> list[str]:
    """(flag, host, port) triples: each port free, none given twice."""
    problems, seen = [], {}
    for flag, host, port in ports:
        if port and port in seen:
            problems.append(f"{flag} {port} is also {seen[port]}: give each a port of its own")
            continue
        seen[port] = flag
        problem = port_problem(flag, host, port)
        if problem is not None:
            problems.append(problem)
    return problems


def serve_ports(config: ServeConfig) -> list[tuple[str, str, int]]:
    """The ports `graphserve serve` binds: gRPC, /metrics, and admin when a token opens it."""
    ports = [("--port", config.host, config.port), ("--metrics-port", config.host, config.metrics_port)]
    if config.admin_token:
        ports.append(("--admin-port", config.admin_host, config.admin_port))
    return ports


def model_file_problem(model: str) -> str | None:
    """A local model directory that cannot be one: seen without importing the model code."""
    if model.startswith("builtin:"):
        return None
    from service.model_dirs import MISSING_MODEL, model_dir

    path = model_dir(model)
    if path is None:
        return f"--model {model}: {MISSING_MODEL}"
    config = path / "config.json"
    if not config.is_file():
        return f"--model {model}: no config.json in it (is it a Hugging Face model directory?)"
    try:
        json.loads(config.read_text())
    except (OSError, ValueError) as exc:
        return f"--model {model}: config.json is not JSON ({exc})"
    return None


def model_problem(model: str, cache_dir: Path | None, config: ServeConfig | None = None) -> str | None:
    """The model package's verdict: architecture, config, tokenizer and weight files (none read);
    with the server's config, also what depends on the model's shape (draft_layers' layer count, a
    draft model's files and vocab_size)."""
    from service.model.builtin import BUILTIN_PREFIX, BUILTIN_SHAPES
    from service.model.loader import check_model
    from service.model.spec import ModelLoadError

    try:
        spec = check_model(model, cache_dir)
    except ModelLoadError as exc:
        return f"--model {model}: {exc}"
    speculation = config.speculation if config is not None else None
    if speculation is not None and speculation.method == "draft_layers":
        from service.engine.spec.draft_layers import check_draft_layers

        layers = (spec.num_layers if spec is not None
                  else BUILTIN_SHAPES[model.removeprefix(BUILTIN_PREFIX)]["num_hidden_layers"])
        try:
            check_draft_layers(speculation, layers)
        except ValueError as exc:
            return f"--speculative-config: {exc} ({model})"
    if speculation is not None and speculation.method == "draft_model":
        return draft_model_problem(speculation.model or "", model, spec, cache_dir)
    return None


def draft_model_problem(draft: str, model: str, spec: object, cache_dir: Path | None) -> str | None:
    """--speculative-config's draft checkpoint (method draft_model) as check_model sees it, and its
    vocab_size against the target's (its tokenizer's vocabulary is compared when both are loaded)."""
    from service.engine.spec.draft_model import vocab_problem
    from service.model.builtin import BUILTIN_PREFIX, BUILTIN_SHAPES
    from service.model.loader import check_model
    from service.model.spec import ModelLoadError

    def vocab(name: str, found: object) -> int:
        return (found.vocab_size if found is not None  # type: ignore[attr-defined]
                else BUILTIN_SHAPES[name.removeprefix(BUILTIN_PREFIX)]["vocab_size"])

    try:
        draft_spec = check_model(draft, cache_dir)
    except ModelLoadError as exc:
        return f"--speculative-config: speculative_config.model {draft}: {exc}"
    problem = vocab_problem(draft, vocab(draft, draft_spec), model, vocab(model, spec))
    return None if problem is None else f"--speculative-config: {problem} ({model})"


def check_serve(config: ServeConfig) -> list[str]:
    """Every start-up problem of `graphserve serve` with this config, one line each (empty: start)."""
    problems = port_problems(serve_ports(config))
    file_problem = model_file_problem(config.model)
    if file_problem is not None:
        return [*problems, file_problem]
    model = model_problem(config.model, config.model_cache_dir, config)
    return problems + ([model] if model else [])
