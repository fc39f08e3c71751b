"""Drift detection under real-world noise: the targets of issue 23, causes, and the cost.

    python bench/drift.py [--quick] [--gpus N] [--days D] [--markdown FILE]
    python bench/drift.py --measure-plan OUTDIR [--seconds S]   # on a GPU (nvidia backend)

1. Check: a vectorized fleet (gemmd.drift's own functions, on numpy arrays, as
   DriftMonitor.observe and its round close drive them: probe tracks, the pooled statistic,
   the slow level, the baseline check, the alarm's hold and reason, speed-ups) against
   DriftMonitor.observe itself, alarm for alarm, through a baseline step, slowdowns, an
   intermittent fault and a speed-up.
2. Targets (issue 23), on the default plan's number of sentinels: false alarms per GPU-year
   of a healthy GPU under each noise model (every alarm raised on any target counts, from
   the first round, baseline included; 95% upper bound), delays in rounds (120 s) with 95%
   confidence intervals (order statistics), shares with Wilson intervals.
   Noise models (built here, log units, per probe result): Gaussian ("iid"), Student-t
   with 3 degrees of freedom scaled to the same standard deviation, one-sided noise (a
   shifted exponential of that standard deviation: a GPU is only ever slowed), outliers
   (one result in 200 of a probe +10% or +30%: a neighbour's burst), AR(1) between
   rounds, a +-2% daily cycle common to the GPU's probes (temperature), a common share
   of the variance, and
   "measured H200": the shape measured on an H200 (bench/results/2026-11-26-h200: a tight
   core, +0.7-1% excursions on the power-capped bf16 probe, lag-1 autocorrelation), at
   the default window's measured spread (bench/results/2026-11-26-h200-plan). Runtime gets
   the model; power 1% iid (measured H200: its own); energy = runtime x power.
   The H200's real clock cap (issue 22: SM clocks -5.3% then -10.6%, 3 rounds each) is
   replayed from its archive through today's detector, as ``bench/gpu_accept.py --replay``
   does: on the default plan, and on all six probes of that run.
3. Causes: the fake backend's fault scenarios (thermal throttling, a lowered power limit,
   locked clocks, same clocks and less work, more power at the same runtime), measured by
   gemmd's protocol and judged by DriftMonitor with each probe's context.
4. Cost: GPU seconds per round of sentinel plans, from the per-probe cost measured on an
   H100 by window with this tree's protocol (``--measure-plan``), and the H100's default
   rounds measured whole, against detection delay and false alarms: with the H200's
   measured noise at that window, and at 2% noise.
5. Peers: a GPU 5% slower than its 7 siblings from its first probe.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import io
import logging
import math
import os
import statistics
import sys
import tarfile
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from call_overhead import check_costs  # noqa: E402

from gemmd.config import DriftConfig, MeasureConfig, ProbesConfig  # noqa: E402
from gemmd.drift import DriftMonitor  # noqa: E402
from gemmd.drift import device as DD  # noqa: E402
from gemmd.drift import params as DP  # noqa: E402
from gemmd.drift import series as DS  # noqa: E402
from gemmd.gemm import ProbeSpec  # noqa: E402

ROUND_S = 120.0
DAY = int(86400 / ROUND_S)
ROUNDS_PER_YEAR = 365 * DAY
P = DriftConfig()  # the shipped defaults
TARGETS = ("runtime", "power", "energy")
RESULTS = Path(__file__).resolve().parent / "results"
NOISE_TAR = RESULTS / "2026-11-26-h200" / "results.tar.gz"
# An H100 under today's default plan: 60 rounds 2 s apart, then the power limit cut 10% and
# 20%; and 20 rounds back to back, then the SM clocks capped 5% and 10% (the first run).
H100_TAR = RESULTS / "2026-11-26-h100-power" / "results.tar.gz"
H100_CLOCKS_TAR = RESULTS / "2026-11-26-h100" / "results.tar.gz"
PLAN_CSV = RESULTS / "2026-11-26-h200-plan" / "plan_cost.csv"
# What each probe costs under this tree's protocol (warm-up in two calls, windows on time):
# the H100's plan_cost.csv; the H200's above predates both and sets only its noise's spread.
COST_CSV = RESULTS / "2026-11-26-h100-power-plan" / "plan_cost.csv"
# Probes by preference: the default plan's first, then what a larger plan adds.
CANDIDATES = [ProbeSpec(8192, 8192, 8192, "fp32"), ProbeSpec(8192, 8192, 8192, "bf16"),
              ProbeSpec(4096, 4096, 4096, "fp32"), ProbeSpec(4096, 4096, 4096, "bf16"),
              ProbeSpec(1024, 1024, 1024, "fp32", "tiled", 32),
              ProbeSpec(1024, 1024, 1024, "fp32", "tiled", 16)]


def default_plan() -> list[ProbeSpec]:
    """The shipped sentinels on an NVIDIA GPU (gemmd.config.DEFAULT_SENTINELS)."""
    out: list[ProbeSpec] = []
    for g in ProbesConfig().sentinels:
        if g.backends and "nvidia" not in g.backends:
            continue
        for shape in g.shapes:
            for dtype in g.dtypes:
                for kernel in g.kernels:
                    for tile in (g.tiles if kernel == "tiled" else (0,)):
                        for layout in (g.layouts if kernel == "blas" else ("nn",)):
                            out.append(ProbeSpec(*shape, dtype, kernel, tile, layout))
    return out


# ---------------------------------------------------------------- noise


@dataclasses.dataclass
class Shape:
    """One probe's measured noise for one quantity: a Gaussian AR(1) core (sd, phi) and
    excursions at ``rate`` per result, their sizes resampled from those seen."""

    sd: float
    phi: float = 0.0
    rate: float = 0.0
    sizes: tuple[float, ...] = ()


@dataclasses.dataclass
class Noise:
    """Log-residual noise of a GPU's probes, per round: ``sigma`` (runtime sd), ``dist``
    normal, t3 or exp (one-sided: a shifted exponential; each scaled to sd ``sigma``),
    AR(1) ``phi`` between rounds, a ``common`` share of the variance shared by the GPU's
    probes, outliers (``out_rate`` per result of a probe, +``out_size``), a daily
    ``cycle`` of that amplitude common to the GPU's probes, ``power`` sd (iid); or
    ``measured``: per probe (runtime, power) shapes."""

    sigma: float = 0.01
    dist: str = "normal"
    phi: float = 0.0
    common: float = 0.0
    out_rate: float = 0.0
    out_size: float = 0.0
    cycle: float = 0.0
    power: float = 0.01
    measured: list[tuple[Shape, Shape]] | None = None
    name: str = ""

    def label(self) -> str:
        if self.name:
            return self.name
        out = f"{100 * self.sigma:g}%"
        out += ", t3" if self.dist == "t3" else ""
        out += ", one-sided (exponential)" if self.dist == "exp" else ""
        out += f", AR(1) {self.phi:g}" if self.phi else ""
        out += f", {self.common:.0%} common" if self.common else ""
        if self.out_rate:
            out += f", 1 in {1 / self.out_rate:.0f} at +{100 * math.expm1(self.out_size):.0f}%"
        out += f", +-{100 * self.cycle:g}% daily cycle" if self.cycle else ""
        return out


class Gen:
    """Residuals (G, 3, P) per round: runtime, power, energy (= runtime + power)."""

    def __init__(self, g: int, p: int, noise: Noise, rng: np.random.Generator):
        self.G, self.P, self.noise, self.rng = g, p, noise, rng
        self.f = rng.normal(0, 1, (g, 1))
        self.e = rng.normal(0, 1, (g, p))
        self.core = np.zeros((2, g, p))
        self.phase = rng.uniform(0, 2 * math.pi, (g, 1))
        self.t = 0

    def _base(self, shape: tuple[int, ...]) -> np.ndarray:
        if self.noise.dist == "t3":
            return self.rng.standard_t(3, shape) / math.sqrt(3)
        if self.noise.dist == "exp":  # one-sided: only ever slower than usual, sd 1
            return self.rng.exponential(1.0, shape) - 1.0
        return self.rng.normal(0, 1, shape)

    def draw(self) -> np.ndarray:
        n, g, p, rng = self.noise, self.G, self.P, self.rng
        if n.measured is not None:
            return self._measured()
        if n.phi:
            sd = math.sqrt(1 - n.phi ** 2)
            self.f = n.phi * self.f + sd * self._base((g, 1))
            self.e = n.phi * self.e + sd * self._base((g, p))
        else:
            self.f, self.e = self._base((g, 1)), self._base((g, p))
        r = n.sigma * (math.sqrt(n.common) * self.f + math.sqrt(1 - n.common) * self.e)
        if n.out_rate:
            r = r + n.out_size * (rng.random((g, p)) < n.out_rate)
        if n.cycle:
            r = r + n.cycle * np.sin(2 * math.pi * self.t / DAY + self.phase)
        self.t += 1
        pw = n.power * rng.normal(0, 1, (g, p))
        return np.stack([r, pw, r + pw], axis=1)

    def _measured(self) -> np.ndarray:
        assert self.noise.measured is not None
        g, p, rng = self.G, self.P, self.rng
        out = np.zeros((2, g, p))
        for j in range(p):
            for q, shape in enumerate(self.noise.measured[j % len(self.noise.measured)]):
                c = shape.phi * self.core[q, :, j] + shape.sd * math.sqrt(
                    1 - shape.phi ** 2) * rng.normal(0, 1, g)
                self.core[q, :, j] = c
                v = c.copy()
                if shape.rate and shape.sizes:
                    hit = rng.random(g) < shape.rate
                    size = np.array(shape.sizes)[rng.integers(0, len(shape.sizes), g)]
                    v += hit * size * rng.uniform(0.8, 1.25, g)
                out[q, :, j] = v
        self.t += 1
        return np.stack([out[0], out[1], out[0] + out[1]], axis=1)


def _tar_csv(path: Path, member: str) -> list[dict[str, str]]:
    with tarfile.open(path) as tf:
        f = tf.extractfile(member)
        assert f is not None
        return list(csv.DictReader(io.TextIOWrapper(f)))


def _shape(values: Sequence[float], floor_sd: float = 0.0) -> Shape:
    """A probe's noise shape from its measured values (log units around the median)."""
    x = np.log(np.asarray(values, float))
    x = x - np.median(x)
    rsd = max(1.4826 * float(np.median(np.abs(x))), 1e-5)
    out = np.abs(x) > 3.5 * rsd
    core = x[~out]
    phi = 0.0
    if len(core) > 3 and core.std() > 0:
        phi = float(np.clip(np.corrcoef(core[:-1], core[1:])[0, 1], 0.0, 0.6))
    sd = max(float(core.std(ddof=1)) if len(core) > 2 else rsd, rsd, floor_sd)
    return Shape(sd, phi, float(out.mean()), tuple(float(v) for v in x[out]))


