"""The one boundary to NVML: discovery and telemetry, in SI units, errors translated.

The pynvml module is injected (the real one by default) so that tests drive this code with
a fake module. Every NVML error becomes a gemmd error here, with the NVML cause kept.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from gemmd.errors import DeviceError, DeviceUnavailable
from gemmd.gpulibs import import_gpu_library
from gemmd.records import CLOCK_EVENT_REASONS

# nvml.h constants gemmd uses; the contract tests compare them with pynvml's.
_CLOCK_SM, _CLOCK_MEM, _TEMP_GPU = 1, 2, 0  # NVML_CLOCK_SM, NVML_CLOCK_MEM, NVML_TEMPERATURE_GPU
_ERROR_GPU_IS_LOST, _ERROR_NOT_SUPPORTED = 15, 3


def decode_reasons(mask: int) -> list[str]:
    """Names of the clock-event reason bits set in ``mask`` (unknown bits as hex)."""
    out = [name for bit, name in CLOCK_EVENT_REASONS.items() if mask & bit]
    unknown = mask & ~sum(CLOCK_EVENT_REASONS)
    if unknown:
        out.append(f"unknown_{unknown:#x}")
    return out


def parse_visible_devices(value: str | None) -> list[str] | None:
    """CUDA_VISIBLE_DEVICES entries (indices or UUID prefixes); None = every device.

    CUDA stops at the first invalid entry; so do we. An empty string hides every device.
    """
    if value is None:
        return None
    out = []
    for tok in value.split(","):
        tok = tok.strip()
        if not tok:
            break
        if tok.isdigit() or tok.startswith(("GPU-", "MIG-")):
            out.append(tok)
        else:
            break
    return out


@dataclass(frozen=True)
class GpuRecord:
    """What discovery learns about one GPU (no CUDA needed)."""

    index: int  # NVML index
    uuid: str
    name: str
    pci_bus_id: str
    compute_capability: tuple[int, int]
    memory_bytes: int
    power_limit_w: float | None
    max_sm_clock_hz: float | None
    max_mem_clock_hz: float | None = None
    mem_bus_width_bits: int | None = None
    mig_enabled: bool = False
    mig_instances: list[str] = field(default_factory=list)  # MIG UUIDs
    # What the runbook suspects first when a GPU drifts: a driver or firmware change.
    driver_version: str = ""
    cuda_driver_version: str = ""  # e.g. "13.0"
    vbios_version: str = ""


class Nvml:
    """A narrow NVML interface: discovery, energy, power, context, processes."""

    def __init__(self, module: ModuleType | None = None):
        self.nv: Any = module if module is not None else import_gpu_library("pynvml", "pynvml")
        try:
            self.nv.nvmlInit()
        except self.nv.NVMLError as e:
            raise DeviceUnavailable(f"NVML cannot start: {e}") from e

    @contextlib.contextmanager
    def errors(self, what: str) -> Iterator[None]:
        """Translate NVML errors raised inside into DeviceError, naming ``what``."""
        try:
            yield
        except self.nv.NVMLError as e:
            lost = getattr(e, "value", None) == _ERROR_GPU_IS_LOST
            raise DeviceError(f"{what}: {'GPU is lost: ' if lost else ''}NVML: {e}") from e

    def _optional(self, fn, *args: Any) -> Any:
        """An NVML query some GPUs or drivers don't support: None instead of an error."""
        try:
            return fn(*args)
        except self.nv.NVMLError as e:
            if getattr(e, "value", None) == _ERROR_GPU_IS_LOST:
                raise DeviceError(f"GPU is lost: NVML: {e}") from e
            return None

    def discover(self) -> list[GpuRecord]:
        nv = self.nv
        out = []
        with self.errors("NVML discovery"):
            count = nv.nvmlDeviceGetCount()
        driver = self._optional(nv.nvmlSystemGetDriverVersion)
        cuda = self._optional(nv.nvmlSystemGetCudaDriverVersion_v2)  # 13000 -> "13.0"
        for i in range(count):
            with self.errors(f"GPU {i}"):
                h = nv.nvmlDeviceGetHandleByIndex(i)
                pci = nv.nvmlDeviceGetPciInfo(h)
                bus = _s(pci.busId)
                cc = tuple(nv.nvmlDeviceGetCudaComputeCapability(h))
                mem = nv.nvmlDeviceGetMemoryInfo(h).total
                uuid, name = _s(nv.nvmlDeviceGetUUID(h)), _s(nv.nvmlDeviceGetName(h))
            bus_id = bus
            limit = self._optional(nv.nvmlDeviceGetEnforcedPowerLimit, h)
            max_sm = self._optional(nv.nvmlDeviceGetMaxClockInfo, h, _CLOCK_SM)
            max_mem = self._optional(nv.nvmlDeviceGetMaxClockInfo, h, _CLOCK_MEM)
            width = self._optional(nv.nvmlDeviceGetMemoryBusWidth, h)
            vbios = self._optional(nv.nvmlDeviceGetVbiosVersion, h)
            mig = self._optional(nv.nvmlDeviceGetMigMode, h)
            mig_on = bool(mig and mig[0])
            instances = self._mig_instances(h) if mig_on else []
            out.append(GpuRecord(
                index=i, uuid=uuid, name=name, pci_bus_id=bus_id,
                compute_capability=(int(cc[0]), int(cc[1])), memory_bytes=int(mem),
                power_limit_w=limit / 1000.0 if limit else None,
                max_sm_clock_hz=max_sm * 1e6 if max_sm else None,
                max_mem_clock_hz=max_mem * 1e6 if max_mem else None,
                mem_bus_width_bits=int(width) if width else None,
                mig_enabled=mig_on, mig_instances=instances,
                driver_version=_s(driver) if driver else "",
                cuda_driver_version=f"{cuda // 1000}.{cuda % 1000 // 10}" if cuda else "",
                vbios_version=_s(vbios) if vbios else ""))
        return out

    def _mig_instances(self, h: Any) -> list[str]:
        nv, out = self.nv, []
        n = self._optional(nv.nvmlDeviceGetMaxMigDeviceCount, h) or 0
        for j in range(n):
            mh = self._optional(nv.nvmlDeviceGetMigDeviceHandleByIndex, h, j)
            if mh is not None:
                uuid = self._optional(nv.nvmlDeviceGetUUID, mh)
                if uuid:
                    out.append(_s(uuid))
        return out

    def handle(self, index: int) -> Any:
        with self.errors(f"GPU {index}"):
            return self.nv.nvmlDeviceGetHandleByIndex(index)

    # ---------------------------------------------------------------- telemetry
    def energy_j(self, h: Any) -> float | None:
        """Total energy since driver load, mJ -> J; None where the GPU has no counter."""
        mj = self._optional(self.nv.nvmlDeviceGetTotalEnergyConsumption, h)
        return mj / 1000.0 if mj is not None else None

    def power_w(self, h: Any) -> float | None:
        """nvmlDeviceGetPowerUsage: on Ampere (but GA100) and newer GPUs NVML averages it
        over the last second; on older ones it is a recent sample. Context only: gemmd's
        power figures come from the energy counter."""
        mw = self._optional(self.nv.nvmlDeviceGetPowerUsage, h)
        return mw / 1000.0 if mw is not None else None

    def context(self, h: Any) -> dict[str, Any]:
        nv, ctx = self.nv, {}
        sm = self._optional(nv.nvmlDeviceGetClockInfo, h, _CLOCK_SM)
        mem = self._optional(nv.nvmlDeviceGetClockInfo, h, _CLOCK_MEM)
        temp = self._optional(nv.nvmlDeviceGetTemperature, h, _TEMP_GPU)
        limit = self._optional(nv.nvmlDeviceGetEnforcedPowerLimit, h)
        pstate = self._optional(nv.nvmlDeviceGetPerformanceState, h)
        get_reasons = getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None) or \
            nv.nvmlDeviceGetCurrentClocksThrottleReasons
        mask = self._optional(get_reasons, h)
        if sm is not None:
            ctx["sm_clock_hz"] = sm * 1e6
        if mem is not None:
            ctx["mem_clock_hz"] = mem * 1e6
        if temp is not None:
            ctx["temperature_c"] = float(temp)
        if limit is not None:
            ctx["power_limit_w"] = limit / 1000.0
        if pstate is not None:
            ctx["pstate"] = int(pstate)
        if mask is not None:
            ctx["clock_event_reasons"] = decode_reasons(int(mask))
        return ctx

    def other_processes(self, h: Any, own_pids: Sequence[int] = ()) -> list[int]:
        """PIDs of compute processes on the GPU other than ours (and our workers')."""
        own = {os.getpid(), *own_pids}
        procs = self._optional(self.nv.nvmlDeviceGetComputeRunningProcesses, h) or []
        return sorted({p.pid for p in procs} - own)

    def memory_used_by_others(self, h: Any, own_pids: Sequence[int] = ()) -> int | None:
        """Device memory in use minus what this process (and ``own_pids``) holds, bytes.

        Unlike the process list, this sees work in other PID namespaces (other containers):
        NVML lists only the processes of the caller's namespace, but counts all memory.
        Memory the driver reserves is left out where NVML tells it apart (v2 query).
        """
        nv = self.nv
        info = None
        if hasattr(nv, "nvmlMemory_v2"):
            info = self._optional(nv.nvmlDeviceGetMemoryInfo, h, nv.nvmlMemory_v2)
        if info is None:
            info = self._optional(nv.nvmlDeviceGetMemoryInfo, h)
        if info is None:
            return None
        own = {os.getpid(), *own_pids}
        procs = self._optional(nv.nvmlDeviceGetComputeRunningProcesses, h) or []
        mine = sum(int(p.usedGpuMemory or 0) for p in procs if p.pid in own)
        return max(0, int(info.used) - mine)

    def utilization(self, h: Any) -> float | None:
        u = self._optional(self.nv.nvmlDeviceGetUtilizationRates, h)
        return u.gpu / 100.0 if u is not None else None


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)
