"""The NVIDIA backend against the real CuPy, cuBLAS and nvidia-ml-py, on a machine without a GPU.

Two kinds of test: the real libraries themselves (names, constants, argument lists, calls
that reach the library and fail only for want of a GPU), and the backend end to end over
stand-ins that are tied to those real APIs (tests/cuda_standin.py).
"""

from __future__ import annotations

import ast
import ctypes
import logging
import math
import re
import threading
import time
from importlib import metadata
from pathlib import Path

import cupy
import numpy as np
import pynvml
import pytest
from cuda_standin import (
    CublasStandin,
    Event,
    FakePynvml,
    Gpu,
    VirtualClock,
    make_cupy,
    real_signature,
    stepping_counter,
)
from cupy_backends.cuda.api import runtime as cuda_runtime
from cupy_backends.cuda.api.runtime import CUDARuntimeError
from cupy_backends.cuda.libs import cublas as cupy_cublas

from gemmd.config import MeasureConfig
from gemmd.devices import cublas, energy_watch, nvidia, nvml, visible
from gemmd.devices.base import iterations_for_window, measure
from gemmd.devices.nvml import Nvml
from gemmd.errors import DeviceError, DeviceFault, DeviceUnavailable, UnsupportedProbe
from gemmd.gemm import ProbeSpec

ROOT = Path(__file__).resolve().parent.parent
BUS = "00000000:18:00.0"
FAST = MeasureConfig(window_s=0.03, warmup_s=0.005, min_iters=3)


def _gpu_present() -> bool:
    """CI has no GPU; bench/gpu_accept.py runs this file on one too, where the calls below
    that fail for want of a driver succeed instead."""
    try:
        Nvml()
        return True
    except DeviceUnavailable:
        return False


GPU = _gpu_present()


# ------------------------------------------------------------------ real libraries


