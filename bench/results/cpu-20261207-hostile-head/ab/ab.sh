for i in 1 2; do
  for v in head old; do
    if [ $v = old ]; then cd /work/wtB; else cd /work/main; fi
    echo "== $v $i $(git log --oneline -1 | cut -c1-7)"
    GRAPHSERVE_BENCH_RESULTS=/tmp/ab3/$v timeout 600 /work/main/.venv/bin/python bench/hostile_constraints.py --scenarios gaps --repeat 3 2>&1 | grep -v '^{' | grep -E "^  [0-9]"
  done
done
