"""Stand-ins for CuPy, cuBLAS and pynvml, tied to the real libraries' APIs.

Every stand-in class or function is declared with the real thing it stands for
(``@conforms(real)``): a member the real library lacks fails at import, and every call is
first bound against the real signature (from ``inspect.signature`` or, for Cython
functions, the signature CuPy embeds in the docstring), so a wrong argument count or name
fails the test that made it. The stand-in GPU computes with NumPy on host memory addressed
by raw pointers, as cuBLAS does on device memory, and keeps time on a virtual clock
(``VirtualClock``): enqueued work finishes later in virtual time, events and synchronize
advance the clock to it, host calls cost their own virtual microseconds; no result depends
on how fast the machine running the tests is. It checks what a real GPU would reject or
punish: cuBLAS argument bounds, kernel launch limits, reads of inputs another stream is
still writing (the random generator's state included), cuBLAS calls while capturing a graph
that CuPy would refuse, a cuBLAS workspace reset by cublasSetStream (cuBLAS then allocates
during capture), a GEMM whose kernel is first loaded inside a capture, and the upload cost
of a graph's first launch.
"""

from __future__ import annotations

import ast
import ctypes
import functools
import inspect
import re
import threading
import weakref
from types import SimpleNamespace
from typing import Any

import cupy
import numpy as np
import pynvml
from cupy.cuda import graph as cupy_graph
from cupy_backends.cuda.api.runtime import CUDARuntimeError

from gemmd.devices import nvidia
from gemmd.devices.cublas import Cublas, CublasError

# ------------------------------------------------------------------ conformance

_CY_TYPES = r"\b(?:int|str|size_t|intptr_t|bint|double|float|object|list|tuple|bool)\s+"


def real_signature(fn: Any) -> inspect.Signature | None:
    """The signature of a real library function or method, also for Cython builtins that
    embed it in their docstring ("name(int device) -> str"); None when it has neither."""
    try:
        return inspect.signature(fn)
    except (TypeError, ValueError):
        pass
    first = (getattr(fn, "__doc__", None) or "").strip().splitlines()[:1]
    m = re.match(r"^[\w.]+\((.*)\)", first[0]) if first else None
    if not m:
        return None
    params = re.sub(_CY_TYPES, "", m.group(1))
    tree = ast.parse(f"def f({params}): pass")
    ns: dict[str, Any] = {}
    exec(compile(ast.Module(body=tree.body, type_ignores=[]), "<sig>", "exec"), ns)
    return inspect.signature(ns["f"])


def _checked(real: Any, fake: Any, where: str) -> Any:
    sig = real_signature(real)

    @functools.wraps(fake)
    def call(*args: Any, **kwargs: Any) -> Any:
        if sig is not None:
            try:
                sig.bind(*args, **kwargs)
            except TypeError as e:
                raise TypeError(f"{where}: the real API rejects this call: {e}") from None
        return fake(*args, **kwargs)
    return call


def conforms(real: Any):
    """Class decorator: every public member of the stand-in exists on ``real`` and every
    method call binds against the real method's signature."""
    def wrap(cls: type) -> type:
        for name, member in list(vars(cls).items()):
            if name.startswith("_") and name not in ("__call__", "__enter__", "__exit__"):
                continue
            if not hasattr(real, name):
                raise AssertionError(f"{cls.__name__}.{name}: {real!r} has no {name!r}")
            if inspect.isfunction(member) and not name.startswith("__"):
                setattr(cls, name, _checked(getattr(real, name), member,
                                            f"{real.__name__}.{name}"))
        cls.__conforms_to__ = real
        return cls
    return wrap


def conforming_function(real: Any):
    def wrap(fn: Any) -> Any:
        return _checked(real, fn, getattr(real, "__qualname__", repr(real)))
    return wrap


# ------------------------------------------------------------------ the stand-in GPU


