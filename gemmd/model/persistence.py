"""What a model file holds and what loading one checks: the format, the trusted types,
the payload's shape and its forests' features; the device and configuration records
kept in a model's metadata."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from gemmd import features
from gemmd.errors import ModelError
from gemmd.features import Table
from gemmd.gemm import TARGETS

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
