"""The roofline predictor and the target spaces.

RooflinePredictor is the analytical estimate used until enough probes exist. Targets are
learned in log space relative to physics (runtime / (roofline time + a launch), power /
power limit, energy / FLOP): to_model_space and from_model_space map between the two;
table_hash names a training set.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from gemmd import bounds, features
from gemmd.features import Table
from gemmd.gemm import COLUMN, ProbeSpec
from gemmd.records import DeviceInfo, Prediction

# A GEMM costs at least a launch: runtime is learned relative to the roofline time plus
# this (seconds), so tiny GEMMs are not 1000x "inefficient" on one GPU and 3000x on
# another, which transfers badly.
# 3 us: the least a cuBLAS/XLA GEMM took on the shared data's B200 and H100 was 3.4-4 us
# (bench/transfer.py: with it, 5 probes of a GPU predict its other GEMMs 2-4x better).
LAUNCH_S = 3e-6


class RooflinePredictor:
    """Runtime = roofline bound / assumed efficiency; no power or energy estimate."""

    kind = "roofline"
    version = "roofline"

    def __init__(self, efficiency: float = 0.7, interval_factor: float = 2.0):
        self.efficiency = efficiency
        # The estimate is rough: its interval spans a factor either way.
        self.interval_factor = interval_factor
        self.meta: dict[str, Any] = {"n_samples": 0, "scores": {}, "created": None}

    def predict(self, specs: Sequence[ProbeSpec], infos: Sequence[DeviceInfo],
                source: str = "") -> list[Prediction]:
        t_ = Table.from_specs(specs, infos)
        roof = features.roofline(t_)
        floor = bounds.runtime_floor(t_)
        out = []
        for r, f in zip(roof, floor):
            t = max(float(r) / self.efficiency, float(f))
            out.append(Prediction(runtime_s=t, runtime_lo=max(t / self.interval_factor, f),
                                  runtime_hi=t * self.interval_factor,
                                  sigma={"runtime": math.log(self.interval_factor) / 1.645},
                                  in_domain=False, domain="no model yet (roofline estimate)"))
        return out


# ------------------------------------------------------------------ target spaces


def launch_s(t: Table) -> np.ndarray:
    """LAUNCH_S per row; 0 for CUTLASS profiler rows (device time of back-to-back kernels,
    no launch in it: with 3 us their unseen-shape error grew from 4.4% to 5.4%)."""
    return np.where(t["kernel"] == "cutlass", 0.0, LAUNCH_S)


def runtime_reference(t: Table) -> np.ndarray:
    """What runtime is learned relative to: the roofline time plus a launch."""
    return features.roofline(t) + launch_s(t)


def _scale(target: str, t: Table) -> np.ndarray:
    """Physics reference each target is learned relative to (in log space)."""
    if target == "runtime":
        return runtime_reference(t)
    if target == "power":
        limits = np.array([d.power_limit_w or 1.0 for d in t.devices], dtype=np.float64)
        return limits[t.device] if len(t) else np.zeros(0)
    return features.flops(t)


def to_model_space(target: str, t: Table, values: np.ndarray | None = None) -> np.ndarray:
    """log(measured / reference); NaN where not measured."""
    raw = t[COLUMN[target]] if values is None else values
    with np.errstate(divide="ignore", invalid="ignore"):
        y = np.log(raw / _scale(target, t))
    y[~np.isfinite(y)] = np.nan
    return y


def from_model_space(target: str, t: Table, y: np.ndarray) -> np.ndarray:
    return np.exp(y) * _scale(target, t)


def table_hash(t: Table) -> str:
    """Identity of the training data: configuration and measured columns, in order."""
    h = hashlib.sha256()
    for c in sorted(t.cols):
        v = t.cols[c]
        h.update(c.encode())
        h.update(v.tobytes() if v.dtype != object else "\x1f".join(map(str, v)).encode())
    h.update(",".join(d.uuid for d in t.devices).encode() + t.device.tobytes())
    return h.hexdigest()[:16]
