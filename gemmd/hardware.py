"""What GPU hardware can do: dense peak rates from compute capability, SM count and clock,
and peak memory bandwidth. Pure arithmetic, no CUDA: used by the NVIDIA backend and by the
importers of public measurements alike."""

from __future__ import annotations

# Dense FLOP per clock per SM by compute capability (tensor cores where the dtype uses
# them). Multiplied by SM count and max SM clock they give datasheet-level peaks, e.g.
# H100 SXM: 132 SMs x 1.98 GHz x 4096 = 1070 TFLOP/s bf16 (datasheet 989 at 1.83 GHz).
_PER_SM_CLOCK = {
    (7, 0): {"fp64": 64, "fp32": 128, "fp16": 1024},
    (7, 5): {"fp64": 4, "fp32": 128, "fp16": 512},
    (8, 0): {"fp64": 128, "fp32": 128, "tf32": 1024, "fp16": 2048, "bf16": 2048},
    (8, 6): {"fp64": 4, "fp32": 256, "tf32": 512, "fp16": 1024, "bf16": 1024},
    (8, 7): {"fp64": 4, "fp32": 256, "tf32": 512, "fp16": 1024, "bf16": 1024},
    (8, 9): {"fp64": 4, "fp32": 256, "tf32": 512, "fp16": 1024, "bf16": 1024, "fp8": 2048},
    (9, 0): {"fp64": 256, "fp32": 256, "tf32": 2048, "fp16": 4096, "bf16": 4096,
             "fp8": 8192},
    (10, 0): {"fp64": 256, "fp32": 256, "tf32": 4096, "fp16": 8192, "bf16": 8192,
              "fp8": 16384},
    (12, 0): {"fp64": 4, "fp32": 256, "tf32": 512, "fp16": 1024, "bf16": 1024, "fp8": 2048},
}


def arch_rates(cc: tuple[int, int]) -> dict[str, int]:
    """Per-SM rates of ``cc``, or of the nearest older known architecture."""
    known = sorted(k for k in _PER_SM_CLOCK if k <= tuple(cc)) or [min(_PER_SM_CLOCK)]
    return _PER_SM_CLOCK[known[-1]]


def peak_flops(cc: tuple[int, int], sm_count: int, sm_clock_hz: float) -> dict[str, float]:
    """Dense peak FLOP/s per dtype."""
    return {d: v * sm_count * sm_clock_hz for d, v in arch_rates(cc).items()}


def bandwidth(bus_width_bits: int | None, max_mem_clock_hz: float | None) -> float:
    """Peak DRAM bandwidth, bytes/s: bus width x memory clock x 2 (double data rate)."""
    if not bus_width_bits or not max_mem_clock_hz:
        return 0.0
    return bus_width_bits / 8 * max_mem_clock_hz * 2
