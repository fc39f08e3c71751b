#!/usr/bin/env bash
# Sweep gemmd's NVIDIA probes over shapes x dtypes x kernels with `gemmd probe` (needs a GPU).
# Usage: bench/gpu_sweep.sh [OUT.csv]   (default bench/results/sweep-<gpu>-<date>.csv)
set -euo pipefail
cd "$(dirname "$0")/.."
GEMMD=${GEMMD:-.venv/bin/gemmd}
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader -i 0 | tr ' ' '_' | tr -cd '[:alnum:]_-')
out=${1:-bench/results/sweep-${gpu}-$(date -u +%Y%m%d).csv}
shapes=(--shape 512x512x512 --shape 1024x1024x1024 --shape 2048x2048x2048
        --shape 4096x4096x4096 --shape 8192x8192x8192 --shape 8192x8192x1024
        --shape 1024x8192x8192)
# cuBLAS: every dtype and layout the backend reaches.
"$GEMMD" probe --backend nvidia --no-store --force --format csv "${shapes[@]}" \
  --kernel blas --dtype fp32 --dtype tf32 --dtype fp16 --dtype bf16 --dtype fp64 --dtype fp8 \
  --layout nn --layout nt --layout tn --layout tt > "$out"
# The paper's tiled kernel at its tile sizes (fp32, row-major); append without the header.
"$GEMMD" probe --backend nvidia --no-store --force --format csv \
  --shape 512x512x512 --shape 1024x1024x1024 --shape 2048x2048x2048 \
  --kernel tiled --dtype fp32 --tile 1 --tile 4 --tile 8 --tile 16 --tile 32 | tail -n +2 >> "$out"
echo "wrote $out ($(($(wc -l < "$out") - 1)) probes)"
