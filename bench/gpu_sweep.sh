#!/usr/bin/env bash
# gemmd's own probes over a grid of shapes and dtypes on the lent GPU machine
# (../shared/gpu/README.md), exported as CSV: timings of a GPU the model never saw, to judge
# transfer on (`python bench/transfer.py --holdout OUT/sweep.csv`, or
# `gemmd evaluate --model prior.skops --calibrate-rows 0,5,20 OUT/sweep.csv`).
#
# Usage: bench/gpu_sweep.sh OUTDIR [SECONDS]   (default 360 s; no chunk is started after)
#
# One `gemmd probe` process per (dtype, M), the store exported after each, so a run cut at
# any point returns what it measured. Window 0.5 s, the least the NVIDIA backend accepts
# (NVML's energy counter moves in ~100 ms steps). Environment, for a smaller run or the
# simulated GPU (tests/test_gpu_accept.py): GEMMD_SWEEP_BACKEND (nvidia),
# GEMMD_SWEEP_SIZES ("256 1024 2048 4096 8192", each of M, N, K), GEMMD_SWEEP_DTYPES
# ("bf16 fp16 tf32 fp32"); GEMMD_SWEEP_RANDOM=N (instead of the grid: N shapes per dtype, each
# of M, N, K drawn log-uniform between the least and the largest of the sizes, half of them
# rounded to a multiple of 64 and half left odd, seeded by GEMMD_SWEEP_SEED (1); run in chunks
# of 25 shapes, each dtype in turn, so that a run cut short has every dtype).
root=$(cd "$(dirname "$0")/.." && pwd)
out=${1:?usage: bench/gpu_sweep.sh OUTDIR [SECONDS]}
budget=${2:-360}
backend=${GEMMD_SWEEP_BACKEND:-nvidia}
sizes=${GEMMD_SWEEP_SIZES:-256 1024 2048 4096 8192}
dtypes=${GEMMD_SWEEP_DTYPES:-bf16 fp16 tf32 fp32}
random=${GEMMD_SWEEP_RANDOM:-0}
seed=${GEMMD_SWEEP_SEED:-1}
mkdir -p "$out" || exit
# the lent machine's missing dependencies (../shared/gpu/README.md); not for the simulated
# GPU, which runs in the project's own environment
if [[ $backend == nvidia ]] && compgen -G "$root/.whl/*.whl" > /dev/null; then
  python3 -m pip install -q --upgrade --no-index --no-deps --target /tmp/site "$root"/.whl/*.whl \
    || exit
  export PYTHONPATH=/tmp/site:$root
else
  export PYTHONPATH=$root${PYTHONPATH:+:$PYTHONPATH}
fi
state=$(mktemp -d) || exit
trap 'rm -rf "$state"' EXIT
log=$out/sweep.log
start=$SECONDS
nvidia-smi -q -d CLOCK,POWER,PERFORMANCE,TEMPERATURE > "$out/smi_before.txt" 2>&1
# one gemmd probe process per chunk: "LABEL DTYPE SHAPE..." on each line
chunks() {
  if ((random > 0)); then
    python3 - "$random" "$seed" "$dtypes" $sizes <<'PY' || exit
import math, random, sys
count, seed, dtypes = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3].split()
sizes = [int(x) for x in sys.argv[4:]]
lo, hi = math.log(min(sizes)), math.log(max(sizes))
draw = random.Random(seed)
def dim(odd):
    v = math.exp(draw.uniform(lo, hi))
    return max(1, round(v)) if odd else max(64, round(v / 64) * 64)
shapes = {d: [] for d in dtypes}
for d in dtypes:
    for i in range(count):
        shapes[d].append("x".join(str(dim(i % 2 == 1)) for _ in range(3)))
for c in range(0, count, 25):
    for d in dtypes:
        print(f"{d}-random-{c // 25}", d, *shapes[d][c:c + 25])
PY
  else
    for dtype in $dtypes; do
      for m in $sizes; do
        line="$dtype/M=$m $dtype"
        for n in $sizes; do for k in $sizes; do line+=" ${m}x${n}x${k}"; done; done
        echo "$line"
      done
    done
  fi
}
plan=$(chunks) || exit
while read -r label dtype shapes; do
  left=$((budget - (SECONDS - start)))
  if ((left <= 0)); then echo "cut by the budget: $label not run" >> "$log"; continue; fi
  args=()
  for shape in $shapes; do args+=(--shape "$shape"); done
  t0=$SECONDS
  timeout $((left + 30)) python3 -m gemmd probe --backend "$backend" --state-dir "$state" \
    --dtype "$dtype" --window 0.5 --force --format csv "${args[@]}" \
    > /dev/null 2>> "$log"
  echo "$label: exit $?, $((SECONDS - t0)) s" >> "$log"
  python3 -m gemmd export --state-dir "$state" --out "$out/sweep.csv" 2>> "$log"
done <<< "$plan"
nvidia-smi -q -d CLOCK,POWER,PERFORMANCE,TEMPERATURE > "$out/smi_after.txt" 2>&1
rows=0
[[ -f $out/sweep.csv ]] && rows=$(($(wc -l < "$out/sweep.csv") - 1))
echo "done in $((SECONDS - start)) s; $rows rows" | tee -a "$log"
((rows > 0))
