"""What every measurement reader shares: the GPUs of the datasheet catalogue by name, the
Dataset, a CSV file read whole and checked cell by cell, and the Table built from its columns.

Any bad value is an InputError naming the file, the row (as a spreadsheet numbers it: the
header is row 1) and the column; a file is read whole or not at all.
"""

from __future__ import annotations

import csv
import math
import os
import re
import stat
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from gemmd.errors import InputError
from gemmd.features import NUMERIC_DEFAULTS, Table
from gemmd.gemm import TARGET_COLUMNS
from gemmd.hardware import CATALOGUE, Catalogue
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
    for c, v in cols.items():  # extra columns (ts, source, context) travel along
        full[c] = np.asarray(v)
    devices = [info] if isinstance(info, DeviceInfo) else list(info)
    return Table(full, devices, np.zeros(n, dtype=np.int64) if device is None else device)


def _gpu(name: str, path: str, catalog: Catalogue | None = None) -> DeviceInfo:
    info = known_gpu(name, catalog)
    if info is None:
        raise InputError(f"{path}: --gpu: {_unknown_gpu(name, catalog)}")
    return info


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

