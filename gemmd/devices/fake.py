"""A simulated GPU for tests and demos: seeded, realistic, with fault injection.

Runtime follows a roofline with tile/wave quantization and lognormal noise; power follows
utilization between idle and the power limit; the energy counter is monotonic and, like
NVML's, only moves in 100 ms steps. Time is simulated (no sleeping) unless ``realtime``.

Faults: ``FakeDeviceConfig.slowdown_factor`` (thermal throttling), or a ``Scenario`` set on
the device, each with the context a real GPU reports with it (clocks, clock-event reasons,
power limit, temperature), so that drift's alarms can name their cause.
"""

from __future__ import annotations

import bisect
import hashlib
import math
import os
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np

from gemmd.config import FakeDeviceConfig
from gemmd.devices.base import BusyLimits, Device, Run
from gemmd.errors import DeviceError, DeviceFault
from gemmd.gemm import DTYPE_BYTES, ProbeSpec
from gemmd.records import DeviceInfo


@dataclass(frozen=True)
class GpuModel:
    name: str
    sm_count: int
    peak: dict[str, float]  # dense FLOP/s
    bandwidth: float  # B/s
    memory: int
    tdp_w: float
    idle_w: float
    sm_clock_hz: float
    mem_clock_hz: float


T = 1e12
MODELS = {
    "H100-SXM": GpuModel("NVIDIA H100 80GB HBM3 (fake)", 132,
                         {"fp64": 67 * T, "fp32": 67 * T, "tf32": 494.7 * T, "fp16": 989.4 * T,
                          "bf16": 989.4 * T, "fp8": 1978.9 * T}, 3.35e12, 80 << 30, 700, 70,
                         1.98e9, 2.619e9),
    "A100-SXM": GpuModel("NVIDIA A100-SXM4-80GB (fake)", 108,
                         {"fp64": 19.5 * T, "fp32": 19.5 * T, "tf32": 156 * T, "fp16": 312 * T,
                          "bf16": 312 * T}, 2.039e12, 80 << 30, 400, 55, 1.41e9, 1.593e9),
    "RTX4070": GpuModel("NVIDIA GeForce RTX 4070 (fake)", 46,
                        {"fp64": 0.455 * T, "fp32": 29.1 * T, "tf32": 29.1 * T,
                         "fp16": 58.3 * T, "bf16": 58.3 * T, "fp8": 116.6 * T}, 504e9,
                        12 << 30, 200, 12, 2.475e9, 10.5e9),
    "L4": GpuModel("NVIDIA L4 (fake)", 58,
                   {"fp64": 0.49 * T, "fp32": 30.3 * T, "tf32": 60 * T, "fp16": 121 * T,
                    "bf16": 121 * T, "fp8": 242.5 * T}, 300e9, 24 << 30, 72, 16, 2.04e9,
                   6.251e9),
}

# Fraction of fp32 peak reached by the paper's naive tiled kernel, by tile edge (shape of
# GPPerf's finding: tiny tiles are launch/latency bound, 16-32 are best).
@dataclass(frozen=True)
class Scenario:
    """A fault from ``after_s`` on (on the device's clock), with its context:

    - thermal: clocks down by ``factor`` (runtime x factor), hw_thermal_slowdown, 12 C
      hotter, less power;
    - power_cap: the power limit lowered to ``factor`` x the model's; probes that drew
      more slow down until they fit (clocks down, sw_power_cap);
    - clock_cap: SM clocks locked ``factor`` lower, no clock-event reason (as
      ``nvidia-smi -lgc`` did on the H200);
    - less_work: runtime x ``factor`` at the same clocks, reasons, power limit and
      temperature (the case no counter explains);
    - power: power x ``factor`` at the same runtime and clocks (up to the limit).
    """

    kind: str
    factor: float = 1.05
    after_s: float = 0.0

    KINDS = ("thermal", "power_cap", "clock_cap", "less_work", "power")

    def __post_init__(self) -> None:
        if self.kind not in self.KINDS:
            raise ValueError(f"unknown fake scenario {self.kind!r} (one of {self.KINDS})")


