"""Drift detection: delay to detect a sustained slowdown, and false alarms on healthy GPUs.

Three parts, one run:
1. Pipeline: a fake H100 probed by gemmd's own measurement protocol on simulated time,
   a Random Forest fitted on its healthy probes, and the daemon's DriftMonitor, for
   simulated days at the default 120 s interval; a 5% slowdown starts half-way. Reports
   the delay in probe rounds and any false alarm before it.
2. Delay: gemmd.drift.update on log-residual streams with run-to-run noise CV of
   0.5/1/2/3% (3% is the noise floor of the GPPerf CUTLASS data, repeated profiler runs;
   a probe's 1 s window median is steadier), 2,000 trials per level.
3. False alarms per GPU-year: the same CUSUM vectorized over many tracks (checked
   against gemmd.drift.update on a sample), 18 tracks per GPU (6 sentinels x runtime,
   power, energy), one year of 120 s rounds, iid and AR(1)-correlated noise.

    .venv/bin/python bench/drift.py [--gpu-years 100] [--days 4] [--markdown FILE]
"""

from __future__ import annotations

import argparse
import math
import time

import numpy as np

from gemmd.config import DriftConfig, FakeDeviceConfig, MeasureConfig, ModelConfig
from gemmd.devices.fake import FakeDevice
from gemmd.drift import (
    ALPHA,
    RHO_MAX,
    Z_CAP,
    DriftMonitor,
    Track,
    measured_of,
    predicted_of,
    update,
)
from gemmd.gemm import ProbeSpec
from gemmd.model import ForestModel
from gemmd.probes import as_row, measure

ROUND_S = 120.0
ROUNDS_PER_YEAR = int(365 * 86400 / ROUND_S)
P = DriftConfig()  # the shipped defaults
SENTINELS = [ProbeSpec(4096, 4096, 4096, "bf16"), ProbeSpec(4096, 4096, 4096, "fp32"),
             ProbeSpec(8192, 8192, 8192, "bf16"), ProbeSpec(8192, 8192, 8192, "fp32"),
             ProbeSpec(1024, 1024, 1024, "fp32", "tiled", 16),
             ProbeSpec(1024, 1024, 1024, "fp32", "tiled", 32)]


def pipeline(days: float, jitter: float, shift: float = 0.05) -> dict:
    dev = FakeDevice(0, FakeDeviceConfig(), seed=3, jitter=jitter)
    cfg = MeasureConfig(window_s=1.0, warmup_s=0.1)
    rows = []
    for _ in range(12):  # two hours of healthy history before the first model
        for s in SENTINELS:
            r = as_row(measure(dev, s, cfg))
            r["device_uuid"] = dev.info.uuid
            rows.append(r)
    model = ForestModel.fit(rows, [dev.info] * len(rows), ModelConfig(min_samples=30))
    mon = DriftMonitor(P)
    rounds = int(days * 86400 / ROUND_S)
    start_slow = rounds // 2
    false_alarms, detect = 0, None
    preds = model.predict(SENTINELS, [dev.info] * len(SENTINELS))
    for i in range(rounds):
        if i == start_slow:
            dev.cfg = FakeDeviceConfig(slowdown_factor=1 + shift)
        for s, p in zip(SENTINELS, preds):
            m = measure(dev, s, cfg)
            raised = mon.observe(dev.info.uuid, s, measured_of(m), predicted_of(p), p.sigma,
                                 now=i * ROUND_S)
            if raised and i < start_slow:
                false_alarms += 1
            if raised and i >= start_slow and detect is None and "runtime" in raised:
                detect = i - start_slow + 1
    return {"rounds": rounds, "false_alarms": false_alarms, "delay": detect,
            "model_sigma": model.sigma.get("runtime", math.nan)}


def delays(noise: float, trials: int, rng: np.random.Generator, shift: float = 0.05,
           settle: int = 0) -> list:
    """Rounds to detect ``shift`` starting ``settle`` healthy rounds after the baseline."""
    out = []
    for _ in range(trials):
        tr = Track()
        for r in rng.normal(0, noise, P.baseline_probes + settle):
            update(tr, r, 0.0, shift=P.shift, arl0=P.arl0, baseline_probes=P.baseline_probes,
                   min_scale=P.min_scale, now=0)
        for n in range(1, 1000):
            if update(tr, math.log1p(shift) + rng.normal(0, noise), 0.0, shift=P.shift, arl0=P.arl0,
                      baseline_probes=P.baseline_probes, min_scale=P.min_scale, now=0):
                out.append(n)
                break
    return out


def noise_stream(rng: np.random.Generator, shape: tuple, noise: float, phi: float) -> np.ndarray:
    """AR(1) noise with marginal std ``noise`` (phi = 0: iid)."""
    e = rng.normal(0, noise * math.sqrt(1 - phi**2), shape)
    if phi == 0:
        return e
    x = np.empty(shape)
    x[0] = rng.normal(0, noise, shape[1])
    for t in range(1, shape[0]):
        x[t] = phi * x[t - 1] + e[t]
    return x