def plan_costs(path: Path = PLAN_CSV) -> dict[tuple[str, float, float], dict[str, float]]:
    """Per (probe, window, warm-up): median elapsed device time, runtime and energy CV
    (``path``: a plan_cost.csv, by default the H200's), and the check's extra time, the
    same at every window (it compares the output with a reference, after the window):
    what a check costs once its dtype has been checked in the process
    (call_overhead.check_costs; the first check of a dtype pays once, +0.22 s on the
    H200)."""
    rows = list(csv.DictReader(open(path)))
    check, _ = check_costs(rows)
    by: dict[tuple[str, float, float], list[dict[str, str]]] = defaultdict(list)
    for r in rows:
        by[(r["probe"], float(r["window_cfg"]), float(r["warmup_cfg"]))].append(r)
    out = {}
    for key, rs in by.items():
        plain = [r for r in rs if r["check"] == "False"]

        def cv(col: str, rs: list[dict[str, str]] = plain) -> float:
            xs = [float(r[col]) for r in rs if r[col] not in ("", "None")]
            return statistics.pstdev(xs) / statistics.fmean(xs) if len(xs) > 1 else math.nan

        el = statistics.median(float(r["elapsed_s"]) for r in plain)
        steps = sum(r["energy_method"] == "steps" for r in plain) / len(plain)
        out[key] = {"elapsed": el, "runtime_cv": cv("runtime_s"), "energy_cv": cv("energy_j"),
                    "steps": steps, "check": 0.0 if math.isnan(check) else check,
                    "n": len(plain)}
    return out


def measured_h200(plan: Sequence[ProbeSpec], window: float) -> Noise:
    """The measured H200 noise of ``plan``'s probes: the shape (tails, autocorrelation) of
    20 rounds at 1 s windows (noise.csv), its spread at least the CV measured at
    ``window`` (plan_cost.csv, 6-7 repeats). The first run's tiled32 rows were tile 16's
    kernel: tiled32 takes tiled16's shape."""
    rows = _tar_csv(NOISE_TAR, "gpu_accept/noise.csv")
    costs = plan_costs()
    shapes = []
    for spec in plan:
        name = spec.name.replace("tiled32", "tiled16")
        rs = [r for r in rows if r["probe"] == name and r["outcome"] == "ok"]
        c = costs.get((spec.name, window, 0.02)) or costs.get((spec.name, window, 0.1)) or {}
        rt = _shape([float(r["runtime_s"]) for r in rs], c.get("runtime_cv", 0.0) or 0.0)
        pw = _shape([float(r["power_w"]) for r in rs], c.get("energy_cv", 0.0) or 0.0)
        shapes.append((rt, pw))
    return Noise(measured=shapes, name=f"measured H200 ({window:g} s window)")


def measured_h100(plan: Sequence[ProbeSpec]) -> Noise:
    """The measured H100 noise of ``plan``'s probes (the default sentinels): the shape
    (tails, autocorrelation) and spread of 60 rounds of 0.5 s windows, 2 s apart."""
    rows = _tar_csv(H100_TAR, "gpu_accept/noise.csv")
    shapes = []
    for spec in plan:
        rs = [r for r in rows if r["probe"] == spec.name and r["outcome"] == "ok"]
        if not rs:
            raise SystemExit(f"drift.py: {H100_TAR}: no rounds of {spec.name}")
        shapes.append((_shape([float(r["runtime_s"]) for r in rs]),
                       _shape([float(r["power_w"]) for r in rs])))
    return Noise(measured=shapes, name="measured H100 (0.5 s windows, 60 rounds 2 s apart)")


