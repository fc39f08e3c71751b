"""Drift detection per device: each probe's own track, the device's pooled evidence, peers.

Full arithmetic, parameters and benchmark figures: docs/drift.md. In short:

residual  r = log(measured / predicted), per probe result and target (runtime, power,
              energy). A card's steady offset from the model is not drift: each track
              learns its own level (the reference, exported as a ratio).
series    every track is a series with its own AR(1) model, fitted while in control:
              r_t - L = phi (r_{t-1} - L) + e_t. The CUSUM runs on the standardized
              innovations u = e / sigma_e (pre-whitening), which are independent when the
              model fits, so the false-alarm rate that Siegmund's formula gives for
              independent noise holds for autocorrelated noise too. A sustained shift d
              moves u by d (1 - phi) / sigma_e per result (the first by d / sigma_e).
learning  level, phi and sigma_e come from running moments of (previous, current) value
              pairs, learnt only while in control (no alarm, the series' and its device's
              CUSUMs low, see ``in_control``): a regression on the previous value stays
              unbiased under a gate on the past. The level is refined over the first
              LEVEL_N results learnt, then frozen, so a slow degradation is not absorbed;
              the noise keeps adapting (memory NOISE_N). What is uncertain is widened:
              sigma_e at its 99% chi-square bound, times (1 - phi) / (1 - phi_hi) for an
              autocorrelation PHI_Z standard errors above its estimate, and the allowance
              k raised by LEVEL_Z standard errors of the level. A noise estimate 10% low
              would multiply the false-alarm rate; these bounds shrink as results come.
CUSUM     S = max(0, S + min(u', cap) - k), k = half the steady response to ``shift``;
              alarm while S > h, h from ``arl0`` (healthy results between false alarms of
              one CUSUM) by Siegmund's approximation; clears when S is back at 0. No single
              result can raise an alarm from S = 0 (cap = max(4, k + 0.6 h)).
device    per device and target, once per round: the pooled statistic
              Z = sum_i g_i u_i / sqrt(sum_i g_i^2), g_i = (1 - phi_i) / sigma_e,i being how
              strongly probe i responds to a common shift (its weight: how informative it
              is). Z is a series of its own: its variance and autocorrelation, which are
              where the probes' correlation shows (independent probes: variance 1; fully
              correlated: the number of probes), are learnt while in control like a
              track's, and a CUSUM runs on its innovations. A slowdown of every probe adds
              up across probes; one of a single probe shows in that probe's own track.
alarm     a device is in alarm for a target while its pooled CUSUM or any of its probes'
              is; while in alarm for any target its results are kept out of refits until
              an operator re-baselines (or ``accept_after_s`` passes).
peers     a card slow from its first result is its own reference, so its CUSUMs never
              see it. Each device's levels are compared with those of the other devices
              of the same model on the host, probe by probe (median of the siblings),
              pooled by precision: slower than peers when the lower PEER_Z-sigma bound of
              the pooled ratio exceeds 1 + ``peer_margin`` (cleared when the ratio itself
              is back within it).

State is saved to a JSON file so a restart does not take a degraded card as its new
baseline (version 2; a version 1 file still loads). The arithmetic is written on numpy
arrays (``start``, ``step``, ``pool``), so that bench/drift.py simulates thousands of
GPUs with the code the daemon runs.
"""

from __future__ import annotations

import json
import logging
import math
import os
import statistics
import tempfile
import time
from collections import deque
from collections.abc import Collection, Mapping
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from gemmd.config import DriftConfig
from gemmd.errors import naming
from gemmd.gemm import COLUMN, TARGETS, ProbeSpec

logger = logging.getLogger(__name__)

RHO_MAX = 0.9  # largest lag-1 autocorrelation believed
Z_CAP = 4.0  # a standardized innovation counts at most this much (more if k + 0.6 h is)
CLEAN = 4.0  # innovations are winsorized at this many (safe) scales in the AR(1) filter
DEVICE_LEARN_Z = 3.0  # a pooled statistic learns only results within this many scales

