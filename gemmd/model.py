"""Fit, predict (with intervals), save and load the performance model.

Two predictors share one interface: the analytical roofline estimate used until enough
probes exist, and a Random Forest per target (runtime, power, energy) trained on stored
probes or imported measurements. Targets are learned in log space relative to physics
(runtime / roofline time, power / power limit, energy / FLOP) so that the forest predicts
efficiency, which carries to unseen sizes. Repeats of a configuration are fitted as one
row (their median); energy is power x runtime where the data agree. Intervals combine the
spread of the trees with the noise of a single measurement. docs/model.md has the why.
"""

from __future__ import annotations

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

from gemmd import features
from gemmd.config import ModelConfig
from gemmd.devices.base import DeviceInfo
from gemmd.errors import ModelError
from gemmd.features import Table
from gemmd.gemm import COLUMN, TARGETS, ProbeSpec

# Bumped whenever features or target spaces change: older files are refused, not misread.
MODEL_FORMAT = 2

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

Progress = Callable[[int], None]


@dataclass
class Prediction:
    """Point prediction and interval per target; None where the predictor has no estimate."""

    runtime_s: float | None = None
    runtime_lo: float | None = None
    runtime_hi: float | None = None
    power_w: float | None = None
    power_lo: float | None = None
    power_hi: float | None = None
    energy_j: float | None = None
    energy_lo: float | None = None
    energy_hi: float | None = None
    sigma: dict[str, float] = field(default_factory=dict)  # log-space std per target


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
        roof = features.roofline_vector(specs, infos)
        out = []
        for r in roof:
            t = float(r) / self.efficiency
            out.append(Prediction(runtime_s=t, runtime_lo=t / self.interval_factor,
                                  runtime_hi=t * self.interval_factor,
                                  sigma={"runtime": math.log(self.interval_factor) / 1.645}))
        return out


# ------------------------------------------------------------------ target spaces


def _scale(target: str, t: Table) -> np.ndarray:
    """Physics reference each target is learned relative to (in log space)."""
    if target == "runtime":
        return features.roofline(t)
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