# ---------------------------------------------------------------- the fleet


class Fleet:
    """GPUs x targets x probes, driven by gemmd.drift's functions exactly as
    DriftMonitor.observe and its round close drive them."""

    def __init__(self, gpus: int, probes: int, noise: Noise, rng: np.random.Generator,
                 cfg: DriftConfig = P, targets: int = 3):
        self.G, self.T, self.P, self.cfg = gpus, targets, probes, cfg
        self.S = gpus * targets
        self.N = self.S * probes
        self.kappa = DS.allowance(cfg.shift, cfg.tolerance)
        self.kappa_fast = DD.fast_allowance(cfg.shift)
        self.tol = math.log1p(min(cfg.tolerance, cfg.shift))
        self.gen = Gen(gpus, probes, noise, rng)
        self.offset = np.zeros((gpus, targets, probes))
        self.ps: dict[str, np.ndarray] | None = None
        self.zs: dict[str, np.ndarray] | None = None
        self.dv = DD.new_device_state(self.S)
        self.base: list[np.ndarray] = []
        self.hits = np.zeros(self.S)
        self.cut = np.zeros(self.S, int)
        self.spd = np.zeros(self.N)
        self.rounds = 0

    def draw(self) -> np.ndarray:
        return self.gen.draw()[:, :self.T]

    def step(self, x: np.ndarray | None = None) -> np.ndarray:
        """One round; returns the device alarms raised, shaped (G, T)."""
        cfg, S, Pn, N = self.cfg, self.S, self.P, self.N
        xs = ((self.draw() if x is None else x) + self.offset).reshape(S, Pn)
        self.rounds += 1
        now = float(self.rounds)
        floor = cfg.min_scale
        if self.ps is None:
            self.base.append(xs)
            n = len(self.base)
            b = np.stack(self.base)
            if n >= DP.BASE_FIRST + 1:
                hit = DD.baseline_check(b, floor, self.kappa)
                self.hits = np.where(hit, self.hits + 1, 0.0)
                least = 1 if n >= cfg.baseline_probes else DP.BASE_HITS
                new = (self.hits >= least) & (self.cut == 0)
                self.cut = np.where(new, n - self.hits.astype(int), self.cut)
                up, _ = DD._alarm(self.dv, self.hits >= DP.BASE_HITS, np.full(S, DP.STEP), hit,
                                  hit, ~hit, now)
            else:
                up = np.zeros(S, bool)
            if n >= cfg.baseline_probes:
                cutp = np.repeat(self.cut, Pn)
                self.ps = DS.start(b.reshape(n, N), np.where(cutp > 0, cutp, n))
                u, g = DS.innovations(self.ps, b.reshape(n, N), floor)
                z, _ = DD.pool(u.reshape(n - 1, S, Pn), g.reshape(S, Pn), kappa=self.kappa_fast)
                self.zs = DS.start(z, np.where(self.cut > 1, self.cut - 1, n - 1))
                sc = DS.long_run_scales(self.ps, floor).reshape(S, Pn)
                devs = b - self.ps["reference"].reshape(S, Pn)
                ys, _ = DD.pooled_deviation(devs, sc[None])
                DD.warm_level(self.dv, ys)
                self.dv["young_thr"] = DD.young_threshold(b, self.cut, floor, self.kappa)
                self.dv["young"] = np.zeros(S)
                self.dv["hits"] = self.hits.copy()
            else:
                self.dv["hits"] = self.hits.copy()
            return up.reshape(self.G, self.T)
        ps, zs, dv = self.ps, self.zs, self.dv
        assert zs is not None
        settled = ~((zs["level_n"] >= DP.LEVEL_N) & (self.tol > 0) &
                    (np.abs(dv["level"]) - 2 * np.nan_to_num(dv["level_se"]) > self.tol / 2))
        calm = DS.in_control(zs) & ~dv["drifting"] & (dv["faster"] == 0) & settled
        rp = DS.step(ps, xs.reshape(N), gain=1.0, floor=floor, learn=np.repeat(calm, Pn),
                     shift=cfg.shift, arl0=cfg.arl0, now=now, kappa=self.kappa,
                     cap_h=DP.CAP_PROBE, learn_z=DP.LEARN_Z, tails=True)
        z, gz = DD.pool(ps["last_u"].reshape(S, Pn), ps["gain"].reshape(S, Pn),
                        kappa=self.kappa_fast)
        drift_p = ps["drifting"].reshape(S, Pn)
        calm2 = ~drift_p.any(axis=1) & ~dv["drifting"] & (dv["faster"] == 0) & settled
        how = DD.pooled_settings(zs["n"], dv["band"], gz, cfg.shift, cfg.tolerance)
        fast = DS.step(zs, z - how["offset"], gain=gz, floor=1.0, learn=calm2, shift=cfg.shift,
                       arl0=cfg.arl0, now=now, phi_z=how["phi_z"], learn_z=DP.DEVICE_LEARN_Z,
                       kappa=how["kappa"], cap_h=DP.CAP_POOLED, misfit_z=DP.MISFIT_Z, tails=True,
                       chi_z=how["chi_z"], level_z=how["level_z"])
        raw = ps["scale"]
        sc = np.maximum(np.where(np.isfinite(raw) & (raw > 0), raw, floor), floor).reshape(S, Pn)
        y, prior = DD.pooled_deviation(ps["prev"].reshape(S, Pn), sc)
        w = 1.0 / (sc * sc)
        lvar = sc * sc / np.maximum(ps["level_n"].reshape(S, Pn), 1.0)
        ref_var = (w * w * lvar).sum(axis=1) / w.sum(axis=1) ** 2
        alive = zs["drifting"] | (zs["cusum"] > np.nan_to_num(zs["h"], nan=np.inf) / 2)
        zsc = np.clip(np.nan_to_num(zs["scale"], nan=1.0), 1.0, math.sqrt(Pn))
        up, _, speed = DD.device_step(
            dv, y, prior * zsc, ref_var, fast_raised=fast, fast_alive=alive,
            probe_raised=rp.reshape(S, Pn).any(axis=1), probe_alive=drift_p.any(axis=1),
            kappa=self.kappa, tolerance=cfg.tolerance, now=now,
            moved=DD.together(ps["prev"].reshape(S, Pn)))
        self.spd = np.where(np.repeat(dv["faster"] > 0, Pn), self.spd + ps["prev"], 0.0)
        busy = (dv["drifting"] | ps["drifting"].reshape(S, Pn).any(axis=1)
                ).reshape(self.G, self.T).any(axis=1)
        go = speed & ~np.repeat(busy, self.T)
        if go.any():
            held = np.repeat(np.maximum(dv["faster"], 1.0), Pn)
            sh = np.minimum(self.spd / held, 0.0) * np.repeat(go, Pn)
            self.spd = np.where(np.repeat(go, Pn), 0.0, self.spd)
            for f in ("reference", "lx", "ly", "mx", "my", "last"):
                ps[f] = ps[f] + sh
            ps["prev"] = ps["prev"] - sh
            ps["slow"] = ps["slow"] - sh
            dv["level"] = np.where(go, 0.0, dv["level"])
            dv["band"] = np.where(go, 0.0, dv["band"])
            dv["faster"] = np.where(go, 0.0, dv["faster"])
        return up.reshape(self.G, self.T)

    def drifting(self) -> np.ndarray:
        """The GPUs' alarm per target, shaped (G, T)."""
        d = self.dv["drifting"].copy()
        if self.ps is not None:
            d |= self.ps["drifting"].reshape(self.S, self.P).any(axis=1)
        return d.reshape(self.G, self.T)

    def reason(self) -> np.ndarray:
        return self.dv["reason"].reshape(self.G, self.T)


