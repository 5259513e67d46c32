"""`graphctl`: look at and steer the graph cache of a running graphserve over its admin port.

    graphctl [--target HOST:PORT] [--token-file F] [--json] [--timeout S]
             [--tls-ca F [--tls-cert F --tls-key F]]
             state | stats | capture SIZE... | evict SIZE... | budget BYTES | reset-stats
             | adapters | load-adapter NAME PATH | unload-adapter NAME

The global flags go before or after the command: `graphctl --json state` = `graphctl state --json`.

Exit codes: 0 ok, 2 usage, 3 server unreachable, 4 no or wrong token, 5 refused or failed.
Imports no torch, so it starts fast.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import time
from collections.abc import Callable, Sequence
from fractions import Fraction
from pathlib import Path
from typing import Any

import grpc
from google.protobuf import json_format
from google.protobuf.message import Message

from service.proto import admin_pb2, admin_pb2_grpc

EXIT_OK, EXIT_USAGE, EXIT_UNREACHABLE, EXIT_UNAUTHENTICATED, EXIT_REFUSED = 0, 2, 3, 4, 5
DEFAULT_TARGET = "127.0.0.1:50052"
NOT_DONE = ("failed", "over_budget")  # per-size outcomes that make an operation exit non-zero
MAX_TOKEN_FILE_BYTES = 4096  # a token file holds one token: /dev/zero or a log file given by mistake is refused
MAX_TIMEOUT_S = 86400.0  # gRPC's deadline overflows into "already expired" far above this

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_BYTES_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


class CtlError(Exception):
    """A failure to report as one line on stderr with this exit code."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


# ---- parsing and formatting ------------------------------------------------------------------


def parse_bytes(text: str) -> int:
    """"8GiB", "512MiB", "1.5G", "1e9", "1000000" -> bytes. Unlike --graph-memory-budget, a plain
    number is always bytes, never a fraction of device memory. A count that is not a whole number of
    bytes ("1.999", "0.1KiB") is refused, not rounded."""
    m = _BYTES_RE.match(text)
    unit = m.group(2).lower() if m else ""
    if not m or unit not in _UNITS:
        raise ValueError(f"{text!r} is not a byte count; write e.g. 8GiB, 512MiB or 1000000")
    approx = float(m.group(1)) * _UNITS[unit]  # the range first: the exact value of "1e999999" is huge
    if approx < 1:
        raise ValueError(f"{text!r} is below one byte; the budget must be > 0")
    if approx >= 2**64:
        raise ValueError(f"{text!r} is more bytes than any device has")
    value = Fraction(m.group(1)) * _UNITS[unit]
    if value.denominator != 1:
        raise ValueError(f"{text!r} is {float(value):.6g} bytes, not a whole number; write e.g. "
                         f"{math.floor(value)} or {math.ceil(value)}")
    return int(value)


def _size(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a batch size") from None
    if not 1 <= value < 2**32:
        raise argparse.ArgumentTypeError(f"batch size {value} must be in [1, 2**32)")
    return value


def human_bytes(n: int) -> str:
    if n < 1024:
        return f"{n} B"
    value = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB", "PiB"):
        value /= 1024
        if value < 1024 or unit == "PiB":
            return f"{value:.1f} {unit}"
    raise AssertionError("unreachable")


def human_ms(ms: float) -> str:
    if ms <= 0:
        return "-"
    return f"{ms:.1f} ms" if ms < 1000 else f"{ms / 1000:.2f} s"


def human_ago(unix: float, now: float | None = None) -> str:
    if unix <= 0:
        return "never"
    seconds = max(0.0, (time.time() if now is None else now) - unix)
    if seconds < 120:
        return f"{seconds:.0f} s ago"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min ago"
    if seconds < 2 * 86400:
        return f"{seconds / 3600:.0f} h ago"
    return f"{seconds / 86400:.0f} d ago"


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]], left: Sequence[int] = ()) -> str:
    """Columns aligned; numbers to the right, the columns in `left` to the left."""
    cells = [list(map(str, headers))] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = []
    for r in cells:
        parts = [c.ljust(w) if i in left else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))]
        lines.append("  ".join(parts).rstrip())
    return "\n".join(lines)


