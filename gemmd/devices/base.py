"""The narrow Device interface every backend implements, and the measurement protocol.

Units are SI at this boundary: seconds, joules, watts, hertz, bytes, FLOP/s.

A probe is one GEMM configuration run back to back for a timed window. The protocol
(warm-up, window sized from the warm-up, energy-counter delta over the window) is written
once here against the Device primitives so that every backend measures the same way.
"""

from __future__ import annotations

import abc
import math
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gemmd.config import MeasureConfig
from gemmd.errors import DeviceError, ProbeCancelled, UnsupportedProbe
from gemmd.gemm import ProbeSpec
from gemmd.records import DeviceInfo, Measurement

# A warm-up call runs at most this many times the GEMMs run before it: a 0.2 ms GEMM, or
# a chunk of small ones (the NVIDIA backend's first call runs ~0.2 ms of them), reaches a
# 20 ms warm-up in two calls; a timer's glitch costs at most this many GEMMs.
_WARMUP_GROWTH = 128
# Iterations asked of a time-bounded window beyond the warm-up's pace (bounds_window).
_WINDOW_HEADROOM = 2.0


@dataclass(frozen=True)
class BusyLimits:
    """When probing would disturb other work on a device (schedule.busy_* in the config)."""

    utilization: float = 0.10  # the device's utilization over the last sample period
    memory_bytes: int = 256 << 20  # device memory held by other processes


@dataclass
class Run:
    """What one back-to-back run of a GEMM observed, on the device's clock().

    ``t0``/``e0`` are read just before the first GEMM is issued and ``t1``/``e1`` just after
    the last one finished, so the window holds the work and nothing else; ``steps`` are the
    energy counter's changes seen between them, as (clock(), joules).
    """

    times: list[float]  # device seconds per GEMM
    t0: float
    t1: float
    e0: float | None = None
    e1: float | None = None
    steps: list[tuple[float, float]] = field(default_factory=list)


class BufferCache:
    """A device's input/output buffers per shape, within a byte budget: the least recently
    used shapes are dropped to make room for a new one."""

    def __init__(self, budget: int):
        self.budget = budget
        self._items: OrderedDict[tuple, tuple[Any, int]] = OrderedDict()

    def get(self, key: tuple) -> Any:
        """The buffers of ``key`` (now most recently used), or None."""
        if key not in self._items:
            return None
        self._items.move_to_end(key)
        return self._items[key][0]

    def make_room(self, nbytes: int) -> int:
        """Drop least recently used buffers until ``nbytes`` more fit (before allocating);
        how many were dropped (a GPU backend then returns their memory to the driver)."""
        dropped = 0
        while self._items and nbytes + sum(n for _, n in self._items.values()) > self.budget:
            self._items.popitem(last=False)
            dropped += 1
        return dropped

    def put(self, key: tuple, buffers: Any, nbytes: int) -> None:
        self._items[key] = (buffers, nbytes)

    def __getitem__(self, key: tuple) -> Any:
        return self._items[key][0]

    def values(self) -> list[Any]:
        return [b for b, _ in self._items.values()]

    def clear(self) -> None:
        self._items.clear()


def over_budget(spec: ProbeSpec, budget: int) -> str | None:
    need = spec.buffer_bytes
    if need > budget:
        return f"needs {need / 2**20:.0f} MiB, over the memory budget of {budget / 2**20:.0f} MiB"
    return None


