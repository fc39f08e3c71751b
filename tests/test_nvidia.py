"""NVIDIA backend without a GPU: NVML boundary (stand-in pynvml), pure arithmetic, layouts.

The backend end to end, and the real libraries, are in test_gpu_contract.py."""

from __future__ import annotations

import shutil
import subprocess

import numpy as np
import pytest
from cuda_standin import FakePynvml  # tied to the real pynvml's functions and constants

from gemmd import gpulibs, hardware
from gemmd.devices import nvidia, visible
from gemmd.devices.base import over_budget
from gemmd.devices.check import check_result
from gemmd.devices.nvml import Nvml, decode_reasons, parse_visible_devices
from gemmd.errors import DeviceError, DeviceUnavailable
from gemmd.gemm import ProbeSpec


def _gpus(**extra):
    return [{"uuid": "GPU-aaaa-1111", "bus": "00000000:18:00.0", "energy_mj": 123_456,
             "power_mw": 412_345, **extra},
            {"uuid": "GPU-bbbb-2222", "bus": "00000000:2A:00.0", "power_mw": 90_000,
             "mig": ["MIG-cccc-1", "MIG-cccc-2"]}]


def test_discovery_records_units_and_mig():
    recs = Nvml(FakePynvml(_gpus())).discover()
    assert [r.uuid for r in recs] == ["GPU-aaaa-1111", "GPU-bbbb-2222"]
    r = recs[0]
    assert r.pci_bus_id == "00000000:18:00.0" and r.compute_capability == (9, 0)
    assert r.power_limit_w == 700.0 and r.max_sm_clock_hz == 1.98e9
    assert r.mem_bus_width_bits is None  # unsupported query -> None, not an error
    assert not r.mig_enabled and recs[1].mig_enabled
    assert recs[1].mig_instances == ["MIG-cccc-1", "MIG-cccc-2"]


def test_telemetry_in_si_units_and_absent_counter():
    nv = Nvml(FakePynvml(_gpus(reasons=0x4 | 0x40, pids=[4242], util=37)))
    h0, h1 = nv.handle(0), nv.handle(1)
    assert nv.energy_j(h0) == pytest.approx(123.456)
    assert nv.energy_j(h1) is None  # no counter: absent, not zero, not an error
    assert nv.power_w(h0) == pytest.approx(412.345)
    ctx = nv.context(h0)
    assert ctx["sm_clock_hz"] == 1.755e9 and ctx["temperature_c"] == 61.0
    assert ctx["power_limit_w"] == 700.0
    assert ctx["clock_event_reasons"] == ["sw_power_cap", "hw_thermal_slowdown"]
    assert nv.other_processes(h0) == [4242] and nv.utilization(h0) == 0.37


def test_nvml_errors_become_gemmd_errors():
    with pytest.raises(DeviceUnavailable, match="NVML cannot start: NVML Shared Library Not Found"):
        Nvml(FakePynvml([], init_error=12))
    nv = Nvml(FakePynvml(_gpus(lost=True)))
    with pytest.raises(DeviceError, match="GPU is lost"):
        nv.discover()
    with pytest.raises(DeviceError, match="GPU is lost"):
        nv.energy_j(nv.handle(0))


def test_decode_reasons_and_visible_devices():
    assert decode_reasons(0) == []
    assert decode_reasons(0x1 | 0x8) == ["gpu_idle", "hw_slowdown"]
    assert decode_reasons(0x10000) == ["unknown_0x10000"]
    assert decode_reasons(0x200 | 0x400) == ["board_limit", "reliability"]
    assert parse_visible_devices(None) is None
    assert parse_visible_devices("") == []
    assert parse_visible_devices("1,GPU-ab, 0") == ["1", "GPU-ab", "0"]
    assert parse_visible_devices("0,foo,1") == ["0"]  # CUDA stops at the first bad entry
    recs = Nvml(FakePynvml(_gpus())).discover()
    assert [r.index for r in visible.visible(recs, "1,0")] == [1, 0]
    assert [r.index for r in visible.visible(recs, "GPU-bbbb")] == [1]
    assert [r.index for r in visible.visible(recs, "MIG-cccc-2")] == [1]
    assert visible.visible(recs, "") == []
    assert visible.visible(recs, None) == recs