class VirtualClock:
    """Seconds that pass only when the simulated host waits or works: ``now()`` for the
    device under test (its clock), ``advance_to`` for the stand-in's waits. Subscribers
    (the device's energy watcher) are called at every multiple of their period that the
    clock passes, as a polling thread would be, in order and without races."""

    def __init__(self, start: float = 1000.0):
        self.t = start
        self._subs: dict[int, list] = {}  # id: [fn, period, next tick]
        self._next_id = 0

    def now(self) -> float:
        return self.t

    def subscribe(self, fn: Any, period: float) -> int:
        self._next_id += 1
        self._subs[self._next_id] = [fn, period, self.t + period]
        return self._next_id

    def unsubscribe(self, sid: int) -> None:
        self._subs.pop(sid, None)

    def advance_to(self, t: float) -> None:
        while self._subs:
            sid, (fn, period, tick) = min(self._subs.items(), key=lambda kv: kv[1][2])
            if tick > t:
                break
            self.t = max(self.t, tick)
            self._subs[sid][2] = tick + period
            fn()
        self.t = max(self.t, t)

    def sleep(self, dt: float) -> None:
        self.advance_to(self.t + dt)


class Gpu:
    """State of the simulated device: streams' timelines, allocations, counters.

    ``launch_s``: GPU time a graph launch adds; ``host_call_s``: host time of one direct
    kernel launch or cuBLAS call (the reason small GEMMs need graphs); ``upload_s``: GPU
    time of a graph's first launch (its upload)."""

    def __init__(self, flops_per_s: float = 2e10, launch_s: float = 2e-6,
                 host_call_s: float = 5e-6, upload_s: float = 50e-6):
        self.flops_per_s, self.launch_s = flops_per_s, launch_s
        self.host_call_s, self.upload_s = host_call_s, upload_s
        self.clock = VirtualClock()
        self.current: list[Stream] = []
        self.null = Stream(null=True, gpu=self)
        self.pool = MemoryPool(self)
        self.calls: dict[str, int] = {}
        self.sticky: BaseException | None = None  # a poisoned context: all work fails
        self.capture_error: BaseException | None = None
        self.event_creations: list[float] = []
        # cuBLAS loads a GEMM's kernel on its first use: inside a capture, that fails.
        self.lazy_loading = True

    def count(self, what: str) -> None:
        self.calls[what] = self.calls.get(what, 0) + 1

    def stream(self) -> Stream:
        return self.current[-1] if self.current else self.null

    def enqueue(self, stream: Stream, duration: float, work: Any, reads: tuple = (),
                writes: tuple = ()) -> None:
        """Run ``work`` (NumPy, now) as if it ran on ``stream`` for ``duration`` seconds (a
        callable: the seconds at the GPU's speed when it runs, as in a replayed graph)."""
        if self.sticky is not None:
            raise self.sticky
        if stream.capturing is not None:
            stream.capturing.append((duration, work, reads, writes))
            return
        if callable(duration):
            duration = duration()
        for arr in reads:
            writer = getattr(arr, "_writer", None)
            if writer is not None and writer is not stream and writer.pending:
                raise AssertionError(f"race: reading an array that {writer!r} is still "
                                     f"writing, from {stream!r} (no synchronize between)")
        work()
        for arr in writes:
            arr._writer = stream
        start = max(self.clock.now(), stream.t_done)
        stream.t_done = start + duration
        stream.pending = True


class DevArray(np.ndarray):
    """A NumPy array standing in for a CuPy array: ``.data.ptr`` is its address. An array
    that owns new memory (from the pool, or the result of arithmetic or astype) is counted
    in the pool and was written by the stream current when it was made."""

    _writer = None

    def __array_finalize__(self, obj: Any) -> None:
        gpu = _GPU.gpu
        if gpu is not None and self.base is None:
            gpu.pool.account(self)
            stream = gpu.stream()
            self._writer = stream
            stream.pending = True

    @property
    def data(self) -> Any:  # cupy.ndarray.data is a MemoryPointer with .ptr
        return SimpleNamespace(ptr=self.__array_interface__["data"][0])


for _name in ("data", "astype", "view", "reshape", "T", "size", "dtype"):
    assert hasattr(cupy.ndarray, _name), _name


