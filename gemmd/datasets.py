"""Read external GEMM measurements (GPPerf, B200, XLA, gemmd's generic CSV) into a Table.

Every loader converts to SI units on the way in (seconds, watts, joules) and gives each
row the DeviceInfo of the GPU it ran on, from the datasheet table below. Any bad value
is an InputError naming the file, the row (as a spreadsheet numbers it: the header is
row 1) and the column; a file is read whole or not at all.
"""

from __future__ import annotations

import csv
import dataclasses
import hashlib
import math
import os
import re
import stat
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from gemmd.errors import InputError
from gemmd.features import NUMERIC_DEFAULTS, Table, concat, flops
from gemmd.gemm import DATA_KERNELS, DTYPES, LAYOUTS, TARGET_COLUMNS
from gemmd.hardware import CATALOGUE, Catalogue, SpecError, compact, spec_from_mapping
from gemmd.records import DeviceInfo

# ------------------------------------------------------------------ known GPUs

# Every GPU of the catalogue (gemmd/hardware.py: datasheet figures, sources named there)
# as a reference DeviceInfo, by key; known_gpu() also takes the names NVML and tools print.
KNOWN_GPUS: dict[str, DeviceInfo] = {k: CATALOGUE.info_of(k) for k in CATALOGUE.keys()}


def known_gpu(name: str, catalog: Catalogue | None = None) -> DeviceInfo | None:
    """The datasheet DeviceInfo for a GPU key or name (case, punctuation, vendor words
    ignored: 'NVIDIA A100-SXM4-80GB', 'Tesla V100-PCIE-32GB', 'sm_90'), or None."""
    return (catalog or CATALOGUE).info(name)


def known_gpu_names(catalog: Catalogue | None = None) -> str:
    return (catalog or CATALOGUE).names()


def _unknown_gpu(name: str, catalog: Catalogue | None) -> str:
    return (f"unknown GPU {name!r} (known: {known_gpu_names(catalog)}; describe another "
            "with --gpu-spec FILE or peak_<dtype>_tflops and mem_bandwidth_gbs columns)")


# ------------------------------------------------------------------ datasets


@dataclass
class Dataset:
    name: str  # the format (and source name for imports)
    table: Table
    paths: list[str]
    notes: list[str] = field(default_factory=list)

    @property
    def targets(self) -> list[str]:
        """The targets measured on at least one row: runtime, power, energy."""
        return [c.split("_")[0] for c in TARGET_COLUMNS
                if np.isfinite(self.table[c]).any()]


_MISSING = ("", "[N/A]", "N/A", "NA", "nan", "NaN", "-")
# A number in a data file: ASCII digits, an optional sign, one '.', an exponent; nothing
# else (no separators, no other scripts' digits, no inf).
_DECIMAL = re.compile(r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]{1,3})?")


def _open_text(path: str | Path):
    """Open a measurement file: a regular file (not a device, FIFO or directory, which
    could be read forever), as UTF-8 text."""
    st = os.stat(path)
    if not stat.S_ISREG(st.st_mode):
        raise InputError(f"{path}: not a regular file")
    return open(path, newline="", encoding="utf-8-sig")


