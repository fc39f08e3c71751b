"""Where a probe's GPU time goes beyond its window, from the H200's plan_cost.csv.

``python bench/call_overhead.py [CSV]`` (default: bench/results/2026-11-26-h200-plan/
plan_cost.csv, written by ``bench/drift.py --measure-plan`` before the phases were
recorded). For each probe and configuration it rebuilds the warm-up that the measuring
tree ran (batches of 1, 2, 4, ... GEMMs rounded up to whole chunks until warmup_iters and
warmup_s were reached), subtracts the warm-up's and the window's GPU time from the elapsed
time, and fits what is left as ``a + b x (device calls)``: the host time each call costs.
Then it estimates what the default plan costs a round with this tree's warm-up (two
calls) and time-bounded window, under the two readings of that cost the data cannot tell
apart: every call pays it, or only the calls that read the energy counter. The phases
recorded by this tree (gpu_accept's phases.csv) will say which.
"""

from __future__ import annotations

import argparse
import csv
import math
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
DEFAULT = HERE / "results" / "2026-11-26-h200-plan" / "plan_cost.csv"
PLAN = ("blas-fp32-nn-8192x8192x8192", "blas-bf16-nn-8192x8192x8192")  # the default plan
WINDOW, WARMUP, CHECK_EVERY = 0.5, 0.02, 10


def check_costs(rows: list[dict[str, str]]) -> tuple[float, dict[str, float]]:
    """The correctness check's time beyond its probe's unchecked median elapsed time at the
    same window and warm-up, each check in the order it ran: (what a check costs once its
    dtype has been checked before in the process, the largest such excess, at least 0;
    the first check of each dtype's excess). On the H200 the first check of bf16 and of
    fp32 (both 8192^3, checked first) cost +0.22 s, the later ones of the same dtypes
    (4096^3, tiled) -0.05 to +0.03 s: a one-time cost per dtype (CuPy builds its gather
    kernels per dtype on first use; the host's float64 reference is ~17 MFLOP), not a
    cost of every check."""
    by: dict[tuple[str, str, str], list[float]] = defaultdict(list)
    for r in rows:
        if r["check"] == "False":
            by[(r["probe"], r["window_cfg"], r["warmup_cfg"])].append(float(r["elapsed_s"]))
    seen: set[str] = set()
    first: dict[str, float] = {}
    later: list[float] = []
    for r in sorted((r for r in rows if r["check"] == "True"), key=lambda r: float(r["t"])):
        plain = by.get((r["probe"], r["window_cfg"], r["warmup_cfg"]))
        if not plain:
            continue
        extra = float(r["elapsed_s"]) - float(np.median(plain))
        dtype = r["probe"].split("-")[1]  # blas-bf16-nn-..., tiled32-fp32-nn-...
        if dtype in seen:
            later.append(extra)
        else:
            seen.add(dtype)
            first[dtype] = extra
    return (max(max(later), 0.0) if later else math.nan), first


def chunk_size(per: float) -> int:
    """The NVIDIA backend's GEMMs per graph for a GEMM of ``per`` seconds (warm)."""
    return 1 if per >= 200e-6 else math.ceil(200e-6 / per)


