"""NVIDIA backend: cuBLAS GEMMs and the paper's tiled kernel through CuPy, NVML telemetry.

Imported only when the backend is auto or nvidia. Discovery runs on NVML alone in the
daemon; each GPU's CuPy side lives in its own worker process (``worker.py``) by default.
cuBLAS is column-major: layout "nt" means op(A) = A, op(B) = B^T, as in cuBLAS and CUTLASS
names. The tiled kernel is row-major, as written in the paper.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict
from importlib import resources
from typing import Any

import numpy as np

from gemmd.devices.base import BufferCache, Device, DeviceInfo
from gemmd.devices.nvml import GpuRecord, Nvml, parse_visible_devices
from gemmd.errors import DeviceError, DeviceUnavailable, UnsupportedProbe
from gemmd.probes import DTYPE_BYTES, OUT_BYTES, ProbeSpec, check_result

logger = logging.getLogger(__name__)

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

# cuBLAS / CUDA enum values (cublas_api.h, library_types.h); stable across CUDA 11-13.
CUDA_R = {"fp64": 1, "fp32": 0, "tf32": 0, "fp16": 2, "bf16": 14}
CUBLAS_COMPUTE = {"fp64": 70, "fp32": 68, "tf32": 77, "fp16": 68, "bf16": 68}
CUBLAS_OP = {"n": 0, "t": 1}
CUBLAS_GEMM_DEFAULT = -1
_MIN_CHUNK_S = 200e-6  # time per CUDA-event pair at least this long
_CHECK_ROWS, _CHECK_COLS = 8, 256


def _arch(cc: tuple[int, int]) -> dict[str, int]:
    """Per-SM rates of ``cc``, or of the nearest older known architecture."""
    known = sorted(k for k in _PER_SM_CLOCK if k <= tuple(cc)) or [min(_PER_SM_CLOCK)]
    return _PER_SM_CLOCK[known[-1]]


def peak_flops(cc: tuple[int, int], sm_count: int, sm_clock_hz: float) -> dict[str, float]:
    """Dense peak FLOP/s per dtype."""
    return {d: v * sm_count * sm_clock_hz for d, v in _arch(cc).items()}


def bandwidth(bus_width_bits: int | None, max_mem_clock_hz: float | None) -> float:
    """Peak DRAM bandwidth, bytes/s: bus width x memory clock x 2 (double data rate)."""
    if not bus_width_bits or not max_mem_clock_hz:
        return 0.0
    return bus_width_bits / 8 * max_mem_clock_hz * 2


def blas_args(spec: ProbeSpec) -> dict[str, int]:
    """cuBLAS gemmEx arguments for a column-major C(m x n) = op(A)(m x k) op(B)(k x n)."""
    ta, tb = spec.layout[0], spec.layout[1]
    return {"transa": CUBLAS_OP[ta], "transb": CUBLAS_OP[tb],
            "lda": spec.m if ta == "n" else spec.k, "ldb": spec.k if tb == "n" else spec.n,
            "ldc": spec.m}


def logical(flat: np.ndarray, rows: int, cols: int, stored: str) -> np.ndarray:
    """The logical rows x cols matrix held in a flat buffer.

    ``stored``: "n" column-major as is (cuBLAS op N), "t" the transpose stored
    column-major (op T), "r" row-major (the tiled kernel).
    """
    if stored == "n":
        return flat.reshape(cols, rows).T
    return flat.reshape(rows, cols)  # "t" (col-major transpose) and "r" are the same bytes


def bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (uint16), round to nearest even."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return rounded.astype(np.uint16)


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    return (np.asarray(bits, dtype=np.uint32) << 16).view(np.float32)


def chunk_size(per_iter_s: float | None) -> int:
    """GEMMs per CUDA-event pair: one each for slow GEMMs, enough for ~200 us otherwise."""
    if not per_iter_s or per_iter_s >= _MIN_CHUNK_S or not math.isfinite(per_iter_s):
        return 1
    return int(math.ceil(_MIN_CHUNK_S / per_iter_s))


def unsupported(spec: ProbeSpec, cc: tuple[int, int], budget: int) -> str | None:
    """Why this GPU (compute capability ``cc``) can't run ``spec``, or None. Pure."""
    if spec.kernel == "tiled":
        if spec.dtype != "fp32":
            return "the tiled kernel is fp32 only"
    elif spec.dtype == "fp8":
        return "fp8 GEMMs need cuBLASLt, which CuPy does not expose"
    elif spec.dtype in ("tf32", "bf16") and tuple(cc) < (8, 0):
        return f"{spec.dtype} needs compute capability 8.0 or newer (GPU has {cc[0]}.{cc[1]})"
    if spec.dtype not in _arch(cc):
        return f"no {spec.dtype} support on compute capability {cc[0]}.{cc[1]}"
    need = buffer_bytes(spec)
    if need > budget:
        return f"needs {need / 2**20:.0f} MiB, over the memory budget of {budget / 2**20:.0f} MiB"
    return None