class _Csv:
    """A CSV file read whole: header, rows, and the spreadsheet row number of each."""

    def __init__(self, path: str | Path):
        self.path = str(path)
        try:
            with _open_text(path) as f:
                reader = csv.reader(f)
                self.header = [h.strip() for h in next(reader, [])]
                self.rows: list[list[str]] = []
                self.lines: list[int] = []
                for rec in reader:
                    if not rec or all(not x.strip() for x in rec):
                        continue  # blank line
                    if len(rec) != len(self.header):
                        raise InputError(f"{self.path}: row {reader.line_num}: {len(rec)} "
                                         f"fields, the header has {len(self.header)}")
                    self.rows.append(rec)
                    self.lines.append(reader.line_num)
        except OSError as e:
            raise InputError(f"{self.path}: cannot read: {e.strerror or e}") from e
        except UnicodeDecodeError as e:
            raise InputError(f"{self.path}: not UTF-8 text ({e.reason} at byte {e.start})"
                             ) from e
        except csv.Error as e:
            raise InputError(f"{self.path}: not a CSV file: {e}") from e
        if not self.header or self.header == [""]:
            raise InputError(f"{self.path}: empty file (no header row)")
        if not self.rows:
            raise InputError(f"{self.path}: no data rows")
        self._pos = {h: i for i, h in enumerate(self.header)}

    def __len__(self) -> int:
        return len(self.rows)

    def has(self, name: str) -> bool:
        return name in self._pos

    def require(self, *names: str) -> None:
        missing = [n for n in names if n not in self._pos]
        if missing:
            raise InputError(f"{self.path}: missing column{'s' if len(missing) > 1 else ''} "
                             f"{', '.join(missing)} (found: {', '.join(self.header)})")

    def text(self, name: str) -> list[str]:
        i = self._pos[name]
        return [r[i].strip() for r in self.rows]

    def error(self, i: int, name: str, msg: str) -> InputError:
        return InputError(f"{self.path}: row {self.lines[i]}, column {name}: {msg}")

    def floats(self, name: str, *, optional: bool = False, positive: bool = False,
               integer: bool = False, lo: float | None = None, hi: float | None = None,
               unit: str = "") -> np.ndarray:
        """A numeric column; missing cells are NaN when ``optional``, else an error."""
        vals = self.text(name)
        # Strict ASCII decimal (issue 24): float() also reads "0_1" as 1 and full-width
        # digits, and stripping "," read the decimal comma of "0,12" as a thousands
        # separator. An unreadable number is refused, never guessed.
        for i, v in enumerate(vals):
            if v not in _MISSING and not _DECIMAL.fullmatch(v):
                hint = " (a decimal comma? gemmd reads '.' only, without separators)" \
                    if "," in v else ""
                raise self.error(i, name, f"{v!r} is not a number{hint}")
        x = np.array(["nan" if v in _MISSING else v for v in vals], dtype=np.float64)
        missing = np.array([v in _MISSING for v in vals])
        for i in np.flatnonzero(~missing & ~np.isfinite(x))[:1]:
            raise self.error(i, name, f"{vals[i]!r} is not a finite number")
        if not optional:
            for i in np.flatnonzero(missing)[:1]:
                raise self.error(i, name, "value missing")
        ok = ~missing
        u = f" {unit}" if unit else ""
        if positive:
            for i in np.flatnonzero(ok & (x <= 0))[:1]:
                raise self.error(i, name, f"{vals[i]}{u} is not positive")
        if integer:
            for i in np.flatnonzero(ok & (x != np.round(x)))[:1]:
                raise self.error(i, name, f"{vals[i]!r} is not an integer")
        if lo is not None:
            for i in np.flatnonzero(ok & (x < lo))[:1]:
                raise self.error(i, name, f"{vals[i]}{u} is below {lo:g}{u}")
        if hi is not None:
            for i in np.flatnonzero(ok & (x > hi))[:1]:
                raise self.error(i, name, f"{vals[i]}{u} is above {hi:g}{u} (wrong unit?)")
        return x

    def choice(self, name: str, mapping: dict[str, str], what: str) -> np.ndarray:
        vals = self.text(name)
        out = np.empty(len(vals), dtype=object)
        for i, v in enumerate(vals):
            key = v.lower()
            if key not in mapping:
                raise self.error(i, name, f"{v!r} is not a known {what} "
                                          f"({', '.join(sorted(set(mapping.values())))})")
            out[i] = mapping[key]
        return out


def _table(size: int, info: DeviceInfo | Sequence[DeviceInfo],
           device: np.ndarray | None = None, **cols: np.ndarray | str | float) -> Table:
    """A Table of ``size`` rows; scalars broadcast, absent optional columns take defaults."""
    n = size
    full: dict[str, np.ndarray] = {}
    for c in ("m", "n", "k"):
        full[c] = np.asarray(cols.pop(c), dtype=np.float64)
    for c, d in NUMERIC_DEFAULTS.items():
        v = cols.pop(c, d)
        full[c] = np.asarray(v, dtype=np.float64) if np.ndim(v) else np.full(n, float(v))
    for c, text in (("dtype", "fp32"), ("kernel", "blas"), ("layout", "nn"), ("out_dtype", ""),
                    ("variant", "")):
        v = cols.pop(c, text)
        full[c] = np.asarray(v, dtype=object) if np.ndim(v) else np.full(n, v, dtype=object)
    for c in TARGET_COLUMNS:
        v = cols.pop(c, math.nan)
        full[c] = np.asarray(v, dtype=np.float64) if np.ndim(v) else np.full(n, float(v))
    for c, v in cols.items():  # extra columns (ts, context) travel along
        full[c] = np.asarray(v)
    devices = [info] if isinstance(info, DeviceInfo) else list(info)
    return Table(full, devices, np.zeros(n, dtype=np.int64) if device is None else device)


