"""Physics as a bound: what no prediction of gemmd may claim, whatever a model learnt.

A GEMM cannot run faster than its roofline at the GPU's catalogued peaks (the dtype's
dense peak FLOP/s, the memory bandwidth: gemmd/hardware.py), nor draw more average power
than the board's limit or less than an idle GPU; energy per GEMM is power x runtime, so
it lies between idle power and the limit times the runtime. A forest fitted on one GPU
and asked about another, or a level carried over from other GPUs, can break these (a
model of an A100 predicted 109 TFLOP/s of fp32 on an H100 whose datasheet says 67):
``clip`` moves every point and interval bound inside them. Devices whose figures are
estimates rather than peaks (the CPU backend: its bandwidth is a rough guess) are not
bounded. docs/model.md ("What the model trusts") has the evidence.
"""

from __future__ import annotations

from collections.abc import MutableMapping

import numpy as np

from gemmd import features
from gemmd.features import Table
from gemmd.gemm import roofline_s

# The least share of its board limit a GPU draws while it runs anything: datasheets do
# not say; an RTX 4090 idles at ~20 W of 450 (4.4%), the H200 of bench/results at 89 W of
# 700 (12.7%), and the shared data never read below 13.8% (RTX 4070) and 17% (B200).
IDLE_SHARE = 0.04
# A measured average power may exceed the limit by this share (the power controller acts
# on a running average of about a second): the shared data reach 1.020 (B200) and 1.011
# (RTX 4070) of it and the H200's 1 s probes back to back 1.002, but an H100's default
# 0.5 s bf16 windows, each after 2 s of idle, read 1.046-1.174 (median 1.123; back to
# back 0.96-1.09; after 90 s of idle 1.136: bench/results/2026-11-26-h100-power and
# -h100-idle). The predicted power (a mean, and for data of long windows) stays at or
# below the limit; its interval, which is for a measurement, and what a measurement may
# read, reach this much above it.
LIMIT_TOLERANCE = 0.20
# Backends whose peak figures are not upper bounds (the CPU backend estimates them).
UNBOUNDED_BACKENDS = frozenset({"cpu"})


def _trusted(t: Table) -> np.ndarray:
    ok = np.array([d.backend not in UNBOUNDED_BACKENDS for d in t.devices], dtype=bool)
    return ok[t.device] if len(t) else np.zeros(0, dtype=bool)


def runtime_floor(t: Table) -> np.ndarray:
    """Per row, the least runtime physics allows (s): the roofline at the device's
    catalogued peaks; 0 where a peak is unknown or the device's figures are estimates."""
    peak, bw = features.peak_vector(t)
    with np.errstate(divide="ignore", invalid="ignore"):
        r = roofline_s(features.flops(t), features.traffic_bytes(t), peak, bw)
    return np.where(np.isfinite(r) & (r > 0) & _trusted(t), r, 0.0)


def power_range(t: Table) -> tuple[np.ndarray, np.ndarray]:
    """Per row, (idle, limit) average power (W): 0 and inf where the limit is unknown."""
    lim = np.array([d.power_limit_w or np.nan for d in t.devices], dtype=np.float64)
    lim = lim[t.device] if len(t) else np.zeros(0)
    ok = np.isfinite(lim) & (lim > 0) & _trusted(t)
    return np.where(ok, IDLE_SHARE * lim, 0.0), np.where(ok, lim, np.inf)


def violations(t: Table) -> dict[str, np.ndarray]:
    """Per measured target, which rows of ``t`` break the bounds themselves (bad data, or
    physics the bound does not model: operands that stay in L2 between back-to-back
    GEMMs beat the DRAM bandwidth)."""
    out = {}
    floor = runtime_floor(t)
    out["runtime"] = np.isfinite(t["runtime_s"]) & (t["runtime_s"] < floor)
    idle, lim = power_range(t)
    p = t["power_w"]
    out["power"] = np.isfinite(p) & ((p < idle) | (p > lim * (1 + LIMIT_TOLERANCE)))
    return out


def clip(out: MutableMapping[str, dict[str, np.ndarray]], t: Table) -> None:
    """Move each target's point, lo and hi (predict_table's answer, SI units) inside the
    physical bounds of its row, in place: runtime at or above the roofline; power
    between idle and the limit (an interval's top up to LIMIT_TOLERANCE above it); energy
    between idle power and the limit times the (bounded) runtime where both are known,
    and never below idle power times the roofline time. ``sigma`` is left as it was."""
    if not len(t) or not out:
        return
    floor = runtime_floor(t)
    idle, lim = power_range(t)
    rt = out.get("runtime")
    if rt is not None:
        for key in ("point", "lo", "hi"):
            rt[key] = np.maximum(rt[key], floor)
    pw = out.get("power")
    if pw is not None:
        pw["point"] = np.clip(pw["point"], idle, lim)
        pw["lo"] = np.clip(pw["lo"], idle, lim)
        pw["hi"] = np.clip(pw["hi"], idle, lim * (1 + LIMIT_TOLERANCE))
    en = out.get("energy")
    if en is not None:
        lo_e = idle * (rt["point"] if rt is not None else floor)
        hi_e = lim * rt["point"] if rt is not None else np.full(len(t), np.inf)
        en["point"] = np.clip(en["point"], lo_e, hi_e)
        en["lo"] = np.minimum(np.maximum(en["lo"], idle * floor), en["point"])
        en["hi"] = np.maximum(en["hi"], en["point"])
