"""Drift detection per device: each probe's own track, the device's pooled evidence, its
slow level, one alarm per device and target that names its cause, and peers.

Full arithmetic, parameters and benchmark figures: docs/drift.md. In short:

residual  r = log(measured / predicted), per probe result and target (runtime, power,
              energy). A card's steady offset from the model is not drift: each track
              learns its own level (the reference, exported as a ratio). Where the model
              predicts no power or energy yet, the caller passes a stand-in (the power
              limit): sentinels are compared with their own history, so drift arms after
              its baseline rounds, model or not.
series    every track is a series with its own AR(1) model, fitted while in control:
              r_t - L = phi (r_{t-1} - L) + e_t. The CUSUM runs on the standardized
              innovations u = e / sigma_e (pre-whitening). A sustained shift d moves u by
              d (1 - phi) / sigma_e per result (the first by d / sigma_e).
learning  level, phi and sigma_e are learnt only while in control (no alarm, the series'
              and its device's CUSUMs low, the device's slow level within half the
              tolerance) and only from results within LEARN_Z scales of their prediction
              (a symmetric cut: unbiased; the first result of a large step is never
              learnt). The level is the mean of the values learnt over the first LEVEL_N,
              then frozen, so a slow degradation is not absorbed; the noise keeps adapting
              (memory NOISE_N). sigma_e is taken at its 99% chi-square bound, times
              (1 - phi) / (1 - phi_hi) for an autocorrelation PHI_Z standard errors above
              its estimate, times its misfit (innovations that wander together: noise an
              AR(1) does not describe) and its tail factor (heavier tails than Gaussian);
              the allowance is raised by LEVEL_Z standard errors of the level.
CUSUM     S = max(0, S + min(u', k + c h) - k), k the steady response to the allowance
              kappa = (shift + tolerance) / 2 on a probe's track (half ``shift`` without a
              tolerance): a wiggle of the tolerated amplitude drains it instead of filling
              it. h from ``arl0`` by Siegmund's approximation. Bounded influence: one result
              adds at most c h (c = 0.35 on a probe's track: three results, however far
              off, are needed from S = 0; 0.49 on the pooled statistic: three rounds).
device    per device and target, once per round: the pooled statistic
              Z = sum_i g_i u_i / sqrt(sum_i g_i^2), a series of its own with a CUSUM (the
              fast detector, for shifts of ``shift``), judged against the device's band (a
              fast EWMA of its rounds, used within +-``tolerance``: a slow wiggle such as a
              daily cycle is followed, not allowed for) with half the shift as allowance,
              once it has learnt DEVICE_YOUNG_N results (before: as a probe's track); the
              round's deviation y (log units:
              the probes' deviations from their references, weighted by their noise, each
              clipped to 3 scales around their median) and its slow level m, an EWMA with a
              half-life of SLOW_HALF rounds: beyond ``tolerance`` at SLOW_Z standard errors
              it is an alarm (a small shift, a ramp); below -tolerance it is a speed-up,
              reported and, after SPEEDUP_ROUNDS rounds, taken as the new normal.
alarm     a device and target is in alarm from the first trigger (its pooled CUSUM, a
              probe's own CUSUM, its slow level, or during the baseline two rounds far
              above the first three) until it has been quiet (no CUSUM in alarm, no round
              beyond the allowance, its level within tolerance) for QUIET_MIN rounds, or
              QUIET_GAPS times the longest quiet spell seen during the alarm: an
              intermittent fault keeps one alarm, whose reason becomes "intermittent".
              Its cause comes from the probes' context (clocks, clock-event reasons, power
              limit, temperature) against the context of the reference period.
peers     a card slow from its first result is its own reference, so its CUSUMs never
              see it. Each device's levels are compared with those of the other devices
              of the same model on the host, probe by probe (median of the siblings),
              pooled by precision: slower than peers when the lower PEER_Z-sigma bound of
              the pooled ratio exceeds 1 + ``peer_margin`` (cleared when the ratio itself
              is back within it).

State is saved to a JSON file so a restart does not take a degraded card as its new
baseline (version 3; versions 1 and 2 still load). The arithmetic is written on numpy
arrays (``start``, ``step``, ``pool``, ``pooled_deviation``, ``device_step``,
``baseline_check``), so that bench/drift.py simulates thousands of GPUs with the code the
daemon runs.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import statistics
import tempfile
import time
import warnings
from collections import deque
from collections.abc import Collection, Iterator, Mapping
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from gemmd.config import DriftConfig
from gemmd.errors import naming
from gemmd.gemm import COLUMN, TARGETS, ProbeSpec

logger = logging.getLogger(__name__)

RHO_MAX = 0.95  # largest lag-1 autocorrelation believed
Z_CAP = 4.0  # a probe's standardized innovation counts at most this much in the pool
CLEAN = 4.0  # innovations are winsorized at this many (safe) scales in the AR(1) filter
LEARN_Z = 4.0  # a probe's track learns only results within this many scales
DEVICE_LEARN_Z = 3.0  # a pooled statistic learns only results within this many scales

NOISE_N = 720  # the noise estimate: cumulative over this many results, then EWMA 1/N
LEVEL_N = 720  # the level is refined over this many in-control results, then frozen
LEVEL_Z = 2.33  # allowance raised by this many standard errors of the level estimate
# Results are learnt (noise) while the series' CUSUM is at most min(LEARN_BELOW h,
# LEARN_ABS), its level only while the CUSUM is at 0.
LEARN_BELOW = 0.5
LEARN_ABS = 0.5
PHI_Z = 2.33  # widen for an autocorrelation this many standard errors above its estimate
# The same for a device's pooled series: PHI_Z while it is young (fewer than DEVICE_YOUNG_N
# results learnt: its probes' autocorrelation is still uncertain, and so is its own), then
# DEVICE_PHI_Z (white when its probes' are; its misfit widens it where they are not).
DEVICE_PHI_Z = 0.0
DEVICE_YOUNG_N = 500
PEER_Z = 3.0  # slower than peers: the ratio's lower PEER_Z-sigma bound above the margin
PEER_MIN_RESULTS = 5  # results behind a level before it is compared with peers
EU_N = 16  # the innovations' EWMA: rounds it averages (the horizon misfit is measured at)
MISFIT_MAX = 4.0  # the scale is widened at most this much for innovations that wander
CAP_PROBE = 0.35  # one result adds at most this share of h to a probe's CUSUM (three)
CAP_POOLED = 0.49  # ... and one round to the device's pooled CUSUM (three rounds)
# The settled pooled CUSUM's allowance, as a share of log(1 + shift) (0.5: half way between
# 0 and the shift), judged against the device's band (BAND_HALF below).
FAST_K = 0.5
# The pooled CUSUM, and every long-run scale, widen for misfit beyond this many standard
# errors of it (a probe's own CUSUM for all of it).
MISFIT_Z = 1.0
# Heavy tails: a CUSUM's scale is widened until its innovations fall below -TAIL_Z as often
# as Gaussian ones would (the share's lower bound at TAIL_SE standard errors).
TAIL_Z = 2.5
TAIL_SE = 1.0
TAIL_MAX = 2.0
# Once settled, the pooled statistic's noise at this normal quantile's bound (90%; 99%
# while young), its allowance raised by this many errors of its level (LEVEL_Z while young).
DEVICE_CHI_Z = 1.2816
DEVICE_LEVEL_Z = 1.0

SLOW_HALF = 30  # rounds: half-life of a device's slow level (an hour at 120 s)
ALPHA = 1.0 - 0.5 ** (1.0 / SLOW_HALF)
BAND_HALF = 15  # rounds: half-life of the band the pooled CUSUM is judged against
ALPHA_BAND = 1.0 - 0.5 ** (1.0 / BAND_HALF)
SLOW_Z = 3.0  # the slow level is beyond the tolerance at this many standard errors
BAD_Z = 3.0  # a round beyond the allowance counts as bad at this many of its scales
QUIET_MIN = 30  # rounds without evidence before an alarm clears (an hour at 120 s) ...
QUIET_GAPS = 3  # ... or this many times the longest quiet spell seen during the alarm
QUIET_MAX = 720  # ... at most a day
INTERMITTENT_EPISODES = 3  # bad spells during one alarm, with at least ...
INTERMITTENT_GOOD = 0.3  # ... this share of its rounds normal: "intermittent"
SPEEDUP_ROUNDS = 30  # a speed-up held this many rounds becomes the new normal
BASE_FIRST = 3  # during the baseline, later rounds are compared with the first ones
BASE_Z = 3.0  # ... at this many scales (90% bound), at least twice the allowance ...
BASE_HITS = 2  # ... in this many rounds in a row
YOUNG_ROUNDS = 30  # the same check, against the references, for this many rounds after

# Why a device is in alarm (``DeviceTrack.reason``): its pooled CUSUM or the baseline
# check (a step), its slow level (a gradual change), a probe's own CUSUM, or on and off.
REASONS = ("", "step", "gradual", "probe", "intermittent")
STEP, GRADUAL, PROBE, INTERMITTENT = 1, 2, 3, 4

# The per-series state, as arrays in ``step`` and as floats in Track.
SERIES_FIELDS = ("reference", "level_n", "lx", "ly", "n", "mx", "my", "cxx", "cxy", "cyy",
                 "last", "prev", "scale", "phi", "cusum", "drifting", "since", "alarms",
                 "h", "k", "last_z", "last_u", "gain", "slow", "eu", "ev", "lcusum", "tail",
                 "tn", "wander")
# A device's own state per target, as arrays in ``device_step``.
DEVICE_FIELDS = ("drifting", "since", "alarms", "reason", "quiet", "gap_max", "episodes",
                 "good", "span", "bad_prev", "level", "level_se", "faster", "hits", "young",
                 "young_thr", "band")
# A DeviceTrack keeps its pooled series' own alarm apart: its ``drifting``, ``since`` and
# ``alarms`` are the device's alarm.
_POOLED_NAMES = {"drifting": "fast", "since": "fast_since", "alarms": "fast_alarms"}
_BOOL_FIELDS = {"drifting", "bad_prev"}
_INT_FIELDS = {"alarms"}
_OPTIONAL_FIELDS = {"since", "h", "k", "last_z", "last_u", "reference", "scale", "level_se"}


def truncated(z: float) -> float:
    """E[x^2 | |x| < z] for a standard normal: what a symmetric cut at z leaves of a
    variance (1 without a cut)."""
    if math.isinf(z):
        return 1.0
    return 1 - 2 * z * math.exp(-z * z / 2) / math.sqrt(2 * math.pi) / math.erf(z / math.sqrt(2))


def allowance(shift: float, tolerance: float = 0.0) -> float:
    """The CUSUMs' allowance in log units: half way between the tolerated amplitude and the
    shift to detect (half the shift without a tolerance)."""
    s = math.log1p(shift)
    return (s + math.log1p(min(max(tolerance, 0.0), shift))) / 2


@dataclass
class Track:
    """Drift state of one series: a (device, probe, target), or a device's pooled
    statistic (DeviceTrack). ``reference``: the learnt level (log ratio; None while
    the baseline is taken)."""

    baseline: list[float] = field(default_factory=list)  # values while (re)baselining
    reference: float | None = None  # level L
    level_n: float = 0.0  # results behind the level (frozen at LEVEL_N)
    lx: float = 0.0  # level accumulators: mean of previous and current values learnt
    ly: float = 0.0
    n: float = 0.0  # results behind the noise estimate (at most NOISE_N)
    mx: float = 0.0  # running means and (co)variances of (previous, current) value pairs
    my: float = 0.0
    cxx: float = 0.0
    cxy: float = 0.0
    cyy: float = 0.0
    last: float = 0.0  # the previous value, winsorized (the AR(1) filter's memory)
    prev: float = 0.0  # the latest value's deviation from the reference
    scale: float | None = None  # long-run scale sigma_e / (1 - phi), at its upper bound
    phi: float = 0.0  # lag-1 autocorrelation
    cusum: float = 0.0
    drifting: bool = False
    since: float | None = None  # when the current alarm started
    alarms: int = 0
    h: float | None = None  # alarm threshold
    k: float | None = None  # allowance
    last_z: float | None = None  # latest standardized innovation, as the CUSUM took it
    last_u: float | None = None  # the same at the raw noise estimate (what is pooled)
    gain: float = 0.0  # response of last_u to a unit log shift (the pooling weight)
    slow: float = 0.0  # EWMA of the deviation from the reference (half-life SLOW_HALF)
    eu: float = 0.0  # EWMA of the innovations (1/EU_N) and its mean square: how much more
    ev: float = 0.0  # they wander together than independent ones would (model misfit)
    lcusum: float = 0.0  # the lower CUSUM: evidence of a speed-up (stops learning; no alarm)
    tail: float = 0.0  # share of its in-control innovations below -TAIL_Z (heavy tails) ...
    tn: float = 0.0  # ... over this many results (at most NOISE_N)
    wander: float = 1.0  # its misfit as learnt over its reference period (then frozen)
    cut: int = 0  # baseline values before a step seen during the baseline (0: none)
    spd: float = 0.0  # sum of its deviations while its device counts a speed-up

    def ready(self) -> bool:
        return self.reference is not None


@dataclass
class DeviceTrack(Track):
    """A device's pooled statistic for one target, its slow level, its alarm (``drifting``,
    ``since``, ``alarms``: raised, with its reason and cause) and its standing among its
    peers."""

    members: int = 0  # probes pooled in the latest round
    ratio: float | None = None  # latest round's measured/normal, pooled over its probes
    peer_ratio: float | None = None  # normal against the median of same-model siblings
    peer_se: float | None = None  # standard error of log(peer_ratio)
    peers: int = 0  # siblings compared with
    slower: bool = False  # slower than its peers by more than peer_margin
    slower_since: float | None = None
    fast: bool = False  # the pooled CUSUM's own alarm
    fast_since: float | None = None
    fast_alarms: int = 0
    reason: str = ""  # why the device is in alarm: REASONS
    cause: str = ""  # what changed with it (CAUSES), and in words
    cause_text: str = ""
    quiet: float = 0.0  # rounds without evidence during the alarm
    gap_max: float = 0.0  # its longest quiet spell so far
    episodes: float = 0.0  # bad spells during the alarm
    good: float = 0.0  # normal rounds during the alarm
    span: float = 0.0  # rounds of the alarm
    bad_prev: bool = False
    level: float = 0.0  # slow level m (log units, EWMA of the rounds' deviations)
    level_se: float | None = None  # its standard error (noise and reference)
    faster: float = 0.0  # rounds in a row faster than normal beyond the tolerance
    hits: float = 0.0  # rounds in a row far above the first ones (baseline, young)
    young: float = 0.0  # rounds since the pooled statistic started
    young_thr: float = 0.0  # the young check's bar (log units)
    band: float = 0.0  # where slow wiggles have it now (log; the pooled CUSUM's reference)
    speedups: int = 0  # speed-ups taken as the new normal

    def armed(self) -> bool:
        """The pooled statistic has its reference: the device's alarms work fully."""
        return self.ready()


