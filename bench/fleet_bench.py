"""A fleet of replicas behind the real smg on a multi-tenant chat workload: cache-aware (KV-event)
routing against round robin.

For each --policy in turn (the order alternates across --repeat), starts `graphserve gateway
--replicas R --policy P` afresh (empty caches), runs the same seeded workload against its OpenAI
endpoint with the official `openai` AsyncOpenAI client, and reads from every replica's /metrics the
prefix-cache counters (vllm:prefix_cache_queries / vllm:prefix_cache_hits, prompt tokens looked up /
found; their deltas over the run, summed across the replicas) and the requests each replica finished
(vllm:request_success). TTFT is client-side: from sending a streamed chat completion to the first
chunk that carries output tokens (usage on every chunk, stream_options.continuous_usage_stats).

The workload: --tenants system prompts (random word-like text of about --system-tokens tokens each);
--conversations conversations start at Poisson arrivals of --rate per second, each with a tenant
drawn Zipf(--zipf) over the tenants (tenant k with weight 1/k^s) and 1..--max-turns turns. Each turn
resends the whole conversation so far (system prompt, earlier questions and the replica's answers)
plus a new question, after a think time (exponential, mean --think-s) from the previous answer.
Greedy, max_tokens --output-tokens.

CPU defaults (2 cores run 3 replicas, smg and the client): system prompts of ~400 tokens rather than
the 1-2k of a production tenant, so that one policy's run takes about a minute and both fit in a few
minutes; the KV pool of each replica is what --max-running-seqs x --max-seq-len need (8 x 1024
tokens, the CPU default), smaller than the tenants' prompts together (24 x 400), so round robin,
which places every tenant on every replica, turns its pools over where cache-aware routing keeps
each tenant on one. Pass --system-tokens 1500 --max-seq-len 4096 for the issue's sizes.

    python bench/fleet_bench.py                                   # CPU: 3 replicas, both policies once
    python bench/fleet_bench.py --repeat 3 --system-tokens 1500 --max-seq-len 4096 \\
        --serve-arg=--device=cuda --model builtin:llama-1b
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import pathlib
import random
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from typing import Any

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from bench.common import print_table, write_result

POLICIES = ("cache_aware", "round_robin")
WORDS = ("alpha beta gamma delta policy manual section answer cite refund order invoice account user tenant "
         "support reply brief never guess always check the a of to in for with on by from ticket escalate "
         "product shipping return warranty billing contract language tone polite formal short").split()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="builtin:tiny")
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--policies", default=",".join(POLICIES), help="comma-separated smg policies")
    p.add_argument("--repeat", type=int, default=1, help="runs of every policy; the order alternates")
    p.add_argument("--tenants", type=int, default=24)
    p.add_argument("--system-tokens", type=int, default=400, help="about this many tokens per system prompt")
    p.add_argument("--zipf", type=float, default=1.1, help="tenant k is drawn with weight 1/k^zipf")
    p.add_argument("--conversations", type=int, default=40)
    p.add_argument("--max-turns", type=int, default=4)
    p.add_argument("--rate", type=float, default=1.0, help="conversations started per second (Poisson)")
    p.add_argument("--think-s", type=float, default=1.0, help="mean pause between an answer and the next turn")
    p.add_argument("--output-tokens", type=int, default=8)
    p.add_argument("--max-running-seqs", type=int, default=8)
    p.add_argument("--max-seq-len", type=int, default=1024)
    p.add_argument("--serve-arg", action="append", default=[], metavar="ARG",
                   help="one more flag for every replica's graphserve serve (repeatable)")
    p.add_argument("--smg-arg", action="append", default=[], metavar="ARG",
                   help="one more flag for smg, e.g. --smg-arg=--balance-abs-threshold=2 (repeatable)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ready-timeout", type=float, default=300.0)
    p.add_argument("--log-dir", type=pathlib.Path, default=None, help="keep each gateway's log here")
    p.add_argument("--results-dir", type=pathlib.Path, default=None, help="default: bench/results")
    args = p.parse_args(argv)
    args.policies = [x for x in args.policies.split(",") if x]
    return args


# ---- the workload ----------------------------------------------------------------------------


@dataclass
class Conversation:
    tenant: int
    start: float  # seconds after the run starts
    questions: list[str]
    thinks: list[float]  # pause before each follow-up


@dataclass
class Turn:
    tenant: int
    turn: int
    sent: float = 0.0
    first: float | None = None
    done: float | None = None
    prompt_tokens: int = 0
    cached_tokens: int | None = None
    error: str | None = None


@dataclass
class Workload:
    systems: list[str]
    conversations: list[Conversation] = field(default_factory=list)


def make_workload(args: argparse.Namespace) -> Workload:
    rng = random.Random(args.seed)
    # Characters per token is taken as 1.3 (byte-level BPE over a small vocabulary), not measured: the run
    # reports the mean prompt length smg counted (503 tokens with the defaults, turns and answers included).
    systems = []
    for t in range(args.tenants):
        words, chars = [f"You are the assistant of tenant {t}."], 0
        while chars < args.system_tokens * 1.3:
            words.append(rng.choice(WORDS))
            chars += len(words[-1]) + 1
        systems.append(" ".join(words))
    weights = [1 / (k + 1) ** args.zipf for k in range(args.tenants)]
    work, at = Workload(systems), 0.0
    for _ in range(args.conversations):
        at += rng.expovariate(args.rate)
        turns = rng.randint(1, args.max_turns)
        tenant = rng.choices(range(args.tenants), weights)[0]
        questions = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 20))) + "?" for _ in range(turns)]
        work.conversations.append(Conversation(tenant, at, questions,
                                               [rng.expovariate(1 / args.think_s) for _ in range(turns)]))
    return work


async def _turn(client: Any, model: str, messages: list[dict[str, str]], args: argparse.Namespace,
                record: Turn) -> str:
    text = ""
    record.sent = time.perf_counter()
    try:
        stream = await client.chat.completions.create(
            model=model, messages=messages, max_tokens=args.output_tokens, temperature=0.0, stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True})
        async for chunk in stream:
            now = time.perf_counter()
            for choice in chunk.choices:
                text += choice.delta.content or ""
            usage = chunk.usage
            if usage is None:
                continue
            if record.first is None and usage.completion_tokens > 0:
                record.first = now
            record.prompt_tokens = usage.prompt_tokens
            details = getattr(usage, "prompt_tokens_details", None)
            if details is not None and details.cached_tokens is not None:
                record.cached_tokens = details.cached_tokens
        if record.first is None:
            record.error = "no chunk carried output tokens"
    except Exception as exc:  # noqa: BLE001 - recorded per request
        record.error = f"{type(exc).__name__}: {exc}"
    record.done = time.perf_counter()
    return text


async def _conversation(client: Any, model: str, work: Workload, c: Conversation, t0: float,
                        args: argparse.Namespace, out: list[Turn]) -> None:
    await asyncio.sleep(max(0.0, t0 + c.start - time.perf_counter()))
    messages = [{"role": "system", "content": work.systems[c.tenant]}]
    for i, (question, think) in enumerate(zip(c.questions, c.thinks, strict=True)):
        if i:
            await asyncio.sleep(think)
        messages.append({"role": "user", "content": question})
        record = Turn(c.tenant, i)
        out.append(record)
        answer = await _turn(client, model, messages, args, record)
        if record.error is not None:
            return
        messages.append({"role": "assistant", "content": answer})


async def drive(base_url: str, model: str, work: Workload, args: argparse.Namespace) -> tuple[list[Turn], float]:
    from openai import AsyncOpenAI

    out: list[Turn] = []
    async with AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=300.0) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*[_conversation(client, model, work, c, t0, args, out) for c in work.conversations])
        return out, time.perf_counter() - t0


# ---- the fleet -------------------------------------------------------------------------------


class Fleet:
    """`graphserve gateway --replicas R --policy P` on free ports; its output in a log file."""

    def __init__(self, policy: str, args: argparse.Namespace, log_path: pathlib.Path) -> None:
        from tests.support.gateway import free_run

        first = free_run(3 * args.replicas + 2)
        self.http_port, self.first_port, self.replicas = first + 3 * args.replicas, first, args.replicas
        self.argv = [sys.executable, "-m", "service", "gateway", "--replicas", str(args.replicas), "--policy", policy,
                     "--http-port", str(self.http_port), "--first-port", str(first),
                     "--smg-metrics-port", str(first + 3 * args.replicas + 1),
                     *[f"--smg-arg={a}" for a in args.smg_arg], "--", "--model", args.model,
                     "--max-running-seqs", str(args.max_running_seqs), "--max-seq-len", str(args.max_seq_len),
                     *args.serve_arg]
        self.log_path = log_path
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen(self.argv, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}/v1"

    def metrics_ports(self) -> list[int]:
        return [self.first_port + 3 * i + 2 for i in range(self.replicas)]

    def wait_ready(self, model: str, timeout: float) -> None:
        """Until smg lists the model and every replica logged smg's KV-event subscription (or 10 s more)."""
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"graphserve gateway exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.base_url}/models", timeout=5) as r:
                    if model in [m["id"] for m in json.loads(r.read())["data"]]:
                        break
            except Exception:  # noqa: BLE001, S110 - not up yet
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"smg did not list {model} within {timeout:.0f} s:\n{self.log_tail()}")
            time.sleep(0.5)
        settle = time.monotonic() + 10
        while self.log_text().count('"kv_events_subscribed"') < self.replicas and time.monotonic() < settle:
            time.sleep(0.2)

    def log_text(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def log_tail(self, chars: int = 4000) -> str:
        return self.log_text()[-chars:]

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)  # the gateway drains its replicas and stops smg
            try:
                self.proc.wait(90)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self._log.close()


