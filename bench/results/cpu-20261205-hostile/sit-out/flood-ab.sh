for n in 19 0 19 0 19 0; do
  for side in B A; do
    d=/work/wtB; [ $side = A ] && d=/work/main
    cd $d; r=$(timeout 600 .venv/bin/python bench/hostile_constraints.py --scenarios flood --repeat 0 --hostile-nice $n 2>&1 | grep flood:)
    echo "$side nice=$n $r"
    mv bench/results/hostile-constraints-cpu-2026*.json /tmp/ab/$side-nice$n-$(date +%H%M%S).json
  done
done
