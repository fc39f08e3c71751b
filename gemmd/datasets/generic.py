"""gemmd's generic CSV (docs/model.md): measurement columns named with their units, the
other names of the configuration columns, GPUs described by columns, and the checks that
catch a unit mistake."""

from __future__ import annotations

import dataclasses
import hashlib
import re
from pathlib import Path

import numpy as np

from gemmd.datasets.reader import Dataset, _Csv, _dims, _gpus, _table, _unknown_gpu
from gemmd.errors import InputError
from gemmd.features import Table, compute_dtype, flops
from gemmd.gemm import DATA_KERNELS, DTYPES, LAYOUTS
from gemmd.hardware import CATALOGUE, Catalogue, SpecError, compact, spec_from_mapping
from gemmd.records import DeviceInfo

# ------------------------------------------------------------ gemmd's generic CSV

DTYPE_ALIASES = {**{d: d for d in DTYPES}, "float64": "fp64", "double": "fp64", "f64": "fp64",
                 "float32": "fp32", "float": "fp32", "single": "fp32", "f32": "fp32",
                 "float16": "fp16", "half": "fp16", "f16": "fp16", "bfloat16": "bf16",
                 "bfloat": "bf16", "tensorfloat32": "tf32", "float8": "fp8",
                 "fp8_e4m3": "fp8", "fp8_e5m2": "fp8", "e4m3": "fp8", "e5m2": "fp8",
                 "e4m3fn": "fp8", "float8_e4m3fn": "fp8", "float8_e5m2": "fp8",
                 "float8_e4m3": "fp8", "fp8e4m3": "fp8", "fp8e5m2": "fp8"}
# Measurement columns: a stem naming the quantity and a unit, written runtime_ms,
# "latency (us)", time[ns], energy-mJ... The first stem of each list wins when a file has
# several columns for one quantity (a median before a mean); the others are noted.
TIME_UNITS = {"s": 1.0, "sec": 1.0, "secs": 1.0, "second": 1.0, "seconds": 1.0,
              "ms": 1e-3, "msec": 1e-3, "millis": 1e-3, "millisecond": 1e-3,
              "milliseconds": 1e-3, "us": 1e-6, "usec": 1e-6, "µs": 1e-6, "μs": 1e-6,
              "microsecond": 1e-6, "microseconds": 1e-6, "ns": 1e-9, "nsec": 1e-9,
              "nanosecond": 1e-9, "nanoseconds": 1e-9}
POWER_UNITS = {"w": 1.0, "watt": 1.0, "watts": 1.0, "mw": 1e-3, "kw": 1e3}
ENERGY_UNITS = {"j": 1.0, "joule": 1.0, "joules": 1.0, "kj": 1e3, "mj": 1e-3, "uj": 1e-6,
                "µj": 1e-6, "μj": 1e-6, "nj": 1e-9}
MEASUREMENT_STEMS = {
    "runtime_s": (("runtime", "time", "latency", "duration", "elapsed", "elapsed_time",
                   "exec_time", "execution_time", "kernel_time", "gemm_time", "time_per_gemm",
                   "runtime_per_gemm", "median_runtime", "median_time", "median_latency",
                   "mean_runtime", "mean_time", "mean_latency", "avg_runtime", "avg_time",
                   "avg_latency", "average_runtime", "average_time", "average_latency"),
                  TIME_UNITS),
    "power_w": (("power", "avg_power", "average_power", "mean_power", "median_power",
                 "power_draw", "board_power"), POWER_UNITS),
    "energy_j": (("energy", "energy_per_gemm", "energy_per_call", "avg_energy",
                  "average_energy", "mean_energy", "median_energy"), ENERGY_UNITS),
}
_RUNTIME_NAMES = "runtime_s, runtime_ms or runtime_us (or _ns; time_, latency_, duration_ " \
                 "work too)"
_UNIT_DISPLAY = {"w": "W", "mw": "mW", "kw": "kW", "j": "J", "kj": "kJ", "mj": "mJ",
                 "uj": "uJ", "nj": "nJ"}
