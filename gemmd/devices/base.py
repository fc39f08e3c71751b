"""The narrow Device interface every backend implements.

Units are SI at this boundary: seconds, joules, watts, hertz, bytes, FLOP/s.
"""

from __future__ import annotations

import abc
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from gemmd.errors import UnsupportedProbe
from gemmd.gemm import ProbeSpec
from gemmd.probes import Measurement

if TYPE_CHECKING:
    from gemmd.config import MeasureConfig


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

    def run_observed(self, spec: ProbeSpec, iterations: int, cancel: threading.Event) -> Run:
        """Like run(), with the energy counter read around the work and, where the device
        can watch it, its steps during the work. A device may round ``iterations`` up (to
        whole chunks); len(Run.times) is what ran."""
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
        from gemmd.probes import measure

        return measure(self, spec, cfg, check=check, cancel=cancel)

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release buffers and handles."""
