"""Device backends and the one place where devices are built (no singletons).

The NVIDIA backend is imported only when asked for, so the CPU path never needs CUDA.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence

from gemmd.config import Config
from gemmd.devices.base import BusyLimits, Device
from gemmd.errors import DeviceUnavailable

logger = logging.getLogger(__name__)

__all__ = ["BusyLimits", "Device", "open_devices", "select"]


def select(devices: Sequence[Device], wanted: str | Sequence[int | str]) -> list[Device]:
    """Keep the devices named by index or UUID; an entry matching nothing is an error."""
    if wanted == "all":
        return list(devices)
    out: list[Device] = []
    for w in wanted:
        match = [d for d in devices if (isinstance(w, int) and d.info.index == w)
                 or (isinstance(w, str) and d.info.uuid == w)]
        if not match:
            have = ", ".join(f"{d.info.index}={d.info.uuid}" for d in devices) or "none"
            raise DeviceUnavailable(f"devices: no device matches {w!r} (found: {have})")
        out.extend(m for m in match if m not in out)
    return out


def isolation_of(cfg: Config, backend: str) -> str:
    """Where a backend's devices run: "auto" puts GPUs in worker processes (a hung kernel or
    a poisoned CUDA context is killed with its process) and simulated ones in threads."""
    if cfg.isolation != "auto":
        return cfg.isolation
    return "process" if backend == "nvidia" else "thread"


def open_devices(cfg: Config) -> list[Device]:
    """Build the configured backend's devices. Raises DeviceUnavailable when it can't."""
    budget = cfg.budget.memory_mb << 20
    if cfg.backend == "fake":
        from gemmd.devices.fake import FakeDevice
        from gemmd.devices.worker import isolated

        devs = [isolated(functools.partial(FakeDevice, index=i, cfg=d, seed=cfg.fake.seed,
                                           noise=cfg.fake.noise, jitter=cfg.fake.jitter,
                                           realtime=cfg.fake.realtime, memory_budget=budget),
                         f"GPU {i}", isolation_of(cfg, "fake"))
                for i, d in enumerate(cfg.fake.devices)]
        return select(devs, cfg.devices)
    if cfg.backend in ("auto", "nvidia"):
        from gemmd.devices import nvidia

        try:
            found = nvidia.open_all(memory_budget=budget, seed=cfg.model.seed,
                                    isolation=isolation_of(cfg, "nvidia"))
        except DeviceUnavailable as e:
            if cfg.backend == "nvidia":
                raise
            logger.warning("backend auto: no usable NVIDIA GPU (%s); using the CPU backend", e)
        else:
            return select(found, cfg.devices)
    from gemmd.devices.cpu import CpuDevice

    return select([CpuDevice(memory_budget=budget, seed=cfg.model.seed)], cfg.devices)