_UNIT_HELP = {"runtime_s": _RUNTIME_NAMES, "power_w": "power_w, power_mw or power_kw",
              "energy_j": "energy_j, energy_mj, energy_uj or energy_nj"}
# Other names of the configuration columns (the first of each is gemmd's).
COLUMN_ALIASES = {"gpu": ("gpu", "gpu_name", "gpu_model", "device_name", "gpu_key"),
                  "dtype": ("dtype", "precision", "data_type", "datatype"),
                  "batch": ("batch", "batch_size", "batch_count"),
                  "timestamp": ("timestamp", "ts", "unix_time")}
CSV_OPTIONAL = ("gpu", "batch", "kernel", "tile", "layout", "cta_m", "cta_n", "cta_k",
                "stages", "alpha", "beta", "out_dtype", "timestamp", "source")
# Columns that describe the GPU itself (a GPU the catalogue lacks, or one run differently).
GPU_COLUMNS = {**{f"peak_{d}_tflops": ("peak", d) for d in DTYPES},
               "mem_bandwidth_gbs": ("bandwidth_gbs", None), "bandwidth_gbs":
               ("bandwidth_gbs", None), "sm_count": ("sm_count", None),
               "power_limit_w": ("power_w", None), "tdp_w": ("power_w", None)}
# Sanity bounds: a value outside them is almost always a unit mistake.
MAX_POWER_W = 5000.0
MAX_RUNTIME_S = 3600.0  # no probe GEMM runs for an hour (the fastest: the peak check)
MAX_PEAK_MULTIPLE = 4.0  # achieved FLOP/s above this multiple of the datasheet peak
ENERGY_TOLERANCE = 2.0  # energy within this factor of power x runtime


def _key(header: str) -> str:
    """A header as gemmd names columns: 'GPU Name' -> 'gpu_name'."""
    return re.sub(r"[\s\-]+", "_", header.strip().lower())


def measurement_column(header: str) -> tuple[str, float] | tuple[str, None] | None:
    """(SI column, factor to SI) for a measurement header ('latency_ms' -> ('runtime_s',
    1e-3); '"Time (us)"' -> ('runtime_s', 1e-6)); (SI column, None) for a known stem
    without a unit (refused); None for anything else."""
    h = header.strip().lower()
    m = re.fullmatch(r"(.+?)\s*[\(\[]\s*([^\)\]]+?)\s*[\)\]]", h)
    stem, unit = (m[1], m[2]) if m else (h, "")
    stem = re.sub(r"[\s\-]+", "_", stem.strip())
    for si, (stems, units) in MEASUREMENT_STEMS.items():
        if not m and stem in stems:
            return si, None
        if m and stem in stems:
            return (si, units[unit]) if unit in units else None
        if not m:
            for s in stems:
                if stem.startswith(s) and stem[len(s):len(s) + 1] in ("_", ""):
                    rest = stem[len(s) + 1:]
                    if rest in units:
                        return si, units[rest]
    return None


def _statistic(header: str) -> str:
    """What a measurement column summarizes: median, mean, or '' (a plain time, power or
    energy: runtime_ms, time_s, latency_us and power_w are all the same thing)."""
    first = re.split(r"[\s\-_\(\[]+", header.strip().lower(), maxsplit=1)[0]
    return {"median": "median", "mean": "mean", "avg": "mean", "average": "mean"}.get(
        first, "")


def _stem_rank(header: str, si: str) -> int:
    h = re.sub(r"[\s\-\(\[]+", "_", header.strip().lower())
    stems = MEASUREMENT_STEMS[si][0]
    return min((i for i, s in enumerate(stems) if h.startswith(s + "_") or h == s),
               default=len(stems))