# ---------------------------------------------------------------- statistics


def poisson_upper(k: int, level: float = 0.95) -> float:
    """Upper confidence bound of a Poisson mean after k events (by bisection on the CDF)."""
    lo, hi = float(k), 10.0 * k + 10.0
    for _ in range(100):
        mid = (lo + hi) / 2
        cdf = sum(math.exp(-mid + i * math.log(mid) - math.lgamma(i + 1)) for i in range(k + 1))
        lo, hi = (mid, hi) if cdf > 1 - level else (lo, mid)
    return hi


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    if n == 0:
        return (math.nan, math.nan)
    p = k / n
    d = 1 + z * z / n
    c = (p + z * z / (2 * n)) / d
    h = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return (max(0.0, c - h), min(1.0, c + h))


def quantile_ci(a: np.ndarray, q: float, z: float = 1.96) -> tuple[float, float, float]:
    """A percentile and its 95% confidence interval from order statistics (inf: beyond
    the rounds watched)."""
    a = np.sort(np.asarray(a, float))
    n = len(a)
    if not n:
        return (math.nan, math.nan, math.nan)
    k = q * n
    s = z * math.sqrt(n * q * (1 - q))
    lo, hi = int(max(math.floor(k - s), 0)), int(min(math.ceil(k + s), n - 1))
    return (float(np.percentile(a, 100 * q, method="inverted_cdf")), float(a[lo]), float(a[hi]))


def fmt_q(a: np.ndarray, q: float) -> str:
    v, lo, hi = quantile_ci(a, q)

    def f(x: float) -> str:
        return ">" if math.isinf(x) else f"{x:.0f}"

    return f"{f(v)} ({f(lo)}-{f(hi)})"


def rate(k: int, years: float) -> str:
    return f"{k / years:.2f} (<= {poisson_upper(k) / years:.2f})"


# ---------------------------------------------------------------- scenarios


def run_healthy(noise: Noise, gpus: int, days: float, probes: int, seed: int) -> dict:
    f = Fleet(gpus, probes, noise, np.random.default_rng(seed))
    rounds = int(days * DAY)
    k = 0
    for _ in range(rounds):
        k += int(f.step().sum())
    return {"k": k, "years": gpus * rounds / ROUNDS_PER_YEAR, "fleet": f}


def slow_all(f: Fleet, size: float, targets: Sequence[int] = (0, 2)) -> None:
    """Every probe slower by ``size`` (log) at the same power: runtime and energy move."""
    for t in targets:
        f.offset[:, t, :] += size


def delays(f: Fleet, rounds: int, fault: Callable[[Fleet, int], None] | None = None,
           target: int = 0) -> np.ndarray:
    """Rounds until the GPU's alarm on ``target`` (inf: not within ``rounds``), for the
    GPUs not in alarm when the fault starts; ``fault`` is applied before each round."""
    free = ~f.drifting()[:, target]
    out = np.full(f.G, np.inf)
    for i in range(rounds):
        if fault is not None:
            fault(f, i)
        f.step()
        now = f.drifting()[:, target] & np.isinf(out)
        out[now] = i + 1
    return out[free]


def warm(noise: Noise, gpus: int, probes: int, days: float, seed: int) -> Fleet:
    f = Fleet(gpus, probes, noise, np.random.default_rng(seed))
    for _ in range(int(days * DAY)):
        f.step()
    return f


def step_at(start: int, gpus: int, probes: int, noise: Noise, seed: int, watch: int = 40,
            size: float = math.log(1.2)) -> np.ndarray:
    """A step of ``size`` on every probe from round ``start`` (1 = the first round)."""
    f = Fleet(gpus, probes, noise, np.random.default_rng(seed))
    for _ in range(start - 1):
        f.step()
    free = ~f.drifting()[:, 0]
    slow_all(f, size)
    out = np.full(gpus, np.inf)
    for i in range(watch):
        f.step()
        now = f.drifting()[:, 0] & np.isinf(out)
        out[now] = i + 1
    return out[free]


def intermittent(noise: Noise, gpus: int, probes: int, seed: int, share: float = 0.3,
                 size: float = math.log(1.1), days: float = 1.0) -> dict:
    """After a day, ``share`` of the rounds ``size`` slower on every probe, for ``days``:
    alarms raised per GPU-day, and the reason at the end."""
    f = warm(noise, gpus, probes, 1.0, seed)
    rng = np.random.default_rng(seed + 7)
    raises = 0
    for _ in range(int(days * DAY)):
        slow = rng.random(gpus) < share
        f.offset[:] = 0.0
        f.offset[slow, 0, :] = size
        f.offset[slow, 2, :] = size
        raises += int(f.step()[:, 0].sum())
    on = f.drifting()[:, 0]
    inter = f.reason()[:, 0] == DP.INTERMITTENT
    return {"raises": raises, "gpu_days": gpus * days, "on": int(on.sum()),
            "inter": int((on & inter).sum()), "n": gpus}


def ramp(noise: Noise, gpus: int, probes: int, seed: int, per_week: float = 0.05) -> np.ndarray:
    """After a day, every probe slower by ``per_week`` a week, linearly: the slowdown when
    the GPU's runtime alarm comes (inf: not within two weeks)."""
    f = warm(noise, gpus, probes, 1.0, seed)
    free = ~f.drifting()[:, 0]
    per_round = math.log1p(per_week) / (7 * DAY)
    at = np.full(gpus, np.inf)
    for i in range(14 * DAY):
        f.offset[:, 0, :] = f.offset[:, 2, :] = per_round * (i + 1)
        f.step()
        now = f.drifting()[:, 0] & np.isinf(at)
        at[now] = math.expm1(per_round * (i + 1))
        if not np.isinf(at[free]).any():
            break
    return at[free]


def speedup_then_slow(noise: Noise, gpus: int, probes: int, seed: int, speed: float
                      ) -> np.ndarray:
    """After a day, ``speed`` faster (no rebaseline); a day later 5% slower than that."""
    f = warm(noise, gpus, probes, 1.0, seed)
    slow_all(f, math.log1p(-speed))
    for _ in range(DAY):
        f.step()
    slow_all(f, math.log(1.05))
    return delays(f, 60)


