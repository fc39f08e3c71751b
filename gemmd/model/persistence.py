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
from statistics import NormalDist
from typing import Any

import numpy as np

from gemmd import features
from gemmd.errors import ModelError
from gemmd.features import Table
from gemmd.gemm import TARGETS
from gemmd.model.flat import ARRAYS, NODE_ARRAYS, _FlatForest
from gemmd.modelfile import archive_problem
from gemmd.records import DeviceInfo

# Bumped whenever features or target spaces change: older files are refused, not misread.
# 3: datasheet peaks from the GPU catalogue, calibrated intervals and the training domain.
# 4: the domain per target, validated transfer and extrapolation (meta "logo", "ood_sd").
MODEL_FORMAT = 4
# The most a log-space noise sd in a model file may be (a factor of e^10 for one sd):
# beyond it a file was edited (1e300 overflowed every interval).
SIGMA_MAX = 10.0


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
    check_meta(meta, sigma, z, path)
    return forests, dict(sigma), float(z), meta


def _number(v: Any, lo: float = 0.0, hi: float = math.inf, open_lo: bool = False) -> bool:
    """A JSON number (not a bool) within [lo, hi] ((lo, hi] with ``open_lo``)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        return False
    return (v > lo if open_lo else v >= lo) and v <= hi


def _numbers(v: Any, depth: int = 2) -> bool:
    """A dict (nested ``depth`` deep at most) whose leaves are finite numbers >= 0."""
    if not isinstance(v, dict) or not all(isinstance(k, str) for k in v):
        return False
    return all(_number(x) or (depth > 1 and _numbers(x, depth - 1)) for x in v.values())


def _hashes(raw: Any, size: int = 8) -> int | None:
    """How many ``size``-byte values the base64 text ``raw`` holds; None if it is not
    such a text."""
    import base64
    import binascii

    if not isinstance(raw, str):
        return None
    try:
        n = len(base64.b64decode(raw, validate=True))
    except (binascii.Error, ValueError):
        return None
    return n // size if n % size == 0 else None


def _device_problem(d: Any) -> str | None:
    if not isinstance(d, dict):
        return "not a record"
    try:
        info = DeviceInfo(**d)
    except TypeError as e:
        return str(e)
    peaks = info.peak_flops  # (0: not known, as a clock NVML did not give makes it)
    if not isinstance(info.uuid, str) or not isinstance(info.name, str) or \
            not isinstance(peaks, dict) or not all(
                isinstance(k, str) and _number(v) for k, v in peaks.items()):
        return "its uuid, name or peak rates"
    for k in ("mem_bandwidth", "power_limit_w", "sm_count", "memory_bytes"):
        v = getattr(info, k)
        if v is not None and not _number(v):
            return k
    if not isinstance(info.extra, dict) or type(info.index) is not int:
        return "its index or extra"
    return None


def check_meta(meta: Mapping[str, Any], sigma: Mapping[str, float], z: float, path: Path
               ) -> None:
    """The metadata a prediction reads, each field of the type and range gemmd writes: a
    file edited by hand (a z of -1.6 printed intervals upside down, a bf16 peak of -1 a
    numpy warning and a prediction from a NaN feature, a string where a scale belongs a
    traceback) is refused with a line naming the field. Fields a model of an older gemmd
    lacks may be absent."""
    def bad(field: str) -> ModelError:
        return ModelError(f"model file {path}: its {field} is not what gemmd writes "
                          "(edited or damaged); refit it")

    interval = meta.get("interval", 0.9)
    if not _number(interval, 0.0, 1.0, open_lo=True) or interval >= 1.0:
        raise bad("interval")
    if abs(z - NormalDist().inv_cdf(0.5 + interval / 2)) > 1e-6:
        raise bad("z (not the interval's)")
    if not all(_number(v, 0.0, SIGMA_MAX) for v in sigma.values()):
        raise bad("sigma")
    for field in ("interval_scale", "interval_scale_shape", "ood_sd", "interval_noise_floor",
                  "interval_noise_floor_group"):
        if field in meta and not _numbers(meta[field]):
            raise bad(field)
    if not _number(meta.get("roofline_efficiency", 0.7), 0.0, 1.0, open_lo=True):
        raise bad("roofline_efficiency")
    for field in ("domain", "domain_targets", "logo", "repeats", "derived", "scores"):
        if field in meta and not isinstance(meta[field], dict):
            raise bad(field)
    if meta.get("shapes") and _hashes(meta["shapes"]) is None:
        raise bad("shapes")
    for target, rec in (meta.get("repeats") or {}).items():
        if rec and (not isinstance(rec, dict) or (keys := _hashes(rec.get("keys"))) is None
                    or (sd := _hashes(rec.get("sd"), 4)) is None or keys != sd):
            raise bad(f"repeats ({target})")
    ref = meta.get("reference_shapes", [])
    if not isinstance(ref, list) or not all(
            isinstance(r, list) and len(r) == 4 and all(_number(x, 1.0) for x in r)
            for r in ref):
        raise bad("reference_shapes")
    devices = meta.get("devices", [])
    if not isinstance(devices, list):
        raise bad("devices")
    for i, d in enumerate(devices):
        if (why := _device_problem(d)) is not None:
            raise bad(f"devices[{i}] ({why})")
    for field in ("configs", "probe_configs"):
        recs = meta.get(field, [])
        if not isinstance(recs, list) or not all(
                isinstance(c, dict) and all(isinstance(c.get(k), str) for k in (
                    "device", "dtype", "kernel")) for c in recs):
            raise bad(field)


def check_format(meta: Mapping[str, Any], path: Path) -> None:
    """A model of another format (features or target spaces changed) is refused."""
    if meta.get("format") != MODEL_FORMAT or meta.get("features") != list(features.FEATURES):
        raise ModelError(f"model file {path} was fitted by another gemmd version (model "
                         f"format {meta.get('format', 1)!r}, this gemmd reads "
                         f"{MODEL_FORMAT}); refit it")