def _gpu(name: str, path: str, catalog: Catalogue | None = None) -> DeviceInfo:
    info = known_gpu(name, catalog)
    if info is None:
        raise InputError(f"{path}: --gpu: {_unknown_gpu(name, catalog)}")
    return info


def load_gpperf_cutlass(path: str | Path, gpu: str | None = None,
                        catalog: Catalogue | None = None) -> Dataset:
    """GPPerf's CUTLASS profiler runs (RTX 4070, fp32 SIMT). runtime_ms -> s; power_W as
    is ("[N/A]" on most rows); energy = power x runtime where power was read."""
    f = _Csv(path)
    f.require("M", "N", "K", "layout", "cta_m", "cta_n", "cta_k", "runtime_ms", "power_W")
    infos, device = _gpus(f, "gpu_name", gpu, catalog, default="rtx4070")
    rt = f.floats("runtime_ms", positive=True, hi=1e7, unit="ms") / 1e3
    pw = f.floats("power_W", optional=True, positive=True, hi=5000, unit="W")
    opt = {c: f.floats(c) for c in ("stages", "alpha", "beta") if f.has(c)}
    n = len(f)
    t = _table(n, infos, device, m=_dims(f, "M"), n=_dims(f, "N"), k=_dims(f, "K"),
               dtype="fp32", kernel="cutlass",
               layout=f.choice("layout", {x: x for x in LAYOUTS}, "layout"),
               cta_m=_dims(f, "cta_m"), cta_n=_dims(f, "cta_n"), cta_k=_dims(f, "cta_k"),
               runtime_s=rt, power_w=pw, energy_j=pw * rt, **opt,
               **({"ts": f.floats("timestamp", optional=True)} if f.has("timestamp") else {}))
    has_p = int(np.isfinite(pw).sum())
    return Dataset("gpperf-cutlass", t, [f.path], [
        f"power on {has_p:,} of {n:,} rows (one nvidia-smi reading per run)",
        "energy = power x runtime on those rows (the profiler's energy_J_reported is "
        "rounded to 1 mJ)"])


def load_gpperf_tiled(path: str | Path, gpu: str | None = None,
                      catalog: Catalogue | None = None) -> Dataset:
    """GPPerf's naive tiled kernel: execution_times_all.csv (ms) or
    power_usage_results_all.csv (W); one target per file."""
    f = _Csv(path)
    f.require("M", "N", "K", "Tile Size")
    info = _gpu(gpu or "rtx4070", f.path, catalog)
    if f.has("Execution Time"):
        target = {"runtime_s": f.floats("Execution Time", positive=True, hi=1e7,
                                        unit="ms") / 1e3}
    elif f.has("Average Power Usage (W)"):
        target = {"power_w": f.floats("Average Power Usage (W)", positive=True, hi=5000,
                                      unit="W")}
    else:
        raise InputError(f"{f.path}: missing column Execution Time or Average Power Usage (W) "
                         f"(found: {', '.join(f.header)})")
    tile = f.floats("Tile Size", positive=True, integer=True, hi=32)
    t = _table(len(f), info, m=_dims(f, "M"), n=_dims(f, "N"), k=_dims(f, "K"), dtype="fp32",
               kernel="tiled", tile=tile, **target)
    return Dataset("gpperf-tiled", t, [f.path])


_B200_DTYPES = {"half": "fp16", "fp16": "fp16", "float16": "fp16", "bf16": "bf16",
                "bfloat16": "bf16", "fp8": "fp8", "float": "fp32", "fp32": "fp32"}


