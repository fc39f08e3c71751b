"""What a model file holds and what loading one checks: the format, the payload's shape
and its forests' features; the device and configuration records kept in a model's
metadata.

A model file is a zip archive, uncompressed: ``gemmd-model.json`` (the metadata, the
intervals' sigma and z, and per forest its trees and nodes) and per forest the flat
arrays of its trees (gemmd.model.flat), one ``.npy`` member each (``TARGET/NAME.npy``),
read with numpy without pickle. Reading one imports neither scikit-learn nor skops:
what the daemon predicts from is these arrays. Files written before (a skops archive of
scikit-learn's forests, the same model format) are still read, with skops and an
explicit list of trusted types (``TRUSTED_TYPES``).
"""

from __future__ import annotations

import json
import math
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from gemmd import features
from gemmd.errors import ModelError
from gemmd.features import Table
from gemmd.gemm import TARGETS
from gemmd.model.flat import ARRAYS, NODE_ARRAYS, _FlatForest
from gemmd.modelfile import archive_problem

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
    _check_intervals(payload["forests"], payload["sigma"], payload["z"], path)


def _check_intervals(forests: Mapping[str, Any], sigma: Any, z: Any, path: Path) -> None:
    if not isinstance(sigma, dict) or not set(forests) <= set(sigma) <= set(
            TARGETS) or not all(
            isinstance(v, float) and math.isfinite(v) and v >= 0 for v in sigma.values()) \
            or not isinstance(z, float) or not math.isfinite(z):
        raise ModelError(f"model file {path}: its prediction intervals are not gemmd's "
                         "(sigma and z)")


# ------------------------------------------------------------------ the flat archive

FLAT_HEAD = "gemmd-model.json"  # the member that makes an archive a flat gemmd model
CONTAINER = "gemmd flat forests 1"


def is_flat(path: str | Path) -> bool:
    """Whether ``path`` is a zip archive holding a flat gemmd model (else: a skops one,
    or not a model; the skops reader says which)."""
    try:
        with zipfile.ZipFile(path) as z:
            return FLAT_HEAD in z.namelist()
    except (zipfile.BadZipFile, OSError, ValueError, EOFError):
        return False


def _member(name: str) -> zipfile.ZipInfo:
    """A member dated 1980-01-01, not now: the same model gives the same bytes (and
    sha256) whenever it is written."""
    return zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))


def write_flat(path: str | Path, forests: Mapping[str, _FlatForest], sigma: dict[str, float],
               z: float, meta: dict[str, Any]) -> None:
    """Write a flat model file at ``path`` (uncompressed: check_archive's bound on what a
    file may inflate to holds at a ratio of 1)."""
    head = {"container": CONTAINER, "n_features": len(features.FEATURES),
            "forests": {t: {"trees": f.n_trees, "nodes": f.node_count}
                        for t, f in forests.items()},
            "sigma": sigma, "z": z, "meta": meta}
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as zf:
        zf.writestr(_member(FLAT_HEAD), json.dumps(head))
        for target, flat in forests.items():
            for name, arr in flat.arrays().items():
                with zf.open(_member(f"{target}/{name}.npy"), "w",
                             force_zip64=arr.nbytes > (1 << 30)) as f:
                    np.lib.format.write_array(f, arr, allow_pickle=False)


def _bad(path: Path, why: str = "unexpected content") -> ModelError:
    return ModelError(f"model file {path} is not a gemmd model ({why})")


def _read_head(zf: zipfile.ZipFile, path: Path) -> dict[str, Any]:
    try:
        head = json.loads(zf.read(FLAT_HEAD))
    except (ValueError, UnicodeDecodeError) as e:
        raise _bad(path, f"{FLAT_HEAD}: {e}") from None
    forests = head.get("forests") if isinstance(head, dict) else None
    ok = (isinstance(head, dict)
          and set(head) == {"container", "n_features", "forests", "sigma", "z", "meta"}
          and head["container"] == CONTAINER and isinstance(head["meta"], dict)
          and isinstance(forests, dict) and "runtime" in forests
          and set(forests) <= set(TARGETS)
          and all(isinstance(f, dict) and set(f) == {"trees", "nodes"}
                  and all(type(v) is int and 0 < v < 2**31 for v in f.values())
                  for f in forests.values()))
    if not ok:
        raise _bad(path)
    return head


