cd /work/main
for i in 1 2 3; do
  for v in default 1mib; do
    a=""; [ $v = 1mib ] && a="--max-receive-message-bytes 1048576"
    echo "== $v $i"
    OMP_NUM_THREADS=1 GRAPHSERVE_BENCH_RESULTS=/tmp/rl/$v timeout 300 .venv/bin/python bench/hostile_constraints.py --scenarios flood --repeat 0 --server-args "$a" 2>&1 | grep -v '^{' | grep -E "^flood"
  done
done