@dataclass
class DeviceDrift:
    """Per device: its model name (who its peers are), a pooled track per target, and the
    probes' context: of the reference period (``normal``) and the latest results."""

    gpu_model: str = ""
    targets: dict[str, DeviceTrack] = field(default_factory=dict)
    contexts: dict[str, dict[str, list[list[Any]]]] = field(default_factory=dict)

    def track(self, target: str) -> DeviceTrack:
        return self.targets.setdefault(target, DeviceTrack())


class Alarm(NamedTuple):
    """A new alarm: of a probe's own track, or (spec None) of the device."""

    target: str
    spec: ProbeSpec | None


class Transition(NamedTuple):
    """A change of a device's drift state, for the record (the store's events): ``kind``
    alarm (raised), clear (ended: quiet again, or a rebaseline), or rebaseline
    (``drift.accept_after_s`` took the device's behaviour as its new normal; phase
    "speedup": a speed-up did, for one target). ``spec`` None: the device's alarm (or, for
    a rebaseline, every track)."""

    ts: float
    kind: str
    uuid: str
    target: str | None
    spec: ProbeSpec | None
    detail: dict[str, Any]


TRANSITIONS_MAX = 10_000  # kept for a caller that drains them (the daemon drains each result)


# ---------------------------------------------------------------- the arithmetic


def upper_bound_factor(n_eff: Any, z: float = 2.326) -> Any:
    """sigma_99% / sigma_hat for a variance estimated with n_eff - 1 degrees of freedom:
    sqrt(nu / chi2_0.01(nu)), the quantile by Wilson-Hilferty (``z``: another level's
    normal quantile). Scalars or arrays."""
    nu = np.maximum(np.asarray(n_eff, float) - 1.0, 1.0)
    c = 1 - 2 / (9 * nu) - z * np.sqrt(2 / (9 * nu))
    out = np.sqrt(1.0 / np.maximum(c, 0.05) ** 3)
    return float(out) if out.ndim == 0 else out


def threshold(k: Any, arl0: float) -> Any:
    """CUSUM threshold h giving an in-control average run length ``arl0`` for allowance k
    (Siegmund: ARL0 = (exp(2kb) - 2kb - 1) / 2k^2, b = h + 1.166). Scalars or arrays."""
    k = np.maximum(np.asarray(k, float), 1e-3)
    b = np.log(2 * k * k * arl0 + 1) / (2 * k)
    # Fixed point of b = log(2k^2 ARL0 + 2kb + 1) / 2k: a contraction by ~1/(2k^2 ARL0).
    for _ in range(8):
        b = np.log(2 * k * k * arl0 + 2 * k * b + 1) / (2 * k)
    out = np.maximum(b - 1.166, 0.5)
    return float(out) if out.ndim == 0 else out


def _phi(cxx: np.ndarray, cxy: np.ndarray) -> np.ndarray:
    safe = np.where(cxx > 0, cxx, 1.0)
    return np.where(cxx > 0, np.clip(cxy / safe, 0.0, RHO_MAX), 0.0)


def _params(s: dict[str, np.ndarray], floor: Any, phi_z: Any, learn_z: float = math.inf,
            chi_z: Any = 2.326
            ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The series' AR(1) model: phi; the innovation scale sigma_e at its estimate (the
    regression's residual variance, n - 2 degrees of freedom, corrected for the learning
    cut at ``learn_z``) and at its safe bound, both at least floor (1 - phi) (``floor``
    bounds the long-run scale sigma_e / (1 - phi)); the standard error of the level, in
    innovation units; and where innovations are winsorized before they are learnt: CLEAN
    times the estimate's 99% bound (at least a twentieth of the floor).

    The safe bound: the 99% chi-square bound of sigma_e, times (1 - phi) / (1 - phi_hi):
    if the true autocorrelation is phi_hi, the upper ``phi_z``-sigma bound of the
    estimate, innovations filtered with phi wander that much more in the long run."""
    phi = _phi(s["cxx"], s["cxy"])
    n = s["n"]
    var = np.maximum(s["cyy"] - 2 * phi * s["cxy"] + phi * phi * s["cxx"], 0.0)
    var = var * n / np.maximum(n - 2.0, 1.0) / truncated(learn_z)
    raw = np.sqrt(var)
    least = floor * (1.0 - phi)
    # Where the series wanders less than the floor, phi hardly matters to its innovations:
    # its previous values count as spread by at least the floor.
    spread = n * np.maximum(s["cxx"], least * least)
    se_phi = np.where(spread > 0, np.sqrt(var / np.where(spread > 0, spread, 1.0)), 0.0)
    hi = np.minimum(phi + phi_z * se_phi, RHO_MAX + 0.03)
    chi = upper_bound_factor(n - 1.0, chi_z)
    ub = chi * np.maximum((1 - phi) / (1 - hi), 1.0)
    sig = np.maximum(raw, least)
    clip = CLEAN * np.maximum(raw * chi, 0.05 * least)
    # The level is the mean of the values learnt: its error, sigma_e / (1 - phi) / sqrt(n)
    # in log units, moves innovations by (1 - phi) times that.
    lse = sig / np.sqrt(np.maximum(s["level_n"], 1.0))
    return phi, sig, np.maximum(raw * ub, least), lse, clip


def start(baseline: np.ndarray, cut: Any = None) -> dict[str, np.ndarray]:
    """Series state from baseline values (axis 0: time, at least 2; axis 1: series): the
    reference is their median, the noise their AR(1) moments after winsorizing at 4 MADs.
    ``cut`` (per series, optional): a step seen at that value: the reference is the median
    of the values before it, and each side is centred on its own median for the noise
    (a step is no noise). The state is a dict of arrays, one entry per series."""
    b = np.asarray(baseline, float)
    n0, cols = b.shape
    c = np.full(cols, n0) if cut is None else np.asarray(cut, int).reshape(-1)
    c = np.where((c >= 2) & (c < n0), c, n0)
    before = np.arange(n0)[:, None] < c[None, :]
    with np.errstate(all="ignore"), _quiet_nan():
        med = np.nanmedian(np.where(before, b, np.nan), axis=0)
        after = np.nanmedian(np.where(before, np.nan, b), axis=0)
    after = np.where(np.isnan(after), med, after)
    cen = b - np.where(before, med, after)
    mad = 1.4826 * np.median(np.abs(cen), axis=0)
    cw = np.clip(cen, -CLEAN * mad, CLEAN * mad)
    x, y = cw[:-1], cw[1:]
    pair = before[1:] == before[:-1]  # pairs within one side of the step
    cnt = np.maximum(pair.sum(axis=0), 1)
    mx = np.where(pair, x, 0.0).sum(axis=0) / cnt
    my = np.where(pair, y, 0.0).sum(axis=0) / cnt
    z = np.zeros(cols)
    s = {"reference": med, "level_n": c.astype(float), "lx": med.copy(), "ly": med.copy(),
         "n": pair.sum(axis=0).astype(float), "mx": med + mx, "my": med + my,
         "cxx": (np.where(pair, (x - mx) ** 2, 0.0)).sum(axis=0) / cnt,
         "cxy": (np.where(pair, (x - mx) * (y - my), 0.0)).sum(axis=0) / cnt,
         "cyy": (np.where(pair, (y - my) ** 2, 0.0)).sum(axis=0) / cnt,
         "last": b[-1] - cen[-1] + cw[-1], "prev": b[-1] - med, "scale": z.copy(),
         "phi": z.copy(), "cusum": z.copy(), "drifting": np.zeros(cols, bool),
         "since": np.full(cols, np.nan), "alarms": np.zeros(cols),
         "h": np.full(cols, np.nan), "k": np.full(cols, np.nan),
         "last_z": np.full(cols, np.nan), "last_u": np.full(cols, np.nan), "gain": z.copy(),
         "slow": z.copy(), "eu": z.copy(), "ev": z.copy(), "lcusum": z.copy(),
         "tail": z.copy(), "tn": z.copy(), "wander": np.ones(cols)}
    s["phi"] = _phi(s["cxx"], s["cxy"])
    return s


@contextlib.contextmanager
def _quiet_nan() -> Iterator[None]:
    """numpy's "All-NaN slice" warning off (a column with no value before its cut)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        yield