def _attribute_calls(path: Path, owners: set[str]) -> set[str]:
    """Names ``x`` in ``owner.x`` expressions of a module (owner: a name or self.<name>)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute):
            v = node.value
            name = v.id if isinstance(v, ast.Name) else \
                v.attr if isinstance(v, ast.Attribute) else None
            if name in owners:
                out.add(node.attr)
    return out


def test_every_pynvml_name_gemmd_uses_exists_in_the_real_module():
    used = _attribute_calls(ROOT / "gemmd/devices/nvml.py", {"nv"})
    assert {"nvmlInit", "nvmlDeviceGetTotalEnergyConsumption", "NVMLError"} <= used
    missing = sorted(n for n in used if not hasattr(pynvml, n))
    assert missing == []


def test_nvml_constants_match_the_real_module():
    assert nvml._CLOCK_SM == pynvml.NVML_CLOCK_SM
    assert nvml._CLOCK_MEM == pynvml.NVML_CLOCK_MEM
    assert nvml._TEMP_GPU == pynvml.NVML_TEMPERATURE_GPU
    assert nvml._ERROR_GPU_IS_LOST == pynvml.NVML_ERROR_GPU_IS_LOST
    assert nvml._ERROR_NOT_SUPPORTED == pynvml.NVML_ERROR_NOT_SUPPORTED


def test_every_clock_event_reason_bit_of_pynvml_decodes_to_a_name():
    bits = {}
    for name in dir(pynvml):
        m = re.fullmatch(r"nvmlClocks(?:Event|Throttle)Reason(\w+)", name)
        value = getattr(pynvml, name)
        if m and isinstance(value, int) and value and value & (value - 1) == 0:
            bits.setdefault(value, m.group(1))
    # Older nvidia-ml-py releases (12.535 ... 13.610) lack some bits (0x200 BoardLimit,
    # 0x400 Reliability came with 13.615): gemmd decodes from nvml.h, not from pynvml, so
    # what each release defines must decode, and the bits every release has must be there.
    assert {0x1, 0x2, 0x4, 0x8, 0x20, 0x40, 0x80} <= set(bits)
    for bit, pyname in bits.items():
        decoded = nvml.decode_reasons(bit)
        assert len(decoded) == 1 and not decoded[0].startswith("unknown"), (pyname, decoded)
        # The same words as NVML's name, in snake case.
        words = re.sub(r"(?<!^)(?=[A-Z])", "_", pyname).lower().replace("clocks", "clock")
        assert decoded[0].replace("clocks", "clock") in (words, "applications_clock_setting",
                                                         "hw_power_brake_slowdown",
                                                         "sw_power_cap", "gpu_idle")


def test_every_cupy_name_the_backend_uses_exists_in_real_cupy():
    backend = ("gemmd/devices/nvidia.py", "gemmd/devices/visible.py")  # CuPy's users
    used = set().union(*(_attribute_calls(ROOT / f, {"cp", "cupy"}) for f in backend))
    used -= {"float16", "float32", "float64", "uint8", "uint16", "uint32"}
    assert {"cuda", "RawModule", "get_default_memory_pool"} <= used
    assert sorted(n for n in used if not hasattr(cupy, n)) == []
    cuda_used = set().union(*(_attribute_calls(ROOT / f, {"cuda"}) for f in backend))
    assert {"Event", "Stream", "Device", "get_elapsed_time", "runtime"} <= cuda_used
    assert sorted(n for n in cuda_used if not hasattr(cupy.cuda, n)) == []
    assert not hasattr(cupy.cuda.Event, "query")  # the first-run crash of the review
    errors, faults = nvidia._cupy_errors(cupy)
    assert len(errors) == 5 and cupy.cuda.runtime.CUDARuntimeError in faults


def test_cuda_enums_match_cupys_cublas_and_runtime_constants():
    assert cublas.CUDA_R == {"fp64": cuda_runtime.CUDA_R_64F, "fp32": cuda_runtime.CUDA_R_32F,
                             "tf32": cuda_runtime.CUDA_R_32F, "fp16": cuda_runtime.CUDA_R_16F,
                             "bf16": cuda_runtime.CUDA_R_16BF}
    assert cublas.COMPUTE == {"fp64": cupy_cublas.CUBLAS_COMPUTE_64F,
                              "fp32": cupy_cublas.CUBLAS_COMPUTE_32F,
                              "tf32": cupy_cublas.CUBLAS_COMPUTE_32F_FAST_TF32,
                              "fp16": cupy_cublas.CUBLAS_COMPUTE_32F,
                              "bf16": cupy_cublas.CUBLAS_COMPUTE_32F}
    assert cublas.OP == {"n": cupy_cublas.CUBLAS_OP_N, "t": cupy_cublas.CUBLAS_OP_T}
    assert cublas.GEMM_DEFAULT == cupy_cublas.CUBLAS_GEMM_DEFAULT


def _header() -> str:
    """cublas_api.h of the cuBLAS wheel the tests install (or of a CUDA toolkit)."""
    places = []
    for dist in ("nvidia-cublas-cu12", "nvidia-cublas-cu13", "nvidia-cublas"):
        try:
            d = metadata.distribution(dist)
        except metadata.PackageNotFoundError:
            continue
        places += [Path(d.locate_file(f)) for f in d.files or ()
                   if str(f).endswith("cublas_api.h")]
    places.append(Path("/usr/local/cuda/include/cublas_api.h"))
    found = [p for p in places if p.is_file()]
    assert found, "cublas_api.h not found (the test extra installs nvidia-cublas-cu12)"
    return found[0].read_text()


_C_TYPES = {"int": ctypes.c_int, "size_t": ctypes.c_size_t, "cublasOperation_t": ctypes.c_int,
            "cudaDataType": ctypes.c_int, "cublasComputeType_t": ctypes.c_int,
            "cublasGemmAlgo_t": ctypes.c_int, "cublasHandle_t": ctypes.c_void_p,
            "cudaStream_t": ctypes.c_void_p}


@pytest.mark.parametrize("name", sorted(cublas.SIGNATURES))
def test_ctypes_argument_lists_match_the_cublas_header(name):
    m = re.search(rf"cublasStatus_t CUBLASWINAPI {name}\((.*?)\);", _header(), re.S)
    assert m, f"{name} not declared in cublas_api.h"
    params = [" ".join(p.split()) for p in m.group(1).split(",")]
    expected = []
    for p in params:
        ctype = p.rsplit(" ", 1)[0].replace("const ", "")
        if ctype.endswith("*"):
            base = ctype.rstrip("* ")
            expected.append(ctypes.POINTER(ctypes.c_void_p) if base == "cublasHandle_t"
                            else ctypes.c_void_p)
        else:
            expected.append(_C_TYPES[ctype])
    assert [t.__name__ for t in cublas.SIGNATURES[name]] == [t.__name__ for t in expected]


def test_the_real_cublas_library_loads_and_answers():
    blas = cublas.Cublas()  # the library CuPy uses, found the way CuPy finds it
    if GPU:
        handle = blas.create()
        assert handle
        blas.destroy(handle)
    else:
        with pytest.raises(cublas.CublasError, match="NOT_INITIALIZED") as e:
            blas.create()  # no driver here
        assert e.value.status == 1
    one = np.ones(1, np.float32)
    with pytest.raises(cublas.CublasError) as e:  # a NULL handle: refused, not a crash
        blas.gemm_ex(0, 0, 0, 4, 4, 4, one.ctypes.data, 0, 0, 4, 0, 0, 4, one.ctypes.data, 0,
                     0, 4, cublas.COMPUTE["fp32"], cublas.GEMM_DEFAULT)
    assert e.value.status == 1


def test_cupys_own_cublas_wrapper_refuses_graph_capture():
    """Why gemmd calls cuBLAS through ctypes: CuPy's wrappers check for capture on every
    call (its setStream raises NotImplementedError while capturing)."""
    sig = real_signature(cupy_cublas.gemmEx)
    assert len(sig.parameters) == 19
    import inspect

    src = inspect.getdoc(cupy_cublas.setStream) or ""
    assert "setStream" in src


@pytest.mark.skipif(GPU, reason="there is a GPU: the real device is measured instead")
def test_real_cupy_without_a_gpu_is_a_one_line_device_error():
    rec = Nvml(FakePynvml(_gpus())).discover()[0]
    with pytest.raises(DeviceError, match=r"^GPU 0: open: CUDARuntimeError: cudaError\w+"):
        nvidia.NvidiaDevice(rec, memory_budget=1 << 30, nvml=Nvml(FakePynvml(_gpus())))
    assert visible.cuda_visible_bus_ids() is None  # CUDA can't be asked here: no driver


def test_the_cuda_extras_bring_the_cuda_libraries_gemmd_uses_and_no_others():
    try:
        reqs = metadata.requires("gemmd-gpu") or []
    except metadata.PackageNotFoundError:  # a bare checkout on the GPU machine
        import tomllib

        extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
            "optional-dependencies"]
        reqs = [f'{r}; extra == "{x}"' for x, rs in extras.items() for r in rs]
    for extra, cupy_pkg in (("cuda12", "cupy-cuda12x"), ("cuda13", "cupy-cuda13x")):
        mine = [r for r in reqs if f'extra == "{extra}"' in r]
        assert any(r.startswith(f"{cupy_pkg}>=14") for r in mine), mine
        assert any(r.startswith("nvidia-ml-py") for r in mine), mine
        # cuBLAS, NVRTC, the runtime and cuRAND; not CuPy's whole [ctk] (cuFFT, cuSOLVER,
        # cuSPARSE, nvJitLink: ~1.3 GB gemmd never loads).
        (toolkit,) = [r for r in mine if r.startswith("cuda-toolkit")]
        assert toolkit.startswith(f"cuda-toolkit[cublas,cudart,curand,nvrtc]=={extra[4:]}.*")


# ------------------------------------------------------------------ stand-in GPU


def _gpus(**extra):
    return [{"uuid": "GPU-aaaa-1111", "bus": BUS, "energy_mj": 123_456, "power_mw": 412_345,
             **extra}]


@pytest.fixture
def gpu():
    return Gpu()


def _device(gpu, budget=1 << 30, cublas_impl=None, **nv):
    nvml_ = Nvml(FakePynvml(_gpus(**nv)))
    rec = nvml_.discover()[0]
    cp = make_cupy(["0000:18:00.0"], gpu)
    return nvidia.NvidiaDevice(rec, memory_budget=budget, nvml=nvml_, cupy=cp,
                               cublas=cublas_impl or CublasStandin(gpu), clock=gpu.clock.now,
                               ticker=gpu.clock)


@pytest.mark.parametrize("dtype", ["fp64", "fp32", "tf32", "fp16", "bf16"])
@pytest.mark.parametrize("layout", ["nn", "nt", "tn", "tt"])
def test_measure_and_check_every_dtype_and_layout(gpu, dtype, layout):
    dev = _device(gpu)
    spec = ProbeSpec(48, 40, 36, dtype, "blas", 0, layout)
    m = measure(dev, spec, FAST, check=True)
    assert m.check_ok is True, m.check_error
    assert m.iterations >= FAST.min_iters and m.runtime_s > 0
    assert m.context["after"]["sm_clock_hz"] == 1.755e9


@pytest.mark.parametrize("tile", [1, 2, 4, 8, 16, 32])
def test_measure_and_check_the_tiled_kernel_at_every_tile(gpu, tile):
    dev = _device(gpu)
    m = measure(dev, ProbeSpec(37, 29, 23, "fp32", "tiled", tile), FAST, check=True)
    assert m.check_ok is True, m.check_error


class _WrongLeadingDim(CublasStandin):
    def gemm_ex(self, handle, transa, transb, m, n, k, alpha, a, atype, lda, b, btype, ldb,
                beta, c, ctype, ldc, compute, algo):  # reads B as if it were not transposed
        super().gemm_ex(handle, transa, 0, m, n, k, alpha, a, atype, lda, b, btype,
                        max(ldb, k), beta, c, ctype, ldc, compute, algo)


def test_the_check_catches_a_gemm_that_computes_the_wrong_thing(gpu):
    dev = _device(gpu, cublas_impl=_WrongLeadingDim(gpu))
    m = measure(dev, ProbeSpec(32, 32, 32, "fp32", "blas", 0, "nt"), FAST, check=True)
    assert m.check_ok is False


def test_small_gemms_replay_one_graph_per_chunk(gpu):
    dev = _device(gpu)
    spec = ProbeSpec(32, 32, 32, "fp32")  # 66 kFLOP: ~3 us on the stand-in, under a launch
    dev.prepare(spec)
    dev.run(spec, 1, threading.Event())  # sizes the chunk
    chunk = dev._chunks[dev._run_key(spec)]
    # Sized from warm graph replays: ~200 us of GPU time per graph (3.3 us per GEMM plus
    # the launch's 2 us spread over the chunk), not from the first, cold launch (its 5 us
    # cuBLAS call and 50 us upload would make it 4x too small).
    per = 2 * 32**3 / gpu.flops_per_s
    assert 0.8 * 200e-6 / per <= chunk <= 1.2 * 200e-6 / per
    dev.run(spec, 10, threading.Event())  # captures the chunk's graph
    before = dict(gpu.calls)
    run = dev.run_observed(spec, 5 * chunk, threading.Event())
    assert len(run.times) == 5 * chunk
    assert gpu.calls["graph_launches"] - before.get("graph_launches", 0) == 5
    assert gpu.calls["gemm_ex"] == before["gemm_ex"]  # no cuBLAS call: replayed


def test_the_chunk_grows_when_later_windows_show_faster_gemms(gpu):
    dev = _device(gpu)
    spec = ProbeSpec(32, 32, 32, "fp32")
    gpu.flops_per_s /= 4  # idle clocks while calibrating
    dev.run(spec, 1, threading.Event())
    first = dev._chunks[dev._run_key(spec)]
    gpu.flops_per_s *= 4  # clocks up
    dev.run(spec, 4 * first, threading.Event())
    assert dev._chunks[dev._run_key(spec)] >= 2 * first


def test_each_tile_replays_its_own_kernel(gpu):
    """Seen on the H200: tiles of one shape shared the first tile's graph, so every tile
    measured tile 1's kernel."""
    dev = _device(gpu)
    times = {}
    for tile in (1, 8, 32):
        spec = ProbeSpec(64, 64, 64, "fp32", "tiled", tile)
        times[tile] = measure(dev, spec, FAST).runtime_s
        assert gpu.calls.get(f"tiled{tile}_enqueued", 0) > 0
    assert times[1] > times[8] > times[32]
    one, other = (ProbeSpec(64, 64, 64, "fp32", "tiled", t) for t in (1, 32))
    assert dev._bufs.get(dev._key(one)) is dev._bufs.get(dev._key(other))  # shared inputs


