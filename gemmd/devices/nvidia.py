"""NVIDIA backend (pynvml + CuPy). Imported only when the backend is auto or nvidia."""

from __future__ import annotations

from gemmd.devices.base import Device
from gemmd.errors import DeviceUnavailable


def open_all(*, memory_budget: int) -> list[Device]:
    try:
        import pynvml
    except ImportError as e:
        raise DeviceUnavailable("pynvml is not installed (pip install 'gemmd[cuda12]')") from e
    try:
        pynvml.nvmlInit()
        count = pynvml.nvmlDeviceGetCount()
    except pynvml.NVMLError as e:
        raise DeviceUnavailable(f"NVML: {e}") from e
    if count == 0:
        raise DeviceUnavailable("NVML reports no GPU")
    raise DeviceUnavailable("the NVIDIA probe backend is not built yet (issue 3)")