def misfit(s: dict[str, np.ndarray], z: float = 0.0) -> np.ndarray:
    """How much faster than independent ones a series' innovations fill a CUSUM: noise an
    AR(1) does not describe (a slow wander plus white noise, say) leaves them wandering
    together. Their EWMA over EU_N rounds has a mean square a / (2 - a) (a = 1 / EU_N)
    when they are independent; the square root of the ratio, between 1 and MISFIT_MAX,
    widens the scale the series' own CUSUM uses. ``z``: only the ratio's lower bound at
    that many standard errors counts (the mean square of an EWMA over EU_N rounds, learnt
    from n results, has a relative standard error of about sqrt(2 EU_N / n)): white
    noise then seldom widens it."""
    a = 1.0 / EU_N
    ratio = s["ev"] * (2 - a) / a
    if z:
        ratio = ratio / (1 + z * np.sqrt(2 * EU_N / np.maximum(s["n"], EU_N)))
    return np.sqrt(np.clip(ratio, 1.0, MISFIT_MAX ** 2))


_TAIL_P = np.geomspace(1e-5, 0.5, 400)  # Gaussian tail shares (one side), and their z
_TAIL_Q = np.array([statistics.NormalDist().inv_cdf(1 - p) for p in _TAIL_P])
_GAUSS_TAIL = statistics.NormalDist().cdf(-TAIL_Z)


def tail_factor(s: dict[str, np.ndarray]) -> np.ndarray:
    """How much wider a series' scale must be for its innovations to fall below -TAIL_Z
    as seldom as Gaussian ones: TAIL_Z over the Gaussian quantile of the share seen there
    (its lower bound at TAIL_SE standard errors), between 1 and TAIL_MAX. Heavy tails (a
    Student-t, say) leave the learnt scale too narrow for a CUSUM built on Gaussian ones:
    it is learnt within LEARN_Z scales, where a t3 hides a third of its variance. The
    lower tail only: a slowdown's first results are no tail (a speed-up, rarer and
    reported, only widens it)."""
    p, n = s["tail"], np.maximum(s["tn"], 1.0)
    lo = p - TAIL_SE * np.sqrt(p * (1 - p) / n)
    q = np.interp(np.log(np.clip(lo, _TAIL_P[0], _TAIL_P[-1])), np.log(_TAIL_P), _TAIL_Q)
    return np.where(lo > _GAUSS_TAIL, np.clip(TAIL_Z / np.maximum(q, 1e-3), 1.0, TAIL_MAX),
                    1.0)


def step(s: dict[str, np.ndarray], x: np.ndarray, *, gain: Any, floor: Any, learn: Any,
         shift: float, arl0: float, now: float = 0.0, phi_z: Any = None,
         learn_z: float = LEARN_Z, kappa: Any = None, cap_h: float = CAP_PROBE,
         learn_level: Any = True, widen_misfit: bool = True, misfit_z: float = 0.0,
         tails: bool = False, chi_z: Any = 2.326, level_z: Any = LEVEL_Z) -> np.ndarray:
    """Feed one value per series (updated in place); returns where a new alarm was raised.

    ``gain``: how much a unit log shift moves x (1 for a residual; the pooled response for
    a device's Z); ``floor``: least long-run scale, in x's units; ``learn``: False where
    the caller knows the device is not in control (the series also checks its own state);
    ``learn_level``: False where the level must not move (the device's slow level is off);
    ``kappa``: the allowance in log units (``allowance``; half ``shift`` by default; like
    ``phi_z``, per series where an array);
    ``cap_h``: the share of h one value may add; ``widen_misfit``: widen the CUSUM's scale
    by ``misfit`` (at ``misfit_z``), and the long-run scale too; ``tails``: widen the
    CUSUM's scale by ``tail_factor``; ``chi_z``, ``level_z``: the safe bounds' quantiles
    (sigma_e's upper bound, the level's error added to the allowance). Also sets
    ``last_u`` (innovation / raw sigma_e) and ``gain`` (its response to a unit log shift)
    for pooling, and the slow EWMA of the deviation. No I/O, no clock but ``now``.
    """
    phi_z = PHI_Z if phi_z is None else phi_z
    kappa = math.log1p(shift) / 2 if kappa is None else kappa
    phi, sig, safe, lse, clip = _params(s, floor, phi_z, learn_z, chi_z)
    if widen_misfit:
        safe = safe * misfit(s, misfit_z)  # this CUSUM only (not the scale others pool with)
    if tails:
        safe = safe * tail_factor(s)
    level = s["reference"]
    pred = phi * s["last"] + (1 - phi) * level
    a = x - pred
    u = a / sig
    g = gain * (1 - phi) / sig
    k0 = kappa * gain * (1 - phi) / safe
    k = k0 + level_z * lse / safe
    h = threshold(k0, arl0)
    cap = k + cap_h * h
    uc = a / safe
    # Learnt only while in control, and only results within learn_z scales of the
    # prediction: a symmetric cut, so the mean stays unbiased and the variance is corrected
    # by truncated(learn_z). The first result of a large shift arrives while the CUSUM is
    # still at 0: it is never learnt.
    calm = np.asarray(learn) & in_control(s)
    gate = calm & (np.abs(a) <= learn_z * sig)
    at_zero = s["cusum"] == 0
    cusum = np.maximum(0.0, s["cusum"] + np.minimum(uc, cap) - k)
    # The mirror CUSUM: a speed-up is no alarm, but no noise to learn either.
    s["lcusum"] = np.maximum(0.0, s["lcusum"] + np.minimum(-uc, cap) - k)
    raised = ~s["drifting"] & (cusum > h)
    s["drifting"] = (s["drifting"] | raised) & (cusum > 0)
    s["since"] = np.where(raised, now, np.where(s["drifting"], s["since"], np.nan))
    s["alarms"] = s["alarms"] + raised
    s["cusum"], s["h"], s["k"], s["last_z"], s["last_u"], s["gain"] = cusum, h, k, uc, u, g
    dev = x - level
    s["prev"] = dev
    sc = np.where(np.isfinite(s["scale"]) & (s["scale"] > 0), s["scale"], floor)
    s["slow"] = s["slow"] + ALPHA * (np.clip(dev, -CLEAN * sc, CLEAN * sc) - s["slow"])
    # Learn from this result (winsorized) if the series was in control before it.
    xc = pred + np.clip(a, -clip, clip)
    n1 = np.where(gate, np.minimum(s["n"] + 1.0, NOISE_N), s["n"])
    al = np.where(gate, 1.0 / np.maximum(n1, 1.0), 0.0)
    eu = np.where(gate, s["eu"] + (np.clip(u, -CLEAN, CLEAN) - s["eu"]) / EU_N, s["eu"])
    s["ev"] = s["ev"] + al * (eu * eu - s["ev"])
    s["eu"] = eu
    dx, dy = s["last"] - s["mx"], xc - s["my"]
    s["mx"] = s["mx"] + al * dx
    s["my"] = s["my"] + al * dy
    s["cxx"] = (1 - al) * (s["cxx"] + al * dx * dx)
    s["cxy"] = (1 - al) * (s["cxy"] + al * dx * dy)
    s["cyy"] = (1 - al) * (s["cyy"] + al * dy * dy)
    s["n"] = n1
    # The (lower) tail: every in-control result counts, however far off.
    tn = np.where(calm, np.minimum(s["tn"] + 1.0, NOISE_N), s["tn"])
    s["tail"] = s["tail"] + np.where(calm, ((u < -TAIL_Z) - s["tail"]) /
                                     np.maximum(tn, 1.0), 0.0)
    s["tn"] = tn
    lv = gate & at_zero & np.asarray(learn_level) & (s["level_n"] < LEVEL_N)
    ln = np.where(lv, s["level_n"] + 1.0, s["level_n"])
    be = np.where(lv, 1.0 / ln, 0.0)
    s["lx"] = s["lx"] + be * (s["last"] - s["lx"])
    s["ly"] = s["ly"] + be * (xc - s["ly"])
    s["level_n"] = ln
    # The level is the mean of the values learnt (for an AR(1) series as for any: the
    # intercept form (ly - phi lx) / (1 - phi) amplified each error by 1 / (1 - phi)).
    s["reference"] = np.where(lv, s["ly"], level)
    s["last"] = xc
    phi1 = _phi(s["cxx"], s["cxy"])
    _, _, safe1, _, _ = _params(s, floor, phi_z, learn_z, chi_z)
    s["phi"] = phi1
    # The long-run scale (what the device's pooled deviation and slow level weigh this
    # series by) widens with its misfit too, where it shows beyond MISFIT_Z errors:
    # averaged over many rounds, innovations that wander together wander further. As
    # learnt over the reference period (LEVEL_N results), then frozen: a slow drift later
    # (a ramp) would be learnt as wander, and widen the very bound that should catch it.
    if widen_misfit:
        s["wander"] = np.where(s["level_n"] < LEVEL_N, misfit(s, MISFIT_Z), s["wander"])
    s["scale"] = safe1 / (1 - phi1) * (s["wander"] if widen_misfit else 1.0)
    return raised


def fast_allowance(shift: float) -> float:
    """The pooled CUSUM's allowance (log units): FAST_K of the shift, judged against the
    device's band rather than its normal, so that a slow wiggle within the tolerance is
    followed instead of allowed for."""
    return FAST_K * math.log1p(shift)


def pooled_settings(n: Any, band: Any, gain: Any, shift: float, tolerance: float
                    ) -> dict[str, Any]:
    """How a device's pooled CUSUM judges its next value (``n``: the results its series
    learnt; ``band``: the device's, log units; ``gain``: the pooled response to a unit log
    shift). While young (fewer than DEVICE_YOUNG_N: its probes' autocorrelation, and its
    own, are still uncertain) as a probe's track does: against its normal, the allowance
    half way between the tolerance and the shift, an autocorrelation PHI_Z errors above
    its estimate allowed for. Once settled, against the band (a slow wiggle within the
    tolerance is followed, not allowed for: a step is judged against where the device
    was), with FAST_K of the shift as its allowance and DEVICE_PHI_Z (its misfit widens
    it where its probes wander more than their AR(1) says)."""
    young = np.asarray(n, float) < DEVICE_YOUNG_N
    tol = math.log1p(tolerance) if tolerance > 0 else 0.0
    return {"phi_z": np.where(young, PHI_Z, DEVICE_PHI_Z),
            "chi_z": np.where(young, 2.326, DEVICE_CHI_Z),
            "level_z": np.where(young, LEVEL_Z, DEVICE_LEVEL_Z),
            "kappa": np.where(young, allowance(shift, tolerance), fast_allowance(shift)),
            "offset": np.asarray(gain, float) * np.clip(np.asarray(band, float), -tol, tol)}


