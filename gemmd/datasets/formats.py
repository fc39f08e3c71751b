"""The formats gemmd reads, told apart by their header, and the loader of one or more files;
the shared datasets the benchmark and tests use."""

from __future__ import annotations

import csv
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from gemmd.datasets.generic import load_csv
from gemmd.datasets.reader import Dataset, _open_text
from gemmd.datasets.sources import load_b200, load_gpperf_cutlass, load_gpperf_tiled, load_xla
from gemmd.errors import InputError
from gemmd.features import concat
from gemmd.files import file_identity
from gemmd.hardware import Catalogue

# ------------------------------------------------------------------ formats

Loader = Callable[..., Dataset]
FORMATS: dict[str, Loader] = {
    "gpperf-cutlass": load_gpperf_cutlass, "gpperf-tiled": load_gpperf_tiled,
    "b200": load_b200, "xla": load_xla, "csv": load_csv,
}
# The source (features.row_sources) of each format's rows: where the measurements came
# from, one name per project (GPPerf's two files are one paper's runs). A generic CSV's
# rows take its "source" column, else none ('').
FORMAT_SOURCE = {"gpperf-cutlass": "gpperf", "gpperf-tiled": "gpperf", "b200": "apex_plus",
                 "xla": "xla"}
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
    seen: dict[tuple[int, int] | str, str | Path] = {}
    for p in paths:  # the same file twice would count its measurements twice
        # (one that cannot be read: by its name; the format's reader says what is wrong)
        key: tuple[int, int] | str = file_identity(p) or str(p)
        if key in seen:
            raise InputError(f"{p}: given twice (as {seen[key]}); its rows would count twice")
        seen[key] = p
    parts = []
    for p in paths:
        name = detect_format(p) if fmt == "auto" else fmt
        if name not in FORMATS:
            raise InputError(f"unknown format {fmt!r} (known: {', '.join(FORMATS)})")
        part = FORMATS[name](p, gpu=gpu, catalog=catalog)
        if "source" not in part.table.cols and name in FORMAT_SOURCE:
            part.table.cols["source"] = np.full(len(part.table), FORMAT_SOURCE[name],
                                                dtype=object)
        parts.append(part)
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
    root = Path(__file__).resolve().parents[2]  # the project: gemmd/datasets/formats.py
    cands += [root.parent / "shared" / "data", root / "shared" / "data"]
    return next((c for c in cands if (c / "gpperf").is_dir()), None)


def load_shared(name: str, data_dir: Path) -> Dataset:
    fmt, rel = SHARED[name]
    return load(fmt, [data_dir / r for r in rel])
