"""The correctness check of a GEMM's output: sampled entries against a float64 reference,
within a tolerance per dtype. Written once for every backend that can read its output.
"""

from __future__ import annotations

import numpy as np

# Unit roundoff of input rounding, output rounding and accumulation per dtype. tf32 rounds
# its fp32 inputs to a 10-bit mantissa; 16-bit and fp8 GEMMs accumulate in fp32.
_ROUNDOFF = {  # dtype: (u_in, u_out, u_acc)
    "fp64": (0.0, 1.1e-16, 1.1e-16),
    "fp32": (0.0, 6.0e-8, 6.0e-8),
    "tf32": (4.9e-4, 6.0e-8, 6.0e-8),
    "fp16": (0.0, 4.9e-4, 6.0e-8),
    "bf16": (0.0, 3.9e-3, 6.0e-8),
    "fp8": (0.0, 3.9e-3, 6.0e-8),
}


def check_tolerance(dtype: str, k: int) -> float:
    """Bound on |C - ref| / (|A| @ |B|) for a healthy GEMM (a worst-case, not typical, bound)."""
    u_in, u_out, u_acc = _ROUNDOFF[dtype]
    return 2.0 * (2 * u_in + u_out) + k * u_acc


def check_result(c: np.ndarray, ref: np.ndarray, abs_ref: np.ndarray, dtype: str, k: int
                 ) -> tuple[bool, float]:
    """Compare sampled output entries with a float64 reference.

    ``abs_ref`` is (|A| @ |B|) on the same entries, which scales the error so one tolerance
    fits every input magnitude. Returns (ok, worst scaled error); NaN/Inf output fails.
    """
    c = np.asarray(c, dtype=np.float64)
    if not np.all(np.isfinite(c)):
        return False, float("inf")
    scale = np.maximum(np.asarray(abs_ref, dtype=np.float64), np.finfo(np.float64).tiny)
    err = float(np.max(np.abs(c - ref) / scale)) if c.size else 0.0
    return err <= check_tolerance(dtype, k), err
