"""Feature engineering shared by fit and predict.

Physics first: each row gets its roofline time from the device's peak rates and its
tile/wave quantization from the SM count, so the forest learns *efficiency* relative to
the roofline (which transfers to unseen sizes) rather than raw seconds (which does not).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from gemmd.config import DTYPES, LAYOUTS
from gemmd.devices.base import DeviceInfo, roofline_seconds
from gemmd.probes import DTYPE_BYTES, ProbeSpec

FEATURES = (
    "log2_m", "log2_n", "log2_k", "log2_flops", "log2_bytes", "log2_intensity",
    "dtype_bytes", *(f"dtype_{d}" for d in DTYPES), "tiled", "tile",
    *(f"layout_{x}" for x in LAYOUTS), "log2_peak_flops", "log2_bandwidth", "sm_count",
    "log2_roofline_s", "compute_bound", "wave_efficiency", "tile_efficiency",
)


def spec_of(row: Mapping[str, Any]) -> ProbeSpec:
    return ProbeSpec(int(row["m"]), int(row["n"]), int(row["k"]), str(row["dtype"]),
                     str(row["kernel"]), int(row["tile"] or 0), str(row["layout"]))


def quantization(spec: ProbeSpec, sm_count: int | None) -> tuple[float, float]:
    """(wave efficiency, tile efficiency) of a 128x128-tiled GEMM on ``sm_count`` SMs.

    Wave efficiency: useful tiles / (waves x SMs). Tile efficiency: useful elements /
    elements of the padded tiles. Both 1.0 when unknown.
    """
    tm = tn = 128
    if spec.kernel == "tiled":
        tm = tn = max(spec.tile, 1)
    tiles_m, tiles_n = math.ceil(spec.m / tm), math.ceil(spec.n / tn)
    tile_eff = (spec.m * spec.n) / (tiles_m * tm * tiles_n * tn)
    if not sm_count:
        return 1.0, tile_eff
    n_tiles = tiles_m * tiles_n
    waves = math.ceil(n_tiles / sm_count)
    return n_tiles / (waves * sm_count), tile_eff


def feature_row(spec: ProbeSpec, info: DeviceInfo) -> list[float]:
    peak = info.peak_flops.get("fp32" if spec.kernel == "tiled" else spec.dtype) or 1.0
    bw = info.mem_bandwidth or 1.0
    roof = roofline_seconds(info, spec) or spec.flops / peak
    wave_eff, tile_eff = quantization(spec, info.sm_count)
    return [
        math.log2(spec.m), math.log2(spec.n), math.log2(spec.k), math.log2(spec.flops),
        math.log2(spec.bytes), math.log2(spec.intensity), float(DTYPE_BYTES[spec.dtype]),
        *(float(spec.dtype == d) for d in DTYPES), float(spec.kernel == "tiled"),
        float(spec.tile), *(float(spec.layout == x) for x in LAYOUTS),
        math.log2(peak), math.log2(bw), float(info.sm_count or 0), math.log2(roof),
        float(spec.flops / peak >= spec.bytes / bw), wave_eff, tile_eff,
    ]


def matrix(specs: Sequence[ProbeSpec], infos: Sequence[DeviceInfo]) -> np.ndarray:
    return np.array([feature_row(s, i) for s, i in zip(specs, infos)], dtype=np.float64)


def roofline_vector(specs: Sequence[ProbeSpec], infos: Sequence[DeviceInfo]) -> np.ndarray:
    out = []
    for s, i in zip(specs, infos):
        r = roofline_seconds(i, s)
        out.append(r if r else s.flops / 1e12)
    return np.array(out, dtype=np.float64)
