"""Fit, predict (with intervals), evaluate, save and load the performance model.

Two predictors share one interface: the analytical roofline estimate used until enough
probes exist, and a Random Forest per target (runtime, power, energy) trained on stored
probes. Targets are learned in log space relative to physics (runtime / roofline time,
energy / FLOP) so that the forest predicts efficiency, which carries to unseen sizes.
Intervals combine the spread of the trees with the out-of-bag residual noise.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import tempfile
import time
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from statistics import NormalDist
from typing import Any

import numpy as np

from gemmd import features
from gemmd.config import ModelConfig
from gemmd.devices.base import DeviceInfo
from gemmd.errors import ModelError
from gemmd.probes import ProbeSpec

logger = logging.getLogger(__name__)

TARGETS = ("runtime", "power", "energy")
_COLUMN = {"runtime": "runtime_s", "power": "power_w", "energy": "energy_j"}

# The only types a model file may contain; anything else is refused before loading.
TRUSTED_TYPES = [
    "sklearn.ensemble._forest.RandomForestRegressor",
    "sklearn.tree._classes.DecisionTreeRegressor",
    "sklearn.tree._tree.Tree",
    "numpy.random._mt19937.MT19937",
]


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


def _target_values(target: str, rows: Sequence[Mapping[str, Any]], specs: Sequence[ProbeSpec],
                   roof: np.ndarray) -> np.ndarray:
    """Model-space target (log efficiency etc.); NaN where not measured."""
    raw = np.array([r.get(_COLUMN[target]) if r.get(_COLUMN[target]) is not None else np.nan
                    for r in rows], dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        if target == "runtime":
            y = np.log(raw / roof)
        elif target == "power":
            y = np.log(raw)
        else:
            y = np.log(raw / np.array([s.flops for s in specs]))
    y[~np.isfinite(y)] = np.nan
    return y


def _from_model_space(target: str, y: np.ndarray, specs: Sequence[ProbeSpec],
                      roof: np.ndarray) -> np.ndarray:
    if target == "runtime":
        return np.exp(y) * roof
    if target == "power":
        return np.exp(y)
    return np.exp(y) * np.array([s.flops for s in specs])


def data_hash(rows: Sequence[Mapping[str, Any]]) -> str:
    h = hashlib.sha256()
    for r in rows:
        h.update(json.dumps([r.get(c) for c in ("device_uuid", "m", "n", "k", "dtype", "kernel",
                                                 "tile", "layout", "runtime_s", "power_w",
                                                 "energy_j")], default=str).encode())
    return h.hexdigest()[:16]


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

    @classmethod
    def fit(cls, rows: Sequence[Mapping[str, Any]], infos: Sequence[DeviceInfo],
            cfg: ModelConfig) -> ForestModel:
        """Fit on probe rows (store dicts) with the DeviceInfo of each row's device."""
        from sklearn.ensemble import RandomForestRegressor

        if len(rows) < cfg.min_samples:
            raise ModelError(f"{len(rows)} samples, fewer than model.min_samples "
                             f"({cfg.min_samples})")
        t0 = time.perf_counter()
        specs = [features.spec_of(r) for r in rows]
        X = features.matrix(specs, infos)
        roof = features.roofline_vector(specs, infos)
        forests, sigma, scores, counts = {}, {}, {}, {}
        for target in TARGETS:
            y = _target_values(target, rows, specs, roof)
            ok = np.isfinite(y)
            if ok.sum() < cfg.min_samples:
                continue
            rf = RandomForestRegressor(
                n_estimators=cfg.n_estimators, max_depth=cfg.max_depth or None,
                min_samples_leaf=cfg.min_samples_leaf, oob_score=True, bootstrap=True,
                random_state=cfg.seed, n_jobs=1)
            with warnings.catch_warnings():
                # Rows that every bootstrap drew have no OOB estimate; handled below.
                warnings.filterwarnings("ignore", message="Some inputs do not have OOB")
                rf.fit(X[ok], y[ok])
            oob = rf.oob_prediction_
            idx = np.flatnonzero(ok)[np.isfinite(oob)]  # rows with an out-of-bag estimate
            resid = y[idx] - oob[np.isfinite(oob)]
            sigma[target] = float(np.sqrt(np.mean(resid**2))) if resid.size else 0.0
            sub = [specs[i] for i in idx]
            meas = _from_model_space(target, y[idx], sub, roof[idx])
            pred = _from_model_space(target, oob[np.isfinite(oob)], sub, roof[idx])
            ape = np.abs(pred - meas) / meas if meas.size else np.array([np.nan])
            scores[target] = {"oob_mape": float(np.mean(ape)),
                              "oob_median_ape": float(np.median(ape))}
            counts[target] = int(ok.sum())
            forests[target] = rf
        if "runtime" not in forests:
            raise ModelError("no runtime measurements to fit on")
        z = NormalDist().inv_cdf(0.5 + cfg.interval / 2)
        meta = {"n_samples": len(rows), "targets": counts, "scores": scores,
                "features": list(features.FEATURES), "interval": cfg.interval,
                "data_hash": data_hash(rows), "fit_seconds": time.perf_counter() - t0,
                "created": time.time()}
        return cls(forests, sigma, z, meta)

    def predict(self, specs: Sequence[ProbeSpec], infos: Sequence[DeviceInfo]
                ) -> list[Prediction]:
        if not specs:
            return []
        X = features.matrix(specs, infos)
        roof = features.roofline_vector(specs, infos)
        preds = [Prediction() for _ in specs]
        for target, rf in self.forests.items():
            per_tree = np.stack([t.predict(X) for t in rf.estimators_])
            mean, spread = per_tree.mean(axis=0), per_tree.std(axis=0)
            sd = np.sqrt(spread**2 + self.sigma.get(target, 0.0) ** 2)
            point = _from_model_space(target, mean, specs, roof)
            lo = _from_model_space(target, mean - self.z * sd, specs, roof)
            hi = _from_model_space(target, mean + self.z * sd, specs, roof)
            name = {"runtime": "runtime", "power": "power", "energy": "energy"}[target]
            unit = {"runtime": "_s", "power": "_w", "energy": "_j"}[target]
            for i, p in enumerate(preds):
                setattr(p, name + unit, float(point[i]))
                setattr(p, name + "_lo", float(lo[i]))
                setattr(p, name + "_hi", float(hi[i]))
                p.sigma[target] = float(sd[i])
        return preds

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
            return cls(payload["forests"], dict(payload["sigma"]), float(payload["z"]), meta)
        except ModelError:
            raise
        except Exception as e:  # skops/zipfile/json raise many types on a corrupt file
            raise ModelError(f"model file {path} cannot be read: {type(e).__name__}: {e}") from e


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


def _sha256(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