class MemoryPool:
    """Bytes held for arrays in use and bytes cached after they were freed."""

    def __init__(self, gpu: Gpu):
        self.gpu, self.in_use, self.cached, self.peak = gpu, 0, 0, 0

    def alloc(self, arr: np.ndarray) -> DevArray:
        out = arr.view(DevArray)  # a view: accounted here, for the memory it holds
        self.account(out, arr.nbytes)
        out._writer = self.gpu.stream()
        out._writer.pending = True
        return out

    def account(self, arr: np.ndarray, nbytes: int | None = None) -> None:
        n = int(arr.nbytes if nbytes is None else nbytes)
        reuse = min(n, self.cached)
        self.cached -= reuse
        self.in_use += n
        self.peak = max(self.peak, self.held)
        weakref.finalize(arr, self._free, n)
        _LIVE[arr.__array_interface__["data"][0]] = arr

    def _free(self, n: int) -> None:
        self.in_use -= n
        self.cached += n

    @property
    def held(self) -> int:
        return self.in_use + self.cached


@conforms(cupy.cuda.MemoryPool)
class PoolApi:
    def __init__(self, pool: MemoryPool):
        self._pool = pool

    def free_all_blocks(self, stream=None):
        self._pool.gpu.count("free_all_blocks")
        self._pool.cached = 0

    def used_bytes(self):
        return self._pool.in_use

    def total_bytes(self):
        return self._pool.held


@conforms(cupy.cuda.Stream)
class Stream:
    def __init__(self, null=False, non_blocking=False, ptds=False, priority=None, *,
                 gpu: Gpu | None = None):
        self._gpu = gpu or _GPU.get()
        self.ptr = 0 if null else id(self)
        self.t_done = 0.0
        self.pending = False
        self.capturing: list | None = None
        self.non_blocking = non_blocking

    def __repr__(self) -> str:
        return "<null stream>" if self.ptr == 0 else f"<stream {self.ptr:#x}>"

    def __enter__(self):
        self._gpu.current.append(self)
        return self

    def __exit__(self, *exc):
        self._gpu.current.pop()

    def synchronize(self):
        self._gpu.clock.advance_to(self.t_done)
        self.pending = False

    def begin_capture(self, mode=None):
        if self.ptr == 0:
            raise RuntimeError("cannot capture on the default (legacy) stream")
        if self._gpu.capture_error is not None:
            raise self._gpu.capture_error
        self.capturing = []

    def end_capture(self):
        nodes, self.capturing = self.capturing, None
        self._gpu.count("graphs_captured")
        return Graph(nodes, self._gpu)

    def is_capturing(self):
        return self.capturing is not None


@conforms(cupy_graph.Graph)
class Graph:
    def __init__(self, nodes: list, gpu: Gpu):
        self._nodes, self._gpu = nodes, gpu
        self._uploaded = False

    def launch(self, stream=None):
        self._gpu.count("graph_launches")
        s = stream or self._gpu.stream()
        total = self._gpu.launch_s + sum(d() if callable(d) else d for d, *_ in self._nodes)
        if not self._uploaded:  # the first launch uploads the graph to the device
            total += self._gpu.upload_s
            self._uploaded = True
        reads = tuple(a for _, _, r, _ in self._nodes for a in r)
        writes = tuple(a for *_, w in self._nodes for a in w)

        def work() -> None:
            for _, fn, _, _ in self._nodes:
                fn()
        self._gpu.enqueue(s, total, work, reads, writes)


@conforms(cupy.cuda.Event)
class Event:
    def __init__(self, block=False, disable_timing=False, interprocess=False):
        self._gpu = _GPU.get()
        self._gpu.event_creations.append(self._gpu.clock.now())
        self.t: float | None = None

    def record(self, stream=None):
        s = stream or self._gpu.stream()
        if s.capturing is not None:
            raise AssertionError("event recorded while capturing a graph")
        self.t = max(s.t_done, self._gpu.clock.now())

    def synchronize(self):
        self._gpu.clock.advance_to(self.t or 0.0)

    @property
    def done(self):
        return self._gpu.clock.now() >= (self.t or 0.0)