def to_dict(message: Message) -> dict:
    try:
        return json_format.MessageToDict(message, preserving_proto_field_name=True,
                                         always_print_fields_with_no_presence=True)
    except TypeError:  # protobuf < 5.26 names the option differently
        return json_format.MessageToDict(message, preserving_proto_field_name=True,
                                         including_default_value_fields=True)


def _state_name(value: int) -> str:
    return admin_pb2.BucketState.Name(value).removeprefix("BUCKET_STATE_").lower()


def format_state(s: admin_pb2.CacheState) -> str:
    captured = sum(b.state == admin_pb2.BUCKET_STATE_CAPTURED for b in s.buckets)
    head = (f"graph cache: mode {s.mode} on {s.device}, {captured} of {len(s.buckets)} buckets captured, "
            f"used {human_bytes(s.used_bytes + s.lora_used_bytes)} of budget {human_bytes(s.budget_bytes)}, "
            f"max batch {s.max_batch}"
            + (f", model {s.architecture}" if s.architecture else ""))
    # One table, one row per descriptor: the graphs of steps with LoRA adapter rows (the wire lists
    # them apart) are rows of kind "full+lora" / "piecewise+lora".
    listed = [(f"{b.kind or 'full'}{'+lora' if lora else ''}", b)
              for lora, buckets in ((False, s.buckets), (True, s.lora_buckets)) for b in buckets]
    rows = [
        (kind, b.size, _state_name(b.state), human_bytes(b.bytes) if b.bytes else "-", human_ms(b.capture_ms),
         b.replays, b.padded_rows, b.eager_fallbacks, b.failures, human_ago(b.last_use_unix))
        for kind, b in listed
    ]
    if s.lora_buckets:
        lora_captured = sum(b.state == admin_pb2.BUCKET_STATE_CAPTURED for b in s.lora_buckets)
        head += (f"\nLoRA graphs (steps with any adapter row): {lora_captured} of {len(s.lora_buckets)} buckets "
                 f"captured, used {human_bytes(s.lora_used_bytes)}")
    head += "".join(f"\n{_rank_line(r)}" for r in s.ranks)  # tensor parallelism: the budget is per rank
    if s.HasField("kv_cache"):
        head += f"\n{_kv_line(s.kv_cache)}"
    body = table(["kind", "size", "state", "bytes", "capture", "replays", "padded", "eager", "failures", "last use"],
                 rows, left=(0, 2, 9))
    notes = [f"bucket {kind}:{b.size}: {b.failure_reason}" for kind, b in listed if b.failure_reason]
    notes += [f"bucket {kind}:{b.size}: kept (a lone row may not pad into a larger graph): only `graphctl evict` "
              "removes it" for kind, b in listed if b.kept]
    return "\n".join([head, body, *notes])


def _kv_line(kv: admin_pb2.KVCacheState) -> str:
    line = (f"KV cache ({kv.dtype or 'dtype unknown'}): {kv.used_blocks} of {kv.total_blocks} blocks used "
            f"({kv.block_size} tokens each), "
            f"{kv.free_blocks} free, {kv.cached_blocks} cached; preemptions {kv.preemptions}")
    if not kv.prefix_caching:
        return line + "; prefix caching off"
    rate = kv.prefix_hit_tokens / kv.prefix_query_tokens if kv.prefix_query_tokens else 0.0
    return line + f"; prefix hits {kv.prefix_hit_tokens} of {kv.prefix_query_tokens} prompt tokens ({rate:.0%})"


def _rank_line(r: admin_pb2.RankMemory) -> str:
    if not r.reported:
        return f"rank {r.rank}: graphs unknown (not reported yet)"
    line = f"rank {r.rank}: graphs {human_bytes(r.graph_bytes)}"
    if r.device_total_bytes:
        line += f", device {human_bytes(r.device_free_bytes)} free of {human_bytes(r.device_total_bytes)}"
    return line


def format_adapters(r: admin_pb2.ListAdaptersResponse) -> str:
    if not r.max_loras:
        return "adapters: off (start graphserve with --max-loras N or --lora-modules NAME=PATH)"
    head = f"adapters: {len(r.adapters)} loaded, {r.max_loras} device slots, max rank {r.max_lora_rank}"
    rows = [(a.name, a.rank, a.slot or "-", a.active_streams, a.path) for a in r.adapters]
    return "\n".join([head, table(["name", "rank", "slot", "streams", "path"], rows, left=(0, 4))])


