"""Honest evaluation: gemmd's model and GPPerf's published pipeline on the same splits.

Two splits, both seeded (42, as GPPerf): a random 80/20 split of rows, which lets the
repeats of a configuration sit on both sides, and a split by shape, where no (M, N, K)
is in both train and test, which is what predicting a new GEMM means. Per target: R²,
mean and median absolute percentage error, and for gemmd the coverage of its intervals.
The noise floor is what repeated measurements of one configuration disagree by.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from gemmd import features
from gemmd.config import ModelConfig
from gemmd.errors import InputError, ModelError
from gemmd.features import Table
from gemmd.gemm import COLUMN, TARGETS
from gemmd.model import ForestModel

SEED = 42
TEST_SIZE = 0.2
SPLITS = ("random", "shape")


# ------------------------------------------------------------------ splits


def random_split(n: int, seed: int = SEED, test_size: float = TEST_SIZE
                 ) -> tuple[np.ndarray, np.ndarray]:
    """GPPerf's split: train_test_split(test_size=0.2, random_state=42) over rows."""
    from sklearn.model_selection import train_test_split

    if n < 2:
        raise InputError(f"the random split needs at least two rows (the data has {n})")
    train, test = train_test_split(np.arange(n), test_size=test_size, random_state=seed)
    return np.sort(train), np.sort(test)


def shape_groups(t: Table) -> np.ndarray:
    """Group id per row: rows with the same (M, N, K) share one."""
    keys = np.column_stack([t["m"], t["n"], t["k"]])
    return np.unique(keys, axis=0, return_inverse=True)[1].ravel()


def shape_split(t: Table, seed: int = SEED, test_size: float = TEST_SIZE
                ) -> tuple[np.ndarray, np.ndarray]:
    """About ``test_size`` of the shapes held out whole: no (M, N, K) on both sides."""
    from sklearn.model_selection import GroupShuffleSplit

    groups = shape_groups(t)
    if len(np.unique(groups)) < 2:
        raise InputError("the split by shape needs at least two distinct shapes")
    gss = GroupShuffleSplit(n_splits=1, test_size=test_size, random_state=seed)
    train, test = next(gss.split(np.zeros(len(t)), groups=groups))
    return np.sort(train), np.sort(test)


def split(t: Table, kind: str, seed: int = SEED) -> tuple[np.ndarray, np.ndarray]:
    if kind == "random":
        return random_split(len(t), seed)
    if kind == "shape":
        return shape_split(t, seed)
    raise InputError(f"unknown split {kind!r} (known: {', '.join(SPLITS)})")


# ------------------------------------------------------------------ metrics


def metrics(measured: np.ndarray, predicted: np.ndarray) -> dict[str, float]:
    """R², mean and median absolute percentage error (as fractions), on measured rows."""
    ok = np.isfinite(measured) & np.isfinite(predicted)
    y, p = measured[ok], predicted[ok]
    if not y.size:
        return {"n": 0}
    ape = np.abs(p - y) / np.abs(y)
    ss_tot = float(np.sum((y - y.mean()) ** 2))
    r2 = 1.0 - float(np.sum((y - p) ** 2)) / ss_tot if ss_tot > 0 else float("nan")
    return {"n": int(y.size), "r2": r2, "mape": float(ape.mean()),
            "median_ape": float(np.median(ape)), "p90_ape": float(np.percentile(ape, 90))}


# ------------------------------------------------------------------ GPPerf's baseline