@conforming_function(cupy.cuda.get_elapsed_time)
def get_elapsed_time(start_event, end_event):
    if start_event.t is None or end_event.t is None:
        raise CUDARuntimeError(600)  # cudaErrorNotReady
    return (end_event.t - start_event.t) * 1e3


@conforms(cupy.cuda.Device)
class Device:
    def __init__(self, device=None):
        self._gpu = _GPU.get()
        self.id = device or 0

    def use(self):
        pass

    def synchronize(self):
        for s in [self._gpu.null, *self._gpu.current]:
            s.synchronize()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None


class Runtime:
    """cupy.cuda.runtime for GPUs with the given PCI bus ids (CUDA's spelling)."""

    CUDARuntimeError = CUDARuntimeError

    def __init__(self, bus_ids: list[str]):
        self._bus_ids = bus_ids
        self.getDeviceCount = conforming_function(cupy.cuda.runtime.getDeviceCount)(
            lambda: len(self._bus_ids))
        self.deviceGetPCIBusId = conforming_function(cupy.cuda.runtime.deviceGetPCIBusId)(
            lambda device: self._bus_ids[device])
        self.getDeviceProperties = conforming_function(
            cupy.cuda.runtime.getDeviceProperties)(
            lambda device: {"multiProcessorCount": 132, "clockRate": 1_980_000})


class Generator:
    """cupy.random.Generator: its state initialised by a kernel on the stream current at
    construction; normal numbers drawn by the current stream, which reads that state."""

    def __init__(self, seed: Any) -> None:
        self._rng = np.random.default_rng(seed)
        gpu = _GPU.get()
        self._state = gpu.pool.alloc(np.zeros(6, np.uint32))  # written by the current stream
        gpu.enqueue(gpu.stream(), 1e-6, lambda: None, writes=(self._state,))

    def standard_normal(self, size=None, dtype=np.float64, out=None):
        gpu = _GPU.get()
        gpu.enqueue(gpu.stream(), 1e-6, lambda: None, reads=(self._state,),
                    writes=(self._state,))
        return gpu.pool.alloc(self._rng.standard_normal(size, dtype=dtype))


conforms(cupy.random.Generator)(Generator)


@conforms(cupy.RawKernel)
class RawKernel:
    def __init__(self, tile: int, gpu: Gpu):
        self._tile, self._gpu = tile, gpu

    def __call__(self, grid, block, args, **kwargs):
        t = self._tile
        a, b, c, m, n, k = args
        m, n, k = int(m), int(n), int(k)
        if tuple(block) != (t, t) or t * t > 1024:
            raise CUDARuntimeError(9)  # cudaErrorInvalidConfiguration
        if grid[1] > 65535 or grid[0] > 2**31 - 1:
            raise CUDARuntimeError(9)
        if grid[0] * t < n or grid[1] * t < m:
            raise AssertionError(f"grid {grid} x tile {t} does not cover C ({m} x {n})")
        flat = (m, k), (k, n), (m, n)

        def work() -> None:
            av, bv = a.reshape(flat[0]), b.reshape(flat[1])
            c.reshape(flat[2])[...] = (av.astype(np.float64) @ bv).astype(np.float32)
        gpu, stream = self._gpu, self._gpu.stream()
        gpu.count(f"tiled{t}_enqueued")
        if stream.capturing is None:
            gpu.clock.sleep(gpu.host_call_s)
        # Each tile its own speed, as on a real GPU (the H200: 32x32 fastest).
        gpu.enqueue(stream, lambda: 2.0 * m * n * k / gpu.flops_per_s * 8 * (1 + 8 / t), work,
                    (a, b), (c,))


@conforms(cupy.RawModule)
class RawModule:
    def __init__(self, code=None, options=(), **kwargs):
        assert "tiled_gemm" in code
        (tile,) = [int(o.split("=")[1]) for o in options if o.startswith("-DTILE=")]
        self._tile = tile

    def get_function(self, name):
        assert name == "tiled_gemm", name
        return RawKernel(self._tile, _GPU.get())


