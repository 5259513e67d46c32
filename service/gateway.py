"""`graphserve gateway`: graphserve replicas on this machine behind the Shepherd Model Gateway (smg),
supervised.

    graphserve gateway /models/Llama-3.2-1B-Instruct --port 8000 --max-model-len 4096   # as `vllm serve`
    graphserve gateway --replicas 2 --http-port 8080 -- --model builtin:tiny

gives an OpenAI-compatible endpoint (http://HOST:PORT/v1: chat and text completions, streaming,
/v1/models) that routes to the replicas over vLLM's engine protocol. The model (first, as `vllm
serve` takes it), the flags this command does not know and those after `--` go to every replica's
`graphserve serve`; each replica gets its own gRPC, admin and metrics port. smg tokenizes and
renders chat templates itself, from the tokenizer the replicas send. A replica that dies is started
again (at once, then after a backoff that doubles while it keeps dying young, at most --max-restarts
times in 10 minutes), each step logged; its in-flight requests fail, the others' never notice.
Ctrl-C or SIGTERM drains the replicas and stops smg. For a cluster, see k8s/overlays/gateway.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

SMG_VERSION = "1.13.0"  # the gateway this command is tested with (the dev extra pins it)
RESTART_WINDOW_S = 600.0  # --max-restarts counts restarts within this window
HEALTHY_AFTER_S = 60.0  # a replica that served this long has its backoff reset
# smg probes its workers every 60 s by default: a restarted replica would wait that long for traffic.
SMG_DEFAULTS = ("--health-check-interval-secs", "2", "--health-failure-threshold", "2", "--health-success-threshold", "1",
                "--cb-timeout-duration-secs", "5")


def _parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(prog="graphserve gateway", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--replicas", type=int, default=1, help="graphserve processes to start (default: 1)")
    p.add_argument("--host", default="127.0.0.1", help="where smg listens (default: 127.0.0.1)")
    p.add_argument("--http-port", "--port", dest="http_port", type=int, default=8080,
                   help="smg's OpenAI-compatible HTTP port (default: 8080)")
    p.add_argument("--first-port", type=int, default=50061,
                   help="replica i serves gRPC on first-port + 3i, admin on +1, metrics on +2 (default: 50061)")
    p.add_argument("--smg-metrics-port", type=int, default=29000, help="smg's Prometheus port (default: 29000)")
    p.add_argument("--policy", default="cache_aware",
                   help="smg's routing policy: cache_aware, round_robin, least_load, ... (default: cache_aware)")
    p.add_argument("--ready-timeout", type=float, default=600.0,
                   help="seconds each replica gets to turn SERVING at start (default: 600)")
    p.add_argument("--max-restarts", type=int, default=5,
                   help="restarts of one replica within 10 minutes before it is given up (default: 5)")
    p.add_argument("--max-restart-backoff", type=float, default=30.0,
                   help="the longest wait before a restart, in seconds (default: 30)")
    g = p.add_argument_group("smg options (passed to smg launch)")
    g.add_argument("--api-key", default=None, help="clients must send `Authorization: Bearer KEY` (default: none)")
    g.add_argument("--tool-call-parser", default=None, help="smg's tool-call parser, e.g. llama, qwen, json (default: none)")
    g.add_argument("--reasoning-parser", default=None, help="smg's reasoning parser, e.g. deepseek_r1, qwen3 (default: none)")
    g.add_argument("--smg-arg", action="append", default=[], metavar="ARG",
                   help="one more argument for smg launch, e.g. --smg-arg=--max-concurrent-requests=64 (repeatable)")
    cut = argv.index("--") if "--" in argv else len(argv)
    head, serve_args = argv[:cut], argv[cut + 1:]
    model = [] if not head or head[0].startswith("-") else ["--model", head.pop(0)]
    args, unknown = p.parse_known_args(head)
    if args.replicas < 1:
        p.error("--replicas must be >= 1")
    return args, model + unknown + serve_args


def _smg() -> str:
    found = Path(sys.executable).parent / "smg"
    path = str(found) if found.exists() else shutil.which("smg")
    if path is None:
        raise SystemExit(f"graphserve gateway: smg is not installed; `pip install smg=={SMG_VERSION}` (the dev extra "
                         "has it: make setup)")
    return path


def say(text: str) -> None:
    print(f"graphserve gateway: {text}", file=sys.stderr, flush=True)


@dataclass
class Replica:
    """One `graphserve serve` process and what its supervision knows of it."""

    index: int
    port: int
    cmd: list[str]
    proc: subprocess.Popen | None = None
    started_at: float = 0.0
    serving_at: float | None = None  # when health turned SERVING (None: not yet, this start)
    restart_at: float | None = None  # when a dead one is started again (None: not dead)
    backoff: float = 0.0  # the wait before the next restart
    restarts: deque[float] = field(default_factory=deque)
    given_up: bool = False

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> None:
        # Own process groups: Ctrl-C in this terminal reaches this process only, which drains them in order.
        self.proc = subprocess.Popen(self.cmd, start_new_session=True)
        self.started_at, self.serving_at, self.restart_at = time.monotonic(), None, None
        say(f"replica {self.index} on {self.address}: started, pid {self.proc.pid}")

    def serving(self, timeout: float = 0.5) -> bool:
        with grpc.insecure_channel(self.address) as channel:
            try:
                status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout).status
            except grpc.RpcError:
                return False
        return status == health_pb2.HealthCheckResponse.SERVING


class Supervisor:
    """Keeps the replicas running: a dead one is started again after its backoff, at most
    --max-restarts times within RESTART_WINDOW_S; each step is one line on stderr."""

    def __init__(self, replicas: list[Replica], max_restarts: int, max_backoff: float) -> None:
        self.replicas, self.max_restarts, self.max_backoff = replicas, max_restarts, max_backoff

    def wait_serving(self, timeout: float) -> None:
        for replica in self.replicas:
            deadline = time.monotonic() + timeout
            while not replica.serving(timeout=2):
                if replica.proc.poll() is not None:
                    raise SystemExit(f"graphserve gateway: replica {replica.index} on {replica.address} exited with "
                                     f"{replica.proc.returncode} before serving")
                if time.monotonic() > deadline:
                    raise SystemExit(f"graphserve gateway: replica {replica.index} on {replica.address} was not "
                                     f"SERVING after {timeout:g} s")
                time.sleep(0.2)
            replica.serving_at = time.monotonic()

    def check(self) -> bool:
        """One round: notice deaths, restart those due, note restarted ones SERVING. False: all given up."""
        now = time.monotonic()
        for r in self.replicas:
            if r.given_up:
                continue
            if r.restart_at is None and r.proc.poll() is not None:
                self._died(r, now)
            elif r.restart_at is not None and now >= r.restart_at:
                r.restarts.append(now)
                r.start()
            elif r.restart_at is None and r.serving_at is None and r.serving():
                r.serving_at = time.monotonic()
                say(f"replica {r.index} on {r.address}: SERVING again, {r.serving_at - r.started_at:.1f} s after its "
                    "start")
        return not all(r.given_up for r in self.replicas)

    def _died(self, r: Replica, now: float) -> None:
        lived = now - r.started_at
        while r.restarts and now - r.restarts[0] > RESTART_WINDOW_S:
            r.restarts.popleft()
        if len(r.restarts) >= self.max_restarts:
            r.given_up = True
            say(f"replica {r.index} on {r.address}: exited with {r.proc.returncode} after {lived:.1f} s; "
                f"{len(r.restarts)} restarts in {RESTART_WINDOW_S / 60:g} minutes, giving it up")
            return
        young = r.serving_at is None or now - r.serving_at < HEALTHY_AFTER_S
        r.backoff = min(self.max_backoff, max(1.0, 2 * r.backoff)) if young and r.restarts else 0.0
        r.restart_at = now + r.backoff
        say(f"replica {r.index} on {r.address}: exited with {r.proc.returncode} after {lived:.1f} s; restart "
            f"{len(r.restarts) + 1} of at most {self.max_restarts} in {RESTART_WINDOW_S / 60:g} minutes, in {r.backoff:g} s")


def _checked(args: argparse.Namespace, serve_args: list[str], replicas: list[Replica]) -> list[str]:
    """Start-up problems, one line each: the replicas' flags, the model, every port."""
    from service.config import ConfigError, load_config
    from service.preflight import model_file_problem, model_problem, port_problems, serve_ports

    try:
        configs = [load_config(r.cmd[r.cmd.index("serve") + 1:]) for r in replicas]
    except ConfigError as exc:
        return [str(exc)]
    ports = [("--http-port", args.host, args.http_port), ("--smg-metrics-port", args.host, args.smg_metrics_port)]
    for r, config in zip(replicas, configs):
        ports += [(f"{flag} of replica {r.index} (--first-port {args.first_port})", host, port)
                  for flag, host, port in serve_ports(config)]
    problems = port_problems(ports)
    model = model_file_problem(configs[0].model) or model_problem(configs[0].model, configs[0].model_cache_dir)
    return problems + ([model] if model else [])