def format_adapter(a: admin_pb2.AdapterInfo) -> str:
    return f"loaded adapter {a.name!r}: rank {a.rank}, targets {', '.join(a.target_modules)}, from {a.path}"


def _reasons(counts: Sequence[admin_pb2.ReasonCount]) -> str:
    return ", ".join(f"{c.reason} {c.count}" for c in counts) or "-"


def format_stats(s: admin_pb2.CaptureStats) -> str:
    saved = f"last saved {human_ago(s.last_save_unix)}" if s.stats_file else "not persisted"
    lines = [f"stats file: {s.stats_file or '-'} ({saved})", "",
             "requested sizes (full: rows of a decode step; piecewise: tokens of a step):"]
    persisted = {(c.kind or "full", c.size): c.count for c in s.persisted.requested_sizes}
    since = {(c.kind or "full", c.size): c.count for c in s.since_start.requested_sizes}
    keys = sorted(persisted.keys() | since.keys())
    lines.append(table(["kind", "size", "since start", "persisted"],
                       [(*k, since.get(k, 0), persisted.get(k, 0)) for k in keys], left=(0,)) if keys else "  none yet")
    for title, view in (("since start", s.since_start), ("persisted", s.persisted)):
        lines += ["", f"buckets ({title}):"]
        rows = [(b.kind or "full", b.size, b.replays, b.captures, b.evictions, b.failures, b.padded_rows,
                 _reasons(b.eager_fallbacks)) for b in view.buckets]
        lines.append(table(["kind", "size", "replays", "captures", "evictions", "failures", "padded", "eager"],
                           rows, left=(0, 7)))
        lines.append(f"eager fallbacks ({title}): {_reasons(view.eager_fallbacks)}")
    return "\n".join(lines)


def format_operation(r: admin_pb2.OperationResponse) -> str:
    rows = [(x.kind or "full", x.size, x.outcome, human_bytes(x.bytes) if x.bytes else "-", x.message)
            for x in r.results]
    lines = [table(["kind", "size", "outcome", "bytes", "message"], rows, left=(0, 2, 4))] if rows \
        else ["nothing evicted"]
    lines.append(f"used {human_bytes(r.used_bytes)} of budget {human_bytes(r.budget_bytes)}")
    return "\n".join(lines)


# ---- talking to the server -------------------------------------------------------------------


def read_token(token_file: Path | None) -> str:
    if token_file is not None:
        source = f"--token-file {token_file}"
        try:
            with token_file.open("rb") as f:
                data = f.read(MAX_TOKEN_FILE_BYTES + 1)
        except OSError as exc:
            raise CtlError(EXIT_USAGE, f"cannot read {source}: {exc.strerror}") from None
        if len(data) > MAX_TOKEN_FILE_BYTES:
            raise CtlError(EXIT_USAGE, f"{source} is larger than {MAX_TOKEN_FILE_BYTES} bytes; "
                                       "it must hold only the admin token")
        try:
            token = data.decode("utf-8").strip()
        except UnicodeDecodeError:
            raise CtlError(EXIT_USAGE, f"{source} is not UTF-8 text; it must hold only the admin token") from None
        if not token:
            raise CtlError(EXIT_USAGE, f"{source} is empty")
    else:
        source = "GRAPHSERVE_ADMIN_TOKEN"
        token = os.environ.get(source, "").strip()
        if not token:
            raise CtlError(EXIT_UNAUTHENTICATED, "no admin token: pass --token-file F or set GRAPHSERVE_ADMIN_TOKEN")
    if not all("!" <= ch <= "~" for ch in token):  # the server refuses such a token at start, too
        raise CtlError(EXIT_USAGE, f"{source}: the admin token must be visible ASCII characters (no spaces, "
                                   "control or non-ASCII characters)")
    return token