class GPPerfBaseline:
    """GPPerf's published pipeline (cutlass-analysis/cutlass_predictor.py).

    Features m, n, k, blocksize1..3 (the CUTLASS CTA tile; the tile edge for the tiled
    kernel; 0 when unknown), arithmetic_intensity, bytes_accessed = 4(mk+kn+mn),
    total_flops = 2mnk; features and targets clipped to their 1st/99th percentiles;
    StandardScaler; RandomForestRegressor(n_estimators=100, max_depth=6) per target (what
    MultiOutputRegressor does); raw targets (milliseconds there, seconds here: the same
    forest up to scale). Differences, all in the baseline's favour or neutral: percentiles
    come from the training split only (GPPerf took them over all rows before splitting),
    each target trains on the rows where it was measured (GPPerf dropped rows missing any
    target), random_state is fixed for reproducibility and n_jobs=1.
    """

    name = "gpperf"
    FEATURES = ("m", "n", "k", "blocksize1", "blocksize2", "blocksize3",
                "arithmetic_intensity", "bytes_accessed", "total_flops")

    def __init__(self, seed: int = SEED):
        self.seed = seed
        self.models: dict[str, Any] = {}
        self.clip: tuple[np.ndarray, np.ndarray] | None = None

    @classmethod
    def features(cls, t: Table) -> np.ndarray:
        m, n, k = t["m"], t["n"], t["k"]
        tiled = t["kernel"] == "tiled"
        b1 = np.where(t["cta_m"] > 0, t["cta_m"], np.where(tiled, t["tile"], 0.0))
        b2 = np.where(t["cta_n"] > 0, t["cta_n"], np.where(tiled, t["tile"], 0.0))
        b3 = np.where(t["cta_k"] > 0, t["cta_k"], np.where(tiled, t["tile"], 0.0))
        flops = 2 * m * n * k
        by = (m * k + k * n + m * n) * 4
        return np.column_stack([m, n, k, b1, b2, b3, flops / by, by, flops])

    def fit(self, t: Table, progress: Callable[[int], None] | None = None) -> GPPerfBaseline:
        from sklearn.ensemble import RandomForestRegressor
        from sklearn.pipeline import make_pipeline
        from sklearn.preprocessing import StandardScaler

        X = self.features(t)
        self.clip = (np.percentile(X, 1, axis=0), np.percentile(X, 99, axis=0))
        X = np.clip(X, *self.clip)
        for target in TARGETS:
            y = t[COLUMN[target]]
            ok = np.isfinite(y)
            if ok.sum() < 2:
                if progress:
                    progress(1)
                continue
            lo, hi = np.percentile(y[ok], [1, 99])
            pipe = make_pipeline(StandardScaler(), RandomForestRegressor(
                n_estimators=100, max_depth=6, random_state=self.seed, n_jobs=1))
            pipe.fit(X[ok], np.clip(y[ok], lo, hi))
            self.models[target] = pipe
            if progress:
                progress(1)
        return self

    def predict_table(self, t: Table) -> dict[str, dict[str, np.ndarray]]:
        assert self.clip is not None
        X = np.clip(self.features(t), *self.clip)
        return {target: {"point": pipe.predict(X)} for target, pipe in self.models.items()}


class GemmdModel:
    """gemmd's ForestModel behind the same fit/predict_table interface as the baseline."""

    name = "gemmd"

    def __init__(self, cfg: ModelConfig | None = None, n_jobs: int = 1):
        self.cfg = cfg or ModelConfig(min_samples=2)
        self.n_jobs = n_jobs
        self.model: ForestModel | None = None

    def fit(self, t: Table, progress: Callable[[int], None] | None = None) -> GemmdModel:
        self.model = ForestModel.fit_table(t, self.cfg, progress=progress, n_jobs=self.n_jobs)
        return self

    def predict_table(self, t: Table) -> dict[str, dict[str, np.ndarray]]:
        assert self.model is not None
        return self.model.predict_table(t)


# ------------------------------------------------------------------ running


def score(t: Table, pred: dict[str, dict[str, np.ndarray]]) -> dict[str, dict[str, float]]:
    out = {}
    for target, res in pred.items():
        y = t[COLUMN[target]]
        m = metrics(y, res["point"])
        if "lo" in res and m.get("n"):
            ok = np.isfinite(y)
            m["coverage"] = float(np.mean((res["lo"][ok] <= y[ok]) & (y[ok] <= res["hi"][ok])))
            if "in_domain" in res:  # share of test rows the model has data like
                m["in_domain"] = float(np.mean(res["in_domain"][ok]))
        out[target] = m
    return out


