"""Fitting a forest and its intervals: repeats fitted as one row, the noise of one
measurement (from repeats, per noise group), and the split-conformal scale that makes
the nominal interval hold on configurations the forest has not seen; how far a
calibration's out-of-fold errors may widen or narrow its interval (cv_interval_scale)."""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping
from statistics import NormalDist
from typing import Any

import numpy as np

from gemmd.config import ModelConfig
from gemmd.features import Table

# Forest settings chosen by measurement (bench/model.py, docs/model.md): every feature at
# each split (a third of them tripled the median power error on the B200 data and won
# nowhere by more than noise); each tree draws at most MAX_SAMPLES rows, which bounds the
# fitting time whatever the size of the store.
MAX_FEATURES = 1.0
MAX_SAMPLES = 20_000
# A configuration measured at least this often on a device has an interval of its own
# there (_repeat_stats): its own noise and the forest's known error on it; such
# configurations also measure the noise no interval is narrower than (_noise_floors).
# Fewer repeats say little about noise: from 3 of GPPerf's heavy-tailed CUTLASS repeats,
# 90% intervals covered 97% of the held-out fourth (90% as they are).
MIN_REPEATS = 5
# Out-of-fold errors (a calibration's cross-validation over its probes) narrow an
# interval only where they cover the nominal share of new rows with this probability
# (cv_interval_scale), and at most to this factor. At 0.9, 20 probes (20 out-of-fold
# errors, 22 needed) could not narrow at all and 50 only to the 49th of 50: with six draws
# per count, the H200 sweeps' 20-probe cells were covered 92.0-97.5%; at 0.85 (from 19
# errors, to their largest) 85.1-95.2%, and the shared GPUs' 20-200-probe cells all
# within 85-95% (bench/RESULTS.md, a fifteenth session).
NARROW_CONFIDENCE = 0.85
NARROW_LO = 0.5


