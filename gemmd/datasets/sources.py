"""Readers of the published measurement sets: GPPerf's CUTLASS and tiled runs, the B200
GEMMs of apex_plus and OpenXLA's matmul table, each converted to SI units on the way in."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from gemmd.datasets.reader import Dataset, _Csv, _dims, _gpu, _gpus, _table
from gemmd.errors import InputError
from gemmd.gemm import LAYOUTS
from gemmd.hardware import Catalogue

# A power reading sampled beside a run is the GEMM's only if the same sample shows the GPU
# busy: nvidia-smi's utilization is the share of its window a kernel ran. GPPerf's CUTLASS
# file has one reading per run; 1,159 of its 2,595 read gpu_util 0 (30 W, 28 C: an idle
# card; 10% of the runs under 15 ms read busy, 99% of those of 30 ms or more), 274 read
# 1-49% (33 W median), 7 read 55-70%, 1,155 read 91-100% (153 W median, 69 C). A
# reading without a utilization is kept.
BUSY_UTIL = 90.0


def load_gpperf_cutlass(path: str | Path, gpu: str | None = None,
                        catalog: Catalogue | None = None) -> Dataset:
    """GPPerf's CUTLASS profiler runs (RTX 4070, fp32 SIMT). runtime_ms -> s; power_W as
    is ("[N/A]" on most rows) where the same sample's gpu_util says the GPU was busy
    (BUSY_UTIL; all readings without that column); energy = power x runtime there."""
    f = _Csv(path)
    f.require("M", "N", "K", "layout", "cta_m", "cta_n", "cta_k", "runtime_ms", "power_W")
    infos, device = _gpus(f, "gpu_name", gpu, catalog, default="rtx4070")
    rt = f.floats("runtime_ms", positive=True, hi=1e7, unit="ms") / 1e3
    pw = f.floats("power_W", optional=True, positive=True, hi=5000, unit="W")
    read = int(np.isfinite(pw).sum())
    if f.has("gpu_util"):
        util = f.floats("gpu_util", optional=True, lo=0, hi=100, unit="%")
        pw = np.where(util < BUSY_UTIL, np.nan, pw)
    opt = {c: f.floats(c) for c in ("stages", "alpha", "beta") if f.has(c)}
    n = len(f)
    t = _table(n, infos, device, m=_dims(f, "M"), n=_dims(f, "N"), k=_dims(f, "K"),
               dtype="fp32", kernel="cutlass",
               layout=f.choice("layout", {x: x for x in LAYOUTS}, "layout"),
               cta_m=_dims(f, "cta_m"), cta_n=_dims(f, "cta_n"), cta_k=_dims(f, "cta_k"),
               runtime_s=rt, power_w=pw, energy_j=pw * rt, **opt,
               **({"ts": f.floats("timestamp", optional=True)} if f.has("timestamp") else {}))
    has_p = int(np.isfinite(pw).sum())
    idle = f" ({read - has_p:,} more readings dropped: the GPU idle for some or all of " \
        f"the sample, gpu_util below {BUSY_UTIL:g}%)" if read > has_p else ""
    return Dataset("gpperf-cutlass", t, [f.path], [
        f"power on {has_p:,} of {n:,} rows (one nvidia-smi reading per run){idle}",
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

