"""Probe specs, the probe plan and the measurement protocol.

A probe is one GEMM configuration run back to back for a timed window. The protocol
(warm-up, window sized from the warm-up, energy-counter delta over the window) is written
once here against the Device primitives so that every backend measures the same way.
"""

from __future__ import annotations

import dataclasses
import math
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from gemmd.errors import DeviceError, ProbeCancelled
from gemmd.gemm import ProbeSpec

if TYPE_CHECKING:
    from gemmd.config import ExplorationConfig, MeasureConfig, ProbeGroup
    from gemmd.devices.base import Device




def _expand(shapes: Iterable[tuple[int, int, int]], dtypes: Sequence[str],
            kernels: Sequence[str], tiles: Sequence[int], layouts: Sequence[str]
            ) -> list[ProbeSpec]:
    out = []
    for (m, n, k) in shapes:
        for dtype in dtypes:
            for kernel in kernels:
                for tile in (tiles if kernel == "tiled" else (0,)):
                    # The tiled kernel reads row-major A and B only (as in the paper).
                    for layout in (layouts if kernel == "blas" else ("nn",)):
                        out.append(ProbeSpec(m, n, k, dtype, kernel, tile, layout))
    return out


def build_plan(groups: Sequence[ProbeGroup], device: Device) -> tuple[list[ProbeSpec],
                                                                       dict[ProbeSpec, str]]:
    """Sentinel probes for one device: (runnable specs in order, {dropped spec: reason})."""
    plan: list[ProbeSpec] = []
    dropped: dict[ProbeSpec, str] = {}
    for g in groups:
        if g.backends and device.info.backend not in g.backends:
            continue
        for spec in _expand(g.shapes, g.dtypes, g.kernels, g.tiles, g.layouts):
            if spec in plan or spec in dropped:
                continue
            reason = device.unsupported_reason(spec)
            if reason:
                dropped[spec] = reason
            else:
                plan.append(spec)
    return plan, dropped


def exploration_specs(groups: Sequence[ExplorationConfig], device: Device,
                      rng: np.random.Generator) -> list[ProbeSpec]:
    """Random supported specs for this round from every group that applies to the device."""
    out: list[ProbeSpec] = []
    for g in groups:
        if not g.backends or device.info.backend in g.backends:
            out.extend(_explore(g, device, rng))
    return out


def _explore(cfg: ExplorationConfig, device: Device, rng: np.random.Generator
             ) -> list[ProbeSpec]:
    """Draw ``per_round`` random supported specs, shapes log-uniform in the configured ranges."""
    out: list[ProbeSpec] = []
    for _ in range(cfg.per_round * 10):  # bounded retries when many draws are unsupported
        if len(out) >= cfg.per_round:
            break
        m, n, k = (_draw_dim(rng, lo, hi, cfg.align) for lo, hi in (cfg.m, cfg.n, cfg.k))
        kernel = str(rng.choice(cfg.kernels))
        spec = ProbeSpec(m, n, k, dtype=str(rng.choice(cfg.dtypes)), kernel=kernel,
                         tile=int(rng.choice(cfg.tiles)) if kernel == "tiled" else 0,
                         layout=str(rng.choice(cfg.layouts)) if kernel == "blas" else "nn")
        if device.unsupported_reason(spec) is None:
            out.append(spec)
    return out


def _draw_dim(rng: np.random.Generator, lo: int, hi: int, align: int) -> int:
    v = math.exp(rng.uniform(math.log(lo), math.log(hi)))
    v = round(v / align) * align
    return int(min(max(v, lo), hi)) or lo


# ------------------------------------------------------------------ measurement


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


def iterations_for_window(per_iter_s: float, window_s: float, min_iters: int,
                          max_iters: int) -> int:
    """Iterations needed to fill ``window_s`` at ``per_iter_s`` each, within the bounds."""
    if not math.isfinite(per_iter_s):  # infinitely slow (or NaN): as few as allowed
        return min_iters
    if per_iter_s <= 0:
        return max_iters
    return int(min(max(math.ceil(window_s / per_iter_s), min_iters), max_iters))


def iteration_stats(times: Sequence[float]) -> dict[str, float]:
    t = np.asarray(times, dtype=np.float64)
    mean = float(t.mean())
    return {"runtime_s": float(np.median(t)), "runtime_mean_s": mean,
            "runtime_min_s": float(t.min()), "runtime_p90_s": float(np.percentile(t, 90)),
            "runtime_cv": float(t.std() / mean) if mean > 0 else 0.0}


def energy_figures(e0: float | None, e1: float | None, window_s: float, iterations: int
                   ) -> tuple[float | None, float | None]:
    """(energy per GEMM, average power) from two counter reads; None when unavailable.

    A counter that did not move (or went backwards: reset, wrap not handled by the
    device) yields None rather than a zero or negative figure.
    """
    if e0 is None or e1 is None or window_s <= 0 or iterations <= 0:
        return None, None
    delta = e1 - e0
    if delta <= 0:
        return None, None
    return delta / iterations, delta / window_s