def buffer_bytes(spec: ProbeSpec) -> int:
    ib, ob = DTYPE_BYTES[spec.dtype], OUT_BYTES[spec.dtype]
    return ib * (spec.m * spec.k + spec.k * spec.n) + ob * spec.m * spec.n


def visible(records: list[GpuRecord], env: str | None) -> list[GpuRecord]:
    """The GPUs CUDA_VISIBLE_DEVICES lets this process use, in NVML index order."""
    wanted = parse_visible_devices(env)
    if wanted is None:
        return records
    out = []
    for w in wanted:
        for r in records:
            hit = (w.isdigit() and r.index == int(w)) or (not w.isdigit() and (
                r.uuid.startswith(w) or any(m.startswith(w) for m in r.mig_instances)))
            if hit and r not in out:
                out.append(r)
    return out


def open_all(*, memory_budget: int, isolation: str = "process", seed: int = 0) -> list[Device]:
    """Every usable GPU; MIG-enabled GPUs are reported and left out."""
    nvml = Nvml()
    records = visible(nvml.discover(), os.environ.get("CUDA_VISIBLE_DEVICES"))
    if not records:
        raise DeviceUnavailable("NVML reports no GPU visible to this process "
                                f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})")
    devices: list[Device] = []
    for r in records:
        if r.mig_enabled:
            logger.warning("GPU %d (%s) is in MIG mode with %d instance(s) %s: probing MIG "
                           "instances is not supported (no per-instance energy counter); "
                           "left out", r.index, r.uuid, len(r.mig_instances),
                           ", ".join(r.mig_instances) or "")
            continue
        kwargs = {"record": r, "memory_budget": memory_budget, "seed": seed}
        try:
            if isolation == "thread":
                devices.append(NvidiaDevice(**kwargs))
            else:
                from gemmd.devices.worker import WorkerDevice

                devices.append(WorkerDevice(("nvidia", kwargs), f"GPU {r.index}"))
        except (DeviceError, DeviceUnavailable) as e:
            logger.error("GPU %d (%s): cannot be opened: %s", r.index, r.uuid, e)
    if not devices:
        raise DeviceUnavailable("no GPU could be opened for probing (see errors above)")
    return devices


