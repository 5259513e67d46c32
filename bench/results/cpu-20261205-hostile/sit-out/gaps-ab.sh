for k in 1 2; do
  for side in B A; do
    d=/work/wtB; [ $side = A ] && d=/work/main
    cd $d; r=$(timeout 900 .venv/bin/python bench/hostile_constraints.py --scenarios gaps --repeat 2 2>&1 | grep -v wrote | tr '\n' ' ')
    echo "$side $r"
    mv bench/results/hostile-constraints-cpu-2026*.json /tmp/ab/gaps-$side-$(date +%H%M%S).json
  done
done