def test_the_workspace_is_set_after_the_stream(gpu):
    """cublasSetStream resets the workspace to cuBLAS's pool: set first, ours would be
    dropped and cuBLAS would allocate inside every captured graph."""
    dev = _device(gpu)
    measure(dev, ProbeSpec(32, 32, 32, "bf16"), FAST)
    assert gpu.calls.get("graphs_captured", 0) > 0
    assert gpu.calls.get("allocations_during_capture", 0) == 0


def test_the_first_gemm_of_a_shape_runs_before_any_capture(gpu, caplog):
    """The stand-in's cuBLAS fails a capture that loads a kernel; a warm-up outside the
    capture loads it, and graphs stay on."""
    dev = _device(gpu)
    with caplog.at_level(logging.WARNING):
        for dtype in ("fp32", "bf16", "fp16"):
            measure(dev, ProbeSpec(48, 40, 36, dtype), FAST)
    assert "graph capture failed" not in caplog.text and dev._graphs_ok


def test_the_random_state_is_made_on_the_probe_stream(gpu):
    """The generator's state is written by a kernel on the stream current at construction;
    made on the legacy stream and read by the first draw on the probe stream without a
    wait, the stand-in reports the race."""
    dev = _device(gpu)
    dev.prepare(ProbeSpec(64, 64, 64, "fp32"))  # draws the inputs: no race
    with gpu.null:
        rng = dev.cp.random.default_rng(1)
    with dev.stream, pytest.raises(AssertionError, match="race"):
        rng.standard_normal(16)


