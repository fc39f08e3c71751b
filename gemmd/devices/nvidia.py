"""NVIDIA backend: cuBLAS GEMMs and the paper's tiled kernel, replayed from CUDA graphs
captured with CuPy; NVML telemetry.

Imported only when the backend is auto or nvidia. Discovery runs on NVML alone in the
daemon; each GPU's CuPy side lives in its own worker process (``worker.py``) by default.
cuBLAS is column-major: layout "nt" means op(A) = A, op(B) = B^T, as in cuBLAS and CUTLASS
names. The tiled kernel is row-major, as written in the paper.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict
from importlib import resources
from typing import Any

import numpy as np

from gemmd.devices.base import BufferCache, BusyLimits, Device, Run
from gemmd.devices.check import check_result
from gemmd.devices.cublas import (
    COMPUTE,
    CUDA_R,
    GEMM_DEFAULT,
    OP,
    STATUS_EXECUTION_FAILED,
    STATUS_INTERNAL_ERROR,
    WORKSPACE_BYTES,
    Cublas,
    CublasError,
)
from gemmd.devices.energy_watch import _EnergyWatcher
from gemmd.devices.nvml import GpuRecord, Nvml, parse_visible_devices
from gemmd.devices.visible import _bus, cuda_visible_bus_ids, visible
from gemmd.errors import DeviceError, DeviceFault, DeviceUnavailable
from gemmd.gemm import ProbeSpec
from gemmd.gpulibs import import_gpu_library
from gemmd.hardware import arch_rates, bandwidth, enrich_device_info, peak_flops
from gemmd.records import DeviceInfo

logger = logging.getLogger(__name__)

_MIN_CHUNK_S = 200e-6  # GPU time per CUDA-event pair (one graph launch) at least this long
_MAX_CHUNK = 4096  # GEMMs per captured graph at most
# GPU time kept queued ahead of the GPU while a window's time bound is watched (a tenth
# of a shorter window, never under 5 ms): a host that wakes late from its wait must not
# leave the GPU idle.
_QUEUE_S, _QUEUE_MIN_S = 0.05, 0.005
_MAX_GRID_Y = 65535  # CUDA's limit on gridDim.y
_CHECK_ROWS, _CHECK_COLS = 8, 256

def blas_args(spec: ProbeSpec) -> dict[str, int]:
    """cuBLAS gemmEx arguments for a column-major C(m x n) = op(A)(m x k) op(B)(k x n)."""
    ta, tb = spec.layout[0], spec.layout[1]
    return {"transa": OP[ta], "transb": OP[tb],
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
    """GEMMs per CUDA-event pair (one graph): one each for slow GEMMs, enough for ~200 us
    of GPU time otherwise, so that one graph launch per chunk keeps the GPU's queue full."""
    if not per_iter_s or per_iter_s >= _MIN_CHUNK_S or not math.isfinite(per_iter_s):
        return 1
    return int(min(_MAX_CHUNK, math.ceil(_MIN_CHUNK_S / per_iter_s)))