def load_csv(path: str | Path, gpu: str | None = None,
             catalog: Catalogue | None = None) -> Dataset:
    """gemmd's generic CSV (docs/model.md): one GEMM per row, units in the column names.

    Columns gemmd does not use are ignored (named in a note); a measurement column
    without a unit is refused rather than guessed; several columns for one quantity
    (a median and a mean time) use the first in MEASUREMENT_STEMS's order.
    """
    cat = catalog or CATALOGUE
    f = _Csv(path)
    lower = [h.lower() for h in f.header]
    if len(set(lower)) != len(lower):
        dup = next(h for h in f.header if lower.count(h.lower()) > 1)
        raise InputError(f"{f.path}: duplicate column names in the header ({dup})")
    notes: list[str] = []
    rename: dict[str, str] = {}  # header as in the file -> gemmd's column
    measured: dict[str, list[tuple[str, float]]] = {}
    for h in f.header:
        mc = measurement_column(h)
        if mc is None:
            continue
        si, factor = mc
        if factor is None:
            raise InputError(f"{f.path}: column {h} has no unit; name it {_UNIT_HELP[si]}")
        measured.setdefault(si, []).append((h, factor))
    targets: dict[str, tuple[str, float]] = {}
    for si, heads in measured.items():
        heads.sort(key=lambda hc: _stem_rank(hc[0], si))
        by_stat: dict[str, list[str]] = {}
        for h, _ in heads:
            by_stat.setdefault(_statistic(h), []).append(h)
        for same in by_stat.values():
            if len(same) > 1:  # time_ms and time_s: which one is right? (issue 24)
                raise InputError(f"{f.path}: columns {', '.join(same)} both give "
                                 f"{si.split('_')[0]} (the same statistic): which one is "
                                 "meant is not clear; keep one")
        targets[si] = heads[0]
        if len(heads) > 1:
            notes.append(f"{si.split('_')[0]} from column {heads[0][0]}; "
                         f"{', '.join(h for h, _ in heads[1:])} not used")
    for canon, names in COLUMN_ALIASES.items():
        present = [h for h in f.header if _key(h) in names]
        present.sort(key=lambda h: names.index(_key(h)))
        if present:
            rename[present[0]] = canon
    for h in f.header:
        if h not in rename and _key(h) in {"m", "n", "k", *CSV_OPTIONAL, *GPU_COLUMNS}:
            rename[h] = _key(h)
    f.require(*(c for c in ("m", "n", "k") if c not in rename.values()))
    if "dtype" not in rename.values():
        f.require("dtype")
    if not targets:
        raise InputError(f"{f.path}: no measurement column: give at least one of "
                         f"runtime_s/_ms/_us/_ns, power_w, energy_j/_mj/_uj (see docs/model.md)")
    used = set(rename) | {h for h, _ in targets.values()}
    ignored = [h for h in f.header if h not in used and not any(
        h == x for heads in measured.values() for x, _ in heads)]
    if ignored:
        notes.append(f"ignored column{'s' if len(ignored) > 1 else ''} "
                     f"{', '.join(ignored)} (not used by gemmd's model)")
    f.header = [rename.get(h, h) for h in f.header]
    f._pos = {h: i for i, h in enumerate(f.header)}
    if any(c in f._pos for c in GPU_COLUMNS):
        infos, device = _described_gpus(f, gpu, cat)
    else:
        infos, device = _gpus(f, "gpu", gpu, cat)
    n = len(f)
    cols: dict[str, np.ndarray | str | float] = {
        "m": _dims(f, "m"), "n": _dims(f, "n"), "k": _dims(f, "k"),
        "dtype": _dtypes(f, "dtype")}
    if f.has("batch"):
        cols["batch"] = _opt_int(f, "batch", 1.0, 1 << 24)
    if f.has("kernel"):
        cols["kernel"] = f.choice("kernel", {k: k for k in DATA_KERNELS} | {"": "blas"}, "kernel")
    if f.has("layout"):
        cols["layout"] = f.choice("layout", {x: x for x in LAYOUTS} | {"": "nn"}, "layout")
    if f.has("out_dtype"):
        cols["out_dtype"] = _dtypes(f, "out_dtype", empty="")
    for c, most in (("tile", 32), ("cta_m", 4096), ("cta_n", 4096), ("cta_k", 4096),
                    ("stages", 64)):
        if f.has(c):
            cols[c] = _opt_int(f, c, 0.0, most)
    for c, d in (("alpha", 1.0), ("beta", 0.0)):
        if f.has(c):
            x = f.floats(c, optional=True)
            cols[c] = np.where(np.isfinite(x), x, d)
    if f.has("timestamp"):
        cols["ts"] = f.floats("timestamp", optional=True, lo=0)
    if f.has("source"):  # gemmd export's: "daemon" for its own probes
        cols["source"] = np.array([v.strip() for v in f.text("source")], dtype=object)
    seen: dict[str, str] = {}
    for si, (c, factor) in targets.items():
        seen[si] = c
        unit = re.split(r"[_\s\(\[\-]+", c.strip().rstrip(")]"))[-1].lower()
        unit = _UNIT_DISPLAY.get(unit, unit)
        hi = {"power_w": MAX_POWER_W, "runtime_s": MAX_RUNTIME_S,
              "energy_j": MAX_POWER_W * MAX_RUNTIME_S}[si] / factor
        cols[si] = f.floats(c, optional=True, positive=True, hi=hi, unit=unit) * factor
        for i in np.flatnonzero(cols[si] == 0)[:1]:  # positive, but 0 once in SI units
            raise f.error(i, c, f"{f.text(c)[i]} {unit} is too small to be a measurement "
                                f"(0 {si.rsplit('_', 1)[1]} in SI units)")
    if "kernel" in cols:
        tiled = cols["kernel"] == "tiled"
        tile = cols.get("tile", np.zeros(n))
        for i in np.flatnonzero(tiled & (np.asarray(tile) < 1))[:1]:
            raise f.error(i, "tile", "the tiled kernel needs a tile size (1..32)")
    t = _table(n, infos, device, **cols)
    _check_peaks(f, t)
    _check_plausible(f, t, seen)
    rows_with = {si: int(np.isfinite(t[si]).sum()) for si in seen}
    for i in np.flatnonzero(~np.any([np.isfinite(t[si]) for si in seen], axis=0))[:1]:
        raise f.error(i, ", ".join(seen.values()), "no measurement on this row")
    return Dataset("csv", t, [f.path],
                   [f"{si}: {v:,} rows" for si, v in rows_with.items()] + notes)


