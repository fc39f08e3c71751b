"""One GEMM timed alone after idle against the same GEMM back to back over a window.

Why: gemmd's own probes of an H100 took 1.08x (up to 1.17x) XLA's table's time above
17 GFLOP and 0.51x below 1 GFLOP (bench/RESULTS.md, 2026-11-27). The guess: the table
times a GEMM alone, at boost clocks and with a launch; gemmd's 0.5 s windows run GEMMs
back to back, at the power cap where it binds. This measures both ways on one GPU with
torch.matmul (cuBLAS), per shape and dtype:

- ``alone``: after ``--idle`` seconds of idle, ``--reps`` single GEMMs, each timed by its
  own CUDA events with a synchronize between them (a launch each, the clocks of a GPU
  that has not been busy); the median;
- ``window``: GEMMs back to back for ``--window`` seconds (as gemmd's probe), the time
  per GEMM over the last half of the window (CUDA events around a batch);

with the SM clock and NVML's clock-event reasons read after each. Writes OUT/burst.csv.

    python3 bench/burst_vs_window.py OUT [--window 0.5] [--idle 2] [--reps 20]
"""

from __future__ import annotations

import argparse
import csv
import statistics
import sys
import time
from pathlib import Path

SHAPES = [(256, 256, 256), (1024, 1024, 1024), (2048, 2048, 2048), (4096, 4096, 4096),
          (8192, 8192, 8192)]
DTYPES = ("bf16", "tf32")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--window", type=float, default=0.5)
    ap.add_argument("--idle", type=float, default=2.0)
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    try:
        import pynvml
        import torch
    except ImportError as e:
        print(f"bench/burst_vs_window.py: {e}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("bench/burst_vs_window.py: no CUDA device", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    pynvml.nvmlInit()
    h = pynvml.nvmlDeviceGetHandleByIndex(0)
    torch.backends.cuda.matmul.allow_tf32 = True

    def state() -> tuple[int, int]:
        return (pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM),
                pynvml.nvmlDeviceGetCurrentClocksEventReasons(h))

    rows = []
    for dtype in DTYPES:
        tdt = torch.bfloat16 if dtype == "bf16" else torch.float32
        for m, n, k in SHAPES:
            a = torch.randn(m, k, device="cuda", dtype=tdt)
            b = torch.randn(k, n, device="cuda", dtype=tdt)
            c = torch.matmul(a, b)  # cuBLAS handle, heuristics, workspace
            torch.cuda.synchronize()
            time.sleep(args.idle)
            alone = []
            for _ in range(args.reps):
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
                torch.matmul(a, b, out=c)
                e1.record()
                e1.synchronize()
                alone.append(e0.elapsed_time(e1) / 1e3)
            sm_alone, why_alone = state()
            # back to back for the window; the time per GEMM over its second half
            t_end = time.perf_counter() + args.window
            half = time.perf_counter() + args.window / 2
            while time.perf_counter() < half:
                for _ in range(8):
                    torch.matmul(a, b, out=c)
                torch.cuda.synchronize()
            count = 0
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            while time.perf_counter() < t_end:
                for _ in range(8):
                    torch.matmul(a, b, out=c)
                count += 8
                if count % 64 == 0:
                    e1.record()
                    e1.synchronize()
            e1.record()
            e1.synchronize()
            window = e0.elapsed_time(e1) / 1e3 / max(count, 1)
            sm_win, why_win = state()
            row = {"dtype": dtype, "m": m, "n": n, "k": k,
                   "alone_s": statistics.median(alone), "alone_min_s": min(alone),
                   "window_s": window, "window_over_alone": window / statistics.median(alone),
                   "sm_mhz_alone": sm_alone, "reasons_alone": hex(why_alone),
                   "sm_mhz_window": sm_win, "reasons_window": hex(why_win), "gemms": count}
            rows.append(row)
            print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                           for k, v in row.items()), flush=True)
            with (args.out / "burst.csv").open("w", newline="") as fh:
                w = csv.DictWriter(fh, fieldnames=list(rows[0]))
                w.writeheader()
                w.writerows(rows)
            del a, b, c
    return 0


if __name__ == "__main__":
    sys.exit(main())
