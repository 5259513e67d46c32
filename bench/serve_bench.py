"""Serving benchmark: a grpc.aio load generator, and the same workload on the engine without gRPC.

Fixed prompt length (random token ids) and output length (ignore_eos, greedy). Closed loop with
--concurrency streams by default; --rate R gives Poisson arrivals at R requests/s (still at most
--concurrency in flight). Reports TTFT and inter-token latency (p50/p99, client receive times),
request and token throughput, and serving overhead = gRPC token throughput / engine-alone token
throughput. By default it starts `graphserve serve` as a separate process, as a client would meet
it (a load generator in the server's process would share its GIL); --target uses a running one.
--client-procs spreads the streams over several client processes so that the load generator is
not the bottleneck at high message rates. A list of concurrencies (--concurrency 1,64,128,256) runs
each level in turn against the same server and the same engine process, --requests (default
4 x the level) at each. The engine-alone run starts the server's engine process
and drives it over its pipe from this process, without gRPC.

    python bench/serve_bench.py --device cpu --concurrency 8 --requests 32 --output-tokens 32
    python bench/serve_bench.py --model builtin:llama-1b --device cuda --dtype bfloat16 \
        --concurrency 64 --requests 256 --output-tokens 128
    python bench/serve_bench.py --model builtin:llama-1b --device cuda --concurrency 1,64,128,256 \
        --prompt-tokens 32 --output-tokens 256 --client-procs 4
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import pathlib
import random
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from bench.common import percentile, print_table, write_result
from service.telemetry.gc_pauses import freeze_startup_heap


@dataclass
class Trace:
    """Client-side times (time.perf_counter) of one request."""

    sent: float
    chunks: list[tuple[float, int]] = field(default_factory=list)  # (receive time, tokens in chunk)
    # The chunks that carried text, each with the tokens received since the last one: what a client
    # reading text sees when the server holds back bytes of an incomplete character.
    text_chunks: list[tuple[float, int]] = field(default_factory=list)
    done: float | None = None
    error: str | None = None
    # The engine's own times of the request (its Finish timings): from arrival in the server to the
    # first scheduling step, and to the first token
    server_queue_s: float | None = None
    server_ttft_s: float | None = None


def build_parser(description: str | None = __doc__, engine: bool = True) -> argparse.ArgumentParser:
    """The workload's and the started server's flags; engine: also --skip-engine / --skip-grpc
    (gateway_bench.py runs no engine-alone path and adds flags of its own)."""
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="builtin:tiny")
    p.add_argument("--cache-dir", type=pathlib.Path, default=None, help="where built-in models are generated")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="default bfloat16 on cuda, float32 on cpu")
    p.add_argument("--max-running-seqs", type=int, default=None, help="default: --concurrency")
    p.add_argument("--tensor-parallel-size", type=int, default=1, help="ranks (GPUs) the served model is split across")
    p.add_argument("--target", default=None, help="HOST:PORT of a running server (default: start one here)")
    p.add_argument("--concurrency", type=_levels, default=[64],
                   help="streams in flight; a list (1,64,128) runs each level against the same server")
    p.add_argument("--requests", type=int, default=None, help="per level (default: 4 x the concurrency)")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument("--rate", type=float, default=None, help="requests/s, Poisson arrivals (default: closed loop)")
    p.add_argument("--stream-interval", type=int, default=1)
    p.add_argument("--warmup-requests", type=int, default=None,
                   help="short untimed requests first, to capture graphs (default: --concurrency)")
    if engine:
        p.add_argument("--skip-engine", action="store_true", help="skip the engine-alone run")
        p.add_argument("--skip-grpc", action="store_true", help="skip the gRPC run")
    p.add_argument("--no-overlap-steps", dest="overlap_steps", action="store_false",
                   help="the server and the engine read each step's tokens before launching the next")
    p.add_argument("--client-procs", type=int, default=1, help="client processes sharing the streams")
    if engine:
        p.add_argument("--step-baseline", action=argparse.BooleanOptionalAction, default=None,
                       help="time the graphed decode step at this workload's contexts in the same invocation and "
                            "report each closed-loop level against it (default: on for cuda, one rank, no --target)")
    p.add_argument("--server-log", type=pathlib.Path, default=None, help="where the started server logs")
    p.add_argument("--py-spy", type=pathlib.Path, default=None, metavar="DIR",
                   help="record the started server's gRPC process with py-spy (raw, per thread, idle included) "
                        "during each level into DIR/grpc-<streams>.txt")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--server-args", default="",
                   help="more flags for the started server, e.g. '--cudagraph-mode full --stats-file s.json'")
    return p


def _levels(text: str) -> list[int]:
    levels = [int(x) for x in text.split(",")]
    if not levels or min(levels) < 1:
        raise argparse.ArgumentTypeError(f"concurrency must be a list of integers >= 1, not {text!r}")
    return levels


def at_level(args: argparse.Namespace, concurrency: int) -> argparse.Namespace:
    """The flags of one concurrency level: its streams and (unless given) 4 requests per stream."""
    requests = args.given_requests if args.given_requests is not None else 4 * concurrency
    return argparse.Namespace(**{**vars(args), "concurrency": concurrency, "requests": requests})


def finish_args(args: argparse.Namespace) -> argparse.Namespace:
    """Defaults that depend on other flags. args.concurrency becomes the largest level (what the server is
    sized for), args.levels the list."""
    args.levels, args.concurrency = args.concurrency, max(args.concurrency)
    args.given_requests = args.requests
    args.requests = args.requests if args.requests is not None else 4 * args.concurrency
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    args.max_running_seqs = args.max_running_seqs or args.concurrency
    args.warmup_requests = args.concurrency if args.warmup_requests is None else args.warmup_requests
    args.max_seq_len = args.prompt_tokens + args.output_tokens + 8
    if getattr(args, "step_baseline", False) is None:
        args.step_baseline = args.device == "cuda" and args.tensor_parallel_size == 1 and args.target is None
    return args


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return finish_args(build_parser().parse_args(argv))


def make_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab - 300) for _ in range(length)] for _ in range(n)]


def arrival_offsets(n: int, rate: float | None, seed: int) -> list[float]:
    """Seconds after the start at which request i may be sent (all 0 in closed loop)."""
    if rate is None:
        return [0.0] * n
    rng, t, out = random.Random(seed + 1), 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


# ---- summary ---------------------------------------------------------------------------------


def summarize(label: str, traces: list[Trace], wall_s: float, output_tokens: int) -> dict[str, Any]:
    """TTFT per request; ITL = gaps between consecutive chunk arrivals, one sample per chunk (a chunk
    carrying k > 1 tokens is one gap: "coalesced" counts those chunks); TPOT per request = (last
    chunk - first chunk) / the tokens after the first chunk, which coalescing does not change."""
    ok = [t for t in traces if t.error is None and t.chunks]
    ttft = [(t.chunks[0][0] - t.sent) * 1000.0 for t in ok]
    itl = [(b[0] - a[0]) * 1000.0 for t in ok for a, b in zip(t.chunks, t.chunks[1:])]
    tpot = [(t.chunks[-1][0] - t.chunks[0][0]) * 1000.0 / after for t in ok
            if (after := sum(k for _, k in t.chunks[1:])) > 0]
    chunks = [k for t in ok for _, k in t.chunks]
    tokens = sum(chunks)
    # Gaps over 50 ms: when in the run (s after its first send) and where in their stream (the chunk
    # they end); one time shared by many streams is a server-wide stall, times spread out are not.
    start = min((t.sent for t in ok), default=0.0)
    long_gaps = sorted((round(b[0] - start, 3), i + 1) for t in ok for i, (a, b) in enumerate(zip(t.chunks, t.chunks[1:]))
                       if b[0] - a[0] > 0.05)
    return {
        "path": label,
        "requests": len(traces),
        "ok": len(ok),
        "errors": len(traces) - len(ok),
        "first_error": next((t.error for t in traces if t.error), None),
        "wall_s": wall_s,
        "req_per_s": len(ok) / wall_s,
        "tok_per_s": tokens / wall_s,
        "tokens": tokens,
        "short_requests": sum(1 for t in ok if sum(k for _, k in t.chunks) != output_tokens),
        "ttft_p50_ms": percentile(ttft, 50),
        "ttft_p99_ms": percentile(ttft, 99),
        "server_queue_p50_ms": percentile([t.server_queue_s * 1000.0 for t in ok if t.server_queue_s is not None], 50),
        "server_ttft_p50_ms": percentile([t.server_ttft_s * 1000.0 for t in ok if t.server_ttft_s is not None], 50),
        "itl_p50_ms": percentile(itl, 50),
        "itl_p99_ms": percentile(itl, 99),
        "itl_max_ms": max(itl, default=None),
        "tpot_p50_ms": percentile(tpot, 50),
        "chunks": len(chunks),
        "coalesced_chunks": sum(1 for k in chunks if k > 1),
        "tokens_per_chunk": tokens / max(len(chunks), 1),
        "long_gaps": len(long_gaps),
        "long_gap_at_s_and_chunk": long_gaps[:: max(1, len(long_gaps) // 40)],  # at most ~40 samples
    }


# ---- gRPC path -------------------------------------------------------------------------------


async def _one_grpc(stub: Any, pb: Any, prompt: list[int], args: argparse.Namespace, trace: Trace) -> None:
    request = pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=prompt),
        sampling=pb.SamplingParams(temperature=0.0),
        stopping=pb.StoppingCriteria(max_tokens=args.output_tokens, ignore_eos=True),
        stream_interval=args.stream_interval,
    )
    held = 0  # tokens received since the last chunk with text
    try:
        async for response in stub.Generate(request, timeout=600):
            if response.WhichOneof("kind") != "chunk":
                if response.WhichOneof("kind") == "finished" and response.finished.HasField("timings"):
                    trace.server_queue_s = response.finished.timings.queue_seconds
                    trace.server_ttft_s = response.finished.timings.time_to_first_token_seconds
                continue
            now, k = time.perf_counter(), len(response.chunk.token_ids)
            if k:
                trace.chunks.append((now, k))
            held += k
            if response.chunk.text and held:
                trace.text_chunks.append((now, held))
                held = 0
    except Exception as exc:  # noqa: BLE001 - recorded per request
        trace.error = f"{type(exc).__name__}: {exc}"
    trace.done = time.perf_counter()
    if held and trace.error is None:  # the completion ended inside a character
        trace.text_chunks.append((trace.done, held))


async def closed_loop(prompts: list[Any], offsets: list[float], args: argparse.Namespace,
                      send: Callable[[Any, Trace], Awaitable[None]]) -> tuple[list[Trace], float]:
    """send(prompt, trace) for every prompt at its offset, at most --concurrency at once."""
    gate = asyncio.Semaphore(args.concurrency)
    traces: list[Trace] = []
    start = time.perf_counter()

    async def one(prompt: Any, offset: float) -> None:
        await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
        async with gate:
            trace = Trace(sent=time.perf_counter())
            traces.append(trace)
            await send(prompt, trace)

    await asyncio.gather(*(one(p, o) for p, o in zip(prompts, offsets)))
    return traces, time.perf_counter() - start


async def drive_grpc(address: str, prompts: list[list[int]], offsets: list[float],
                     args: argparse.Namespace) -> tuple[list[Trace], float]:
    import grpc

    from service.proto import inference_pb2 as pb
    from service.proto import inference_pb2_grpc

    async with grpc.aio.insecure_channel(address) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        return await closed_loop(prompts, offsets, args, lambda prompt, trace: _one_grpc(stub, pb, prompt, args, trace))


Driver = Callable[[str, list[Any], list[float], argparse.Namespace], Awaitable[tuple[list[Trace], float]]]


def _client_worker(drive: Driver, target: str, prompts: list[Any], offsets: list[float],
                   args: argparse.Namespace, start_at: float) -> tuple[list[Trace], float, float]:
    freeze_startup_heap()  # a full collection here would delay the receive times it records
    time.sleep(max(0.0, start_at - time.perf_counter()))  # every client process starts together
    start = time.perf_counter()
    traces, wall = asyncio.run(drive(target, prompts, offsets, args))
    return traces, start, start + wall


def run_clients(drive: Driver, target: str, prompts: list[Any], offsets: list[float],
                args: argparse.Namespace) -> tuple[list[Trace], float]:
    """asyncio.run(drive(target, ...)) here, or in --client-procs processes: requests i, i + n,
    i + 2n, ... go to client process i, each with its share of the concurrency; perf_counter is
    CLOCK_MONOTONIC, shared by the processes. `drive` must be a module-level function (pickled)."""
    n = max(1, min(args.client_procs, args.concurrency, len(prompts)))
    if n == 1:
        freeze_startup_heap()
        return asyncio.run(drive(target, prompts, offsets, args))
    import concurrent.futures
    import multiprocessing

    shares = [argparse.Namespace(**{**vars(args), "concurrency": args.concurrency // n + (i < args.concurrency % n)})
              for i in range(n)]
    with concurrent.futures.ProcessPoolExecutor(n, mp_context=multiprocessing.get_context("spawn")) as pool:
        list(pool.map(time.sleep, [0.5] * n))  # spawned and imported before the clock starts
        start_at = time.perf_counter() + 0.5
        parts = list(pool.map(_client_worker, [drive] * n, [target] * n, [prompts[i::n] for i in range(n)],
                              [offsets[i::n] for i in range(n)], shares, [start_at] * n))
    traces = [t for part, _, _ in parts for t in part]
    return traces, max(end for _, _, end in parts) - min(start for _, start, _ in parts)


def run_grpc(address: str, prompts: list[list[int]], offsets: list[float],
             args: argparse.Namespace) -> tuple[list[Trace], float]:
    return run_clients(drive_grpc, address, prompts, offsets, args)


def start_server(args: argparse.Namespace) -> Any:
    from tests.support.process import ServerProcess

    argv = ["--model", args.model, "--device", args.device, "--dtype", args.dtype,
            "--max-running-seqs", str(args.max_running_seqs), "--max-seq-len", str(args.max_seq_len),
            "--admin-port", "0", "--log-level", "warning", "--tensor-parallel-size", str(args.tensor_parallel_size)]
    if not args.overlap_steps:
        argv.append("--no-overlap-steps")
    if args.cache_dir is not None:
        argv += ["--model-cache-dir", str(args.cache_dir)]
    argv += shlex.split(args.server_args)
    server = ServerProcess(argv, log_path=args.server_log)
    try:
        server.wait_for_health(1, timeout=600)  # SERVING
    except BaseException:
        server.close()
        raise
    return server


def py_spy(pid: int, out: pathlib.Path) -> subprocess.Popen:
    """py-spy recording process `pid` until SIGINT: raw stacks (one line per stack and count, for
    flamegraph.pl or a grep), every thread, idle samples kept (where the event loop waits)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    exe = shutil.which("py-spy") or str(pathlib.Path(sys.executable).parent / "py-spy")
    for site in sys.path:  # pip --target puts the binary in <target>/bin, off PATH
        if (pathlib.Path(site) / "bin" / "py-spy").exists():
            exe = str(pathlib.Path(site) / "bin" / "py-spy")
    return subprocess.Popen([exe, "record", "-p", str(pid), "-f", "raw", "--threads", "--idle", "-r", "200",
                             "-o", str(out)], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)