def innovations(s: dict[str, np.ndarray], values: np.ndarray, floor: Any
                ) -> tuple[np.ndarray, np.ndarray]:
    """Standardized innovations of ``values`` (axis 0: time) under the AR(1) model of
    ``s`` (their own baseline, just started), and each series' response to a unit log
    shift: what those results would have contributed to a device's pooled statistic.
    Lets the pooled statistic start from the probes' baseline instead of after it."""
    v = np.asarray(values, float)
    phi, sig, _, _, _ = _params(s, floor, 0.0)
    a = v[1:] - phi * v[:-1] - (1 - phi) * s["reference"]
    return a / sig, (1 - phi) / sig


def long_run_scales(s: dict[str, np.ndarray], floor: Any) -> np.ndarray:
    """Each series' long-run scale sigma_e / (1 - phi) at its point estimate, at least
    ``floor``: how far a probe's results stray from its normal (its pooling weight)."""
    phi = _phi(s["cxx"], s["cxy"])
    n = s["n"]
    var = np.maximum(s["cyy"] - 2 * phi * s["cxy"] + phi * phi * s["cxx"], 0.0)
    var = var * n / np.maximum(n - 2.0, 1.0) / truncated(LEARN_Z)
    return np.maximum(np.maximum(np.sqrt(var), floor * (1 - phi)) / (1 - phi), floor)


def in_control(s: dict[str, np.ndarray]) -> np.ndarray:
    """Where a series shows no evidence of a shift either way: no alarm, its CUSUM at
    most min(LEARN_BELOW h, LEARN_ABS), its lower CUSUM at most LEARN_BELOW h. Its next
    result is learnt only there (a gate on the past only: the regression on the previous
    value stays unbiased)."""
    half = LEARN_BELOW * np.nan_to_num(s["h"], nan=np.inf)
    # The lower CUSUM's bar is half its threshold: a speed-up stops the learning within
    # rounds, noise seldom does (a stricter bar narrows what phi is learnt from).
    return ~s["drifting"] & (s["cusum"] <= np.minimum(half, LEARN_ABS)) & (s["lcusum"] <= half)


def pool(u: np.ndarray, g: np.ndarray, present: np.ndarray | None = None,
         kappa: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    """A device's pooled statistic from its probes' standardized innovations ``u`` and
    responses ``g`` (last axis: probes; ``present``: which reported this round):
    Z = sum g u / sqrt(sum g^2), and its response to a unit log shift of every probe,
    sqrt(sum g^2). Each u is capped at Z_CAP, or at twice ``kappa`` (log units; the
    monitor passes half the shift) where that is more: one probe's outlier cannot
    dominate, and a shift of a quiet probe still counts in full."""
    if present is None:
        present = np.ones(np.shape(u), bool)
    gg = np.where(present, g, 0.0)
    cap = np.maximum(Z_CAP, 2 * kappa * np.asarray(g, float))
    uu = np.where(present, np.clip(np.nan_to_num(u), -cap, cap), 0.0)
    norm = np.sqrt((gg * gg).sum(axis=-1))
    safe = np.where(norm > 0, norm, 1.0)
    return (gg * uu).sum(axis=-1) / safe, norm


def pooled_deviation(d: np.ndarray, scale: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A round's deviation from the device's normal (log units) from its probes'
    deviations ``d`` and long-run scales (last axis: probes): their mean weighted by
    1 / scale^2, each first clipped to 3 scales around the probes' median (one probe's
    outlier moves it by a bounded step; a shift of every probe, fully). Also its standard
    deviation were the probes independent, 1 / sqrt(sum 1 / scale^2)."""
    d = np.asarray(d, float)
    sc = np.maximum(np.asarray(scale, float), 1e-9)
    w = 1.0 / (sc * sc)
    med = np.median(d, axis=-1, keepdims=True)
    dc = np.clip(d, med - 3 * sc, med + 3 * sc)
    return (w * dc).sum(axis=-1) / w.sum(axis=-1), 1.0 / np.sqrt(w.sum(axis=-1))


def _spread(b: np.ndarray, rows: np.ndarray, floor: float) -> np.ndarray:
    """The noise of baseline values ``b`` (time, series, probes) over the rounds ``rows``
    (time, series): the probes' variances about their medians, pooled, at least the
    floor's, at the 90% bound of that many degrees of freedom (a few values only: the
    99% bound would hide a 20% step at 2% noise on two probes; the check asks for two
    rounds in a row)."""
    p = b.shape[2]
    m = rows.sum(axis=0)
    x = np.where(rows[..., None], b, np.nan)
    with _quiet_nan():
        med = np.nanmedian(x, axis=0)
    var = np.nansum((x - med) ** 2, axis=0) / np.maximum(m - 1, 1)[:, None]
    sd = np.sqrt(np.maximum(var.mean(axis=-1), floor * floor))
    return sd * upper_bound_factor((m - 1) * p + 1, z=1.2816)


def together(d: np.ndarray) -> np.ndarray:
    """How far a round's probes moved together (last axis: probes): their median, the
    smaller of two: one probe's outlier moves it by nothing."""
    d = np.asarray(d, float)
    return np.median(d, axis=-1) if d.shape[-1] != 2 else d.min(axis=-1)


def baseline_check(b: np.ndarray, floor: float, kappa: float) -> np.ndarray:
    """During the baseline (``b``: values so far, axis 0 time with at least BASE_FIRST + 1,
    then series, then probes): is the latest round far above the first BASE_FIRST? How
    far its probes moved together from their first rounds' median (``together``),
    against at least twice the allowance and BASE_Z times the noise of the earlier rounds
    that were not that far above already (a step does not widen its own bar), at its 90%
    bound. A step this early is otherwise learnt as the card's normal."""
    b = np.asarray(b, float)
    n, _, p = b.shape
    ref = np.median(b[:BASE_FIRST], axis=0)
    y = together(b - ref)  # (time, series)
    far = (y > 2 * kappa) & (np.arange(n)[:, None] >= BASE_FIRST)
    rows = ~far & (np.arange(n)[:, None] < n - 1)
    # The reference (a median of BASE_FIRST) and the latest value both carry noise.
    sd_y = _spread(b, rows, floor) * np.sqrt((1 + math.pi / 2 / BASE_FIRST) / p)
    return y[-1] > np.maximum(2 * kappa, BASE_Z * sd_y)


def young_threshold(b: np.ndarray, cut: np.ndarray, floor: float, kappa: float
                    ) -> np.ndarray:
    """The bar of the same check for YOUNG_ROUNDS rounds after the baseline (``b``: the
    whole baseline; ``cut``: where a step was seen in it, 0 for none), when a round's
    pooled deviation from the references is compared: the safe scales of a young series
    are still wide, and a large step would take them long."""
    b = np.asarray(b, float)
    n, _, p = b.shape
    m = np.where(np.asarray(cut) > 0, cut, n)
    rows = np.arange(n)[:, None] < m[None, :]
    sd_y = _spread(b, rows, floor) * np.sqrt((1 + math.pi / 2 / np.maximum(m, 1)) / p)
    return np.maximum(2 * kappa, BASE_Z * sd_y)


def _alarm(dv: dict[str, np.ndarray], trig: np.ndarray, code: np.ndarray, alive: np.ndarray,
           bad: np.ndarray, good: np.ndarray, now: float) -> tuple[np.ndarray, np.ndarray]:
    """A device's alarm per series (updated in place): raised on ``trig`` (reason
    ``code``), kept while there is evidence (``alive``), cleared after QUIET_MIN rounds
    without, or QUIET_GAPS times the longest quiet spell seen during it; its reason
    becomes intermittent after INTERMITTENT_EPISODES bad spells with INTERMITTENT_GOOD of
    its rounds normal. Returns (raised, cleared)."""
    on = dv["drifting"].astype(bool)
    raised = ~on & trig
    quiet = np.where(on & ~alive, dv["quiet"] + 1, 0.0)
    gap = np.where(on & alive & (dv["quiet"] > 0), np.maximum(dv["gap_max"], dv["quiet"]),
                   dv["gap_max"])
    need = np.clip(np.maximum(QUIET_MIN, QUIET_GAPS * gap), QUIET_MIN, QUIET_MAX)
    cleared = on & (quiet >= need)
    episodes = dv["episodes"] + (on & bad & ~dv["bad_prev"].astype(bool))
    goods = dv["good"] + (on & good)
    span = dv["span"] + on
    inter = on & (episodes >= INTERMITTENT_EPISODES) & (goods >= INTERMITTENT_GOOD * span)
    reason = np.where(inter, INTERMITTENT, dv["reason"])
    keep = on & ~cleared
    dv["drifting"] = keep | raised
    dv["since"] = np.where(raised, now, np.where(keep, dv["since"], np.nan))
    dv["alarms"] = dv["alarms"] + raised
    dv["reason"] = np.where(raised, code, np.where(keep, reason, 0)).astype(float)
    dv["quiet"] = np.where(keep, quiet, 0.0)
    dv["gap_max"] = np.where(keep, gap, 0.0)
    dv["episodes"] = np.where(raised, bad.astype(float), np.where(keep, episodes, 0.0))
    dv["good"] = np.where(keep, goods, 0.0)
    dv["span"] = np.where(raised, 1.0, np.where(keep, span, 0.0))
    dv["bad_prev"] = bad.astype(bool)
    return raised, cleared


def device_step(dv: dict[str, np.ndarray], y: Any, sd: Any, ref_var: Any, *,
                fast_raised: Any, fast_alive: Any, probe_raised: Any, probe_alive: Any,
                kappa: float, tolerance: float, now: float = 0.0, moved: Any = None
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One round of a device's own statistics per series (a device and target), updated
    in place: the slow level of the round's deviation ``y`` (``sd``: y's long-run standard
    deviation, from its probes' long-run scales and the pooled statistic's, which counts
    the noise common to the probes; ``ref_var``: the variance of the pooled reference),
    and the alarm, triggered by the pooled CUSUM (``fast_raised``), a probe's
    (``probe_raised``) or the slow level, alive while any of them shows evidence or a round
    is beyond the allowance; ``moved``: how far the probes moved together (``together``;
    y where not given), what the young check compares. Returns (raised, cleared, a
    speed-up held SPEEDUP_ROUNDS)."""
    y = np.asarray(y, float)
    sd = np.asarray(sd, float)
    tol = math.log1p(tolerance) if tolerance > 0 else 0.0
    se = np.sqrt(sd * sd * ALPHA / (2 - ALPHA) + ref_var)
    m = dv["level"]
    level = m + ALPHA * (np.clip(y, m - CLEAN * sd, m + CLEAN * sd) - m)
    dv["level"], dv["level_se"] = level, se
    # The band follows the rounds as the level does, each moving it at most as far as the
    # tolerance (a step moves it little), and stands still while there is evidence.
    hold = dv["drifting"].astype(bool) | (dv["faster"] > 0)
    dv["band"] = np.where(hold, dv["band"],
                          dv["band"] + ALPHA_BAND * np.clip(y - dv["band"], -tol, tol))
    hi = (level - SLOW_Z * se > tol) if tol > 0 else np.zeros(y.shape, bool)
    lo = (level + SLOW_Z * se < -tol) if tol > 0 else np.zeros(y.shape, bool)
    bad = (y > kappa) & (y > BAD_Z * sd)
    good = y < kappa / 2
    # Young: the first YOUNG_ROUNDS rounds, a large step against the baseline's noise.
    dv["young"] = dv["young"] + 1
    moved = y if moved is None else np.asarray(moved, float)
    # (No bar where the pooled statistic took a baseline of its own: no young check.)
    early = (dv["young"] <= YOUNG_ROUNDS) & (dv["young_thr"] > 0) & (moved > dv["young_thr"])
    dv["hits"] = np.where(early, dv["hits"] + 1, 0.0)
    step_ = np.asarray(fast_raised, bool) | (dv["hits"] >= BASE_HITS)
    trig = step_ | np.asarray(probe_raised, bool) | hi
    code = np.where(step_, STEP, np.where(hi, GRADUAL, PROBE))
    alive = np.asarray(fast_alive, bool) | np.asarray(probe_alive, bool) | hi | bad | early
    raised, cleared = _alarm(dv, trig, code, alive, bad, good, now)
    dv["faster"] = np.where(lo & ~dv["drifting"].astype(bool), dv["faster"] + 1, 0.0)
    return raised, cleared, dv["faster"] >= SPEEDUP_ROUNDS


def warm_level(dv: dict[str, np.ndarray], ys: np.ndarray) -> None:
    """A device's slow level from the rounds of its probes' baselines (``ys``: axis 0
    rounds), so that it starts with the pooled statistic."""
    ys = np.asarray(ys, float)
    m = np.zeros(ys.shape[1:])
    for t in range(ys.shape[0]):
        m = m + ALPHA * (ys[t] - m)
    dv["level"] = m
    dv["band"] = m.copy()


def new_device_state(n: int) -> dict[str, np.ndarray]:
    """``n`` device series' own state (DEVICE_FIELDS), as ``device_step`` keeps it."""
    out = {f: np.zeros(n) for f in DEVICE_FIELDS}
    out["drifting"], out["bad_prev"] = np.zeros(n, bool), np.zeros(n, bool)
    out["since"], out["level_se"] = np.full(n, np.nan), np.full(n, np.nan)
    return out


