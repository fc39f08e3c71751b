"""CPU backend: NumPy/BLAS GEMMs, energy from Linux RAPL powercap files where readable.

Peak FLOP/s is an estimate from core count, maximum frequency and SIMD width; it only
serves the roofline prediction used before the model has data.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from gemmd.devices.base import BufferCache, BusyLimits, Device
from gemmd.devices.check import check_result
from gemmd.errors import DeviceError
from gemmd.gemm import ProbeSpec
from gemmd.records import DeviceInfo

logger = logging.getLogger(__name__)

_NP_DTYPE = {"fp32": np.float32, "fp64": np.float64}
_CHECK_ROWS = 8


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


class Rapl:
    """Sum of the package-level RAPL energy counters, wrap-corrected, in joules."""

    def __init__(self, root: str | Path = "/sys/class/powercap"):
        self.domains: list[tuple[Path, float]] = []
        self.unavailable_reason: str | None = None
        rootp = Path(root)
        pkgs = sorted(p for p in rootp.glob("intel-rapl:*") if p.name.count(":") == 1)
        if not pkgs:
            self.unavailable_reason = f"no RAPL package domains under {rootp}"
            return
        for p in pkgs:
            energy = p / "energy_uj"
            try:
                energy.read_text()
            except OSError as e:
                self.unavailable_reason = f"{energy} is not readable ({e.strerror})"
                self.domains = []
                return
            max_range = _read(p / "max_energy_range_uj")
            self.domains.append((energy, float(max_range) if max_range else 0.0))
        self._last: list[float] = [self._raw(p) for p, _ in self.domains]
        self._total = 0.0
        self._lock = threading.Lock()

    @staticmethod
    def _raw(path: Path) -> float:
        return float(path.read_text())

    def read_j(self) -> float | None:
        if not self.domains:
            return None
        with self._lock:
            for i, (path, max_range) in enumerate(self.domains):
                try:
                    v = self._raw(path)
                except (OSError, ValueError):
                    return None
                d = v - self._last[i]
                if d < 0:  # the counter wrapped
                    d += max_range
                self._last[i] = v
                self._total += d
            return self._total / 1e6


def _cpu_model() -> str:
    for line in (_read(Path("/proc/cpuinfo")) or "").splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine() or "cpu"


def _flags() -> set[str]:
    for line in (_read(Path("/proc/cpuinfo")) or "").splitlines():
        if line.startswith(("flags", "Features")):
            return set(line.split(":", 1)[1].split())
    return set()


def estimate_peak_flops(cores: int, hz: float, flags: set[str]) -> dict[str, float]:
    """fp32/fp64 FLOP/s from SIMD width: two FMA pipes x lanes x 2 FLOP per FMA."""
    if "avx512f" in flags:
        lanes32 = 16
    elif "avx2" in flags and "fma" in flags:
        lanes32 = 8
    elif "asimd" in flags or "sse2" in flags:
        lanes32 = 4
    else:
        lanes32 = 1
    fp32 = cores * hz * 2 * lanes32 * 2
    return {"fp32": fp32, "fp64": fp32 / 2}


def _max_hz() -> float:
    khz = _read(Path("/sys/devices/system/cpu/cpu0/cpufreq/cpuinfo_max_freq"))
    if khz:
        return float(khz) * 1e3
    for line in (_read(Path("/proc/cpuinfo")) or "").splitlines():
        if line.startswith("cpu MHz"):
            return float(line.split(":", 1)[1]) * 1e6
    return 2.5e9


def _proc_stat_jiffies(text: str) -> tuple[int, int] | None:
    """(busy, total) jiffies of all CPUs from /proc/stat's first line."""
    for line in text.splitlines():
        if line.startswith("cpu "):
            v = [int(x) for x in line.split()[1:]]
            idle = v[3] + (v[4] if len(v) > 4 else 0)  # idle + iowait
            total = sum(v[:8])  # guest time is already inside user
            return total - idle, total
    return None


def others_cpu_fraction(interval: float) -> float | None:
    """Share of all cores used by other processes over ``interval`` seconds, or None."""
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    a = _proc_stat_jiffies(_read(Path("/proc/stat")) or "")
    own0 = sum(os.times()[:2])
    time.sleep(interval)
    b = _proc_stat_jiffies(_read(Path("/proc/stat")) or "")
    own1 = sum(os.times()[:2])
    if a is None or b is None or b[1] <= a[1]:
        return None
    busy = (b[0] - a[0]) - (own1 - own0) * tick
    return max(0.0, busy / (b[1] - a[1]))


HOST_BUSY = 0.9  # fraction of all cores used by other processes


