"""Fit, predict (with intervals), save and load the performance model.

Two predictors share one interface: the analytical roofline estimate used until enough
probes exist, and a Random Forest per target (runtime, power, energy) trained on stored
probes or imported measurements. Targets are learned in log space relative to physics
(runtime / roofline time, power / power limit, energy / FLOP) so that the forest predicts
efficiency, which carries to unseen sizes. Repeats of a configuration are fitted as one
row (their median); energy is power x runtime where the data agree. Intervals combine the
spread of the trees with the noise of a single measurement. Every prediction stays inside
the physical bounds of its GPU (gemmd.bounds); how far other GPUs' data carry to a GPU
never trained on, and a new GPU's first probes to the rest of its GEMMs, is what
leave-one-GPU-out validation on the training data measured at fit time (_validate).
docs/model.md has the why ("What the model trusts").
"""

from __future__ import annotations

import base64
import dataclasses
import functools
import hashlib
import json
import math
import os
import tempfile
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from statistics import NormalDist
from typing import Any

import numpy as np

from gemmd import bounds, features
from gemmd.config import ModelConfig
from gemmd.errors import ModelError, naming
from gemmd.features import Table
from gemmd.files import file_sha256
from gemmd.gemm import COLUMN, TARGETS, ProbeSpec
from gemmd.gpulibs import import_hiding_cupy
from gemmd.hardware import gpu_model_key
from gemmd.records import DeviceInfo, Prediction

# Bumped whenever features or target spaces change: older files are refused, not misread.
# 3: datasheet peaks from the GPU catalogue, calibrated intervals and the training domain.
# 4: the domain per target, validated transfer and extrapolation (meta "logo", "ood_sd").
MODEL_FORMAT = 4

# The only types a model file may contain; anything else is refused before loading.
TRUSTED_TYPES = [
    "sklearn.ensemble._forest.RandomForestRegressor",
    "sklearn.tree._classes.DecisionTreeRegressor",
    "sklearn.tree._tree.Tree",
    "numpy.random._mt19937.MT19937",
]

# Forest settings chosen by measurement (bench/model.py, docs/model.md): every feature at
# each split (a third of them tripled the median power error on the B200 data and won
# nowhere by more than noise); each tree draws at most MAX_SAMPLES rows, which bounds the
# fitting time whatever the size of the store.
MAX_FEATURES = 1.0
MAX_SAMPLES = 20_000
# A GEMM costs at least a launch: runtime is learned relative to the roofline time plus
# this (seconds), so tiny GEMMs are not 1000x "inefficient" on one GPU and 3000x on
# another, which transfers badly.
# 3 us: the least a cuBLAS/XLA GEMM took on the shared data's B200 and H100 was 3.4-4 us
# (bench/transfer.py: with it, 5 probes of a GPU predict its other GEMMs 2-4x better).
LAUNCH_S = 3e-6

Progress = Callable[[int], None]


class RooflinePredictor:
    """Runtime = roofline bound / assumed efficiency; no power or energy estimate."""

    kind = "roofline"
    version = "roofline"

    def __init__(self, efficiency: float = 0.7, interval_factor: float = 2.0):
        self.efficiency = efficiency
        # The estimate is rough: its interval spans a factor either way.
        self.interval_factor = interval_factor
        self.meta: dict[str, Any] = {"n_samples": 0, "scores": {}, "created": None}

    def predict(self, specs: Sequence[ProbeSpec], infos: Sequence[DeviceInfo]
                ) -> list[Prediction]:
        t_ = Table.from_specs(specs, infos)
        roof = features.roofline(t_)
        floor = bounds.runtime_floor(t_)
        out = []
        for r, f in zip(roof, floor):
            t = max(float(r) / self.efficiency, float(f))
            out.append(Prediction(runtime_s=t, runtime_lo=max(t / self.interval_factor, f),
                                  runtime_hi=t * self.interval_factor,
                                  sigma={"runtime": math.log(self.interval_factor) / 1.645},
                                  in_domain=False, domain="no model yet (roofline estimate)"))
        return out


# ------------------------------------------------------------------ target spaces


def launch_s(t: Table) -> np.ndarray:
    """LAUNCH_S per row; 0 for CUTLASS profiler rows (device time of back-to-back kernels,
    no launch in it: with 3 us their unseen-shape error grew from 4.4% to 5.4%)."""
    return np.where(t["kernel"] == "cutlass", 0.0, LAUNCH_S)


def runtime_reference(t: Table) -> np.ndarray:
    """What runtime is learned relative to: the roofline time plus a launch."""
    return features.roofline(t) + launch_s(t)


def _scale(target: str, t: Table) -> np.ndarray:
    """Physics reference each target is learned relative to (in log space)."""
    if target == "runtime":
        return runtime_reference(t)
    if target == "power":
        limits = np.array([d.power_limit_w or 1.0 for d in t.devices], dtype=np.float64)
        return limits[t.device] if len(t) else np.zeros(0)
    return features.flops(t)


def to_model_space(target: str, t: Table, values: np.ndarray | None = None) -> np.ndarray:
    """log(measured / reference); NaN where not measured."""
    raw = t[COLUMN[target]] if values is None else values
    with np.errstate(divide="ignore", invalid="ignore"):
        y = np.log(raw / _scale(target, t))
    y[~np.isfinite(y)] = np.nan
    return y


def from_model_space(target: str, t: Table, y: np.ndarray) -> np.ndarray:
    return np.exp(y) * _scale(target, t)


def table_hash(t: Table) -> str:
    """Identity of the training data: configuration and measured columns, in order."""
    h = hashlib.sha256()
    for c in sorted(t.cols):
        v = t.cols[c]
        h.update(c.encode())
        h.update(v.tobytes() if v.dtype != object else "\x1f".join(map(str, v)).encode())
    h.update(",".join(d.uuid for d in t.devices).encode() + t.device.tobytes())
    return h.hexdigest()[:16]


# ------------------------------------------------------------------ fast prediction


class _FlatForest:
    """All trees of one forest as flat arrays, walked together with numpy.

    scikit-learn's forest.predict costs milliseconds per call for a single row (thread
    pool set-up per call); walking the trees level by level over concatenated node arrays
    gives every tree's prediction for a few rows in well under a millisecond.
    """

    def __init__(self, trees: Sequence[Any]):
        feat, thr, left, right, value, roots = [], [], [], [], [], []
        offset = 0
        self.depth = 0
        for est in trees:
            tr = est.tree_
            n = tr.node_count
            leaf = tr.children_left < 0
            ids = np.arange(n)
            left.append(np.where(leaf, ids, tr.children_left) + offset)
            right.append(np.where(leaf, ids, tr.children_right) + offset)
            feat.append(np.where(leaf, 0, tr.feature))
            thr.append(np.where(leaf, np.inf, tr.threshold))
            value.append(tr.value[:, 0, 0])
            roots.append(offset)
            offset += n
            self.depth = max(self.depth, int(tr.max_depth))
        self.feature = np.concatenate(feat).astype(np.intp)
        self.threshold = np.concatenate(thr)
        self.left = np.concatenate(left).astype(np.intp)
        self.right = np.concatenate(right).astype(np.intp)
        self.value = np.concatenate(value)
        self.roots = np.asarray(roots, dtype=np.intp)

    def per_tree(self, X: np.ndarray) -> np.ndarray:
        """(trees x rows) predictions; X as float64 of float32 values, as scikit-learn sees."""
        rows = np.arange(X.shape[0])[None, :]
        node = np.repeat(self.roots[:, None], X.shape[0], axis=1)
        for _ in range(self.depth):
            go_left = X[rows, self.feature[node]] <= self.threshold[node]
            node = np.where(go_left, self.left[node], self.right[node])
        return self.value[node]


_FLAT_MAX_ROWS = 64  # above this, scikit-learn's compiled per-tree predict is faster


def _per_tree(rf: Any, flat: _FlatForest | None, X32: np.ndarray) -> np.ndarray:
    if flat is not None and X32.shape[0] <= _FLAT_MAX_ROWS:
        return flat.per_tree(X32.astype(np.float64))
    return np.stack([est.tree_.predict(X32)[:, 0] for est in rf.estimators_])


# ------------------------------------------------------------------ fitting


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
    over the normal quantile; 0 (none) with fewer than 3 such configurations. For normal
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


MAX_SHAPE_SET = 50_000  # distinct shapes a model remembers (8 bytes each, in its metadata)
# A configuration measured at least this often on a device has an interval of its own
# there (_repeat_stats): its own noise and the forest's known error on it; such
# configurations also measure the noise no interval is narrower than (_noise_floors).
# Fewer repeats say little about noise: from 3 of GPPerf's heavy-tailed CUTLASS repeats,
# 90% intervals covered 97% of the held-out fourth (90% as they are).
MIN_REPEATS = 5
# Each configuration's noise is shrunk toward the pooled noise, worth this many repeats.
NOISE_PRIOR_DOF = 4.0
MAX_REPEATED_CONFIGS = 20_000  # most repeated configurations a model remembers (12 bytes each)