@pytest.mark.parametrize("status, fault", [(700, True), (719, True), (214, True),
                                           (2, False), (1, False), (900, False)])
def test_only_sticky_cuda_errors_are_faults(gpu, status, fault):
    dev = _device(gpu)
    dev.prepare(ProbeSpec(64, 64, 64, "fp32"))
    gpu.sticky = CUDARuntimeError(status)
    with pytest.raises(DeviceError) as e:
        dev.run(ProbeSpec(64, 64, 64, "fp32"), 3, threading.Event())
    assert isinstance(e.value, DeviceFault) is fault


def test_a_missing_cublas_library_is_unavailable_not_a_traceback(gpu, monkeypatch):
    from cuda import pathfinder

    def missing(name):
        raise pathfinder.DynamicLibNotFoundError(f"Failure finding lib{name}.so")
    monkeypatch.setattr(pathfinder, "load_nvidia_dynamic_lib", missing)
    assert issubclass(pathfinder.DynamicLibNotFoundError, RuntimeError)
    with pytest.raises(OSError, match="cuBLAS not found: Failure finding libcublas.so"):
        cublas.library_path()
    nvml_ = Nvml(FakePynvml(_gpus()))
    with pytest.raises(DeviceUnavailable, match="cannot load cuBLAS"):
        nvidia.NvidiaDevice(nvml_.discover()[0], memory_budget=1 << 30, nvml=nvml_,
                            cupy=make_cupy(["0000:18:00.0"], gpu), clock=gpu.clock.now,
                            ticker=gpu.clock)