# ---------------------------------------------------------------- 1. check


def check_against_monitor(probes: int, seed: int = 7, gpus: int = 3) -> int:
    """The same residuals through Fleet and DriftMonitor.observe: alarm for alarm (device
    alarms and probes' own), through a step during the baseline, a 5% slowdown, its end,
    an intermittent fault and a speed-up."""
    rng = np.random.default_rng(seed)
    plan = CANDIDATES[:probes]
    fleet = Fleet(gpus, probes, Noise(0.02, phi=0.3), rng)
    mon = DriftMonitor(P)
    seen = 0
    script = np.zeros((700, gpus, 3))
    script[6:, 0, :] = math.log(1.2)  # GPU 0: 20% slower from its 6th round
    script[200:300, 1, :] = math.log(1.05)  # GPU 1: 5% slower for 100 rounds
    coin = np.random.default_rng(seed + 1).random(700) < 0.3
    script[350:500, 1, :] += np.where(coin[350:500, None], math.log(1.1), 0.0)
    script[150:, 2, :] = math.log(0.92)  # GPU 2: 8% faster, then 5% slower than that
    script[450:, 2, :] += math.log(1.05)
    script[:, :, 1] = 0.0  # power unchanged
    script[:, :, 2] = script[:, :, 0]
    for i in range(700):
        x = fleet.draw() + script[i][:, :, None]
        r = np.vectorize(lambda v: math.log(math.exp(v)))(x)
        fleet.offset[:] = 0.0
        up = fleet.step(r)
        rp = fleet.ps["drifting"].copy() if fleet.ps is not None else None
        got_dev: set[tuple[int, str]] = set()
        got_probe: set[tuple[int, str]] = set()
        for g in range(gpus):
            for pi, spec in enumerate(plan):
                meas = {t: math.exp(r[g, ti, pi]) for ti, t in enumerate(TARGETS)}
                for a in mon.observe(f"GPU-{g}", spec, meas, dict.fromkeys(TARGETS, 1.0), {},
                                     now=float(i + 1), gpu_model="H100", plan=plan):
                    (got_dev if a.spec is None else got_probe).add((g, a.target))
        want_dev = {(g, TARGETS[t]) for g in range(gpus) for t in range(3) if up[g, t]}
        assert got_dev == want_dev, (i, got_dev, want_dev)
        for g in range(gpus):
            for ti, t in enumerate(TARGETS):
                dd = mon.devices[f"GPU-{g}"].targets[t]
                assert dd.drifting == bool(fleet.dv["drifting"][g * 3 + ti]), (i, g, t)
                if rp is not None:
                    for pi, spec in enumerate(plan):
                        tr = mon.tracks[(f"GPU-{g}", spec, t)]
                        assert tr.drifting == bool(rp[(g * 3 + ti) * probes + pi]), (i, g, t, pi)
        seen += len(got_dev) + len(got_probe)
    assert seen, "the check saw no alarm at all"
    return seen


# ---------------------------------------------------------------- 3. causes


def causes(seeds: int, window: float) -> list[dict]:
    """Each fake fault scenario, measured by gemmd's protocol on a fake H100 and judged
    by DriftMonitor with the probes' context: the cause named when the alarm came."""
    from gemmd.config import FakeDeviceConfig
    from gemmd.devices.base import measure
    from gemmd.devices.fake import FakeDevice, Scenario
    from gemmd.drift import measured_of, stand_in

    logging.getLogger("gemmd.drift").setLevel(logging.ERROR)
    plan = default_plan()
    cfg = MeasureConfig(window_s=window, warmup_s=0.02)
    cases = [("thermal throttling, clocks -5%", Scenario("thermal", 1.05), "runtime",
              "clocks_thermal"),
             ("power limit lowered to 85%", Scenario("power_cap", 0.85), "runtime",
              "power_limit"),
             ("SM clocks locked 5% lower (as on the H200)", Scenario("clock_cap", 1.05),
              "runtime", "clocks_other"),
             ("5% slower at the same clocks", Scenario("less_work", 1.05), "runtime",
              "same_clocks"),
             ("6% more power at the same runtime", Scenario("power", 1.06), "power",
              "same_clocks_power")]
    out = []
    for label, sc, target, want in cases:
        right = 0
        delays_: list[float] = []
        got: defaultdict[str, int] = defaultdict(int)
        for seed in range(seeds):
            dev = FakeDevice(0, FakeDeviceConfig(), seed=seed, jitter=0.003)
            mon = DriftMonitor(P)
            t = 0.0
            pred = {}
            for s in plan:  # a stand-in model: the first healthy result of each probe
                m = measure(dev, s, cfg)
                pred[s] = stand_in({"runtime": m.runtime_s}, dev.info.power_limit_w)
            hit = None
            for i in range(80):
                if i == 40:
                    dev.scenario = sc
                for s in plan:
                    m = measure(dev, s, cfg)
                    t += ROUND_S / len(plan)
                    mon.observe(dev.info.uuid, s, measured_of(m), pred[s], {}, now=t,
                                gpu_model=dev.info.name, plan=plan,
                                context=m.context.get("after"))
                ds = mon.devices[dev.info.uuid].targets[target]
                if i >= 40 and ds.drifting:
                    hit = (i - 39, ds.cause)
                    break
            if hit is not None:
                delays_.append(hit[0])
                got[hit[1]] += 1
                right += hit[1] == want
        out.append({"label": label, "target": target, "want": want, "right": right,
                    "n": seeds, "got": dict(got), "delay": np.array(delays_ or [np.inf])})
    return out


# ---------------------------------------------------------------- the real slowdown


def replay(probes: Sequence[str] = (), archive: Path = NOISE_TAR) -> dict[str, str]:
    """A GPU run's real slowdown (``archive``; by default the H200's clock cap,
    bench/results/2026-11-26-h200, issue 22: SM clocks 5.3% then 10.6% lower, 3 rounds
    each) through today's detector, offline, exactly as ``bench/gpu_accept.py --replay``
    does (``probes``: only these; all of that run's otherwise): its figures, by name."""
    import contextlib

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import gpu_accept

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        gpu_accept.replay_archive(archive, list(probes))
    out = {}
    for line in buf.getvalue().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[0] and cells[0] not in ("figure", "---"):
            out[cells[0]] = cells[1]
    return out


# ---------------------------------------------------------------- 4. cost


def plan_cost(specs: Sequence[ProbeSpec], window: float, costs: dict, check_every: int = 10
              ) -> float | None:
    """GPU seconds per round: each probe's measured elapsed time at ``window`` (warm-up
    0.02 s), plus its correctness check (every ``check_every``-th probe)."""
    total = 0.0
    for s in specs:
        c = costs.get((s.name, window, 0.02)) or costs.get((s.name, window, 0.1))
        if c is None:
            return None
        total += c["elapsed"] + max(c["check"], 0.0) / check_every
    return total


