#!/usr/bin/env bash
# One GPU session's runs, in the order they matter, each bounded in time. Results (JSON) and logs go
# to $OUT (default bench/results/h200-<timestamp>). Usage, from the repository root on the GPU machine:
#   bash bench/h200_session.sh tests    # the GPU test suite (or tests-1, tests-2, tests-3: three calls)
#   bash bench/h200_session.sh stall prefill decode  # capture stalls, prefill (piecewise vs eager), decode steps
#   bash bench/h200_session.sh serve    # through gRPC: first-token latency, cold ramps, ITL by mode
#   bash bench/h200_session.sh lora     # LoRA: GPU tests, the integration tests on cuda, the step and load bench
#   bash bench/h200_session.sh tp gen-8b tp-serve tp-serve-long  # two GPUs: TP tests, the TP decode step, 64 streams at TP=1 and 2
#   bash bench/h200_session.sh profile  # the decode step's kernel budget
#   bash bench/h200_session.sh pdl      # batch-1 GEMV + PDL: GPU kernel tests, bench/pdl_chain.py, the step with and without
#   bash bench/h200_session.sh gemm-sweep  # decode GEMMs: cuBLAS against Triton kernels of ours, per shape and M
#   bash bench/h200_session.sh invariant  # --batch-invariant: GPU tests, decode and prefill steps both ways
#   bash bench/h200_session.sh invariant-bench invariant-grpc  # the steps only; the gRPC tests on cuda
#   bash bench/h200_session.sh gateway  # 64 streams through smg against direct gRPC (wheels: bench/fetch_wheels.sh)
#   bash bench/h200_session.sh paged    # paged KV: its GPU tests (and the kernels', graphs'), decode steps at context 512 and 4096
#   bash bench/h200_session.sh hostile gen-1b hostile-cuda  # hostile constraints: victims' gaps and TPOT, the CPU tiny
#     model on the host's cores, then the 1B shape on cuda
#   bash bench/h200_session.sh gen-1b sampling  # sampling fields: their GPU tests, the sampler's cost, the closed loop
#   bash bench/h200_session.sh gen-1b parity  # greedy bf16 text with graphs against eager, 8 prompts one at a time
#   bash bench/h200_session.sh gen-1b host-budget  # the engine thread's host ms per step by part at 64 / 128 / 256 streams
#     (text and token-id streams), and its output processing alone (bench/output_budget.py)
#   bash bench/h200_session.sh gen-1b closed-loop  # 64 / 128 / 256 streams through gRPC, 32 + 256 tokens (and the engine alone at 128),
#     each against the decode step timed in the same call at the workload's own contexts (--step-baseline)
#   bash bench/h200_session.sh gen-1b prefix-load  # a shared 1,024-token prefix at 20 req/s, prefix cache on and off
#   (closed-loop and message-rate: $CLIENT_PROCS client processes, default 8: with 4 the Python clients
#   held part of the first-token time at 128+ streams, bench/results/h200-20261204-ttft/)
#   bash bench/h200_session.sh gen-1b message-rate  # the closed loop at 1 / 64 / 128 / 256 streams, one server per
#     --stream-message-rate in $MSG_RATES (default "0 6000 12000 24000"; 0: unpaced), the engine alone with the first,
#     and the decode step at the workload's contexts, timed in the same call (--step-baseline)
#   bash bench/h200_session.sh gen-1b chat-curve  # the chat-like Poisson load, warm, at $RATES (default 25,50,100,150,200),
#     $REPEAT runs per rate (3) of $DURATION s of arrivals (30): TTFT, TPOT, per-token ITL, message cadence
#   bash bench/h200_session.sh gen-1b constrained-ab  # the chat-like load at $RATES (100) with a quarter of the requests
#     under a JSON schema (the constrained and the free requests' figures apart), then the same arrivals with none,
#     alternated, $REPEAT pairs (3) of $DURATION s (20), a fresh warm server each (~45 s a run on an H200)
#   bash bench/h200_session.sh gen-1b slo  # the highest rate holding TTFT p99 <= $SLO_TTFT ms (200) and TPOT p99 <=
#     $SLO_TPOT ms (10), every repeat, searched by bisection in $SLO_RATES (50,400)
#   (load, chat-curve, slo, prefix-load: a serving-load part spans several calls. Each call stops before a run that
#   might pass $BUDGET s (540) and prints rc=75; the same part again, with the same $OUT, goes on from its book.
#   A lent machine's own $OUT folder is emptied before each command: give this script an OUT of its own that
#   stays between calls while the machine is held, e.g. `D=$OUT; OUT=bench/results/tmp/h200 bash bench/h200_session.sh
#   gen-1b slo; cp bench/results/tmp/h200/*.json bench/results/tmp/h200/*.png "$D"`; on a fresh machine, carry
#   the returned <part>-book.json and <part>-book-work/ into that folder first.)
#   bash bench/h200_session.sh anchors  # decode steps with gpt-fast (torch.compile reduce-overhead) and transformers
#     measured in the same call, on the same shape and weights (gpt-fast compiles 50-60 s per batch)
#   bash bench/h200_session.sh fp8      # FP8 weights: GPU tests, decode steps in bf16 and FP8 (our GEMM and cuBLAS's), 1B and 8B
#   bash bench/h200_session.sh fp8-gemm # FP8 decode GEMMs per weight shape and rows: cuBLAS against ours (bench/fp8_gemm_sweep.py)
#   bash bench/h200_session.sh fp8-kv   # FP8 KV cache: GPU tests, decode steps at context 4096 with bf16 and FP8 KV (1B, 8B)
#   bash bench/h200_session.sh chunk-attention  # prompt-chunk attention of one layer: the Triton kernel against torch / flash
#   bash bench/h200_session.sh gen-1b concurrency  # 1,024 chat-like requests at once in 8 GiB of KV: the most running at once
#   bash bench/h200_session.sh families  # Qwen3, Gemma 3, Qwen3-MoE, Mixtral: their GPU tests (MoE kernels, graphs vs
#     eager), graphed decode steps at 1 / 64 / 256 (Qwen3-8B beside Llama-3.1-8B, same bytes; Qwen3-30B-A3B against the
#     floor of the bytes it must read, bf16 and FP8 experts; Gemma 3 4B; Mixtral-8x7B), the MoE layer alone (bf16, FP8
#     per block)
#   bash bench/h200_session.sh moe-load  # the chat-like load on builtin:qwen3-30b-a3b (weights made on the device):
#     TTFT and TPOT p50 / p99 per rate in $MOE_RATES (default 5,10,20), cold and warm; a serving-load part (see load)
#   bash bench/h200_session.sh gen-1b startup load  # the 1B checkpoint once; start-up GPU tests; the serving load
#     (TAG=before LOAD_ARGS='--server-args "--startup-graph-timeout 0"' for the start-up captures off)
set -uo pipefail
OUT=${OUT:-bench/results/h200-$(date -u +%Y%m%dT%H%MZ)}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 GRAPHSERVE_BENCH_RESULTS="$OUT"
M="--model builtin:llama-1b --device cuda"
run() { local name=$1 limit=$2; shift 2; echo "== $name"; timeout "$limit" "$@" >"$OUT/$name.log" 2>&1; echo "rc=$?"; grep -v '^{' "$OUT/$name.log" | tail -"${TAIL:-14}"; }
# 64 streams on builtin:llama-8b at TP=1 then TP=2 ($REPEAT times each, alternating); the capture
# stalls (and rank memory reports) from each server's log
tp_serve() {
  local tag=$1; shift
  for i in $(seq "${REPEAT:-1}"); do
    for tp in 1 2; do
      local name=serve-8b-${tag}tp$tp${REPEAT:+-$i}
      run "$name" 280 python3 bench/serve_bench.py --model builtin:llama-8b --device cuda --dtype bfloat16 \
        --skip-engine --concurrency 64 --client-procs 4 "$@" --tensor-parallel-size $tp \
        --server-log "$OUT/$name-server.log" --server-args "--log-level info --log-format json"
      python3 bench/capture_stalls.py "$OUT/$name-server.log"
    done
  done
}
# serving_load.py with a book in $OUT: finished runs are kept, and a call stops (rc=75) before a run
# that might pass $BUDGET s; the same part again goes on
load() {
  local name=$1; shift
  run "$name" 590 python3 bench/serving_load.py $M --cache-dir .cache/models --book "$OUT/$name-book.json" \
    --time-budget "${BUDGET:-540}" --log-dir "$OUT/$name" "$@"
}
for part in "$@"; do
  case $part in
    tests) TAIL=12 run gpu-tests 560 python3 -m pytest -q -m gpu tests/gpu -p no:cacheprovider --timeout 200 -k "${GPU_TESTS_K:-}" ;;
    # The suite in three parts, one call each (at 4364f1a on one H200: files a-fp8 ~420 s, fp8_kv 174 s, graph_cache +
    # kernels + l-z 298 s; bench/results/h200-20261205-suite-4364f1a); -v with durations, so a killed run still shows
    # what passed
    tests-1) TAIL=12 run gpu-tests-1 ${SUITE_LIMIT:-540} python3 -m pytest -v -rf --tb=short -m gpu tests/gpu/test_admin_gpu.py \
      tests/gpu/test_batch_invariant_gpu.py tests/gpu/test_chunked_gpu.py tests/gpu/test_families_gpu.py tests/gpu/test_fp8_gpu.py \
      -p no:cacheprovider --timeout 240 --durations=15 ;;
    tests-2) TAIL=12 run gpu-tests-2 ${SUITE_LIMIT:-540} python3 -m pytest -v -rf --tb=short -m gpu tests/gpu/test_fp8_kv_gpu.py \
      tests/gpu/test_graph_cache.py tests/gpu/test_kernels_gpu.py tests/gpu/test_sampling_gpu.py -p no:cacheprovider --timeout 240 \
      --durations=15 ;;
    tests-3) TAIL=12 run gpu-tests-3 ${SUITE_LIMIT:-540} python3 -m pytest -v -rf --tb=short -m gpu tests/gpu/test_paged_gpu.py \
      tests/gpu/test_piecewise_gpu.py tests/gpu/test_lora_gpu.py tests/gpu/test_overlap_gpu.py tests/gpu/test_late_masks_gpu.py tests/gpu/test_startup_gpu.py \
      tests/gpu/test_tensor_parallel_gpu.py tests/unit/test_sampler.py -p no:cacheprovider --timeout 240 --durations=15 ;;
    hostile)  # structured-output constraints sent to hurt: victims' gaps, a compile flood's TTFT, memory, SIGTERM; the CPU
      # tiny model on this host's 16 cores (a core each for the engine, the gRPC process and both clients)
      run hostile-cpu 280 python3 bench/hostile_constraints.py --repeat 3 --memory-constraints 100 --server-args "--device cpu" ;;
    hostile-cuda)  # the same gaps and flood on the 1B shape on cuda, 16 victims of ~3 s (run gen-1b first)
      run hostile-cuda 280 python3 bench/hostile_constraints.py --model builtin:llama-1b --cache-dir .cache/models \
        --scenarios gaps,flood --repeat 3 --victims 16 --victim-tokens 1000 --server-args "--device cuda" ;;
    stall) run capture-stall 150 python3 bench/capture_stall_bench.py $M --random-init ;;
    prefill) run prefill 120 python3 bench/prefill_bench.py $M --random-init ;;
    decode) run decode 90 python3 bench/decode_bench.py $M --random-init --batches 1,64,256 --no-anchors --no-plot ;;
    anchors)  # ours, gpt-fast (compiled, reduce-overhead) and transformers, one call, the same shape and weights
      TAIL=40 run decode-anchors 590 python3 bench/decode_bench.py $M --random-init --batches ${BATCHES:-1,8,64,256} \
        --anchor-batches 1 ;;
    serve)
      S="python3 bench/serve_bench.py $M --dtype bfloat16 --skip-engine --warmup-requests 0"
      run ttft-128 150 $S --concurrency 1 --requests 40 --prompt-tokens 128 --output-tokens 4
      run ttft-2048 100 $S --concurrency 1 --requests 20 --prompt-tokens 2048 --output-tokens 4
      run cold-16x512 100 $S --concurrency 16 --requests 16 --prompt-tokens 512 --output-tokens 8
      run ramp64-fp 150 $S --concurrency 64 --requests 192 --prompt-tokens 128 --output-tokens 64 --client-procs 4
      run ramp64-full 150 $S --concurrency 64 --requests 192 --prompt-tokens 128 --output-tokens 64 --client-procs 4 --server-args "--cudagraph-mode full" ;;
    lora)
      TAIL=8 run lora-gpu-tests 240 python3 -m pytest -q -m gpu tests/gpu/test_lora_gpu.py tests/gpu/test_graph_cache.py::test_two_caches_on_one_device_capture_at_once -p no:cacheprovider --timeout 120
      TAIL=8 GRAPHSERVE_TEST_ARGS="--device cuda --dtype float32" run lora-integration 300 \
        python3 -m pytest -q tests/integration/test_lora.py -p no:cacheprovider --timeout 150
      run lora-bench 300 python3 bench/lora_bench.py $M --random-init --watchdog-s 270 ;;
    tp)
      TAIL=8 run tp-gpu-tests 300 python3 -m pytest -q -m gpu tests/gpu/test_tensor_parallel_gpu.py -p no:cacheprovider --timeout 240
      run tp-decode 300 python3 bench/tp_decode_bench.py --model builtin:llama-8b --tp-sizes 1,2 --batches 1,64 ;;
    gen-8b) run gen-8b 400 python3 -c "from service.model.builtin import ensure_builtin; from service.model.loader import default_cache_dir; print(ensure_builtin('llama-8b', default_cache_dir()))" ;;
    gen-1b) run gen-1b 300 python3 -c "import pathlib; from service.model.builtin import ensure_builtin; print(ensure_builtin('llama-1b', pathlib.Path('.cache/models')))" ;;
    startup) TAIL=10 run startup-gpu-tests 400 python3 -m pytest -q -m gpu tests/gpu/test_startup_gpu.py tests/gpu/test_lora_gpu.py \
      -p no:cacheprovider --timeout 200 ;;
    families)
      TAIL=16 run families-tests 560 python3 -m pytest -q -m gpu tests/gpu/test_families_gpu.py -p no:cacheprovider --timeout 300
      for m in llama-8b qwen3-8b gemma3-4b; do
        run decode-$m 240 python3 bench/decode_bench.py --model builtin:$m --device cuda --random-init --batches 1,64,256 \
          --no-anchors --no-plot
      done
      for q in none fp8; do
        TAIL=10 run decode-qwen3-30b-a3b-$q 500 python3 bench/decode_bench.py --model builtin:qwen3-30b-a3b --device cuda \
          --random-init --batches 1,64,256 --no-anchors --no-plot --quantization $q
      done
      TAIL=10 run decode-mixtral-8x7b 500 python3 bench/decode_bench.py --model builtin:mixtral-8x7b --device cuda \
        --random-init --batches 1,64,256 --no-anchors --no-plot
      TAIL=12 run moe-layer 300 python3 bench/moe_bench.py --device cuda
      TAIL=12 run moe-layer-fp8 300 python3 bench/moe_bench.py --device cuda --fp8 block ;;
    moe-load)  # one run per rate and start: a fresh server makes 61 GB of weights on the device each time
      M="--model builtin:qwen3-30b-a3b --device cuda" load moe-load --rates ${MOE_RATES:-5,10,20} --starts cold,warm \
        --duration ${DURATION:-30} --repeat ${REPEAT:-1} --max-running-seqs 128 ${LOAD_ARGS:-} ;;
    load)  # Poisson load, mixed lengths, a fresh server per run, cold and warm; bursts on fresh servers
      eval "load serving-load${TAG:+-$TAG} --rates ${RATES:-20,100} --duration ${DURATION:-30} --repeat ${REPEAT:-3} \
        --burst ${BURST:-16:512} --max-running-seqs 256 ${LOAD_ARGS:-}" ;;
    paged)
      TAIL=12 run paged-gpu-tests 420 python3 -m pytest -q -m gpu tests/gpu/test_paged_gpu.py tests/gpu/test_kernels_gpu.py \
        tests/gpu/test_chunked_gpu.py tests/gpu/test_piecewise_gpu.py -p no:cacheprovider --timeout 200
      run decode-512 90 python3 bench/decode_bench.py $M --random-init --batches 1,64,256 --no-anchors --no-plot --context 512
      run decode-4096 120 python3 bench/decode_bench.py $M --random-init --batches 1,64,256 --no-anchors --no-plot --context 4096 ;;
    sampling)
      TAIL=8 run sampling-gpu-tests 240 python3 -m pytest -q -m gpu tests/gpu/test_sampling_gpu.py -p no:cacheprovider --timeout 200
      TAIL=30 run sampling-bench 300 python3 bench/sampling_bench.py --device cuda --e2e --cache-dir .cache/models ;;
    parity) run graph-parity 200 python3 bench/graph_parity.py --model builtin:llama-1b --cache-dir .cache/models --prompts 8 --tokens 64 ;;
    host-budget)  # text streams, then token-id streams (as the vLLM protocol's); the output processing alone
      TAIL=8 run host-budget 300 python3 bench/host_budget.py $M --cache-dir .cache/models --streams ${STREAMS:-64,128,256} ${BUDGET_ARGS:-}
      TAIL=8 run host-budget-ids 300 python3 bench/host_budget.py $M --cache-dir .cache/models --streams ${STREAMS:-64,128,256} \
        --token-ids-only ${BUDGET_ARGS:-}
      TAIL=12 run output-budget 120 python3 bench/output_budget.py --model builtin:llama-1b --streams ${STREAMS:-64,128,256} ;;
    closed-loop)  # issue 28's closed loop through gRPC: 32-token prompts, 256 out; at 128 streams the engine alone too
      for c in ${STREAMS:-64 128 256}; do
        skip=--skip-engine; [ "$c" = 128 ] && skip=
        TAIL=8 run closed-loop-$c 240 python3 bench/serve_bench.py $M --dtype bfloat16 --cache-dir .cache/models $skip \
          --concurrency "$c" --requests $((2 * c)) --prompt-tokens 32 --output-tokens 256 --client-procs ${CLIENT_PROCS:-8} \
          --step-baseline
      done ;;
    message-rate)  # issue 28: the closed loop through gRPC (32 + 256 tokens) against the engine alone
      skip=; step=--step-baseline  # the engine alone and the step once, with the first server
      for r in ${MSG_RATES:-0 6000 12000 24000}; do
        TAIL=12 run closed-loop-rate-$r 400 python3 bench/serve_bench.py $M --dtype bfloat16 --cache-dir .cache/models $skip \
          --concurrency ${LEVELS:-1,64,128,256} --prompt-tokens 32 --output-tokens 256 --client-procs ${CLIENT_PROCS:-8} \
          $step --server-log "$OUT/closed-loop-rate-$r-server.log" --server-args "--stream-message-rate $r --log-level info --log-format json"
        grep -o '"event": "[a-z_]*"' "$OUT/closed-loop-rate-$r-server.log" | sort | uniq -c | grep -v request_finished
        skip=--skip-engine; step=--no-step-baseline
      done ;;
    chat-curve)  # the chat-like load's rate curve, warm starts, repeats on fresh servers
      load chat-curve${TAG:+-$TAG} --starts warm --rates ${RATES:-25,50,100,150,200} --duration ${DURATION:-30} \
        --repeat ${REPEAT:-3} --max-running-seqs 256 ${LOAD_ARGS:-} ;;
    constrained-ab)  # schema share 0.25 against 0, alternated so that drift falls on both sides
      for i in $(seq "${REPEAT:-3}"); do
        for share in 0.25 0; do
          load "constrained-ab-$share-$i" --starts warm --rates "${RATES:-100}" --duration "${DURATION:-20}" --repeat 1 \
            --max-running-seqs 256 --constrained-share $share
        done
      done ;;
    slo)  # the highest rate of the chat-like load holding the SLO, found by bisection
      load slo${TAG:+-$TAG} --starts warm --rates "" --slo-ttft-p99-ms ${SLO_TTFT:-200} --slo-tpot-p99-ms ${SLO_TPOT:-10} \
        --slo-rates ${SLO_RATES:-50,400} --duration ${DURATION:-30} --repeat ${REPEAT:-3} --max-running-seqs 256 ${LOAD_ARGS:-} ;;
    prefix-load)  # the prefix cache off first, then on (the cache-on server running first skewed an earlier comparison)
      eval "load prefix-load${TAG:+-$TAG} --rates ${RATES:-20} --starts ${STARTS:-warm} --duration ${DURATION:-30} \
        --repeat ${REPEAT:-3} --shared-prefix 1024 --prefix-caching off,on ${LOAD_ARGS:-}" ;;
    fp8)
      TAIL=8 run fp8-gpu-tests 240 python3 -m pytest -q -m gpu tests/gpu/test_fp8_gpu.py -p no:cacheprovider --timeout 200
      for q in none fp8 fp8-cublas; do  # fp8-cublas: FP8 with cuBLAS's GEMM at 2-256 rows (the A/B of ours)
        export GRAPHSERVE_FP8_GEMM=$([ $q = fp8-cublas ] && echo cublas || echo ours)
        run decode-1b-$q 100 python3 bench/decode_bench.py $M --random-init --batches 1,64,256 --no-anchors --no-plot \
          --quantization ${q%-cublas}
        run decode-8b-$q 150 python3 bench/decode_bench.py --model builtin:llama-8b --device cuda --random-init \
          --batches 1,64,256 --no-anchors --no-plot --quantization ${q%-cublas}
      done
      unset GRAPHSERVE_FP8_GEMM ;;
    fp8-gemm) run fp8-gemm-sweep 420 python3 bench/fp8_gemm_sweep.py ;;  # decode GEMMs: cuBLAS FP8 against ours, per shape
    fp8-kv)
      TAIL=8 run fp8-kv-gpu-tests 420 python3 -m pytest -q -m gpu tests/gpu/test_fp8_kv_gpu.py -p no:cacheprovider --timeout 300
      for kv in auto fp8; do
        run decode-4096-kv-$kv 150 python3 bench/decode_bench.py $M --random-init --batches 1,64,256 --no-anchors --no-plot \
          --context 4096 --kv-cache-dtype $kv
        run decode-8b-4096-kv-$kv 240 python3 bench/decode_bench.py --model builtin:llama-8b --device cuda --random-init \
          --batches 1,64 --no-anchors --no-plot --context 4096 --kv-cache-dtype $kv
      done ;;
    chunk-attention)
      TAIL=12 run chunk-attention 120 python3 bench/chunk_attention_bench.py --device cuda
      TAIL=12 run chunk-attention-8b 120 python3 bench/chunk_attention_bench.py --device cuda --heads 32,8,128 ;;
    concurrency)  # 8 GiB of KV held 8 GiB / (2,048 x 32 KiB) = 128 static slots of 2,048 tokens at the 1B shape;
      # a step budget of 16,384 tokens admits the burst faster than requests finish, so the pool is what binds
      run concurrency${TAG:+-$TAG} 400 python3 bench/serving_load.py $M --cache-dir .cache/models --rates 1000 --starts cold \
        --requests 1024 --repeat 1 --max-prompt 1024 --max-output 1016 --max-running-seqs 1024 \
        --server-args "--kv-cache-memory 8GiB ${CONCURRENCY_ARGS:---max-num-batched-tokens 16384}" \
        --log-dir $OUT/concurrency${TAG:+-$TAG} ;;
    tp-serve) tp_serve "" --requests 192 --output-tokens 64 ;;  # run gen-8b first: the 16 GB checkpoint is made once
    tp-serve-long) tp_serve "long-" --requests 128 --output-tokens 256 ;;  # decode-dominated
    invariant)
      TAIL=8 run invariant-gpu-tests 420 python3 -m pytest -q -m gpu tests/gpu/test_batch_invariant_gpu.py -p no:cacheprovider --timeout 300 ;&
    invariant-bench)
      run decode-default 90 python3 bench/decode_bench.py $M --random-init --batches 1,64,256 --no-anchors --no-plot
      run decode-invariant 90 python3 bench/decode_bench.py $M --random-init --batches 1,64,256 --no-anchors --no-plot --batch-invariant
      run prefill-invariant 150 python3 bench/prefill_bench.py $M --random-init --no-transformers --batch-invariant ;;
    invariant-grpc)
      TAIL=8 GRAPHSERVE_TEST_ARGS="--device cuda --dtype bfloat16" run invariant-integration 300 \
        python3 -m pytest -q tests/integration/test_batch_invariant.py -p no:cacheprovider --timeout 200 ;;
    pdl)  # the batch-1 GEMV and programmatic dependent launch: GPU kernel tests, the chain, the step with and without each
      TAIL=8 run pdl-gpu-tests 300 python3 -m pytest -q -m gpu tests/gpu/test_kernels_gpu.py -p no:cacheprovider --timeout 200
      run pdl-chain 120 python3 bench/pdl_chain.py
      for i in $(seq "${REPEAT:-2}"); do
        run decode-pdl-$i 90 python3 bench/decode_bench.py $M --random-init --batches 1,8,64,256 --no-anchors --no-plot
        run decode-nopdl-$i 90 env GRAPHSERVE_PDL=0 python3 bench/decode_bench.py $M --random-init --batches 1,8,64,256 --no-anchors --no-plot
        run decode-cublas-$i 90 python3 bench/decode_bench.py $M --random-init --batches 1,8,64,256 --no-anchors --no-plot --without gemv
      done
      run decode-profile-pdl 150 python3 bench/profile_decode.py $M --random-init --batches 1,8 ;;
    profile) run decode-profile 150 python3 bench/profile_decode.py $M --random-init --batches 1,8,64,256 ;;
    gateway)  # through the Shepherd Model Gateway against direct graphserve.v1, one server, two rounds in turn
      if ! python3 -c "import smg, openai" 2>/dev/null; then
        echo "gateway: smg / openai not importable: install the wheels of bench/fetch_wheels.sh first (see there)"; continue
      fi
      TAIL=20 run gateway-1b 500 python3 bench/gateway_bench.py $M --dtype bfloat16 --concurrency 64 --requests 256 \
        --output-tokens 128 --client-procs 4 --rounds 2 --server-log "$OUT/gateway-1b-server.log" --smg-log "$OUT/gateway-1b-smg.log" ;;
    gemm-sweep)  # decode GEMMs, cuBLAS against our Triton GEMV / small tiles: the 1B shapes, then 8B's at TP=2
      TAIL=40 run gemm-sweep-1b 150 python3 bench/gemm_sweep.py
      TAIL=40 run gemm-sweep-8b-tp2 150 python3 bench/gemm_sweep.py --shapes 3072x4096,4096x2048,14336x4096,4096x7168,64128x4096 ;;
  esac
done