def test_graph_capture_failure_falls_back_to_direct_launches(gpu, caplog):
    gpu.capture_error = CUDARuntimeError(900)  # cudaErrorStreamCaptureUnsupported
    dev = _device(gpu)
    with caplog.at_level(logging.WARNING):
        m = measure(dev, ProbeSpec(32, 32, 32, "bf16"), FAST, check=True)
    assert m.check_ok is True and "graph capture failed" in caplog.text


def test_no_event_is_created_inside_the_energy_window(gpu):
    dev = _device(gpu)
    spec = ProbeSpec(32, 32, 32, "fp16")
    measure(dev, spec, FAST)
    run = dev.run_observed(spec, 400, threading.Event())
    assert not [t for t in gpu.event_creations if run.t0 <= t <= run.t1]


def test_inputs_are_ready_before_the_first_gemm_reads_them(gpu):
    """The stand-in raises on a read of an array another stream is still writing: inputs
    made on CuPy's legacy stream and read from the probe's non-blocking stream would."""
    dev = _device(gpu)
    for dtype in ("fp32", "bf16", "fp16", "fp64"):
        spec = ProbeSpec(64, 64, 64, dtype)
        dev.prepare(spec)
        dev.run(spec, 2, threading.Event())
    # The check itself: an input written on the legacy stream, never waited for.
    bufs = dev._bufs.get(dev._key(spec))
    with gpu.null:
        bufs["a"] = dev.cp.random.default_rng(7).standard_normal(64 * 64, dtype=np.float64)
    bufs["graphs"].clear()
    with pytest.raises(AssertionError, match="race"):
        dev.run(spec, 2, threading.Event())


def test_evicted_buffers_go_back_to_the_driver(gpu):
    budget = 3 * (4 * 3 * 256 * 256)  # room for three fp32 256^3 shapes
    dev = _device(gpu, budget=budget)
    baseline = gpu.pool.held  # the cuBLAS workspace
    for k in range(256, 256 + 64 * 10, 64):
        dev.prepare(ProbeSpec(256, 256, k, "fp32"))
    assert gpu.calls.get("free_all_blocks", 0) > 0
    held = gpu.pool.held - baseline
    assert held <= budget, f"GPU holds {held} bytes over a budget of {budget}"


def test_a_sticky_cuda_error_is_a_device_fault(gpu):
    dev = _device(gpu)
    spec = ProbeSpec(64, 64, 64, "fp32")
    dev.prepare(spec)
    gpu.sticky = CUDARuntimeError(700)  # cudaErrorIllegalAddress: the context is lost
    with pytest.raises(DeviceFault, match="GPU 0: run blas-fp32-nn-64x64x64: "
                                          "CUDARuntimeError: cudaErrorIllegalAddress"):
        dev.run(spec, 3, threading.Event())


class _Refusing(CublasStandin):
    def gemm_ex(self, *args):
        raise cublas.CublasError("cublasGemmEx", 15)  # CUBLAS_STATUS_NOT_SUPPORTED


def test_a_cublas_refusal_is_a_device_error_not_a_fault(gpu):
    dev = _device(gpu, cublas_impl=_Refusing(gpu))
    with pytest.raises(DeviceError, match="CUBLAS_STATUS_NOT_SUPPORTED") as e:
        dev.run(ProbeSpec(64, 64, 64, "fp32"), 3, threading.Event())
    assert not isinstance(e.value, DeviceFault)