# ---------------------------------------------------------------- one series at a time


def _to_arrays(tr: Track, names: tuple[str, ...] = SERIES_FIELDS,
               rename: Mapping[str, str] | None = None) -> dict[str, np.ndarray]:
    out = {}
    for name in names:
        v = getattr(tr, (rename or {}).get(name, name))
        if name == "reason":
            v = float(REASONS.index(v)) if v in REASONS else 0.0
        out[name] = np.array([np.nan if v is None else v],
                             dtype=bool if name in _BOOL_FIELDS else float)
    return out


def _from_arrays(tr: Track, s: dict[str, np.ndarray], names: tuple[str, ...] = SERIES_FIELDS,
                 rename: Mapping[str, str] | None = None) -> None:
    for name in names:
        v = s[name][0]
        attr = (rename or {}).get(name, name)
        if name in _BOOL_FIELDS:
            setattr(tr, attr, bool(v))
        elif name in _INT_FIELDS:
            setattr(tr, attr, int(v))
        elif name == "reason":
            setattr(tr, attr, REASONS[int(v)] if 0 <= int(v) < len(REASONS) else "")
        elif name in _OPTIONAL_FIELDS:
            setattr(tr, attr, None if math.isnan(v) else float(v))
        else:
            setattr(tr, attr, float(v))


def set_reference(track: Track, values: list[float], cut: int = 0) -> None:
    """Reference and noise of ``track`` from a run of healthy values, oldest first (``cut``:
    a step seen at that value: the reference is taken before it)."""
    keep: dict[str, Any] = {"alarms": track.alarms, "drifting": track.drifting,
                            "since": track.since, "cusum": track.cusum}
    rename = None
    if isinstance(track, DeviceTrack):
        rename = _POOLED_NAMES
        keep = {"fast_alarms": track.fast_alarms, "fast": track.fast,
                "fast_since": track.fast_since, "cusum": track.cusum}
    _from_arrays(track, start(np.asarray(values, float)[:, None], [cut or len(values)]),
                 rename=rename)
    track.baseline = []
    for name, v in keep.items():
        setattr(track, name, v)


def update(track: Track, value: float, model_sigma: float = 0.0, *, shift: float,
           arl0: float, baseline_probes: int, min_scale: float, now: float,
           use_model_sigma: bool = False, learn: bool = True, gain: float = 1.0,
           phi_z: float | None = None, learn_z: float = LEARN_Z,
           kappa: float | None = None, cap_h: float = CAP_PROBE,
           learn_level: bool = True, widen_misfit: bool = True, misfit_z: float = 0.0,
           tails: bool = False, chi_z: float = 2.326, level_z: float = LEVEL_Z) -> bool:
    """Feed one value (a log residual; a device's Z with ``gain``) into ``track``, updated
    in place; True when it raised a new alarm. ``min_scale``: the floor of the long-run
    scale (floored further by the model's sigma when ``use_model_sigma``)."""
    floor = max(min_scale, model_sigma if use_model_sigma else 0.0)
    if not track.ready():
        track.baseline.append(value)
        if len(track.baseline) >= max(baseline_probes, 2):
            set_reference(track, track.baseline, track.cut)
        return False
    rename = _POOLED_NAMES if isinstance(track, DeviceTrack) else None
    s = _to_arrays(track, rename=rename)
    raised = step(s, np.array([value]), gain=gain, floor=floor, learn=learn, shift=shift,
                  arl0=arl0, now=now, phi_z=phi_z, learn_z=learn_z, kappa=kappa,
                  cap_h=cap_h, learn_level=learn_level, widen_misfit=widen_misfit,
                  misfit_z=misfit_z, tails=tails, chi_z=chi_z, level_z=level_z)
    _from_arrays(track, s, rename=rename)
    return bool(raised[0])


def residual_of(measured: float | None, predicted: float | None) -> float | None:
    if not measured or not predicted or measured <= 0 or predicted <= 0:
        return None
    return math.log(measured / predicted)


def stand_in(predicted: Mapping[str, float | None], power_limit_w: float | None
             ) -> dict[str, float | None]:
    """What drift compares a result with where the model predicts no power or energy (the
    roofline before the first fit): the power limit, and the power limit times the
    predicted runtime. A track follows the card's own history either way (its level is
    learnt); this only arms it before a model exists. A refit moves it by
    log(stand-in / new prediction), like any model change."""
    out = dict(predicted)
    if power_limit_w and power_limit_w > 0:
        if not out.get("power"):
            out["power"] = float(power_limit_w)
        if not out.get("energy") and out.get("runtime"):
            out["energy"] = float(power_limit_w) * float(out["runtime"] or 0.0) or None
    return out


def long_run_scale(tr: Track, floor: float = 0.0) -> float:
    """A ready series' long-run scale sigma_e / (1 - phi) at its point estimate (as
    ``_params`` computes it, without the widening)."""
    phi = min(max(tr.cxy / tr.cxx, 0.0), RHO_MAX) if tr.cxx > 0 else 0.0
    var = max(tr.cyy - 2 * phi * tr.cxy + phi * phi * tr.cxx, 0.0) * tr.n / max(tr.n - 2, 1)
    var /= truncated(DEVICE_LEARN_Z if isinstance(tr, DeviceTrack) else LEARN_Z)
    return max(math.sqrt(var), floor * (1 - phi)) / (1 - phi)


def _level_of(tr: Track, floor: float) -> tuple[float, float] | None:
    """(level, variance of its estimate) of a track, from its baseline while it is taken;
    None with fewer than PEER_MIN_RESULTS results behind it."""
    if tr.ready():
        if tr.level_n < PEER_MIN_RESULTS or tr.reference is None:
            return None
        scale = long_run_scale(tr, floor)
        return tr.reference, scale * scale / tr.level_n
    b = tr.baseline
    if len(b) < PEER_MIN_RESULTS:
        return None
    mean = statistics.fmean(b)
    sd = max(statistics.stdev(b), floor)
    d = [x - mean for x in b]
    rho = min(max(sum(p * q for p, q in zip(d, d[1:])) / max(sum(x * x for x in d), 1e-300),
                  0.0), RHO_MAX)
    return mean, sd * sd * (1 + rho) / (1 - rho) / len(b)


def _calm(tr: Track) -> bool:
    """``in_control`` of a device's pooled series."""
    return bool(in_control(_to_arrays(tr, rename=_POOLED_NAMES))[0])


# ---------------------------------------------------------------- causes

# What changed with an alarm, from the probes' context against the reference period's:
# a bounded vocabulary (a label value), each with its words.
CAUSES = {
    "power_limit": "power limit changed",
    "clocks_thermal": "SM clocks down: thermal slowdown",
    "clocks_power_cap": "SM clocks down at the power cap (more power per clock: hotter or "
                        "aging card)",
    "clocks_hw_slowdown": "SM clocks down: hardware slowdown (power brake, external signal)",
    "clocks_other": "SM clocks down with no throttle reason (locked or application clocks)",
    "memory_clock": "memory clock down",
    "clocks_up": "SM clocks up",
    "temperature": "hotter at the same clocks",
    "same_clocks": "same clocks, less work: no counter explains it",
    "same_clocks_power": "same clocks, more power: no counter explains it",
    "unknown": "no probe context recorded",
}
THERMAL = {"sw_thermal_slowdown", "hw_thermal_slowdown"}
HW_SLOW = {"hw_slowdown", "hw_power_brake_slowdown"}
CTX_NORMAL = 30  # contexts per probe that describe the reference period
CTX_RECENT = 3  # ... and the latest
CLOCK_DROP = 0.01  # a clock 1% lower (or higher) has changed
TEMP_UP = 8.0  # degrees C hotter has changed


def context_row(ctx: Mapping[str, Any] | None) -> list[Any] | None:
    """A probe's context as drift keeps it: [SM MHz, memory MHz, C, power limit W,
    "reason|reason"] (None where a value is missing)."""
    if not ctx:
        return None

    def num(key: str, scale: float = 1.0) -> float | None:
        v: Any = ctx.get(key)
        try:
            f = float(v) / scale
        except (TypeError, ValueError):
            return None
        return f if math.isfinite(f) else None

    reasons = ctx.get("clock_event_reasons") or []
    if isinstance(reasons, str):
        reasons = [r for r in reasons.split("|") if r]
    return [num("sm_clock_hz", 1e6), num("mem_clock_hz", 1e6), num("temperature_c"),
            num("power_limit_w"), "|".join(sorted(str(r) for r in reasons))]


def _med(rows: list[list[Any]], i: int) -> float | None:
    vals = [r[i] for r in rows if r and r[i] is not None]
    return statistics.median(vals) if vals else None


def _reasons(rows: list[list[Any]]) -> set[str]:
    return {x for r in rows if r for x in str(r[4]).split("|") if x}