def load_b200(path: str | Path, gpu: str | None = None,
              catalog: Catalogue | None = None) -> Dataset:
    """apex_plus B200 GEMMs: columns m,k,n (that order), time in us, energy in uJ."""
    f = _Csv(path)
    f.require("dtype", "m", "k", "n", "time(us)", "avg_power(W)", "avg_energy(uJ)")
    infos = _gpus(f, "gpu", gpu, catalog)
    rt = f.floats("time(us)", positive=True, hi=1e10, unit="us") / 1e6
    t = _table(len(f), *infos, m=_dims(f, "m"), n=_dims(f, "n"), k=_dims(f, "k"),
               dtype=f.choice("dtype", _B200_DTYPES, "dtype"), kernel="blas", runtime_s=rt,
               power_w=f.floats("avg_power(W)", positive=True, hi=5000, unit="W"),
               energy_j=f.floats("avg_energy(uJ)", positive=True, unit="uJ") / 1e6)
    return Dataset("b200", t, [f.path], [
        "time is whole microseconds: tiny GEMMs carry up to +-0.5 us (10% at 5 us)"])


def _xla_dtype(s: str) -> tuple[str, str] | None:
    """XLA's 'f8e4m3fnxf8e5m2->bf16' -> (input dtype, output dtype) in gemmd's names."""
    m = re.fullmatch(r"([a-z0-9]+)x([a-z0-9]+)->([a-z0-9]+)", s)
    if not m:
        return None
    names = {"f32": "tf32", "bf16": "bf16", "f16": "fp16", "f64": "fp64"}
    out_names = {"f32": "fp32", "bf16": "bf16", "f16": "fp16", "f64": "fp64"}

    def one(x: str, table: dict[str, str]) -> str | None:
        return "fp8" if x.startswith("f8") else table.get(x)

    a, b, o = one(m[1], names), one(m[2], names), one(m[3], out_names)
    if a is None or b is None or o is None:
        return None
    return (a if a == b or "fp8" not in (a, b) else "fp8"), o


def load_xla(path: str | Path, gpu: str | None = None,
             catalog: Catalogue | None = None) -> Dataset:
    """OpenXLA's matmul table: runtime_us_derived = 2 b m n k / flops_per_s (us -> s).
    f32 GEMMs are taken as TF32 (tensor cores), fp8 variants as fp8."""
    f = _Csv(path)
    f.require("gpu_key", "b", "m", "n", "k", "dtype", "runtime_us_derived")
    infos = _gpus(f, "gpu_key", gpu, catalog)
    raw = f.text("dtype")
    dt, out = np.empty(len(f), dtype=object), np.empty(len(f), dtype=object)
    for i, s in enumerate(raw):
        pair = _xla_dtype(s)
        if pair is None:
            raise f.error(i, "dtype", f"{s!r} is not an XLA dtype like bf16xbf16->bf16")
        dt[i], out[i] = pair
    t = _table(len(f), *infos, batch=_dims(f, "b"), m=_dims(f, "m"), n=_dims(f, "n"),
               k=_dims(f, "k"), dtype=dt, out_dtype=out, variant=np.asarray(raw, dtype=object),
               kernel="blas",
               runtime_s=f.floats("runtime_us_derived", positive=True, hi=1e10,
                                  unit="us") / 1e6)
    return Dataset("xla", t, [f.path], ["runtime is derived from XLA's FLOP/s figure",
                                         "f32 x f32 is taken as TF32 on tensor cores"])


def _dims(f: _Csv, name: str) -> np.ndarray:
    return f.floats(name, positive=True, integer=True, hi=1 << 24)


def _gpus(f: _Csv, column: str, gpu: str | None, catalog: Catalogue | None = None,
          default: str | None = None) -> tuple[list[DeviceInfo], np.ndarray]:
    """(distinct DeviceInfos, index per row) from a GPU-name column; ``gpu`` (--gpu) where
    the file has none. A file that names its GPUs and a --gpu that is not the same GPU
    on every row is an error: the file's own column is never silently overridden."""
    cat = catalog or CATALOGUE
    if not f.has(column):
        if gpu is not None:
            return [_gpu(gpu, f.path, cat)], np.zeros(len(f), dtype=np.int64)
        if default is not None:
            return [_gpu(default, f.path, cat)], np.zeros(len(f), dtype=np.int64)
        raise InputError(f"{f.path}: missing column {column} (or give the GPU with --gpu; "
                         f"known: {known_gpu_names(cat)})")
    want = _gpu(gpu, f.path, cat) if gpu is not None else None
    names = f.text(column)
    infos: list[DeviceInfo] = []
    seen: dict[str, int] = {}
    idx = np.empty(len(names), dtype=np.int64)
    for i, name in enumerate(names):
        j = seen.get(name)
        if j is None:
            info = known_gpu(name, cat)
            if info is None:
                raise f.error(i, column, _unknown_gpu(name, cat))
            if want is not None and info.uuid != want.uuid:
                raise f.error(i, column, f"{name!r} is not --gpu {gpu!r} ({want.name}): the "
                                         "file names its GPU; drop --gpu or fix the column")
            j = next((x for x, d in enumerate(infos) if d.uuid == info.uuid), None)
            if j is None:
                j = len(infos)
                infos.append(info)
            seen[name] = j
        idx[i] = j
    return infos, idx


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
                "stages", "alpha", "beta", "out_dtype", "timestamp")
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
        d = "fp32" if t["kernel"][i] == "tiled" else t["dtype"][i]
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