def _aggregate(y: np.ndarray, gid: np.ndarray
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(first row of each group, median y per group, count per group, group per row)."""
    _, first, inv, cnt = np.unique(gid, return_index=True, return_inverse=True,
                                   return_counts=True)
    order = np.lexsort((y, inv))
    ys = y[order]
    starts = np.concatenate([[0], np.cumsum(cnt)[:-1]])
    med = (ys[starts + (cnt - 1) // 2] + ys[starts + cnt // 2]) / 2
    return first, med, cnt, inv.ravel()


def _fit_one(X: np.ndarray, y: np.ndarray, gid: np.ndarray, cfg: ModelConfig, n_jobs: int,
             groups: np.ndarray | None = None) -> tuple[Any, float, np.ndarray, float]:
    """One forest on per-configuration medians: (forest, sigma, OOB prediction per row,
    interval scale).

    sigma is the noise of a single measurement around the prediction, in log space: the
    spread of repeats of one configuration where there are repeats, else the out-of-bag
    residual (which then also carries the model's own error: wider, not narrower). The
    interval scale makes the nominal interval hold on configurations the forest has not
    seen (see _interval_scale). ``groups``: each row's noise group (_noise_groups).
    """
    from sklearn.ensemble import RandomForestRegressor

    first, med, cnt, inv = _aggregate(y, gid)
    n = len(med)
    rf = RandomForestRegressor(
        n_estimators=cfg.n_estimators, max_depth=cfg.max_depth or None,
        min_samples_leaf=cfg.min_samples_leaf, max_leaf_nodes=cfg.max_leaf_nodes or None,
        max_features=MAX_FEATURES,
        max_samples=None if n <= MAX_SAMPLES else MAX_SAMPLES / n, oob_score=n >= 2,
        bootstrap=True,
        random_state=cfg.seed, n_jobs=n_jobs)
    with warnings.catch_warnings():
        # Configurations that every bootstrap drew have no OOB estimate; NaN below.
        warnings.filterwarnings("ignore", message="Some inputs do not have OOB")
        rf.fit(X[first], med, sample_weight=cnt.astype(np.float64))
    rf.n_jobs = 1  # predictions are single-threaded whatever the fit used
    # scikit-learn reports 0.0, not NaN, for a configuration that no tree left out (a
    # sentinel measured hundreds of times is in every bootstrap): NaN there.
    oob_g = np.full(n, np.nan)
    if n >= 2:
        left_out = np.zeros(n, dtype=bool)
        for inbag in rf.estimators_samples_:
            left_out |= np.bincount(inbag, minlength=n) == 0
        oob_g = np.where(left_out & np.isfinite(rf.oob_prediction_), rf.oob_prediction_,
                         np.nan)
    rep = cnt[inv] >= 2
    if _noise_from_repeats(cnt):
        dev = y[rep] - np.bincount(inv, weights=y)[inv][rep] / cnt[inv][rep]
        dof = float(rep.sum() - (cnt >= 2).sum())
        s = float(np.sqrt(np.sum(dev**2) / dof))
    else:
        resid = y - oob_g[inv]
        resid = resid[np.isfinite(resid)]
        s = float(np.sqrt(np.mean(resid**2))) if resid.size else 0.0
    # Measurement noise (from repeats) is a floor the scale may not shrink an interval
    # below; an out-of-bag residual (no repeats) is model error too, scaled like the rest.
    floor = _row_floors(groups, *_noise_floors(y, gid, groups, cfg.interval), len(y))
    scale = _interval_scale(rf, X[first], y, inv, s, cfg.interval, floor) \
        if n >= 2 else 1.0
    return rf, s, oob_g[inv], scale


def _loo_deviations(y: np.ndarray, gid: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(per measurement: its deviation from the median of the other measurements of its
    configuration, NaN where it has none; measurements of its configuration).

    What predicting a measurement by its configuration's typical value leaves: the noise
    of one measurement, with the error of the others' median (for normal noise, a
    variance pi / 2 / (n - 1) times the noise's) taken out. Unlike the spread around the
    mean it is not inflated by the rare outlier (a thermally throttled run, an idle
    power reading) beyond that outlier."""
    _, _, cnt, inv = _aggregate(y, gid)
    order = np.lexsort((y, inv))
    ys, gs = y[order], inv[order]
    starts = np.concatenate([[0], np.cumsum(cnt)[:-1]])[gs]
    n = cnt[gs]
    pos = np.arange(len(y)) - starts  # rank within its configuration
    m = np.maximum(n - 1, 1)  # the others

    def other(j: np.ndarray) -> np.ndarray:  # the j-th smallest of the others
        return ys[np.minimum(starts + j + (j >= pos), len(ys) - 1)]

    med = (other((m - 1) // 2) + other(m // 2)) / 2
    out = np.full(len(y), np.nan)
    out[order] = np.where(n >= 2, (ys - med) * np.sqrt(m / (m + math.pi / 2)), np.nan)
    return out, cnt[inv]


def _noise_floors(y: np.ndarray, gid: np.ndarray, groups: np.ndarray | None,
                  interval: float) -> tuple[float, dict[str, float]]:
    """The measurement noise as a log-space sd, overall and per noise group
    (_noise_groups; only groups that show it): the nominal share's conformal quantile
    of the repeats' deviations from their configuration's other measurements
    (_loo_deviations; configurations with at least MIN_REPEATS, each counting once)
    over the normal quantile; 0 (none) with fewer than 3 such configurations or 20
    repeats in all (3 configurations of 5 or 6 repeats: none). For normal
    noise this is its sd; for heavy-tailed noise it is what the nominal share needs.
    Noise differs between kernels and sizes (a 1 s window holds 47 GEMMs of one size and
    5,000 of another): per group where repeats allow."""
    dev, n = _loo_deviations(y, gid)
    ok = np.isfinite(dev) & (n >= MIN_REPEATS)
    z = NormalDist().inv_cdf(0.5 + interval / 2)

    def floor(sel: np.ndarray) -> float:
        if sel.sum() < 20 or np.sum(1.0 / n[sel]) < 2.5:  # 3 configurations
            return 0.0
        return _weighted_conformal_quantile(np.abs(dev[sel]), 1.0 / n[sel], interval) / z

    per: dict[str, float] = {}
    if groups is not None and ok.any():
        for g in np.unique(groups[ok]):
            if (f := floor(ok & (groups == g))) > 0:
                per[str(g)] = f
    return floor(ok), per


def _folded_half_width(b: np.ndarray, s: np.ndarray, p: float) -> np.ndarray:
    """The half-width h of the interval centred on 0 that holds the share ``p`` of
    N(b, s^2): z s for b = 0, about |b| + 1.28 s for |b| >> s (90%). A known offset
    added in quadrature (sqrt(b^2 + s^2) z) covers 95% at b = 2 s and 99% at b = 3 s."""
    from scipy.special import ndtr

    b, s = np.abs(b), np.maximum(s, 1e-12)
    z = NormalDist().inv_cdf(0.5 + p / 2)
    lo, hi = z * s, b + z * s  # the share at lo is at most p, at hi at least p
    for _ in range(50):
        h = (lo + hi) / 2
        inside = ndtr((h - b) / s) - ndtr((-h - b) / s) >= p
        lo, hi = np.where(inside, lo, h), np.where(inside, h, hi)
    return hi


def _noise_groups(t: Table) -> np.ndarray:
    """Per row, the group whose measurements share a noise level: kernel and dtype."""
    return np.char.add(np.char.add(t["kernel"].astype(str), "/"), t["dtype"].astype(str))


def _row_floors(groups: np.ndarray | None, overall: float, per: Mapping[str, float],
                n: int) -> np.ndarray:
    """Each row's noise floor: its group's where known, else the overall one."""
    out = np.full(n, overall)
    if groups is not None:
        for g, f in per.items():
            out[groups == g] = f
    return out


def _noise_from_repeats(cnt: np.ndarray) -> bool:
    """Enough repeated configurations (``cnt``: measurements per configuration) for the
    pooled spread of repeats to be the measurement noise: at least 3 repeated
    configurations and as many extra measurements as repeated configurations."""
    reps = int((cnt >= 2).sum())
    return reps >= 3 and int(cnt[cnt >= 2].sum()) >= 2 * reps


def _scale_for(r: np.ndarray, base: np.ndarray, floor: np.ndarray | float, z: float,
               interval: float, weight: np.ndarray | None = None) -> float:
    """The least factor c for which the interval z * max(c * base, floor) holds the
    nominal share of residuals ``r`` (split-conformal: each residual's smallest c that
    covers it, 0 where the floor alone does; their conformal quantile, each residual
    weighted by ``weight``). With no floor this is the quantile of |r| / base over z."""
    need = np.abs(r) / np.maximum(z * base, 1e-12)
    need = np.where(np.abs(r) <= z * np.asarray(floor), 0.0, need)
    ok = np.isfinite(need)
    if weight is None:
        return conformal_quantile(need[ok], interval)
    return _weighted_conformal_quantile(need[ok], weight[ok], interval)


def _weighted_conformal_quantile(x: np.ndarray, w: np.ndarray, p: float) -> float:
    """conformal_quantile with weights: the smallest score whose weighted share of
    scores at or below it, counting a new score of weight max(w) beyond all of them,
    reaches ``p`` (the largest score, widened by the new score's weight, when none does)."""
    order = np.argsort(x)
    x, w = x[order], w[order]
    total = w.sum() + w.max()
    cum = np.cumsum(w) / total
    k = int(np.searchsorted(cum, p - 1e-12))
    return float(x[k]) if k < len(x) else float(x[-1]) * (1.0 + w.max() / w.sum())


def _interval_scale(rf: Any, Xg: np.ndarray, y: np.ndarray, inv: np.ndarray, s: float,
                    interval: float, floor: np.ndarray | float = 0.0) -> float:
    """The factor on the log-space sd that makes the nominal interval cover that share of
    out-of-bag measurements (split-conformal on the trees that did not see a
    configuration): each measurement's residual against its configuration's OOB mean,
    over the OOB trees' spread combined with sigma. The trees' spread alone says little
    about a configuration nobody measured (the trees agree on what they all extrapolate
    alike); this factor, measured, replaces the assumption that it does.

    A configuration counts as at most MIN_REPEATS - 1 measurements, however often it
    was measured (a sentinel repeated a thousand times would otherwise decide the scale
    for every configuration, and its out-of-bag prediction often comes from the same GEMM
    on a sibling card, which is not a configuration the forest has not seen; it has an
    interval of its own, _repeat_stats). The interval is never narrower than ``floor``
    (per measurement), the measurement noise: the scale is the one that holds with it."""
    n = Xg.shape[0]
    tot, tot2, cnt = np.zeros(n), np.zeros(n), np.zeros(n)
    for est, inbag in zip(rf.estimators_, rf.estimators_samples_):
        oob = np.ones(n, dtype=bool)
        oob[inbag] = False
        if not oob.any():
            continue
        p = est.predict(Xg[oob])
        tot[oob] += p
        tot2[oob] += p * p
        cnt[oob] += 1
    ok_g = cnt >= 3
    if ok_g.sum() < 20:
        return 1.0
    mean = np.where(ok_g, tot / np.maximum(cnt, 1), np.nan)
    var = np.where(ok_g, np.maximum(tot2 / np.maximum(cnt, 1) - mean**2, 0.0), np.nan)
    sd = np.sqrt(var + s * s)[inv]
    r = y - mean[inv]
    ok = np.isfinite(r) & (sd > 0)
    if ok.sum() < 20:
        return 1.0
    z = NormalDist().inv_cdf(0.5 + interval / 2)
    weight = np.minimum(1.0, (MIN_REPEATS - 1) / np.bincount(inv)[inv])
    floor = np.broadcast_to(np.asarray(floor, dtype=np.float64), r.shape)
    return float(np.clip(_scale_for(r[ok], sd[ok], floor[ok], z, interval, weight[ok]),
                         0.25, 8.0))


def conformal_quantile(x: np.ndarray, p: float) -> float:
    """The split-conformal quantile of scores ``x``: the ceil((n+1)p)-th smallest, so
    that a new score falls at or below it with probability >= p (the largest score,
    widened by 1/n, when n is too small for that)."""
    x = np.sort(np.asarray(x, dtype=float))
    n = len(x)
    k = math.ceil((n + 1) * p)
    return float(x[k - 1]) if k <= n else float(x[-1]) * (1.0 + 1.0 / n)


def cv_interval_scale(scores: np.ndarray, p: float, z: float, hi: float) -> float:
    """The factor on an interval's half-width (``z`` standard errors) that out-of-fold
    ``scores`` (|log error| / the predicted standard error) say makes ``p`` of new rows
    covered, within NARROW_LO..``hi``.

    Wider on their split-conformal quantile: from min_cv_rows of them (fewer cannot say
    how wide: one probe outside an interval of 5 would widen it 4x; 98-100% coverage of
    the RTX 4070 and MI355X at 5 probes). Narrower only as far as they are sure of it:
    to the order statistic that covers ``p`` of new rows with probability
    NARROW_CONFIDENCE (the Beta law of a conformal quantile's coverage; from 19 of them
    at 90%, to their largest), so that a few lucky folds do not narrow it (from 20 of
    the shared data's H100 probes, the plain quantile's factors below 1 took coverage to
    74-81%; from 50, to 80-93%), while many probes do (200 of the RTX 4070's: 99.7%
    coverage at a factor of 1)."""
    n = len(scores)
    if n < min_cv_rows(p):
        return 1.0
    x = np.sort(np.asarray(scores, dtype=float))
    q = conformal_quantile(x, p) / z
    if q >= 1.0:
        return float(min(q, hi))
    from scipy.stats import beta  # with scikit-learn: fitting only

    k = np.arange(1, n + 1)
    sure = np.flatnonzero(beta.cdf(p, k, n + 1 - k) <= 1.0 - NARROW_CONFIDENCE)
    if not len(sure):
        return 1.0
    return float(np.clip(x[sure[0]] / z, NARROW_LO, 1.0))


def min_cv_rows(p: float) -> int:
    """The fewest out-of-fold errors whose split-conformal quantile at ``p`` is one of
    them (conformal_quantile: the ceil((n + 1) p)-th smallest of n)."""
    return math.ceil(p / (1 - p) - 1e-9)


def min_narrow_rows(p: float) -> int:
    """The fewest out-of-fold errors that can narrow an interval at ``p``
    (cv_interval_scale): even the largest of n covers ``p`` of new rows with probability
    NARROW_CONFIDENCE only from n >= log(1 - NARROW_CONFIDENCE) / log(p) (19 at 90%)."""
    return math.ceil(math.log(1.0 - NARROW_CONFIDENCE) / math.log(p) - 1e-9)


def _t_quantile(dof: float, p: float) -> float:
    """Student's t quantile at ``p`` with ``dof`` degrees of freedom."""
    from scipy.stats import t as student_t

    return float(student_t.ppf(p, dof))
