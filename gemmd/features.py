"""Feature engineering shared by fit and predict, for stored probes and imported rows alike.

Physics first: each row gets its roofline time from the device's peak rates and its
tile/wave quantization from the SM count, so the forest learns *efficiency* relative to
the roofline (which transfers to unseen sizes) rather than raw seconds (which does not).
Rows are plain mappings; configuration a probe does not have (a CUTLASS CTA tile, stages,
alpha/beta, a batch count) is optional, so one feature code serves every data source.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from gemmd.gemm import (
    COLUMN,
    DATA_KERNELS,
    DTYPE_BYTES,
    DTYPES,
    LAYOUTS,
    OUT_BYTES,
    TARGET_COLUMNS,
    TARGETS,
    ProbeSpec,
    gemm_bytes,
    gemm_flops,
    roofline_s,
)
from gemmd.records import DeviceInfo

# Optional numeric columns and their value when a row does not say (0 = unknown).
NUMERIC_DEFAULTS = {"batch": 1.0, "tile": 0.0, "cta_m": 0.0, "cta_n": 0.0, "cta_k": 0.0,
                    "stages": 0.0, "alpha": 1.0, "beta": 0.0}
# "variant" tells apart inputs the features do not (XLA's fp8 e4m3 x e5m2 vs e4m3 x e4m3):
# rows that differ only there are different configurations, not repeats.
TEXT_DEFAULTS = {"dtype": "fp32", "kernel": "blas", "layout": "nn", "out_dtype": "",
                 "variant": ""}
__all__ = ["COLUMN", "FEATURES", "TARGETS", "TARGET_COLUMNS", "Table"]  # targets: gemmd.gemm

FEATURES = (
    "log2_m", "log2_n", "log2_k", "log2_batch", "log2_flops", "log2_intensity",
    "dtype_bytes", "out_bytes", *(f"dtype_{d}" for d in DTYPES),
    *(f"kernel_{k}" for k in DATA_KERNELS), "tile", "cta_m", "cta_n", "cta_k", "stages",
    "beta_nonzero", "alpha_not_one", *(f"layout_{x}" for x in LAYOUTS),
    "align_m", "align_n", "align_k", "log2_peak_flops", "log2_bandwidth", "sm_count",
    "log2_roofline_s", "log2_intensity_over_ridge", "wave_efficiency", "tile_efficiency",
    "log2_waves", "k_efficiency", "wave_efficiency_256",
)

_MAX_ALIGN = 256  # alignment beyond this changes nothing for any kernel


class Table:
    """Columns of GEMM rows (numpy arrays, SI units) plus the device each row ran on.

    ``devices`` holds each distinct DeviceInfo once; ``device`` indexes it per row.
    Targets (runtime_s, power_w, energy_j) are NaN where not measured.
    """

    def __init__(self, cols: dict[str, np.ndarray], devices: Sequence[DeviceInfo],
                 device: np.ndarray):
        self.cols = cols
        self.devices = list(devices)
        self.device = np.asarray(device, dtype=np.int64)

    def __len__(self) -> int:
        return len(self.device)

    def __getitem__(self, name: str) -> np.ndarray:
        return self.cols[name]

    def take(self, idx: np.ndarray | Sequence[int]) -> Table:
        idx = np.asarray(idx)
        return Table({k: v[idx] for k, v in self.cols.items()}, self.devices, self.device[idx])

    def info(self, i: int | np.integer) -> DeviceInfo:
        return self.devices[int(self.device[i])]

    def row(self, i: int) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for k, v in self.cols.items():
            x = v[i].item() if hasattr(v[i], "item") else v[i]
            out[k] = None if isinstance(x, float) and math.isnan(x) else x
        return out

    @classmethod
    def from_rows(cls, rows: Sequence[Mapping[str, Any]], infos: Sequence[DeviceInfo]
                  ) -> Table:
        """From row mappings (store rows, CSV records) and the DeviceInfo of each row."""
        devices, device = _index_devices(infos)
        cols: dict[str, np.ndarray] = {}
        for c in ("m", "n", "k"):
            cols[c] = np.array([float(r[c]) for r in rows], dtype=np.float64)
        for c, d in NUMERIC_DEFAULTS.items():
            cols[c] = np.array([_num(r.get(c), d) for r in rows], dtype=np.float64)
        for c, text in TEXT_DEFAULTS.items():
            cols[c] = np.array([str(r.get(c) or text) for r in rows], dtype=object)
        for c in TARGET_COLUMNS:
            cols[c] = np.array([_num(r.get(c), math.nan) for r in rows], dtype=np.float64)
        if any("ts" in r for r in rows[:1]):
            cols["ts"] = np.array([_num(r.get("ts"), math.nan) for r in rows], dtype=np.float64)
        if any("source" in r for r in rows[:1]):
            cols["source"] = np.array([str(r.get("source") or "") for r in rows], dtype=object)
        return cls(cols, devices, device)

    @classmethod
    def from_specs(cls, specs: Sequence[ProbeSpec], infos: Sequence[DeviceInfo],
                   source: str = "") -> Table:
        """``source``: whose measurement is predicted (row_sources; "daemon": gemmd's own
        probes), '' for none in particular."""
        rows = [_spec_row(s) for s in specs]
        return cls.from_rows([{**r, "source": source} for r in rows] if source else rows, infos)


def _spec_row(s: ProbeSpec) -> dict[str, Any]:
    return {"m": s.m, "n": s.n, "k": s.k, "dtype": s.dtype, "kernel": s.kernel,
            "tile": s.tile, "layout": s.layout}


def _num(v: Any, default: float) -> float:
    if v is None or v == "":
        return default
    return float(v)


def _index_devices(infos: Sequence[DeviceInfo]) -> tuple[list[DeviceInfo], np.ndarray]:
    devices: list[DeviceInfo] = []
    by_id: dict[int, int] = {}
    by_uuid: dict[str, int] = {}
    idx = np.empty(len(infos), dtype=np.int64)
    for i, info in enumerate(infos):
        j = by_id.get(id(info))
        if j is None:
            j = by_uuid.get(info.uuid)
            if j is None:
                j = by_uuid[info.uuid] = len(devices)
                devices.append(info)
            by_id[id(info)] = j
        idx[i] = j
    return devices, idx


def row_sources(t: Table) -> np.ndarray:
    """Per row, the source its measurement came from ("daemon": gemmd's own probes; an
    imported file's format or source name), '' where unknown. Two sources may time the
    same GEMM differently (XLA's table: one launch at boost clocks; gemmd: back-to-back
    GEMMs over a 0.5 s window, at the power cap where it binds): model.domain keeps them
    apart."""
    src = t.cols.get("source")
    return np.full(len(t), "", dtype=object) if src is None else src


def concat(tables: Sequence[Table]) -> Table:
    """One table from several (columns present in all of them)."""
    devices: list[DeviceInfo] = []
    maps = []
    for t in tables:
        m = []
        for d in t.devices:
            hit = next((i for i, x in enumerate(devices) if x.uuid == d.uuid), None)
            if hit is None:
                hit = len(devices)
                devices.append(d)
            m.append(hit)
        maps.append(np.asarray(m, dtype=np.int64))
    keys = [k for k in tables[0].cols if all(k in t.cols for t in tables)]
    cols = {k: np.concatenate([t.cols[k] for t in tables]) for k in keys}
    if any("source" in t.cols for t in tables):  # a table without one: source unknown
        cols["source"] = np.concatenate([row_sources(t) for t in tables])
    device = np.concatenate([mp[t.device] for mp, t in zip(maps, tables)])
    return Table(cols, devices, device)


CONFIG_KEYS = ("batch", "m", "n", "k", "dtype", "out_dtype", "variant", "kernel", "tile",
               "layout", "cta_m", "cta_n", "cta_k", "stages", "alpha", "beta")


def config_ids(t: Table) -> np.ndarray:
    """Group id per row: rows of the same configuration on the same device share one."""
    if not len(t):
        return np.zeros(0, dtype=np.int64)
    parts = [t.device.astype(np.float64)]
    for c in CONFIG_KEYS:
        v = t[c]
        parts.append(np.unique(v, return_inverse=True)[1].ravel().astype(np.float64)
                     if v.dtype == object else v.astype(np.float64))
    return np.unique(np.column_stack(parts), axis=0, return_inverse=True)[1].ravel()


def spec_of(row: Mapping[str, Any]) -> ProbeSpec:
    return ProbeSpec(int(row["m"]), int(row["n"]), int(row["k"]), str(row["dtype"]),
                     str(row["kernel"]), int(row["tile"] or 0), str(row["layout"]))


# ------------------------------------------------------------------ physics


def _lookup(values: np.ndarray, table: Mapping[str, float], default: float) -> np.ndarray:
    get = table.get
    return np.fromiter((get(v, default) for v in values), dtype=np.float64, count=len(values))


def flops(t: Table) -> np.ndarray:
    return gemm_flops(t["m"], t["n"], t["k"], t["batch"])


def traffic_bytes(t: Table) -> np.ndarray:
    """Compulsory traffic: read A and B once, write C once (and read it when beta != 0)."""
    return gemm_bytes(t["m"], t["n"], t["k"], _lookup(t["dtype"], DTYPE_BYTES, 4.0),
                      _out_bytes(t), t["batch"], 1.0 + (t["beta"] != 0))


def _out_bytes(t: Table) -> np.ndarray:
    ob = _lookup(t["dtype"], OUT_BYTES, 4.0)
    named = _lookup(t["out_dtype"], OUT_BYTES, 0.0)
    return np.where(named > 0, named, ob)


def compute_dtype(dtype: str, kernel: str) -> str:
    """The dtype whose peak bounds a GEMM: the tiled kernel runs on the fp32 (SIMT) units
    whatever the tensor-core peaks are (peak_vector's rule, for one row)."""
    return "fp32" if kernel == "tiled" else dtype


def peak_vector(t: Table) -> tuple[np.ndarray, np.ndarray]:
    """(peak FLOP/s for each row's dtype and kernel, peak bandwidth B/s); NaN if unknown.

    The tiled kernel runs on the fp32 (SIMT) units whatever the tensor-core peaks are.
    """
    compute_dtype = np.where(t["kernel"] == "tiled", "fp32", t["dtype"])
    peaks = [d.peak_flops for d in t.devices]
    peak = np.fromiter(((peaks[j].get(d) or np.nan) for j, d in zip(t.device, compute_dtype)),
                       dtype=np.float64, count=len(t))
    bws = np.array([d.mem_bandwidth or np.nan for d in t.devices], dtype=np.float64)
    bw = bws[t.device] if len(t) else np.zeros(0)
    return peak, bw


def roofline(t: Table) -> np.ndarray:
    """Lower bound on runtime, seconds; 1 TFLOP/s when the device's peaks are unknown."""
    peak, bw = peak_vector(t)
    f = flops(t)
    r = roofline_s(f, traffic_bytes(t), peak, bw)
    return np.where(np.isfinite(r) & (r > 0), r, f / 1e12)


def _tiles(t: Table) -> tuple[np.ndarray, np.ndarray]:
    """Output tile (rows, cols) per CTA: the CUTLASS CTA shape when known, the tiled
    kernel's tile edge, else 128x128 (a common cuBLAS tile)."""
    tm = np.where(t["cta_m"] > 0, t["cta_m"], np.where(t["kernel"] == "tiled",
                                                        np.maximum(t["tile"], 1), 128.0))
    tn = np.where(t["cta_n"] > 0, t["cta_n"], np.where(t["kernel"] == "tiled",
                                                        np.maximum(t["tile"], 1), 128.0))
    return tm, tn


def _waves(t: Table, tm: np.ndarray, tn: np.ndarray, sms: np.ndarray
           ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(wave efficiency, waves, CTAs): useful CTAs / (waves x SMs); 1.0 when SMs unknown."""
    ctas = t["batch"] * np.ceil(t["m"] / tm) * np.ceil(t["n"] / tn)
    s = np.where(sms > 0, sms, 1.0)
    waves = np.ceil(ctas / s)
    eff = np.where(sms > 0, ctas / (waves * s), 1.0)
    return eff, waves, ctas


def _alignment(x: np.ndarray) -> np.ndarray:
    """log2 of the largest power of two dividing x, capped (vector loads, tensor cores)."""
    xi = x.astype(np.int64)
    low = xi & -xi
    return np.log2(np.minimum(np.where(low > 0, low, 1), _MAX_ALIGN).astype(np.float64))


def table_matrix(t: Table) -> np.ndarray:
    """Feature matrix (rows x FEATURES) of a table."""
    m, n, k, b = t["m"], t["n"], t["k"], t["batch"]
    f, by = flops(t), traffic_bytes(t)
    peak, bw = peak_vector(t)
    peak_ok = np.where(np.isfinite(peak), peak, 1e12)
    bw_ok = np.where(np.isfinite(bw), bw, 1e11)
    sms = np.array([float(d.sm_count or 0) for d in t.devices])[t.device] if len(t) else \
        np.zeros(0)
    roof = roofline_s(f, by, peak_ok, bw_ok)
    tm, tn = _tiles(t)
    wave_eff, waves, _ = _waves(t, tm, tn, sms)
    tile_eff = (m * n) / (np.ceil(m / tm) * tm * np.ceil(n / tn) * tn)
    wave_eff2, _, _ = _waves(t, np.full(len(t), 256.0), np.full(len(t), 128.0), sms)
    ck = np.where(t["cta_k"] > 0, t["cta_k"], 32.0)
    k_iters = np.ceil(k / ck)
    cols = [
        np.log2(m), np.log2(n), np.log2(k), np.log2(b), np.log2(f), np.log2(f / by),
        _lookup(t["dtype"], DTYPE_BYTES, 4.0), _out_bytes(t),
        *((t["dtype"] == d).astype(np.float64) for d in DTYPES),
        *((t["kernel"] == x).astype(np.float64) for x in DATA_KERNELS),
        t["tile"], t["cta_m"], t["cta_n"], t["cta_k"], t["stages"],
        (t["beta"] != 0).astype(np.float64), (t["alpha"] != 1).astype(np.float64),
        *((t["layout"] == x).astype(np.float64) for x in LAYOUTS),
        _alignment(m), _alignment(n), _alignment(k),
        np.log2(peak_ok), np.log2(bw_ok), sms,
        np.log2(roof), np.log2((f / by) / (peak_ok / bw_ok)),
        wave_eff, tile_eff, np.log2(waves), k / (k_iters * ck), wave_eff2,
    ]
    return np.column_stack(cols) if len(t) else np.zeros((0, len(FEATURES)))


# ------------------------------------------------- the probe-spec interface (daemon)


def matrix(specs: Sequence[ProbeSpec], infos: Sequence[DeviceInfo]) -> np.ndarray:
    return table_matrix(Table.from_specs(specs, infos))


def roofline_vector(specs: Sequence[ProbeSpec], infos: Sequence[DeviceInfo]) -> np.ndarray:
    return roofline(Table.from_specs(specs, infos))