def name_cause(target: str, contexts: Mapping[str, Mapping[str, list[list[Any]]]],
               moved: Collection[str], runtime_cause: tuple[str, str] | None = None
               ) -> tuple[str, str]:
    """(cause, in words) of an alarm on ``target`` from the probes' contexts (per probe
    name: its reference period's rows, "normal", and the latest, "recent"; see
    ``context_row``), looking at the probes that moved (all where none is named).

    A changed power limit first (it moves every probe at the cap); then, for a slower
    runtime, SM clocks down on the probes that moved (and why: a thermal or hardware
    clock-event reason that was not there before, the power cap, or none), the memory
    clock; for more power or energy, clocks up, a hotter card; otherwise "same clocks":
    the case no counter explains, the one that needs a human. Energy follows the runtime's
    cause when the runtime is in alarm too (``runtime_cause``)."""
    have = {p: c for p, c in contexts.items() if c.get("normal") and c.get("recent")}
    if not have:
        return "unknown", CAUSES["unknown"]
    if target == "energy" and runtime_cause is not None and runtime_cause[0] != "unknown":
        return runtime_cause
    normal = [r for c in have.values() for r in c["normal"]]
    recent = [r for c in have.values() for r in c["recent"]]
    pl_n, pl_r = _med(normal, 3), _med(recent, 3)
    if pl_n and pl_r and abs(pl_r / pl_n - 1) >= CLOCK_DROP:
        return "power_limit", f"power limit {pl_n:.0f} -> {pl_r:.0f} W"
    probes = [p for p in have if p in moved] or list(have)
    ratios, mem, temps, new, capped = [], [], [], set(), False
    for p in probes:
        n, r = have[p]["normal"], have[p]["recent"]
        sm_n, sm_r = _med(n, 0), _med(r, 0)
        if sm_n and sm_r:
            ratios.append(sm_r / sm_n)
        mn, mr = _med(n, 1), _med(r, 1)
        if mn and mr:
            mem.append(mr / mn)
        tn, tr_ = _med(n, 2), _med(r, 2)
        if tn is not None and tr_ is not None:
            temps.append(tr_ - tn)
        new |= _reasons(r) - _reasons(n)
        capped |= bool({"sw_power_cap", "board_limit"} & _reasons(r))
    clock = statistics.median(ratios) if ratios else None
    hot = statistics.median(temps) if temps else None
    warm = f", {hot:+.0f} C" if hot is not None and abs(hot) >= 1 else ""
    if target == "runtime":
        if clock is not None and clock <= 1 - CLOCK_DROP:
            drop = f"SM clocks {100 * (clock - 1):+.1f}%{warm}"
            if new & THERMAL:
                return "clocks_thermal", f"{drop}: thermal slowdown ({', '.join(sorted(new))})"
            if new & HW_SLOW:
                return "clocks_hw_slowdown", f"{drop}: hardware slowdown " \
                                             f"({', '.join(sorted(new))})"
            if capped:
                return "clocks_power_cap", f"{drop} at the power cap (sw_power_cap): more " \
                                           "power per clock"
            return "clocks_other", f"{drop}, no throttle reason (locked or application " \
                                   "clocks?)"
        m = statistics.median(mem) if mem else None
        if m is not None and m <= 1 - CLOCK_DROP:
            return "memory_clock", f"memory clock {100 * (m - 1):+.1f}%"
        return "same_clocks", f"same clocks, less work{warm}"
    if clock is not None and clock >= 1 + CLOCK_DROP:
        return "clocks_up", f"SM clocks {100 * (clock - 1):+.1f}%{warm}"
    if hot is not None and hot >= TEMP_UP:
        return "temperature", f"{hot:+.0f} C at the same clocks (leakage, cooling)"
    return "same_clocks_power", f"same clocks, more {target}{warm}"


# ---------------------------------------------------------------- the monitor


