#!/usr/bin/env bash
# Wheels of what a lent H200 (Python 3.12, x86-64, no network) lacks for `graphserve serve` and for
# bench/gateway_bench.py (smg, the openai client), pinned to the versions tested on the CPU machine.
# Run where pip reaches PyPI, from the repository root; they land in .whl/ (gitignored), ~50 MB:
#   bash bench/fetch_wheels.sh
# On the GPU machine (carry .whl), before the benchmark:
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
#     && export PYTHONPATH=/tmp/site
# smg then runs as `python3 -m smg` (pip --target puts no executable on PATH); gateway_bench.py finds it so.
set -euo pipefail
DEST=${DEST:-.whl}
PIN=(
  # graphserve serve: not in the image, or older there than pyproject.toml asks
  structlog==26.1.0 grpcio==1.85.3 grpcio-health-checking==1.85.1 grpcio-reflection==1.85.1 protobuf==7.36.2
  smg-grpc-proto==0.4.28 typing-extensions==4.16.0 google-re2==1.1.20251105
  # structured outputs (llguidance) and the GPU tests' output checks (jsonschema)
  llguidance==1.9.1 jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1
  attrs==26.1.0
  # the gateway (a Rust binary inside the wheel) and what it needs beside the image's pyyaml
  smg==1.13.0 setproctitle==1.3.8
  # the openai client: httpx2 / httpcore2 (not the image's httpx), pydantic and the rest
  openai==3.57.0 httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5 jiter==0.19.0 pydantic==2.14.4
  pydantic-core==2.50.5 typing-inspection==0.4.5 annotated-types==0.8.0 sniffio==1.3.1 anyio==4.16.0 idna==3.20 h11==0.16.0
)
mkdir -p "$DEST"
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$DEST" "${PIN[@]}"
ls "$DEST"
du -sh "$DEST"