class _Current:
    """The stand-in GPU of the running test (one at a time)."""

    gpu: Gpu | None = None

    def get(self) -> Gpu:
        assert self.gpu is not None, "no stand-in GPU"
        return self.gpu


_GPU = _Current()


def make_cupy(bus_ids: list[str], gpu: Gpu) -> Any:
    """A cupy-like namespace over the stand-in GPU (only what gemmd uses)."""
    _GPU.gpu = gpu

    def zeros(shape, dtype=float, order="C"):
        return gpu.pool.alloc(np.zeros(shape, dtype=dtype))

    def empty(shape, dtype=float, order="C"):
        return gpu.pool.alloc(np.empty(shape, dtype=dtype))

    def asnumpy(a, stream=None, order="C", out=None, *, blocking=True):
        return np.array(a).view(np.ndarray)

    pool = PoolApi(gpu.pool)
    ns = SimpleNamespace(
        float16=np.float16, float32=np.float32, float64=np.float64, uint8=np.uint8,
        uint16=np.uint16, uint32=np.uint32,
        zeros=conforming_function(cupy.zeros)(zeros),
        empty=conforming_function(cupy.empty)(empty),
        asnumpy=conforming_function(cupy.asnumpy)(asnumpy),
        get_default_memory_pool=conforming_function(cupy.get_default_memory_pool)(
            lambda: pool),
        RawModule=RawModule,
        random=SimpleNamespace(default_rng=conforming_function(cupy.random.default_rng)(
            lambda seed=None: Generator(seed))),
        cuda=SimpleNamespace(
            Device=Device, Stream=Stream, Event=Event, get_elapsed_time=get_elapsed_time,
            runtime=Runtime(bus_ids), driver=cupy.cuda.driver, memory=cupy.cuda.memory,
            compiler=cupy.cuda.compiler))
    for path in ("cuda.runtime.CUDARuntimeError", "cuda.driver.CUDADriverError",
                 "cuda.memory.OutOfMemoryError", "cuda.compiler.CompileException"):
        real: Any = cupy
        for part in path.split("."):
            real = getattr(real, part)
        assert real is not None
    return ns


# ------------------------------------------------------------------ cuBLAS

_DT = {0: np.float32, 1: np.float64, 2: np.float16, 14: np.uint16}  # CUDA_R_* storage