def _fit_one(X: np.ndarray, y: np.ndarray, gid: np.ndarray, cfg: ModelConfig, n_jobs: int
             ) -> tuple[Any, float, np.ndarray]:
    """One forest on per-configuration medians: (forest, sigma, OOB prediction per row).

    sigma is the noise of a single measurement around the prediction, in log space: the
    spread of repeats of one configuration where there are repeats, else the out-of-bag
    residual (which then also carries the model's own error: wider, not narrower).
    """
    from sklearn.ensemble import RandomForestRegressor

    first, med, cnt, inv = _aggregate(y, gid)
    n = len(med)
    rf = RandomForestRegressor(
        n_estimators=cfg.n_estimators, max_depth=cfg.max_depth or None,
        min_samples_leaf=cfg.min_samples_leaf, max_features=MAX_FEATURES,
        max_samples=min(1.0, MAX_SAMPLES / n), oob_score=n >= 2, bootstrap=True,
        random_state=cfg.seed, n_jobs=n_jobs)
    with warnings.catch_warnings():
        # Configurations that every bootstrap drew have no OOB estimate; NaN below.
        warnings.filterwarnings("ignore", message="Some inputs do not have OOB")
        rf.fit(X[first], med, sample_weight=cnt.astype(np.float64))
    rf.n_jobs = 1  # predictions are single-threaded whatever the fit used
    oob_g = rf.oob_prediction_ if n >= 2 else np.full(n, np.nan)
    oob_g = np.where(np.isfinite(oob_g), oob_g, np.nan)
    rep = cnt[inv] >= 2
    if rep.sum() >= 2 * max(1, int((cnt >= 2).sum())) and (cnt >= 2).sum() >= 3:
        dev = y[rep] - np.bincount(inv, weights=y)[inv][rep] / cnt[inv][rep]
        dof = float(rep.sum() - (cnt >= 2).sum())
        s = float(np.sqrt(np.sum(dev**2) / dof))
    else:
        resid = y - oob_g[inv]
        resid = resid[np.isfinite(resid)]
        s = float(np.sqrt(np.mean(resid**2))) if resid.size else 0.0
    return rf, s, oob_g[inv]


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
        for target in targets:
            y = to_model_space(target, t)
            ok = np.isfinite(y)
            counts[target] = int(ok.sum())
            if target == "energy" and _energy_is_derived(t, forests):
                derived["energy"] = "power*runtime"
                oob["energy"] = oob["power"] * oob["runtime"]
                sigma["energy"] = float(math.hypot(sigma["power"], sigma["runtime"]))
            elif counts[target] >= cfg.min_samples:
                rf, s, o = _fit_one(X[ok], y[ok], gid[ok], cfg, n_jobs)
                forests[target], sigma[target] = rf, s
                oob[target] = np.full(len(t), np.nan)
                oob[target][ok] = from_model_space(target, t.take(np.flatnonzero(ok)), o)
            if progress:
                progress(1)
        if "runtime" not in forests:
            raise ModelError("no runtime measurements to fit on")
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
                           "max_features": MAX_FEATURES, "max_samples": MAX_SAMPLES,
                           "seed": cfg.seed},
                "devices": _device_meta(t), "configs": _configs(t)}
        return cls(forests, sigma, z, meta)

    # ------------------------------------------------------------- predicting
    def predict(self, specs: Sequence[ProbeSpec], infos: Sequence[DeviceInfo]
                ) -> list[Prediction]:
        if not specs:
            return []
        out = self.predict_table(Table.from_specs(specs, infos))
        preds = [Prediction() for _ in specs]
        for target, res in out.items():
            for i, p in enumerate(preds):
                setattr(p, COLUMN[target], float(res["point"][i]))
                setattr(p, f"{target}_lo", float(res["lo"][i]))
                setattr(p, f"{target}_hi", float(res["hi"][i]))
                p.sigma[target] = float(res["sigma"][i])
        return preds

    def predict_table(self, t: Table) -> dict[str, dict[str, np.ndarray]]:
        """Per target: point, lo, hi (SI units) and sigma (log space), one entry per row."""
        if not len(t):
            return {}
        X32 = features.table_matrix(t).astype(np.float32)
        logs: dict[str, tuple[np.ndarray, np.ndarray]] = {}  # log point, log-space sd
        for target, rf in self.forests.items():
            flat = self._flat.get(target)
            if flat is None and X32.shape[0] <= _FLAT_MAX_ROWS:
                flat = self._flat[target] = _FlatForest(rf.estimators_)
            per_tree = _per_tree(rf, flat, X32)
            mean, spread = per_tree.mean(axis=0), per_tree.std(axis=0)
            sd = np.sqrt(spread**2 + self.sigma.get(target, 0.0) ** 2)
            logs[target] = (np.log(from_model_space(target, t, mean)), sd)
        if self.meta.get("derived", {}).get("energy") and {"power", "runtime"} <= set(logs):
            (lp, sp), (lr, sr) = logs["power"], logs["runtime"]
            logs["energy"] = (lp + lr, np.hypot(sp, sr))
        return {target: {"point": np.exp(mu), "lo": np.exp(mu - self.z * sd),
                         "hi": np.exp(mu + self.z * sd), "sigma": sd}
                for target, (mu, sd) in logs.items()}

    # -------------------------------------------------------------- persistence
    def save(self, path: str | Path) -> str:
        """Write atomically (temp file + rename); returns the file's sha256."""
        import skops.io as sio

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
            digest = _sha256(tmp)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return digest

    @classmethod
    def load(cls, path: str | Path, sha256: str | None = None) -> ForestModel:
        """Load without executing code: checksum first, then skops with trusted types only."""
        import skops.io as sio

        path = Path(path)
        if not path.is_file():
            raise ModelError(f"model file {path} does not exist")
        if sha256 and _sha256(path) != sha256:
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


def _sha256(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