def test_energy_steps_are_watched_from_another_thread_while_the_gpu_works(gpu):
    dev = _device(gpu, energy_mj=stepping_counter(300.0, gpu.clock, step_s=0.01))
    spec = ProbeSpec(96, 96, 96, "fp32")  # ~90 us per GEMM on the stand-in
    m = measure(dev, spec, MeasureConfig(window_s=0.15, warmup_s=0.02))
    assert m.context["after"]["energy_method"] == "steps"
    assert m.power_w == pytest.approx(300.0, rel=0.1)
    assert m.energy_j == pytest.approx(300.0 * m.runtime_mean_s, rel=0.1)


@pytest.mark.parametrize("late_s", [0.0, 0.004])
def test_a_window_sized_at_warm_up_clocks_ends_at_its_time_when_the_clocks_drop(
        gpu, monkeypatch, late_s):
    """Seen on the H200: the bf16 probe's 0.5 s window, sized on the warm-up's GEMMs at
    1980 MHz, ran 0.577 s once the power cap brought the clocks to 1530 MHz (15% more GPU
    time a round). The window now stops enqueuing when what is queued reaches its time, a
    chunk at most beyond it, and never leaves the GPU waiting on the host, also where the
    host wakes late from each wait (4 ms here: under the 5 ms queued for a 50 ms window)."""
    real_sync = Event.synchronize

    def late(self):  # a wait that blocks wakes late; one on work done returns at once
        waits = gpu.clock.now() < (self.t or 0.0)
        real_sync(self)
        if waits:
            gpu.clock.sleep(late_s)

    monkeypatch.setattr(Event, "synchronize", late)
    dev = _device(gpu, energy_mj=stepping_counter(300.0, gpu.clock, step_s=0.01))
    spec = ProbeSpec(96, 96, 96, "fp32")  # ~90 us per GEMM on the stand-in: chunks of 3
    real = dev.run_observed

    def power_capped(*args, **kwargs):
        gpu.flops_per_s /= 1.3  # the clocks drop as the window starts
        return real(*args, **kwargs)

    dev.run_observed = power_capped
    cfg = MeasureConfig(window_s=0.05, warmup_s=0.01)
    m = measure(dev, spec, cfg)
    chunk = dev._chunks[dev._run_key(spec)]
    gpu_s = m.runtime_mean_s * m.iterations  # the GEMMs' own (event) times
    assert cfg.window_s <= gpu_s <= cfg.window_s + 2 * chunk * m.runtime_s
    # Back to back: the GEMMs fill the window but for the host's last wake (the host
    # waited on the GPU, never the GPU on the host), energy from the counter's steps.
    assert gpu_s - 1e-9 <= m.window_s <= gpu_s + late_s + 1e-9
    assert m.context["after"]["energy_method"] == "steps"
    # What it was sized for at the warm-up's clocks would have run 30% over.
    sized = iterations_for_window(m.runtime_s / 1.3, cfg.window_s, 3, 100_000)
    assert m.iterations < sized and sized * m.runtime_s > 1.25 * cfg.window_s


def test_a_window_sized_on_a_slow_warm_up_still_runs_its_time(gpu):
    """Seen on the H100: the fp32 sentinel's warm-up ran on clocks still recovering from
    the power-capped probe before it, so the GEMMs it sized the 0.5 s window for ran out
    at 0.38-0.49 s. The time bound, not the warm-up's count, ends the window now."""
    dev = _device(gpu, energy_mj=stepping_counter(300.0, gpu.clock, step_s=0.01))
    spec = ProbeSpec(256, 256, 256, "fp32")  # ~1.7 ms per GEMM on the stand-in: chunk 1
    real = dev.run_observed
    gpu.flops_per_s /= 1.3  # the warm-up's clocks

    def recovered(*args, **kwargs):
        gpu.flops_per_s *= 1.3  # back to full clocks as the window starts
        return real(*args, **kwargs)

    dev.run_observed = recovered
    cfg = MeasureConfig(window_s=0.1, warmup_s=0.01)
    m = measure(dev, spec, cfg)
    per = 2 * 256**3 / gpu.flops_per_s
    assert m.runtime_s == pytest.approx(per, rel=0.05)
    assert cfg.window_s <= m.runtime_mean_s * m.iterations <= cfg.window_s + 2 * per
    assert cfg.window_s <= m.window_s
    # What the warm-up's pace asked for would have run a quarter short.
    assert iterations_for_window(1.3 * per, cfg.window_s, 3, 100_000) * per \
        < 0.8 * cfg.window_s