def evaluate(t: Table, *, splits: Sequence[str] = SPLITS, baseline: bool = True,
             cfg: ModelConfig | None = None, seed: int = SEED, n_jobs: int = 1,
             progress: Callable[[int], None] | None = None) -> dict[str, Any]:
    """Fit and score gemmd (and the baseline) on each split; figures as plain dicts."""
    out: dict[str, Any] = {"rows": len(t), "shapes": int(len(np.unique(shape_groups(t)))),
                           "measured": {tg: int(np.isfinite(t[COLUMN[tg]]).sum())
                                        for tg in TARGETS},
                           "seed": seed, "test_size": TEST_SIZE,
                           "noise_floor": noise_floor(t), "splits": {}}
    for kind in splits:
        train, test = split(t, kind, seed)
        tr, te = t.take(train), t.take(test)
        res: dict[str, Any] = {"train_rows": len(train), "test_rows": len(test)}
        models: list[Any] = [GemmdModel(cfg, n_jobs)]
        if baseline:
            models.append(GPPerfBaseline(seed))
        for model in models:
            t0 = time.perf_counter()
            try:
                model.fit(tr, progress)
            except ModelError as e:  # too few rows to train on: say which split left them
                raise ModelError(f"the {kind} split trains on {len(train)} of {len(t)} rows: "
                                 f"{e}") from e
            t1 = time.perf_counter()
            pred = model.predict_table(te)
            t2 = time.perf_counter()
            res[model.name] = {"fit_s": t1 - t0, "predict_s": t2 - t1, "targets": score(te, pred)}
        out["splits"][kind] = res
    return out


# ------------------------------------------------------------------ a fitted model


CALIBRATION_SHAPES = 0.75  # the most of a table's shapes calibration rows are drawn from