def exploration_cost(window: float, costs: dict) -> float | None:
    """GPU seconds a round spends on the shipped exploration probes on an NVIDIA GPU:
    per_round / every_rounds probes, each at the median elapsed time of the measured
    sentinels at ``window`` (a probe's time is its window and what surrounds it, whatever
    its shape, as plan_cost.csv shows for 1024^3 to 8192^3)."""
    per = [c["elapsed"] for (_, w, wu), c in costs.items() if w == window and wu == 0.02]
    if not per:
        return None
    share = sum(g.per_round / g.every_rounds for g in ProbesConfig().exploration
                if not g.backends or "nvidia" in g.backends)
    return share * statistics.median(per)


# ---------------------------------------------------------------- 5. peers


def peers(hosts: int, rounds: int, seed: int, noise: float = 0.02, spread: float = 0.01
          ) -> dict:
    logging.getLogger("gemmd.drift").setLevel(logging.ERROR)
    rng = np.random.default_rng(seed)
    plan = default_plan()
    flagged_at, healthy_flagged = [], 0
    for h in range(hosts):
        mon = DriftMonitor(dataclasses.replace(P, targets=("runtime",)))
        normal = rng.normal(0, spread, 8)
        normal[0] = np.median(normal[1:]) + math.log(1.05)
        first: dict[int, int] = {}
        for i in range(rounds):
            for g in range(8):
                for spec, v in zip(plan, normal[g] + rng.normal(0, noise, len(plan))):
                    mon.observe(f"{h}-{g}", spec, {"runtime": math.exp(v)}, {"runtime": 1.0},
                                {}, now=i * ROUND_S, gpu_model="H100", plan=plan)
                if mon.devices[f"{h}-{g}"].targets["runtime"].slower:
                    first.setdefault(g, i + 1)
        flagged_at.append(first.get(0, math.inf))
        healthy_flagged += len([g for g in first if g])
    return {"at": np.array(flagged_at), "healthy": healthy_flagged, "healthy_n": hosts * 7}


# ---------------------------------------------------------------- --measure-plan


def measure_plan(out: Path, seconds: float) -> int:
    """On a GPU: each candidate sentinel at windows 0.1-1 s and warm-ups 0.02 / 0.1 s,
    repeated (idle 2 s between rounds) until ``seconds`` pass: elapsed device time and
    its phases (buffers, warm-up, before and after the window, the check), the runtime,
    power and energy of each measurement (plan_cost.csv)."""
    from gemmd.config import Config
    from gemmd.devices import open_devices
    from gemmd.devices.base import measure

    deadline = time.monotonic() + seconds
    cfg = dataclasses.replace(Config(), backend=os.environ.get("BACKEND", "nvidia"),
                              isolation="thread")
    devs = open_devices(cfg)
    dev = devs[0]
    specs = CANDIDATES[:5]
    configs = [(0.1, 0.02), (0.25, 0.02), (0.5, 0.02), (0.25, 0.1), (1.0, 0.1)]
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.monotonic()
    with open(out / "plan_cost.csv", "w", newline="") as f:
        w: Any = None
        for s in specs:  # buffers, graphs and the check's first use, not timed as a probe
            measure(dev, s, MeasureConfig(window_s=0.05, warmup_s=0.02), check=True)
        rep = 0
        while time.monotonic() < deadline:
            time.sleep(2.0)
            for order, (win, wu) in enumerate(configs):
                if win >= 1.0 and rep >= 2:
                    continue
                for s in specs:
                    if time.monotonic() > deadline:
                        break
                    check = rep in (1, 2) and win == 0.25 and wu == 0.02
                    t0 = time.monotonic()
                    m = measure(dev, s, MeasureConfig(window_s=win, warmup_s=wu), check=check)
                    a = m.context.get("after") or {}
                    row = {"rep": rep, "order": order, "probe": s.name, "window_cfg": win,
                           "warmup_cfg": wu, "check": check, "elapsed_s": m.elapsed_s,
                           "host_s": time.monotonic() - t0, "window_s": m.window_s,
                           "iterations": m.iterations, "runtime_s": m.runtime_s,
                           "runtime_cv": m.runtime_cv, "power_w": m.power_w,
                           "energy_j": m.energy_j, "energy_method": a.get("energy_method"),
                           "sm_clock_hz": a.get("sm_clock_hz"),
                           "temperature_c": a.get("temperature_c"),
                           "clock_event_reasons": "|".join(a.get("clock_event_reasons") or []),
                           "power_limit_w": a.get("power_limit_w"),
                           # where the time beyond the window went (the plan's overhead)
                           **{f"phase_{k}": v for k, v in
                              (m.context.get("phases") or {}).items()},
                           "t": time.monotonic() - t_start}
                    if w is None:
                        w = csv.DictWriter(f, fieldnames=list(row))
                        w.writeheader()
                    w.writerow(row)
                    f.flush()
            print("rep", rep, "done at", round(time.monotonic() - t_start, 1), "s", flush=True)
            rep += 1
    for d in devs:
        d.close()
    return 0


# ---------------------------------------------------------------- a young GPU


def young(gpus: int) -> list[str]:
    """``--young``: a 5% step on every probe from round s of a GPU's life, caught within a
    day, under each noise (docs/drift.md, "Weak, and why: a GPU's first hours")."""
    plan = default_plan()
    noises = [measured_h200(plan, MeasureConfig().window_s), measured_h100(plan),
              Noise(0.005), Noise(0.01), Noise(0.02)]
    starts = (12, 30, 60, 100)
    lines = [f"A 5% step on every probe from round s, caught within a day ({gpus} GPUs, the "
             "default plan): share caught, p50 rounds from the step.", "",
             "| noise | " + " | ".join(f"s = {s}" for s in starts) + " |",
             "|---|" + "---|" * len(starts)]
    for j, noise in enumerate(noises):
        cells = []
        for s in starts:
            d = step_at(s, gpus, len(plan), noise, seed=600 + 10 * j + s, watch=DAY,
                        size=math.log(1.05))
            k = int(np.isfinite(d).sum())
            cells.append(f"{100 * k / len(d):.0f}%, p50 {fmt_q(d, 0.5)}" if len(d) else "-")
        lines.append(f"| {noise.label()} | " + " | ".join(cells) + " |")
        print(lines[-1], flush=True)
    return lines