def stop_server(server: Any) -> None:
    server.terminate()
    try:
        server.wait(120)
    finally:
        server.close()


# ---- engine-alone path -----------------------------------------------------------------------


class EngineAlone:
    """The engine process the server runs, driven without gRPC: its pipe is read by an event loop on a
    thread of this process, as in the gRPC process, so sinks run there and submits come from the
    caller's thread. The engine keeps its own process and GIL, as when serving."""

    def __init__(self, args: argparse.Namespace) -> None:
        from service.config import ServeConfig
        from service.engine_client.faults import Faults
        from service.engine_client.gil import shorten_switch_interval
        from service.engine_client.messages import WorkerSpec
        from service.engine_client.process import EngineProcess

        shorten_switch_interval()  # as in the gRPC process
        config = ServeConfig(model=args.model, model_cache_dir=args.cache_dir, device=args.device, dtype=args.dtype,
                             max_running_seqs=args.max_running_seqs, max_seq_len=args.max_seq_len,
                             overlap_steps=args.overlap_steps, log_level="warning",
                             tensor_parallel_size=args.tensor_parallel_size)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="engine-pipe", daemon=True)
        self.thread.start()
        self.process = EngineProcess(WorkerSpec(config, Faults()), self.loop)
        try:
            self.process.start()
        except BaseException:
            self.close()
            raise
        # This process reads the engine's pipe, as the gRPC process does: keep its collections short too.
        freeze_startup_heap()

    def submit(self, request: Any, sink: Any) -> str:
        return self.process.submit(request, sink)

    def close(self) -> None:
        self.process.stop()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def run_engine(engine: Any, prompts: list[list[int]], offsets: list[float],
               args: argparse.Namespace, tag: str) -> tuple[list[Trace], float]:
    """Submits from this thread; sinks record perf_counter times on the engine's pipe reader."""
    from service.engine.request import (
        EngineError,
        Finish,
        GenerationRequest,
        SamplingParams,
        TokenDelta,
    )

    gate = threading.Semaphore(args.concurrency)
    finished = threading.Semaphore(0)
    traces: list[Trace] = []

    def sink_for(trace: Trace):
        def sink(event: Any) -> None:
            now = time.perf_counter()
            if isinstance(event, TokenDelta) and event.token_ids:
                trace.chunks.append((now, len(event.token_ids)))
            elif isinstance(event, (Finish, EngineError)):
                if isinstance(event, Finish) and event.final_delta is not None and event.final_delta.token_ids:
                    trace.chunks.append((now, len(event.final_delta.token_ids)))
                if isinstance(event, EngineError):
                    trace.error = event.message
                else:
                    trace.server_queue_s, trace.server_ttft_s = event.queue_seconds, event.time_to_first_token_seconds
                trace.done = now
                gate.release()
                finished.release()
        return sink

    start = time.perf_counter()
    for i, (prompt, offset) in enumerate(zip(prompts, offsets)):
        time.sleep(max(0.0, start + offset - time.perf_counter()))
        gate.acquire()
        trace = Trace(sent=time.perf_counter())
        traces.append(trace)
        engine.submit(GenerationRequest(
            request_id=f"{tag}-{i}", prompt_token_ids=prompt,
                sampling=SamplingParams(temperature=0.0, max_tokens=args.output_tokens, ignore_eos=True, seed=0),
            stream_interval=args.stream_interval, arrival_time=time.monotonic()), sink_for(trace))
    for _ in prompts:
        if not finished.acquire(timeout=600):
            raise RuntimeError("engine-alone run timed out")
    return traces, time.perf_counter() - start