def open_channel(args: argparse.Namespace) -> grpc.Channel:
    if args.tls_ca is None and args.tls_cert is None and args.tls_key is None:
        return grpc.insecure_channel(args.target)
    if (args.tls_cert is None) != (args.tls_key is None):
        raise CtlError(EXIT_USAGE, "--tls-cert and --tls-key must be given together")

    def read(path: Path | None, flag: str) -> bytes | None:
        try:
            return path.read_bytes() if path is not None else None
        except OSError as exc:
            raise CtlError(EXIT_USAGE, f"cannot read {flag} {path}: {exc.strerror}") from None

    credentials = grpc.ssl_channel_credentials(
        root_certificates=read(args.tls_ca, "--tls-ca"),
        private_key=read(args.tls_key, "--tls-key"),
        certificate_chain=read(args.tls_cert, "--tls-cert"),
    )
    return grpc.secure_channel(args.target, credentials)


def rpc_error(exc: grpc.RpcError, command: str, target: str) -> CtlError:
    code, details = exc.code(), exc.details() or ""
    if code == grpc.StatusCode.UNAVAILABLE and "the engine is not running" in details:
        return CtlError(EXIT_REFUSED, f"{command} refused: {details}; the server is shutting down or failed")
    if code == grpc.StatusCode.UNAVAILABLE:
        return CtlError(EXIT_UNREACHABLE, f"cannot reach the admin server at {target} ({details}); is graphserve "
                                          "running with an admin token, and are --target and the TLS flags right?")
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return CtlError(EXIT_UNREACHABLE, f"no answer from {target} within the timeout; retry with a larger --timeout")
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return CtlError(EXIT_UNAUTHENTICATED, "the server rejected the admin token; check --token-file or "
                                              "GRAPHSERVE_ADMIN_TOKEN against the server's token")
    if code == grpc.StatusCode.UNIMPLEMENTED:
        return CtlError(EXIT_REFUSED, f"{target} does not serve the graph-cache admin API; is it the admin port?")
    return CtlError(EXIT_REFUSED, f"{command} refused ({code.name}): {details}")


def run_command(args: argparse.Namespace, stub: admin_pb2_grpc.GraphCacheAdminStub,
                call: Callable[[Callable, Message], Message]) -> tuple[Message, str, int]:
    """(response, readable text, exit code) of one command."""
    if args.command == "state":
        r = call(stub.GetCacheState, admin_pb2.GetCacheStateRequest())
        return r, format_state(r), EXIT_OK
    if args.command == "stats":
        r = call(stub.GetCaptureStats, admin_pb2.GetCaptureStatsRequest())
        return r, format_stats(r), EXIT_OK
    if args.command == "adapters":
        r = call(stub.ListAdapters, admin_pb2.ListAdaptersRequest())
        return r, format_adapters(r), EXIT_OK
    if args.command == "load-adapter":
        path = os.path.abspath(args.path) if os.path.isdir(args.path) else args.path  # the server's filesystem
        r = call(stub.LoadAdapter, admin_pb2.LoadAdapterRequest(name=args.name, path=path))
        return r, format_adapter(r), EXIT_OK
    if args.command == "unload-adapter":
        r = call(stub.UnloadAdapter, admin_pb2.UnloadAdapterRequest(name=args.name))
        return r, f"unloaded adapter {args.name!r}", EXIT_OK
    if args.command == "reset-stats":
        r = call(stub.ResetStats, admin_pb2.ResetStatsRequest())
        return r, "stats reset (since start and persisted)", EXIT_OK
    if args.command in ("capture", "evict"):
        method = stub.Capture if args.command == "capture" else stub.Evict
        r = call(method, admin_pb2.SizesRequest(sizes=args.sizes, kind=args.kind))
    else:
        r = call(stub.SetBudget, admin_pb2.SetBudgetRequest(budget_bytes=args.budget))
    code = EXIT_REFUSED if any(x.outcome in NOT_DONE for x in r.results) else EXIT_OK
    return r, format_operation(r), code