def power_between_steps(steps: Sequence[tuple[float, float]], window_s: float
                        ) -> float | None:
    """Average power between the first and last observed counter steps of a busy window.

    NVML's counter moves in ~100 ms steps, so a window read at arbitrary times carries up to
    a step of error at each end (about +-10% on a 1 s window). Between two observed steps
    the energy is exact and only the host's polling latency (~1 ms) errs. Needs the steps
    to span at least half of the window; else None (use the window delta).
    """
    if len(steps) < 2:
        return None
    (ta, ea), (tb, eb) = steps[0], steps[-1]
    if tb - ta < 0.5 * window_s or eb <= ea:
        return None
    return (eb - ea) / (tb - ta)


def measure(device: Device, spec: ProbeSpec, cfg: MeasureConfig, *, check: bool = False,
            cancel: threading.Event | None = None) -> Measurement:
    """Run the measurement protocol for one spec on one device.

    Raises DeviceError (device failed), UnsupportedProbe (e.g. over the memory budget) or
    ProbeCancelled (shutdown requested mid-probe; nothing is recorded).
    """
    cancel = cancel or threading.Event()
    started = device.clock()
    device.prepare(spec)
    # Warm-up: at least warmup_iters and warmup_s of device time; its median sizes the window.
    # Batches double so that a microsecond GEMM does not cost thousands of host round trips.
    warm: list[float] = []
    batch = 1
    while len(warm) < cfg.warmup_iters or sum(warm) < cfg.warmup_s:
        warm.extend(device.run(spec, batch, cancel))
        batch = min(batch * 2, cfg.max_iters)
        if cancel.is_set():
            raise ProbeCancelled(spec.name)
    iters = iterations_for_window(float(np.median(warm)), cfg.window_s, cfg.min_iters,
                                  cfg.max_iters)
    ctx_before = device.context()
    run = device.run_observed(spec, iters, cancel)
    power_sample = device.power_w()
    if cancel.is_set():
        raise ProbeCancelled(spec.name)
    if not run.times:
        raise DeviceError(f"{spec.name}: the device ran no GEMM in the window")
    ctx_after = device.context()
    iters, window = len(run.times), run.t1 - run.t0
    energy, power = energy_figures(run.e0, run.e1, window, iters)
    method = "window" if energy is not None else None
    step_power = power_between_steps(run.steps, window)
    if step_power is not None:
        # Exact counter values at two observed steps while busy: no partial-step error.
        power, energy, method = step_power, step_power * float(np.mean(run.times)), "steps"
    ctx_after = dict(ctx_after, energy_method=method)
    st = iteration_stats(run.times)
    m = Measurement(spec=spec, iterations=iters, window_s=window, energy_j=energy,
                    power_w=power, power_sample_w=power_sample,
                    context={"before": ctx_before, "after": ctx_after},
                    runtime_s=st["runtime_s"], runtime_mean_s=st["runtime_mean_s"],
                    runtime_min_s=st["runtime_min_s"], runtime_p90_s=st["runtime_p90_s"],
                    runtime_cv=st["runtime_cv"])
    if check:
        m.check_ok, m.check_error = device.check(spec)
    m.elapsed_s = max(0.0, device.clock() - started)
    return m


def as_row(m: Measurement) -> dict[str, Any]:
    """Flatten a measurement for the store."""
    d = dataclasses.asdict(m)
    spec = d.pop("spec")
    d.update(spec)
    return d


# ------------------------------------------------------------- correctness check

# Unit roundoff of input rounding, output rounding and accumulation per dtype. tf32 rounds
# its fp32 inputs to a 10-bit mantissa; 16-bit and fp8 GEMMs accumulate in fp32.
_ROUNDOFF = {  # dtype: (u_in, u_out, u_acc)
    "fp64": (0.0, 1.1e-16, 1.1e-16),
    "fp32": (0.0, 6.0e-8, 6.0e-8),
    "tf32": (4.9e-4, 6.0e-8, 6.0e-8),
    "fp16": (0.0, 4.9e-4, 6.0e-8),
    "bf16": (0.0, 3.9e-3, 6.0e-8),
    "fp8": (0.0, 3.9e-3, 6.0e-8),
}


def check_tolerance(dtype: str, k: int) -> float:
    """Bound on |C - ref| / (|A| @ |B|) for a healthy GEMM (a worst-case, not typical, bound)."""
    u_in, u_out, u_acc = _ROUNDOFF[dtype]
    return 2.0 * (2 * u_in + u_out) + k * u_acc


def check_result(c: np.ndarray, ref: np.ndarray, abs_ref: np.ndarray, dtype: str, k: int
                 ) -> tuple[bool, float]:
    """Compare sampled output entries with a float64 reference.

    ``abs_ref`` is (|A| @ |B|) on the same entries, which scales the error so one tolerance
    fits every input magnitude. Returns (ok, worst scaled error); NaN/Inf output fails.
    """
    c = np.asarray(c, dtype=np.float64)
    if not np.all(np.isfinite(c)):
        return False, float("inf")
    scale = np.maximum(np.asarray(abs_ref, dtype=np.float64), np.finfo(np.float64).tiny)
    err = float(np.max(np.abs(c - ref) / scale)) if c.size else 0.0
    return err <= check_tolerance(dtype, k), err