def _array_at(zf: zipfile.ZipFile, name: str, dtype: str, length: int, path: Path
              ) -> int:
    """Where a member's values start: its .npy header checked (1-D, ``dtype``, ``length``,
    the member's size exactly that) before anything of it is read; numpy reads the
    header, never a pickle."""
    info = zf.getinfo(name)
    with zf.open(info) as f:
        try:
            version = np.lib.format.read_magic(f)
            read_header = np.lib.format.read_array_header_1_0 if version == (1, 0) else \
                np.lib.format.read_array_header_2_0
            shape, _, dt = read_header(f)
        except ValueError as e:
            raise _bad(path, f"{name}: {e}") from None
        start = f.tell()
    if shape != (length,) or dt != np.dtype(dtype) or dt.hasobject or \
            info.file_size != start + length * dt.itemsize:
        raise _bad(path, f"{name}: not {length} values of {np.dtype(dtype)}")
    return start


def _read_arrays(zf: zipfile.ZipFile, spec: Mapping[str, Mapping[str, int]], path: Path
                 ) -> dict[str, dict[str, np.ndarray]]:
    """Every forest's arrays, in one buffer: one allocation of the model's size (the C
    allocator maps it apart and gives it back whole when the model goes, rather than
    leaving a model's worth of holes in its heap at each reload)."""
    layout = []  # (target, array, member, where its values start, offset in buf, bytes)
    total = 0
    for target, size in spec.items():
        for k, d in ARRAYS.items():
            n = size["nodes"] if k in NODE_ARRAYS else size["trees"]
            name = f"{target}/{k}.npy"
            layout.append((target, k, name, _array_at(zf, name, d, n, path), total,
                           n * np.dtype(d).itemsize))
            total += -(-n * np.dtype(d).itemsize // 8) * 8  # each array 8-byte aligned
    buf = np.empty(total, dtype=np.uint8)
    out: dict[str, dict[str, np.ndarray]] = {t: {} for t in spec}
    for target, k, name, skip, at, nbytes in layout:
        view = memoryview(buf[at:at + nbytes])  # type: ignore[arg-type]
        with zf.open(name) as f:
            f.read(skip)
            done = 0
            while done < nbytes:
                chunk = f.read(min(1 << 20, nbytes - done))
                if not chunk:
                    raise _bad(path, f"{name}: truncated")
                view[done:done + len(chunk)] = chunk
                done += len(chunk)
        out[target][k] = buf[at:at + nbytes].view(np.dtype(ARRAYS[k]))
    return out


def read_flat(path: Path) -> tuple[dict[str, _FlatForest], dict[str, float], float,
                                   dict[str, Any]]:
    """(forests, sigma, z, meta) of a flat model file; ModelError naming the file if it is
    not one this gemmd reads (the archive bounded before anything is inflated)."""
    problem = archive_problem(path)
    if problem is not None:
        raise ModelError(f"model file {path} {problem}")
    with zipfile.ZipFile(path) as zf:
        head = _read_head(zf, path)
        meta = head["meta"]
        check_format(meta, path)
        spec = head["forests"]
        members = {FLAT_HEAD} | {f"{t}/{k}.npy" for t in spec for k in ARRAYS}
        if set(zf.namelist()) != members or len(zf.namelist()) != len(members):
            raise _bad(path)
        n = len(features.FEATURES)
        forests = {}
        if head["n_features"] != n:
            raise ModelError(f"model file {path}: the runtime forest does not read "
                             f"gemmd's {n} features (fitted on other data); refit it")
        for target, arrays in _read_arrays(zf, spec, path).items():
            try:
                forests[target] = _FlatForest.from_arrays(arrays, n)
            except ValueError as e:
                if "features outside" in str(e):
                    raise ModelError(f"model file {path}: the {target} forest does not read "
                                     f"gemmd's {n} features (fitted on other data); refit "
                                     "it") from None
                raise _bad(path, f"the {target} forest: {e}") from None
    sigma, z = head["sigma"], head["z"]
    _check_intervals(forests, sigma, z, path)
    return forests, dict(sigma), float(z), meta


def check_format(meta: Mapping[str, Any], path: Path) -> None:
    """A model of another format (features or target spaces changed) is refused."""
    if meta.get("format") != MODEL_FORMAT or meta.get("features") != list(features.FEATURES):
        raise ModelError(f"model file {path} was fitted by another gemmd version (model "
                         f"format {meta.get('format', 1)}, this gemmd reads "
                         f"{MODEL_FORMAT}); refit it")