# ---- main ------------------------------------------------------------------------------------


def vocab_size(args: argparse.Namespace) -> int:
    from service.model.builtin import BUILTIN_PREFIX, BUILTIN_SHAPES

    if args.model.startswith(BUILTIN_PREFIX):
        return BUILTIN_SHAPES[args.model[len(BUILTIN_PREFIX):]]["vocab_size"]
    import json

    return int(json.loads((pathlib.Path(args.model).expanduser() / "config.json").read_text())["vocab_size"])


def workload(args: argparse.Namespace, n: int, output_tokens: int, seed: int) -> tuple[list, list]:
    prompts = make_prompts(n, args.prompt_tokens, vocab_size(args), seed)
    return prompts, arrival_offsets(n, args.rate, seed)


def bench_grpc(args: argparse.Namespace) -> list[dict[str, Any]]:
    server = None if args.target else start_server(args)
    address = args.target or server.address
    rows = []
    try:
        if args.warmup_requests:
            warm = argparse.Namespace(**{**vars(args), "output_tokens": 8, "rate": None})
            run_grpc(address, *workload(warm, args.warmup_requests, 8, args.seed + 100), warm)
        for level in args.levels:
            a = at_level(args, level)
            spy = None if args.py_spy is None or server is None else py_spy(server.proc.pid, args.py_spy / f"grpc-{level}.txt")
            try:
                traces, wall = run_grpc(address, *workload(a, a.requests, a.output_tokens, a.seed), a)
            finally:
                if spy is not None:
                    spy.send_signal(signal.SIGINT)  # py-spy writes its samples and exits
                    spy.wait(60)
            rows.append({"streams": level, **summarize("grpc" if args.target is None else f"grpc {args.target}",
                                                       traces, wall, args.output_tokens)})
    finally:
        if server is not None:
            stop_server(server)
    return rows