NOISE_N = 720  # the noise estimate: cumulative over this many results, then EWMA 1/N
LEVEL_N = 720  # the level is refined over this many in-control results, then frozen
LEVEL_Z = 2.33  # allowance raised by this many standard errors of the level estimate
# Results are learnt (noise) while the series' CUSUM is at most min(LEARN_BELOW h,
# LEARN_ABS), its level only while the CUSUM is at 0: strict enough that a real shift is
# not learnt before it is caught, lenient enough that a track whose estimate is a little
# off still learns its way back (gating only at 0 left such tracks stuck).
LEARN_BELOW = 0.5
LEARN_ABS = 0.5
PHI_Z = 2.33  # widen for an autocorrelation this many standard errors above its estimate
DEVICE_PHI_Z = 1.0  # the same for a device's pooled series (white when its probes' are)
PEER_Z = 3.0  # slower than peers: the ratio's lower PEER_Z-sigma bound above the margin
PEER_MIN_RESULTS = 5  # results behind a level before it is compared with peers

# The per-series state, as arrays in ``step`` and as floats in Track.
SERIES_FIELDS = ("reference", "level_n", "lx", "ly", "n", "mx", "my", "cxx", "cxy", "cyy",
                 "last", "prev", "scale", "phi", "cusum", "drifting", "since", "alarms",
                 "h", "k", "last_z", "last_u", "gain")


def truncated(z: float) -> float:
    """E[x^2 | |x| < z] for a standard normal: what a symmetric cut at z leaves of a
    variance (1 without a cut)."""
    if math.isinf(z):
        return 1.0
    return 1 - 2 * z * math.exp(-z * z / 2) / math.sqrt(2 * math.pi) / math.erf(z / math.sqrt(2))


@dataclass
class Track:
    """Drift state of one series: a (device, probe, target), or a device's pooled
    statistic (DeviceTrack). ``reference``: the learnt level (log ratio; None while
    the baseline is taken)."""

    baseline: list[float] = field(default_factory=list)  # values while (re)baselining
    reference: float | None = None  # level L
    level_n: float = 0.0  # results behind the level (frozen at LEVEL_N)
    lx: float = 0.0  # level accumulators: mean of previous and current values
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

    def ready(self) -> bool:
        return self.reference is not None


@dataclass
class DeviceTrack(Track):
    """A device's pooled statistic for one target, and its standing among its peers."""

    members: int = 0  # probes pooled in the latest round
    ratio: float | None = None  # latest round's measured/normal, pooled over its probes
    peer_ratio: float | None = None  # normal against the median of same-model siblings
    peer_se: float | None = None  # standard error of log(peer_ratio)
    peers: int = 0  # siblings compared with
    slower: bool = False  # slower than its peers by more than peer_margin
    slower_since: float | None = None


@dataclass
class DeviceDrift:
    """Per device: its model name (who its peers are) and a pooled track per target."""

    gpu_model: str = ""
    targets: dict[str, DeviceTrack] = field(default_factory=dict)

    def track(self, target: str) -> DeviceTrack:
        return self.targets.setdefault(target, DeviceTrack())


class Alarm(NamedTuple):
    """A new alarm: of a probe's own track, or (spec None) of the device's pooled one."""

    target: str
    spec: ProbeSpec | None


class Transition(NamedTuple):
    """A change of a device's drift state, for the record (the store's events): ``kind``
    alarm (raised), clear (ended: its CUSUM back at 0, or a rebaseline), or rebaseline
    (``drift.accept_after_s`` took the device's behaviour as its new normal). ``spec``
    None: the device's pooled statistic (or, for a rebaseline, every track)."""

    ts: float
    kind: str
    uuid: str
    target: str | None
    spec: ProbeSpec | None
    detail: dict[str, Any]


