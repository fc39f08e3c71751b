"""The few cuBLAS C functions gemmd calls, through ctypes.

Why not CuPy's ``cupy_backends.cuda.libs.cublas``: its wrappers set the handle's stream on
every call and refuse to run while the stream is being captured into a CUDA graph
(``setStream`` raises NotImplementedError, CuPy 13-14). Small GEMMs need graphs: cuBLAS
spends several microseconds of host time per call, more than a small GEMM takes on the GPU,
so a Python loop of calls times the host, not the GPU. Replayed from a graph, a chunk of
GEMMs costs one launch.

The library is the one CuPy itself loads (found through ``cuda.pathfinder``, which CuPy >= 14
uses), so the process holds one copy of cuBLAS. The handle is gemmd's own, with its own
workspace, so nothing here changes CuPy's handle. Argument lists follow cublas_api.h
(CUDA 12/13); tests/test_gpu_contract.py checks them against the header the cuBLAS wheel
ships and calls the real library.
"""

from __future__ import annotations

import ctypes
from typing import Any

# cublasStatus_t values (cublas_api.h) that mean the context itself failed.
STATUS_EXECUTION_FAILED, STATUS_INTERNAL_ERROR = 13, 14
STATUS_NAMES = {0: "CUBLAS_STATUS_SUCCESS", 1: "CUBLAS_STATUS_NOT_INITIALIZED",
                3: "CUBLAS_STATUS_ALLOC_FAILED", 7: "CUBLAS_STATUS_INVALID_VALUE",
                8: "CUBLAS_STATUS_ARCH_MISMATCH", 11: "CUBLAS_STATUS_MAPPING_ERROR",
                13: "CUBLAS_STATUS_EXECUTION_FAILED", 14: "CUBLAS_STATUS_INTERNAL_ERROR",
                15: "CUBLAS_STATUS_NOT_SUPPORTED", 16: "CUBLAS_STATUS_LICENSE_ERROR"}

# Enum values (library_types.h, cublas_api.h); the contract tests compare them with CuPy's.
CUDA_R = {"fp64": 1, "fp32": 0, "tf32": 0, "fp16": 2, "bf16": 14}
COMPUTE = {"fp64": 70, "fp32": 68, "tf32": 77, "fp16": 68, "bf16": 68}
OP = {"n": 0, "t": 1}
GEMM_DEFAULT = -1
WORKSPACE_BYTES = 32 << 20  # cuBLAS's recommendation for Hopper; more than older GPUs need

_p, _i = ctypes.c_void_p, ctypes.c_int
# name: (argtypes) of each function used; every one returns cublasStatus_t (int).
SIGNATURES: dict[str, tuple[Any, ...]] = {
    "cublasCreate_v2": (ctypes.POINTER(ctypes.c_void_p),),
    "cublasDestroy_v2": (_p,),
    "cublasSetStream_v2": (_p, _p),
    "cublasSetWorkspace_v2": (_p, _p, ctypes.c_size_t),
    # handle, transa, transb, m, n, k, alpha, A, Atype, lda, B, Btype, ldb, beta, C, Ctype,
    # ldc, computeType, algo
    "cublasGemmEx": (_p, _i, _i, _i, _i, _i, _p, _p, _i, _i, _p, _i, _i, _p, _p, _i, _i, _i,
                     _i),
}


class CublasError(RuntimeError):
    def __init__(self, function: str, status: int):
        self.function, self.status = function, status
        super().__init__(f"{function}: {STATUS_NAMES.get(status, 'cublasStatus')} ({status})")


def library_path() -> str:
    """Path of the cuBLAS library CuPy uses (the [ctk] wheels, else the system's)."""
    try:
        from cuda.pathfinder import load_nvidia_dynamic_lib
    except ImportError:
        import ctypes.util

        found = ctypes.util.find_library("cublas")
        if not found:
            raise OSError("cuBLAS not found (install gemmd's cuda12/cuda13 extra)") from None
        return found
    try:
        return load_nvidia_dynamic_lib("cublas").abs_path
    except RuntimeError as e:  # cuda.pathfinder's DynamicLibNotFoundError
        raise OSError(f"cuBLAS not found: {e} (install gemmd's cuda12/cuda13 extra)") from e


class Cublas:
    """cuBLAS through ctypes: one handle per instance, created on the current device."""

    def __init__(self, lib: Any = None):
        self.lib = lib if lib is not None else ctypes.CDLL(library_path())
        self._fn = {}
        for name, argtypes in SIGNATURES.items():
            fn = getattr(self.lib, name)
            fn.argtypes, fn.restype = list(argtypes), ctypes.c_int
            self._fn[name] = fn

    def _call(self, name: str, *args: Any) -> None:
        status = self._fn[name](*args)
        if status != 0:
            raise CublasError(name, status)

    def create(self) -> int:
        handle = ctypes.c_void_p()
        self._call("cublasCreate_v2", ctypes.byref(handle))
        return int(handle.value or 0)

    def destroy(self, handle: int) -> None:
        self._call("cublasDestroy_v2", handle)

    def set_stream(self, handle: int, stream_ptr: int) -> None:
        self._call("cublasSetStream_v2", handle, stream_ptr)

    def set_workspace(self, handle: int, ptr: int, nbytes: int) -> None:
        self._call("cublasSetWorkspace_v2", handle, ptr, nbytes)

    def gemm_ex(self, handle: int, transa: int, transb: int, m: int, n: int, k: int,
                alpha: int, a: int, atype: int, lda: int, b: int, btype: int, ldb: int,
                beta: int, c: int, ctype: int, ldc: int, compute: int, algo: int) -> None:
        """cublasGemmEx; ``alpha``/``beta`` are host addresses (pointer mode host: their
        values are baked into a captured graph), ``a``, ``b``, ``c`` device addresses."""
        self._call("cublasGemmEx", handle, transa, transb, m, n, k, alpha, a, atype, lda, b,
                   btype, ldb, beta, c, ctype, ldc, compute, algo)
