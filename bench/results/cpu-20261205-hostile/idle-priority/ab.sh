for i in 1 2; do
  for v in before after; do
    if [ $v = before ]; then cd /work/wtB; else cd /work/main; fi
    echo "== $v $i $(git log --oneline -1 | cut -c1-7)"
    GRAPHSERVE_BENCH_RESULTS=/tmp/ab2/$v timeout 600 /work/main/.venv/bin/python bench/hostile_constraints.py --scenarios gaps,flood --repeat 2 2>&1 | grep -v '^{' | grep -E "^  [0-9]|^flood"
  done
done
