"""One series' arithmetic (a probe's track, or a device's pooled statistic): its AR(1)
model learnt while in control, the CUSUM on its standardized innovations, on numpy arrays
(``start``, ``step``) and one Track at a time (``set_reference``, ``update``)."""

from __future__ import annotations

import contextlib
import math
import statistics
import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np

from gemmd.drift.params import (
    ALPHA,
    CAP_PROBE,
    CLEAN,
    DEVICE_LEARN_Z,
    EU_N,
    LEARN_ABS,
    LEARN_BELOW,
    LEARN_Z,
    LEVEL_N,
    LEVEL_Z,
    MISFIT_MAX,
    MISFIT_Z,
    NOISE_N,
    PHI_Z,
    REBASE_MIN,
    REBASE_N,
    RHO_MAX,
    TAIL_HI_N,
    TAIL_MAX,
    TAIL_SE,
    TAIL_Z,
)
from gemmd.drift.tracks import (
    _POOLED_NAMES,
    NOISE_FIELDS,
    DeviceTrack,
    Track,
    _from_arrays,
    _to_arrays,
)

# ---------------------------------------------------------------- the arithmetic


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


def _chi2_over_nu(nu: Any, z: float) -> Any:
    """chi2_p(nu) / nu by Wilson-Hilferty, ``z`` the normal quantile of p (negative for a
    lower quantile; the cube root's base kept at least 0.05)."""
    return np.maximum(1 - 2 / (9 * nu) + z * np.sqrt(2 / (9 * nu)), 0.05) ** 3


def upper_bound_factor(n_eff: Any, z: float = 2.326) -> Any:
    """sigma_99% / sigma_hat for a variance estimated with n_eff - 1 degrees of freedom:
    sqrt(nu / chi2_0.01(nu)) (``z``: another level's normal quantile). Scalars or
    arrays."""
    nu = np.maximum(np.asarray(n_eff, float) - 1.0, 1.0)
    out = np.sqrt(1.0 / _chi2_over_nu(nu, -z))
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


def _ar1(cxx: Any, cxy: Any, cyy: Any, n: Any = None, learn_z: float = math.inf
         ) -> tuple[np.ndarray, np.ndarray]:
    """An AR(1) model's phi and innovation variance from a series' moments; with ``n``,
    the variance corrected for its n - 2 degrees of freedom and for the learning cut at
    ``learn_z`` (truncated)."""
    cxx, cxy, cyy = np.asarray(cxx, float), np.asarray(cxy, float), np.asarray(cyy, float)
    phi = _phi(cxx, cxy)
    var = np.maximum(cyy - 2 * phi * cxy + phi * phi * cxx, 0.0)
    if n is not None:
        var = var * n / np.maximum(n - 2.0, 1.0) / truncated(learn_z)
    return phi, var


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
    n = s["n"]
    phi, var = _ar1(s["cxx"], s["cxy"], s["cyy"], n, learn_z)
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
         "tail": z.copy(), "tail_hi": z.copy(), "tn": z.copy(), "wander": np.ones(cols)}
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


def _tail_factor(p: np.ndarray, n: np.ndarray) -> np.ndarray:
    lo = p - TAIL_SE * np.sqrt(p * (1 - p) / n)
    q = np.interp(np.log(np.clip(lo, _TAIL_P[0], _TAIL_P[-1])), np.log(_TAIL_P), _TAIL_Q)
    return np.where(lo > _GAUSS_TAIL, np.clip(TAIL_Z / np.maximum(q, 1e-3), 1.0, TAIL_MAX),
                    1.0)


def tail_factor(s: dict[str, np.ndarray]) -> np.ndarray:
    """How much wider a series' scale must be for its innovations to fall beyond TAIL_Z
    scales as seldom as Gaussian ones, on either side: TAIL_Z over the Gaussian quantile
    of the share seen there (its lower bound at TAIL_SE standard errors), between 1 and
    TAIL_MAX, the wider side's. Heavy tails (a Student-t, say) leave the learnt scale too
    narrow for a CUSUM built on Gaussian ones: it is learnt within LEARN_Z scales, where
    a t3 hides a third of its variance. The upper tail counts too: real noise is often
    one-sided (a neighbour's burst, a busy host slow a GPU, nothing speeds it up), and
    measured only on the lower side it looked Gaussian. Both shares are learnt from
    in-control results only: of a slowdown, its first result at most. The upper side
    counts only from TAIL_HI_N results: in a young track (12-15 results) two or three
    above, the H200's own excursions and a slowdown's first result, widened the scale
    1.6-2x, and its replayed clock cap went unseen."""
    n = np.maximum(s["tn"], 1.0)
    hi = np.where(n >= TAIL_HI_N, _tail_factor(s["tail_hi"], n), 1.0)
    return np.maximum(_tail_factor(s["tail"], n), hi)


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
    s["tail_hi"] = s["tail_hi"] + np.where(calm, ((u > TAIL_Z) - s["tail_hi"]) /
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
    phi, var = _ar1(s["cxx"], s["cxy"], s["cyy"], s["n"], LEARN_Z)
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

# ---------------------------------------------------------------- one series at a time


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
    if track.noise and not _noisier(track.noise, values, cut):
        for name in NOISE_FIELDS:
            if name in track.noise:
                setattr(track, name, float(track.noise[name]))
        track.n, track.tn = min(track.n, REBASE_N), min(track.tn, REBASE_N)
        track.phi = float(_phi(np.array([track.cxx]), np.array([track.cxy]))[0])
    track.noise = None


def _noisier(noise: dict[str, float], values: list[float], cut: int) -> bool:
    """Whether a new baseline scatters more than the noise model kept from before a
    rebaseline allows: its first differences' mean square beyond the 99% chi-square
    bound of what that AR(1) model gives them (2 sigma_e^2 / (1 + phi)). A driver update
    or a busier host may have changed the noise; the model is then learnt anew."""
    v = np.asarray(values, float)
    c = cut if 2 <= cut < len(v) else len(v)
    d = np.concatenate([np.diff(v[:c]), np.diff(v[c:])])
    if len(d) < 2:
        return False
    phi, var_e = _ar1(noise.get("cxx", 0.0), noise.get("cxy", 0.0), noise.get("cyy", 0.0))
    expected = float(2 * var_e / (1 + phi))
    return bool(np.mean(d * d) > float(_chi2_over_nu(float(len(d)), 2.326)) * expected)


def noise_of(track: Track) -> dict[str, float] | None:
    """What a series learnt about its noise (NOISE_FIELDS) for a rebaseline to keep: a
    new level is no new noise. None where it has learnt from fewer than REBASE_MIN
    results; one still re-baselining passes on what it carries."""
    if not track.ready():
        return track.noise
    if track.n < REBASE_MIN:
        return None
    return {name: float(getattr(track, name)) for name in NOISE_FIELDS}


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


def long_run_scale(tr: Track, floor: float = 0.0) -> float:
    """A ready series' long-run scale sigma_e / (1 - phi) at its point estimate (as
    ``_params`` computes it, without the widening)."""
    phi, var = (float(x) for x in _ar1(
        tr.cxx, tr.cxy, tr.cyy, tr.n, DEVICE_LEARN_Z if isinstance(tr, DeviceTrack) else LEARN_Z))
    return max(math.sqrt(var), floor * (1 - phi)) / (1 - phi)


def _calm(tr: Track) -> bool:
    """``in_control`` of a device's pooled series."""
    return bool(in_control(_to_arrays(tr, rename=_POOLED_NAMES))[0])