@dataclass(frozen=True)
class _Effect:
    """What a fault does to one probe: runtime and power factors, SM clock factor, the
    power limit, clock-event reasons, extra temperature."""

    time: float = 1.0
    power: float = 1.0
    clock: float = 1.0
    limit: float | None = None
    reasons: tuple[str, ...] = ()
    hotter: float = 0.0


_TILED_EFF = {1: 0.004, 2: 0.012, 4: 0.04, 8: 0.09, 16: 0.15, 32: 0.14}
_LAYOUT_FACTOR = {"nn": 1.0, "nt": 1.01, "tn": 1.02, "tt": 1.04}
_LAUNCH_S = 4e-6
_ENERGY_STEP_S = 0.1


def simulated_runtime(model: GpuModel, spec: ProbeSpec) -> tuple[float, float]:
    """Noise-free (runtime seconds, utilization 0..1) of ``spec`` on ``model``."""
    if spec.kernel == "tiled":
        tiles = sorted(_TILED_EFF)
        eff = _TILED_EFF[min(tiles, key=lambda t: abs(t - spec.tile))]
        t = spec.flops / (model.peak["fp32"] * eff) + _LAUNCH_S
        return t, min(1.0, 0.3 + 2 * eff)
    # cuBLAS-like: 128x128 output tiles (256x128 for <=16-bit), wave quantization over SMs.
    tm, tn = (256, 128) if DTYPE_BYTES[spec.dtype] <= 2 else (128, 128)
    n_tiles = math.ceil(spec.m / tm) * math.ceil(spec.n / tn)
    waves = math.ceil(n_tiles / model.sm_count)
    wave_eff = n_tiles / (waves * model.sm_count)
    compute = spec.flops / (model.peak[spec.dtype] * 0.8 * wave_eff)
    memory = spec.bytes / (model.bandwidth * 0.85)
    t = max(compute, memory) * _LAYOUT_FACTOR[spec.layout] + _LAUNCH_S
    util = min(1.0, spec.flops / (t * model.peak[spec.dtype]) / 0.8)
    # Memory-bound kernels still keep the chip busy; launch-bound ones do not.
    busy = max(util, min(1.0, memory / t) * 0.6)
    return t, busy


