"""GPU fidelity of gemmd's NVIDIA probes (needs an NVIDIA GPU, CuPy, pynvml; torch optional).

1. Throughput: the probe's bf16/fp16/fp32 8192^3 TFLOP/s against cupy.matmul and
   torch.matmul timed independently (CUDA events, same shape) in the same run.
   Target: probe / best library >= 0.98.
2. Energy stability: coefficient of variation of energy per GEMM over REPEATS probes at
   window lengths 0.25/0.5/1/2 s, for the window-delta method gemmd uses and for the
   step-to-step method (power between two observed counter steps x CUDA-event time).
   Target: CV <= 2% at the default window.

    python bench/gpu_fidelity.py [--gpu 0] [--repeats 10] [--out DIR]

Prints tables and writes fidelity.csv and energy.csv to --out.
"""

from __future__ import annotations

import argparse
import csv
import math
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np

from gemmd.config import MeasureConfig
from gemmd.devices.nvidia import NvidiaDevice
from gemmd.devices.nvml import Nvml
from gemmd.probes import ProbeSpec, measure

SHAPE = (8192, 8192, 8192)
WINDOWS = (0.25, 0.5, 1.0, 2.0)


def time_library(fn, iters: int = 50) -> float:
    """Median seconds per call of ``fn`` on the current CuPy stream, CUDA-event timed."""
    import cupy as cp

    for _ in range(5):
        fn()
    cp.cuda.get_current_stream().synchronize()
    times = []
    for _ in range(iters):
        a, b = cp.cuda.Event(), cp.cuda.Event()
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(cp.cuda.get_elapsed_time(a, b) / 1e3)
    return float(np.median(times))


def library_tflops(dtype: str, ordinal: int) -> dict[str, float]:
    m, n, k = SHAPE
    flops = 2.0 * m * n * k
    out: dict[str, float] = {}
    import cupy as cp

    if dtype in ("fp16", "fp32"):  # CuPy has no bfloat16 arrays
        dt = {"fp16": cp.float16, "fp32": cp.float32}[dtype]
        with cp.cuda.Device(ordinal):
            a = cp.random.standard_normal((m, k), dtype=cp.float32).astype(dt)
            b = cp.random.standard_normal((k, n), dtype=cp.float32).astype(dt)
            out["cupy.matmul"] = flops / time_library(lambda: cp.matmul(a, b)) / 1e12
            del a, b
    try:
        import torch
    except ImportError:
        return out
    tdt = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32, as in the probe
    dev = torch.device("cuda", ordinal)
    a = torch.randn(m, k, device=dev, dtype=tdt)
    b = torch.randn(k, n, device=dev, dtype=tdt)
    for _ in range(5):
        torch.matmul(a, b)
    torch.cuda.synchronize(dev)
    times = []
    for _ in range(50):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        torch.matmul(a, b)
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    out["torch.matmul"] = flops / float(np.median(times)) / 1e12
    return out


def step_to_step_energy(dev: NvidiaDevice, spec: ProbeSpec, window_s: float) -> float | None:
    """Energy per GEMM = power between two observed counter steps x CUDA-event time/GEMM.

    The GPU runs the GEMM back to back (a background thread keeps the queue full) while
    the host polls the counter; the first and last observed steps bound the interval.
    """
    per_iter = float(np.median(dev.run(spec, 20, threading.Event())))
    iters = max(3, int((window_s + 0.4) / per_iter))
    done = threading.Event()
    times: list[float] = []
    t = threading.Thread(target=lambda: (times.extend(dev.run(spec, iters, done)), done.set()))
    t.start()
    steps = []
    last = dev.energy_j()
    start = time.monotonic()
    while not done.is_set() and time.monotonic() - start < window_s + 0.4:
        e = dev.energy_j()
        if e != last:
            steps.append((time.monotonic(), e))
            last = e
        time.sleep(0.001)
    t.join()
    if len(steps) < 2:
        return None
    (t0, e0), (t1, e1) = steps[0], steps[-1]
    power = (e1 - e0) / (t1 - t0)
    return power * float(np.median(times))


def cv(xs: list[float]) -> float:
    return statistics.pstdev(xs) / statistics.fmean(xs) if len(xs) > 1 else math.nan


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpu", type=int, default=0, help="NVML index")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--out", type=Path, default=Path("bench/results"))
    args = ap.parse_args()
    nvml = Nvml()
    rec = next((r for r in nvml.discover() if r.index == args.gpu), None)
    if rec is None:
        print(f"no GPU with NVML index {args.gpu}", file=sys.stderr)
        return 2
    dev = NvidiaDevice(rec, memory_budget=8 << 30, nvml=nvml)
    print(f"# {rec.name} ({rec.uuid}), CC {rec.compute_capability}, SMs {dev.info.sm_count}, "
          f"power limit {rec.power_limit_w} W, {time.strftime('%Y-%m-%d %H:%M:%S %Z')}")
    args.out.mkdir(parents=True, exist_ok=True)

    rows = []
    print("\n## Throughput, 8192^3 (TFLOP/s)")
    print(f"{'dtype':<6} {'probe':>8} {'cupy':>8} {'torch':>8} {'ratio':>7}")
    for dtype in ("bf16", "fp16", "fp32"):
        spec = ProbeSpec(*SHAPE, dtype=dtype)
        m = measure(dev, spec, MeasureConfig(window_s=1.0, warmup_s=0.5))
        libs = library_tflops(dtype, dev.info.extra["cuda_ordinal"])
        best = max(libs.values()) if libs else math.nan
        ratio = m.tflops / best
        rows.append({"dtype": dtype, "probe_tflops": m.tflops, **{k + "_tflops": v for k, v in
                                                                   libs.items()},
                     "ratio_to_best": ratio, "probe_power_w": m.power_w})
        print(f"{dtype:<6} {m.tflops:8.1f} {libs.get('cupy.matmul', math.nan):8.1f} "
              f"{libs.get('torch.matmul', math.nan):8.1f} {ratio:7.3f}")
    with open(args.out / "fidelity.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=sorted({k for r in rows for k in r}))
        w.writeheader()
        w.writerows(rows)

    print(f"\n## Energy per GEMM, bf16 8192^3, {args.repeats} repeats per window")
    print(f"{'window_s':>8} {'delta mJ':>10} {'delta CV':>9} {'step mJ':>10} {'step CV':>8}")
    spec = ProbeSpec(*SHAPE, dtype="bf16")
    erows = []
    for window in WINDOWS:
        cfg = MeasureConfig(window_s=window, warmup_s=0.2)
        delta = [measure(dev, spec, cfg).energy_j or math.nan for _ in range(args.repeats)]
        step = [step_to_step_energy(dev, spec, window) or math.nan for _ in range(args.repeats)]
        for i in range(args.repeats):
            erows.append({"window_s": window, "repeat": i, "delta_energy_j": delta[i],
                          "step_energy_j": step[i]})
        print(f"{window:8.2f} {1e3 * statistics.fmean(delta):10.2f} {100 * cv(delta):8.2f}% "
              f"{1e3 * statistics.fmean(step):10.2f} {100 * cv(step):7.2f}%")
    with open(args.out / "energy.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(erows[0]))
        w.writeheader()
        w.writerows(erows)
    dev.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