def old_warm_up(per: float, warmup_s: float, chunk: int, warmup_iters: int = 2
                ) -> tuple[int, float]:
    """(calls, GPU seconds) of the doubling warm-up that measured plan_cost.csv."""
    n, batch, calls = 0, 1, 0
    while n < warmup_iters or n * per < warmup_s:
        n += -(-batch // chunk) * chunk
        batch *= 2
        calls += 1
    return calls, n * per


def new_warm_up(per: float, warmup_s: float, chunk: int, warmup_iters: int = 2
                ) -> tuple[int, float]:
    """(calls, GPU seconds) of this tree's warm-up (gemmd/devices/base.py): one GEMM,
    then 10% over what is still needed, at most 128x the GEMMs so far, whole chunks."""
    n, batch, calls = 0, 1, 0
    while n < warmup_iters or n * per < warmup_s:
        n += -(-batch // chunk) * chunk
        calls += 1
        by_time = math.ceil(1.1 * (warmup_s - n * per) / per)
        batch = max(1, min(n * 128, max(warmup_iters - n, by_time)))
    return calls, n * per


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("csv", nargs="?", default=str(DEFAULT))
    args = ap.parse_args(argv)
    groups: dict[tuple, list[dict]] = defaultdict(list)
    with open(args.csv, newline="") as f:
        every = list(csv.DictReader(f))
    for r in every:
        if r["check"] == "False":
            groups[(r["probe"], float(r["window_cfg"]), float(r["warmup_cfg"]))].append(r)
    check_s, first = check_costs(every)
    rows, x, y = [], [], []
    for (probe, win, wu), rs in sorted(groups.items()):
        per = float(np.median([float(r["runtime_s"]) for r in rs]))
        # The chunk was calibrated on warm GEMMs at full clocks: the fastest seen.
        chunk = chunk_size(min(float(r["runtime_s"]) for r in rs))
        calls, warm_s = old_warm_up(per, wu, chunk)
        rest = float(np.median([float(r["elapsed_s"]) - float(r["window_s"]) for r in rs]))
        left = rest - warm_s
        rows.append((probe, win, wu, per, chunk, calls, warm_s, left))
        x.append([1.0, calls + 1])  # the warm-up's calls and the window's
        y.append(left)
    fits = {}
    for wu in sorted({r[2] for r in rows}):
        pick = [i for i, r in enumerate(rows) if r[2] == wu]
        xs, ys = np.asarray(x)[pick], np.asarray(y)[pick]
        sol, *_ = np.linalg.lstsq(xs, ys, rcond=None)
        fits[wu] = (float(sol[0]), float(sol[1]), float((ys - xs @ sol).std()), len(pick))
    print("| probe | window s | warm-up s | GEMM ms | chunk | warm-up calls | warm-up GPU s "
          "| left beyond window and warm-up, s | per call |")
    print("|---|---|---|---|---|---|---|---|---|")
    for probe, win, wu, per, chunk, calls, warm_s, left in rows:
        print(f"| {probe} | {win} | {wu} | {per * 1e3:.3f} | {chunk} | {calls} | "
              f"{warm_s:.3f} | {left:.3f} | {left / (calls + 1) * 1e3:.1f} ms |")
    print()
    for wu, (a, b, sd, k) in fits.items():
        print(f"Fit over the {k} configurations with a {wu} s warm-up: left = "
              f"{a * 1e3:.1f} ms + {b * 1e3:.1f} ms x calls (residual sd {sd * 1e3:.1f} ms)")
    a, b, _, _ = fits[WARMUP]  # the default warm-up's
    # This tree: the warm-up of new_warm_up, the window ending at its 0.5 s (give or
    # take a chunk) whatever the clocks do, the energy counter read only in the window.
    total_all = total_window_only = 0.0
    for probe in PLAN:
        rs = groups[(probe, WINDOW, WARMUP)]
        per = float(np.median([float(r["runtime_s"]) for r in rs]))
        calls, warm_s = new_warm_up(per, WARMUP, chunk_size(per))
        base = WINDOW + warm_s + max(a, 0.0) + check_s / CHECK_EVERY
        total_all += base + (calls + 1) * b
        total_window_only += base + b
        print(f"{probe}: window measured {np.median([float(r['window_s']) for r in rs]):.3f} s "
              f"-> {WINDOW} s; warm-up {warm_s:.3f} s of GEMMs in {calls} calls")
    print("the check: " + ", ".join(f"the first of {d} +{x:.3f} s" for d, x in first.items())
          + f", a later one at most +{check_s:.3f} s (once in {CHECK_EVERY} probes)")
    print(f"default plan, estimated per round: {total_window_only:.2f} s (only the window's "
          f"call pays the {b * 1e3:.0f} ms) to {total_all:.2f} s (every call pays it), "
          "before exploration")
    return 0


if __name__ == "__main__":
    sys.exit(main())