def _add_global_flags(p: argparse.ArgumentParser, defaults: bool) -> None:
    """The flags every command takes. The main parser holds their defaults; each command's parser
    takes them too (`graphctl state --json`), without defaults, so that it only sets what was typed."""

    def default(value: Any) -> Any:
        return value if defaults else argparse.SUPPRESS

    p.add_argument("--target", default=default(None),
                   help=f"admin HOST:PORT (GRAPHSERVE_ADMIN_TARGET, default {DEFAULT_TARGET})")
    p.add_argument("--token-file", type=Path, default=default(None),
                   help="file holding the admin token (or GRAPHSERVE_ADMIN_TOKEN)")
    p.add_argument("--json", action="store_true", default=default(False), help="print the response as JSON")
    p.add_argument("--timeout", type=float, default=default(30.0), help="seconds per call (default 30)")
    p.add_argument("--tls-ca", type=Path, default=default(None), help="CA that signed the server certificate")
    p.add_argument("--tls-cert", type=Path, default=default(None), help="client certificate (mTLS)")
    p.add_argument("--tls-key", type=Path, default=default(None), help="client key (mTLS)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="graphctl", description="Inspect and steer the CUDA-graph cache of a running graphserve.",
        epilog="global flags go before or after the command; "
               "exit codes: 0 ok, 2 usage, 3 unreachable, 4 no or wrong token, 5 refused or failed",
    )
    _add_global_flags(p, defaults=True)
    flags = argparse.ArgumentParser(add_help=False)
    _add_global_flags(flags, defaults=False)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, help: str) -> argparse.ArgumentParser:  # noqa: A002 - argparse's own name
        return sub.add_parser(name, help=help, parents=[flags])

    command("state", "buckets, their state, memory and counters")
    command("stats", "requested-size histogram and per-bucket counters, since start and persisted")
    for name, verb in (("capture", "capture now"), ("evict", "evict now")):
        c = command(name, f"{verb} the graphs of these sizes")
        c.add_argument("sizes", nargs="+", type=_size, metavar="SIZE")
        c.add_argument("--kind", choices=["full", "piecewise", "full+lora", "piecewise+lora"], default="full",
                       help="full: a whole decode step, SIZE rows (default); piecewise: any step, SIZE tokens; "
                            "+lora: the graphs of steps with adapter rows (servers with adapter slots)")
    b = command("budget", "set the graph memory budget, one for the base and LoRA graphs together "
                          "(evicts from either until they fit)")
    b.add_argument("budget", metavar="BYTES", help="e.g. 8GiB, 512MiB or 1000000")
    command("reset-stats", "zero every counter, since start and persisted")
    command("adapters", "the loaded LoRA adapters, their device slots and streams")
    la = command("load-adapter", "load a PEFT LoRA adapter directory (a path on the server) under NAME")
    la.add_argument("name", metavar="NAME")
    la.add_argument("path", metavar="PATH")
    ua = command("unload-adapter", "unload an adapter (refused while streams use it)")
    ua.add_argument("name", metavar="NAME")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    except SystemExit as exc:  # argparse printed usage (or --help)
        return EXIT_OK if exc.code == 0 else EXIT_USAGE
    args.target = args.target or os.environ.get("GRAPHSERVE_ADMIN_TARGET") or DEFAULT_TARGET
    try:
        if args.command == "budget":
            try:
                args.budget = parse_bytes(args.budget)
            except ValueError as exc:
                raise CtlError(EXIT_USAGE, f"budget: {exc}") from None
        if not (math.isfinite(args.timeout) and 0 < args.timeout <= MAX_TIMEOUT_S):
            raise CtlError(EXIT_USAGE, f"--timeout must be a number of seconds in (0, {MAX_TIMEOUT_S:g}], "
                                       f"got {args.timeout:g}")
        metadata = (("authorization", f"Bearer {read_token(args.token_file)}"),)
        with open_channel(args) as channel:
            stub = admin_pb2_grpc.GraphCacheAdminStub(channel)

            def call(method: Callable, request: Message) -> Message:
                try:
                    return method(request, timeout=args.timeout, metadata=metadata)
                except grpc.RpcError as exc:
                    raise rpc_error(exc, args.command, args.target) from None

            response, text, code = run_command(args, stub, call)
    except CtlError as exc:
        print(f"graphctl: {exc}", file=sys.stderr)
        return exc.code
    print(json.dumps(to_dict(response), indent=2) if args.json else text)
    if code != EXIT_OK:
        failed = ", ".join(f"{x.size} ({x.outcome}: {x.message})" for x in response.results if x.outcome in NOT_DONE)
        print(f"graphctl: {args.command} did not complete for {failed}", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