# ------------------------------------------------------------------ formats

Loader = Callable[..., Dataset]
FORMATS: dict[str, Loader] = {
    "gpperf-cutlass": load_gpperf_cutlass, "gpperf-tiled": load_gpperf_tiled,
    "b200": load_b200, "xla": load_xla, "csv": load_csv,
}
# A header that identifies each format (checked in this order by "auto").
_SIGNATURES = (
    ("gpperf-cutlass", {"cta_m", "runtime_ms", "power_W"}),
    ("gpperf-tiled", {"Tile Size", "M", "N", "K"}),
    ("b200", {"time(us)", "avg_power(W)", "avg_energy(uJ)"}),
    ("xla", {"gpu_key", "runtime_us_derived"}),
)


def detect_format(path: str | Path) -> str:
    """The format whose signature columns the file's header has, else "csv"."""
    try:
        with _open_text(path) as fh:
            header = {h.strip() for h in next(csv.reader(fh), [])}
    except (OSError, UnicodeDecodeError, csv.Error) as e:
        raise InputError(f"{path}: cannot read: {getattr(e, 'strerror', None) or e}") from e
    for name, cols in _SIGNATURES:
        if cols <= header:
            return name
    return "csv"


def load(fmt: str, paths: Sequence[str | Path], gpu: str | None = None,
         catalog: Catalogue | None = None) -> Dataset:
    """Read one or more files of a format ("auto": detected per file) into one Dataset.
    ``gpu`` stands for the GPU of files without a GPU column; ``catalog`` (the datasheet
    catalogue plus --gpu-spec GPUs) is what GPU names are looked up in."""
    if not paths:
        raise InputError("no input file given")
    parts = []
    for p in paths:
        name = detect_format(p) if fmt == "auto" else fmt
        if name not in FORMATS:
            raise InputError(f"unknown format {fmt!r} (known: {', '.join(FORMATS)})")
        parts.append(FORMATS[name](p, gpu=gpu, catalog=catalog))
    if len(parts) == 1:
        return parts[0]
    names = sorted({d.name for d in parts})
    return Dataset("+".join(names), concat([d.table for d in parts]),
                   [p for d in parts for p in d.paths],
                   list(dict.fromkeys(n for d in parts for n in d.notes)))


# The shared datasets the benchmark and tests use, relative to the data folder.
SHARED = {
    "gpperf-cutlass": ("gpperf-cutlass", ("gpperf/cutlass_rtx4070_results_clean.csv",)),
    "gpperf-tiled": ("gpperf-tiled", ("gpperf/execution_times_all.csv",
                                      "gpperf/power_usage_results_all.csv")),
    "b200": ("b200", ("b200/b200_gemm_half.csv", "b200/b200_gemm_fp8.csv")),
    "xla": ("xla", ("xla/xla_matmul_perf_table_latest.csv",)),
}


def shared_data_dir() -> Path | None:
    """../shared/data next to the project (or $GEMMD_DATA), if present."""
    import os

    env = os.environ.get("GEMMD_DATA")
    cands = [Path(env)] if env else []
    root = Path(__file__).resolve().parent.parent
    cands += [root.parent / "shared" / "data", root / "shared" / "data"]
    return next((c for c in cands if (c / "gpperf").is_dir()), None)


def load_shared(name: str, data_dir: Path) -> Dataset:
    fmt, rel = SHARED[name]
    return load(fmt, [data_dir / r for r in rel])
