cd /work/main
for i in 1 2; do
  for v in before after; do
    if [ $v = before ]; then git stash push -q service/engine/mask_fill.py service/engine/grammar_threads.py; fi
    echo "== $v $i"
    GRAPHSERVE_BENCH_RESULTS=/tmp/ab/$v timeout 600 .venv/bin/python bench/hostile_constraints.py --scenarios gaps,flood --repeat 2 2>&1 | grep -v '^{' | grep -E "^  [0-9]|^flood"
    if [ $v = before ]; then git stash pop -q; fi
  done
done