def test_clocks_that_drop_late_in_the_window_are_paced_by_the_last_chunks(gpu):
    """The GEMMs still queued are costed at the pace of the last chunks that ran, not the
    window's average: clocks 30% slower 0.3 s into a 0.5 s window overshot by 13 ms, now
    by at most a chunk or two. (What is queued when the slower chunks first end can't be
    taken back: a drop in the window's last ~50 ms overshoots by the queue times it.)"""
    dev = _device(gpu)
    spec = ProbeSpec(256, 256, 256, "fp32")  # ~1.7 ms per GEMM on the stand-in: chunk 1
    dev.prepare(spec)
    dev.run(spec, 2, threading.Event())
    per = 2 * 256**3 / gpu.flops_per_s
    start = gpu.clock.now()
    sid = []

    def drop():
        gpu.flops_per_s /= 1.3
        gpu.clock.unsubscribe(sid[0])

    sid.append(gpu.clock.subscribe(drop, 0.3))
    run = dev.run_observed(spec, math.ceil(0.5 / per), threading.Event(), max_s=0.5)
    assert gpu.clock.now() - start > 0.3  # the clocks did drop inside the window
    assert 0.5 <= sum(run.times) <= 0.5 + 2 * (1.3 * per)


def test_a_lost_gpu_fails_the_window_though_the_watcher_reads_first(gpu):
    """The window's e0 is the watcher's first reading; where that failed (a GPU lost),
    the counter is read again so that the run fails as it did, not a window without
    energy."""
    dev = _device(gpu, energy_mj=stepping_counter(300.0, gpu.clock))
    spec = ProbeSpec(96, 96, 96, "fp32")
    dev.run(spec, 3, threading.Event())
    dev.h["lost"] = True
    with pytest.raises(DeviceError, match="GPU is lost"):
        dev.run_observed(spec, 10, threading.Event(), max_s=0.01)


def test_a_slow_gemm_still_runs_min_iters(gpu):
    """min_iters holds under the time bound: a 13 ms GEMM in a 20 ms window ran 2."""
    dev = _device(gpu)
    spec = ProbeSpec(640, 640, 320, "fp32")  # ~13 ms per GEMM on the stand-in
    m = measure(dev, spec, MeasureConfig(window_s=0.02, warmup_s=0.0, min_iters=3))
    assert m.runtime_s > 0.01 and m.iterations == 3


def test_the_warm_up_reads_no_energy_counter_and_the_window_few(gpu):
    """The warm-up's calls cost the H200 ~26 ms of host time each beyond their GEMMs; the
    energy reads and their watcher were in every one. The warm-up has no use for them."""
    counter = stepping_counter(300.0, gpu.clock, step_s=0.01)
    reads = {"warm-up": 0, "other": 0}
    phase = ["other"]

    def read():
        reads[phase[0]] += 1
        return counter()

    dev = _device(gpu, energy_mj=read)
    real = dev.run
    calls = []

    def warm_up(spec, n, cancel):
        phase[0] = "warm-up"
        calls.append(n)
        try:
            return real(spec, n, cancel)
        finally:
            phase[0] = "other"

    dev.run = warm_up
    m = measure(dev, ProbeSpec(96, 96, 96, "fp32"), MeasureConfig(window_s=0.05,
                                                                  warmup_s=0.01))
    assert reads["warm-up"] == 0 and m.context["after"]["energy_method"] == "steps"
    assert len(calls) == 2  # one GEMM (maybe cold), then what 10 ms still needs


def test_energy_watcher_keeps_only_changes():
    clock = VirtualClock()
    values = iter([1.0, 1.0, 2.0, 2.0, 3.0] + [3.0] * 100)
    with energy_watch._EnergyWatcher(lambda: next(values), period=0.001, clock=clock.now,
                               ticker=clock) as w:
        clock.sleep(0.05)
    assert w.steps == [(pytest.approx(1000.002), 2.0), (pytest.approx(1000.004), 3.0)]


def test_energy_watcher_thread_polls_until_stopped():
    values = iter([1.0, 2.0] + [3.0] * 1_000_000)
    with energy_watch._EnergyWatcher(lambda: next(values), period=0.0001) as w:
        while len(w.steps) < 2:  # however slow the machine, both changes are seen
            time.sleep(0.001)
    assert [e for _, e in w.steps] == [2.0, 3.0] and w.error is None


def test_tiled_kernel_grid_limit_is_refused_with_a_reason():
    reason = nvidia.unsupported(ProbeSpec(70_000, 64, 64, "fp32", "tiled", 1), (9, 0))
    assert "gridDim.y limit of 65535" in reason and "tile of at least 2" in reason
    assert nvidia.unsupported(ProbeSpec(70_000, 64, 64, "fp32", "tiled", 2), (9, 0)) is None


def test_prepare_refuses_an_unsupported_probe(gpu):
    with pytest.raises(UnsupportedProbe, match="gridDim.y"):
        _device(gpu).prepare(ProbeSpec(70_000, 8, 8, "fp32", "tiled", 1))


