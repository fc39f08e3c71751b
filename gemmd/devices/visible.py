"""Which GPUs this process may use: CUDA_VISIBLE_DEVICES resolved against NVML's records,
through the PCI bus ids CUDA reports (CUDA and NVML number GPUs differently)."""

from __future__ import annotations

import logging
import os

from gemmd.devices.nvml import GpuRecord, parse_visible_devices
from gemmd.errors import DeviceUnavailable
from gemmd.gpulibs import import_gpu_library

logger = logging.getLogger("gemmd.devices.nvidia")  # the backend's log, as before the split


def _bus(bus_id: str) -> str:
    """A PCI bus id in one spelling: NVML's "00000000:18:00.0" and CUDA's "0000:18:00.0"."""
    return bus_id.lower()[-12:]


def cuda_visible_bus_ids() -> list[str] | None:
    """PCI bus ids of the GPUs CUDA shows this process, in CUDA's order; None when CUDA
    can't be asked. Initializes the driver, creates no context."""
    try:
        cupy = import_gpu_library("cupy", "CuPy")
        rt = cupy.cuda.runtime
        return [rt.deviceGetPCIBusId(i) for i in range(rt.getDeviceCount())]
    except (DeviceUnavailable, RuntimeError) as e:  # CUDARuntimeError is a RuntimeError
        logger.debug("cannot ask CUDA which GPUs are visible: %s", e)
        return None


def visible(records: list[GpuRecord], env: str | None,
            cuda_bus_ids: list[str] | None = None) -> list[GpuRecord]:
    """The GPUs CUDA_VISIBLE_DEVICES lets this process use, in CUDA's order.

    Numeric entries are CUDA ordinals, which follow CUDA_DEVICE_ORDER (fastest first by
    default), not NVML's PCI order: they are resolved through the PCI bus ids CUDA reports
    (``cuda_bus_ids``). UUID entries are matched directly.
    """
    wanted = parse_visible_devices(env)
    if wanted is None:
        return records
    if cuda_bus_ids is not None and any(w.isdigit() for w in wanted):
        by_bus = {_bus(r.pci_bus_id): r for r in records}
        return [by_bus[_bus(b)] for b in cuda_bus_ids if _bus(b) in by_bus]
    if any(w.isdigit() for w in wanted) and os.environ.get("CUDA_DEVICE_ORDER") != "PCI_BUS_ID" \
            and len({r.name for r in records}) > 1:
        logger.warning("CUDA_VISIBLE_DEVICES=%s names GPUs by CUDA ordinal, CUDA could not be "
                       "asked which GPUs those are, and this host mixes GPU models (CUDA "
                       "numbers them fastest first): assuming NVML order; set "
                       "CUDA_DEVICE_ORDER=PCI_BUS_ID or use GPU UUIDs", env)
    out = []
    for w in wanted:
        for r in records:
            hit = (w.isdigit() and r.index == int(w)) or (not w.isdigit() and (
                r.uuid.startswith(w) or any(m.startswith(w) for m in r.mig_instances)))
            if hit and r not in out:
                out.append(r)
    return out