class FakeDevice(Device):
    def __init__(self, index: int, cfg: FakeDeviceConfig, *, seed: int = 0, noise: float = 0.01,
                 realtime: bool = False, memory_budget: int = 2 << 30, jitter: float = 0.0):
        self.cfg = cfg
        self.model = MODELS[cfg.model]
        uid = hashlib.sha1(f"{seed}-{index}-{cfg.model}".encode()).hexdigest()
        self.info = DeviceInfo(
            index=index, uuid=f"GPU-fake-{uid[:8]}-{uid[8:12]}-{uid[12:16]}", name=self.model.name,
            backend="fake", peak_flops=dict(self.model.peak), mem_bandwidth=self.model.bandwidth,
            sm_count=self.model.sm_count, memory_bytes=self.model.memory,
            power_limit_w=self.model.tdp_w, extra={"simulated": True})
        self._rng = np.random.default_rng([seed, index])
        # The polling latency of the counter's steps draws apart: how many steps a window
        # holds depends on the host's speed, which must not shift the GEMMs' noise.
        self._poll_rng = np.random.default_rng([seed, index, 1])
        # Sibling cards differ a little (silicon lottery), fixed per device.
        self._offset = float(np.exp(self._rng.normal(0.0, 0.01)))
        self._noise = noise
        self._jitter = jitter
        self._realtime = realtime
        self.memory_budget = memory_budget
        self._lock = threading.Lock()
        self._start = time.monotonic()
        self._sim_offset = 0.0  # simulated seconds added to the real clock
        self._energy = 0.0  # exact integral, J
        self._energy_t = self._start
        # Energy breakpoints of the last few seconds (older ones are never asked for).
        self._points: deque[tuple[float, float]] = deque([(self._start, 0.0)], maxlen=4096)
        self._power = self.model.idle_w
        self._calls = 0
        self._faulted = False
        self._closed = threading.Event()
        self._util = 0.0
        self.scenario: Scenario | None = None  # a fault with its context (tests, benches)
        self._effect = _Effect()  # the fault's effect on the last probe run

    # -- faults and state -------------------------------------------------------
    def _slowdown(self) -> float:
        if self.cfg.slowdown_when_file:  # while the file exists: whoever made it chose when
            active = os.path.exists(self.cfg.slowdown_when_file)
        else:  # on the device's own clock, so simulated time counts too
            active = self.clock() - self._start >= self.cfg.slowdown_after_s
        return self.cfg.slowdown_factor if active else 1.0

    def _fault(self, util: float, spec: ProbeSpec) -> _Effect:
        """What the configured slowdown or the scenario does to ``spec`` now."""
        slow = self._slowdown()
        sc = self.scenario
        if sc is None or self.clock() - self._start < sc.after_s:
            if slow > 1.0:
                return _Effect(slow, 1 / slow**0.5, 1 / slow, None, ("hw_thermal_slowdown",),
                               12.0)
            return _Effect()
        m = self.model
        if sc.kind == "thermal":
            return _Effect(sc.factor, 1 / sc.factor**0.5, 1 / sc.factor, None,
                           ("hw_thermal_slowdown",), 12.0)
        if sc.kind == "clock_cap":
            return _Effect(sc.factor, 1 / sc.factor**0.5, 1 / sc.factor)
        if sc.kind == "less_work":
            return _Effect(sc.factor)
        if sc.kind == "power":
            return _Effect(power=sc.factor)
        # power_cap: power scales with about the cube of the clock (voltage follows it).
        limit = sc.factor * m.tdp_w
        dyn = self._power_for(util, 1.0, spec, noise=False) - m.idle_w
        if dyn + m.idle_w <= limit:
            return _Effect(limit=limit)
        s = (dyn / max(limit - m.idle_w, 1.0)) ** (1 / 3)
        return _Effect(s, (limit / (dyn + m.idle_w)), 1 / s, limit, ("sw_power_cap",))

    def clock(self) -> float:
        return time.monotonic() + self._sim_offset

    def _advance(self, seconds: float, power: float) -> None:
        """Integrate energy: idle since the last event, then ``power`` for ``seconds``.

        Breakpoints (time, exact energy) bound linear pieces (constant power), so the
        energy at any past step boundary can be read back exactly.
        """
        now = self.clock()
        self._energy += self.model.idle_w * max(0.0, now - self._energy_t)
        self._points.append((now, self._energy))
        if self._realtime:
            time.sleep(seconds)
        else:
            self._sim_offset += seconds
        self._energy += power * seconds
        self._energy_t = now + seconds
        self._points.append((self._energy_t, self._energy))
        self._power = power

    # -- Device -----------------------------------------------------------------
    def _unsupported(self, spec: ProbeSpec) -> str | None:
        if spec.kernel == "tiled" and spec.dtype != "fp32":
            return "the tiled kernel is fp32 only"
        if spec.dtype not in self.model.peak:
            return f"{self.model.name} has no {spec.dtype} support"
        return None

    def busy_reason(self, limits: BusyLimits | None = None) -> str | None:
        limits = limits or BusyLimits()
        if self.cfg.busy:
            return "other_processes"
        if self.cfg.other_utilization and self.cfg.other_utilization >= limits.utilization:
            return "utilization"
        if self.cfg.other_memory_mb and limits.memory_bytes and \
                self.cfg.other_memory_mb << 20 >= limits.memory_bytes:
            return "other_memory"
        return None

    def _allocate(self, spec: ProbeSpec) -> None:
        pass  # simulated: no buffers

    def run(self, spec: ProbeSpec, iterations: int, cancel: threading.Event) -> list[float]:
        with self._lock:
            self._calls += 1
            call = self._calls
        if self._closed.is_set():
            raise DeviceError(f"fake GPU {self.info.index}: device closed")
        if self.cfg.fail_on_call and call >= self.cfg.fail_on_call:
            raise DeviceError(f"fake GPU {self.info.index}: injected failure on call {call} "
                              "(CUDA_ERROR_LAUNCH_FAILED)")
        if self.cfg.fault_on_call and (call >= self.cfg.fault_on_call or self._faulted):
            self._faulted = True  # like a poisoned CUDA context: every later call fails
            raise DeviceFault(f"fake GPU {self.info.index}: run: CUDARuntimeError: "
                              "cudaErrorIllegalAddress: an illegal memory access was "
                              "encountered")
        if self.cfg.hang_on_call and call == self.cfg.hang_on_call:
            self._closed.wait()  # a real hang ignores cancellation; only close() ends it
            raise DeviceError(f"fake GPU {self.info.index}: hung probe abandoned")
        base, util = simulated_runtime(self.model, spec)
        fx = self._fault(util, spec)
        self._effect = fx
        run_factor = float(np.exp(self._rng.normal(0.0, self._jitter))) if self._jitter else 1.0
        times = base * self._offset * fx.time * run_factor * np.exp(
            self._rng.normal(0.0, self._noise, size=iterations))
        total = float(times.sum())
        self._util = util
        power = min(self._power_for(util, 1.0, spec) * fx.power,
                    fx.limit or self.model.tdp_w)
        with self._lock:
            self._advance(total, power)
        return times.tolist()

    def run_observed(self, spec: ProbeSpec, iterations: int, cancel: threading.Event, *,
                     max_s: float | None = None, min_iters: int = 1) -> Run:
        """Counter steps inside the run, as a host polling every ~1 ms would see them. The
        simulated GEMMs run the iterations asked for (the time bound is the NVIDIA
        backend's)."""
        e0, start = self.energy_j(), self.clock()
        times = self.run(spec, iterations, cancel)
        e1, end = self.energy_j(), self.clock()
        first = math.floor((start - self._start) / _ENERGY_STEP_S) + 1
        steps = []
        with self._lock:
            j = first
            while (b := self._start + j * _ENERGY_STEP_S) <= end:
                latency = float(self._poll_rng.uniform(0.0, 0.001))
                steps.append((b + latency, self._energy_at(b)))
                j += 1
        return Run(times, start, end, e0, e1, steps)

    def _power_for(self, util: float, slow: float, spec: ProbeSpec, noise: bool = True
                   ) -> float:
        m = self.model
        dyn = (m.tdp_w - m.idle_w) * (0.25 + 0.75 * util)
        if spec.dtype in ("fp16", "bf16", "fp8"):
            dyn *= 0.92  # narrower datapaths toggle fewer bits per FLOP
        # A throttled card (slow > 1) runs at lower clocks and draws somewhat less.
        p = m.idle_w + dyn / slow**0.5
        if noise:
            p *= float(np.exp(self._rng.normal(0.0, self._noise / 2)))
        return min(p, m.tdp_w)

    def energy_j(self) -> float | None:
        """Counter as NVML reports it: the exact energy at the last 100 ms step boundary."""
        with self._lock:
            now = self.clock()
            b = self._start + math.floor((now - self._start) / _ENERGY_STEP_S) * _ENERGY_STEP_S
            return self._energy_at(b)

    def _energy_at(self, t: float) -> float:
        pts = self._points
        if t >= self._energy_t:  # idle since the last run
            return self._energy + self.model.idle_w * (t - self._energy_t)
        i = bisect.bisect_right(pts, (t, math.inf))  # first breakpoint after t
        if i == 0:
            return pts[0][1] if pts else 0.0
        (t0, e0), (t1, e1) = pts[i - 1], pts[min(i, len(pts) - 1)]
        return e0 if t1 <= t0 else e0 + (e1 - e0) * (t - t0) / (t1 - t0)

    def power_w(self) -> float | None:
        return self._power

    def context(self) -> dict[str, Any]:
        fx = self._effect  # as the last probe ran
        return {
            "sm_clock_hz": self.model.sm_clock_hz * fx.clock,
            "mem_clock_hz": self.model.mem_clock_hz,
            "temperature_c": 35.0 + 45.0 * self._util + fx.hotter,
            "power_limit_w": fx.limit or self.model.tdp_w,
            "clock_event_reasons": list(fx.reasons),
            "pstate": 0,
            "other_processes": 1 if self.cfg.busy else 0,
        }

    def check(self, spec: ProbeSpec) -> tuple[bool, float]:
        # The fake computes nothing; a slowed card still computes correctly.
        return True, 0.0

    def close(self) -> None:
        self._closed.set()
