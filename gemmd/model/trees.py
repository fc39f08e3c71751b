"""The trees a TransferModel fits on a device's probes: the few-probe trees ("few") on
the targets' model space, and the residual trees on what the calibrated prior leaves."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from gemmd import features
from gemmd.config import ModelConfig
from gemmd.features import Table
from gemmd.gemm import COLUMN
from gemmd.model.intervals import MAX_SAMPLES, _aggregate
from gemmd.model.space import to_model_space

# "few": extremely randomized trees on the device's probes, each split the best of one
# random threshold on each of a third of the features (Breiman's p/3 for regression). On a
# few probes a bootstrapped forest's best-threshold splits make a coarse step function of
# them; random thresholds average into a smoother one (bench/transfer.py, 20 probes:
# 15.6-28.9% MAPE on held-out shapes against 16.1-29.9% for gemmd's forest on the same
# probes, better on every GPU of the shared data; at 200 probes 7-19% against 8-21%,
# worse on the RTX 4070 only).
FEW_MAX_FEATURES = 1 / 3


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
