"""Through the Shepherd Model Gateway (smg) against direct graphserve.v1 gRPC, on one server.

Starts `graphserve serve` as serve_bench.py does (or uses --target), starts `smg launch --backend
vllm` in front of it on the vLLM engine protocol, waits until smg lists the model and answers a
first request, then runs the same workload on both paths, --rounds times in turn: (a) graphserve.v1
Generate with serve_bench.py's load generator, (b) OpenAI streaming chat completions through smg
with the official `openai` AsyncOpenAI client. Both greedy, ignore_eos, max_tokens --output-tokens,
--concurrency streams over --client-procs client processes.

Prompts are text: smg's /v1/completions takes no token-id prompt (it answers 400 "StringOrArray"),
and only chat completions report usage on every chunk (stream_options.continuous_usage_stats), which
gives each chunk's token count. Each prompt is one user message of random word-like tokens whose
rendered chat prompt is exactly --prompt-tokens tokens; the direct path sends those rendered ids, and
a request whose smg usage reports another prompt length counts as failed. smg forwards ignore_eos to
the worker (checked on the tiny model: without it a greedy completion stops at EOS, with it runs to
max_tokens); short_requests counts completions shorter than --output-tokens.

smg detokenizes and sends no chunk while the text ends in an incomplete character, so its chunks
coalesce tokens where direct gRPC chunks carry one each (random weights over a byte-level vocabulary
do that often). The "grpc text" row reads the direct run as a text client would (a chunk where the
server's text advanced), isolating what the gateway adds; TPOT does not depend on chunking.

    python bench/gateway_bench.py --device cpu --concurrency 8 --requests 32 --output-tokens 32
    python bench/gateway_bench.py --model builtin:llama-1b --device cuda --dtype bfloat16 \\
        --concurrency 64 --requests 256 --output-tokens 128 --client-procs 4
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import pathlib
import random
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from typing import Any

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from bench.common import print_table, write_result
from bench.serve_bench import (
    Trace,
    arrival_offsets,
    build_parser,
    closed_loop,
    drive_grpc,
    finish_args,
    run_clients,
    start_server,
    stop_server,
    summarize,
)

_WORDLIKE = re.compile(r"^ ?[A-Za-z0-9.,!?']+$")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = build_parser(__doc__, engine=False)
    g = p.add_argument_group("gateway")
    g.add_argument("--rounds", type=int, default=1, help="direct then smg, this many times")
    g.add_argument("--smg", default=None, help="the smg executable (default: beside this Python, on PATH, else python -m smg)")
    g.add_argument("--smg-args", default="", help="more flags for smg launch, e.g. '--policy round_robin'")
    g.add_argument("--smg-log", type=pathlib.Path, default=None, help="where smg logs (default: a temporary file)")
    g.add_argument("--smg-start-timeout", type=float, default=120.0, help="seconds for smg to serve the model")
    args = finish_args(p.parse_args(argv))
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    return args


# ---- prompts ---------------------------------------------------------------------------------


def render_chat(tokenizer: Any, text: str) -> list[int]:
    """The prompt ids of one user message with the generation prompt, as smg renders and tokenizes it."""
    out = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
    return list(out if isinstance(out, list) else out["input_ids"])


def chat_prompts(tokenizer: Any, n: int, length: int, seed: int) -> list[tuple[str, list[int]]]:
    """n (message text, rendered prompt ids) pairs, each prompt exactly `length` tokens: random
    word-like tokens, trimmed or extended until the rendered message has that length (tokens merge
    across their joins, so the count moves when re-encoded)."""
    special = set(tokenizer.all_special_ids)
    texts = tokenizer.batch_decode([[i] for i in range(len(tokenizer))])
    pieces = [i for i, s in enumerate(texts) if i not in special and _WORDLIKE.match(s)]
    overhead = len(render_chat(tokenizer, ""))
    if length <= overhead or not pieces:
        raise SystemExit(f"--prompt-tokens {length}: the chat template alone takes {overhead} tokens")
    rng = random.Random(seed)
    out: list[tuple[str, list[int]]] = []
    for _ in range(n * 20):
        ids = [rng.choice(pieces) for _ in range(length - overhead)]
        for _ in range(8):
            text = tokenizer.decode(ids)
            rendered = render_chat(tokenizer, text)
            short = length - len(rendered)
            if short == 0:
                out.append((text, rendered))
                break
            ids = ids[:short] if short < 0 else ids + [rng.choice(pieces) for _ in range(short)]
        if len(out) == n:
            return out
    raise SystemExit(f"could not make {n} chat prompts of exactly {length} tokens")


# ---- the smg path ----------------------------------------------------------------------------


async def _one_chat(client: Any, model: str, prompt: tuple[str, int], args: argparse.Namespace, trace: Trace) -> None:
    """One streamed chat completion; chunk token counts from the usage smg reports on every chunk."""
    text, prompt_tokens = prompt
    received = 0
    try:
        stream = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": text}], max_tokens=args.output_tokens,
            temperature=0.0, stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True},
            extra_body={"ignore_eos": True})
        async for chunk in stream:
            now, usage = time.perf_counter(), chunk.usage
            if usage is None:
                continue
            if usage.completion_tokens > received:
                trace.chunks.append((now, usage.completion_tokens - received))
                received = usage.completion_tokens
            if usage.prompt_tokens != prompt_tokens:
                trace.error = f"smg counted {usage.prompt_tokens} prompt tokens, the direct path sent {prompt_tokens}"
        if not trace.chunks and trace.error is None:
            trace.error = "no chunk carried usage (stream_options.continuous_usage_stats)"
    except Exception as exc:  # noqa: BLE001 - recorded per request
        trace.error = f"{type(exc).__name__}: {exc}"
    trace.done = time.perf_counter()


async def drive_smg(target: str, prompts: list[tuple[str, int]], offsets: list[float],
                    args: argparse.Namespace) -> tuple[list[Trace], float]:
    """target: "BASE_URL MODEL"."""
    from openai import AsyncOpenAI

    base_url, model = target.split(" ", 1)
    async with AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=600.0) as client:
        return await closed_loop(prompts, offsets, args, lambda p, trace: _one_chat(client, model, p, args, trace))


def find_smg(explicit: str | None) -> list[str]:
    """The smg command: --smg, else the executable beside this Python or on PATH, else `python -m smg`
    (a package installed with pip --target onto PYTHONPATH has no executable on PATH)."""
    candidates = [explicit] if explicit else [str(pathlib.Path(sys.executable).parent / "smg"), shutil.which("smg")]
    for c in candidates:
        if c and os.access(c, os.X_OK):
            return [c]
    if not explicit and importlib.util.find_spec("smg") is not None:
        return [sys.executable, "-m", "smg"]
    raise SystemExit("smg not found beside this Python, on PATH or as a module: pip install smg (or pass --smg)")


def cpu_seconds(pid: int | None) -> float | None:
    """User + system CPU seconds of process pid (all its threads), from /proc; None where unreadable."""
    try:
        fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, TypeError):
        return None


class Gateway:
    """`smg launch` in front of one worker on the vLLM engine protocol, on free loopback ports."""

    def __init__(self, smg: list[str], worker: str, model_path: str, args: argparse.Namespace) -> None:
        from tests.support.server import free_port

        self.port = free_port()
        self.argv = [*smg, "launch", "--worker-urls", f"grpc://{worker}", "--backend", "vllm",
                     "--host", "127.0.0.1", "--port", str(self.port), "--prometheus-host", "127.0.0.1",
                     "--prometheus-port", str(free_port()), "--model-path", model_path, "--disable-retries",
                     # nothing is in flight when it is stopped: no need to wait the default 180 s for it
                     "--shutdown-grace-period-secs", "2", "--log-level", "warn", *shlex.split(args.smg_args)]
        self._temporary_log = args.smg_log is None  # removed at close; a failure's message carries its tail
        self.log_path = args.smg_log or pathlib.Path(tempfile.mkstemp(prefix="smg-", suffix=".log")[1])
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen(self.argv, stdout=self._log, stderr=subprocess.STDOUT)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def wait_ready(self, model: str, timeout: float) -> None:
        """Until /v1/models lists `model` and a first chat completion comes back."""
        import openai

        deadline = time.monotonic() + timeout
        client = openai.OpenAI(base_url=self.base_url, api_key="none", max_retries=0, timeout=30.0)
        last = "no answer"
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"smg exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.base_url}/models", timeout=5) as r:
                    listed = [m["id"] for m in json.loads(r.read())["data"]]
                if model in listed:
                    client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hello"}],
                                                   max_tokens=2, temperature=0.0)
                    return
                last = f"/v1/models lists {listed}"
            except Exception as exc:  # noqa: BLE001 - not up yet
                last = f"{type(exc).__name__}: {exc}"
            time.sleep(0.25)
        raise RuntimeError(f"smg did not serve {model} within {timeout:.0f} s ({last}):\n{self.log_tail()}")

    def log_tail(self, chars: int = 3000) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-chars:]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()
        if self._temporary_log:
            self.log_path.unlink(missing_ok=True)


def worker_facts(address: str) -> tuple[str, str]:
    """(served model name, model directory) from the worker's vLLM GetModelInfo, as smg reads them."""
    import grpc
    from smg_grpc_proto.generated import vllm_engine_pb2, vllm_engine_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        info = vllm_engine_pb2_grpc.VllmEngineStub(channel).GetModelInfo(vllm_engine_pb2.GetModelInfoRequest(), timeout=30)
    return info.served_model_name, info.model_path