def _dtypes(f: _Csv, name: str, empty: str | None = None) -> np.ndarray:
    """A dtype column: gemmd's names and common spellings (float16, torch.bfloat16...)."""
    vals = f.text(name)
    out = np.empty(len(vals), dtype=object)
    for i, v in enumerate(vals):
        key = re.sub(r"^(torch|np|numpy|jnp|cupy)\.", "", v.lower())
        if key == "" and empty is not None:
            out[i] = empty
        elif key in DTYPE_ALIASES:
            out[i] = DTYPE_ALIASES[key]
        else:
            raise f.error(i, name, f"{v!r} is not a known dtype ({', '.join(DTYPES)})")
    return out


def _described_gpus(f: _Csv, gpu: str | None, cat: Catalogue
                    ) -> tuple[list[DeviceInfo], np.ndarray]:
    """GPUs described by columns (peak_<dtype>_tflops, mem_bandwidth_gbs, sm_count,
    power_limit_w), on top of the catalogue entry the gpu column (or --gpu) names, if
    any. Rows that say the same share one DeviceInfo."""
    if f.has("gpu"):
        names = f.text("gpu")
        if gpu is not None:  # --gpu must be the GPU every row names
            want = cat.lookup(gpu)
            for i, name in enumerate(names):
                if name != gpu and (want is None or cat.lookup(name) is not want):
                    raise f.error(i, "gpu", f"{name!r} is not --gpu {gpu!r}: the file names "
                                            "its GPU; drop --gpu or fix the column")
    else:
        if gpu is not None and cat.lookup(gpu) is None and not f.has("mem_bandwidth_gbs") \
                and not f.has("bandwidth_gbs"):
            raise InputError(f"{f.path}: --gpu: {_unknown_gpu(gpu, cat)}")
        names = [gpu or "custom GPU"] * len(f)
    vals = {c: f.floats(c, optional=True, positive=True) for c in GPU_COLUMNS if f.has(c)}
    infos: list[DeviceInfo] = []
    keys: dict[tuple, int] = {}
    idx = np.empty(len(f), dtype=np.int64)
    for i in range(len(f)):
        given = tuple((c, float(v[i])) for c, v in vals.items() if np.isfinite(v[i]))
        key = (names[i], given)
        j = keys.get(key)
        if j is None:
            base = cat.lookup(names[i])
            rec: dict = {"name": names[i], "peak_tflops": {}}
            if base is not None:
                rec["base"] = base.key
            for c, x in given:
                what, dt = GPU_COLUMNS[c]
                if what == "peak":
                    rec["peak_tflops"][dt] = x
                else:
                    rec[what] = int(x) if what == "sm_count" and x == int(x) else x
            if base is not None and _same_as(base, rec):
                info = cat.info_of(base.key)  # what the catalogue says (an export, say)
            else:
                digest = hashlib.sha256(repr(key).encode()).hexdigest()[:8]
                rec["key"] = f"{(base.key if base else compact(names[i]) or 'custom')[:40]}" \
                             f"-{digest}"
                try:
                    spec = spec_from_mapping(rec, f"{f.path}: row {f.lines[i]}", cat)
                except SpecError as e:
                    raise InputError(str(e).replace("peak_tflops:", "peak_<dtype>_tflops "
                                                    "columns:")) from None
                info = spec.info()
                if base is not None:  # the same GPU model, described differently
                    info = dataclasses.replace(info, extra={**info.extra, "key": base.key,
                                                            "spec": spec.key})
            j = keys[key] = len(infos)
            infos.append(info)
        idx[i] = j
    return infos, idx