# ---------------------------------------------------------------- report


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", type=int, default=500, help="simulated GPUs per noise case")
    ap.add_argument("--days", type=float, default=3.0, help="healthy days per GPU")
    ap.add_argument("--quick", action="store_true", help="fewer GPUs and days (a smoke run)")
    ap.add_argument("--markdown", help="write the figures as Markdown here")
    ap.add_argument("--measure-plan", metavar="OUTDIR",
                    help="on a GPU: measure the cost of short windows (plan_cost.csv)")
    ap.add_argument("--seconds", type=float, default=105.0)
    ap.add_argument("--young", action="store_true",
                    help="only the table of a 5%% step in a GPU's first hours")
    args = ap.parse_args()
    if args.measure_plan:
        return measure_plan(Path(args.measure_plan), args.seconds)
    if args.young:
        logging.getLogger("gemmd.drift").setLevel(logging.ERROR)
        out = young(60 if args.quick else 200)
        if args.markdown:
            Path(args.markdown).write_text("\n".join(out) + "\n")
        return 0
    if args.quick:
        args.gpus, args.days = 60, 1.0
    logging.getLogger("gemmd.drift").setLevel(logging.ERROR)
    t0 = time.perf_counter()
    plan = default_plan()
    window = MeasureConfig().window_s
    nP = len(plan)
    G, days = args.gpus, args.days
    dG = max(G // 2, 60)
    lines = [f"Defaults: shift {P.shift}, tolerance {P.tolerance}, arl0 {P.arl0:g}, "
             f"baseline_probes {P.baseline_probes}, min_scale {P.min_scale}; default plan "
             f"{', '.join(s.name for s in plan)}, window {window:g} s; rounds every "
             f"{ROUND_S:.0f} s.", ""]
    seen = check_against_monitor(nP)
    lines += [f"Check: the vectorized fleet and DriftMonitor.observe agreed alarm for alarm "
              f"(3 GPUs x 3 targets x {nP} probes, 700 rounds: a step in the baseline, a "
              f"slowdown and its end, an intermittent fault, a speed-up then a slowdown; "
              f"{seen} alarms).", ""]
    print(lines[-2], flush=True)
    rows: list[tuple[str, str, str, str]] = []

    def add(case: str, value: str, target: str, met: bool | None) -> None:
        rows.append((case, value, target, "yes" if met else ("-" if met is None else "**NO**")))
        print(" | ".join(rows[-1]), flush=True)

    h200 = measured_h200(plan, window)
    healthy = [Noise(s) for s in (0.005, 0.01, 0.02, 0.03, 0.05)]
    healthy += [Noise(s, "t3") for s in (0.01, 0.02, 0.03)]
    healthy += [Noise(0.01, out_rate=1 / 200, out_size=math.log(1.1)),
                Noise(0.01, out_rate=1 / 200, out_size=math.log(1.3))]
    healthy += [Noise(s, phi=phi) for phi in (0.5, 0.8, 0.95) for s in (0.01, 0.02)]
    healthy += [Noise(s, cycle=0.02) for s in (0.01, 0.02)]
    healthy += [Noise(0.02, common=0.7), Noise(0.05, common=0.7), h200]
    healthy += [Noise(s, "exp") for s in (0.01, 0.02, 0.03)]  # last: the seeds above stay
    healthy += [measured_h100(plan)]
    total_k, total_y = 0, 0.0
    for i, noise in enumerate(healthy):
        r = run_healthy(noise, G, days, nP, seed=100 + i)
        total_k, total_y = total_k + r["k"], total_y + r["years"]
        up = poisson_upper(r["k"]) / r["years"]
        add(f"healthy, {noise.label()}", rate(r["k"], r["years"]), "<= 1 per GPU-year",
            r["k"] / r["years"] <= 1 and up <= 3)
    lines += [f"False alarms: {G} GPUs x {days:g} days per noise model "
              f"({G * days / 365:.1f} GPU-years each, {total_y:.0f} in all: {total_k} alarms), "
              "every alarm raised on any target (runtime, power, energy), from the first "
              "round. In brackets: the 95% upper bound.", ""]

    for noise in (Noise(0.02), Noise(0.02, "t3")):
        d = delays(warm(noise, dG, nP, 1.0, seed=300), 60,
                   lambda f, i: slow_all(f, math.log(1.05)) if i == 0 else None)
        p50, p90 = quantile_ci(d, 0.5)[0], quantile_ci(d, 0.9)[0]
        add(f"5% slowdown on every probe, {noise.label()}", f"p50 {fmt_q(d, 0.5)}, p90 "
            f"{fmt_q(d, 0.9)} rounds", "p50 <= 3, p90 <= 6", p50 <= 3 and p90 <= 6)
    d = delays(warm(Noise(0.02), dG, nP, 1.0, seed=301), DAY,
               lambda f, i: slow_all(f, math.log(1.03)) if i == 0 else None)
    k = int(np.isfinite(d).sum())
    lo, hi = wilson(k, len(d))
    add("3% slowdown, 2% noise", f"{100 * k / len(d):.1f}% within a day ({100 * lo:.1f}-"
        f"{100 * hi:.1f}%), p50 {fmt_q(d, 0.5)} rounds", ">= 95% within a day",
        k / len(d) >= 0.95)
    at = ramp(Noise(0.02), dG, nP, seed=302)
    k = int((at < 0.03).sum())
    lo, hi = wilson(k, len(at))
    add("5%-per-week ramp, 2% noise", f"caught at {100 * np.median(at):.2f}% (p50), max "
        f"{100 * at.max():.2f}%; before 3% on {k}/{len(at)} ({100 * lo:.0f}-{100 * hi:.0f}%)",
        "caught before 3%", k == len(at))
    later = step_at(3 * DAY, dG, nP, Noise(0.02), seed=303)
    worst, worst_at = -math.inf, 0
    for s in list(range(4, P.baseline_probes + 6)) + [20, 40]:
        d = step_at(s, dG, nP, Noise(0.02), seed=310 + s)
        gap = quantile_ci(d, 0.9)[0] - quantile_ci(later, 0.9)[0]
        if gap > worst:
            worst, worst_at = gap, s
    add("20% step from round 4 to 15, 20, 40 (2% noise)", f"p90 at most {worst:+.0f} rounds "
        f"against later in life (worst: from round {worst_at}); later in life p50 "
        f"{fmt_q(later, 0.5)}, p90 {fmt_q(later, 0.9)}", "within 3 rounds of later in life",
        worst <= 3)
    base = delays(warm(Noise(0.02), dG, nP, 2.0, seed=320), 60,
                  lambda f, i: slow_all(f, math.log(1.05)) if i == 0 else None)
    for sp in (0.04, 0.08):
        d = speedup_then_slow(Noise(0.02), dG, nP, seed=321 + int(100 * sp), speed=sp)
        ok = quantile_ci(d, 0.5)[0] <= quantile_ci(base, 0.5)[0] + 1 and np.isfinite(d).all()
        add(f"{100 * sp:.0f}% speed-up, a day later 5% slowdown (2% noise)",
            f"p50 {fmt_q(d, 0.5)}, p90 {fmt_q(d, 0.9)}, caught {np.isfinite(d).sum()}/"
            f"{len(d)}; without the speed-up p50 {fmt_q(base, 0.5)}",
            "caught as without the speed-up", ok)
    r = intermittent(Noise(0.02), dG, nP, seed=330)
    per = r["raises"] / r["gpu_days"]
    add("intermittent: 10% slower in 30% of rounds (2% noise)",
        f"{per:.2f} raises per GPU-day (<= {poisson_upper(r['raises']) / r['gpu_days']:.2f}); "
        f"in alarm at the day's end {r['on']}/{r['n']}, reason intermittent {r['inter']}/"
        f"{r['n']}", "<= 1 raise per GPU-day, one alarm that stays, reason intermittent",
        per <= 1 and r["inter"] == r["n"])

    cs = causes(5 if args.quick else 20, window)
    right = sum(c["right"] for c in cs)
    n = sum(c["n"] for c in cs)
    add("cause named on the fake scenarios", f"{right}/{n} right (" + "; ".join(
        f"{c['label']}: {c['right']}/{c['n']} {c['want']}, alarm after "
        f"{fmt_q(c['delay'], 0.5)} rounds" for c in cs) + ")", "right in every case",
        right == n)

    default = [s.name for s in plan]
    h200_cap = "a real clock cap on an H200, SM clocks -5.3% (replayed)"
    for label, names, archive, lever in (
            (f"{h200_cap}, the default plan", default, NOISE_TAR, "clock"),
            (f"{h200_cap}, all 6 probes of that run", [], NOISE_TAR, "clock"),
            ("a real clock cap on an H100, SM clocks -5.3% (replayed)", default,
             H100_CLOCKS_TAR, "clock"),
            ("a real power-limit cut on an H100, 700 -> 630 W (replayed)", default,
             H100_TAR, "power limit")):
        fig = replay(names, archive)
        at = next((v for k, v in fig.items()
                   if k.startswith("rounds until the device alarm at ")), "none")
        cause = fig.get("the cause the alarm names", "-")
        add(label, f"device alarm in round {at} of 3; cause: {cause}; false alarms before "
            f"it: {fig.get('false alarms over the stock rounds (after the baseline)', '?')}",
            "alarm within 3 rounds, cause named", at.isdigit() and int(at) <= 3 and
            lever in cause)
    rc = _tar_csv(H100_TAR, "gpu_accept/round_cost.csv")[0]
    add("cost of the default plan (H100, 60 whole rounds measured)",
        f"{float(rc['time_s']):.2f} GPU s per round ({100 * float(rc['duty_cycle']):.2f}%), "
        "before the check and exploration", "<= 1% (1.2 s)", float(rc["time_s"]) <= 1.2)

    costs = plan_costs(COST_CSV)
    cost = plan_cost(plan, window, costs)
    add("cost of the default plan (H100, measured per probe, the check every 10th)",
        f"{cost:.2f} GPU s per {ROUND_S:.0f} s round ({100 * cost / ROUND_S:.2f}%)"
        if cost else "not measured at this window", "<= 1% (1.2 s)",
        cost is not None and cost <= 1.2)
    explore = exploration_cost(window, costs)
    whole = cost + explore if cost is not None and explore is not None else None
    add("... with the default exploration (a random shape; its share of a round)",
        f"{whole:.2f} GPU s per round ({100 * whole / ROUND_S:.2f}%; exploration "
        f"{explore:.3f} s)" if whole is not None else "not measured at this window",
        "<= 1% (1.2 s)", whole is not None and whole <= 1.2)
    lines += ["| case | measured (95% CI) | target | met |", "|---|---|---|---|"]
    lines += [f"| {a} | {b} | {c} | {m} |" for a, b, c, m in rows]
    lines += ["", "Delays in rounds from the first slow round (after a day of healthy rounds "
              "unless said); p50 and p90 with their 95% confidence intervals. '>': not within "
              "the rounds watched.", ""]

    # The trade-off curve.
    lines += ["| plan (probes x window) | GPU s per round (H100) | duty | runtime / energy CV "
              "(measured) | 5% runtime: p50 / p90 | 5% power: p50 / p90 | 2% noise, 5% "
              "runtime: p50 / p90 | false alarms, measured noise |",
              "|---|---|---|---|---|---|---|---|"]
    h200_costs = plan_costs()  # the spread of the noise the curve's plans are judged under
    curve = [(1, 0.5), (1, 1.0), (2, 0.25), (2, 0.5), (2, 1.0), (3, 0.5), (4, 0.5), (5, 1.0)]
    for j, (k_, w_) in enumerate(curve):
        specs = CANDIDATES[:k_]
        c = plan_cost(specs, w_, costs)
        if c is None:
            continue
        noise = measured_h200(specs, w_)
        cvs = [h200_costs.get((s.name, w_, 0.02)) or h200_costs.get((s.name, w_, 0.1)) or {}
               for s in specs]
        rt = max(x.get("runtime_cv", math.nan) for x in cvs)
        en = max(x.get("energy_cv", math.nan) for x in cvs)
        g_ = max(G // 5, 60)
        f = warm(noise, g_, k_, 1.0, seed=400 + j)
        d_rt = delays(f, 30, lambda f, i: slow_all(f, math.log(1.05)) if i == 0 else None)
        f = warm(noise, g_, k_, 1.0, seed=420 + j)
        d_pw = delays(f, 30, lambda f, i: slow_all(f, math.log(1.05), (1, 2)) if i == 0
                      else None, target=1)
        f = warm(Noise(0.02), g_, k_, 1.0, seed=440 + j)
        d_2 = delays(f, 30, lambda f, i: slow_all(f, math.log(1.05)) if i == 0 else None)
        hr = run_healthy(noise, g_, 1.0, k_, seed=460 + j)
        lines.append(
            f"| {k_} x {w_:g} s | {c:.2f} | {100 * c / ROUND_S:.2f}% | {100 * rt:.2f}% / "
            f"{100 * en:.1f}% | {fmt_q(d_rt, 0.5)} / {fmt_q(d_rt, 0.9)} | {fmt_q(d_pw, 0.5)} / "
            f"{fmt_q(d_pw, 0.9)} | {fmt_q(d_2, 0.5)} / {fmt_q(d_2, 0.9)} | "
            f"{rate(hr['k'], hr['years'])} |")
        print(lines[-1], flush=True)
    lines += ["", "Plans take the probes in this order: " + ", ".join(
        s.name for s in CANDIDATES[:5]) + ". GPU seconds: the median elapsed device time "
        "per probe measured on the H100 at that window with this protocol (warm-up 0.02 s; "
        "1 s: 0.1 s; bench/results/2026-11-26-h100-power-plan), with the correctness check "
        "every 10th probe (what a check of a dtype checked before cost there; the first of "
        "each dtype is paid once); the old default (6 x 1 s) measured 8.45 s a round on the "
        "H200. Runtime and energy CV and noise: 'measured H200' at that window. "
        "5% power: every probe's power (and energy) 5% higher at the same runtime.", ""]

    pr = peers(hosts=30 if not args.quick else 5, rounds=20, seed=500)
    at = pr["at"]
    lines += [f"Peers (2% noise, {nP} probes, 8 GPUs per host whose normals differ by 1%, "
              f"GPU 0 5% slower than its siblings' median from its first probe; {len(at)} "
              f"hosts, 20 rounds): flagged after {fmt_q(at, 0.5)} (p50) rounds, on "
              f"{int(np.isfinite(at).sum())} of {len(at)} hosts within the 20 rounds; "
              f"healthy siblings "
              f"flagged: {pr['healthy']} of {pr['healthy_n']}.", ""]
    lines += [f"Total time {time.perf_counter() - t0:.0f} s."]
    text = "\n".join(lines)
    print(text)
    if args.markdown:
        Path(args.markdown).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