def counters(port: int) -> dict[str, float]:
    """vllm:prefix_cache_queries / _hits and vllm:request_success totals of one replica (labels summed)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    wanted = {"vllm:prefix_cache_queries_total": "queries", "vllm:prefix_cache_hits_total": "hits",
              "vllm:request_success_total": "requests"}
    out = dict.fromkeys(wanted.values(), 0.0)
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in wanted:
                out[wanted[s.name]] += s.value
    return out


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, max(0, math.ceil(q * len(values)) - 1))]


def run_policy(policy: str, work: Workload, args: argparse.Namespace, repeat: int, log_dir: pathlib.Path) -> dict:
    fleet = Fleet(policy, args, log_dir / f"gateway-{policy}-{repeat}.log")
    try:
        fleet.wait_ready(args.model, args.ready_timeout)
        before = [counters(p) for p in fleet.metrics_ports()]
        turns, wall = asyncio.run(drive(fleet.base_url, args.model, work, args))
        time.sleep(0.5)
        after = [counters(p) for p in fleet.metrics_ports()]
    finally:
        fleet.close()
    delta = [{k: a[k] - b[k] for k in a} for a, b in zip(after, before, strict=True)]
    queries, hits = sum(d["queries"] for d in delta), sum(d["hits"] for d in delta)
    ok = [t for t in turns if t.error is None]
    ttft = [(t.first - t.sent) * 1e3 for t in ok]
    follow = [(t.first - t.sent) * 1e3 for t in ok if t.turn > 0]
    errors = [t.error for t in turns if t.error is not None]
    return {"repeat": repeat, "policy": policy, "requests": len(turns), "ok": len(ok), "errors": len(errors),
            "first_error": errors[0] if errors else None, "wall_s": wall,
            "hit_rate": hits / queries if queries else None, "hit_tokens": hits, "queried_tokens": queries,
            "ttft_p50_ms": pct(ttft, 0.5), "ttft_p99_ms": pct(ttft, 0.99),
            "followup_ttft_p50_ms": pct(follow, 0.5),
            "per_replica_requests": [int(d["requests"]) for d in delta],
            "per_replica_hit_tokens": [int(d["hits"]) for d in delta],
            "prompt_tokens_mean": statistics.mean(t.prompt_tokens for t in ok) if ok else None,
            "gateway_command": shlex.join(fleet.argv)}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    work = make_workload(args)
    log_dir = args.log_dir or pathlib.Path(tempfile.mkdtemp(prefix="fleet-bench-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the fleet on the way out
    rows = []
    for r in range(1, args.repeat + 1):
        order = args.policies if r % 2 else list(reversed(args.policies))
        for policy in order:
            row = run_policy(policy, work, args, r, log_dir)
            rows.append(row)
            print(f"repeat {r} {policy}: hit rate {row['hit_rate']}, TTFT p50 {row['ttft_p50_ms']} ms, "
                  f"per replica {row['per_replica_requests']}", flush=True)
    summary = {}
    for policy in args.policies:
        mine = [x for x in rows if x["policy"] == policy]
        summary[policy] = {k: statistics.median(x[k] for x in mine) if all(x[k] is not None for x in mine) else None
                           for k in ("hit_rate", "ttft_p50_ms", "ttft_p99_ms", "followup_ttft_p50_ms")}
    tenants = [c.tenant for c in work.conversations]
    workload_info = {**{k: v for k, v in vars(args).items() if k not in ("log_dir", "results_dir")},
                     "turns": sum(len(c.questions) for c in work.conversations),
                     "distinct_tenants": len(set(tenants)),
                     "top_tenant_share": max(tenants.count(t) for t in set(tenants)) / len(tenants)}
    table_columns = ["repeat", "policy", "ok", "errors", "wall_s", "hit_rate", "ttft_p50_ms", "ttft_p99_ms",
                     "followup_ttft_p50_ms", "per_replica_requests", "prompt_tokens_mean"]
    path = write_result("fleet", {
        "workload": workload_info, "results": rows, "median_by_policy": summary,
        "notes": "hit_rate: prompt tokens the replicas' prefix caches held / prompt tokens looked up "
                 "(vllm:prefix_cache_hits / vllm:prefix_cache_queries, deltas over the run summed across the "
                 "replicas); TTFT client-side, to the first chunk with output tokens; followup_ttft: turns after "
                 "the first of a conversation; per_replica_requests: vllm:request_success deltas; each policy's "
                 "run starts a fresh fleet (empty caches)",
    }, device="cpu" if not any("cuda" in a for a in args.serve_arg) else None, results_dir=args.results_dir)
    print_table([{**x, "per_replica_requests": "/".join(map(str, x["per_replica_requests"]))} for x in rows],
                table_columns,
                title=f"\n{args.model}, {args.replicas} replicas behind smg: {args.conversations} conversations of "
                      f"{args.tenants} tenants (Zipf {args.zipf}, ~{args.system_tokens}-token system prompts, "
                      f"1-{args.max_turns} turns), {args.rate}/s, {args.output_tokens} output tokens")
    print(f"wrote {path}")
    return 0 if all(x["errors"] == 0 for x in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