def _same_as(base, rec: dict) -> bool:
    """Do a row's GPU columns say what the catalogue entry ``base`` says (within 0.5%)?"""
    def near(a: float | None, b: float | None) -> bool:
        return a is not None and b is not None and abs(a - b) <= 0.005 * max(abs(b), 1e-9)

    if any(not near(v, base.peak_tflops.get(d)) for d, v in rec["peak_tflops"].items()):
        return False
    return all(near(float(rec[k]), getattr(base, k)) for k in ("bandwidth_gbs", "power_w",
                                                                 "sm_count") if k in rec)


def _check_peaks(f: _Csv, t: Table) -> None:
    """Every row's GPU must have a peak for the dtype its kernel computes in."""
    from gemmd.features import peak_vector

    peak, _ = peak_vector(t)
    for i in np.flatnonzero(~np.isfinite(peak))[:1]:
        d = compute_dtype(t["dtype"][i], t["kernel"][i])
        raise f.error(i, "dtype", f"{t.info(i).name} has no {d} peak (the catalogue "
                                  f"knows none: no {d} units?); if it is right, give "
                                  f"peak_{d}_tflops")


def _opt_int(f: _Csv, name: str, default: float, hi: float) -> np.ndarray:
    x = f.floats(name, optional=True, integer=True, lo=0, hi=hi)
    return np.where(np.isfinite(x), x, default)


def _check_plausible(f: _Csv, t: Table, seen: dict[str, str]) -> None:
    """Unit mistakes show as physically impossible rows: name the first one."""
    from gemmd.features import peak_vector

    if "runtime_s" in seen:
        peak, _ = peak_vector(t)
        rate = flops(t) / t["runtime_s"]
        bad = np.isfinite(rate) & np.isfinite(peak) & (rate > MAX_PEAK_MULTIPLE * peak)
        for i in np.flatnonzero(bad)[:1]:
            raise f.error(i, seen["runtime_s"], f"{rate[i] / 1e12:.3g} TFLOP/s is over "
                          f"{MAX_PEAK_MULTIPLE:g}x the {t.info(i).name}'s {t['dtype'][i]} peak "
                          f"({peak[i] / 1e12:.3g} TFLOP/s): wrong unit?")
    if {"runtime_s", "power_w", "energy_j"} <= set(seen):
        ratio = t["energy_j"] / (t["power_w"] * t["runtime_s"])
        bad = np.isfinite(ratio) & ((ratio > ENERGY_TOLERANCE) | (ratio < 1 / ENERGY_TOLERANCE))
        for i in np.flatnonzero(bad)[:1]:
            raise f.error(i, seen["energy_j"], f"energy is {ratio[i]:.3g}x power x runtime; "
                          "expected about 1 (wrong unit?)")