# ---- main ------------------------------------------------------------------------------------


def measure(label: str, run: Any, pids: dict[str, int | None], args: argparse.Namespace,
            round_: int) -> tuple[dict[str, Any], list[Trace]]:
    """run() -> (traces, wall); the row, with each process's CPU time over the run per output token."""
    before = {name: cpu_seconds(pid) for name, pid in pids.items()}
    traces, wall = run()
    row = {"round": round_, **summarize(label, traces, wall, args.output_tokens)}
    for name, pid in pids.items():
        after = cpu_seconds(pid)
        spent = after - before[name] if after is not None and before[name] is not None else None
        row[f"{name}_cpu_s"] = spent
        row[f"{name}_cpu_us_per_token"] = spent / row["tokens"] * 1e6 if spent is not None and row["tokens"] else None
    return row, traces


def text_view(traces: list[Trace]) -> list[Trace]:
    """The direct run as a client reading text sees it: one chunk where the server's text advanced."""
    return [Trace(sent=t.sent, chunks=t.text_chunks, done=t.done, error=t.error) for t in traces]


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import logging

    import structlog

    from service.model.loader import read_tokenizer

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the server and smg on the way out
    smg = find_smg(args.smg)
    rows: list[dict[str, Any]] = []
    ratios: list[dict[str, Any]] = []
    server = None if args.target else start_server(args)
    gateway = None
    try:
        address = args.target or server.address
        model, model_dir = worker_facts(address)
        if not pathlib.Path(model_dir).is_dir():
            raise SystemExit(f"the worker's model directory {model_dir} is not on this machine: smg and the prompts "
                             "need its tokenizer")
        tokenizer = read_tokenizer(pathlib.Path(model_dir))
        prompts = chat_prompts(tokenizer, args.requests, args.prompt_tokens, args.seed)
        warm = chat_prompts(tokenizer, args.warmup_requests, args.prompt_tokens, args.seed + 100) if args.warmup_requests else []
        gateway = Gateway(smg, address, model_dir, args)
        gateway.wait_ready(model, args.smg_start_timeout)
        smg_target = f"{gateway.base_url} {model}"
        pids = {"server": None if server is None else server.proc.pid, "smg": gateway.proc.pid}
        offsets = arrival_offsets(args.requests, args.rate, args.seed)
        if warm:
            w = argparse.Namespace(**{**vars(args), "output_tokens": 8, "rate": None})
            run_clients(drive_grpc, address, [ids for _, ids in warm], [0.0] * len(warm), w)
            run_clients(drive_smg, smg_target, [(t, len(ids)) for t, ids in warm], [0.0] * len(warm), w)
        for r in range(1, args.rounds + 1):
            direct, traces = measure("grpc", lambda: run_clients(drive_grpc, address, [ids for _, ids in prompts],
                                                                 offsets, args), pids, args, r)
            text = {"round": r, **summarize("grpc text", text_view(traces), direct["wall_s"], args.output_tokens)}
            via, _ = measure("smg", lambda: run_clients(drive_smg, smg_target, [(t, len(ids)) for t, ids in prompts],
                                                        offsets, args), pids, args, r)
            rows += [direct, text, via]
            ratios.append({"round": r, "itl_p50": ratio(via["itl_p50_ms"], direct["itl_p50_ms"]),
                           "itl_p50_vs_text": ratio(via["itl_p50_ms"], text["itl_p50_ms"]),
                           "tpot_p50": ratio(via["tpot_p50_ms"], direct["tpot_p50_ms"]),
                           "tok_per_s": ratio(via["tok_per_s"], direct["tok_per_s"]),
                           "ttft_p50": ratio(via["ttft_p50_ms"], direct["ttft_p50_ms"])})
    finally:
        if gateway is not None:
            gateway.close()
        if server is not None:
            stop_server(server)
    summary = {k: statistics.median(x[k] for x in ratios) if all(x[k] is not None for x in ratios) else None
               for k in ratios[0] if k != "round"}
    workload_info = {k: getattr(args, k) for k in ("model", "device", "dtype", "concurrency", "requests",
                                                   "prompt_tokens", "output_tokens", "rate", "stream_interval",
                                                   "max_running_seqs", "max_seq_len", "warmup_requests", "target",
                                                   "client_procs", "overlap_steps", "rounds")}
    path = write_result("gateway", {
        "workload": workload_info,
        "smg_command": shlex.join(gateway.argv),
        "results": rows,
        "smg_over_direct": ratios,
        "smg_over_direct_median": summary,
        "targets": {"itl_p50": "<= 1.10", "tok_per_s": ">= 0.95"},
        "notes": "client-side receive times; ITL is one sample per chunk (a chunk of k tokens is one gap); smg's "
                 "chunk token counts come from usage on every chunk (continuous_usage_stats); 'grpc text' is the "
                 "direct run counting only chunks where the server's text advanced; *_cpu_s is the process's "
                 "user + system CPU time over the run (server: the gRPC process, not its engine process)",
    }, device=args.device)
    print_table(rows, ["round", "path", "ok", "errors", "wall_s", "tok_per_s", "ttft_p50_ms", "ttft_p99_ms",
                       "itl_p50_ms", "itl_p99_ms", "itl_max_ms", "tpot_p50_ms", "tokens_per_chunk",
                       "server_cpu_us_per_token", "smg_cpu_us_per_token"],
                title=f"\n{args.model} {args.dtype} on {args.device}: {args.requests} requests, concurrency "
                      f"{args.concurrency}, {args.prompt_tokens} prompt + {args.output_tokens} output tokens, "
                      f"{args.client_procs} client process(es)")
    print_table(ratios, ["round", "itl_p50", "itl_p50_vs_text", "tpot_p50", "tok_per_s", "ttft_p50"],
                title="\nsmg / direct")
    if summary["itl_p50"] is not None and summary["tok_per_s"] is not None:
        print(f"target: ITL p50 smg/direct {summary['itl_p50']:.3f} (<= 1.10: "
              f"{'met' if summary['itl_p50'] <= 1.10 else 'missed'}), tokens/s {summary['tok_per_s']:.3f} "
              f"(>= 0.95: {'met' if summary['tok_per_s'] >= 0.95 else 'missed'})")
    for row in rows:
        if row["errors"]:
            print(f"first {row['path']} error:", row["first_error"])
    print(f"wrote {path}")
    return 0 if all(r["errors"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