def test_open_all_without_pynvml_or_gpu_is_unavailable(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml -> ImportError
    with pytest.raises(DeviceUnavailable, match="pynvml is not installed"):
        nvidia.open_all(memory_budget=1 << 30)


def test_a_gpu_without_cupy_is_unavailable_with_the_extra_to_install(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "cupy", None)  # import cupy -> ImportError
    fake = FakePynvml(_gpus())  # a CUDA 13.0 driver
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    nv = Nvml(fake)
    with pytest.raises(DeviceUnavailable, match=r"^CuPy is not installed \(pip install "
                                                 r"'gemmd-gpu\[cuda13\]'\)$"):
        nvidia.NvidiaDevice(nv.discover()[0], memory_budget=1 << 30, nvml=nv)


def test_the_extra_named_follows_the_driver_and_names_both_when_unknown(monkeypatch):
    import sys

    from gemmd.gpulibs import cuda_extra

    fake = FakePynvml(_gpus())
    assert cuda_extra(fake) == "cuda13"
    fake.nvmlSystemGetCudaDriverVersion_v2 = lambda: 12080
    assert cuda_extra(fake) == "cuda12"
    monkeypatch.setitem(sys.modules, "pynvml", None)  # no nvidia-ml-py: no driver to ask
    assert cuda_extra() == "cuda12|cuda13"
    monkeypatch.setitem(sys.modules, "cupy", None)
    with pytest.raises(DeviceUnavailable, match=r"^CuPy is not installed \(pip install "
                       r"'gemmd-gpu\[cuda12\]' or pip install 'gemmd-gpu\[cuda13\]' for a "
                       r"CUDA 12 / 13 driver\)$"):
        gpulibs.import_gpu_library("cupy", "CuPy")


def test_peak_flops_and_bandwidth_match_datasheets():
    h100 = hardware.peak_flops((9, 0), 132, 1.83e9)  # tensor-core boost clock
    assert h100["bf16"] == pytest.approx(989e12, rel=0.01)
    assert h100["fp32"] == pytest.approx(61.8e12, rel=0.01)
    a100 = hardware.peak_flops((8, 0), 108, 1.41e9)
    assert a100["bf16"] == pytest.approx(312e12, rel=0.01)
    assert a100["fp32"] == pytest.approx(19.5e12, rel=0.01) and "fp8" not in a100
    l4 = hardware.peak_flops((8, 9), 58, 2.04e9)
    assert l4["fp8"] == pytest.approx(242e12, rel=0.01)
    assert hardware.peak_flops((9, 9), 1, 1.0) == hardware.peak_flops((9, 0), 1, 1.0)  # nearest
    assert hardware.bandwidth(5120, 2619e6) == pytest.approx(3.35e12, rel=0.01)
    assert hardware.bandwidth(None, 2619e6) == 0.0


def test_unsupported_reasons():
    assert "cuBLASLt" in nvidia.unsupported(ProbeSpec(64, 64, 64, "fp8"), (9, 0))
    assert "8.0" in nvidia.unsupported(ProbeSpec(64, 64, 64, "bf16"), (7, 5))
    assert "fp32 only" in nvidia.unsupported(ProbeSpec(64, 64, 64, "fp16", "tiled", 16),
                                             (9, 0))
    assert "memory budget" in over_budget(ProbeSpec(8192, 8192, 8192, "fp32"), 1 << 20)
    assert over_budget(ProbeSpec(8192, 8192, 8192, "fp32"), 1 << 34) is None
    assert nvidia.unsupported(ProbeSpec(4096, 4096, 4096, "tf32"), (8, 0)) is None


def _colmajor_gemm(spec, a_flat, b_flat):
    """cuBLAS semantics spelled out element by element (column-major, op per layout)."""
    args = nvidia.blas_args(spec)
    m, n, k = spec.m, spec.n, spec.k
    c = np.zeros(m * n)
    for i in range(m):
        for j in range(n):
            s = 0.0
            for p in range(k):
                a = a_flat[i + p * args["lda"]] if args["transa"] == 0 else \
                    a_flat[p + i * args["lda"]]
                b = b_flat[p + j * args["ldb"]] if args["transb"] == 0 else \
                    b_flat[j + p * args["ldb"]]
                s += a * b
            c[i + j * args["ldc"]] = s
    return c


@pytest.mark.parametrize("layout", ["nn", "nt", "tn", "tt"])
def test_layout_views_match_cublas_semantics(layout):
    spec = ProbeSpec(5, 3, 4, "fp64", "blas", 0, layout)
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal(spec.m * spec.k), rng.standard_normal(spec.k * spec.n)
    c = _colmajor_gemm(spec, a, b)
    la = nvidia.logical(a, spec.m, spec.k, layout[0])
    lb = nvidia.logical(b, spec.k, spec.n, layout[1])
    lc = nvidia.logical(c, spec.m, spec.n, "n")
    np.testing.assert_allclose(la @ lb, lc)
    # The check used on the GPU accepts it, and catches one corrupted entry.
    ok, _ = check_result(lc, la @ lb, np.abs(la) @ np.abs(lb), "fp64", spec.k)
    assert ok
    c[7] += 1.0
    lc = nvidia.logical(c, spec.m, spec.n, "n")
    assert not check_result(lc, la @ lb, np.abs(la) @ np.abs(lb), "fp64", spec.k)[0]


def test_bf16_conversion_rounds_to_nearest_even():
    x = np.array([1.0, -2.5, 3.14159, 1e-3, 65504.0], dtype=np.float32)
    back = nvidia.bf16_to_f32(nvidia.bf16_bits(x))
    np.testing.assert_allclose(back, x, rtol=2**-8)
    assert nvidia.bf16_bits(np.array([1.0], np.float32))[0] == 0x3F80
    # 1 + 2^-8 is exactly halfway between two bf16 values: ties go to even (1.0).
    assert nvidia.bf16_to_f32(nvidia.bf16_bits(np.array([1 + 2**-8], np.float32)))[0] == 1.0


def test_chunk_size():
    assert nvidia.chunk_size(None) == 1
    assert nvidia.chunk_size(1e-3) == 1
    assert nvidia.chunk_size(10e-6) == 20
    assert nvidia.chunk_size(float("inf")) == 1


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
@pytest.mark.parametrize("tile", [1, 4, 16, 32])
def test_tiled_kernel_compiles_for_every_paper_tile(tmp_path, tile):
    from importlib import resources

    src = resources.files("gemmd.kernels").joinpath("tiled_gemm.cu")
    r = subprocess.run(["nvcc", f"-DTILE={tile}", "-arch=sm_80", "-c", str(src), "-o",
                        str(tmp_path / "k.o")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