class CpuDevice(Device):
    def __init__(self, *, memory_budget: int = 2 << 30, seed: int = 0,
                 powercap_root: str | Path = "/sys/class/powercap"):
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (
            os.cpu_count() or 1)
        self._cores = cores
        name = _cpu_model()
        mid = _read(Path("/etc/machine-id")) or platform.node()
        uid = hashlib.sha1(f"{mid}-{name}".encode()).hexdigest()
        self.info = DeviceInfo(
            index=0, uuid=f"CPU-{uid[:8]}-{uid[8:12]}", name=name, backend="cpu",
            peak_flops=estimate_peak_flops(cores, _max_hz(), _flags()),
            mem_bandwidth=10e9 * min(cores, 8),  # rough; used only for the roofline estimate
            memory_bytes=None, extra={"cores": cores, "peak": "estimated"})
        self.memory_budget = memory_budget
        self._rng = np.random.default_rng(seed)
        self._buffers = BufferCache(memory_budget)
        self.rapl = Rapl(powercap_root)
        if self.rapl.unavailable_reason:
            logger.info("CPU energy unavailable: %s; no power/energy series will be exported",
                        self.rapl.unavailable_reason)

    def _unsupported(self, spec: ProbeSpec) -> str | None:
        if spec.kernel != "blas":
            return f"kernel {spec.kernel} needs a GPU"
        if spec.dtype not in _NP_DTYPE:
            return f"{spec.dtype} has no BLAS on the CPU (fp32, fp64 only)"
        return None

    def busy_reason(self, limits: BusyLimits | None = None) -> str | None:
        """"host_busy" when other processes used nearly all the cores (HOST_BUSY, 90%) in
        the last 0.3 s: then a probe would time the contention, not the BLAS. Below that a
        probe (a second of one BLAS call) costs others little; at half the cores, as before,
        a shared 2-core machine skipped most rounds.

        Measured, not the load average: that lags by minutes and counts our own probes.
        """
        others = others_cpu_fraction(0.3)
        return "host_busy" if others is not None and others > HOST_BUSY else None

    def _key(self, spec: ProbeSpec) -> tuple:
        return (spec.m, spec.n, spec.k, spec.dtype, spec.layout)

    def _allocate(self, spec: ProbeSpec) -> None:
        key = self._key(spec)
        if self._buffers.get(key) is not None:
            return
        need = spec.buffer_bytes
        self._buffers.make_room(need)
        dt = _NP_DTYPE[spec.dtype]
        # Random inputs, never zeros; stored transposed where the layout says so.
        a = self._rng.standard_normal((spec.k, spec.m) if spec.layout[0] == "t"
                                      else (spec.m, spec.k)).astype(dt)
        b = self._rng.standard_normal((spec.n, spec.k) if spec.layout[1] == "t"
                                      else (spec.k, spec.n)).astype(dt)
        c = np.empty((spec.m, spec.n), dtype=dt)
        self._buffers.put(key, (a, b, c), need)

    def _operands(self, spec: ProbeSpec) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        try:
            a, b, c = self._buffers[self._key(spec)]
        except KeyError:
            raise DeviceError(f"{spec.name}: run before prepare") from None
        return (a.T if spec.layout[0] == "t" else a), (b.T if spec.layout[1] == "t" else b), c

    def run(self, spec: ProbeSpec, iterations: int, cancel: threading.Event) -> list[float]:
        a, b, c = self._operands(spec)
        times = []
        try:
            for _ in range(iterations):
                t0 = time.perf_counter()
                np.matmul(a, b, out=c)
                times.append(time.perf_counter() - t0)
                if cancel.is_set():
                    break
        except (MemoryError, ValueError) as e:
            raise DeviceError(f"{spec.name}: {e}") from e
        return times

    def clock(self) -> float:
        return time.monotonic()

    def energy_j(self) -> float | None:
        return self.rapl.read_j()

    def power_w(self) -> float | None:
        return None

    def context(self) -> dict[str, Any]:
        ctx: dict[str, Any] = {}
        khz = _read(Path("/sys/devices/system/cpu/cpu0/cpufreq/scaling_cur_freq"))
        if khz:
            ctx["sm_clock_hz"] = float(khz) * 1e3
        try:
            ctx["load1"] = os.getloadavg()[0]
        except OSError:
            pass
        return ctx

    def check(self, spec: ProbeSpec) -> tuple[bool, float]:
        a, b, c = self._operands(spec)
        rows = self._rng.choice(spec.m, size=min(_CHECK_ROWS, spec.m), replace=False)
        a64 = np.asarray(a[rows], dtype=np.float64)
        b64 = np.asarray(b, dtype=np.float64)
        return check_result(c[rows], a64 @ b64, np.abs(a64) @ np.abs(b64), spec.dtype, spec.k)

    def close(self) -> None:
        self._buffers.clear()
