"""`graphserve gateway`: N graphserve replicas on this machine behind the Shepherd Model Gateway (smg).

    graphserve gateway --replicas 2 --http-port 8080 -- --model builtin:tiny

gives an OpenAI-compatible endpoint (http://127.0.0.1:8080/v1: chat and text completions, streaming,
/v1/models) that routes to the replicas over vLLM's engine protocol. Flags after `--` go to every
replica's `graphserve serve`; each replica gets its own gRPC, admin and metrics port. smg tokenizes
and renders chat templates itself, from the model directory the replicas report. Ctrl-C or SIGTERM
drains the replicas and stops smg. For a cluster, see k8s/overlays/gateway.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

SMG_VERSION = "1.13.0"  # the gateway this command is tested with (the dev extra pins it)


def _parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(prog="graphserve gateway", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--replicas", type=int, default=2, help="graphserve processes to start")
    p.add_argument("--host", default="127.0.0.1", help="where smg listens")
    p.add_argument("--http-port", type=int, default=8080, help="smg's OpenAI-compatible HTTP port")
    p.add_argument("--first-port", type=int, default=50061,
                   help="replica i serves gRPC on first-port + 3i, admin on +1, metrics on +2")
    p.add_argument("--smg-metrics-port", type=int, default=29000, help="smg's Prometheus port")
    p.add_argument("--policy", default="cache_aware", help="smg's routing policy (round_robin, least_load, ...)")
    p.add_argument("--ready-timeout", type=float, default=600.0, help="seconds to wait for each replica's SERVING")
    cut = argv.index("--") if "--" in argv else len(argv)
    args, serve_args = p.parse_args(argv[:cut]), argv[cut + 1:]
    if args.replicas < 1:
        p.error("--replicas must be >= 1")
    return args, serve_args


def _smg() -> str:
    found = Path(sys.executable).parent / "smg"
    path = str(found) if found.exists() else shutil.which("smg")
    if path is None:
        raise SystemExit(f"graphserve gateway: smg is not installed; `pip install smg=={SMG_VERSION}` (the dev extra "
                         "has it: make setup)")
    return path


def _wait_serving(address: str, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise SystemExit(f"graphserve gateway: the replica on {address} exited with {proc.returncode}")
            try:
                status = health.Check(health_pb2.HealthCheckRequest(), timeout=2).status
                if status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.2)
    raise SystemExit(f"graphserve gateway: the replica on {address} was not SERVING after {timeout:g} s")


def main(argv: list[str]) -> int:
    args, serve_args = _parse(argv)
    smg = _smg()
    stopping = False

    def stop(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    replicas: list[subprocess.Popen] = []
    gateway: subprocess.Popen | None = None
    try:
        addresses = []
        for i in range(args.replicas):
            port = args.first_port + 3 * i
            cmd = [sys.executable, "-m", "service", "serve", "--host", "127.0.0.1", "--port", str(port),
                   "--admin-port", str(port + 1), "--metrics-port", str(port + 2), *serve_args]
            # Own process groups: Ctrl-C in this terminal reaches this process only, which drains them in order.
            replicas.append(subprocess.Popen(cmd, start_new_session=True))
            addresses.append(f"127.0.0.1:{port}")
        for address, proc in zip(addresses, replicas):
            _wait_serving(address, proc, args.ready_timeout)
        gateway = subprocess.Popen([smg, "launch", "--host", args.host, "--port", str(args.http_port), "--backend", "vllm",
                                    "--policy", args.policy, "--prometheus-port", str(args.smg_metrics_port),
                                    "--worker-urls", *[f"grpc://{a}" for a in addresses]], start_new_session=True)
        print(f"graphserve gateway: OpenAI-compatible endpoint on http://{args.host}:{args.http_port}/v1 "
              f"routing to {', '.join(addresses)}", file=sys.stderr, flush=True)
        while not stopping:
            if gateway.poll() is not None or any(p.poll() is not None for p in replicas):
                print("graphserve gateway: a process exited; stopping the rest", file=sys.stderr)
                return 1
            time.sleep(0.5)
        return 0
    finally:
        for proc in ([gateway] if gateway is not None else []) + replicas:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)  # replicas drain (--drain-timeout) and save their stats
        for proc in ([gateway] if gateway is not None else []) + replicas:
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
