"""Imports of the NVIDIA backend's libraries (CuPy, nvidia-ml-py), and of what would drag
CuPy in where no GPU work is done (skops). A leaf below the devices and the model alike:
the NVIDIA backend imports its libraries here, and the model's files are read here
without CuPy's 165 MB.
"""

from __future__ import annotations

import importlib
import sys
import threading
from types import ModuleType
from typing import Any

from gemmd.errors import DeviceUnavailable

# GPU libraries are imported under this lock, so that import_hiding_cupy never hides CuPy
# from a thread that wants it.
_IMPORT_LOCK = threading.RLock()


def cuda_extra(module: Any = None) -> str:
    """The extra that matches this host's CUDA driver ("cuda13" for a CUDA 13 driver,
    "cuda12" for 12), asked of NVML where nvidia-ml-py is installed; "cuda12|cuda13" where
    it can't be told."""
    try:
        nv = module if module is not None else importlib.import_module("pynvml")
        nv.nvmlInit()
        major = int(nv.nvmlSystemGetCudaDriverVersion_v2()) // 1000
    except Exception:  # no pynvml, no driver: say both
        return "cuda12|cuda13"
    return f"cuda{major}" if major in (12, 13) else "cuda12|cuda13"


def import_gpu_library(name: str, what: str) -> ModuleType:
    """Import one of the NVIDIA backend's libraries (the cuda12 or cuda13 extra), or say
    how to get it: DeviceUnavailable, which makes ``backend: auto`` fall back to the CPU."""
    with _IMPORT_LOCK:
        try:
            return importlib.import_module(name)
        except ImportError as e:
            extra = cuda_extra() if name != "pynvml" else "cuda12|cuda13"
            hint = " or ".join(f"pip install 'gemmd-gpu[{x}]'" for x in extra.split("|"))
            raise DeviceUnavailable(f"{what} is not installed ({hint}"
                                    f"{' for a CUDA 12 / 13 driver' if '|' in extra else ''})"
                                    ) from e


def import_hiding_cupy(name: str) -> ModuleType:
    """Import ``name`` with CuPy hidden (unless something imported CuPy already), for
    skops.io: skops imports every scikit-learn module to list the types it trusts, among
    them scikit-learn's array-API shim for CuPy, which imports CuPy wherever the CUDA extra
    is installed: 165 MB more RSS in every gemmd that saves or loads a model (the daemon's
    parent, gemmd predict), none of which runs CuPy (probes run in worker processes).
    scikit-learn skips the shim when CuPy cannot be imported; CuPy stays importable."""
    modules: dict[str, Any] = sys.modules  # None there makes `import cupy` fail at once
    with _IMPORT_LOCK:
        hide = "cupy" not in modules
        if hide:
            modules["cupy"] = None
        try:
            return importlib.import_module(name)
        finally:
            if hide and "cupy" in modules and modules["cupy"] is None:
                del modules["cupy"]
