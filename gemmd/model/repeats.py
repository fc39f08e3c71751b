"""Repeated configurations and seen shapes: 64-bit hashes of a row's configuration and
of its shape, the interval of a configuration measured often (_repeat_stats), and the
interval scale for shapes the model has not seen (_shape_scale)."""

from __future__ import annotations

import base64
import functools
import hashlib
import math
from collections.abc import Mapping
from statistics import NormalDist
from typing import Any

import numpy as np

from gemmd import features
from gemmd.config import ModelConfig
from gemmd.features import Table
from gemmd.hardware import gpu_model_key
from gemmd.model.flat import _FLAT_MAX_ROWS
from gemmd.model.intervals import (
    MAX_FEATURES,
    MAX_SAMPLES,
    MIN_REPEATS,
    _aggregate,
    _folded_half_width,
    _loo_deviations,
    _scale_for,
)
from gemmd.model.space import to_model_space

MAX_SHAPE_SET = 50_000  # distinct shapes a model remembers (8 bytes each, in its metadata)
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