def calibration_split(t: Table, rows: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(calibration, test) row indices with no shape (M, N, K) on both sides: ``rows``
    rows drawn at random as a new GPU's first probes, one per shape (shapes in the order
    a random permutation of the rows reaches them, so drawn as often as the data hold
    them, a random row of each), from at most CALIBRATION_SHAPES of the shapes (then a
    second row of each, and so on); the test set is every row of the other shapes."""
    if rows < 0:
        raise InputError(f"--calibrate-rows {rows}: give 0 or more rows")
    groups = shape_groups(t)
    n_shapes = int(groups.max()) + 1 if len(t) else 0
    rng = np.random.default_rng(seed)
    take = min(rows, int(CALIBRATION_SHAPES * n_shapes))
    uniq, firsts = np.unique(groups[rng.permutation(len(t))], return_index=True)
    chosen = uniq[np.argsort(firsts)][:take]
    pool = np.flatnonzero(np.isin(groups, chosen))
    if len(pool) < rows or n_shapes - take < 1:
        raise InputError(f"--calibrate-rows {rows}: too many for the data ({len(t):,} "
                         f"rows, {n_shapes:,} shapes): calibration rows come from at most "
                         f"{100 * CALIBRATION_SHAPES:.0f}% of the shapes, the others are "
                         "the test")
    rank = np.empty(n_shapes, dtype=np.int64)
    rank[chosen] = np.arange(take)
    rnd = rng.permutation(len(pool))  # a random row of each shape first, then another
    within = np.empty(len(pool), dtype=np.int64)
    order = np.lexsort((rnd, rank[groups[pool]]))
    g_sorted = groups[pool][order]
    starts = np.r_[0, np.flatnonzero(g_sorted[1:] != g_sorted[:-1]) + 1]
    counts = np.diff(np.r_[starts, len(order)])
    within[order] = np.arange(len(order)) - np.repeat(starts, counts)
    cal = np.sort(pool[np.lexsort((rank[groups[pool]], within))[:rows]])
    test = np.flatnonzero(~np.isin(groups, chosen))
    return cal, test


def evaluate_model(model: Any, t: Table, *, cfg: ModelConfig | None = None,
                   calibrate: Table | None = None, calibrate_rows: Sequence[int] = (),
                   seeds: int = 1, progress: Callable[[int], None] | None = None
                   ) -> dict[str, Any]:
    """A fitted model judged on ``t`` without refitting it: as it is ("model"), carried
    over by the rows of ``calibrate`` (a new GPU's first probes, TransferModel), and for
    each N of ``calibrate_rows`` carried over by N rows of ``t`` itself, drawn by whole
    shapes (calibration_split) and judged on the other shapes, the figures averaged over
    ``seeds`` draws. The same metrics as evaluate() (MAPE, median and p90 APE, R²,
    coverage, share in domain) under "splits"; from two draws, their standard deviation
    over the draws too ("spread": MAPE and coverage), for one draw of a few probes is
    not another (the shared RTX 4070 at 50: 98.2% covered over three draws, 87.0% over
    six)."""
    from gemmd.model import ForestModel, TransferModel

    cfg = cfg or ModelConfig(min_samples=2)
    prior = model.base_prior if isinstance(model, TransferModel) else model
    out: dict[str, Any] = {"rows": len(t), "shapes": int(len(np.unique(shape_groups(t)))),
                           "measured": {tg: int(np.isfinite(t[COLUMN[tg]]).sum())
                                        for tg in TARGETS},
                           "model": getattr(model, "version", "?"), "seeds": seeds,
                           "noise_floor": noise_floor(t), "splits": {}}

    def judge(m: Any, te: Table) -> dict[str, Any]:
        t0 = time.perf_counter()
        pred = m.predict_table(te)
        return {"predict_s": time.perf_counter() - t0, "targets": score(te, pred)}

    out["splits"]["model"] = {"test_rows": len(t), "gemmd": judge(model, t)}
    if progress:
        progress(1)
    if calibrate is not None:
        if not isinstance(prior, ForestModel):
            raise ModelError("calibration carries a fitted model over to a device; this "
                             "model is not one")
        t0 = time.perf_counter()
        tm = TransferModel.fit(prior, calibrate, cfg)
        res = judge(tm, t)
        res["fit_s"] = time.perf_counter() - t0
        res["settings"] = _settings([tm.meta["transfer"].get("setting")])
        out["splits"][f"calibrated on {len(calibrate):,} rows"] = {
            "test_rows": len(t), "calibration_rows": len(calibrate), "gemmd": res}
        if progress:
            progress(1)
    for n in calibrate_rows:
        if not isinstance(prior, ForestModel):
            raise ModelError("calibration carries a fitted model over to a device; this "
                             "model is not one")
        runs = []
        for seed in range(seeds):
            cal, test = calibration_split(t, n, seed)
            te = t.take(test)
            t0 = time.perf_counter()
            m = TransferModel.fit(prior, t.take(cal), cfg) if n else prior
            fit_s = time.perf_counter() - t0
            runs.append({**judge(m, te), "fit_s": fit_s, "test_rows": len(test),
                         "choice": dict(getattr(m, "choice", {})),
                         "setting": (m.meta.get("transfer") or {}).get("setting")})
            if progress:
                progress(1)
        out["splits"][f"{n} rows"] = {
            "calibration_rows": n, "test_rows": float(np.mean([r["test_rows"] for r in runs])),
            "gemmd": {"fit_s": float(np.mean([r["fit_s"] for r in runs])),
                      "predict_s": float(np.mean([r["predict_s"] for r in runs])),
                      "targets": _mean_scores([r["targets"] for r in runs]),
                      # (0 rows: every draw is the model as it is, on every row)
                      **({"spread": _spread_scores([r["targets"] for r in runs])}
                         if n else {}),
                      "choices": sorted({c for r in runs for c in r["choice"].values()}),
                      "settings": _settings([r["setting"] for r in runs])}}
    return out


def _settings(chosen: Sequence[dict[str, Any] | None]) -> list[str]:
    """The transfer settings some calibrations' probes chose (choosing), "w=0.5 a=1", or
    "launch" (the prior's own with a launch offset, choosing.LAUNCH)."""
    return sorted({"launch" if c.get("launch") else f"w={c['w']:g} a={c['a']:g}"
                   for c in chosen if c})


def _judged(runs: Sequence[dict[str, dict[str, float]]]
            ) -> Iterator[tuple[str, list[dict[str, float]]]]:
    """Per target of any run: (target, its scores in the runs that judged rows of it)."""
    for target in dict.fromkeys(tg for r in runs for tg in r):
        yield target, [r[target] for r in runs if target in r and r[target].get("n")]


def _mean_scores(runs: Sequence[dict[str, dict[str, float]]]) -> dict[str, dict[str, float]]:
    """Per target and metric, the mean over runs that have it (n: the mean count)."""
    out: dict[str, dict[str, float]] = {}
    for target, per in _judged(runs):
        if per:
            keys = dict.fromkeys(k for p in per for k in p)
            out[target] = {k: float(np.mean([p[k] for p in per if k in p])) for k in keys}
    return out


SPREAD_METRICS = ("mape", "coverage")  # evaluate_model's "spread" over draws


def _spread_scores(runs: Sequence[dict[str, dict[str, float]]]
                   ) -> dict[str, dict[str, float]]:
    """Per target, the standard deviation over runs (ddof 1) of SPREAD_METRICS, where
    two runs or more have it."""
    out: dict[str, dict[str, float]] = {}
    for target, per in _judged(runs):
        sd = {k: float(np.std(v, ddof=1)) for k in SPREAD_METRICS
              if len(v := [p[k] for p in per if p.get(k) is not None]) >= 2}
        if sd:
            out[target] = sd
    return out


def work_units(t: Table, splits: Sequence[str], baseline: bool) -> int:
    """How many forests evaluate() fits (for a progress bar)."""
    return len(splits) * len(TARGETS) * (2 if baseline else 1)


# ------------------------------------------------------------------ noise floor

def noise_floor(t: Table) -> dict[str, Any]:
    """Spread between repeated measurements of one configuration, per target.

    ``median_cv``: median over configurations of std/mean (ddof=1). ``loo_mape`` and
    ``loo_median_ape``: the error of predicting each repeat by the mean of the others, the
    best a model that knows the configuration can do on a random split. None where no
    configuration was measured twice.
    """
    gid = features.config_ids(t)
    out: dict[str, Any] = {}
    for target in TARGETS:
        y = t[COLUMN[target]]
        ok = np.isfinite(y)
        g, v = gid[ok], y[ok]
        counts = np.bincount(g, minlength=gid.max() + 1 if len(gid) else 0)
        rep = counts[g] >= 2
        if not rep.any():
            out[target] = None
            continue
        g, v = g[rep], v[rep]
        cnt = counts[g].astype(np.float64)
        s = np.bincount(g, weights=v)[g]
        s2 = np.bincount(g, weights=v * v)[g]
        mean = s / cnt
        var = np.maximum(s2 / cnt - mean**2, 0.0) * cnt / (cnt - 1)
        first = np.unique(g, return_index=True)[1]
        loo = (s - v) / (cnt - 1)
        ape = np.abs(loo - v) / v
        out[target] = {"configs": int(len(first)), "rows": int(len(v)),
                       "median_cv": float(np.median(np.sqrt(var[first]) / mean[first])),
                       "loo_mape": float(ape.mean()), "loo_median_ape": float(np.median(ape))}
    return out

