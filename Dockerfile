# syntax=docker/dockerfile:1
# graphserve: gRPC LLM inference with a CUDA-graph cache.
#
#   docker build -t registry.example.com/graphserve:0.1.0 .                           # GPU (CUDA 13)
#   docker build --build-arg FLAVOR=cpu -t registry.example.com/graphserve:0.1.0-cpu .  # CPU (k8s/overlays/cpu-dev)
#
# The GPU image targets CUDA 13 (NVIDIA driver >= 580). For older drivers build against CUDA 12.8:
#   docker build --build-arg CUDA_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04 \
#                --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 -t ... .

ARG FLAVOR=cuda
ARG CUDA_IMAGE=nvidia/cuda:13.0.1-runtime-ubuntu24.04
ARG CPU_IMAGE=ubuntu:24.04
# One torch per flavor, the Makefile's pins (tests/deploy/test_torch_versions.py holds them equal).
ARG TORCH_CUDA_VERSION=2.11.0
ARG TORCH_CPU_VERSION=2.13.0

FROM ${CUDA_IMAGE} AS base-cuda
FROM ${CPU_IMAGE} AS base-cpu

# ---- build: a venv with torch, the generated protobuf stubs and graphserve -----------------------
FROM base-${FLAVOR} AS build
ARG FLAVOR
ARG TORCH_CUDA_VERSION
ARG TORCH_CPU_VERSION
# Empty: the CUDA 13 index for cuda, the CPU index for cpu.
ARG TORCH_INDEX_URL=
ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv make \
 && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
# torch first, from its index, in its own layer: it is most of the image and changes rarely.
RUN if [ "${FLAVOR}" = cpu ]; then \
      pip install "torch==${TORCH_CPU_VERSION}" --index-url "${TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu}"; \
    else \
      pip install "torch==${TORCH_CUDA_VERSION}" --index-url "${TORCH_INDEX_URL:-https://download.pytorch.org/whl/cu130}"; \
    fi
WORKDIR /src
COPY pyproject.toml README.md Makefile ./
COPY protos/ protos/
COPY cache_manager/ cache_manager/
COPY service/ service/
# Stubs are generated here by `make protos`, with the grpcio-tools that matches the pinned grpcio.
# The sentinel tells the Makefile this venv is already set up (it would otherwise build a dev venv).
RUN pip install "grpcio-tools==1.84.*" \
 && touch /opt/venv/.installed \
 && make protos VENV=/opt/venv \
 && pip install . \
 && pip uninstall -y grpcio-tools \
 && python -m compileall -q /opt/venv

# ---- runtime: the CUDA runtime (or plain Ubuntu) base, python, the venv, a non-root user ---------
FROM base-${FLAVOR} AS runtime
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --gid 10001 graphserve \
 && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent \
            --shell /usr/sbin/nologin graphserve \
 && install -d -o 10001 -g 10001 /var/cache/graphserve /var/lib/graphserve
COPY --from=build /opt/venv /opt/venv
# HOME=/tmp: torch, triton and the CUDA JIT cache write under $HOME; /tmp is writable even when the
# root filesystem is read-only (Kubernetes mounts an emptyDir there).
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/tmp \
    GRAPHSERVE_MODEL_CACHE_DIR=/var/cache/graphserve
USER 10001
# 50051 gRPC Inference + health, 50052 admin gRPC (bearer token), 9464 Prometheus /metrics.
EXPOSE 50051 50052 9464
ENTRYPOINT ["graphserve"]
CMD ["serve"]