def _tf32(x: np.ndarray) -> np.ndarray:
    """Round float32 to TF32's 10-bit mantissa (nearest even), as tensor cores read it."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    r = ((u + 0xFFF + ((u >> 13) & 1)) >> 13) << 13
    return r.astype(np.uint32).view(np.float32)


def _matrix(ptr: int, dtype: Any, ld: int, rows: int, cols: int) -> np.ndarray:
    """The column-major rows x cols matrix at ``ptr`` with leading dimension ``ld``."""
    count = ld * (cols - 1) + rows
    buf = (ctypes.c_char * (count * np.dtype(dtype).itemsize)).from_address(ptr)
    flat = np.frombuffer(buf, dtype=dtype, count=count)
    return np.lib.stride_tricks.as_strided(
        flat, shape=(rows, cols), strides=(flat.itemsize, flat.itemsize * ld))


def _to_f64(x: np.ndarray, ctype: int) -> np.ndarray:
    if ctype == 14:
        return nvidia.bf16_to_f32(x).astype(np.float64)
    return x.astype(np.float64)


@conforms(Cublas)
class CublasStandin:
    """cuBLAS's GemmEx semantics (column-major, op per transpose flag) on raw pointers."""

    def __init__(self, gpu: Gpu):
        self._gpu = gpu
        self._streams: dict[int, int] = {}
        self._workspace: dict[int, int | None] = {}
        self._loaded: set[tuple] = set()  # GEMM kernels loaded (first used outside capture)
        self._next = 0x1000

    def create(self):
        self._next += 16
        self._streams[self._next] = 0
        self._workspace[self._next] = None
        return self._next

    def destroy(self, handle):
        self._streams.pop(handle)
        self._workspace.pop(handle)

    def set_stream(self, handle, stream_ptr):
        # cuBLAS docs, cublasSetStream: "unconditionally resets the cuBLAS library
        # workspace back to the default workspace pool".
        self._streams[handle] = stream_ptr
        self._workspace[handle] = None

    def set_workspace(self, handle, ptr, nbytes):
        assert handle in self._streams and ptr and nbytes > 0
        self._workspace[handle] = ptr

    def gemm_ex(self, handle, transa, transb, m, n, k, alpha, a, atype, lda, b, btype, ldb,
                beta, c, ctype, ldc, compute, algo):
        self._gpu.count("gemm_ex")
        if handle not in self._streams:
            raise CublasError("cublasGemmEx", 1)
        ra, ca = (m, k) if transa == 0 else (k, m)
        rb, cb = (k, n) if transb == 0 else (n, k)
        if min(m, n, k) <= 0 or lda < max(1, ra) or ldb < max(1, rb) or ldc < max(1, m) \
                or not (atype == btype == ctype) or atype not in _DT:
            raise CublasError("cublasGemmEx", 7)  # CUBLAS_STATUS_INVALID_VALUE
        scalar = ctypes.c_double if compute == 70 else ctypes.c_float
        al = scalar.from_address(alpha).value  # host pointer mode: read at call (or capture)
        be = scalar.from_address(beta).value
        stream = next((s for s in [self._gpu.null, *self._gpu.current]
                       if s.ptr == self._streams[handle]), None)
        assert stream is not None, "the handle's stream is not a live stream"
        kernel = (transa, transb, m, n, k, atype, compute)
        if stream.capturing is not None:
            if self._workspace[handle] is None:
                self._gpu.count("allocations_during_capture")  # cuBLAS's own workspace
            if self._gpu.lazy_loading and kernel not in self._loaded:
                raise CUDARuntimeError(900)  # cudaErrorStreamCaptureUnsupported: a load
        else:
            self._loaded.add(kernel)
            self._gpu.clock.sleep(self._gpu.host_call_s)

        def work() -> None:
            am = _to_f64(_matrix(a, _DT[atype], lda, ra, ca), atype)
            bm = _to_f64(_matrix(b, _DT[btype], ldb, rb, cb), btype)
            am, bm = (am if transa == 0 else am.T), (bm if transb == 0 else bm.T)
            if compute == 77:  # CUBLAS_COMPUTE_32F_FAST_TF32
                am, bm = _tf32(am.astype(np.float32)), _tf32(bm.astype(np.float32))
            cm = _matrix(c, _DT[ctype], ldc, m, n)
            out = al * (np.asarray(am, np.float64) @ np.asarray(bm, np.float64))
            if be:
                out += be * _to_f64(cm, ctype)
            if ctype == 14:
                cm[...] = nvidia.bf16_bits(out.astype(np.float32))
            else:
                cm[...] = out.astype(_DT[ctype])
        arrays = _owners(a, b, c)
        gpu = self._gpu
        gpu.enqueue(stream, lambda: 2.0 * m * n * k / gpu.flops_per_s, work,
                    reads=arrays[:2], writes=arrays[2:])


_LIVE: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def _owners(*ptrs: int) -> tuple:
    """The stand-in arrays at these addresses (for the stream-race check), where known."""
    return tuple(x for p in ptrs if (x := _LIVE.get(p)) is not None)


# ------------------------------------------------------------------ pynvml