class DriftMonitor:
    """All drift state of a daemon, configured by the ``drift`` section of the
    configuration; thread-safe use is the caller's (under State.lock). ``use_model_sigma``
    also floors a track's residual scale by the model's own uncertainty (off: see
    bench/RESULTS.md)."""

    def __init__(self, cfg: DriftConfig | None = None, path: Path | None = None, *,
                 use_model_sigma: bool = False):
        self.p = cfg or DriftConfig()
        self.use_model_sigma = use_model_sigma
        self.path = path
        # The CUSUMs allow for the tolerance: a wiggle of that amplitude drains them.
        self.kappa = allowance(self.p.shift, self.p.tolerance)
        # ... except the pooled one, whose reference follows the slow wiggles instead.
        self.kappa_fast = fast_allowance(self.p.shift)
        self.tol = math.log1p(min(self.p.tolerance, self.p.shift))
        self.tracks: dict[tuple[str, ProbeSpec, str], Track] = {}
        self.devices: dict[str, DeviceDrift] = {}
        self.model_version: str | None = None  # the model the references were taken under
        # The round being collected per device: the probes seen, per target what each
        # ready probe contributes to the pooled statistic, the targets a probe's own
        # track raised an alarm on.
        self._seen: dict[str, set[ProbeSpec]] = {}
        self._pending: dict[str, dict[str, dict[ProbeSpec, tuple[float, ...]]]] = {}
        self._probe_raised: dict[str, set[str]] = {}
        # Baselines just completed (per device and target): the pooled statistic's start.
        self._warm: dict[str, dict[str, dict[ProbeSpec, tuple[list[float], float, int]]]] = {}
        # Alarms raised and cleared, rebaselines: until a caller drains them (bounded).
        self.transitions: deque[Transition] = deque(maxlen=TRANSITIONS_MAX)
        if path is not None and path.exists():
            self._load(path)

    def drain(self) -> list[Transition]:
        """The transitions since the last drain, oldest first (and forget them)."""
        out = list(self.transitions)
        self.transitions.clear()
        return out

    def _note(self, kind: str, uuid: str, target: str, spec: ProbeSpec | None, tr: Track,
              now: float, since: float | None = None, **extra: Any) -> None:
        """Record an alarm raised or cleared on ``tr`` (a probe's track, or with spec None
        the device's): how far off (the latest measured / normal: the probe's latest
        result, or the round's pooled ratio), the CUSUM and its threshold; for the device,
        why and what changed with it."""
        ratio = tr.ratio if isinstance(tr, DeviceTrack) else \
            (math.exp(tr.prev) if tr.ready() else None)
        detail: dict[str, Any] = {"scope": "probe" if spec is not None else "pooled",
                                  "ratio": _finite(ratio),
                                  "shift": _finite(ratio - 1 if ratio is not None else None),
                                  "z": _finite(tr.last_z), "cusum": _finite(tr.cusum),
                                  "threshold": _finite(tr.h)}
        if isinstance(tr, DeviceTrack):
            detail["probes"] = tr.members
            detail["level_ratio"] = _finite(math.exp(tr.level)) if tr.ready() else None
            if kind == "alarm":
                detail.update(reason=tr.reason, cause=tr.cause, cause_text=tr.cause_text)
        if kind == "clear":
            detail["since"] = _finite(since)
        detail.update(extra)
        self.transitions.append(Transition(now, kind, uuid, target, spec, detail))

    def _update(self, tr: Track, value: float, floor: float, now: float, *,
                learn: bool) -> bool:
        """A probe's own track."""
        return update(tr, value, 0.0, shift=self.p.shift, arl0=self.p.arl0,
                      baseline_probes=self.p.baseline_probes, min_scale=floor, now=now,
                      learn=learn, kappa=self.kappa, tails=True)

    def _update_pooled(self, ds: DeviceTrack, z: float, gain: float, now: float, *,
                       learn: bool) -> bool:
        """A device's pooled statistic (``pooled_settings``)."""
        how = pooled_settings(ds.n, ds.band, gain, self.p.shift, self.p.tolerance)
        return update(ds, z - float(how["offset"]), 0.0, shift=self.p.shift, arl0=self.p.arl0,
                      baseline_probes=self.p.baseline_probes, min_scale=1.0, now=now,
                      learn=learn, gain=gain, phi_z=float(how["phi_z"]),
                      learn_z=DEVICE_LEARN_Z, kappa=float(how["kappa"]), cap_h=CAP_POOLED,
                      misfit_z=MISFIT_Z, tails=True, chi_z=float(how["chi_z"]),
                      level_z=float(how["level_z"]))

    # ------------------------------------------------------------------ updates
    def observe(self, uuid: str, spec: ProbeSpec, measured: Mapping[str, float | None],
                predicted: Mapping[str, float | None], sigma: Mapping[str, float],
                now: float | None = None, model_version: str | None = None, *,
                gpu_model: str | None = None, plan: Collection[ProbeSpec] | None = None,
                context: Mapping[str, Any] | None = None) -> list[Alarm]:
        """Feed one probe result; returns the alarms it raised: of the probe's own tracks,
        and of the device when it completed a round. Alarms raised and cleared are also
        kept in ``transitions`` (see ``drain``) for the record.

        A round is complete when every probe of ``plan`` (the device's sentinels) has
        reported, or, without a plan or when a probe failed, when a probe reports a second
        time. ``gpu_model`` names the device's peers (devices of the same model);
        ``context`` is the probe's (clocks, clock-event reasons, power limit, temperature:
        what names an alarm's cause). A result predicted by another model than the
        references were taken under (a refit just replaced it; references are being
        re-taken) is not judged.
        """
        now = time.time() if now is None else now
        if model_version is not None and self.model_version is not None and \
                model_version != self.model_version:
            return []
        dev = self.devices.setdefault(uuid, DeviceDrift())
        if gpu_model:
            dev.gpu_model = gpu_model
        raised: list[Alarm] = []
        if spec in self._seen.get(uuid, ()):
            raised += self._close_round(uuid, now)
        seen = self._seen.setdefault(uuid, set())
        seen.add(spec)
        row = context_row(context)
        if row is not None:
            ctx = dev.contexts.setdefault(spec.name, {"normal": [], "recent": []})
            ctx["recent"] = [*ctx["recent"], row][-CTX_RECENT:]
            if len(ctx["normal"]) < CTX_NORMAL and not self.device_drifting(uuid):
                ctx["normal"].append(row)
        pending = self._pending.setdefault(uuid, {})
        for target in self.p.targets:
            r = residual_of(measured.get(target), predicted.get(target))
            if r is None:
                continue
            tr = self.tracks.setdefault((uuid, spec, target), Track())
            ds = dev.track(target)
            floor = max(self.p.min_scale,
                        sigma.get(target, 0.0) if self.use_model_sigma else 0.0)
            was_ready, values = tr.ready(), [*tr.baseline, r]
            was, since = tr.drifting, tr.since
            # Learnt only while the device is in control: no alarm, no speed-up counting,
            # its slow level not confidently beyond the tolerance.
            calm = _calm(ds) and not ds.drifting and not ds.faster and self._settled(ds)
            if self._update(tr, r, floor, now, learn=calm):
                raised.append(Alarm(target, spec))
                self._probe_raised.setdefault(uuid, set()).add(target)
                self._note("alarm", uuid, target, spec, tr, now)
            elif was and not tr.drifting:
                self._note("clear", uuid, target, spec, tr, now, since)
            if tr.ready() and not was_ready:
                self._warm.setdefault(uuid, {}).setdefault(target, {})[spec] = \
                    (values, floor, tr.cut)
            if tr.ready() and tr.last_u is not None:
                scale = max(tr.scale or floor, floor)
                pending.setdefault(target, {})[spec] = (
                    tr.last_u, tr.gain, tr.prev, scale,
                    scale * scale / max(tr.level_n, 1.0))
        if plan is not None and seen >= set(plan):
            raised += self._close_round(uuid, now)
        if self.p.accept_after_s and self.device_drifting(uuid):
            since = min(s for s in self._alarm_starts(uuid))
            if now - since >= self.p.accept_after_s:
                logger.warning("device %s drifting for %.0f s: accepting its behaviour as the "
                               "new normal (drift.accept_after_s)", uuid, now - since)
                self.transitions.append(Transition(now, "rebaseline", uuid, None, None, {
                    "phase": "automatic", "reason": "drift.accept_after_s",
                    "drifting_s": now - since}))
                self.rebaseline(uuid, now=now)
        return raised

    def end_round(self, uuid: str, now: float | None = None) -> list[Alarm]:
        """Close the device's round now (callers that know a round ended)."""
        return self._close_round(uuid, time.time() if now is None else now)

    def _mine(self, uuid: str, target: str) -> dict[ProbeSpec, Track]:
        return {spec: tr for (u, spec, t), tr in self.tracks.items()
                if u == uuid and t == target}

    def _close_round(self, uuid: str, now: float) -> list[Alarm]:
        self._seen[uuid] = set()
        pending = self._pending.pop(uuid, {})
        probe_raised = self._probe_raised.pop(uuid, set())
        dev = self.devices.setdefault(uuid, DeviceDrift())
        raised: list[Alarm] = []
        faster: list[str] = []
        for target in self.p.targets:
            if dev.gpu_model:
                self._peers(uuid, target, now)
            ds = dev.track(target)
            mine = self._mine(uuid, target)
            members = pending.get(target) or {}
            if not ds.ready():
                self._pooled_baseline(uuid, target, ds, mine, members, now, raised)
                continue
            if not members:
                continue
            u, g, d, sc, lvar = (np.array(col, float) for col in zip(*members.values()))
            z, gain = pool(u, g, kappa=self.kappa_fast)
            calm = not any(mine[s].drifting for s in members) and not ds.drifting and \
                not ds.faster and self._settled(ds)
            fast = self._update_pooled(ds, float(z), float(gain), now, learn=calm)
            ds.members = len(members)
            y, prior = pooled_deviation(d, sc)
            ds.ratio = math.exp(float(y))
            w = 1.0 / (sc * sc)
            ref_var = float((w * w * lvar).sum() / w.sum() ** 2)
            alive = ds.fast or ds.cusum > (ds.h or math.inf) / 2
            was, since = ds.drifting, ds.since
            dv = _to_arrays(ds, DEVICE_FIELDS)
            common = min(max(ds.scale or 1.0, 1.0), math.sqrt(len(members)))
            up, down, speed = device_step(
                dv, [float(y)], [float(prior) * common], [ref_var],
                fast_raised=[fast], fast_alive=[alive], probe_raised=[target in probe_raised],
                probe_alive=[any(tr.drifting for tr in mine.values())], kappa=self.kappa,
                tolerance=self.p.tolerance, now=now, moved=together(d[None, :]))
            _from_arrays(ds, dv, DEVICE_FIELDS)
            for spec in members:  # what a speed-up moves each probe's normal by
                tr = mine[spec]
                tr.spd = tr.spd + tr.prev if ds.faster > 0 else 0.0
            self._after(uuid, target, ds, bool(up[0]), was and bool(down[0]), since, now,
                        raised)
            if speed[0]:
                faster.append(target)
        # A speed-up becomes the new normal only while nothing is in alarm (power that
        # drops while clocks are capped comes back when they are restored).
        for target in faster:
            if not self.device_drifting(uuid):
                self._speedup(uuid, target, dev.targets[target], self._mine(uuid, target),
                              now)
        return raised

    def _settled(self, ds: DeviceTrack) -> bool:
        """Not a device whose slow level is confidently beyond half the tolerance once its
        references have settled (a day of results learnt): a small sustained shift is no
        noise to learn. (While they settle, a daily cycle may still sit off them.)"""
        return not (ds.ready() and ds.level_n >= LEVEL_N and self.tol > 0 and
                    abs(ds.level) - 2 * (ds.level_se or 0.0) > self.tol / 2)

    def _after(self, uuid: str, target: str, ds: DeviceTrack, up: bool, down: bool,
               since: float | None, now: float, raised: list[Alarm]) -> None:
        """Name the cause of a device alarm raised or in progress; record raises, clears."""
        if ds.drifting:
            ds.cause, ds.cause_text = self.cause(uuid, target)
        if up:
            raised.append(Alarm(target, None))
            self._note("alarm", uuid, target, None, ds, now)
        if down:
            self._note("clear", uuid, target, None, ds, now, since)
            ds.cause = ds.cause_text = ""

    def cause(self, uuid: str, target: str) -> tuple[str, str]:
        """What changed with the device's alarm on ``target`` (see ``name_cause``)."""
        dev = self.devices.get(uuid)
        if dev is None:
            return "unknown", CAUSES["unknown"]
        moved = {s.name for s, tr in self._mine(uuid, target).items()
                 if tr.ready() and (tr.drifting or tr.cusum > 0 or tr.prev > self.kappa / 2)}
        rt = dev.targets.get("runtime")
        runtime = (rt.cause, rt.cause_text) if rt is not None and rt.drifting and \
            target != "runtime" and rt.cause else None
        return name_cause(target, dev.contexts, moved, runtime)

    def _pooled_baseline(self, uuid: str, target: str, ds: DeviceTrack,
                         mine: dict[ProbeSpec, Track], members: Mapping[ProbeSpec, Any],
                         now: float, raised: list[Alarm]) -> None:
        """A round before the device's pooled statistic is ready: start it from its
        probes' baselines once they are all taken; until then, compare each round with
        the first ones (a step this early would otherwise become the card's normal)."""
        if not mine:
            return
        warm = self._warm.get(uuid, {}).get(target)
        if all(tr.ready() for tr in mine.values()):
            if warm and set(warm) == set(mine):
                del self._warm[uuid][target]
                lens = {len(v) for v, _, _ in warm.values()}
                if len(lens) == 1 and lens.pop() >= BASE_FIRST + 1:
                    b = np.array([warm[s][0] for s in mine], float).T[:, None, :]
                    self._check_baseline(uuid, target, ds, mine, b, now, raised, warm)
                if self._warm_start(ds, warm):
                    return
            if members:  # no usable warm start: the pooled statistic takes its own baseline
                u, g = (np.array(col, float) for col in list(zip(*members.values()))[:2])
                z, gain = pool(u, g, kappa=self.kappa_fast)
                self._update_pooled(ds, float(z), float(gain), now, learn=True)
            return
        lens = {len(tr.baseline) for tr in mine.values()}
        if any(tr.ready() for tr in mine.values()) or len(lens) != 1:
            return
        n = lens.pop()
        if n < BASE_FIRST + 1:
            return
        b = np.array([tr.baseline for tr in mine.values()], float).T[:, None, :]
        self._check_baseline(uuid, target, ds, mine, b, now, raised, None)

    def _check_baseline(self, uuid: str, target: str, ds: DeviceTrack,
                        mine: dict[ProbeSpec, Track], b: np.ndarray, now: float,
                        raised: list[Alarm],
                        warm: dict[ProbeSpec, tuple[list[float], float, int]] | None) -> None:
        """One round of the baseline check (``b``: the baselines so far; ``warm``: they are
        complete, references just taken). Two rounds in a row far above the first ones are
        an alarm, and the values before them the normal; a complete baseline that ends far
        above its start takes its references before that end."""
        n = b.shape[0]
        hit = bool(baseline_check(b, self.p.min_scale, self.kappa)[0])
        ds.hits = ds.hits + 1 if hit else 0.0
        least = 1 if warm is not None else BASE_HITS
        if ds.hits >= least and not any(tr.cut for tr in mine.values()):
            cut = n - int(ds.hits)  # the values before the step are the normal
            for spec, tr in mine.items():
                tr.cut = cut
                if warm is not None:
                    values, floor, _ = warm[spec]
                    set_reference(tr, values, cut)
                    warm[spec] = (values, floor, cut)
        was, since = ds.drifting, ds.since
        dv = _to_arrays(ds, DEVICE_FIELDS)
        up, down = _alarm(dv, np.array([ds.hits >= BASE_HITS]), np.array([STEP]),
                          np.array([hit]), np.array([hit]), np.array([not hit]), now)
        _from_arrays(ds, dv, DEVICE_FIELDS)
        self._after(uuid, target, ds, bool(up[0]), was and bool(down[0]), since, now, raised)

    def _warm_start(self, ds: DeviceTrack,
                    warm: dict[ProbeSpec, tuple[list[float], float, int]]) -> bool:
        """The pooled statistic and the slow level over the rounds of its probes'
        baselines (taken together), so that they are ready with them rather than a
        baseline later. False where the baselines do not line up."""
        lengths = {len(v) for v, _, _ in warm.values()}
        if len(lengths) != 1 or lengths.pop() < 3:
            return False
        us, gs, devs, scales = [], [], [], []
        cut = 0
        for values, floor, c in warm.values():
            v = np.asarray(values, float)[:, None]
            st = start(v, [c or len(values)])
            u, g = innovations(st, v, floor)
            us.append(u[:, 0])
            gs.append(g[0])
            devs.append(v[:, 0] - st["reference"][0])
            scales.append(float(long_run_scales(st, floor)[0]))
            cut = max(cut, c)
        z, _ = pool(np.array(us).T, np.array(gs), kappa=self.kappa_fast)
        set_reference(ds, [float(x) for x in z], cut=max(cut - 1, 0))
        ys, _ = pooled_deviation(np.array(devs).T, np.array(scales))
        dv = _to_arrays(ds, DEVICE_FIELDS)
        warm_level(dv, ys[:, None])
        b = np.array([v for v, _, _ in warm.values()], float).T[:, None, :]
        dv["young_thr"] = young_threshold(b, np.array([cut]), self.p.min_scale, self.kappa)
        dv["young"] = np.zeros(1)
        _from_arrays(ds, dv, DEVICE_FIELDS)
        return True

    def _speedup(self, uuid: str, target: str, ds: DeviceTrack, mine: dict[ProbeSpec, Track],
                 now: float) -> None:
        """A speed-up held for SPEEDUP_ROUNDS rounds: each probe's normal moves to where
        it has been since (its mean deviation over those rounds, where lower), so that
        what follows is judged against it rather than hidden under it."""
        ratio = math.exp(ds.level)
        moved = 0
        n = max(ds.faster, 1.0)
        for tr in mine.values():
            sh = min(tr.spd / n, 0.0)
            tr.spd = 0.0
            if not tr.ready() or sh == 0.0 or tr.reference is None:
                continue
            tr.reference += sh
            tr.lx, tr.ly, tr.mx, tr.my, tr.last = (tr.lx + sh, tr.ly + sh, tr.mx + sh,
                                                   tr.my + sh, tr.last + sh)
            tr.prev -= sh
            tr.slow -= sh
            moved += 1
        ds.level, ds.faster, ds.band = 0.0, 0.0, 0.0
        ds.speedups += 1
        if target == "runtime":  # the new normal's context is re-taken too
            for ctx in self.devices[uuid].contexts.values():
                ctx["normal"] = []
        logger.warning("device %s: %s faster than normal (x%.3f) for %d rounds: taken as the "
                       "new normal", uuid, target, ratio, SPEEDUP_ROUNDS)
        self.transitions.append(Transition(now, "rebaseline", uuid, target, None, {
            "phase": "speedup", "target": target, "ratio": _finite(ratio), "probes": moved}))

    def _peers(self, uuid: str, target: str, now: float) -> None:
        """Compare the device's levels for ``target`` with its same-model siblings'."""
        dev = self.devices[uuid]
        ds = dev.track(target)
        sibs = [u for u, d in self.devices.items()
                if u != uuid and dev.gpu_model and d.gpu_model == dev.gpu_model]
        levels: dict[str, dict[ProbeSpec, tuple[float, float]]] = {}
        for (u, spec, t), tr in self.tracks.items():
            if t == target and (u == uuid or u in sibs):
                found = _level_of(tr, self.p.min_scale)
                if found is not None:
                    levels.setdefault(u, {})[spec] = found
        num = den = 0.0
        peers = 0
        for spec, (lv, var) in levels.get(uuid, {}).items():
            others = [levels[s][spec] for s in sibs if spec in levels.get(s, {})]
            if len(others) < self.p.peer_min_siblings:
                continue
            peers = max(peers, len(others))
            diff = lv - statistics.median(o[0] for o in others)
            v = var + math.pi / 2 * statistics.fmean(o[1] for o in others) / len(others)
            num, den = num + diff / v, den + 1 / v
        if not den:
            ds.peer_ratio = ds.peer_se = None
            ds.peers, ds.slower, ds.slower_since = 0, False, None
            return
        est = num / den
        # Correlated probes carry less evidence than independent ones: the pooled series'
        # long-run scale (1 when independent, up to sqrt(probes)) widens the error.
        infl = max(1.0, long_run_scale(ds)) if ds.ready() else 1.0
        se = math.sqrt(1 / den) * infl
        ds.peer_ratio, ds.peer_se, ds.peers = math.exp(est), se, peers
        # Flagged at PEER_Z standard errors past the margin; cleared only once the estimate
        # itself is back within it (a GPU near the margin does not flap).
        margin = math.log1p(self.p.peer_margin)
        slower = target == "runtime" and (est > margin if ds.slower
                                          else est - PEER_Z * se > margin)
        if slower and not ds.slower:
            logger.warning("device %s is slower than its %d %s peers on this host: %.3fx "
                           "their median (drift.peer_margin %.2f)", uuid, peers,
                           dev.gpu_model, math.exp(est), self.p.peer_margin)
            ds.slower_since = now
        elif not slower:
            ds.slower_since = None
        ds.slower = slower

    # ------------------------------------------------------------------ queries
    def _alarm_starts(self, uuid: str) -> list[float]:
        out = [t.since for (u, _, _), t in self.tracks.items()
               if u == uuid and t.drifting and t.since is not None]
        dev = self.devices.get(uuid)
        if dev is not None:
            out += [t.since for t in dev.targets.values() if t.drifting and t.since is not None]
        return out

    def target_drifting(self, uuid: str, target: str) -> bool:
        """The device's alarm for ``target`` (raised by its pooled statistic, its slow
        level or a probe's own track)."""
        dev = self.devices.get(uuid)
        if dev is not None and target in dev.targets and dev.targets[target].drifting:
            return True
        return any(t.drifting for (u, _, tg), t in self.tracks.items()
                   if u == uuid and tg == target)

    def device_drifting(self, uuid: str) -> bool:
        dev = self.devices.get(uuid)
        if dev is not None and any(t.drifting for t in dev.targets.values()):
            return True
        return any(t.drifting for (u, _, _), t in self.tracks.items() if u == uuid)

    # ------------------------------------------------------------------ references
    def rebaseline(self, uuid: str | None = None, now: float | None = None) -> int:
        """Forget references (of one device, or all): the next results set new ones; the
        alarms in progress end (noted as cleared by the rebaseline). Returns the number
        of probe tracks reset."""
        now = time.time() if now is None else now
        n = 0
        for key in list(self.tracks):
            if uuid is None or key[0] == uuid:
                old = self.tracks[key]
                if old.drifting:
                    self._note("clear", key[0], key[2], key[1], old, now, old.since,
                               reason="rebaseline")
                self.tracks[key] = Track(alarms=old.alarms)
                n += 1
        for u, dev in self.devices.items():
            if uuid is None or u == uuid:
                for t, d in dev.targets.items():
                    if d.drifting:
                        self._note("clear", u, t, None, d, now, d.since, reason="rebaseline")
                dev.targets = {t: DeviceTrack(alarms=d.alarms, fast_alarms=d.fast_alarms,
                                              speedups=d.speedups)
                               for t, d in dev.targets.items()}
                dev.contexts = {}
                self._seen.pop(u, None)
                self._pending.pop(u, None)
                self._warm.pop(u, None)
                self._probe_raised.pop(u, None)
        return n

    def rereference(self, uuid: str, spec: ProbeSpec, target: str,
                    residuals: list[float], model_sigma: float,
                    shift: float | None = None) -> None:
        """References under a new model, keeping the noise estimate and the alarm state.

        ``shift``: how much the new model moves this probe's residuals (log of the old
        prediction over the new one), where known: the track moves by it and keeps all it
        learnt. Otherwise its level is re-taken from past healthy residuals (newest
        first), and learnt again from there."""
        tr = self.tracks.setdefault((uuid, spec, target), Track())
        if shift is not None and math.isfinite(shift):
            tr.baseline = [v + shift for v in tr.baseline]
            if tr.ready() and tr.reference is not None:
                tr.reference += shift
                tr.lx, tr.ly, tr.mx, tr.my = tr.lx + shift, tr.ly + shift, tr.mx + shift, \
                    tr.my + shift
                tr.last += shift
            return
        if len(residuals) < self.p.baseline_probes:
            if not tr.drifting:
                self.tracks[(uuid, spec, target)] = Track(alarms=tr.alarms)
            return
        values = list(reversed(residuals))  # oldest first, as they happened
        if not tr.ready() or tr.n < 2:
            set_reference(tr, values)
        else:
            # Central moments do not move with the level: only the level is re-taken.
            ref = statistics.median(values)
            shift = ref - (tr.reference or 0.0)
            tr.reference, tr.level_n, tr.lx, tr.ly = ref, float(len(values)), ref, ref
            tr.mx, tr.my = tr.mx + shift, tr.my + shift
            tr.last, tr.prev = values[-1], values[-1] - ref
            tr.baseline = []
        # The device's pooled level was learnt against the old references: learn it again.
        dev = self.devices.get(uuid)
        if dev is not None and target in dev.targets and dev.targets[target].ready():
            ds = dev.targets[target]
            ds.level_n = min(ds.level_n, float(self.p.baseline_probes))
        self._pending.pop(uuid, None)
        self._seen.pop(uuid, None)
        self._warm.pop(uuid, None)

    # ------------------------------------------------------------------ persistence
    def save(self) -> None:
        if self.path is None:
            return
        data = {"version": 3, "model_version": self.model_version, "tracks": [
            {"uuid": u, "spec": asdict(s), "target": t, **asdict(tr)}
            for (u, s, t), tr in self.tracks.items()],
            "devices": [{"uuid": u, **asdict(d)} for u, d in self.devices.items()],
            # Baselines just completed whose pooled statistic has not started yet: a
            # restart between the two would otherwise take a second baseline.
            "warm": [{"uuid": u, "target": t, "spec": asdict(s), "values": v, "floor": f,
                      "cut": c}
                     for u, by in self._warm.items() for t, w in by.items()
                     for s, (v, f, c) in w.items()]}
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".drift-", suffix=".json")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(data, f)
            os.replace(tmp, self.path)
        except OSError as e:
            Path(tmp).unlink(missing_ok=True)
            raise naming(e, self.path) from None
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def _load(self, path: Path) -> None:
        try:
            data = json.loads(path.read_text())
            self.model_version = data.get("model_version")
            version = data.get("version", 1)
            for rec in data["tracks"]:
                key = (rec.pop("uuid"), ProbeSpec(**rec.pop("spec")), rec.pop("target"))
                self.tracks[key] = _v1_track(rec) if version < 2 else _make(Track, rec)
            for rec in data.get("devices", []):
                self.devices[rec["uuid"]] = DeviceDrift(
                    gpu_model=str(rec.get("gpu_model") or ""),
                    targets={t: _device_track(d, version)
                             for t, d in (rec.get("targets") or {}).items()},
                    contexts=_contexts(rec.get("contexts")))
            for rec in data.get("warm", []):
                self._warm.setdefault(rec["uuid"], {}).setdefault(rec["target"], {})[
                    ProbeSpec(**rec["spec"])] = ([float(x) for x in rec["values"]],
                                                 float(rec["floor"]), int(rec.get("cut", 0)))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            # A damaged state file must not stop the daemon: start over, loudly.
            logger.error("drift state %s unreadable (%s): references will be re-established",
                         path, e)
            self.tracks, self.devices, self._warm = {}, {}, {}

    def snapshot(self) -> dict[tuple[str, ProbeSpec, str], Track]:
        return {k: Track(**asdict(v)) for k, v in self.tracks.items()}

    def device_snapshot(self) -> dict[str, DeviceDrift]:
        return {u: DeviceDrift(d.gpu_model, {t: DeviceTrack(**asdict(x))
                                             for t, x in d.targets.items()})
                for u, d in self.devices.items()}


