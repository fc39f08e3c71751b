"""A device's own statistics per target, on numpy arrays: its probes' innovations pooled
into one statistic, the round's deviation and its slow level, the baseline's and the young
check, and the device's alarm (raised, kept, cleared, intermittent)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from gemmd.drift.params import (
    ALPHA,
    ALPHA_BAND,
    BAD_Z,
    BASE_FIRST,
    BASE_HITS,
    BASE_Z,
    CLEAN,
    DEVICE_CHI_Z,
    DEVICE_LEVEL_Z,
    DEVICE_PHI_Z,
    DEVICE_YOUNG_N,
    FAST_K,
    GRADUAL,
    INTERMITTENT,
    INTERMITTENT_EPISODES,
    INTERMITTENT_GOOD,
    LEVEL_Z,
    PHI_Z,
    PROBE,
    QUIET_GAPS,
    QUIET_MAX,
    QUIET_MIN,
    SLOW_Z,
    SPEEDUP_ROUNDS,
    STEP,
    YOUNG_ROUNDS,
    Z_CAP,
)
from gemmd.drift.series import _quiet_nan, allowance, upper_bound_factor

# A device's own state per target, as arrays in ``device_step``.
DEVICE_FIELDS = ("drifting", "since", "alarms", "reason", "quiet", "gap_max", "episodes",
                 "good", "span", "bad_prev", "level", "level_se", "faster", "hits", "young",
                 "young_thr", "band")


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
