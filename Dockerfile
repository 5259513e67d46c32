# syntax=docker/dockerfile:1
# graphserve: gRPC LLM inference with a CUDA-graph cache.
#
#   docker build -t registry.example.com/graphserve:0.1.0 .
#
# The default targets CUDA 13 (NVIDIA driver >= 580). For older drivers build against CUDA 12.8:
#   docker build --build-arg CUDA_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04 \
#                --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 -t ... .

ARG CUDA_IMAGE=nvidia/cuda:13.0.1-runtime-ubuntu24.04

# ---- build: a venv with torch, the generated protobuf stubs and graphserve -----------------------
FROM ${CUDA_IMAGE} AS build
ARG TORCH_VERSION=2.11.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu130
ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv make \
 && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
# torch first, from the CUDA index, in its own layer: it is most of the image and changes rarely.
RUN pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}"
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

# ---- runtime: the CUDA runtime base, python, the venv, a non-root user ---------------------------
FROM ${CUDA_IMAGE} AS runtime
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
