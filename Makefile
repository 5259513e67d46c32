# graphserve: developer entry points. `make run` and `make test` set everything up on first use.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# One torch per kind of machine, named here and nowhere else by hand: the Dockerfile's ARGs and README's
# GPU install line must say the same (tests/deploy/test_torch_versions.py).
# The CPU build (make setup, CI, the cpu image); the CUDA 13 build (the GPU image, README: "Install for a GPU").
TORCH_CPU_VERSION := 2.13.0
TORCH_CUDA_VERSION := 2.11.0
TORCH_SPEC ?= torch==$(TORCH_CPU_VERSION)
PROTO_SRC := protos/graphserve/v1
PROTO_OUT := service/proto
STUBS := $(PROTO_OUT)/inference_pb2.py $(PROTO_OUT)/admin_pb2.py

.PHONY: setup protos run gateway test test-gpu eval-tools bench bench-tp bench-cpu bench-report lint clean

setup: $(VENV)/.installed protos

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

# Stubs are generated, never edited. The virtual import path makes them importable as service.proto.*.
protos: $(STUBS)

$(PROTO_OUT)/%_pb2.py: $(PROTO_SRC)/%.proto | $(VENV)/.installed
	$(PY) -m grpc_tools.protoc -I$(PROTO_OUT)=$(PROTO_SRC) --python_out=. --pyi_out=. --grpc_python_out=. $(PROTO_OUT)/$*.proto

run: setup
	$(VENV)/bin/graphserve serve $(ARGS)

# REPLICAS graphserve processes behind smg: an OpenAI-compatible endpoint on http://127.0.0.1:8080/v1.
REPLICAS ?= 2
gateway: setup
	$(VENV)/bin/graphserve gateway --replicas $(REPLICAS) $(GATEWAY_ARGS) -- $(ARGS)

test: setup
	$(PY) -m pytest -q -m "not gpu" $(PYTEST_ARGS)

test-gpu: setup
	$(PY) -m pytest -q -m gpu $(PYTEST_ARGS)

# lm-eval and guidellm in a venv of their own (their dependencies must not change ours), for
# tests/integration/test_eval_tools.py. torch is pinned in the same command: guidellm would pull a CUDA build.
EVAL_VENV ?= .venv-eval
eval-tools: $(EVAL_VENV)/.installed

$(EVAL_VENV)/.installed: Makefile
	test -x $(EVAL_VENV)/bin/python || $(PYTHON) -m venv $(EVAL_VENV)
	$(EVAL_VENV)/bin/python -m pip install -q "lm_eval[api]==0.4.13" "guidellm==0.8.1" "torch==$(TORCH_CPU_VERSION)"
	touch $@

# GPU benchmarks (Llama-3.2-1B shape, bf16): decode steps per batch with the anchors, every capture
# bucket, then streaming through gRPC against the engine alone. Results land in bench/results/.
bench: setup
	$(PY) bench/decode_bench.py --model builtin:llama-1b --device cuda --random-init
	$(PY) bench/decode_bench.py --model builtin:llama-1b --device cuda --random-init --buckets all
	$(PY) bench/serve_bench.py --model builtin:llama-1b --device cuda --dtype bfloat16 --concurrency 64 --requests 256 --output-tokens 128 --client-procs 4

# Tensor parallelism on 2 GPUs (Llama-3.1-8B shape, bf16): the decode step at TP=1 and TP=2 (random
# weights on the device), then 64 streams through gRPC at each (the 16 GB checkpoint is generated once).
bench-tp: setup
	$(PY) bench/tp_decode_bench.py --model builtin:llama-8b --tp-sizes 1,2 --batches 1,64
	$(PY) bench/serve_bench.py --model builtin:llama-8b --device cuda --dtype bfloat16 --concurrency 64 --requests 256 --output-tokens 128 --client-procs 4 --skip-engine --tensor-parallel-size 1
	$(PY) bench/serve_bench.py --model builtin:llama-8b --device cuda --dtype bfloat16 --concurrency 64 --requests 256 --output-tokens 128 --client-procs 4 --skip-engine --tensor-parallel-size 2

bench-cpu: setup
	$(PY) bench/decode_bench.py --model builtin:tiny --device cpu --batches 1,4,16 --context 64
	$(PY) bench/serve_bench.py --device cpu --concurrency 8 --requests 32 --output-tokens 32

# README's benchmark tables, rewritten from the newest result files (bench/report.py; --check only compares).
bench-report: setup
	$(PY) bench/report.py

lint: setup
	$(PY) -m ruff check service cache_manager tests bench

clean:
	rm -rf $(VENV) $(PROTO_OUT)/*_pb2*.py $(PROTO_OUT)/*_pb2*.pyi