def false_alarms(tracks: int, rounds: int, noise: float, phi: float, rng: np.random.Generator,
                 check: int = 0) -> int:
    """Alarms over ``rounds`` healthy rounds of ``tracks`` tracks, vectorized; the first
    ``check`` tracks also run through gemmd.drift.update and must agree alarm for alarm."""
    n0 = P.baseline_probes
    base = noise_stream(rng, (n0, tracks), noise, phi)
    ref = np.median(base, axis=0)
    dev0 = base - ref
    var = np.var(base, axis=0, ddof=1)
    cov = np.mean(dev0[1:] * dev0[:-1], axis=0)
    prev = dev0[-1].copy()
    neff = np.full(tracks, float(n0))

    def lr_scale(var, cov, neff):
        rho = np.clip(np.divide(cov, var, out=np.zeros_like(var), where=var > 0), 0, RHO_MAX)
        nu = np.maximum(neff - 1.0, 1.0)  # gemmd.drift.upper_bound_factor, vectorized
        c = 1 - 2 / (9 * nu) - 2.326 * np.sqrt(2 / (9 * nu))
        widen = np.sqrt(nu / (nu * np.maximum(c, 0.05) ** 3))
        return np.maximum(P.min_scale,
                          widen * np.sqrt(np.maximum(var, 0) * (1 + rho) / (1 - rho)))

    scale = lr_scale(var, cov, neff)

    def h_of(k: np.ndarray) -> np.ndarray:
        """gemmd.drift.threshold, vectorized (same fixed point, same floor)."""
        k = np.maximum(k, 1e-3)
        b = np.ones_like(k)
        for _ in range(8):
            b = np.log(2 * k * k * P.arl0 + 2 * k * b + 1) / (2 * k)
        return np.maximum(b - 1.166, 0.5)

    s, drifting, alarms = np.zeros(tracks), np.zeros(tracks, bool), np.zeros(tracks, int)
    checked = [Track() for _ in range(check)]
    for j, tr in enumerate(checked):
        for r in base[:, j]:
            update(tr, float(r), 0.0, shift=P.shift, arl0=P.arl0, baseline_probes=n0,
                   min_scale=P.min_scale, now=0)
    last, chunk = base[-1], 20_000
    for c0 in range(0, rounds, chunk):
        n = min(chunk, rounds - c0)
        e = rng.normal(0, noise * math.sqrt(1 - phi**2), (n, tracks))
        if phi:  # continue the AR(1) process across chunks
            for t in range(n):
                last = phi * last + e[t]
                e[t] = last
        x = e
        for t in range(n):
            dev = x[t] - ref
            z = dev / scale
            k = math.log1p(P.shift) / (2 * scale)
            learn = (s == 0) & ~drifting
            d = np.clip(dev, -4 * scale, 4 * scale)
            var = np.where(learn, (1 - ALPHA) * var + ALPHA * d * d, var)
            cov = np.where(learn, (1 - ALPHA) * cov + ALPHA * d * prev, cov)
            neff = np.where(learn, (1 - ALPHA) * neff + 1.0, neff)
            scale = np.where(learn, lr_scale(var, cov, neff), scale)
            prev = dev
            s = np.maximum(0.0, s + np.clip(z, -Z_CAP, Z_CAP) - k)
            new = ~drifting & (s > h_of(k))
            alarms += new
            drifting = (drifting | new) & (s > 0)
            for j, tr in enumerate(checked):
                update(tr, float(x[t, j]), 0.0, shift=P.shift, arl0=P.arl0, baseline_probes=n0,
                       min_scale=P.min_scale, now=0)
    assert [tr.alarms for tr in checked] == alarms[:check].tolist(), "vectorized != drift.py"
    return int(alarms.sum())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpu-years", type=int, default=100)
    ap.add_argument("--days", type=float, default=4.0)
    ap.add_argument("--trials", type=int, default=2000)
    ap.add_argument("--markdown", help="write the figures as a Markdown section here")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    lines = [f"Defaults: shift {P.shift}, arl0 {P.arl0:g}, baseline_probes {P.baseline_probes}, "
             f"min_scale {P.min_scale}; rounds every {ROUND_S:.0f} s.", ""]

    t0 = time.perf_counter()
    pipe = pipeline(args.days, jitter=0.01)
    lines += [f"Pipeline (fake H100, 6 sentinels, run-to-run jitter 1%, {args.days:g} simulated "
              f"days, 5% slowdown from day {args.days / 2:g}): detected after "
              f"{pipe['delay']} round(s); {pipe['false_alarms']} false alarm(s) in "
              f"{pipe['rounds'] // 2} healthy rounds x 18 tracks; model runtime sigma "
              f"{pipe['model_sigma']:.4f} ({time.perf_counter() - t0:.0f} s).", ""]

    lines += ["| run-to-run noise (CV) | delay p50 / p95 / max, 1 day after baseline | "
              "same, right after baseline | false alarms / GPU-year, iid | AR(1) phi=0.7 |",
              "|---|---|---|---|---|"]
    gpus = args.gpu_years
    for noise in (0.005, 0.01, 0.02, 0.03):
        d = delays(noise, args.trials, rng, settle=int(86400 / ROUND_S))
        d0 = delays(noise, args.trials // 4, rng)
        iid = false_alarms(18 * gpus, ROUNDS_PER_YEAR, noise, 0.0, rng, check=4)
        ar = false_alarms(18 * gpus, ROUNDS_PER_YEAR, noise, 0.7, rng)
        lines.append(f"| {100 * noise:.1f}% | {np.median(d):.0f} / {np.percentile(d, 95):.0f} / "
                     f"{max(d)} | {np.median(d0):.0f} / {np.percentile(d0, 95):.0f} / "
                     f"{max(d0)} | {iid / gpus:.2f} | {ar / gpus:.2f} |")
    lines += ["", f"False alarms simulated over {gpus} GPU-years ({ROUNDS_PER_YEAR} rounds x 18 "
              f"tracks each); total time {time.perf_counter() - t0:.0f} s."]
    text = "\n".join(lines)
    print(text)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