def _smg_command(args: argparse.Namespace, smg: str, replicas: list[Replica]) -> list[str]:
    """smg in front of the replicas. Its cache-aware policy follows each replica's KV events
    (SubscribeKvEvents) and chunks prompts into the replicas' blocks."""
    from service.config import load_config

    block_size = load_config(replicas[0].cmd[replicas[0].cmd.index("serve") + 1:]).block_size
    cmd = [smg, "launch", "--host", args.host, "--port", str(args.http_port), "--backend", "vllm",
           "--policy", args.policy, "--block-size", str(block_size), "--prometheus-port", str(args.smg_metrics_port),
           *SMG_DEFAULTS]
    for flag in ("api_key", "tool_call_parser", "reasoning_parser"):
        if getattr(args, flag) is not None:
            cmd += ["--" + flag.replace("_", "-"), getattr(args, flag)]
    return [*cmd, *args.smg_arg, "--worker-urls", *[f"grpc://{r.address}" for r in replicas]]


def main(argv: list[str]) -> int:
    args, serve_args = _parse(argv)
    smg = _smg()
    replicas = []
    for i in range(args.replicas):
        port = args.first_port + 3 * i
        replicas.append(Replica(i, port, [sys.executable, "-m", "service", "serve", "--host", "127.0.0.1",
                                          "--port", str(port), "--admin-port", str(port + 1),
                                          "--metrics-port", str(port + 2), *serve_args]))
    problems = _checked(args, serve_args, replicas)
    for problem in problems:
        say(problem)
    if problems:
        return 2
    stopping = False

    def stop(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    supervisor = Supervisor(replicas, args.max_restarts, args.max_restart_backoff)
    gateway: subprocess.Popen | None = None
    try:
        for replica in replicas:
            replica.start()
        supervisor.wait_serving(args.ready_timeout)
        gateway = subprocess.Popen(_smg_command(args, smg, replicas), start_new_session=True)
        say(f"OpenAI-compatible endpoint on http://{args.host}:{args.http_port}/v1 routing to "
            f"{', '.join(r.address for r in replicas)}")
        while not stopping:
            if gateway.poll() is not None:
                say(f"smg exited with {gateway.returncode}; stopping the replicas")
                return 1
            if not supervisor.check():
                say("every replica was given up; stopping")
                return 1
            time.sleep(0.2)
        return 0
    finally:
        procs = ([gateway] if gateway is not None else []) + [r.proc for r in replicas if r.proc is not None]
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)  # replicas drain (--drain-timeout) and save their stats
        for proc in procs:
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