def bench_engine(args: argparse.Namespace) -> list[dict[str, Any]]:
    engine = EngineAlone(args)
    rows = []
    try:
        if args.warmup_requests:
            warm = argparse.Namespace(**{**vars(args), "output_tokens": 8, "rate": None})
            run_engine(engine, *workload(warm, args.warmup_requests, 8, args.seed + 100), warm, "warm")
        for level in args.levels:
            a = at_level(args, level)
            traces, wall = run_engine(engine, *workload(a, a.requests, a.output_tokens, a.seed), a, f"run{level}")
            rows.append({"streams": level, **summarize("engine", traces, wall, args.output_tokens)})
    finally:
        engine.close()
    return rows


def free_device(args: argparse.Namespace) -> None:
    gc.collect()
    if args.device == "cuda":
        torch.cuda.empty_cache()


def against_graphed_step(args: argparse.Namespace, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The decode step timed at this workload's own contexts, now, on this machine; each closed-loop row's
    tokens/s over what that step allows at its streams (bench/step_baseline.py)."""
    from bench import step_baseline

    batch = {level: min(level, args.max_running_seqs) for level in args.levels}
    baseline = step_baseline.measure(args, sorted(set(batch.values())))
    allows = {r["batch"]: r["allows_tok_per_s"] for r in baseline["rows"]}
    for row in rows:
        row["step_allows_tok_per_s"] = allows[batch[row["streams"]]]
        row["vs_graphed_step"] = row["tok_per_s"] / row["step_allows_tok_per_s"]
    return baseline


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import logging

    import structlog

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    grpc_rows = [] if args.skip_grpc else bench_grpc(args)
    free_device(args)
    engine_rows = [] if args.skip_engine else bench_engine(args)
    free_device(args)
    rows = sorted(grpc_rows + engine_rows, key=lambda r: r["streams"])
    overhead = {g["streams"]: g["tok_per_s"] / e["tok_per_s"] for g, e in zip(grpc_rows, engine_rows)
                if e["tok_per_s"]}
    baseline = against_graphed_step(args, rows) if args.step_baseline and args.rate is None else None
    workload_info = {k: getattr(args, k) for k in ("model", "device", "dtype", "levels", "requests",
                                                   "prompt_tokens", "output_tokens", "rate", "stream_interval",
                                                   "max_running_seqs", "max_seq_len", "warmup_requests", "target",
                                                   "client_procs", "overlap_steps", "server_args")}
    requests = workload_info["requests"] = args.given_requests if args.given_requests is not None else "4 x streams"
    path = write_result("serve", {
        "workload": workload_info,
        "results": rows,
        "grpc_over_engine_token_throughput": {str(k): v for k, v in overhead.items()},
        "graphed_step": baseline,
        "notes": "client-side receive times (engine path: the engine process without gRPC, sink times where "
                 "its pipe is read); ITL is one "
                 "sample per chunk, coalesced_chunks counts chunks carrying more than one token",
    }, device=args.device)
    print_table(rows, ["streams", "path", "ok", "errors", "wall_s", "req_per_s", "tok_per_s", "ttft_p50_ms",
                       "ttft_p99_ms", "server_queue_p50_ms", "server_ttft_p50_ms", "itl_p50_ms", "itl_p99_ms",
                       "itl_max_ms", "long_gaps", "tpot_p50_ms", "tokens_per_chunk", "vs_graphed_step"],
                title=f"\n{args.model} {args.dtype} on {args.device}: {requests} requests per level, "
                      f"{args.prompt_tokens} prompt + {args.output_tokens} output tokens"
                      f"{'' if args.rate is None else f', Poisson {args.rate}/s'}"
                      f"{f' (server: {args.server_args})' if args.server_args else ''}")
    for streams, ratio in overhead.items():
        print(f"serving overhead at {streams} streams: gRPC / engine-alone token throughput = {ratio:.3f}")
    for row in (baseline or {}).get("rows", []):
        print(f"the {baseline['mode']} step of {row['batch']} rows at contexts {baseline['contexts']} (same invocation): "
              f"{row['step_ms']:.3f} ms, allows {row['allows_tok_per_s']:,.0f} tokens/s")
    for row in rows:
        if row["errors"]:
            print(f"first error at {row['streams']} streams ({row['path']}):", row["first_error"])
    print(f"wrote {path}")
    return 0 if all(r["errors"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
