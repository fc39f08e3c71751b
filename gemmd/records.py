"""The plain records that several layers share, beside the GEMM vocabulary (gemm.py).

What a device is (``DeviceInfo``), what a probe measured (``Measurement``), what the model
predicts (``Prediction``) and the names of the clock-event reasons a measurement's context
carries. Plain data, no behaviour beyond reading itself: the devices make them, the store
keeps them, the features and the model read them, drift and the exporter judge and show
them, and none of those needs another's module for it. Imports nothing from gemmd but the
vocabulary.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from gemmd.gemm import ProbeSpec

# nvmlClocksEventReason* bits (nvml.h; "throttle reasons" in older drivers). 0x200 and 0x400
# exist only under their nvmlClocksThrottleReason* names in pynvml.
CLOCK_EVENT_REASONS = {
    0x1: "gpu_idle",
    0x2: "applications_clocks_setting",
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x10: "sync_boost",
    0x20: "sw_thermal_slowdown",
    0x40: "hw_thermal_slowdown",
    0x80: "hw_power_brake_slowdown",
    0x100: "display_clock_setting",
    0x200: "board_limit",
    0x400: "reliability",
}


@dataclass(frozen=True)
class DeviceInfo:
    index: int
    uuid: str
    name: str  # model name, e.g. "NVIDIA H100 80GB HBM3"
    backend: str  # "nvidia" | "cpu" | "fake"
    peak_flops: dict[str, float]  # dense peak FLOP/s per dtype (datasheet or estimate)
    mem_bandwidth: float  # bytes/s
    sm_count: int | None = None
    memory_bytes: int | None = None
    power_limit_w: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class Measurement:
    """One probe's result. Times in seconds, energy in joules, power in watts."""

    spec: ProbeSpec
    iterations: int
    runtime_s: float  # median per-iteration time over the window
    runtime_mean_s: float
    runtime_min_s: float
    runtime_p90_s: float
    runtime_cv: float  # coefficient of variation of per-iteration times
    window_s: float  # device clock from just before the first GEMM to just after the last
    energy_j: float | None = None  # per GEMM: counter delta / iterations
    power_w: float | None = None  # average: counter delta / window
    # One reading of NVML's power after the window (context only). Not instantaneous on
    # Ampere and newer GPUs: NVML reports power averaged over the last second there.
    power_sample_w: float | None = None
    context: dict[str, Any] = field(default_factory=dict)
    check_ok: bool | None = None  # None: not checked this time
    check_error: float | None = None
    elapsed_s: float = 0.0  # device time the whole protocol took (buffers, warm-up, window)

    @property
    def tflops(self) -> float:
        return self.spec.flops / self.runtime_s / 1e12


def as_row(m: Measurement) -> dict[str, Any]:
    """Flatten a measurement for the store."""
    d = dataclasses.asdict(m)
    spec = d.pop("spec")
    d.update(spec)
    return d


@dataclass
class Prediction:
    """Point prediction and interval per target; None where the predictor has no estimate."""

    runtime_s: float | None = None
    runtime_lo: float | None = None
    runtime_hi: float | None = None
    power_w: float | None = None
    power_lo: float | None = None
    power_hi: float | None = None
    energy_j: float | None = None
    energy_lo: float | None = None
    energy_hi: float | None = None
    sigma: dict[str, float] = field(default_factory=dict)  # log-space std per target
    # False where the model has no data like this GEMM (a GPU, dtype or kernel it never
    # saw, or a size far outside the trained range); ``domain`` then says why, briefly.
    # Such predictions are guesses: their interval is widened to say so.
    in_domain: bool = True
    domain: str = ""
    # Per target, why it is outside the domain ('' inside): power and energy are in the
    # domain only where power was measured, so they can be out where runtime is in.
    domains: dict[str, str] = field(default_factory=dict)

    def target_in_domain(self, target: str) -> bool:
        return not self.domains.get(target, "" if self.in_domain else self.domain)