def _make(cls: type, rec: Mapping[str, Any]) -> Any:
    """A dataclass from a saved record; keys it does not know (a newer file) are ignored."""
    names = {f.name for f in fields(cls)}
    return cls(**{k: v for k, v in rec.items() if k in names})


def _device_track(rec: Mapping[str, Any], version: int) -> DeviceTrack:
    """A device's pooled track as saved; before version 3 its ``drifting`` was the pooled
    CUSUM's alarm, which is now the device's (raised by that CUSUM: a step)."""
    ds = _make(DeviceTrack, rec)
    if version < 3:
        ds.fast, ds.fast_since, ds.fast_alarms = ds.drifting, ds.since, ds.alarms
        ds.reason = "step" if ds.drifting else ""
    return ds


def _contexts(rec: Any) -> dict[str, dict[str, list[list[Any]]]]:
    if not isinstance(rec, dict):
        return {}
    return {str(p): {"normal": list(c.get("normal") or [])[:CTX_NORMAL],
                     "recent": list(c.get("recent") or [])[-CTX_RECENT:]}
            for p, c in rec.items() if isinstance(c, dict)}


def _v1_track(rec: Mapping[str, Any]) -> Track:
    """A track saved by gemmd before version 2 (reference, var, cov, prev, n): its
    reference and noise as the starting point, its alarm state as it was."""
    tr = Track(baseline=list(rec.get("baseline") or []), cusum=float(rec.get("cusum", 0.0)),
               drifting=bool(rec.get("drifting")), since=rec.get("since"),
               alarms=int(rec.get("alarms", 0)), h=rec.get("h"), last_z=rec.get("last_z"),
               scale=rec.get("scale"))
    ref = rec.get("reference")
    if ref is None:
        return tr
    var, cov = float(rec.get("var", 0.0)), float(rec.get("cov", 0.0))
    prev = float(rec.get("prev", 0.0))
    tr.reference, tr.level_n, tr.lx, tr.ly = float(ref), 10.0, float(ref), float(ref)
    tr.n = max(min(float(rec.get("n", 0.0)), NOISE_N), 2.0)
    tr.mx = tr.my = float(ref)
    tr.cxx = tr.cyy = var
    tr.cxy = cov
    tr.phi = float(_phi(np.array(var), np.array(cov)))
    tr.last, tr.prev = float(ref) + prev, prev
    return tr


def _finite(v: Any) -> float | None:
    """A number for the record: None where there is none (NaN, infinite)."""
    return float(v) if v is not None and math.isfinite(v) else None


def measured_of(m: Any) -> dict[str, float | None]:
    return {t: getattr(m, COLUMN[t]) for t in TARGETS}


def predicted_of(p: Any) -> dict[str, float | None]:
    return {t: getattr(p, COLUMN[t]) for t in TARGETS}