class Device(abc.ABC):
    """One probe-able device. Methods may raise DeviceError; none may hang forever on close.

    A backend implements ``_unsupported`` (what it cannot run) and ``_allocate`` (its
    buffers); the memory-budget check and the order of prepare() are written once here.
    """

    info: DeviceInfo
    memory_budget: int = 0
    # Whether run_observed() ends the window itself once ``max_s`` of GEMMs are queued
    # (the NVIDIA backend): measure() then asks it for more GEMMs than the warm-up's pace
    # says, and the time bound, not the count, decides the window's length.
    bounds_window: bool = False

    def unsupported_reason(self, spec: ProbeSpec) -> str | None:
        """Why this device cannot run ``spec`` (dtype, kernel, memory budget), or None."""
        return self._unsupported(spec) or over_budget(spec, self.memory_budget)

    def _unsupported(self, spec: ProbeSpec) -> str | None:
        """What this backend cannot run, whatever the budget (dtype, kernel, limits)."""
        raise NotImplementedError

    def _allocate(self, spec: ProbeSpec) -> None:
        """Make (or reuse) random input and output buffers for a supported ``spec``."""
        raise NotImplementedError

    @abc.abstractmethod
    def busy_reason(self, limits: BusyLimits | None = None) -> str | None:
        """Why probing now would disturb other work ("other_processes", "utilization",
        "other_memory", "host_busy"), or None."""

    def prepare(self, spec: ProbeSpec) -> None:
        """Allocate (or reuse) random input buffers for ``spec`` within the memory budget;
        UnsupportedProbe, with the reason, for a spec this device cannot run."""
        reason = self.unsupported_reason(spec)
        if reason:
            raise UnsupportedProbe(f"{spec.name}: {reason}")
        self._allocate(spec)

    @abc.abstractmethod
    def run(self, spec: ProbeSpec, iterations: int, cancel: threading.Event) -> list[float]:
        """Run ``iterations`` GEMMs back to back; per-iteration device time in seconds.

        Returns early (fewer times) when ``cancel`` is set.
        """

    def run_observed(self, spec: ProbeSpec, iterations: int, cancel: threading.Event, *,
                     max_s: float | None = None, min_iters: int = 1) -> Run:
        """Like run(), with the energy counter read around the work and, where the device
        can watch it, its steps during the work. A device may round ``iterations`` up (to
        whole chunks); len(Run.times) is what ran. A device that sees its progress while
        it works (the NVIDIA backend) also stops once ``max_s`` seconds of GEMMs are
        queued, but not before ``min_iters`` GEMMs; the others, which time each GEMM as it
        ends, run the iterations."""
        e0, t0 = self.energy_j(), self.clock()
        times = self.run(spec, iterations, cancel)
        e1, t1 = self.energy_j(), self.clock()
        return Run(times, t0, t1, e0, e1)

    @abc.abstractmethod
    def clock(self) -> float:
        """Monotonic seconds on the same time base as the energy counter."""

    @abc.abstractmethod
    def energy_j(self) -> float | None:
        """Monotonic energy counter in joules, or None when the device has none."""

    @abc.abstractmethod
    def power_w(self) -> float | None:
        """Instantaneous power in watts, or None."""

    @abc.abstractmethod
    def context(self) -> dict[str, Any]:
        """Clocks (Hz), temperature (C), power limit (W), throttle reasons, P-state..."""

    @abc.abstractmethod
    def check(self, spec: ProbeSpec) -> tuple[bool, float]:
        """Compare the last output of ``spec`` with a reference: (ok, worst scaled error)."""

    def measure(self, spec: ProbeSpec, cfg: MeasureConfig, *, check: bool = False,
                cancel: threading.Event | None = None) -> Measurement:
        """Run the measurement protocol here (a worker-process device runs it remotely)."""
        return measure(self, spec, cfg, check=check, cancel=cancel)

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release buffers and handles."""


# ------------------------------------------------------------------ measurement


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
    prepared = device.clock()
    # Warm-up: at least warmup_iters and warmup_s of device time, in as few calls as it
    # can (each cost the H200 ~26 ms of host time: doubling batches made 4-7 calls of a
    # 0.2-1.6 ms GEMM). One GEMM first, as it may run cold; then what is still needed at
    # the median so far, but at most _WARMUP_GROWTH times the GEMMs run so far (a glitch
    # of the timer must not buy seconds of GEMMs); no more than needed (a 21 ms
    # GEMM ran 3 for a warm-up of 2 GEMMs and 20 ms). A device whose GEMMs take no time
    # at all stops after max_iters of them.
    warm: list[float] = []
    batch = 1
    while len(warm) < cfg.warmup_iters or (sum(warm) < cfg.warmup_s and
                                           len(warm) < cfg.max_iters):
        warm.extend(device.run(spec, batch, cancel))
        if cancel.is_set():
            raise ProbeCancelled(spec.name)
        per, done = (float(np.median(warm)), sum(warm)) if warm else (0.0, 0.0)
        # (10% over what the median says: noisy times must not leave a call of 3 GEMMs)
        by_time = math.ceil(1.1 * (cfg.warmup_s - done) / per) \
            if per > 0 and math.isfinite(per) and math.isfinite(done) else batch * 2
        batch = max(1, min(len(warm) * _WARMUP_GROWTH, cfg.max_iters,
                           max(cfg.warmup_iters - len(warm), by_time)))
    # The window is sized on the warm-up's later half: its first GEMMs may run cold (with
    # two warm-up GEMMs, the median of both sized a CPU probe's 0.1 s window at 21 ms, 8
    # GEMMs of 0.2 ms, after a 56 ms warm-up; tests/test_probes.py, a 100x cold call).
    # A device that bounds the window by time is asked for _WINDOW_HEADROOM times that:
    # on the H100 the fp32 sentinel's warm-up ran on clocks still recovering from the
    # power-capped bf16 probe before it, and its 0.5 s windows ran out of GEMMs at
    # 0.38-0.49 s (bench/results/2026-11-26-h100).
    headroom = _WINDOW_HEADROOM if device.bounds_window else 1.0
    iters = iterations_for_window(float(np.median(warm[len(warm) // 2:])),
                                  headroom * cfg.window_s, cfg.min_iters, cfg.max_iters)
    warmed = device.clock()
    ctx_before = device.context()
    run = device.run_observed(spec, iters, cancel, max_s=cfg.window_s,
                              min_iters=cfg.min_iters)
    power_sample = device.power_w()
    if cancel.is_set():
        raise ProbeCancelled(spec.name)
    if not run.times:
        raise DeviceError(f"{spec.name}: the device ran no GEMM in the window")
    if not all(0 < x < math.inf for x in run.times):  # NaN fails too
        bad = next(x for x in run.times if not 0 < x < math.inf)
        raise DeviceError(f"{spec.name}: the device timed a GEMM of the window at {bad!r} s "
                          "(a broken timer): nothing recorded")
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
    before_check = device.clock()
    if check:
        m.check_ok, m.check_error = device.check(spec)
    m.elapsed_s = max(0.0, device.clock() - started)
    # Where the probe's device time went beyond its window (device clock, seconds): what a
    # plan's cost is made of (bench/drift.py --measure-plan).
    m.context["phases"] = {
        "prepare_s": prepared - started, "warmup_s": warmed - prepared,
        "before_window_s": run.t0 - warmed, "window_s": window,
        "after_window_s": before_check - run.t1,
        "check_s": started + m.elapsed_s - before_check}
    return m
