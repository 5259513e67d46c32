"""Hostile structured-output constraints against a real server, as a client outside the project
sends them: what other streams see, what the hostile requests get, memory, shutdown.

Each scenario starts `graphserve serve` as its own process and talks to it with plain gRPC stubs
(graphserve.v1 and vLLM's engine protocol):

- gaps: victim streams (greedy, one token per message) while hostile constraints arrive; the
  longest and p99 gap between a victim's messages, against the same victims alone.
- memory: the engine process's RSS before and after many distinct hostile constraints.
- flood: an unrelated request's time to first token alone and while compiles flood the server.
- shutdown: SIGTERM while compiles run; seconds until the process exits.
- outcomes: every hostile request's status; completions that claim success are checked against
  their constraint (a success that breaks its constraint is a violation).

    python bench/hostile_constraints.py --repeat 3 --memory-constraints 100
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import pathlib
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from typing import Any

import grpc

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from bench.common import percentile, print_table, write_result
from service.proto import inference_pb2 as pb
from service.proto import inference_pb2_grpc

HEALTH_SERVING = 1


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="builtin:tiny")
    p.add_argument("--cache-dir", type=pathlib.Path, default=None)
    p.add_argument("--repeat", type=int, default=3, help="runs of the gap scenario, a fresh server each")
    p.add_argument("--victims", type=int, default=4)
    p.add_argument("--victim-tokens", type=int, default=300)
    p.add_argument("--hostile", type=int, default=8, help="hostile requests per gap run")
    p.add_argument("--memory-constraints", type=int, default=100)
    p.add_argument("--flood", type=int, default=12, help="concurrent hostile compiles in the flood")
    p.add_argument("--ttft-samples", type=int, default=30,
                   help="unrelated requests timed alone and again under the flood (10 gave p50 ratios of 0.8-2.9x "
                        "on one 2-core host from run to run)")
    p.add_argument("--server-args", default="", help="extra flags for graphserve serve")
    p.add_argument("--scenarios", default="gaps,memory,flood,shutdown", help="which scenarios to run")
    p.add_argument("--hostile-nice", type=int, default=0,
                   help="the hostile client's niceness: 19 stands in for a client on another host, whose CPU is not "
                        "the server's (on a 2-core machine the client building a 150,000-entry list takes a core)")
    return p.parse_args(argv)


# ---- the server ------------------------------------------------------------------------------

class Server:
    def __init__(self, args: argparse.Namespace, log_dir: pathlib.Path, *extra: str) -> None:
        from tests.support.server import free_port

        self.port = free_port()
        self.log_path = log_dir / f"server-{self.port}.log"
        cache = args.cache_dir or pathlib.Path(tempfile.gettempdir()) / "graphserve-bench-models"
        cmd = [sys.executable, "-m", "service", "serve", "--model", args.model, "--model-cache-dir", str(cache),
               "--host", "127.0.0.1", "--port", str(self.port), "--admin-port", "0", "--metrics-port", "0",
               "--log-format", "json", *args.server_args.split(), *extra]
        self.started = time.monotonic()
        self.proc = subprocess.Popen(cmd, stdout=open(self.log_path, "w"), stderr=subprocess.STDOUT,
                                     cwd=pathlib.Path(__file__).resolve().parents[1])
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.port}")
        self._wait_serving()

    def _wait_serving(self, timeout: float = 300) -> None:
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        stub = health_pb2_grpc.HealthStub(self.channel)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited: {self.log_path.read_text()[-2000:]}")
            try:
                if stub.Check(health_pb2.HealthCheckRequest(), timeout=2).status == HEALTH_SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.2)
        raise TimeoutError("the server did not turn SERVING")

    @property
    def engine_pid(self) -> int:
        for line in self.log_path.read_text().splitlines():
            if '"engine_process_started"' in line:
                return int(json.loads(line)["pid"])
        raise RuntimeError("no engine_process_started in the log")

    def serving(self) -> bool:
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        try:
            return health_pb2_grpc.HealthStub(self.channel).Check(health_pb2.HealthCheckRequest(),
                                                                  timeout=5).status == HEALTH_SERVING
        except grpc.RpcError:
            return False

    def stop(self) -> float:
        """SIGTERM; seconds until the process exited."""
        t = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(300)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.channel.close()
        return time.monotonic() - t


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


# ---- requests --------------------------------------------------------------------------------

def hostile_sampling(i: int) -> tuple[str, pb.SamplingParams]:
    """The i-th hostile constraint (each distinct, so none is served from a cache)."""
    kinds = [
        ("regex", pb.SamplingParams(regex="p{1000}{%d}" % (1129 + i))),  # 13 bytes, a million-character literal
        ("json_schema", pb.SamplingParams(json_schema=json.dumps({"type": "string", "pattern": "^a{1000}{%d}$" % (50 + i)}))),
        ("regex", pb.SamplingParams(regex="(x|y){1000}{%d}" % (100 + i))),
        ("grammar", pb.SamplingParams(grammar="root ::= " + " | ".join(f'"w{i}x{j}"' for j in range(2500)))),
        ("choice", pb.SamplingParams(choice=pb.Choices(choices=[f"c{i}-{j}" for j in range(150_000)]))),
    ]
    return kinds[i % len(kinds)]


def send(stub: Any, sampling: pb.SamplingParams, max_tokens: int = 40, text: str = "x") -> dict[str, Any]:
    t = time.monotonic()
    out: dict[str, Any] = {"first_token_s": None}
    ids: list[int] = []
    try:
        for r in stub.Generate(pb.GenerateRequest(text=text, sampling=sampling,
                                                  stopping=pb.StoppingCriteria(max_tokens=max_tokens)), timeout=120):
            if r.HasField("chunk"):
                if out["first_token_s"] is None:
                    out["first_token_s"] = time.monotonic() - t
                ids += r.chunk.token_ids
                out["text"] = out.get("text", "") + r.chunk.text
            elif r.HasField("finished"):
                out["status"] = "OK"
                out["finish"] = pb.FinishReason.Name(r.finished.finish_reason)
                # the server's own clock: from the request's arrival in the gRPC process to its first token
                out["server_first_token_s"] = r.finished.timings.time_to_first_token_seconds
                out["server_queue_s"] = r.finished.timings.queue_seconds
    except grpc.RpcError as e:
        out["status"] = e.code().name
        out["details"] = e.details()[:200]
    out["seconds"] = time.monotonic() - t
    out["sent_at"], out["done_at"] = t, t + out["seconds"]  # CLOCK_MONOTONIC: one clock for every process here
    out["tokens"] = len(ids)
    return out


def violates(kind: str, sampling: pb.SamplingParams, result: dict[str, Any]) -> bool:
    """A completion that claims success (finished, not by length) and breaks its constraint."""
    if result.get("status") != "OK" or result.get("finish") == "FINISH_REASON_LENGTH":
        return False
    text = result.get("text", "")
    if kind == "choice":
        return text not in set(sampling.choice.choices)
    if kind == "regex":
        return re.fullmatch(sampling.regex, text) is None
    if kind == "grammar":
        return re.fullmatch(r"w\d+x\d+", text) is None
    if kind == "json_schema":
        pattern = json.loads(sampling.json_schema)["pattern"]
        try:
            return not isinstance(json.loads(text), str) or re.fullmatch(pattern.strip("^$"), json.loads(text)) is None
        except ValueError:
            return True
    return False


def victim(stub: Any, tokens: int, out: list[float], span: list[tuple[float, float]]) -> None:
    """One greedy stream, a message per token; appends its gaps (seconds) to out and (first, last)
    message times to span."""
    first = last = None
    req = pb.GenerateRequest(text="a story about the sea", sampling=pb.SamplingParams(temperature=0.0),
                             stopping=pb.StoppingCriteria(max_tokens=tokens, ignore_eos=True))
    for r in stub.Generate(req, timeout=300):
        if r.HasField("chunk"):
            now = time.monotonic()
            if last is not None:
                out.append(now - last)
            first, last = first or now, now
    span.append((first, last))


# ---- the hostile client: a process of its own ----------------------------------------------------
# The hostile requests come from another process, as another user's would: building and encoding a
# 150,000-entry choice list in the victims' process would hold its GIL and show up as victims' gaps.

def _connected(port: int, nice: int, ready: Any) -> Any:
    """A stub on a connected channel, this process at niceness nice; sets ready. The process's start
    (its imports: seconds where torch loads CUDA's libraries) must not eat into the window it is
    measured in."""
    os.nice(nice)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    grpc.channel_ready_future(channel).result(timeout=60)
    ready.set()
    return inference_pb2_grpc.InferenceStub(channel)


def _hostile_sender(port: int, nice: int, indices: list[int], stagger_s: float, go: Any, ready: Any,
                    results: Any) -> None:
    """Once go is set, sends hostile_sampling(i) for each i, one thread each, stagger_s apart; puts
    [(i, result)]."""
    stub = _connected(port, nice, ready)
    go.wait()
    out: list[tuple[int, dict[str, Any]]] = []

    def one(i: int) -> None:
        out.append((i, send(stub, hostile_sampling(i)[1])))

    threads = []
    for i in indices:
        threads.append(threading.Thread(target=one, args=(i,)))
        threads[-1].start()
        time.sleep(stagger_s)
    for t in threads:
        t.join()
    results.put(out)


def _flooder(port: int, nice: int, flood: int, stop: Any, ready: Any, results: Any) -> None:
    """flood threads, each sending distinct hostile constraints one after another until stop is set;
    puts [(sent_at, done_at, status)] of every request."""
    stub = _connected(port, nice, ready)
    sent: list[tuple[float, float, str]] = []

    def one(k: int) -> None:
        i = k
        while not stop.is_set():
            r = send(stub, hostile_sampling(i)[1])
            sent.append((r["sent_at"], r["done_at"], r["status"]))
            i += flood

    threads = [threading.Thread(target=one, args=(k,)) for k in range(flood)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    results.put(sent)


def _spawn(target: Any, *args: Any) -> tuple[Any, Any]:
    """Starts target(*args, ready, results) in a process of its own and waits until it is connected
    (sets ready); returns (process, results queue)."""
    ctx = multiprocessing.get_context("spawn")
    results, ready = ctx.Queue(), ctx.Event()
    proc = ctx.Process(target=target, args=(*args, ready, results), daemon=True)
    proc.start()
    if not ready.wait(120):
        raise RuntimeError("the hostile client did not connect within 120 s")
    return proc, results


# ---- scenarios -------------------------------------------------------------------------------

def gap_run(args: argparse.Namespace, log_dir: pathlib.Path, hostile: bool) -> dict[str, Any]:
    server = Server(args, log_dir)
    try:
        stub = inference_pb2_grpc.InferenceStub(server.channel)
        send(stub, pb.SamplingParams(temperature=0.0), 8)  # warm
        gaps: list[list[float]] = [[] for _ in range(args.victims)]
        spans: list[tuple[float, float]] = []
        threads = [threading.Thread(target=victim, args=(stub, args.victim_tokens, g, spans)) for g in gaps]
        if hostile:  # connected before the victims start, so that its requests land while they stream
            go = multiprocessing.get_context("spawn").Event()
            proc, queue = _spawn(_hostile_sender, server.port, args.hostile_nice, list(range(args.hostile)), 0.05, go)
        for t in threads:
            t.start()
        time.sleep(0.3)
        sent: list[tuple[int, dict[str, Any]]] = []
        if hostile:
            go.set()
            sent = queue.get(timeout=300)
            proc.join()
        for t in threads:
            t.join()
        # Rebuilt only now: a 150,000-entry choice list built here while the victims stream would hold
        # this process's GIL and show up as their gaps.
        results = [(*hostile_sampling(i), r) for i, r in sent]
        every = [g for gs in gaps for g in gs]
        streaming = (max(a for a, _ in spans), min(b for _, b in spans))  # every victim streaming
        return {
            "victims_streaming_s": round(streaming[1] - streaming[0], 2),
            # a hostile request counts once it was sent while every victim streamed; the gaps mean
            # nothing if the victims ended first
            "hostile_sent_while_streaming": sum(streaming[0] <= r["sent_at"] <= streaming[1] for _, _, r in results),
            "hostile": hostile,
            "victim_max_gap_ms": round(max(every) * 1000, 1),
            "victim_p99_gap_ms": round(percentile(every, 99) * 1000, 2),
            "victim_p50_gap_ms": round(percentile(every, 50) * 1000, 2),
            "victim_tokens": [len(g) + 1 for g in gaps],
            "statuses": dict(Counter(r["status"] for _, _, r in results)),
            "violations": sum(violates(k, s, r) for k, s, r in results),
            "hostile_results": [{"kind": k, **{x: r.get(x) for x in ("status", "details", "seconds", "finish")}}
                                for k, s, r in results],
            "serving_after": server.serving(),
        }
    finally:
        server.stop()


def memory_run(args: argparse.Namespace, log_dir: pathlib.Path) -> dict[str, Any]:
    server = Server(args, log_dir)
    try:
        stub = inference_pb2_grpc.InferenceStub(server.channel)
        for _ in range(3):  # the compiler, the workers and a constrained step made once
            send(stub, pb.SamplingParams(regex="[a-z]{1,8}"), 8)
        time.sleep(2)
        pid = server.engine_pid
        start = rss_mb(pid)
        statuses: Counter = Counter()
        peak = start
        lock = threading.Lock()
        todo = iter(range(args.memory_constraints))

        def worker() -> None:
            nonlocal peak
            for i in todo:
                kind, sampling = hostile_sampling(i % 4 + 4 * (i // 4) * 5)  # distinct, no oversized choice list
                r = send(stub, sampling)
                with lock:
                    statuses[r["status"]] += 1
                    peak = max(peak, rss_mb(pid))

        threads = [threading.Thread(target=worker) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        after = rss_mb(pid)
        time.sleep(3)  # the trimmer gives freed memory back within a second or two
        settled = rss_mb(pid)
        return {"constraints": args.memory_constraints, "engine_rss_start_mb": round(start, 1),
                "engine_rss_peak_mb": round(peak, 1), "engine_rss_end_mb": round(after, 1),
                "engine_rss_settled_mb": round(settled, 1), "growth_mb": round(settled - start, 1),
                "MALLOC_ARENA_MAX": os.environ.get("MALLOC_ARENA_MAX"),  # an operator's cap (else the engine's: 2)
                "statuses": dict(statuses)}
    finally:
        server.stop()


def flood_run(args: argparse.Namespace, log_dir: pathlib.Path) -> dict[str, Any]:
    server = Server(args, log_dir)
    try:
        stub = inference_pb2_grpc.InferenceStub(server.channel)
        plain = pb.SamplingParams(temperature=0.0)
        send(stub, plain, 4)
        alone_runs = [send(stub, plain, 4, text="hello there") for _ in range(args.ttft_samples)]
        stop = multiprocessing.get_context("spawn").Event()
        proc, queue = _spawn(_flooder, server.port, args.hostile_nice, args.flood, stop)
        time.sleep(3.0)  # the flood's compiles under way
        start = time.monotonic()
        loaded_runs = [send(stub, plain, 4, text="hello there") for _ in range(args.ttft_samples)]
        window = (start, time.monotonic())
        alone, loaded = [r["first_token_s"] for r in alone_runs], [r["first_token_s"] for r in loaded_runs]
        # where the added time is spent: inside the server (arrival to first token, queueing) or outside it
        inside = {f"{what}_{side}_ms": [round(r[f"server_{what}_s"] * 1000, 1) for r in runs]
                  for what in ("first_token", "queue") for side, runs in (("alone", alone_runs), ("flood", loaded_runs))}
        stop.set()
        sent = queue.get(timeout=300)
        proc.join()
        statuses = dict(Counter(status for _, _, status in sent))
        # hostile requests in flight at some point of the measured window: 0 would mean no flood
        overlapping = sum(a < window[1] and b > window[0] for a, b, _ in sent)
        return {"flood": args.flood, "ttft_alone_ms": [round(x * 1000, 1) for x in alone],
                "ttft_flood_ms": [round(x * 1000, 1) for x in loaded],
                "ttft_alone_p50_ms": round(statistics.median(alone) * 1000, 1),
                "ttft_flood_p50_ms": round(statistics.median(loaded) * 1000, 1),
                "ttft_flood_max_ms": round(max(loaded) * 1000, 1),
                "ratio_p50": round(statistics.median(loaded) / statistics.median(alone), 2),
                "hostile_in_flight_while_measured": overlapping, "statuses": statuses,
                "server_ms": inside,
                "server_first_token_p50_ms": {side: round(statistics.median(inside[f"first_token_{side}_ms"]), 1)
                                              for side in ("alone", "flood")}}
    finally:
        server.stop()


def shutdown_run(args: argparse.Namespace, log_dir: pathlib.Path) -> dict[str, Any]:
    drain, engine_stop = 5.0, 5.0
    server = Server(args, log_dir, "--drain-timeout", str(drain), "--engine-stop-timeout", str(engine_stop))
    stub = inference_pb2_grpc.InferenceStub(server.channel)
    statuses: Counter = Counter()

    def one(i: int) -> None:
        statuses[send(stub, hostile_sampling(i)[1])["status"]] += 1

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(args.flood)]
    for t in threads:
        t.start()
    time.sleep(0.5)
    seconds = server.stop()
    return {"drain_timeout_s": drain, "engine_stop_timeout_s": engine_stop, "exit_s": round(seconds, 2),
            "exit_code": server.proc.returncode, "within_s": drain + engine_stop + 5}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    log_dir = pathlib.Path(tempfile.mkdtemp(prefix="hostile-constraints-"))
    which = set(args.scenarios.split(","))
    runs = []
    for r in range(args.repeat if "gaps" in which else 0):
        runs.append({"repeat": r, "alone": gap_run(args, log_dir, hostile=False),
                     "attacked": gap_run(args, log_dir, hostile=True)})
    memory = memory_run(args, log_dir) if "memory" in which else None
    flood = flood_run(args, log_dir) if "flood" in which else None
    shutdown = shutdown_run(args, log_dir) if "shutdown" in which else None
    if runs:
        rows = [{"run": r["repeat"],
                 "alone max / p99 gap ms": f"{r['alone']['victim_max_gap_ms']} / {r['alone']['victim_p99_gap_ms']}",
                 "attacked max / p99 gap ms": f"{r['attacked']['victim_max_gap_ms']} / {r['attacked']['victim_p99_gap_ms']}",
                 "TPOT p50 ms alone / attacked": f"{r['alone']['victim_p50_gap_ms']} / {r['attacked']['victim_p50_gap_ms']}",
                 "hostile statuses": json.dumps(r["attacked"]["statuses"]), "violations": r["attacked"]["violations"],
                 "sent while all streamed": f"{r['attacked']['hostile_sent_while_streaming']}/{args.hostile}",
                 "serving after": r["attacked"]["serving_after"]} for r in runs]
        print_table(rows, list(rows[0]), title=f"victim streams ({args.victims} x {args.victim_tokens} tokens) "
                                               f"alone and while {args.hostile} hostile constraints arrive")
    if memory:
        print(f"memory: engine RSS {memory['engine_rss_start_mb']} MB -> peak {memory['engine_rss_peak_mb']} -> "
              f"settled {memory['engine_rss_settled_mb']} after {memory['constraints']} hostile constraints "
              f"({memory['statuses']})")
    if flood:
        print(f"flood: TTFT p50 {flood['ttft_alone_p50_ms']} ms alone, {flood['ttft_flood_p50_ms']} ms (max "
              f"{flood['ttft_flood_max_ms']}) under {flood['flood']} concurrent hostile compiles ({flood['statuses']}; "
              f"{flood['hostile_in_flight_while_measured']} in flight while measured); inside the server "
              f"(arrival to first token) p50 {flood['server_first_token_p50_ms']['alone']} -> "
              f"{flood['server_first_token_p50_ms']['flood']} ms")
    if shutdown:
        print(f"shutdown: exit {shutdown['exit_s']} s after SIGTERM (code {shutdown['exit_code']}; bound "
              f"{shutdown['within_s']} s)")
    path = write_result("hostile-constraints", {"args": vars(args) | {"cache_dir": str(args.cache_dir)}, "gap_runs": runs,
                                                "memory": memory, "flood": flood, "shutdown": shutdown})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