TRANSITIONS_MAX = 10_000  # kept for a caller that drains them (the daemon drains each result)


# ---------------------------------------------------------------- the arithmetic


def upper_bound_factor(n_eff: Any) -> Any:
    """sigma_99% / sigma_hat for a variance estimated with n_eff - 1 degrees of freedom:
    sqrt(nu / chi2_0.01(nu)), the quantile by Wilson-Hilferty. Scalars or arrays."""
    nu = np.maximum(np.asarray(n_eff, float) - 1.0, 1.0)
    c = 1 - 2 / (9 * nu) - 2.326 * np.sqrt(2 / (9 * nu))
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


def _params(s: dict[str, np.ndarray], floor: Any, phi_z: float, learn_z: float = math.inf
            ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The series' AR(1) model: phi; the innovation scale sigma_e at its estimate (the
    regression's residual variance, n - 2 degrees of freedom) and at its safe bound, both
    at least floor (1 - phi) (``floor`` bounds the long-run scale sigma_e / (1 - phi));
    the standard error of the level, in innovation units; and where innovations are
    winsorized before they are learnt: CLEAN times the estimate's 99% bound (at least
    a twentieth of the floor), so that one result, however far off, moves the estimates by a
    bounded step (the floor alone would let a series far quieter than it learn a 5 %
    step as noise and then never see it).

    The safe bound: the 99% chi-square bound of sigma_e, times (1 - phi) / (1 - phi_hi):
    if the true autocorrelation is phi_hi, the upper ``phi_z``-sigma bound of the
    estimate, innovations filtered with phi wander that much more in the long run. The
    standard errors come from the moments actually learnt (results taken while in control
    may span a narrower range than all results would)."""
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
    hi = np.minimum(phi + phi_z * se_phi, RHO_MAX + 0.05)
    chi = upper_bound_factor(n - 1.0)
    ub = chi * np.maximum((1 - phi) / (1 - hi), 1.0)
    sig = np.maximum(raw, least)
    clip = CLEAN * np.maximum(raw * chi, 0.05 * least)
    # The level is (ly - phi lx) / (1 - phi): an error in phi moves it (in innovation
    # units) by se_phi (ly - lx) / (1 - phi), which counts where lx is far from it.
    off = se_phi * np.abs(s["ly"] - s["lx"]) / (1 - phi)
    lse = np.sqrt(sig * sig / np.maximum(s["level_n"], 1.0) + off * off)
    return phi, sig, np.maximum(raw * ub, least), lse, clip


def start(baseline: np.ndarray) -> dict[str, np.ndarray]:
    """Series state from baseline values (axis 0: time, at least 2; axis 1: series):
    the reference is their median, the noise their AR(1) moments after winsorizing at
    4 MADs. The state is a dict of arrays, one entry per series."""
    b = np.asarray(baseline, float)
    n0, cols = b.shape
    med = np.median(b, axis=0)
    mad = 1.4826 * np.median(np.abs(b - med), axis=0)
    bw = np.clip(b, med - CLEAN * mad, med + CLEAN * mad)
    x, y = bw[:-1], bw[1:]
    mx, my = x.mean(axis=0), y.mean(axis=0)
    z = np.zeros(cols)
    s = {"reference": med, "level_n": np.full(cols, float(n0)), "lx": med.copy(),
         "ly": med.copy(), "n": np.full(cols, float(n0 - 1)), "mx": mx, "my": my,
         "cxx": ((x - mx) ** 2).mean(axis=0), "cxy": ((x - mx) * (y - my)).mean(axis=0),
         "cyy": ((y - my) ** 2).mean(axis=0), "last": bw[-1].copy(), "prev": b[-1] - med,
         "scale": z.copy(), "phi": z.copy(), "cusum": z.copy(),
         "drifting": np.zeros(cols, bool), "since": np.full(cols, np.nan),
         "alarms": np.zeros(cols), "h": np.full(cols, np.nan), "k": np.full(cols, np.nan),
         "last_z": np.full(cols, np.nan), "last_u": np.full(cols, np.nan), "gain": z.copy()}
    s["phi"] = _phi(s["cxx"], s["cxy"])
    return s


def step(s: dict[str, np.ndarray], x: np.ndarray, *, gain: Any, floor: Any, learn: Any,
         shift: float, arl0: float, now: float = 0.0, phi_z: float | None = None,
         learn_z: float = math.inf) -> np.ndarray:
    """Feed one value per series (updated in place); returns where a new alarm was raised.

    ``gain``: how much a unit log shift moves x (1 for a residual; the pooled response for
    a device's Z); ``floor``: least long-run scale, in x's units; ``learn``: False where
    the caller knows the device is not in control (the series also checks its own state).
    Also sets ``last_u`` (innovation / raw sigma_e) and ``gain`` (its response to a unit
    log shift) for pooling. No I/O, no clock but ``now``.
    """
    phi_z = PHI_Z if phi_z is None else phi_z
    phi, sig, safe, lse, clip = _params(s, floor, phi_z, learn_z)
    level = s["reference"]
    pred = phi * s["last"] + (1 - phi) * level
    a = x - pred
    u = a / sig
    g = gain * (1 - phi) / sig
    k0 = math.log1p(shift) * gain * (1 - phi) / (2 * safe)
    k = k0 + LEVEL_Z * lse / safe
    h = threshold(k0, arl0)
    cap = np.maximum(Z_CAP, k + 0.6 * h)
    uc = a / safe
    # Learnt only while in control, and (``learn_z``) only results within learn_z scales
    # of the prediction: a symmetric cut, so the mean stays unbiased and the variance is
    # corrected by truncated(learn_z). The first result of a shift arrives while the
    # CUSUM is still at 0; to a pooled statistic it is a large one, and learnt it would
    # inflate the noise at once. (Not for a probe's own track: there the cut would also
    # act on phi's error, and keep a phi that is off from learning its way back.)
    gate = np.asarray(learn) & in_control(s) & (np.abs(a) <= learn_z * sig)
    at_zero = s["cusum"] == 0
    cusum = np.maximum(0.0, s["cusum"] + np.clip(uc, -cap, cap) - k)
    raised = ~s["drifting"] & (cusum > h)
    s["drifting"] = (s["drifting"] | raised) & (cusum > 0)
    s["since"] = np.where(raised, now, np.where(s["drifting"], s["since"], np.nan))
    s["alarms"] = s["alarms"] + raised
    s["cusum"], s["h"], s["k"], s["last_z"], s["last_u"], s["gain"] = cusum, h, k, uc, u, g
    s["prev"] = x - level
    # Learn from this result (winsorized) if the series was in control before it.
    xc = pred + np.clip(a, -clip, clip)
    n1 = np.where(gate, np.minimum(s["n"] + 1.0, NOISE_N), s["n"])
    al = np.where(gate, 1.0 / np.maximum(n1, 1.0), 0.0)
    dx, dy = s["last"] - s["mx"], xc - s["my"]
    s["mx"] = s["mx"] + al * dx
    s["my"] = s["my"] + al * dy
    s["cxx"] = (1 - al) * (s["cxx"] + al * dx * dx)
    s["cxy"] = (1 - al) * (s["cxy"] + al * dx * dy)
    s["cyy"] = (1 - al) * (s["cyy"] + al * dy * dy)
    s["n"] = n1
    lv = gate & at_zero & (s["level_n"] < LEVEL_N)
    ln = np.where(lv, s["level_n"] + 1.0, s["level_n"])
    be = np.where(lv, 1.0 / ln, 0.0)
    s["lx"] = s["lx"] + be * (s["last"] - s["lx"])
    s["ly"] = s["ly"] + be * (xc - s["ly"])
    s["level_n"] = ln
    phi1 = _phi(s["cxx"], s["cxy"])
    s["reference"] = np.where(lv, (s["ly"] - phi1 * s["lx"]) / (1 - phi1), level)
    s["last"] = xc
    _, _, safe1, _, _ = _params(s, floor, phi_z, learn_z)
    s["phi"] = phi1
    s["scale"] = safe1 / (1 - phi1)
    return raised


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


def in_control(s: dict[str, np.ndarray]) -> np.ndarray:
    """Where a series shows no evidence of a shift: no alarm, CUSUM at most
    min(LEARN_BELOW h, LEARN_ABS). Its next result is learnt only there (a gate on the
    past only: the regression on the previous value stays unbiased)."""
    bar = np.minimum(LEARN_BELOW * np.nan_to_num(s["h"], nan=np.inf), LEARN_ABS)
    return ~s["drifting"] & (s["cusum"] <= bar)


def pool(u: np.ndarray, g: np.ndarray, present: np.ndarray | None = None
         ) -> tuple[np.ndarray, np.ndarray]:
    """A device's pooled statistic from its probes' standardized innovations ``u`` and
    responses ``g`` (last axis: probes; ``present``: which reported this round):
    Z = sum g u / sqrt(sum g^2) (each u capped at Z_CAP), and its response to a unit log
    shift of every probe, sqrt(sum g^2)."""
    if present is None:
        present = np.ones(np.shape(u), bool)
    gg = np.where(present, g, 0.0)
    uu = np.where(present, np.clip(np.nan_to_num(u), -Z_CAP, Z_CAP), 0.0)
    norm = np.sqrt((gg * gg).sum(axis=-1))
    safe = np.where(norm > 0, norm, 1.0)
    return (gg * uu).sum(axis=-1) / safe, norm


# ---------------------------------------------------------------- one series at a time


def _to_arrays(tr: Track) -> dict[str, np.ndarray]:
    out = {}
    for name in SERIES_FIELDS:
        v = getattr(tr, name)
        out[name] = np.array([np.nan if v is None else v],
                             dtype=bool if name == "drifting" else float)
    return out


def _from_arrays(tr: Track, s: dict[str, np.ndarray]) -> None:
    for name in SERIES_FIELDS:
        v = s[name][0]
        if name == "drifting":
            tr.drifting = bool(v)
        elif name == "alarms":
            tr.alarms = int(v)
        elif name in ("since", "h", "k", "last_z", "last_u", "reference", "scale"):
            setattr(tr, name, None if math.isnan(v) else float(v))
        else:
            setattr(tr, name, float(v))


def set_reference(track: Track, values: list[float]) -> None:
    """Reference and noise of ``track`` from a run of healthy values, oldest first."""
    keep = {"alarms": track.alarms, "drifting": track.drifting, "since": track.since,
            "cusum": track.cusum}
    _from_arrays(track, start(np.asarray(values, float)[:, None]))
    track.baseline = []
    for name, v in keep.items():
        setattr(track, name, v)


def update(track: Track, value: float, model_sigma: float = 0.0, *, shift: float,
           arl0: float, baseline_probes: int, min_scale: float, now: float,
           use_model_sigma: bool = False, learn: bool = True, gain: float = 1.0,
           phi_z: float | None = None, learn_z: float = math.inf) -> bool:
    """Feed one value (a log residual; a device's Z with ``gain``) into ``track``, updated
    in place; True when it raised a new alarm. ``min_scale``: the floor of the long-run
    scale (floored further by the model's sigma when ``use_model_sigma``)."""
    floor = max(min_scale, model_sigma if use_model_sigma else 0.0)
    if not track.ready():
        track.baseline.append(value)
        if len(track.baseline) >= max(baseline_probes, 2):
            set_reference(track, track.baseline)
        return False
    s = _to_arrays(track)
    raised = step(s, np.array([value]), gain=gain, floor=floor, learn=learn, shift=shift,
                  arl0=arl0, now=now, phi_z=phi_z, learn_z=learn_z)
    _from_arrays(track, s)
    return bool(raised[0])


def residual_of(measured: float | None, predicted: float | None) -> float | None:
    if not measured or not predicted or measured <= 0 or predicted <= 0:
        return None
    return math.log(measured / predicted)


def long_run_scale(tr: Track, floor: float = 0.0) -> float:
    """A ready series' long-run scale sigma_e / (1 - phi) at its point estimate (as
    ``_params`` computes it, without the widening)."""
    phi = min(max(tr.cxy / tr.cxx, 0.0), RHO_MAX) if tr.cxx > 0 else 0.0
    var = max(tr.cyy - 2 * phi * tr.cxy + phi * phi * tr.cxx, 0.0) * tr.n / max(tr.n - 2, 1)
    var /= truncated(DEVICE_LEARN_Z if isinstance(tr, DeviceTrack) else math.inf)
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
    """``in_control`` of one series."""
    return bool(in_control(_to_arrays(tr))[0])


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
        self.tracks: dict[tuple[str, ProbeSpec, str], Track] = {}
        self.devices: dict[str, DeviceDrift] = {}
        self.model_version: str | None = None  # the model the references were taken under
        # The round being collected per device: the probes seen, and per target what each
        # ready probe contributes to the pooled statistic.
        self._seen: dict[str, set[ProbeSpec]] = {}
        self._pending: dict[str, dict[str, dict[ProbeSpec, tuple[float, float, float,
                                                                 float]]]] = {}
        # Baselines just completed (per device and target): the pooled statistic's start.
        self._warm: dict[str, dict[str, dict[ProbeSpec, tuple[list[float], float]]]] = {}
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
        the device's pooled one): how far off (the latest measured / normal: the probe's
        latest result, or the round's pooled ratio), the CUSUM and its threshold."""
        ratio = tr.ratio if isinstance(tr, DeviceTrack) else \
            (math.exp(tr.prev) if tr.ready() else None)
        detail: dict[str, Any] = {"scope": "probe" if spec is not None else "pooled",
                                  "ratio": _finite(ratio),
                                  "shift": _finite(ratio - 1 if ratio is not None else None),
                                  "z": _finite(tr.last_z), "cusum": _finite(tr.cusum),
                                  "threshold": _finite(tr.h)}
        if isinstance(tr, DeviceTrack):
            detail["probes"] = tr.members
        if kind == "clear":
            detail["since"] = _finite(since)
        detail.update(extra)
        self.transitions.append(Transition(now, kind, uuid, target, spec, detail))

    def _update(self, tr: Track, value: float, floor: float, now: float, *, learn: bool,
                gain: float = 1.0, phi_z: float | None = None,
                learn_z: float = math.inf) -> bool:
        return update(tr, value, 0.0, shift=self.p.shift, arl0=self.p.arl0,
                      baseline_probes=self.p.baseline_probes, min_scale=floor, now=now,
                      learn=learn, gain=gain, phi_z=phi_z, learn_z=learn_z)

    # ------------------------------------------------------------------ updates
    def observe(self, uuid: str, spec: ProbeSpec, measured: Mapping[str, float | None],
                predicted: Mapping[str, float | None], sigma: Mapping[str, float],
                now: float | None = None, model_version: str | None = None, *,
                gpu_model: str | None = None, plan: Collection[ProbeSpec] | None = None
                ) -> list[Alarm]:
        """Feed one probe result; returns the alarms it raised: of the probe's own tracks,
        and of the device's pooled statistic when it completed a round. Alarms raised and
        cleared are also kept in ``transitions`` (see ``drain``) for the record.

        A round is complete when every probe of ``plan`` (the device's sentinels) has
        reported, or, without a plan or when a probe failed, when a probe reports a second
        time. ``gpu_model`` names the device's peers (devices of the same model).
        A result predicted by another model than the references were taken under (a refit
        just replaced it; references are being re-taken) is not judged.
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
            if self._update(tr, r, floor, now, learn=_calm(ds)):
                raised.append(Alarm(target, spec))
                self._note("alarm", uuid, target, spec, tr, now)
            elif was and not tr.drifting:
                self._note("clear", uuid, target, spec, tr, now, since)
            if tr.ready() and not was_ready:
                self._warm.setdefault(uuid, {}).setdefault(target, {})[spec] = \
                    (values, floor)
            if tr.ready() and tr.last_u is not None:
                w = 1.0 / max(tr.scale or floor, floor) ** 2
                pending.setdefault(target, {})[spec] = (tr.last_u, tr.gain, tr.prev, w)
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

    def _close_round(self, uuid: str, now: float) -> list[Alarm]:
        self._seen[uuid] = set()
        pending = self._pending.pop(uuid, {})
        dev = self.devices.setdefault(uuid, DeviceDrift())
        raised = []
        for target in self.p.targets:
            if dev.gpu_model:
                self._peers(uuid, target, now)
            members = pending.get(target)
            if not members:
                continue
            u, g, d, w = (np.array(col, float) for col in zip(*members.values()))
            z, gain = pool(u, g)
            ds = dev.track(target)
            warm = self._warm.get(uuid, {}).pop(target, {})
            if not ds.ready() and not ds.baseline and set(warm) == set(members):
                ds.baseline = self._warm_start(uuid, target, warm)
            calm = not any(self.tracks[(uuid, spec, target)].drifting for spec in members)
            was, since = ds.drifting, ds.since
            new = self._update(ds, float(z), 1.0, now, learn=calm, gain=float(gain),
                               phi_z=DEVICE_PHI_Z, learn_z=DEVICE_LEARN_Z)
            if new:
                raised.append(Alarm(target, None))
            ds.members = len(members)
            ds.ratio = math.exp(float((w * d).sum() / w.sum()))
            if new:
                self._note("alarm", uuid, target, None, ds, now)
            elif was and not ds.drifting:
                self._note("clear", uuid, target, None, ds, now, since)
        return raised

    def _warm_start(self, uuid: str, target: str,
                    warm: dict[ProbeSpec, tuple[list[float], float]]) -> list[float]:
        """The pooled statistic over the rounds of its probes' baselines (when they were
        taken together), so that it is ready with them rather than a baseline later."""
        lengths = {len(v) for v, _ in warm.values()}
        if len(lengths) != 1 or lengths.pop() < 3:
            return []
        us, gs = [], []
        for values, floor in warm.values():
            st = start(np.asarray(values, float)[:, None])
            u, g = innovations(st, np.asarray(values, float)[:, None], floor)
            us.append(u[:, 0])
            gs.append(g[0])
        z, _ = pool(np.array(us).T, np.array(gs))
        return [float(x) for x in z]

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
        """The device's alarm for ``target``: its pooled statistic's or any probe's."""
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
                dev.targets = {t: DeviceTrack(alarms=d.alarms) for t, d in dev.targets.items()}
                self._seen.pop(u, None)
                self._pending.pop(u, None)
                self._warm.pop(u, None)
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
        data = {"version": 2, "model_version": self.model_version, "tracks": [
            {"uuid": u, "spec": asdict(s), "target": t, **asdict(tr)}
            for (u, s, t), tr in self.tracks.items()],
            "devices": [{"uuid": u, **asdict(d)} for u, d in self.devices.items()]}
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
                    targets={t: _make(DeviceTrack, d)
                             for t, d in (rec.get("targets") or {}).items()})
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            # A damaged state file must not stop the daemon: start over, loudly.
            logger.error("drift state %s unreadable (%s): references will be re-established",
                         path, e)
            self.tracks, self.devices = {}, {}

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