class NvidiaDevice(Device):
    def __init__(self, record: GpuRecord, *, memory_budget: int, seed: int = 0,
                 nvml: Nvml | None = None):
        try:
            import cupy
        except ImportError as e:
            raise DeviceUnavailable("CuPy is not installed (pip install 'gemmd[cuda12]')") from e
        self.cp = cupy
        self.record = record
        self.nvml = nvml or Nvml()
        self.h = self.nvml.handle(record.index)
        self._errors = _cupy_errors(cupy)
        with self._translate("open"):
            ordinal = self._ordinal(record.pci_bus_id)
            self.dev = cupy.cuda.Device(ordinal)
            self.dev.use()
            props = cupy.cuda.runtime.getDeviceProperties(ordinal)
            self.stream = cupy.cuda.Stream(non_blocking=True)
            from cupy_backends.cuda.libs import cublas

            self.cublas = cublas
            self.handle = cupy.cuda.device.get_cublas_handle()
        sm = int(props["multiProcessorCount"])
        clock = record.max_sm_clock_hz or float(props["clockRate"]) * 1e3
        self.info = DeviceInfo(
            index=record.index, uuid=record.uuid, name=record.name, backend="nvidia",
            peak_flops=peak_flops(record.compute_capability, sm, clock),
            mem_bandwidth=bandwidth(record.mem_bus_width_bits, record.max_mem_clock_hz),
            sm_count=sm, memory_bytes=record.memory_bytes, power_limit_w=record.power_limit_w,
            extra={"pci_bus_id": record.pci_bus_id, "cuda_ordinal": ordinal,
                   "compute_capability": "{}.{}".format(*record.compute_capability),
                   "record": asdict(record)})
        self._budget = memory_budget
        self._rng = cupy.random.default_rng(seed)
        self._host_rng = np.random.default_rng(seed)
        self._bufs = BufferCache(memory_budget)
        self._kernels: dict[int, Any] = {}
        self._per_iter: dict[ProbeSpec, float] = {}

    # ---------------------------------------------------------------- helpers
    @contextlib.contextmanager
    def _translate(self, what: str) -> Iterator[None]:
        """CUDA, cuBLAS, NVRTC and allocation errors become DeviceError (cause kept)."""
        try:
            yield
        except self._errors as e:
            raise DeviceError(f"GPU {self.record.index}: {what}: {type(e).__name__}: "
                              f"{e}") from e

    def _ordinal(self, bus_id: str) -> int:
        """CUDA ordinal of the GPU with this PCI bus id (CUDA and NVML orders differ)."""
        rt = self.cp.cuda.runtime
        want = bus_id.lower()[-12:]
        for i in range(rt.getDeviceCount()):
            if rt.deviceGetPCIBusId(i).lower()[-12:] == want:
                return i
        raise DeviceUnavailable(f"GPU {self.record.index} ({bus_id}) is not visible to CUDA")

    # ---------------------------------------------------------------- Device
    def unsupported_reason(self, spec: ProbeSpec) -> str | None:
        return unsupported(spec, self.record.compute_capability, self._budget)

    def busy_reason(self) -> str | None:
        with self.nvml.errors(f"GPU {self.record.index}"):
            others = self.nvml.other_processes(self.h)
            if others:
                return "other_processes"
            util = self.nvml.utilization(self.h)
        # Utilization is sampled over the last second or so, after our own last round.
        return "utilization" if util is not None and util >= 0.10 else None

    def _key(self, spec: ProbeSpec) -> tuple:
        return (spec.m, spec.n, spec.k, spec.dtype, spec.kernel, spec.layout)

    def prepare(self, spec: ProbeSpec) -> None:
        reason = self.unsupported_reason(spec)
        if reason:
            raise UnsupportedProbe(f"{spec.name}: {reason}")
        key = self._key(spec)
        if self._bufs.get(key) is not None:
            return
        need = buffer_bytes(spec)
        self._bufs.make_room(need)
        cp = self.cp
        with self._translate(f"allocate {spec.name}"), self.dev:
            a = self._random(spec.m * spec.k, spec.dtype)
            b = self._random(spec.k * spec.n, spec.dtype)
            out = {"fp64": cp.float64, "fp32": cp.float32, "tf32": cp.float32,
                   "fp16": cp.float16, "bf16": cp.uint16}[spec.dtype]
            c = cp.zeros(spec.m * spec.n, dtype=out)
            self.stream.synchronize()
        self._bufs.put(key, {"a": a, "b": b, "c": c}, need)
        if spec.kernel == "tiled":
            self._kernel(spec.tile)

    def _random(self, size: int, dtype: str) -> Any:
        """Random normal inputs on the device (never zeros: they run faster)."""
        cp = self.cp
        if dtype == "fp64":
            return self._rng.standard_normal(size, dtype=cp.float64)
        x = self._rng.standard_normal(size, dtype=cp.float32)
        if dtype == "fp16":
            return x.astype(cp.float16)
        if dtype == "bf16":
            u = x.view(cp.uint32)
            return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(cp.uint16)
        return x

    def _kernel(self, tile: int) -> Any:
        if tile not in self._kernels:
            src = resources.files("gemmd.kernels").joinpath("tiled_gemm.cu").read_text()
            with self._translate(f"compile tiled kernel TILE={tile}"):
                mod = self.cp.RawModule(code=src, options=(f"-DTILE={tile}",))
                self._kernels[tile] = mod.get_function("tiled_gemm")
        return self._kernels[tile]

    def _launcher(self, spec: ProbeSpec):
        bufs = self._bufs[self._key(spec)]
        a, b, c = bufs["a"], bufs["b"], bufs["c"]
        if spec.kernel == "tiled":
            t = spec.tile
            kern = self._kernel(t)
            grid = ((spec.n + t - 1) // t, (spec.m + t - 1) // t)
            args = (a, b, c, np.int32(spec.m), np.int32(spec.n), np.int32(spec.k))
            return lambda: kern(grid, (t, t), args)  # on the current stream
        ba = blas_args(spec)
        scalar = np.float64 if spec.dtype == "fp64" else np.float32
        one, zero = np.ones(1, dtype=scalar), np.zeros(1, dtype=scalar)
        dt, comp = CUDA_R[spec.dtype], CUBLAS_COMPUTE[spec.dtype]
        cublas, handle = self.cublas, self.handle  # CuPy binds the handle to the current stream

        def launch():
            cublas.gemmEx(handle, ba["transa"], ba["transb"], spec.m, spec.n, spec.k,
                          one.ctypes.data, a.data.ptr, dt, ba["lda"], b.data.ptr, dt, ba["ldb"],
                          zero.ctypes.data, c.data.ptr, dt, ba["ldc"], comp, CUBLAS_GEMM_DEFAULT)
        return launch

    def run(self, spec: ProbeSpec, iterations: int, cancel: threading.Event) -> list[float]:
        return self.run_observed(spec, iterations, cancel, watch=False)[0]

    def run_observed(self, spec: ProbeSpec, iterations: int, cancel: threading.Event,
                     watch: bool = True) -> tuple[list[float], list[tuple[float, float]]]:
        """Back-to-back GEMMs on one stream, timed with CUDA events per chunk.

        With ``watch``, the host polls NVML's energy counter while the GPU works (launches
        are asynchronous): between enqueued chunks, then every 0.5 ms until the last event
        completes, recording (time, joules) at each step.
        """
        cp = self.cp
        steps: list[tuple[float, float]] = []
        last = [self.energy_j() if watch else None]

        def poll() -> None:
            e = self.energy_j()
            if e is not None and e != last[0]:
                steps.append((time.monotonic(), e))
                last[0] = e

        chunk = chunk_size(self._per_iter.get(spec))
        sizes = [chunk] * (iterations // chunk) + ([iterations % chunk] if iterations % chunk
                                                   else [])
        times: list[float] = []
        with self._translate(f"run {spec.name}"), self.dev, self.stream:
            launch = self._launcher(spec)
            events = [cp.cuda.Event() for _ in range(len(sizes) + 1)]
            events[0].record(self.stream)
            done = 0
            for i, n in enumerate(sizes):
                for _ in range(n):
                    launch()
                events[i + 1].record(self.stream)
                done = i + 1
                if watch and last[0] is not None:
                    poll()
                if cancel.is_set():
                    break
            while watch and last[0] is not None and not events[done].query():
                poll()
                time.sleep(0.0005)
            events[done].synchronize()
            for i in range(done):
                ms = cp.cuda.get_elapsed_time(events[i], events[i + 1])
                times.extend([ms / 1e3 / sizes[i]] * sizes[i])
        if times:
            self._per_iter[spec] = float(np.median(times))
        # Only steps seen while the GPU was still busy with this work count.
        return times, steps

    def clock(self) -> float:
        return time.monotonic()

    def energy_j(self) -> float | None:
        return self.nvml.energy_j(self.h)

    def power_w(self) -> float | None:
        return self.nvml.power_w(self.h)

    def context(self) -> dict[str, Any]:
        with self.nvml.errors(f"GPU {self.record.index}"):
            ctx = self.nvml.context(self.h)
            ctx["other_processes"] = len(self.nvml.other_processes(self.h))
        return ctx

    def check(self, spec: ProbeSpec) -> tuple[bool, float]:
        """Sampled rows x columns of C against a float64 host reference of the same inputs."""
        bufs = self._bufs[self._key(spec)]
        rows = np.sort(self._host_rng.choice(spec.m, min(_CHECK_ROWS, spec.m), replace=False))
        cols = np.sort(self._host_rng.choice(spec.n, min(_CHECK_COLS, spec.n), replace=False))
        if spec.kernel == "tiled":
            sa = sb = sc = "r"
        else:
            sa, sb, sc = spec.layout[0], spec.layout[1], "n"
        with self._translate(f"check {spec.name}"), self.dev:
            self.stream.synchronize()
            a = logical(bufs["a"], spec.m, spec.k, sa)[rows, :]
            b = logical(bufs["b"], spec.k, spec.n, sb)[:, cols]
            c = logical(bufs["c"], spec.m, spec.n, sc)[rows][:, cols]
            a, b, c = (self._to_f64(self.cp.asnumpy(x), spec.dtype) for x in (a, b, c))
        return check_result(c, a @ b, np.abs(a) @ np.abs(b), spec.dtype, spec.k)

    @staticmethod
    def _to_f64(x: np.ndarray, dtype: str) -> np.ndarray:
        return (bf16_to_f32(x) if dtype == "bf16" else x).astype(np.float64)

    def close(self) -> None:
        self._bufs.clear()
        self._kernels.clear()


def _cupy_errors(cupy: Any) -> tuple[type[BaseException], ...]:
    """The exception types CuPy raises for CUDA, driver, cuBLAS, NVRTC and memory errors."""
    out: list[type[BaseException]] = []
    for path in ("cuda.runtime.CUDARuntimeError", "cuda.driver.CUDADriverError",
                 "cuda.memory.OutOfMemoryError", "cuda.compiler.CompileException"):
        obj: Any = cupy
        try:
            for part in path.split("."):
                obj = getattr(obj, part)
            out.append(obj)
        except AttributeError:
            continue
    try:
        from cupy_backends.cuda.libs.cublas import CUBLASError

        out.append(CUBLASError)
    except ImportError:
        pass
    return tuple(out) or (RuntimeError,)
