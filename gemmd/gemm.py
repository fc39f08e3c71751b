"""The GEMM vocabulary: what a GEMM is, what it costs, and what gemmd measures of it.

A leaf module (it imports nothing from gemmd): dtypes, kernels, layouts, element sizes,
the probe spec, the FLOP and byte counts and the roofline (written once, for one spec or
for numpy columns of many), and the three targets with their column names. Adding a dtype
or a target starts here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

DTYPES = ("fp64", "fp32", "tf32", "fp16", "bf16", "fp8")
KERNELS = ("blas", "tiled")  # what gemmd can probe
DATA_KERNELS = (*KERNELS, "cutlass")  # what imported measurements may also name
LAYOUTS = ("nn", "nt", "tn", "tt")  # op(A), op(B) as cuBLAS and CUTLASS name them
DAEMON_SOURCE = "daemon"  # the source of gemmd's own probes (imports are named otherwise)

# Bytes per element of the inputs; fp8 GEMMs write a 16-bit output.
DTYPE_BYTES = {"fp64": 8, "fp32": 4, "tf32": 4, "fp16": 2, "bf16": 2, "fp8": 1}
OUT_BYTES = {**DTYPE_BYTES, "fp8": 2}

# Measured and predicted: runtime (s), average power (W), energy per GEMM (J). Probe rows,
# Measurement and Prediction all name them by COLUMN; UNIT is the metric-name suffix.
TARGETS = ("runtime", "power", "energy")
COLUMN = {"runtime": "runtime_s", "power": "power_w", "energy": "energy_j"}
TARGET_COLUMNS = tuple(COLUMN[t] for t in TARGETS)
UNIT = {"runtime": "seconds", "power": "watts", "energy": "joules"}


def gemm_flops(m: Any, n: Any, k: Any, batch: Any = 1) -> Any:
    """FLOP of C = A @ B (a multiply and an add per term); scalars or numpy arrays."""
    return 2.0 * batch * m * n * k


def gemm_bytes(m: Any, n: Any, k: Any, in_bytes: Any, out_bytes: Any, batch: Any = 1,
               c_passes: Any = 1) -> Any:
    """Compulsory memory traffic: read A and B once, write C once (``c_passes`` = 2 when
    C is also read, beta != 0); also the memory A, B and C occupy. Scalars or arrays."""
    return batch * (in_bytes * (m * k + k * n) + out_bytes * m * n * c_passes)


def roofline_s(flops: Any, nbytes: Any, peak_flops: Any, bandwidth: Any) -> Any:
    """Lower bound on runtime: compute at peak or traffic at peak bandwidth, the longer."""
    import numpy as np

    return np.maximum(flops / peak_flops, nbytes / bandwidth)


@dataclass(frozen=True, order=True)
class ProbeSpec:
    m: int
    n: int
    k: int
    dtype: str = "fp32"
    kernel: str = "blas"
    tile: int = 0  # tile edge of the tiled kernel; 0 for blas
    layout: str = "nn"

    @property
    def flops(self) -> float:
        return float(gemm_flops(self.m, self.n, self.k))

    @property
    def buffer_bytes(self) -> int:
        """Memory for A, B and C: what a device must hold to run this GEMM."""
        return int(gemm_bytes(self.m, self.n, self.k, DTYPE_BYTES[self.dtype],
                              OUT_BYTES[self.dtype]))

    @property
    def bytes(self) -> float:
        """Compulsory traffic: read A and B once, write C once."""
        return float(self.buffer_bytes)

    @property
    def intensity(self) -> float:
        """Arithmetic intensity, FLOP per byte of compulsory traffic."""
        return self.flops / self.bytes

    @property
    def name(self) -> str:
        kern = f"tiled{self.tile}" if self.kernel == "tiled" else self.kernel
        return f"{kern}-{self.dtype}-{self.layout}-{self.m}x{self.n}x{self.k}"

    def labels(self) -> dict[str, str]:
        return {"probe": self.name, "m": str(self.m), "n": str(self.n), "k": str(self.k),
                "dtype": self.dtype, "kernel": self.kernel, "tile": str(self.tile),
                "layout": self.layout}


PROBE_LABELS = ("probe", "m", "n", "k", "dtype", "kernel", "tile", "layout")