def unsupported(spec: ProbeSpec, cc: tuple[int, int]) -> str | None:
    """Why a GPU of compute capability ``cc`` can't run ``spec`` (the memory budget aside),
    or None. Pure."""
    if spec.kernel == "tiled":
        if spec.dtype != "fp32":
            return "the tiled kernel is fp32 only"
        rows = -(-spec.m // spec.tile)
        if rows > _MAX_GRID_Y:
            return (f"the tiled kernel would need {rows} thread blocks along M, over CUDA's "
                    f"gridDim.y limit of {_MAX_GRID_Y} (use a tile of at least "
                    f"{-(-spec.m // _MAX_GRID_Y)})")
    elif spec.dtype == "fp8":
        return "fp8 GEMMs need cuBLASLt, which CuPy does not expose"
    elif spec.dtype in ("tf32", "bf16") and tuple(cc) < (8, 0):
        return f"{spec.dtype} needs compute capability 8.0 or newer (GPU has {cc[0]}.{cc[1]})"
    if spec.dtype not in arch_rates(cc):
        return f"no {spec.dtype} support on compute capability {cc[0]}.{cc[1]}"
    return None


# cudaError_t / CUresult codes (the same numbers) after which the CUDA context is unusable
# ("sticky": every later call fails too) and the worker must be restarted. Others (out of
# memory, an invalid value, capture unsupported, not ready) leave the context working.
STICKY_CUDA_ERRORS = frozenset({
    214,  # ECC uncorrectable
    700,  # illegal address
    702,  # launch timeout
    709,  # context is destroyed
    710,  # device-side assert
    714,  # hardware stack error
    715,  # illegal instruction
    716,  # misaligned address
    717,  # invalid address space
    718,  # invalid PC
    719,  # launch failure
    999,  # unknown
})


def _sticky(e: BaseException) -> bool:
    """Whether a CUDA runtime/driver error leaves the context unusable (unknown: yes)."""
    status = getattr(e, "status", None)
    return not isinstance(status, int) or status in STICKY_CUDA_ERRORS




def open_all(*, memory_budget: int, isolation: str = "process", seed: int = 0) -> list[Device]:
    """Every usable GPU; MIG-enabled GPUs are reported and left out."""
    from gemmd.devices.worker import isolated

    nvml = Nvml()
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    wanted = parse_visible_devices(env) or []
    bus_ids = cuda_visible_bus_ids() if any(w.isdigit() for w in wanted) else None
    records = visible(nvml.discover(), env, bus_ids)
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
        factory = functools.partial(NvidiaDevice, record=r, memory_budget=memory_budget,
                                    seed=seed)
        try:
            devices.append(isolated(factory, f"GPU {r.index}", isolation))
        except (DeviceError, DeviceUnavailable) as e:
            logger.error("GPU %d (%s): cannot be opened: %s", r.index, r.uuid, e)
    if not devices:
        raise DeviceUnavailable("no GPU could be opened for probing (see errors above)")
    return devices




class NvidiaDevice(Device):
    """One GPU through CuPy (memory, streams, events, graphs, NVRTC) and cuBLAS (ctypes).

    ``cupy``, ``cublas``, ``nvml`` and the clock are injected in tests (stand-ins checked
    against the real libraries, a virtual clock); by default the real ones are used.
    """
    bounds_window = True  # run_observed() ends the window at max_s (see _run)

    def __init__(self, record: GpuRecord, *, memory_budget: int, seed: int = 0,
                 nvml: Nvml | None = None, cupy: Any = None, cublas: Cublas | None = None,
                 clock: Callable[[], float] = time.monotonic, ticker: Any = None):
        """``clock`` and ``ticker`` (tests: a virtual clock) time the host side: the
        energy window and the watcher's readings."""
        self._clock, self._ticker = clock, ticker
        if cupy is None:
            cupy = import_gpu_library("cupy", "CuPy")
        self.cp = cupy
        self.record = record
        self.nvml = nvml or Nvml()
        self.h = self.nvml.handle(record.index)
        self._errors, self._faults = _cupy_errors(cupy)
        self.handle = 0
        with self._translate("open"):
            ordinal = self._ordinal(record.pci_bus_id)
            self.dev = cupy.cuda.Device(ordinal)
            self.dev.use()
            props = cupy.cuda.runtime.getDeviceProperties(ordinal)
            self.stream = cupy.cuda.Stream(non_blocking=True)
            try:
                self.blas = cublas or Cublas()
            except OSError as e:
                raise DeviceUnavailable(f"GPU {record.index}: cannot load cuBLAS: {e}") from e
            self.handle = self.blas.create()
            # The stream first: cublasSetStream resets the handle's workspace to cuBLAS's
            # default pool (cuBLAS docs, cublasSetStream). Then a workspace of our own, so
            # that cuBLAS allocates nothing while a graph is captured.
            self.blas.set_stream(self.handle, self.stream.ptr)
            self._workspace = cupy.empty(WORKSPACE_BYTES, dtype=cupy.uint8)
            self.blas.set_workspace(self.handle, self._workspace.data.ptr, WORKSPACE_BYTES)
        sm = int(props["multiProcessorCount"])
        sm_clock = record.max_sm_clock_hz or float(props["clockRate"]) * 1e3
        # Datasheet figures where the catalogue knows the GPU (offline data only have
        # datasheets: the daemon's probes must describe a GPU model the same way).
        self.info = enrich_device_info(DeviceInfo(
            index=record.index, uuid=record.uuid, name=record.name, backend="nvidia",
            peak_flops=peak_flops(record.compute_capability, sm, sm_clock),
            mem_bandwidth=bandwidth(record.mem_bus_width_bits, record.max_mem_clock_hz),
            sm_count=sm, memory_bytes=record.memory_bytes, power_limit_w=record.power_limit_w,
            extra={"pci_bus_id": record.pci_bus_id, "cuda_ordinal": ordinal,
                   "driver_version": record.driver_version,
                   "cuda_driver_version": record.cuda_driver_version,
                   "vbios_version": record.vbios_version,
                   "compute_capability": "{}.{}".format(*record.compute_capability),
                   "record": asdict(record)}))
        self.memory_budget = memory_budget
        # The generator's state is initialised by a kernel on the current stream: the probe
        # stream, waited for, so that the first draw (on that stream) reads a ready state.
        with self._translate("open"), self.dev, self.stream:
            self._rng = cupy.random.default_rng(seed)
            self.stream.synchronize()
        self._host_rng = np.random.default_rng(seed)
        self._bufs = BufferCache(memory_budget)
        self._kernels: dict[int, Any] = {}
        self._chunks: dict[tuple, int] = {}  # GEMMs per graph, calibrated warm, refined
        self._events: list[Any] = []  # reused CUDA events
        self._graphs_ok = True
        self._has_counter = self.energy_j() is not None
        self._scalars: dict[type, tuple[np.ndarray, np.ndarray]] = {  # alpha 1, beta 0, kept
            np.float32: (np.ones(1, np.float32), np.zeros(1, np.float32)),
            np.float64: (np.ones(1, np.float64), np.zeros(1, np.float64))}

    # ---------------------------------------------------------------- helpers
    @contextlib.contextmanager
    def _translate(self, what: str) -> Iterator[None]:
        """CUDA, cuBLAS, NVRTC and allocation errors become DeviceError (cause kept); those
        that leave the CUDA context unusable become DeviceFault."""
        try:
            yield
        except self._errors as e:
            fatal = (isinstance(e, self._faults) and _sticky(e)) or (
                isinstance(e, CublasError) and e.status in (STATUS_EXECUTION_FAILED,
                                                            STATUS_INTERNAL_ERROR))
            cls = DeviceFault if fatal else DeviceError
            raise cls(f"GPU {self.record.index}: {what}: {type(e).__name__}: {e}") from e

    def _ordinal(self, bus_id: str) -> int:
        """CUDA ordinal of the GPU with this PCI bus id (CUDA and NVML orders differ)."""
        rt = self.cp.cuda.runtime
        want = _bus(bus_id)
        for i in range(rt.getDeviceCount()):
            if _bus(rt.deviceGetPCIBusId(i)) == want:
                return i
        raise DeviceUnavailable(f"GPU {self.record.index} ({bus_id}) is not visible to CUDA")

    # ---------------------------------------------------------------- Device
    def _unsupported(self, spec: ProbeSpec) -> str | None:
        return unsupported(spec, self.record.compute_capability)

    def busy_reason(self, limits: BusyLimits | None = None) -> str | None:
        """Other work on the GPU: compute processes NVML shows (only those of our PID
        namespace: in a container without hostPID, other pods' are invisible), then the
        GPU's utilization and the memory others hold, which NVML counts for everyone."""
        limits = limits or BusyLimits()
        with self.nvml.errors(f"GPU {self.record.index}"):
            if self.nvml.other_processes(self.h):
                return "other_processes"
            util = self.nvml.utilization(self.h)
            # Sampled over the last second or so, after our own last round.
            if util is not None and util >= limits.utilization:
                return "utilization"
            others = self.nvml.memory_used_by_others(self.h)
        if others is not None and limits.memory_bytes and others >= limits.memory_bytes:
            return "other_memory"
        return None

    def _key(self, spec: ProbeSpec) -> tuple:
        """The buffers' key: tiles of one shape share their inputs and output."""
        return (spec.m, spec.n, spec.k, spec.dtype, spec.kernel, spec.layout)

    def _run_key(self, spec: ProbeSpec) -> tuple:
        """The key of what is launched: a graph or a chunk size is the tile's own."""
        return (*self._key(spec), spec.tile)

    def _allocate(self, spec: ProbeSpec) -> None:
        key = self._key(spec)
        if self._bufs.get(key) is not None:
            if spec.kernel == "tiled":
                self._kernel(spec.tile)
            return
        need = spec.buffer_bytes
        cp = self.cp
        with self._translate(f"allocate {spec.name}"), self.dev:
            if self._bufs.make_room(need):
                # Evicted arrays go back to CuPy's pool; hand the pool's free blocks back
                # to the driver so that the budget bounds what the GPU really holds.
                self.stream.synchronize()
                cp.get_default_memory_pool().free_all_blocks()
            # Generated on the probe stream and waited for there: the first GEMM must not
            # read inputs still being written.
            with self.stream:
                a = self._random(spec.m * spec.k, spec.dtype)
                b = self._random(spec.k * spec.n, spec.dtype)
                out = {"fp64": cp.float64, "fp32": cp.float32, "tf32": cp.float32,
                       "fp16": cp.float16, "bf16": cp.uint16}[spec.dtype]
                c = cp.zeros(spec.m * spec.n, dtype=out)
            self.stream.synchronize()
        # Buffers serve every tile of a shape; graphs are kept per (tile, GEMMs per graph).
        self._bufs.put(key, {"a": a, "b": b, "c": c, "graphs": {}}, need)
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
            with self._translate(f"compile tiled kernel TILE={tile}"), self.dev:
                mod = self.cp.RawModule(code=src, options=(f"-DTILE={tile}",))
                self._kernels[tile] = mod.get_function("tiled_gemm")
        return self._kernels[tile]

    def _launcher(self, spec: ProbeSpec, bufs: dict[str, Any]) -> Any:
        """A no-argument callable that enqueues one GEMM on the probe stream; everything
        it needs (pointers, scalars, enums) is computed here, once."""
        a, b, c = bufs["a"], bufs["b"], bufs["c"]
        if spec.kernel == "tiled":
            t = spec.tile
            kern = self._kernel(t)
            grid = ((spec.n + t - 1) // t, (spec.m + t - 1) // t)
            args = (a, b, c, np.int32(spec.m), np.int32(spec.n), np.int32(spec.k))
            return lambda: kern(grid, (t, t), args)  # on the current stream: ours
        ba = blas_args(spec)
        one, zero = self._scalars[np.float64 if spec.dtype == "fp64" else np.float32]
        gemm = self.blas.gemm_ex
        dt = CUDA_R[spec.dtype]
        call = (self.handle, ba["transa"], ba["transb"], spec.m, spec.n, spec.k,
                one.ctypes.data, a.data.ptr, dt, ba["lda"], b.data.ptr, dt, ba["ldb"],
                zero.ctypes.data, c.data.ptr, dt, ba["ldc"], COMPUTE[spec.dtype],
                GEMM_DEFAULT)
        return lambda: gemm(*call)  # on the handle's stream: ours

    def _replay(self, spec: ProbeSpec, bufs: dict[str, Any], n: int) -> Any:
        """A callable that enqueues ``n`` GEMMs: one launch of a CUDA graph captured once
        (cached with the buffers), or, where capture fails, ``n`` direct launches."""
        graphs = bufs["graphs"]
        gk = (spec.tile, n)
        if gk in graphs:
            return graphs[gk].launch
        launch = self._launcher(spec, bufs)
        if self._graphs_ok:
            try:
                self.stream.begin_capture()
                try:
                    for _ in range(n):
                        launch()
                finally:
                    graph = self.stream.end_capture()
                graphs[gk] = graph
                return graph.launch
            except self._errors as e:
                self._graphs_ok = False
                logger.warning("GPU %s: CUDA graph capture failed (%s: %s); launching GEMMs "
                               "one by one: small GEMMs will be timed host-bound",
                               self.record.index, type(e).__name__, e)

        def direct() -> None:
            for _ in range(n):
                launch()
        return direct

    def _event_pool(self, n: int) -> list[Any]:
        while len(self._events) < n:
            self._events.append(self.cp.cuda.Event())
        return self._events[:n]

    def _calibrate(self, spec: ProbeSpec, bufs: dict[str, Any]) -> int:
        """GEMMs per graph for a shape and tile, from warm launches: a first GEMM outside
        any capture (cuBLAS chooses its kernel and loads its module here, where an error is
        the probe's, not a failed capture that would turn graphs off for the device's
        lifetime), then one timed directly; if under ``_MIN_CHUNK_S``, graphs of growing
        chunks, each launched once untimed (the upload) then three times back to back,
        until the chunk stops growing. A cold or lone launch includes launch latency and
        would size the chunk too small. Runs inside ``_run``'s context (the warm-up's
        first call, as a rule)."""
        get_time = self.cp.cuda.get_elapsed_time
        a, b, c, d = self._event_pool(4)
        launch = self._launcher(spec, bufs)
        launch()  # the warm-up
        self.stream.synchronize()
        a.record(self.stream)
        launch()
        b.record(self.stream)
        b.synchronize()
        per = get_time(a, b) / 1e3
        chunk = chunk_size(per)
        if chunk == 1 or not self._graphs_ok:
            return 1
        for _ in range(4):
            replay = self._replay(spec, bufs, chunk)
            replay()  # uploads the graph: not timed
            a.record(self.stream)
            replay()
            b.record(self.stream)
            replay()
            c.record(self.stream)
            replay()
            d.record(self.stream)
            d.synchronize()
            best = min(get_time(a, b), get_time(b, c), get_time(c, d)) / 1e3
            new = chunk_size(best / chunk)
            if new <= chunk:
                break
            chunk = new
        return chunk

    def run(self, spec: ProbeSpec, iterations: int, cancel: threading.Event) -> list[float]:
        """The warm-up's GEMMs: timed with events, without the energy counter or its
        watcher. On the H200 each call cost ~26 ms of host time beyond its GEMMs
        (bench/call_overhead.py), and the watcher and the counter's reads are what only
        calls had; the warm-up has no use for them, and the window no longer depends on
        its sizing being exact (``max_s``)."""
        return self._run(spec, iterations, cancel, watch=False, max_s=None).times

    def run_observed(self, spec: ProbeSpec, iterations: int, cancel: threading.Event, *,
                     max_s: float | None = None, min_iters: int = 1) -> Run:
        """Back-to-back GEMMs on the probe stream, one graph launch per chunk of GEMMs and a
        CUDA event between chunks, the energy counter watched throughout.

        The chunk size is calibrated on the first call for a shape (``_calibrate``) and
        grown when a later window shows GEMMs faster than it assumed; graphs are captured
        before ``t0``, and ``iterations`` is rounded up to whole chunks. With ``max_s``
        the run also ends once the GEMMs queued reach ``max_s`` of GPU time at the pace
        so far: the host stays ~``_QUEUE_S`` of work ahead of the GPU (never starving it)
        and stops enqueuing there (never before ``min_iters`` GEMMs), so a window sized on
        warm-up clocks that then drop (the H200's bf16 probe: 1980 -> 1530 MHz at its
        power cap, a 0.5 s window ran 0.577 s) costs what it was configured to, give or
        take a chunk; it ends sooner where the iterations run out first.
        """
        return self._run(spec, iterations, cancel, watch=self._has_counter, max_s=max_s,
                         min_iters=min_iters)

    def _run(self, spec: ProbeSpec, iterations: int, cancel: threading.Event, *,
             watch: bool, max_s: float | None, min_iters: int = 1) -> Run:
        key = self._key(spec)
        bufs = self._bufs.get(key)
        if bufs is None:
            self.prepare(spec)
            bufs = self._bufs[key]
        key = self._run_key(spec)
        get_time = self.cp.cuda.get_elapsed_time
        with self._translate(f"run {spec.name}"), self.dev, self.stream:
            if key not in self._chunks:
                self._chunks[key] = self._calibrate(spec, bufs)
            chunk = self._chunks[key]
            n = max(1, -(-iterations // chunk))
            replay = self._replay(spec, bufs, chunk)
            events = self._event_pool(n + 1)
            # While a time bound is watched: queue (GPU seconds kept ahead of the GPU) and
            # lag (that many chunks, at the planned pace first, at the measured one later).
            bound = max_s if max_s is not None and max_s > 0 else math.inf
            queue = max(_QUEUE_MIN_S, min(_QUEUE_S, bound / 10))
            lag = max(1, math.ceil(queue * n / bound)) if bound < math.inf else n
            watcher: Any = _EnergyWatcher(self.energy_j, clock=self._clock,
                                          ticker=self._ticker) if watch else \
                contextlib.nullcontext()
            with watcher as w:
                # The watcher's first reading is the window's start: one NVML read fewer
                # (read again where it failed, so that a failing counter fails the run).
                e0 = (w.first if w.error is None else self.energy_j()) if w is not None else None
                t0 = self._clock()
                events[0].record(self.stream)
                done = 0
                for i in range(n):
                    replay()
                    events[i + 1].record(self.stream)
                    done = i + 1
                    if cancel.is_set():
                        break
                    j = done - lag  # the boundary to wait for: lag chunks stay queued
                    if j >= 1 and done < n and done * chunk >= min_iters:
                        events[j].synchronize()
                        ran = get_time(events[0], events[j]) / 1e3
                        # The pace of the last chunks that ran (clocks may have dropped
                        # since the first), for what is still queued.
                        k = max(0, j - lag)
                        pace = get_time(events[k], events[j]) / 1e3 / (j - k)
                        if ran + (done - j) * pace >= bound:
                            break  # what is queued fills the window
                        if pace > 0:
                            lag = max(lag, math.ceil(queue / pace))
                events[done].synchronize()
                t1 = self._clock()
                e1 = self.energy_j() if watch else None
            times: list[float] = []
            for i in range(done):
                times.extend([get_time(events[i], events[i + 1]) / 1e3 / chunk] * chunk)
        steps: list[tuple[float, float]] = []
        if w is not None:
            if w.error is not None:
                logger.debug("GPU %s: energy watcher: %s", self.record.index, w.error)
            # Only steps seen while the GPU was busy with this work count.
            steps = [s for s in w.steps if t0 <= s[0] <= t1]
        if times and self._graphs_ok:
            # Clocks ramp up after idle: a window that shows much faster GEMMs than the
            # calibration saw grows the chunk for the next call (never shrinks it).
            grown = chunk_size(float(np.median(times)))
            if grown >= 2 * chunk:
                self._chunks[key] = grown
        return Run(times, t0, t1, e0, e1, steps)

    def clock(self) -> float:
        return self._clock()

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
        self._events.clear()
        if self.handle:
            with contextlib.suppress(*self._errors), self.dev:
                self.blas.destroy(self.handle)
            self.handle = 0


def _cupy_errors(cupy: Any) -> tuple[tuple[type[BaseException], ...],
                                     tuple[type[BaseException], ...]]:
    """(every error type CuPy or cuBLAS raises for CUDA, driver, cuBLAS, NVRTC and memory
    failures; those of them that come from the CUDA runtime or driver)."""
    found: dict[str, type[BaseException]] = {}
    for path in ("cuda.runtime.CUDARuntimeError", "cuda.driver.CUDADriverError",
                 "cuda.memory.OutOfMemoryError", "cuda.compiler.CompileException"):
        obj: Any = cupy
        try:
            for part in path.split("."):
                obj = getattr(obj, part)
            found[path] = obj
        except AttributeError:
            continue
    faults = tuple(found[p] for p in ("cuda.runtime.CUDARuntimeError",
                                      "cuda.driver.CUDADriverError") if p in found)
    return (*found.values(), CublasError), faults