@functools.lru_cache(maxsize=4096)
def _hash64(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little")


def _mix64(h: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer: every input bit moves every output bit (a plain multiply
    and xor left floats that differ in their top bits, alpha 1 vs 2, colliding)."""
    h = (h ^ (h >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    h = (h ^ (h >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return h ^ (h >> np.uint64(31))


_U64 = (1 << 64) - 1


def _mix64_int(h: int) -> int:
    """_mix64 on one Python int (a single prediction: no numpy call per column)."""
    h = ((h ^ (h >> 30)) * 0xBF58476D1CE4E5B9) & _U64
    h = ((h ^ (h >> 27)) * 0x94D049BB133111EB) & _U64
    return h ^ (h >> 31)


def config_hashes(t: Table) -> np.ndarray:
    """A 64-bit hash per row of (device uuid, configuration): features.config_ids'
    grouping, the same in any table."""
    if not len(t):
        return np.zeros(0, dtype=np.uint64)
    cols = [t[c] for c in features.CONFIG_KEYS]
    if len(t) <= _FLAT_MAX_ROWS:  # one prediction: Python ints, the same hash
        out = []
        for i in range(len(t)):
            acc = _hash64(t.devices[int(t.device[i])].uuid)
            for v in cols:
                x = v[i]
                bits = _hash64(str(x)) if v.dtype == object else \
                    int(np.float64(float(x) + 0.0).view(np.uint64))
                acc = _mix64_int(acc ^ bits)
            out.append(acc)
        return np.array(out, dtype=np.uint64)
    h = np.array([_hash64(d.uuid) for d in t.devices], dtype=np.uint64)[t.device]
    with np.errstate(over="ignore"):
        for v in cols:
            if v.dtype == object:
                u, inv = np.unique(v.astype(str), return_inverse=True)
                code = np.array([_hash64(x) for x in u], dtype=np.uint64)[inv.ravel()]
            else:  # + 0.0: -0.0 and 0.0 alike
                code = (np.asarray(v, dtype=np.float64) + 0.0).view(np.uint64)
            h = _mix64(h ^ code)
    return h


def _repeat_stats(rf: Any, X: np.ndarray, y: np.ndarray, gid: np.ndarray,
                  hashes: np.ndarray, s0: np.ndarray, interval: float
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per configuration measured at least MIN_REPEATS times (on one device), sorted by
    its config_hashes key: (key, the forest's offset from it, the sd of a new measurement
    around that offset), log space; for _encode_repeats.

    For a configuration the forest was trained on, a new measurement misses the
    prediction by the forest's offset from the configuration's median (the forest
    averages it with neighbours, and with sibling cards whose features are the same)
    plus the configuration's own noise: its repeats' deviations from the median of the
    others (_loo_deviations), as a mean square shrunk toward the pooled noise ``s0`` (per
    row: its noise group's) by NOISE_PRIOR_DOF repeats' worth, widened by Student's t
    over the normal quantile (a spread estimated from few repeats) and by the error of
    the median the offset is measured from. Neither the trees' spread nor a scale
    measured on other configurations says this (bench/RESULTS.md, "Interval coverage on
    repeated probes")."""
    from scipy.stats import t as student_t

    first, med, cnt, inv = _aggregate(y, gid)
    keep = cnt >= MIN_REPEATS
    if keep.sum() > MAX_REPEATED_CONFIGS:
        idx = np.flatnonzero(keep)
        keep = np.zeros_like(keep)
        keep[idx[np.argsort(-cnt[idx], kind="stable")[:MAX_REPEATED_CONFIGS]]] = True
    if not keep.any():
        return np.zeros(0, dtype=np.uint64), np.zeros(0), np.zeros(0)
    dev, _ = _loo_deviations(y, gid)
    n = cnt[keep].astype(np.float64)
    ms = np.bincount(inv, weights=np.nan_to_num(dev) ** 2, minlength=len(cnt))[keep]
    noise2 = (ms + NOISE_PRIOR_DOF * s0[first[keep]] ** 2) / (n + NOISE_PRIOR_DOF)
    p = 0.5 + interval / 2
    widen = student_t.ppf(p, n - 1 + NOISE_PRIOR_DOF) / NormalDist().inv_cdf(p)
    offset = rf.predict(X[first[keep]]) - med[keep]
    noise = np.sqrt(noise2 * (1.0 + math.pi / 2 / n)) * widen
    keys = hashes[first[keep]].astype(np.uint64)
    order = np.argsort(keys)
    keys, offset, noise = keys[order], offset[order], noise[order]
    # Two configurations with one key (a hash collision): neither gets its own interval.
    dup = np.zeros(len(keys), dtype=bool)
    dup[1:] |= keys[1:] == keys[:-1]
    dup[:-1] |= keys[1:] == keys[:-1]
    return keys[~dup], offset[~dup], noise[~dup]


def _encode_repeats(keys: np.ndarray, offset: np.ndarray, noise: np.ndarray,
                    interval: float) -> dict[str, str]:
    """The model's table of repeated configurations: base64 of the sorted uint64 keys
    and of each one's interval as a float32 log-space sd (the half-width over z of the
    interval around the prediction that holds the nominal share of N(offset, noise^2));
    {} when none."""
    if not len(keys):
        return {}
    sd = _folded_half_width(offset, noise, interval) / NormalDist().inv_cdf(0.5 + interval / 2)
    return {"keys": base64.b64encode(keys.astype(np.uint64).tobytes()).decode(),
            "sd": base64.b64encode(sd.astype(np.float32).tobytes()).decode()}


def shape_hashes(t: Table) -> np.ndarray:
    """A 64-bit hash per row of (GPU model, M, N, K, batch)."""
    keys = np.array([int.from_bytes(hashlib.sha256(gpu_model_key(d).encode()).digest()[:8],
                                    "little") for d in t.devices], dtype=np.uint64)
    h = keys[t.device] if len(t) else np.zeros(0, dtype=np.uint64)
    with np.errstate(over="ignore"):
        for c in ("m", "n", "k", "batch"):
            h = h * np.uint64(1_000_003) + t[c].astype(np.uint64)
    return h


def _shape_scale(t: Table, X: np.ndarray, forests: dict[str, Any], sigma: dict[str, float],
                 scale: dict[str, float], cfg: ModelConfig,
                 floor: Mapping[str, np.ndarray] | None = None
                 ) -> tuple[dict[str, float], str]:
    """Interval scale for shapes the model has not seen, and the set of those it has.

    The out-of-bag scale (_interval_scale) holds for a configuration left out, whose
    shape other configurations (tiles, layouts, dtypes) often still show the forest;
    predicting a new shape is harder. Where shapes repeat across configurations, a
    5-fold cross-validation grouped by shape (30 trees, at most 10,000 configurations)
    measures the scale that covers the nominal share of unseen shapes; elsewhere the
    out-of-bag scale already is that. ``floor``: per target and row of ``t``, the
    measurement noise no interval is narrower than (see _interval_scale). Returns ({}
    and '' when not needed)."""
    from sklearn.ensemble import RandomForestRegressor
    from sklearn.model_selection import GroupKFold

    hashes = shape_hashes(t)
    shapes, shape_id = np.unique(hashes, return_inverse=True)
    gid = features.config_ids(t)
    n_cfg = len(np.unique(gid))
    if len(shapes) < 10 or n_cfg < 1.5 * len(shapes):
        return {}, ""
    z = NormalDist().inv_cdf(0.5 + cfg.interval / 2)
    out: dict[str, float] = {}
    for target, _ in forests.items():
        y = to_model_space(target, t)
        ok = np.flatnonzero(np.isfinite(y))
        first, med, cnt, inv = _aggregate(y[ok], gid[ok])
        rows, sid = ok[first], shape_id[ok[first]]
        if len(rows) > 10_000:
            keep = np.sort(np.random.default_rng(cfg.seed).choice(len(rows), 10_000,
                                                                  replace=False))
            rows, med, cnt, sid = rows[keep], med[keep], cnt[keep], sid[keep]
        if len(np.unique(sid)) < 6:
            continue
        r, sds, floors = [], [], []
        rows_floor = (floor or {}).get(target, np.zeros(len(t)))
        for train, test in GroupKFold(5).split(rows, groups=sid):
            rf = RandomForestRegressor(
                n_estimators=30, max_depth=cfg.max_depth or None,
                min_samples_leaf=cfg.min_samples_leaf,
                max_leaf_nodes=cfg.max_leaf_nodes or None, max_features=MAX_FEATURES,
                max_samples=None if len(train) <= MAX_SAMPLES else MAX_SAMPLES / len(train),
                random_state=cfg.seed,
                n_jobs=1).fit(X[rows[train]], med[train],
                              sample_weight=cnt[train].astype(np.float64))
            per_tree = np.stack([e.tree_.predict(X[rows[test]].astype(np.float32))[:, 0]
                                 for e in rf.estimators_])
            sds.append(np.sqrt(per_tree.std(axis=0) ** 2 + sigma.get(target, 0.0) ** 2))
            r.append(med[test] - per_tree.mean(axis=0))
            floors.append(rows_floor[rows[test]])
        q = _scale_for(np.concatenate(r), np.concatenate(sds), np.concatenate(floors), z,
                       cfg.interval)
        out[target] = float(np.clip(max(q, scale.get(target, 1.0)), 0.25, 8.0))
    if "power" in out and "runtime" in out:
        out.setdefault("energy", out["runtime"])
    kept = base64.b64encode(np.sort(shapes).astype(np.uint64).tobytes()).decode() \
        if len(shapes) <= MAX_SHAPE_SET else ""
    return out, kept



# ------------------------------------------------------------------ validation at fit time

VALIDATION_TREES = 20  # trees of each forest fitted to validate (leave-one-GPU-out, sizes)
VALIDATION_TRAIN_MAX = 5_000  # configurations such a forest is fitted on, at most
VALIDATION_TEST_MAX = 1_500  # rows it is judged on, at most
LOGO_MAX_GPUS = 6  # GPU models left out in turn, at most (those with the most rows)
LOGO_MIN_ROWS = 20  # rows a GPU model needs to be left out and judged
LOGO_TRUST_GPUS = 9  # GPU models left out before their spread alone sets the "gpu" widening
SIZE_MIN_D = 0.5  # a row beyond the trained sizes is widened as if at least this far out
# The least widening per factor of 2 beyond the trained sizes, whatever the folds found
# (log-space sd): what lies beyond the data can hold what no fold inside it shows.
SIZE_SD_FLOOR = 0.05
SIZE_SHARE = 0.15  # the largest (smallest) sizes held out to validate extrapolation


def _quick_forest(X: np.ndarray, y: np.ndarray, gid: np.ndarray, cfg: ModelConfig) -> Any:
    """A small forest on per-configuration medians (VALIDATION_TREES, at most
    VALIDATION_TRAIN_MAX configurations), as _fit_one fits but without its intervals."""
    from sklearn.ensemble import RandomForestRegressor

    first, med, cnt, _ = _aggregate(y, gid)
    if len(med) > VALIDATION_TRAIN_MAX:
        keep = np.sort(np.random.default_rng(cfg.seed).choice(len(med), VALIDATION_TRAIN_MAX,
                                                              replace=False))
        first, med, cnt = first[keep], med[keep], cnt[keep]
    return RandomForestRegressor(
        n_estimators=VALIDATION_TREES, max_depth=cfg.max_depth or None,
        min_samples_leaf=cfg.min_samples_leaf, max_leaf_nodes=cfg.max_leaf_nodes or None,
        max_features=MAX_FEATURES, random_state=cfg.seed, n_jobs=1,
    ).fit(X[first], med, sample_weight=cnt.astype(np.float64))


def _fold_model(t: Table, idx: np.ndarray, X: np.ndarray, gid: np.ndarray, target: str,
                y: np.ndarray, sigma: float, cfg: ModelConfig) -> ForestModel:
    """A ForestModel of one target fitted on the rows ``idx`` of ``t`` (quickly): what a
    model trained on them alone predicts, with their domain and reference shapes."""
    tr = t.take(idx)
    rf = _quick_forest(X[idx], y[idx], gid[idx], cfg)
    meta = {"reference_shapes": _reference_shapes(tr), "domain": domain_record(tr),
            "roofline_efficiency": cfg.roofline_efficiency, "interval": cfg.interval}
    return ForestModel({target: rf}, {target: sigma}, NormalDist().inv_cdf(
        0.5 + cfg.interval / 2), meta)


def _test_rows(sel: np.ndarray, seed: int) -> np.ndarray:
    idx = np.flatnonzero(sel)
    if len(idx) > VALIDATION_TEST_MAX:
        idx = np.sort(np.random.default_rng(seed).choice(idx, VALIDATION_TEST_MAX,
                                                         replace=False))
    return idx


def _clip_logs(target: str, t: Table, mu: np.ndarray) -> np.ndarray:
    """Log points inside the physical bounds (gemmd.bounds), as predictions are served."""
    if target == "runtime":
        floor = bounds.runtime_floor(t)
        return np.where(floor > 0, np.maximum(mu, np.log(np.maximum(floor, 1e-300))), mu)
    if target == "power":
        idle, lim = bounds.power_range(t)
        with np.errstate(divide="ignore"):
            return np.clip(mu, np.log(idle), np.log(lim))
    return mu


def _need(r: np.ndarray, sd: np.ndarray, z: float, per: np.ndarray) -> np.ndarray:
    """Per residual: the spread ``per`` unit of distance must add (in quadrature to sd)
    for the interval z * sd to hold it; 0 where sd alone does."""
    return np.sqrt(np.maximum((np.abs(r) / z) ** 2 - sd**2, 0.0)) / np.maximum(per, 1e-12)


def _validate(t: Table, X: np.ndarray, gid: np.ndarray, forests: Mapping[str, Any],
              sigma: Mapping[str, float], in_scale: Mapping[str, float], cfg: ModelConfig
              ) -> tuple[dict[str, dict[str, float]], dict[str, dict[str, Any]]]:
    """What the training data say about predicting outside themselves, per forest target:
    ({target: {"size": spread per factor of 2 beyond the trained sizes, "gpu": spread on
    a GPU model never trained on}} where measured, {target: the leave-one-GPU-out
    record}); see _validate_size and _validate_transfer."""
    ood: dict[str, dict[str, float]] = {}
    transfer: dict[str, dict[str, Any]] = {}
    z = NormalDist().inv_cdf(0.5 + cfg.interval / 2)
    for target in forests:
        y = to_model_space(target, t)
        tau = dict(OOD_SD.get(target, OOD_SD["runtime"]))
        size = _validate_size(t, X, gid, target, y, sigma[target], in_scale[target], cfg, z)
        if size is not None:
            tau["size"] = ood.setdefault(target, {})["size"] = size
        rec = _validate_transfer(t, X, gid, target, y, sigma[target], in_scale[target], cfg,
                                 z, tau)
        if rec:
            transfer[target] = rec
            # GPUs left out are the units: below LOGO_TRUST_GPUS of them the nominal
            # share of GPUs cannot be told, and the spread is never taken below OOD_SD's
            gpu = rec["gpu_sd"] if len(rec["gpus"]) >= LOGO_TRUST_GPUS else \
                max(rec["gpu_sd"], tau["gpu"])
            ood.setdefault(target, {})["gpu"] = gpu
    return ood, transfer


def _validate_size(t: Table, X: np.ndarray, gid: np.ndarray, target: str, y: np.ndarray,
                   sigma: float, scale: float, cfg: ModelConfig, z: float) -> float | None:
    """The spread per factor of 2 beyond the trained sizes that makes the nominal interval
    hold there: the largest SIZE_SHARE of rows in M, N or K held out (then the smallest),
    a forest fitted on the rest, and each held-out row's residual set against the
    interval it would get in the domain, over how far beyond the range it lies (at least
    SIZE_MIN_D factors of 2); the conformal quantile of what each needs. None when the
    data do not span sizes enough to try."""
    ok = np.isfinite(y)
    lg = np.column_stack([np.log2(t[c]) for c in ("m", "n", "k")])
    needs = []
    for side in (1, -1):
        out = np.zeros(len(t), dtype=bool)
        for j in range(3):
            v = lg[ok, j]
            u = np.unique(v)
            if len(u) < 4:
                continue
            # the distinct size whose share beyond it is nearest SIZE_SHARE (sizes
            # often lie on a grid: a quantile there would leave nothing beyond it)
            cut = u[:-1] if side > 0 else u[1:]
            share = np.array([np.mean(side * (v - c) > 0) for c in cut])
            q = cut[int(np.argmin(np.abs(share - SIZE_SHARE)))]
            out |= (side * (lg[:, j] - q) > 0) & ok
        train = ok & ~out
        if out.sum() < LOGO_MIN_ROWS or train.sum() < 3 * LOGO_MIN_ROWS:
            continue
        fold = _fold_model(t, np.flatnonzero(train), X, gid, target, y, sigma, cfg)
        te_idx = _test_rows(out, cfg.seed + (side > 0))
        te = t.take(te_idx)
        d = domain_flags(fold.meta["domain"], te)["size"]
        mu, sd = fold.raw_logs(te, scaled=False)[target]
        mu = _clip_logs(target, te, mu)
        r = np.log(te[COLUMN[target]]) - mu
        far = (d > 0) & np.isfinite(r)
        if far.any():
            needs.append(_need(r[far], sd[far] * scale, z, np.maximum(d[far], SIZE_MIN_D)))
    if not needs or sum(len(n) for n in needs) < LOGO_MIN_ROWS:
        return None
    return float(np.clip(conformal_quantile(np.concatenate(needs), cfg.interval),
                         SIZE_SD_FLOOR, 2.0))


def _validate_transfer(t: Table, X: np.ndarray, gid: np.ndarray, target: str,
                       y: np.ndarray, sigma: float, scale: float, cfg: ModelConfig, z: float,
                       tau: Mapping[str, float]) -> dict[str, Any]:
    """Leave-one-GPU-out on the training data (at least two GPU models with the target
    measured): each GPU model in turn predicted by a forest of the others, as the model
    predicts a GPU it never saw. For runtime, every (w, a) of TRANSFER_GRID is judged
    (ForestModel.transfer_runtime): the one with the least mean error relative to the
    roofline estimate's (each held-out GPU counts once) is chosen. Returns {} without two
    GPU models, else {"w", "a", "gpus", "scores" (per candidate: mean MAPE / roofline
    MAPE), "mape" (per held-out GPU at the choice), "roofline_mape", "level_sd" (how far
    a held-out GPU's level was off: the root mean square of their median log residual),
    "shape_sd" (the scatter around it: median of their MAD x 1.4826) and "gpu_sd" (the
    spread that makes the nominal interval, with the other widenings a row gets, hold
    on the held-out GPUs' rows, each GPU weighted alike)}."""
    ok = np.isfinite(y)
    if not ok.any():
        return {}
    keys = np.array([gpu_model_key(d) for d in t.devices], dtype=object)[t.device]
    names, counts = np.unique(keys[ok], return_counts=True)
    if len(names) < 2:
        return {}
    order = np.argsort(-counts, kind="stable")
    gpus = [str(names[i]) for i in order[:LOGO_MAX_GPUS] if counts[i] >= LOGO_MIN_ROWS]
    if not gpus:
        return {}
    eff = cfg.roofline_efficiency
    grid = TRANSFER_GRID if target == "runtime" else ((1.0, 1.0),)
    err: dict[tuple[float, float], list[float]] = {c: [] for c in grid}
    roof_err: list[float] = []
    folds = []
    fold_groups: list[np.ndarray] = []
    for g_i, g in enumerate(gpus):
        fold = _fold_model(t, np.flatnonzero(ok & (keys != g)), X, gid, target, y, sigma, cfg)
        te_idx = _test_rows(ok & (keys == g), cfg.seed + g_i)
        te = t.take(te_idx)
        yt = np.log(te[COLUMN[target]])
        flags = domain_flags(fold.meta["domain"], te)
        mu, sd = fold.raw_logs(te, scaled=False)[target]
        cands = {}
        if target == "runtime":
            todo = flags["gpu"] & ~flags["kernel"]
            level = fold.forest_levels(te, todo)
            ref = np.log(runtime_reference(te))
            zz = np.where(todo, mu - ref - level, 0.0)
            for w, a in grid:
                p = np.where(todo, ref + (1 - w) * math.log(1 / eff) + w * level + a * zz, mu)
                cands[(w, a)] = _clip_logs(target, te, fold._fallback(target, te, p, flags))
            roof = features.roofline(te) / eff
            roof_err.append(float(np.mean(np.abs(roof / np.exp(yt) - 1))))
        else:
            cands[(1.0, 1.0)] = _clip_logs(target, te, mu)
            roof_err.append(float("nan"))
        for c, p in cands.items():
            err[c].append(float(np.mean(np.abs(np.expm1(p - yt)))))
        folds.append((yt, cands, sd * scale, flags))
        fold_groups.append(_groups(te))
    ratio = {c: float(np.mean(np.array(e) / np.array(roof_err))) if target == "runtime"
             else float(np.mean(e)) for c, e in err.items()}
    best = min(grid, key=lambda c: (ratio[c], grid.index(c)))
    levels, spreads, needs, weights = [], [], [], []
    for yt, cands, sd, flags in folds:
        r = yt - cands[best]
        med = float(np.median(r))
        levels.append(med)
        spreads.append(1.4826 * float(np.median(np.abs(r - med))))
        other = widen(target, np.zeros(len(r)), flags, skip=("gpu",), tau=tau)
        needs.append(_need(r, np.hypot(sd, other), z, np.ones(len(r))))
        weights.append(np.full(len(r), 1.0 / len(r)))
    gpu_sd = _weighted_conformal_quantile(np.concatenate(needs), np.concatenate(weights),
                                          cfg.interval)
    shape_sd = float(np.median(spreads)) or RESID_SD0
    n0, gain = _validate_calibration([(yt - cands[best], g) for (yt, cands, _, _), g
                                      in zip(folds, fold_groups)], shape_sd, cfg.seed)
    return {"w": best[0], "a": best[1], "gpus": gpus,
            "scores": {f"{w:g},{a:g}": v for (w, a), v in ratio.items()},
            "mape": dict(zip(gpus, err[best])),
            "roofline_mape": dict(zip(gpus, roof_err)) if target == "runtime" else {},
            "level_sd": float(np.sqrt(np.mean(np.square(levels)))),
            "shape_sd": shape_sd, "gpu_sd": float(np.clip(gpu_sd, 0.02, 3.0)),
            "level_n0": n0, "calibration_gain": gain}


# How many probes' worth the prior's level counts for against a new GPU's own
# (calibrate: the level is shrunk toward the prior by this pseudo-count), the candidates
# leave-one-GPU-out judges: simulated calibrations of each held-out GPU on CAL_PROBES
# random rows of it (CAL_DRAWS draws each), the pseudo-count with the least mean error
# relative to no calibration (the largest among equals: the prior is kept unless the
# probes help).
LEVEL_N0_GRID = (0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0)
CAL_PROBES = (5, 20)
CAL_DRAWS = 20


def _validate_calibration(resid: Sequence[tuple[np.ndarray, np.ndarray]], s0: float,
                          seed: int) -> tuple[float, dict[str, float]]:
    """(the chosen pseudo-count of LEVEL_N0_GRID, {probes: mean error relative to none
    at that choice}) from each held-out GPU's log residuals (measured minus predicted, as
    carried over) and dtype/kernel group per row: calibrate's level and group offsets,
    each with that pseudo-count, on random rows of the GPU, judged on all of its rows."""
    rng = np.random.default_rng(seed)
    ratio: dict[float, list[float]] = {n0: [] for n0 in LEVEL_N0_GRID}
    per_n: dict[float, dict[int, list[float]]] = {n0: {n: [] for n in CAL_PROBES}
                                                  for n0 in LEVEL_N0_GRID}
    for r, groups in resid:
        ok = np.isfinite(r)
        r, groups = r[ok], groups[ok].astype(str)
        base = float(np.mean(np.abs(np.expm1(-r))))
        if len(r) < 2 * max(CAL_PROBES) or base <= 0:
            continue
        names_all, g_all = np.unique(groups, return_inverse=True)
        for n in CAL_PROBES:
            draws = [rng.choice(len(r), n, replace=False) for _ in range(CAL_DRAWS)]
            for n0 in LEVEL_N0_GRID:
                tau = s0 / math.sqrt(n0)
                errs = []
                for idx in draws:
                    present, gi = np.unique(g_all[idx], return_inverse=True)
                    b, cg = _robust_offsets(r[idx], gi.ravel(), len(present), s0, tau,
                                               np.full(len(present), tau))
                    shift = np.full(len(names_all), b)
                    shift[present] += cg
                    errs.append(float(np.mean(np.abs(np.expm1(shift[g_all] - r)))))
                ratio[n0].append(float(np.mean(errs)) / base)
                per_n[n0][n].append(float(np.mean(errs)) / base)
    if not ratio[LEVEL_N0_GRID[0]]:
        return LEVEL_N0_DEFAULT, {}
    mean = {n0: float(np.mean(v)) for n0, v in ratio.items()}
    best = min(LEVEL_N0_GRID, key=lambda n0: (round(mean[n0], 4), -n0))
    return best, {str(n): float(np.mean(v)) for n, v in per_n[best].items()}


def _energy_is_derived(t: Table, forests: dict[str, Any]) -> bool:
    """True when a power and a runtime forest exist and energy was either never measured
    (energy per GEMM is then average power x runtime by definition) or is power x runtime
    within 5% at the median on the rows that have all three."""
    if not {"power", "runtime"} <= set(forests):
        return False
    e, p, r = t["energy_j"], t["power_w"], t["runtime_s"]
    if not np.isfinite(e).any():
        return True
    both = np.isfinite(e) & np.isfinite(p) & np.isfinite(r)
    if not both.any() or both.sum() < np.isfinite(e).sum() / 2:
        return False
    return float(np.median(np.abs(np.log(e[both] / (p[both] * r[both]))))) < 0.05


# ------------------------------------------------------------------ the forest


class ForestModel:
    """One RandomForestRegressor per target, each on the rows where that target was measured."""

    kind = "random_forest"

    def __init__(self, forests: dict[str, Any], sigma: dict[str, float], z: float,
                 meta: dict[str, Any]):
        self.forests = forests
        self.sigma = sigma  # out-of-bag residual std per target, log space
        self.z = z
        self.meta = meta
        self.version = str(meta.get("version", "rf"))
        self._flat: dict[str, _FlatForest] = {}
        self._anchor_cache: dict[tuple, float] = {}
        self._shape_set: np.ndarray | None = None
        self._repeats: dict[str, tuple[np.ndarray, np.ndarray]] | None = None

    @classmethod
    def fit(cls, rows: Sequence[Mapping[str, Any]], infos: Sequence[DeviceInfo],
            cfg: ModelConfig, *, progress: Progress | None = None) -> ForestModel:
        """Fit on probe rows (store dicts) with the DeviceInfo of each row's device."""
        if len(rows) < cfg.min_samples:
            raise ModelError(f"{len(rows)} samples, fewer than model.min_samples "
                             f"({cfg.min_samples})")
        # One identity for one training set: fit_table's table_hash.
        return cls.fit_table(Table.from_rows(rows, infos), cfg, progress=progress)

    @classmethod
    def fit_table(cls, t: Table, cfg: ModelConfig, *, progress: Progress | None = None,
                  n_jobs: int = 1, targets: Sequence[str] = TARGETS) -> ForestModel:
        """Fit on a Table; ``progress(1)`` is called as each target is done.

        Repeated measurements of one configuration are fitted as one row (their median in
        log space, weighted by their count): the forest learns the configuration's typical
        value, not its noise, and a month of sentinel repeats costs one row, not thousands.
        Energy is power x runtime (no forest of its own) where the data agree with that.
        """
        if len(t) < cfg.min_samples:
            raise ModelError(f"{len(t)} samples, fewer than model.min_samples "
                             f"({cfg.min_samples})")
        t0 = time.perf_counter()
        X = features.table_matrix(t).astype(np.float32)
        gid = features.config_ids(t)
        forests: dict[str, Any] = {}
        sigma: dict[str, float] = {}
        counts: dict[str, int] = {}
        oob: dict[str, np.ndarray] = {}  # SI units per row, NaN where none
        derived = {}
        scale: dict[str, float] = {}
        # The measurement noise no interval is narrower than: overall, per noise group.
        floor: dict[str, float] = {}
        floor_group: dict[str, dict[str, float]] = {}
        floor_rows: dict[str, np.ndarray] = {}
        repeats: dict[str, dict[str, str]] = {}  # per repeated configuration (_repeat_stats)
        stats: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        hashes = config_hashes(t)
        groups = _noise_groups(t)
        for target in targets:
            y = to_model_space(target, t)
            ok = np.isfinite(y)
            counts[target] = int(ok.sum())
            if target == "energy" and _energy_is_derived(t, forests):
                derived["energy"] = "power*runtime"
                oob["energy"] = oob["power"] * oob["runtime"]
                sigma["energy"] = float(math.hypot(sigma["power"], sigma["runtime"]))
                if {"power", "runtime"} <= set(stats):  # offsets add, noises in quadrature
                    (kr, orr, nr), (kp, op, n_p) = stats["runtime"], stats["power"]
                    both, i, j = np.intersect1d(kr, kp, assume_unique=True,
                                                return_indices=True)
                    repeats["energy"] = _encode_repeats(both, orr[i] + op[j],
                                                        np.hypot(nr[i], n_p[j]), cfg.interval)
            elif counts[target] >= cfg.min_samples:
                rf, s, o, scale[target] = _fit_one(X[ok], y[ok], gid[ok], cfg, n_jobs,
                                                   groups[ok])
                forests[target], sigma[target] = rf, s
                floor[target], floor_group[target] = _noise_floors(
                    y[ok], gid[ok], groups[ok], cfg.interval)
                floor_rows[target] = _row_floors(groups, floor[target], floor_group[target],
                                                 len(t))
                s0 = np.where(floor_rows[target] > 0, floor_rows[target], s)[ok]
                stats[target] = _repeat_stats(rf, X[ok], y[ok], gid[ok], hashes[ok], s0,
                                              cfg.interval)
                repeats[target] = _encode_repeats(*stats[target], cfg.interval)
                oob[target] = np.full(len(t), np.nan)
                oob[target][ok] = from_model_space(target, t.take(np.flatnonzero(ok)), o)
            if progress:
                progress(1)
        if "runtime" not in forests:
            raise ModelError("no runtime measurements to fit on")
        shape_scale, shape_set = _shape_scale(t, X, forests, sigma, scale, cfg, floor_rows)
        domain_targets = {tg: domain_record(t.take(np.flatnonzero(np.isfinite(
            t[COLUMN[tg]])))) for tg in forests}
        if "energy" in derived:  # power x runtime: known where power was measured
            domain_targets["energy"] = domain_targets["power"]
        in_scale = {tg: shape_scale.get(tg, scale.get(tg, 1.0)) for tg in forests}
        ood, transfer = _validate(t, X, gid, forests, sigma, in_scale, cfg)
        scores = {}
        for target, pred in oob.items():
            meas = t[COLUMN[target]]
            has = np.isfinite(pred) & np.isfinite(meas)
            if has.any():
                ape = np.abs(pred[has] - meas[has]) / meas[has]
                scores[target] = {"oob_mape": float(np.mean(ape)),
                                  "oob_median_ape": float(np.median(ape))}
        z = NormalDist().inv_cdf(0.5 + cfg.interval / 2)
        meta = {"format": MODEL_FORMAT, "n_samples": len(t),
                "targets": {k: v for k, v in counts.items() if k in forests or k in derived},
                "derived": derived, "scores": scores, "features": list(features.FEATURES),
                "interval": cfg.interval, "data_hash": table_hash(t),
                "fit_seconds": time.perf_counter() - t0, "created": time.time(),
                "params": {"n_estimators": cfg.n_estimators, "max_depth": cfg.max_depth,
                           "min_samples_leaf": cfg.min_samples_leaf,
                           "max_leaf_nodes": cfg.max_leaf_nodes,
                           "max_features": MAX_FEATURES, "max_samples": MAX_SAMPLES,
                           "seed": cfg.seed},
                "devices": _device_meta(t), "configs": _configs(t),
                "interval_scale": scale, "interval_scale_shape": shape_scale,
                "interval_noise_floor": floor, "interval_noise_floor_group": floor_group,
                "repeats": repeats,
                "shapes": shape_set, "domain": domain_record(t),
                "domain_targets": domain_targets, "ood_sd": ood, "logo": transfer,
                "reference_shapes": _reference_shapes(t),
                "roofline_efficiency": cfg.roofline_efficiency}
        return cls(forests, sigma, z, meta)

    # ------------------------------------------------------------- predicting
    def predict(self, specs: Sequence[ProbeSpec], infos: Sequence[DeviceInfo]
                ) -> list[Prediction]:
        if not specs:
            return []
        out = self.predict_table(Table.from_specs(specs, infos))
        return to_predictions(out, len(specs))

    def predict_table(self, t: Table) -> dict[str, dict[str, np.ndarray]]:
        """Per target: point, lo, hi (SI units), sigma (log space), in_domain (bool) and
        domain (why not, '' when in domain), one entry per row; inside the physical
        bounds of each row's device (gemmd.bounds)."""
        if not len(t):
            return {}
        logs, flags = self.prior_logs(t)
        for target, (mu, sd) in list(logs.items()):
            logs[target] = (mu, widen(target, sd, flags[target], tau=self.ood_sd(target)))
        logs = self._with_energy(logs, t)
        out = result(logs, {tg: flags.get(tg, flags["runtime"]) for tg in logs}, self.z)
        bounds.clip(out, t)
        return out

    def ood_sd(self, target: str) -> dict[str, float]:
        """The log-space spread added per way a row lies outside the domain (OOD_SD),
        with the model's own validated figures where it measured them at fit time
        (leave-one-GPU-out for "gpu", extrapolation beyond a trained size for "size")."""
        return {**OOD_SD.get(target, OOD_SD["runtime"]),
                **(self.meta.get("ood_sd") or {}).get(target, {})}

    def transfer_setting(self) -> tuple[float, float]:
        """(w, a) for an unknown GPU's runtime: the weight of the forest's own efficiency
        level against the roofline estimate's, and of its shape dependence (how
        efficiency changes with size and configuration) against none; chosen at fit time
        by leave-one-GPU-out validation, else DEFAULT_TRANSFER."""
        rec = (self.meta.get("logo") or {}).get("runtime") or {}
        return float(rec.get("w", DEFAULT_TRANSFER[0])), float(rec.get("a", DEFAULT_TRANSFER[1]))

    def prior_logs(self, t: Table) -> tuple[dict[str, tuple[np.ndarray, np.ndarray]],
                                            dict[str, dict[str, Any]]]:
        """(per forest target: log point and in-domain log sd, per target: domain flags):
        the raw forest with an unknown GPU's runtime carried over by transfer_setting
        and an unknown kernel's runtime from the roofline; the interval not yet widened
        for being outside the domain."""
        logs = self.raw_logs(t)
        flags = self.target_flags(t)
        for target, (mu, sd) in list(logs.items()):
            if target == "runtime":
                mu = self.transfer_runtime(t, mu, flags["runtime"])
            logs[target] = (self._fallback(target, t, mu, flags[target]), sd)
        return logs, flags

    def target_flags(self, t: Table, extra: Mapping[str, Mapping[str, Any]] | None = None
                     ) -> dict[str, dict[str, Any]]:
        """domain_flags per target: runtime against the rows trained with a runtime,
        power and energy against those with power (energy measured, where it has a
        forest of its own): power is not in the domain of a GPU whose power was never
        measured. ``extra``: per target, domain_flags' extra (a calibration's probes)."""
        recs = self.meta.get("domain_targets") or {}
        out = {}
        derived = self.meta.get("derived", {})
        for target in self.forests:
            rec = recs.get(target, self.meta.get("domain"))
            out[target] = domain_flags(rec, t, (extra or {}).get(target))
            if target != "runtime" and target in recs:  # say which data is missing
                out[target]["reason"] = np.array(
                    [r.replace("no data on", f"no {target} data on") for r in
                     out[target]["reason"]], dtype=object)
        if "runtime" not in out:
            out["runtime"] = domain_flags(self.meta.get("domain"), t,
                                          (extra or {}).get("runtime"))
        for target in derived:  # power x runtime: known where power is
            out[target] = out.get("power", out["runtime"])
        return out

    def domain_flags(self, t: Table) -> dict[str, Any]:
        """The runtime's domain flags (target_flags for the others)."""
        return self.target_flags(t)["runtime"]

    def forest_levels(self, t: Table, todo: np.ndarray) -> np.ndarray:
        """Per row where ``todo``: the forest's efficiency level for the row's device and
        configuration, the median over the shapes it was trained on (meta
        "reference_shapes") of its log(runtime / runtime_reference); NaN elsewhere. One
        figure per (device, configuration), whatever else is predicted alongside."""
        out = np.full(len(t), np.nan)
        shapes = self.meta.get("reference_shapes") or []
        if not todo.any() or not shapes or "runtime" not in self.forests:
            return out
        ref = np.asarray(shapes, dtype=np.float64)
        for i in np.flatnonzero(todo):
            info = t.info(i)
            cfg = tuple((c, _plain(t[c][i])) for c in ANCHOR_CONFIG)
            key = (info.uuid, cfg)
            level = self._anchor_cache.get(key)
            if level is None:
                rows = [{"m": a, "n": b, "k": c, "batch": d, **dict(cfg)} for a, b, c, d in ref]
                rt = Table.from_rows(rows, [info] * len(rows))
                mu, _ = self.raw_logs(rt, scaled=False)["runtime"]
                level = float(np.median(mu - np.log(runtime_reference(rt))))
                if len(self._anchor_cache) < 4096:
                    self._anchor_cache[key] = level
            out[i] = level
        return out

    def transfer_runtime(self, t: Table, mu: np.ndarray, flags: Mapping[str, Any]
                         ) -> np.ndarray:
        """Log runtime per row: on a GPU the model never saw (and a kernel
        it knows), log(reference) + (1 - w) log(1 / roofline_efficiency) + w L + a z,
        where L is the forest's level there (forest_levels), z = log efficiency - L the
        forest's shape dependence and (w, a) = transfer_setting(); elsewhere the forest's
        own. What a forest says of an unknown GPU carries its training GPUs'
        efficiency level and shape, which need not be the new GPU's: how far they carry
        is what leave-one-GPU-out validation on the training data measured."""
        todo = flags["gpu"] & ~flags["kernel"]
        if not todo.any():
            return mu
        w, a = self.transfer_setting()
        eff = float(self.meta.get("roofline_efficiency", 0.7))
        level = self.forest_levels(t, todo)
        ref = np.log(runtime_reference(t))
        z = np.where(todo, mu - ref - level, 0.0)
        carried = ref + (1.0 - w) * math.log(1.0 / eff) + w * level + a * z
        return np.where(todo, carried, mu)

    def raw_logs(self, t: Table, scaled: bool = True
                 ) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """Per forest target: (log of the point prediction, log-space sd as if in domain:
        the trees' spread and the single-measurement noise, times the interval scale
        unless not ``scaled``; never below the measurement noise; for a configuration
        trained on with repeats on this device, its own (see _repeat_stats))."""
        X32 = features.table_matrix(t).astype(np.float32)
        scale = self.meta.get("interval_scale", {})
        shape_scale = self.meta.get("interval_scale_shape") or {}
        floor = self.meta.get("interval_noise_floor") or {}
        floor_group = self.meta.get("interval_noise_floor_group") or {}
        groups = _noise_groups(t) if floor_group else None
        seen = self._seen_shapes(t) if shape_scale else None
        own = self._repeat_sds(t) if scaled else {}
        if not scaled:
            scale, shape_scale, seen, floor = {}, {}, None, {}
        logs: dict[str, tuple[np.ndarray, np.ndarray]] = {}  # log point, log-space sd
        for target, rf in self.forests.items():
            flat = self._flat.get(target)
            if flat is None and X32.shape[0] <= _FLAT_MAX_ROWS:
                flat = self._flat[target] = _FlatForest(rf.estimators_)
            per_tree = _per_tree(rf, flat, X32)
            mean, spread = per_tree.mean(axis=0), per_tree.std(axis=0)
            c = scale.get(target, 1.0)
            if seen is not None and target in shape_scale:
                c = np.where(seen, c, shape_scale[target])
            sd = np.maximum(np.sqrt(spread**2 + self.sigma.get(target, 0.0) ** 2) * c,
                            _row_floors(groups, floor.get(target, 0.0),
                                        floor_group.get(target, {}), len(t)))
            if target in own:
                sd = np.where(np.isnan(own[target]), sd, own[target])
            logs[target] = (np.log(from_model_space(target, t, mean)), np.maximum(sd, MIN_SD))
        return logs

    def _repeat_sds(self, t: Table, targets: Sequence[str] | None = None
                    ) -> dict[str, np.ndarray]:
        """Per target with a repeat table (forest targets unless ``targets``): each row's
        own sd where its configuration was trained on with repeats on its device, NaN
        elsewhere."""
        if self._repeats is None:
            self._repeats = {}
            for target, rec in (self.meta.get("repeats") or {}).items():
                if rec:
                    self._repeats[target] = (
                        np.frombuffer(base64.b64decode(rec["keys"]), dtype=np.uint64),
                        np.frombuffer(base64.b64decode(rec["sd"]), dtype=np.float32))
        wanted = {k: v for k, v in self._repeats.items()
                  if k in (targets if targets is not None else self.forests)}
        if not wanted or not len(t):
            return {}
        h = config_hashes(t)
        out = {}
        for target, (keys, sds) in wanted.items():
            i = np.minimum(np.searchsorted(keys, h), len(keys) - 1)
            out[target] = np.where(keys[i] == h, sds[i].astype(np.float64), np.nan)
        return out

    def _seen_shapes(self, t: Table) -> np.ndarray:
        """Per row: was its shape (GPU model, M, N, K, batch) in the training data? All
        False when the model did not keep the set (too many shapes)."""
        if self._shape_set is None:
            raw = self.meta.get("shapes")
            self._shape_set = np.frombuffer(base64.b64decode(raw), dtype=np.uint64) \
                if raw else np.zeros(0, dtype=np.uint64)
        if not self._shape_set.size:
            return np.zeros(len(t), dtype=bool)
        return np.isin(shape_hashes(t), self._shape_set)

    def _fallback(self, target: str, t: Table, mu: np.ndarray, flags: dict[str, Any]
                  ) -> np.ndarray:
        """A kernel the forest never saw: its runtime is the roofline estimate (what the
        forest says there is an extrapolation from other kernels, often off by 10-100x)."""
        if target != "runtime" or not flags["kernel"].any():
            return mu
        eff = float(self.meta.get("roofline_efficiency", 0.7))
        return np.where(flags["kernel"], np.log(features.roofline(t) / eff + launch_s(t)),
                        mu)

    def _with_energy(self, logs: dict[str, tuple[np.ndarray, np.ndarray]],
                     t: Table | None = None) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        if self.meta.get("derived", {}).get("energy") and {"power", "runtime"} <= set(logs):
            (lp, sp), (lr, sr) = logs["power"], logs["runtime"]
            sd = np.hypot(sp, sr)
            # A configuration trained on with repeats: its runtime and power offsets add
            # (in quadrature a known offset counts as noise: a sentinel's energy covered
            # 65-79% where its runtime was 1% off).
            own = self._repeat_sds(t, ("energy",)).get("energy") if t is not None else None
            if own is not None:
                sd = np.where(np.isnan(own), sd, np.maximum(own, MIN_SD))
            logs["energy"] = (lp + lr, sd)
        return logs

    # -------------------------------------------------------------- persistence
    def save(self, path: str | Path) -> str:
        """Write atomically (temp file + rename); returns the file's sha256."""
        sio = import_hiding_cupy("skops.io")  # CuPy: 165 MB for nothing here

        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        payload = {"forests": self.forests, "sigma": self.sigma, "z": self.z,
                   "meta": json.dumps(self.meta)}
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".skops")
        os.close(fd)
        try:
            sio.dump(payload, tmp)
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
            digest = file_sha256(tmp)
            os.replace(tmp, path)
        except OSError as e:
            Path(tmp).unlink(missing_ok=True)
            raise naming(e, path) from None
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return digest

    @classmethod
    def load(cls, path: str | Path, sha256: str | None = None) -> ForestModel:
        """Load without executing code: checksum first, then skops with trusted types only."""
        sio = import_hiding_cupy("skops.io")

        path = Path(path)
        if not path.is_file():
            raise ModelError(f"model file {path} does not exist")
        if sha256 and file_sha256(path) != sha256:
            raise ModelError(f"model file {path} does not match its recorded checksum "
                             "(tampered with or truncated)")
        try:
            untrusted = sio.get_untrusted_types(file=str(path))
            extra = sorted(set(untrusted) - set(TRUSTED_TYPES))
            if extra:
                raise ModelError(f"model file {path} contains untrusted types: "
                                 f"{', '.join(extra)}")
            payload = sio.load(str(path), trusted=sorted(set(untrusted)))
            _check_payload(payload, path)
            meta = json.loads(payload["meta"])
        except ModelError:
            raise
        except Exception as e:  # skops/zipfile/json raise many types on a corrupt file
            raise ModelError(f"model file {path} cannot be read: {type(e).__name__}: {e}") from e
        if meta.get("format") != MODEL_FORMAT or meta.get("features") != list(features.FEATURES):
            raise ModelError(f"model file {path} was fitted by another gemmd version (model "
                             f"format {meta.get('format', 1)}, this gemmd reads "
                             f"{MODEL_FORMAT}); refit it")
        _check_forests(payload, path)
        return cls(payload["forests"], dict(payload["sigma"]), float(payload["z"]), meta)

    def device_infos(self) -> list[DeviceInfo]:
        """The devices the model was trained on (from its metadata)."""
        return [DeviceInfo(**d) for d in self.meta.get("devices", [])]


# ------------------------------------------------------------------ the training domain

# Sizes within this many factors of 2 of the trained range count as in the domain: none.
# A forest extrapolates flat beyond the sizes it saw; trained on M <= 2048 and asked
# about M = 4096 (within the 2x margin this once had) its 90% intervals covered 69-77%
# without a flag (issue 25). Beyond the range in M, N, K or FLOPs a row is flagged and
# its interval widened per factor of 2, by what extrapolation at fit time measured.
SIZE_MARGIN_LOG2 = 0.0
_SIZES = ("m", "n", "k", "flops")

# No interval narrower than this (log space, about +-0.8% at 90%): repeated GEMMs on a
# GPU never agree better, whatever a noiseless training set suggests.
MIN_SD = 0.005

# Log-space sd added to a prediction's for each way its GEMM lies outside the training
# data, per target: "gpu", a GPU model never trained on; "dtype", a dtype never trained
# on that GPU; "kernel", a kernel never trained on (runtime then comes from the roofline);
# "size", per factor of 2 beyond the trained range. Measured by leaving out whole GPUs,
# dtypes and kernels on the shared data (bench/transfer.py --coverage, docs/model.md):
# these make the nominal interval cover about its share of such predictions there.
OOD_SD: dict[str, dict[str, float]] = {
    "runtime": {"gpu": 0.5, "dtype": 0.35, "kernel": 1.5, "size": 0.25},
    "power": {"gpu": 0.45, "dtype": 0.4, "kernel": 0.4, "size": 0.1},
    "energy": {"gpu": 0.5, "dtype": 0.4, "kernel": 1.5, "size": 0.25},
}


# An unknown GPU's runtime (ForestModel.transfer_runtime): candidate (w, a), the weights
# of the forest's efficiency level (against the roofline estimate's) and of its shape
# dependence (against none), judged by leave-one-GPU-out validation at fit time
# (_validate_transfer) where the training data hold two GPU models or more. Without that
# evidence: the roofline estimate's level and no shape (the roofline estimate plus a
# launch), which is what the model would otherwise use. On the shared data's 12
# one-GPU-to-another pairs that beat the forest's level on 7 and its shape on 9
# (bench/RESULTS.md, "Model across GPUs"); another evaluation found the opposite within
# one GPU family (A100 -> A100 80 GB, H100: issue 25): only the training data can say.
TRANSFER_GRID = tuple((w, a) for w in (0.0, 0.5, 1.0) for a in (0.0, 0.5, 1.0))
DEFAULT_TRANSFER = (0.0, 0.0)
ANCHOR_CONFIG = ("dtype", "kernel", "tile", "layout", "cta_m", "cta_n", "cta_k", "stages",
                 "alpha", "beta", "out_dtype", "variant")


def _reference_shapes(t: Table, limit: int = 128) -> list[list[float]]:
    """Up to ``limit`` distinct (m, n, k, batch) of the rows with a runtime, drawn with a
    fixed seed: the shapes an unknown GPU's efficiency level is read over."""
    ok = np.isfinite(t["runtime_s"])
    if not ok.any():
        return []
    shapes = np.unique(np.column_stack([t["m"][ok], t["n"][ok], t["k"][ok], t["batch"][ok]]),
                       axis=0)
    if len(shapes) > limit:
        shapes = shapes[np.sort(np.random.default_rng(0).choice(len(shapes), limit,
                                                                replace=False))]
    return shapes.tolist()


def _log2_sizes(t: Table) -> np.ndarray:
    with np.errstate(divide="ignore"):
        return np.column_stack([np.log2(t["m"]), np.log2(t["n"]), np.log2(t["k"]),
                                np.log2(features.flops(t))])


def domain_record(t: Table) -> dict[str, Any]:
    """What the model was trained on: per GPU model (hardware.gpu_model_key: eight H100s
    are one), its dtypes, kernels, (dtype, kernel) pairs and size ranges (log2 of M, N, K
    and FLOPs); and the same over all GPUs."""
    keys = np.array([gpu_model_key(d) for d in t.devices], dtype=object)
    rowkey = keys[t.device] if len(t) else np.zeros(0, dtype=object)
    sizes = _log2_sizes(t)

    def rng(sel: np.ndarray) -> list[list[float]]:
        return [[float(sizes[sel, j].min()), float(sizes[sel, j].max())]
                for j in range(len(_SIZES))]

    gpus = {}
    for key in sorted(set(rowkey.tolist())):
        sel = rowkey == key
        name = next(d.name for d, k in zip(t.devices, keys) if k == key)
        gpus[key] = {"name": name, "dtypes": sorted(set(t["dtype"][sel].tolist())),
                     "kernels": sorted(set(t["kernel"][sel].tolist())),
                     "pairs": sorted({f"{d}/{k}" for d, k in zip(t["dtype"][sel],
                                                                   t["kernel"][sel])}),
                     "size": rng(sel)}
    everything = np.ones(len(t), dtype=bool)
    return {"gpus": gpus, "dtypes": sorted(set(t["dtype"].tolist())),
            "kernels": sorted(set(t["kernel"].tolist())),
            "size": rng(everything) if len(t) else []}


def domain_flags(rec: Mapping[str, Any] | None, t: Table,
                 extra: Mapping[str, Mapping[str, Any]] | None = None) -> dict[str, Any]:
    """Per row, how it lies outside the domain ``rec``: "gpu", "dtype", "kernel" (bool
    arrays), "size" (factors of 2 beyond the trained range, >= 0), "in_domain" and
    "reason" (a short text, '' in domain). ``extra`` (by GPU model key) adds data a
    calibration has seen on a device. A model without a record (older files) is taken
    to know everything."""
    n = len(t)
    out: dict[str, Any] = {"gpu": np.zeros(n, bool), "dtype": np.zeros(n, bool),
                           "kernel": np.zeros(n, bool), "size": np.zeros(n),
                           "in_domain": np.ones(n, bool), "reason": np.full(n, "", object)}
    if not rec or not n:
        return out
    gpus = rec.get("gpus", {})
    keys = [gpu_model_key(d) for d in t.devices]
    sizes = _log2_sizes(t)
    dts, dti = np.unique(t["dtype"].astype(str), return_inverse=True)
    kns, kni = np.unique(t["kernel"].astype(str), return_inverse=True)
    code = (t.device * len(dts) + dti.ravel()) * len(kns) + kni.ravel()
    for c in np.unique(code):
        sel = code == c
        i0 = int(np.flatnonzero(sel)[0])
        dev, dtype, kernel = int(t.device[i0]), str(t["dtype"][i0]), str(t["kernel"][i0])
        key = keys[int(dev)]
        known = gpus.get(key)
        more = (extra or {}).get(key, {})
        parts = []
        if known is None and not more:
            out["gpu"][sel] = True
            parts.append(f"no data on {t.devices[int(dev)].name}")
        kernels = set(rec.get("kernels", [])) | set(more.get("kernels", []))
        if kernel not in kernels:
            out["kernel"][sel] = True
            parts.append(f"no {kernel} kernel data")
        pairs = set((known or {}).get("pairs", [])) | set(more.get("pairs", []))
        if (known is not None or more) and f"{dtype}/{kernel}" not in pairs \
                and kernel in kernels:
            out["dtype"][sel] = True
            parts.append(f"no {dtype} {kernel} data on this GPU")
        elif known is None and not more and dtype not in rec.get("dtypes", []):
            out["dtype"][sel] = True
            parts.append(f"no {dtype} data")
        lim = np.asarray((known or {}).get("size") or rec.get("size") or [], dtype=float)
        if more.get("size"):
            m = np.asarray(more["size"], dtype=float)
            lim = m if not lim.size else np.column_stack([np.minimum(lim[:, 0], m[:, 0]),
                                                          np.maximum(lim[:, 1], m[:, 1])])
        if lim.size:
            x = sizes[sel]
            beyond = np.maximum(lim[:, 0] - SIZE_MARGIN_LOG2 - x, x - lim[:, 1] -
                                SIZE_MARGIN_LOG2)
            dist = np.maximum(beyond.max(axis=1), 0.0)
            out["size"][sel] = dist
        out["reason"][sel] = "; ".join(parts)
    far = out["size"] > 0
    for i in np.flatnonzero(far):
        note = f"size {2 ** (out['size'][i] + SIZE_MARGIN_LOG2):.3g}x beyond the trained range"
        out["reason"][i] = f"{out['reason'][i]}; {note}" if out["reason"][i] else note
    out["in_domain"] = ~(out["gpu"] | out["dtype"] | out["kernel"] | far)
    return out


def _size_d(d: np.ndarray) -> np.ndarray:
    """Factors of 2 beyond the trained sizes as widened: at least SIZE_MIN_D once beyond."""
    return np.where(d > 0, np.maximum(d, SIZE_MIN_D), 0.0)


def widen(target: str, sd: np.ndarray, flags: Mapping[str, Any],
          skip: Sequence[str] = (), tau: Mapping[str, float] | None = None) -> np.ndarray:
    """sd combined with the spread (``tau``, else OOD_SD) of every way a row lies
    outside the domain."""
    tau = tau or OOD_SD.get(target, OOD_SD["runtime"])
    var = sd**2
    for kind in ("gpu", "dtype", "kernel"):
        if kind not in skip:
            var = var + np.where(flags[kind], tau[kind] ** 2, 0.0)
    if "size" not in skip:
        var = var + (tau["size"] * _size_d(flags["size"])) ** 2
    return np.sqrt(var)


def result(logs: Mapping[str, tuple[np.ndarray, np.ndarray]],
           flags: Mapping[str, Mapping[str, Any]], z: float | np.ndarray
           ) -> dict[str, dict[str, np.ndarray]]:
    """predict_table's answer from log points and sds and each target's domain flags
    (``flags[target]``): z may be one value or per row."""
    return {target: {"point": np.exp(mu), "lo": np.exp(mu - z * sd),
                     "hi": np.exp(mu + z * sd), "sigma": sd,
                     "in_domain": flags[target]["in_domain"],
                     "domain": flags[target]["reason"]}
            for target, (mu, sd) in logs.items()}


def to_predictions(out: Mapping[str, Mapping[str, np.ndarray]], n: int) -> list[Prediction]:
    """Prediction objects from predict_table's answer."""
    preds = [Prediction() for _ in range(n)]
    for target, res in out.items():
        for i, p in enumerate(preds):
            setattr(p, COLUMN[target], float(res["point"][i]))
            setattr(p, f"{target}_lo", float(res["lo"][i]))
            setattr(p, f"{target}_hi", float(res["hi"][i]))
            p.sigma[target] = float(res["sigma"][i])
            p.domains[target] = "" if res["in_domain"][i] else str(res["domain"][i])
    for p in preds:  # in_domain and domain: the runtime's (the headline of a probe)
        head = "runtime" if "runtime" in p.domains else next(iter(p.domains), "")
        p.domain = p.domains.get(head, "")
        p.in_domain = not p.domain
    return preds


# ------------------------------------------------------------------ transfer to a device

# A device's first probes correct a prior model fitted on other GPUs (TransferModel): a
# device-wide offset in log space, then one per dtype/kernel, each shrunk toward the
# prior by the spread expected before any probe (OOD_SD where the prior has no such
# data, these where it has).
LEVEL_SD_KNOWN = 0.1  # another card of a GPU model the prior knows
GROUP_SD_KNOWN = 0.15  # a dtype/kernel the prior knows on that GPU model
RESID_SD0 = 0.3  # scatter left after the offsets on a new GPU, before the probes say
RESID_DOF0 = 3.0  # the weight of that guess, in probes
MIN_PROBES_IN_DOMAIN = 3  # probes of a dtype/kernel that make a device's predictions in domain
MIN_GROUP_PROBES = 10  # probes of a dtype/kernel before trees on the probes predict it
MIN_SELECT = 5  # probes before recipes on the device's own data are fitted (chosen by CV)
MIN_RESIDUAL = 10  # probes before trees on the calibrated residuals are tried
CV_FOLDS = 5
CV_MAX_ROWS = 2000  # cross-validation of the choice reads at most this many probes
CHOICES = ("calibrated", "residual", "own", "few", "blend")
# "blend": the calibrated prior and the few-probe trees averaged in log space, the trees
# weighted by one of these (the one cross-validation over the probes finds best): the
# prediction moves from the prior toward the device's own data as far as the probes show
# skill, not all at once.
BLEND_WEIGHTS = (0.25, 0.5, 0.75)
# The recipe is the calibrated prior (its shrinkage validated at fit time: a few probes
# cannot make it worse than none on the training GPUs); from MIN_OVERRIDE probes another
# (few-probe trees, a blend of them with the calibrated prior, residual trees, gemmd's
# forest on the probes) replaces it where cross-validation over the probes finds it
# better by SELECT_SE standard errors of the paired difference. Until issue 25 "few" was
# the default from 5 probes: 5 probes were then worse than none on 5 of 9 GPUs of one
# evaluation (V100 55.5% against 25.2%) and here on B200 -> H100 (27.2% against 18.0%).
# With the blends, 1 standard error took the MI355X at 20 probes from 28.4% to 27.0% and
# left the H100 at 14.8% (2 standard errors: no blend chosen; 0: 26.4%, a minimum of a
# few probes' CV errors is often a fluke).
DEFAULT_CHOICE = "calibrated"
SELECT_SE = 1.0
MIN_OVERRIDE = 10
# "few": extremely randomized trees on the device's probes, each split the best of one
# random threshold on each of a third of the features (Breiman's p/3 for regression). On a
# few probes a bootstrapped forest's best-threshold splits make a coarse step function of
# them; random thresholds average into a smoother one (bench/transfer.py, 20 probes:
# 15.6-28.9% MAPE on held-out shapes against 16.1-29.9% for gemmd's forest on the same
# probes, better on every GPU of the shared data; at 200 probes 7-19% against 8-21%,
# worse on the RTX 4070 only).
FEW_MAX_FEATURES = 1 / 3


LEVEL_SD_FLOOR = 0.02  # a validated level spread is never taken below this
# Without leave-one-GPU-out evidence, the prior's level counts as this many probes on a
# GPU it never saw: RESID_SD0 / sqrt(0.36) = 0.5 = OOD_SD's "gpu", as before.
LEVEL_N0_DEFAULT = 0.36


@dataclass
class DeviceCalibration:
    """How one device departs from the prior, from its probes (log space, per target)."""

    uuid: str
    gpu: str  # GPU model key (hardware.gpu_model_key)
    n: int
    level: dict[str, float]  # device-wide offset
    groups: dict[str, dict[str, float]]  # "dtype/kernel" -> offset on top of the level
    counts: dict[str, dict[str, int]]  # probes per "dtype/kernel"
    group_sd: dict[str, dict[str, float]]  # prior spread of each group's offset
    sd: dict[str, float]  # residual scatter after the offsets
    dof: dict[str, float]  # its degrees of freedom
    precision: dict[str, float]  # of the level, in probes (n + s0^2 / tau^2)
    domain: dict[str, Any]  # per target: what the probes cover: pairs, kernels, sizes
    # per target and group of a kernel the prior never saw: that group's own scatter
    # (its efficiency may vary with size as no other kernel's does)
    group_scatter: dict[str, dict[str, float]] = field(default_factory=dict)

    def offset(self, target: str, group: str) -> float:
        return self.level.get(target, 0.0) + self.groups.get(target, {}).get(group, 0.0)

    def variance(self, target: str, group: str) -> float:
        """Variance of a new measurement around the calibrated prediction (log space)."""
        s2 = self.sd[target] ** 2
        own = self.group_scatter.get(target, {}).get(group)
        if own is not None:
            s2 = own**2
        var = s2 * (1.0 + 1.0 / self.precision[target])
        n_g = self.counts.get(target, {}).get(group, 0)
        tau = self.group_sd.get(target, {}).get(group)
        if tau is None:  # a group neither the prior nor the probes saw
            tau = OOD_SD.get(target, OOD_SD["runtime"])["dtype"]
        return var + (tau**2 if n_g == 0 else s2 / (n_g + s2 / max(tau, 1e-6) ** 2))


def _groups(t: Table) -> np.ndarray:
    return np.array([f"{d}/{k}" for d, k in zip(t["dtype"], t["kernel"])], dtype=object)


def _unknown_priors(prior: ForestModel, target: str) -> tuple[float, float]:
    """(level spread, scatter after the level) on a GPU model ``prior`` never saw: the
    scatter as leave-one-GPU-out measured it on the training data (else RESID_SD0), the
    level's spread that scatter over the square root of the pseudo-count that validation
    chose (else LEVEL_N0_DEFAULT): the prior's level counts as that many probes."""
    rec = (prior.meta.get("logo") or {}).get(target) or {}
    s0 = float(rec.get("shape_sd", RESID_SD0)) or RESID_SD0
    n0 = float(rec.get("level_n0", LEVEL_N0_DEFAULT))
    return max(s0 / math.sqrt(n0), LEVEL_SD_FLOOR), s0


def calibrate(prior: ForestModel, t: Table) -> dict[str, DeviceCalibration]:
    """Per device of ``t`` (its probes, measured): its offsets from ``prior``.

    Per target, log(measured / prior) = level + group offset + noise, each term shrunk
    toward 0 (the prior) by its prior spread (Bayesian shrinkage: with few probes the
    prior, with many the device's own level), Huber-weighted. On a GPU model the prior
    never saw, the level's spread and the scatter are what leave-one-GPU-out validation
    measured and chose at fit time (_unknown_priors, _validate_calibration)."""
    logs, flags = prior.prior_logs(t)
    groups = _groups(t)
    sizes = _log2_sizes(t)
    out: dict[str, DeviceCalibration] = {}
    dom = prior.meta.get("domain_targets") or {}
    del flags
    shape_ids = shape_hashes(t)
    for j, info in enumerate(t.devices):
        sel = t.device == j
        if not sel.any():
            continue
        key = gpu_model_key(info)
        cal = DeviceCalibration(info.uuid, key, int(sel.sum()), {}, {}, {}, {}, {}, {}, {},
                                {})
        g_all = groups[sel]
        for target, (mu, sd_in) in logs.items():
            rec = dom.get(target, prior.meta.get("domain")) or {}
            known_pairs = set(rec.get("gpus", {}).get(key, {}).get("pairs", []))
            known_kernels = set(rec.get("kernels", []))
            unknown = key not in rec.get("gpus", {})
            r = np.log(t[COLUMN[target]][sel]) - mu[sel]
            ok = np.isfinite(r)
            if not ok.any():
                continue
            tau_o = OOD_SD.get(target, OOD_SD["runtime"])
            e, g = r[ok], g_all[ok]
            if unknown:
                tau_b, s0 = _unknown_priors(prior, target)
            else:
                tau_b = LEVEL_SD_KNOWN
                s0 = max(float(np.median(sd_in[sel][ok])), 0.02)
            names, gi = np.unique(g.astype(str), return_inverse=True)
            # a dtype/kernel's offset on top of the level: on a GPU model the prior never
            # saw, as uncertain as the level (validation judged them together, with the
            # same pseudo-count); on a known one, GROUP_SD_KNOWN where the prior knows the
            # pair there, else as a kernel or a dtype outside the domain
            tau_g = np.array([min(tau_b, tau_o["dtype"]) if unknown else
                              GROUP_SD_KNOWN if name in known_pairs else
                              tau_o["kernel"] if name.split("/")[1] not in known_kernels
                              else tau_o["dtype"] for name in names])
            n_g = np.bincount(gi, minlength=len(names)).astype(float)
            sid = np.unique(shape_ids[sel][ok], return_inverse=True)[1].ravel()
            u = 1.0 / np.bincount(sid)[sid]
            # a kernel the prior never saw: its probes' scatter is its own, and until
            # they say otherwise as wide as its offset's prior spread
            new_kernel = np.array([nm.split("/")[1] not in known_kernels for nm in names])
            s0_g = np.where(new_kernel, tau_o["kernel"], s0)
            b, cg = _robust_offsets(e, gi, len(names), s0, tau_b, tau_g, u, s0_g)
            resid = e - b - cg[gi]
            mine = ~new_kernel[gi]
            dof = RESID_DOF0 + max(int(mine.sum()) - 1, 0)
            s2 = (RESID_DOF0 * s0**2 + float(np.sum(resid[mine] ** 2))) / dof
            for i in np.flatnonzero(new_kernel):
                r_g = resid[gi == i]
                cal.group_scatter.setdefault(target, {})[str(names[i])] = math.sqrt(
                    (RESID_DOF0 * s0_g[i] ** 2 + float(np.sum(r_g**2))) /
                    (RESID_DOF0 + len(r_g)))
            cal.level[target] = b
            cal.groups[target] = {str(nm): float(v) for nm, v in zip(names, cg)}
            cal.counts[target] = {str(nm): int(v) for nm, v in zip(names, n_g)}
            cal.group_sd[target] = {str(nm): float(v) for nm, v in zip(names, tau_g)}
            # groups the prior knows on this GPU but the probes did not cover
            for pair in known_pairs:
                cal.group_sd[target].setdefault(pair, GROUP_SD_KNOWN)
            cal.sd[target] = math.sqrt(s2)
            cal.dof[target] = dof
            cal.precision[target] = float(u.sum()) + s0**2 / tau_b**2
            probed = [p for p, n in cal.counts[target].items() if n >= MIN_PROBES_IN_DOMAIN]
            if probed:
                x = sizes[sel][ok]
                cal.domain[target] = {
                    "pairs": probed, "kernels": sorted({p.split("/")[1] for p in probed}),
                    "size": [[float(x[:, i].min()), float(x[:, i].max())]
                             for i in range(x.shape[1])]}
        out[info.uuid] = cal
    return out


def _robust_offsets(e: np.ndarray, gi: np.ndarray, groups: int, s0: float, tau_b: float,
                    tau_g: np.ndarray, u: np.ndarray | None = None,
                    s0_g: np.ndarray | None = None, k: float = 1.345
                    ) -> tuple[float, np.ndarray]:
    """Level b and group offsets with e ~ b + cg[gi] + noise: each shrunk toward 0 (the
    prior) by its prior spread, and Huber-weighted, so that one launch-bound or
    thermally throttled probe among five does not move a device's whole calibration.
    ``u``: each probe's weight in the level (1 / probes of its shape: the dtypes of one
    shape share its error, they are one piece of evidence about the level, not
    several). ``s0_g``: each group's prior scatter where it is not ``s0``."""
    s0_g = np.full(groups, s0) if s0_g is None else s0_g
    u = np.ones(len(e)) if u is None else u
    w = np.ones(len(e))
    b, cg = 0.0, np.zeros(groups)
    for _ in range(8):
        for _ in range(3):  # backfitting: the level, then the groups around it
            wu = w * u
            b = float(np.sum(wu * (e - cg[gi])) / (wu.sum() + s0**2 / tau_b**2))
            cg = np.bincount(gi, weights=w * (e - b), minlength=groups) / \
                (np.bincount(gi, weights=w, minlength=groups) + s0_g**2 / tau_g**2)
        r = e - b - cg[gi]
        mad = 1.4826 * float(np.median(np.abs(r)))
        scale = math.sqrt((RESID_DOF0 * s0**2 + len(e) * mad**2) / (RESID_DOF0 + len(e)))
        w = np.minimum(1.0, k * scale / np.maximum(np.abs(r), 1e-12))
    return b, cg


class TransferModel:
    """A prior model of other GPUs, carried over to the devices of ``calibrations``.

    Per device: without probes, the prior's prediction (an unknown GPU carried over as
    leave-one-GPU-out chose, ForestModel.transfer_runtime); from one probe, the prior
    corrected by the device's calibration (a device-wide offset, then per dtype/kernel,
    shrunk toward the prior by the pseudo-count validation chose: calibrate); from
    MIN_SELECT probes, a cross-validation over the probes (grouped by shape) that may
    widen the calibrated prior's interval; from MIN_OVERRIDE probes, per target, the
    recipe it finds better than the calibrated prior by SELECT_SE standard errors: the
    few-probe trees ("few"), a blend of them with the calibrated prior ("blend"), the
    calibrated prior plus trees on what it leaves unexplained ("residual") or gemmd's
    forest on the probes ("own"). A dtype/kernel the device has no probe of is predicted
    by the calibrated prior whatever the recipe, a kernel the prior never saw by the trees
    from MIN_GROUP_PROBES of it. Inside the physical bounds (gemmd.bounds). Same interface
    as ForestModel (predict, predict_table).
    """

    kind = "transfer"

    def __init__(self, prior: ForestModel, calibrations: dict[str, DeviceCalibration],
                 choice: dict[str, str] | None = None, own: ForestModel | None = None,
                 residual: dict[str, tuple[Any, float]] | None = None,
                 cv_scale: dict[str, float] | None = None, meta: dict[str, Any] | None = None,
                 few: dict[str, tuple[Any, float]] | None = None,
                 probe_domain: dict[str, Any] | None = None,
                 few_groups: dict[str, list[str]] | None = None):
        self.prior = prior
        self.calibrations = calibrations
        self.choice = choice or {}
        self.own = own
        # target -> (trees, noise of one measurement): on log(measured / calibrated prior)
        self.residual = residual or {}
        self.few = few or {}  # on the probes' model space
        self.cv_scale = cv_scale or {}  # per target: the chosen recipe's interval factor
        self.probe_domain = probe_domain  # domain_record of the probes
        # per target: probed dtype/kernel groups whose kernel the prior never saw (its
        # prediction there is the roofline estimate, with no shape at all): the
        # few-probe trees predict them whatever the recipe (unknown_kernel_groups)
        self.few_groups = few_groups or {}
        self.blend: dict[str, float] = {}  # per target choosing "blend": the trees' weight
        self.z = prior.z
        self.meta = {**prior.meta, **(meta or {})}
        self.version = f"{prior.version}+cal"
        self.devices: list[DeviceInfo] = []  # the calibrated devices (set by fit)
        self._flat: dict[str, _FlatForest] = {}

    def device_infos(self) -> list[DeviceInfo]:
        """The prior's training devices and the calibrated ones."""
        known = self.prior.device_infos()
        return known + [d for d in self.devices if d.uuid not in {k.uuid for k in known}]

    # ------------------------------------------------------------- fitting
    @classmethod
    def fit(cls, prior: ForestModel, t: Table, cfg: ModelConfig, *,
            own: ForestModel | None = None, n_jobs: int = 1,
            select: bool = True) -> TransferModel:
        """Calibrate ``prior`` to the devices of ``t`` (their probes) and, with enough
        probes, choose per target between the calibrated prior, residual trees, own
        forest and few-probe trees by cross-validation. ``own``: a forest already fitted
        on ``t`` (else fitted here when chosen)."""
        cals = calibrate(prior, t) if len(t) else {}
        n = len(t)
        choice = {tg: "calibrated" for tg in TARGETS}
        cv_scale: dict[str, float] = {}
        meta: dict[str, Any] = {"transfer": {"probes": n, "devices": sorted(cals)},
                                "probe_configs": _configs(t)}
        devices = [d for j, d in enumerate(t.devices) if (t.device == j).any()]
        if not select or n < MIN_SELECT:
            out = cls(prior, cals, choice, meta=meta)
            out.devices = devices
            return out
        sub, picked = cls._cv(prior, t, cfg, n_jobs)
        for target, c in picked.items():
            choice[target] = c
            cv_scale[target] = sub[target][c]["scale"]
        meta["transfer"]["cv"] = sub
        icfg = dataclasses.replace(cfg, min_samples=2)
        if "own" in choice.values() and own is None:
            try:
                own = ForestModel.fit_table(t, icfg, n_jobs=n_jobs)
            except ModelError:
                own = None
        few_groups = unknown_kernel_groups(prior, t)
        wanted = {c: [tg for tg, x in choice.items() if x == c or (
            c == "few" and (tg in few_groups or x == "blend"))] for c in ("few", "residual")}
        few = _fit_trees(t, cfg, wanted["few"], n_jobs=n_jobs) if wanted["few"] else {}
        residual = _fit_trees(t, cfg, wanted["residual"], _calibrated_logs(prior, cals, t),
                              n_jobs) if wanted["residual"] else {}
        few, residual = ({tg: (et, math.hypot(noise, sub.get(tg, {}).get(name, {}).get(
                              "floor", 0.0)))
                          for tg, (et, noise) in trees.items()}
                         for name, trees in (("few", few), ("residual", residual)))
        for target, c in choice.items():
            if (c == "own" and (own is None or target not in own.forests)) or \
                    (c == "residual" and target not in residual) or \
                    (c in ("few", "blend") and target not in few):
                choice[target] = "calibrated"
                cv_scale[target] = sub.get(target, {}).get("calibrated", {}).get("scale", 1.0)
        meta["transfer"]["choice"] = dict(choice)
        few_groups = {tg: g for tg, g in few_groups.items() if tg in few}
        meta["transfer"]["few_groups"] = few_groups
        out = cls(prior, cals, choice, own if "own" in choice.values() else None, residual,
                  cv_scale, meta, few, domain_record(t), few_groups)
        out.blend = {tg: float(sub[tg]["blend"]["weight"]) for tg, c in choice.items()
                     if c == "blend"}
        out.devices = devices
        return out

    @classmethod
    def _cv(cls, prior: ForestModel, t: Table, cfg: ModelConfig, n_jobs: int
            ) -> tuple[dict[str, dict[str, dict[str, float]]], dict[str, str]]:
        """Cross-validation over the probes, grouped by shape (the recipes fitted without a
        fold have seen none of its shapes): per target and recipe, the mean absolute
        percentage error of the out-of-fold predictions ("err"), their number ("n") and
        the interval "scale" that makes the nominal share of them covered (never below
        1); for "blend", the best of BLEND_WEIGHTS ("weight"); and per target the recipe
        chosen: DEFAULT_CHOICE unless, from MIN_OVERRIDE probes, another has a lower error
        by SELECT_SE standard errors of the paired difference."""
        from sklearn.model_selection import GroupKFold

        if len(t) > CV_MAX_ROWS:
            t = t.take(np.sort(np.random.default_rng(0).choice(len(t), CV_MAX_ROWS,
                                                                replace=False)))
        gid = np.unique(shape_hashes(t), return_inverse=True)[1].ravel()
        folds = min(CV_FOLDS, len(np.unique(gid)))
        if folds < 2:
            return {}, {}
        icfg = dataclasses.replace(cfg, min_samples=2, n_estimators=min(cfg.n_estimators, 50))
        z = NormalDist().inv_cdf(0.5 + cfg.interval / 2)
        # recipe -> target -> (log point, log sd) per row, NaN where not predicted
        pred: dict[str, dict[str, tuple[np.ndarray, np.ndarray]]] = {
            c: {} for c in CHOICES if c != "blend"}
        for train, test in GroupKFold(folds).split(np.zeros(len(t)), groups=gid):
            tr, te = t.take(train), t.take(test)
            base = cls.fit(prior, tr, cfg, select=False)
            cals, dom = base.calibrations, domain_record(tr)
            recipes: dict[str, TransferModel] = {"calibrated": base}
            try:
                own = ForestModel.fit_table(tr, icfg, n_jobs=n_jobs)
                recipes["own"] = cls(prior, cals, dict.fromkeys(own.forests, "own"), own)
            except ModelError:
                pass
            few = _fit_trees(tr, icfg, list(prior.forests), n_jobs=n_jobs)
            recipes["few"] = cls(prior, cals, dict.fromkeys(few, "few"), few=few,
                                 probe_domain=dom)
            fg = {tg: g for tg, g in unknown_kernel_groups(prior, tr).items() if tg in few}
            if fg:  # the calibrated prior as served: few-probe trees where it has no shape
                recipes["calibrated"] = cls(prior, cals, few=few, probe_domain=dom,
                                            few_groups=fg)
            if len(tr) >= MIN_RESIDUAL:
                res = _fit_trees(tr, icfg, list(prior.forests),
                                 _calibrated_logs(prior, cals, tr), n_jobs)
                recipes["residual"] = cls(prior, cals, dict.fromkeys(res, "residual"), None,
                                          res, probe_domain=dom)
            for name, model in recipes.items():
                for target, r in model.predict_table(te).items():
                    p = pred[name].setdefault(target, (np.full(len(t), np.nan),
                                                       np.full(len(t), np.nan)))
                    p[0][test] = np.log(r["point"])
                    p[1][test] = (np.log(r["hi"]) - np.log(r["point"])) / z
        out: dict[str, dict[str, dict[str, float]]] = {}
        apes: dict[str, dict[str, np.ndarray]] = {}
        for target in pred["few"]:
            if target not in pred["calibrated"]:
                continue
            (mc, sc), (mf, sf) = pred["calibrated"][target], pred["few"][target]
            with np.errstate(divide="ignore", invalid="ignore"):
                y = np.log(t[COLUMN[target]])
            err_f = np.abs(y - mf)
            err_f = err_f[np.isfinite(err_f)]
            if err_f.size < MIN_SELECT:
                continue
            floor = 1.4826 * float(np.median(err_f))
            sf = np.hypot(sf, floor)
            for lam in BLEND_WEIGHTS:
                pred.setdefault(f"blend:{lam:g}", {})[target] = (
                    (1 - lam) * mc + lam * mf, np.sqrt((1 - lam) * sc**2 + lam * sf**2))
        for name, per in pred.items():
            for target, (mu, sd) in per.items():
                with np.errstate(divide="ignore", invalid="ignore"):
                    y = np.log(t[COLUMN[target]])
                ok = np.isfinite(y) & np.isfinite(mu)
                if ok.sum() < MIN_SELECT:
                    continue
                err = np.abs(y[ok] - mu[ok])
                rec: dict[str, float] = {}
                # Out-of-fold hits of a few probes widen an interval, they do not narrow
                # it: the calibrated prior's is a posterior one, the trees' is at least
                # the typical out-of-fold error (from 5 probes, a factor of 0.72 took a
                # synthetic H100's coverage to 73%; from 20 of the shared data's H100,
                # factors below 1 to 74-81%)
                sdv, lo, hi = sd[ok], 1.0, 4.0
                if name in ("few", "residual"):
                    # The trees' spread vanishes on a configuration they were fitted on,
                    # and without repeats the noise of a measurement is unknown: a floor
                    # of the typical out-of-fold error (as the forests' OOB residual).
                    rec["floor"] = float(1.4826 * np.median(err))
                    sdv, hi = np.hypot(sdv, rec["floor"]), 8.0
                q = conformal_quantile(err / np.maximum(sdv, 1e-9), cfg.interval) / z
                ape = np.full(len(t), np.nan)
                ape[ok] = np.abs(np.expm1(mu[ok] - y[ok]))  # what MAPE averages
                apes.setdefault(target, {})[name] = ape
                out.setdefault(target, {})[name] = {"err": float(np.nanmean(ape)),
                                                    "scale": float(np.clip(q, lo, hi)),
                                                    "n": int(ok.sum()), **rec}
        for target, recs_ in out.items():  # the blend: its best weight only
            blends = [n for n in recs_ if n.startswith("blend:")]
            if blends:
                best = min(blends, key=lambda n: recs_[n]["err"])
                recs_["blend"] = {**recs_[best], "weight": float(best.split(":")[1])}
                apes[target]["blend"] = apes[target][best]
            for n in blends:
                del recs_[n]
                del apes[target][n]
        picked = {target: _select(errs, DEFAULT_CHOICE, override=len(t) >= MIN_OVERRIDE)
                  for target, errs in apes.items()}
        return out, picked

    # ------------------------------------------------------------- predicting
    def predict(self, specs: Sequence[ProbeSpec], infos: Sequence[DeviceInfo]
                ) -> list[Prediction]:
        if not specs:
            return []
        return to_predictions(self.predict_table(Table.from_specs(specs, infos)), len(specs))

    def calibration_of(self, info: DeviceInfo) -> DeviceCalibration | None:
        """The device's calibration; else that of a calibrated card of the same model."""
        cal = self.calibrations.get(info.uuid)
        if cal is None:
            key = gpu_model_key(info)
            cal = next((c for c in self.calibrations.values() if c.gpu == key), None)
        return cal

    def predict_table(self, t: Table) -> dict[str, dict[str, np.ndarray]]:
        if not len(t):
            return {}
        logs, flags0 = self.prior.prior_logs(t)
        cals = [self.calibration_of(d) for d in t.devices]
        extra: dict[str, dict[str, Any]] = {}
        for cal_ in cals:
            if cal_ is not None:
                for target, dom in cal_.domain.items():
                    extra.setdefault(target, {})[cal_.gpu] = dom
        flags = self.prior.target_flags(t, extra) if extra else flags0
        groups = _groups(t)
        zrow = np.full(len(t), self.z)
        has = np.array([c is not None for c in cals])[t.device]
        used = {self.choice.get(tg, "calibrated") for tg in logs} if has.any() else set()
        if has.any() and (self.few_groups or "blend" in used):
            used.add("few")
        out: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        own_res = self.own.predict_table(t) if self.own is not None and "own" in used else {}
        res_logs = self._tree_logs("residual", self.residual, t) if "residual" in used else {}
        few_logs = self._tree_logs("few", self.few, t) if "few" in used else {}
        # how far outside the probes' sizes a row is (the trees on them extrapolate flat)
        near = domain_flags(self.probe_domain, t)["size"] if self.probe_domain and \
            "few" in used else np.zeros(len(t))
        q = NormalDist().inv_cdf(0.5 + float(self.meta.get("interval", 0.9)) / 2)
        recs = self.prior.meta.get("domain_targets") or {}
        for target, (mu, sd) in logs.items():
            tau = self.prior.ood_sd(target)
            kernels = set((recs.get(target) or self.prior.meta.get("domain") or {}).get(
                "kernels", []))
            mu, sd = mu.copy(), widen(target, sd, flags0[target], tau=tau)
            choice = self.choice.get(target, "calibrated")
            size_sd = tau["size"]
            fl = flags[target]
            scale = self.cv_scale.get(target, 1.0)
            for j, cal in enumerate(cals):
                sel = t.device == j
                if cal is None or target not in cal.level or not sel.any():
                    continue
                idx = np.flatnonzero(sel)
                # the device's own data only speak for the dtypes/kernels they cover, and
                # for a kernel the prior never saw only from MIN_GROUP_PROBES: trees on a
                # few probes of it, set beside the others, give all its rows those
                # probes' level (GPPerf's tiled kernel: one probe among 50 of CUTLASS,
                # its other shapes 140x off)
                need = {g: MIN_GROUP_PROBES if g.split("/")[1] not in kernels else 1
                        for g in set(groups[idx])}
                probed = np.array([cal.counts.get(target, {}).get(g, 0) >= need[g]
                                   for g in groups[idx]])
                if choice == "own" and target in own_res:
                    r, i = own_res[target], idx[probed]
                    mu[i], sd[i], zrow[i] = np.log(r["point"][i]), r["sigma"][i] * scale, q
                    idx = idx[~probed]
                elif target in few_logs and (choice == "few" or target in self.few_groups):
                    mine = probed.copy()
                    if choice != "few":  # only the groups the prior has no shape for
                        mine &= np.isin(groups[idx], self.few_groups[target])
                    i = idx[mine]
                    fm, fs = few_logs[target]
                    mu[i] = np.log(from_model_space(target, t.take(i), fm[i]))
                    sd[i] = np.sqrt(fs[i] ** 2 + (size_sd * near[i]) ** 2) * scale
                    zrow[i] = q
                    idx, probed = idx[~mine], probed[~mine]
                blend = choice == "blend" and target in few_logs and target in self.blend
                if blend:  # the trees' prediction for the probed rows, blended below
                    b_rows = idx[probed]
                    fm, fs = few_logs[target]
                    b_mu = np.log(from_model_space(target, t.take(b_rows), fm[b_rows]))
                    b_sd = np.sqrt(fs[b_rows] ** 2 + (size_sd * near[b_rows]) ** 2)
                if not len(idx):
                    continue
                off = np.array([cal.offset(target, g) for g in groups[idx]])
                var = np.array([cal.variance(target, g) for g in groups[idx]])
                mu[idx] += off
                extra_sz = (size_sd * _size_d(fl["size"][idx])) ** 2
                if choice == "residual" and target in res_logs:
                    i = np.flatnonzero(probed)
                    rm, rs = res_logs[target]
                    mu[idx[i]] += rm[idx[i]]
                    sd[idx[i]] = np.sqrt(rs[idx[i]] ** 2 + extra_sz[i]) * scale
                    zrow[idx[i]] = q
                    idx, var, extra_sz = idx[~probed], var[~probed], extra_sz[~probed]
                # the calibrated prior (its factor only where it is the chosen recipe)
                c = scale if choice == "calibrated" else \
                    self.meta.get("transfer", {}).get("cv", {}).get(target, {}).get(
                        "calibrated", {}).get("scale", 1.0)
                sd[idx] = np.sqrt(var + extra_sz) * c
                zrow[idx] = _t_quantile(cal.dof[target], 0.5 + float(
                    self.meta.get("interval", 0.9)) / 2)
                if blend and len(b_rows):
                    lam = self.blend[target]
                    own_sd = np.sqrt(var + extra_sz)[np.isin(idx, b_rows)]
                    mu[b_rows] = (1 - lam) * mu[b_rows] + lam * b_mu
                    sd[b_rows] = np.sqrt((1 - lam) * own_sd**2 + lam * b_sd**2) * scale
                    zrow[b_rows] = q
            out[target] = (mu, sd)
        if self.prior.meta.get("derived", {}).get("energy") and {"power", "runtime"} <= set(out):
            (lp, sp), (lr, sr) = out["power"], out["runtime"]
            out["energy"] = (lp + lr, np.hypot(sp, sr))
        res = result(out, {tg: flags.get(tg, flags["runtime"]) for tg in out}, zrow)
        bounds.clip(res, t)
        return res

    def _tree_logs(self, kind: str, trees: dict[str, tuple[Any, float]], t: Table
                   ) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """Per target and row of ``t``: the mean of the trees' predictions (log space),
        and their spread combined with the noise of one measurement (the sd before the
        interval scale)."""
        if not trees:
            return {}
        X32 = features.table_matrix(t).astype(np.float32)
        out = {}
        for target, (et, noise) in trees.items():
            key = f"{kind}/{target}"
            flat = self._flat.get(key)
            if flat is None and X32.shape[0] <= _FLAT_MAX_ROWS:
                flat = self._flat[key] = _FlatForest(et.estimators_)
            per_tree = _per_tree(et, flat, X32)
            out[target] = (per_tree.mean(axis=0),
                           np.maximum(np.sqrt(per_tree.std(axis=0) ** 2 + noise**2), MIN_SD))
        return out


def unknown_kernel_groups(prior: ForestModel, t: Table) -> dict[str, list[str]]:
    """Per prior target: the dtype/kernel groups of ``t``'s measured rows whose kernel
    the prior was never trained on (for that target), with MIN_GROUP_PROBES rows (trees
    on fewer probes of a kernel whose efficiency spans decades, GPPerf's tiled one, were
    off by up to 45x)."""
    recs = prior.meta.get("domain_targets") or {}
    if len(t) < MIN_OVERRIDE:
        return {}
    groups = _groups(t)
    out = {}
    for target in prior.forests:
        known = set((recs.get(target) or prior.meta.get("domain") or {}).get("kernels", []))
        ok = np.isfinite(t[COLUMN[target]])
        names_, counts = np.unique(groups[ok].astype(str), return_counts=True)
        names = [str(g) for g, c in zip(names_, counts)
                 if g.split("/")[1] not in known and c >= MIN_GROUP_PROBES]
        if names:
            out[target] = names
    return out


def _select(apes: Mapping[str, np.ndarray], default: str = DEFAULT_CHOICE,
            override: bool = True) -> str:
    """The recipe to use from per-probe out-of-fold errors (NaN where none): the
    default (the calibrated prior where it has no errors), unless ``override`` and
    another's error is lower by SELECT_SE standard errors of the paired difference (then
    the lowest of those that are)."""
    default = default if default in apes else "calibrated"
    if default not in apes:
        return min(apes, key=lambda c: float(np.nanmean(apes[c])))
    if not override:
        return default
    best, best_err = default, float(np.nanmean(apes[default]))
    for name, ape in apes.items():
        d = apes[default] - ape
        d = d[np.isfinite(d)]
        if name == default or len(d) < 2:
            continue
        se = float(np.std(d, ddof=1)) / math.sqrt(len(d))
        err = float(np.nanmean(ape))
        if float(np.mean(d)) > SELECT_SE * se and err < best_err:
            best, best_err = name, err
    return best


def _calibrated_logs(prior: ForestModel, cals: Mapping[str, DeviceCalibration], t: Table
                     ) -> dict[str, np.ndarray]:
    """Per prior target: the calibrated prior's log prediction for each row of ``t``."""
    logs, _ = prior.prior_logs(t)
    groups = _groups(t)
    uuids = [d.uuid for d in t.devices]
    out = {}
    for target, (mu, _) in logs.items():
        off = np.array([cals[uuids[int(d)]].offset(target, g) if uuids[int(d)] in cals
                        else 0.0 for d, g in zip(t.device, groups)])
        out[target] = mu + off
    return out


def _fit_trees(t: Table, cfg: ModelConfig, targets: Sequence[str],
               base: Mapping[str, np.ndarray] | None = None, n_jobs: int = 1
               ) -> dict[str, tuple[Any, float]]:
    """Per target: extremely randomized trees (FEW_MAX_FEATURES) on the probes of ``t``,
    repeats of a configuration fitted as one row (their median), and the noise of one
    measurement (log sd of the repeats; 0 without repeats); on the target's model space,
    or on log(measured) - ``base[target]`` where ``base`` is given."""
    from sklearn.ensemble import ExtraTreesRegressor

    X = features.table_matrix(t).astype(np.float32)
    gid = features.config_ids(t)
    out: dict[str, tuple[Any, float]] = {}
    for target in targets:
        if base is not None and target not in base:
            continue
        with np.errstate(divide="ignore", invalid="ignore"):
            y = to_model_space(target, t) if base is None else \
                np.log(t[COLUMN[target]]) - base[target]
        ok = np.isfinite(y)
        if ok.sum() < 2:
            continue
        first, med, cnt, inv = _aggregate(y[ok], gid[ok])
        noise = 0.0
        if (cnt >= 2).sum() >= 3:
            rep = cnt[inv] >= 2
            dev = y[ok][rep] - (np.bincount(inv, weights=y[ok]) / cnt)[inv][rep]
            noise = float(np.sqrt(np.sum(dev**2) / (rep.sum() - (cnt >= 2).sum())))
        Xg = X[ok][first]
        if len(med) > MAX_SAMPLES:  # bounds the fitting time, as the forests' max_samples
            keep = np.sort(np.random.default_rng(cfg.seed).choice(len(med), MAX_SAMPLES,
                                                                  replace=False))
            Xg, med, cnt = Xg[keep], med[keep], cnt[keep]
        et = ExtraTreesRegressor(n_estimators=cfg.n_estimators, min_samples_leaf=1,
                                 max_features=FEW_MAX_FEATURES, random_state=cfg.seed,
                                 n_jobs=n_jobs)
        et.fit(Xg, med, sample_weight=cnt.astype(np.float64))
        et.n_jobs = 1  # predictions are single-threaded whatever the fit used
        out[target] = (et, noise)
    return out


def conformal_quantile(x: np.ndarray, p: float) -> float:
    """The split-conformal quantile of scores ``x``: the ceil((n+1)p)-th smallest, so
    that a new score falls at or below it with probability >= p (the largest score,
    widened by 1/n, when n is too small for that)."""
    x = np.sort(np.asarray(x, dtype=float))
    n = len(x)
    k = math.ceil((n + 1) * p)
    return float(x[k - 1]) if k <= n else float(x[-1]) * (1.0 + 1.0 / n)


def _t_quantile(dof: float, p: float) -> float:
    from scipy.stats import t as student_t

    return float(student_t.ppf(p, dof))


def _device_meta(t: Table) -> list[dict[str, Any]]:
    import dataclasses

    used = sorted(set(t.device.tolist()))
    return [json.loads(json.dumps(dataclasses.asdict(t.devices[j]), default=str)) for j in used]


_CONFIG_COLUMNS = ("dtype", "kernel", "tile", "layout", "cta_m", "cta_n", "cta_k", "stages",
                   "out_dtype")


def _configs(t: Table, limit: int = 2000) -> list[dict[str, Any]]:
    """Distinct kernel configurations seen in training, per device (for `gemmd advise`)."""
    seen: dict[tuple, dict[str, Any]] = {}
    uuids = [d.uuid for d in t.devices]
    cols = [t[c] for c in _CONFIG_COLUMNS]
    for i in range(len(t)):
        key = (t.device[i], *(c[i] for c in cols))
        if key not in seen:
            rec = {c: _plain(v) for c, v in zip(_CONFIG_COLUMNS, key[1:])}
            seen[key] = {"device": uuids[int(key[0])], **rec}
            if len(seen) >= limit:
                break
    return list(seen.values())


def _plain(v: Any) -> Any:
    """A JSON-friendly scalar: integral floats as int."""
    v = v.item() if hasattr(v, "item") else v
    return int(v) if isinstance(v, float) and v.is_integer() else v


def _check_payload(payload: Any, path: Path) -> None:
    """skops trusts every scikit-learn estimator; insist on the shape gemmd writes."""
    from sklearn.ensemble import RandomForestRegressor

    ok = (isinstance(payload, dict) and set(payload) == {"forests", "sigma", "z", "meta"}
          and isinstance(payload["forests"], dict) and "runtime" in payload["forests"]
          and set(payload["forests"]) <= set(TARGETS)
          and all(type(f) is RandomForestRegressor for f in payload["forests"].values())
          and isinstance(payload["meta"], str))
    if not ok:
        raise ModelError(f"model file {path} is not a gemmd model (unexpected content)")


def _check_forests(payload: dict, path: Path) -> None:
    """The forests must read exactly gemmd's features: the metadata says which features a
    model uses, but the trees are walked by feature index, so a forest fitted on other
    columns (and a forged checksum) would serve nonsense without an error."""
    n = len(features.FEATURES)
    for target, rf in payload["forests"].items():
        trees = getattr(rf, "estimators_", None) or []
        bad = getattr(rf, "n_features_in_", None) != n or not trees or any(
            getattr(t, "n_features_in_", None) != n or t.tree_.n_features != n
            or (t.tree_.feature >= n).any() for t in trees)
        if bad:
            raise ModelError(f"model file {path}: the {target} forest does not read gemmd's "
                             f"{n} features (fitted on other data); refit it")
    sigma = payload["sigma"]
    if not isinstance(sigma, dict) or not set(payload["forests"]) <= set(sigma) <= set(
            TARGETS) or not all(
            isinstance(v, float) and math.isfinite(v) and v >= 0 for v in sigma.values()) \
            or not isinstance(payload["z"], float) or not math.isfinite(payload["z"]):
        raise ModelError(f"model file {path}: its prediction intervals are not gemmd's "
                         "(sigma and z)")