class FakePynvml:
    """The pynvml functions gemmd calls, over a list of GPU dicts. Each is wrapped with the
    real function's signature; constants and NVMLError are the real module's. A function
    the stand-in doesn't implement raises AttributeError, as a missing one would."""

    NVMLError = pynvml.NVMLError

    def __init__(self, gpus: list[dict], init_error: int | None = None):
        self.gpus = gpus
        self.init_error = init_error
        self.lock = threading.Lock()
        for name in dir(type(self)):
            if name.startswith("nvml"):
                real = getattr(pynvml, name, None)
                if real is None:
                    raise AssertionError(f"pynvml has no {name}")
                setattr(self, name, _checked(real, getattr(self, name), f"pynvml.{name}"))

    def __getattr__(self, name: str) -> Any:
        real = getattr(pynvml, name)  # AttributeError for what pynvml lacks
        if callable(real) and name.startswith("nvml"):
            raise AttributeError(f"stand-in pynvml does not implement {name}")
        return real

    def _g(self, h):
        if h.get("lost"):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
        return h

    def nvmlInit(self):
        if self.init_error:
            raise pynvml.NVMLError(self.init_error)

    def nvmlDeviceGetCount(self):
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index):
        return self.gpus[index]

    def nvmlDeviceGetPciInfo(self, handle):
        return SimpleNamespace(busId=self._g(handle)["bus"].encode())

    def nvmlDeviceGetCudaComputeCapability(self, handle):
        return self._g(handle).get("cc", (9, 0))

    def nvmlDeviceGetMemoryInfo(self, handle, version=None):
        used = handle.get("mem_used", 0)
        if version == pynvml.nvmlMemory_v2:  # used excludes what the driver reserves
            return SimpleNamespace(version=version, total=80 << 30, reserved=512 << 20,
                                   free=(80 << 30) - used - (512 << 20), used=used)
        return SimpleNamespace(total=80 << 30, free=(80 << 30) - used - (512 << 20),
                               used=used + (512 << 20))

    def nvmlSystemGetDriverVersion(self):
        return "580.95.05"

    def nvmlSystemGetCudaDriverVersion_v2(self):
        return 13000

    def nvmlDeviceGetVbiosVersion(self, handle):
        return "96.00.99.00.01"

    def nvmlDeviceGetUUID(self, handle):
        return handle["uuid"]

    def nvmlDeviceGetName(self, handle):
        return handle.get("name", "NVIDIA H100 80GB HBM3").encode()

    def nvmlDeviceGetEnforcedPowerLimit(self, handle):
        return 700_000

    def nvmlDeviceGetMaxClockInfo(self, handle, type):
        return {pynvml.NVML_CLOCK_SM: 1980, pynvml.NVML_CLOCK_MEM: 2619}[type]

    def nvmlDeviceGetMemoryBusWidth(self, device):
        raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)  # older drivers

    def nvmlDeviceGetMigMode(self, device):
        return (1, 1) if device.get("mig") else (0, 0)

    def nvmlDeviceGetMaxMigDeviceCount(self, device):
        return len(device.get("mig", []))

    def nvmlDeviceGetMigDeviceHandleByIndex(self, device, index):
        return {"uuid": device["mig"][index]}

    def nvmlDeviceGetTotalEnergyConsumption(self, handle):
        h = self._g(handle)
        if "energy_mj" not in h:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        e = h["energy_mj"]
        return int(e()) if callable(e) else e

    def nvmlDeviceGetPowerUsage(self, handle):
        return self._g(handle)["power_mw"]

    def nvmlDeviceGetClockInfo(self, handle, type):
        return {pynvml.NVML_CLOCK_SM: 1755, pynvml.NVML_CLOCK_MEM: 2619}[type]

    def nvmlDeviceGetTemperature(self, handle, sensor):
        return 61

    def nvmlDeviceGetPerformanceState(self, handle):
        return 0

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle):
        return handle.get("reasons", 0)

    def nvmlDeviceGetComputeRunningProcesses(self, handle):
        return [SimpleNamespace(pid=p, usedGpuMemory=m)
                for p, m in handle.get("procs", {p: None for p in handle.get("pids", [])}
                                       ).items()]

    def nvmlDeviceGetUtilizationRates(self, handle):
        return SimpleNamespace(gpu=handle.get("util", 0), memory=0)


def stepping_counter(watts: float, clock: VirtualClock, step_s: float = 0.01) -> Any:
    """An energy counter (mJ) that moves every ``step_s`` of ``clock`` at constant power,
    like NVML's."""
    t0 = clock.now()

    def read() -> float:
        steps = int((clock.now() - t0) / step_s)
        return 1e6 + watts * steps * step_s * 1e3
    return read