def test_cuda_ordinals_are_mapped_through_pci_bus_ids():
    gpus = [{"uuid": "GPU-slow", "bus": "00000000:18:00.0", "name": "NVIDIA T4"},
            {"uuid": "GPU-fast", "bus": "00000000:3B:00.0", "name": "NVIDIA H100"}]
    recs = Nvml(FakePynvml(gpus)).discover()
    # CUDA numbers the H100 first (fastest first): CUDA_VISIBLE_DEVICES=0 is the H100.
    assert [r.uuid for r in visible.visible(recs, "0", ["0000:3B:00.0"])] == ["GPU-fast"]
    assert [r.uuid for r in visible.visible(recs, "1,0", ["0000:18:00.0", "0000:3B:00.0"])
            ] == ["GPU-slow", "GPU-fast"]
    assert [r.uuid for r in visible.visible(recs, "GPU-fast", None)] == ["GPU-fast"]


@pytest.mark.skipif(GPU, reason="there is a GPU: NVML starts")
def test_real_nvml_without_a_driver_is_unavailable_not_a_traceback():
    with pytest.raises(DeviceUnavailable, match="^NVML cannot start: NVML Shared Library"):
        Nvml()
    with pytest.raises(DeviceUnavailable):
        nvidia.open_all(memory_budget=1 << 30)


def test_gemmd_probe_runs_without_apscheduler_and_runs_the_whole_plan(tmp_path):
    """A bare GPU machine has no APScheduler; and the sweep's tail must not be cut by the
    daemon's duty-cycle budget (here 2 s a round, for 40 probes of 1.2 s device time)."""
    import subprocess
    import sys

    cfg = tmp_path / "gemmd.yaml"
    cfg.write_text("backend: fake\nisolation: thread\nschedule: {probe_interval_s: 2}\n"
                   "budget: {duty_cycle: 1.0}\nfake: {devices: [{model: H100-SXM}]}\n")
    shapes = [a for s in (512, 1024, 2048, 4096, 8192) for a in ("--shape", f"{s}x{s}x{s}")]
    dtypes = [a for d in ("fp32", "bf16") for a in ("--dtype", d)]
    layouts = [a for lay in ("nn", "nt", "tn", "tt") for a in ("--layout", lay)]
    code = ("import sys; sys.modules['apscheduler'] = None; from gemmd.cli import main; "
            "sys.exit(main(sys.argv[1:]))")
    r = subprocess.run([sys.executable, "-c", code, "probe", "--config", str(cfg),
                        "--no-store", "--force", "--format", "csv", "--window", "0.2",
                        *shapes, *dtypes, *layouts],
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    rows = r.stdout.strip().splitlines()[1:]
    assert len(rows) == 5 * 2 * 4 and all(",ok," in row for row in rows), r.stdout[-2000:]


def test_discovery_records_the_driver_cuda_and_vbios_versions():
    rec = Nvml(FakePynvml(_gpus())).discover()[0]
    assert (rec.driver_version, rec.cuda_driver_version, rec.vbios_version) == \
        ("580.95.05", "13.0", "96.00.99.00.01")


def test_memory_held_by_others_sees_what_the_process_list_cannot(gpu):
    import os

    from gemmd.devices.base import BusyLimits

    me = os.getpid()
    # Our own context (600 MiB) is not someone else's work; 2 GiB more is, even though no
    # other process is listed (another container: NVML lists our PID namespace only).
    dev = _device(gpu, procs={me: 600 << 20}, mem_used=(600 << 20) + (2 << 30))
    assert dev.nvml.memory_used_by_others(dev.h) == 2 << 30
    assert dev.busy_reason(BusyLimits(memory_bytes=256 << 20)) == "other_memory"
    assert dev.busy_reason(BusyLimits(memory_bytes=4 << 30)) is None
    assert dev.busy_reason(BusyLimits(memory_bytes=0)) is None  # 0: not a signal
    idle = _device(Gpu(), procs={me: 600 << 20}, mem_used=600 << 20)
    assert idle.busy_reason(BusyLimits()) is None
    assert _device(Gpu(), util=35).busy_reason(BusyLimits(utilization=0.3)) == "utilization"
    assert _device(Gpu(), util=35).busy_reason(BusyLimits(utilization=0.5)) is None
    assert _device(Gpu(), pids=[4242]).busy_reason() == "other_processes"


def test_a_catalogued_gpu_carries_its_datasheet_figures(gpu):
    """The stand-in reports an H100 by NVML's name: the device describes it by the
    catalogue's datasheet (as offline data do), keeping the clock-derived peaks aside."""
    dev = _device(gpu)
    assert dev.info.extra.get("catalogue")
    assert dev.info.peak_flops["bf16"] == pytest.approx(989e12, rel=0.02)
    assert "peak_flops_clock" in dev.info.extra
