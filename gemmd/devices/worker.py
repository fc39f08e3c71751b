"""Run a device in its own process, so a hung probe or a poisoned CUDA context is killed.

The parent keeps a ``WorkerDevice`` that forwards calls over a pipe; the whole measurement
protocol runs inside the child. A call that outlives its deadline, or a child that dies,
becomes a DeviceError; the child is killed and started afresh on the next call. A CUDA
error that poisons the context (DeviceFault) ends the child the same way.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

from gemmd.config import MeasureConfig
from gemmd.devices.base import BusyLimits, Device, Run
from gemmd.errors import (
    DeviceError,
    DeviceFault,
    DeviceUnavailable,
    GemmdError,
    InputError,
    ModelError,
    ProbeCancelled,
    StoreError,
    UnsupportedProbe,
)
from gemmd.gemm import ProbeSpec
from gemmd.records import DeviceInfo, Measurement

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 120.0  # importing CuPy and creating a CUDA context can take a while
CALL_TIMEOUT_S = 30.0  # any call but measure
# Errors raised in the child are raised again in the parent as the same type. Every
# GemmdError whose constructor takes one message (ConfigError does not reach a device).
_ERRORS = {c.__name__: c for c in (DeviceError, DeviceFault, DeviceUnavailable, GemmdError,
                                   InputError, ModelError, ProbeCancelled, StoreError,
                                   UnsupportedProbe)}


def isolated(factory: Callable[[], Device], label: str, isolation: str) -> Device:
    """The one place that decides where a device runs: ``factory()`` in this process
    ("thread": a probe runs in the scheduler's thread), or in a worker process ("process")."""
    if isolation == "thread":
        return factory()
    return WorkerDevice(factory, label)


def _serve(conn: Any, factory: Callable[[], Device]) -> None:
    """Child main loop: build the device, then answer calls until told to stop."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when we stop
    try:
        dev = factory()
    except GemmdError as e:
        conn.send(("err", type(e).__name__, str(e)))
        return
    except Exception as e:  # a bug, or a vendor error the backend did not translate
        conn.send(("err", "DeviceError", f"cannot build the device: {type(e).__name__}: {e}"))
        return
    conn.send(("ok", dev.info))
    while True:
        try:
            method, args = conn.recv()
        except EOFError:
            break
        if method == "stop":
            break
        try:
            if method == "measure":
                spec, cfg, check = args
                result: Any = dev.measure(spec, cfg, check=check)
            elif method == "run":
                spec, iterations = args
                result = dev.run(spec, iterations, threading.Event())
            elif method == "run_observed":
                spec, iterations, max_s, min_iters = args
                result = dev.run_observed(spec, iterations, threading.Event(), max_s=max_s,
                                          min_iters=min_iters)
            else:
                result = getattr(dev, method)(*args)
            conn.send(("ok", result))
        except DeviceFault as e:
            # The CUDA context is poisoned (sticky error): every later call would fail too.
            # Report, then end this process; the parent starts a fresh one on its next call.
            conn.send(("err", type(e).__name__, str(e)))
            break
        except GemmdError as e:
            conn.send(("err", type(e).__name__, str(e)))
        except Exception as e:  # a bug or vendor error not translated: keep the evidence
            conn.send(("err", "DeviceError", f"{type(e).__name__}: {e}\n"
                                             f"{traceback.format_exc(limit=5)}"))
    try:
        dev.close()
    except Exception:
        pass


class WorkerDevice(Device):
    """A Device whose calls run in a child process (spawned, never forked).

    ``factory``: a picklable callable that builds the real device in the child (e.g.
    ``functools.partial(NvidiaDevice, record=..., memory_budget=...)``); this module knows
    no backend.
    """

    def __init__(self, factory: Callable[[], Device], label: str):
        self.factory = factory
        self.label = label
        self._ctx = mp.get_context("spawn")
        self._proc: Any = None
        self._conn: Any = None
        self._lock = threading.Lock()
        self._kill_lock = threading.Lock()
        self.restarts = 0
        self.info: DeviceInfo = self._start()

    # ----------------------------------------------------------------- process
    def _start(self) -> DeviceInfo:
        parent, child = self._ctx.Pipe()
        proc = self._ctx.Process(target=_serve, args=(child, self.factory),
                                 name=f"gemmd-{self.label}", daemon=True)
        proc.start()
        child.close()
        self._proc, self._conn = proc, parent
        try:
            info = self._receive(START_TIMEOUT_S, "start")
        except DeviceError:
            self._kill()
            raise
        logger.debug("%s: worker pid %d started", self.label, proc.pid)
        return info

    def _kill(self, proc: Any = None) -> None:
        """Kill and reap the worker (``proc``: the one the caller saw; default: current).

        Serialized: close() and a call timing out may both get here at once.
        """
        with self._kill_lock:
            proc = proc if proc is not None else self._proc
            if proc is not None and proc.exitcode is None:
                proc.kill()
                proc.join(5)
            if proc is self._proc:
                if self._conn is not None:
                    self._conn.close()
                self._proc = self._conn = None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def _receive(self, timeout: float, what: str,
                 cancel: threading.Event | None = None) -> Any:
        deadline = self.clock() + timeout
        proc, conn = self._proc, self._conn  # close() may clear them from another thread
        while True:
            if cancel is not None and cancel.is_set():
                self._kill()  # abandoning a probe mid-window: the child is stopped
                raise ProbeCancelled(what)
            left = deadline - self.clock()
            if left <= 0:
                self._kill()
                raise DeviceError(f"{self.label}: {what} did not return within {timeout:g} s; "
                                  "worker killed (hung probe or driver)")
            try:
                ready = conn.poll(min(left, 0.1))
            except (OSError, ValueError, AttributeError):
                ready = True
            if not ready:
                if not proc.is_alive():
                    code = proc.exitcode
                    self._kill()
                    raise DeviceError(f"{self.label}: worker died during {what} "
                                      f"(exit code {code})")
                continue
            try:
                status, *payload = conn.recv()
            except (EOFError, OSError, ValueError, AttributeError) as e:
                code = proc.exitcode
                self._kill()
                raise DeviceError(f"{self.label}: worker died during {what} "
                                  f"(exit code {code})") from e
            if status == "ok":
                return payload[0]
            name, message = payload
            if name == DeviceFault.__name__:
                proc.join(5)  # the child exits after a fault; reap it, restart on next call
                self._kill(proc)
                message += "; worker ended, a fresh one starts on the next call"
            raise _ERRORS.get(name, DeviceError)(message)

    def _call(self, method: str, *args: Any, timeout: float = CALL_TIMEOUT_S,
              cancel: threading.Event | None = None) -> Any:
        with self._lock:
            if self._proc is None:
                self.restarts += 1
                logger.warning("%s: restarting worker (restart %d)", self.label, self.restarts)
                self.info = self._start()
            try:
                self._conn.send((method, args))
            except (OSError, ValueError) as e:
                self._kill()
                raise DeviceError(f"{self.label}: worker unreachable: {e}") from e
            return self._receive(timeout, method, cancel)

    # ----------------------------------------------------------------- Device
    def measure(self, spec: ProbeSpec, cfg: MeasureConfig, *, check: bool = False,
                cancel: threading.Event | None = None) -> Measurement:
        return self._call("measure", spec, cfg, check, timeout=cfg.timeout_s, cancel=cancel)

    def unsupported_reason(self, spec: ProbeSpec) -> str | None:
        return self._call("unsupported_reason", spec)

    def busy_reason(self, limits: BusyLimits | None = None) -> str | None:
        return self._call("busy_reason", limits)

    def context(self) -> dict[str, Any]:
        return self._call("context")

    def check(self, spec: ProbeSpec) -> tuple[bool, float]:
        return self._call("check", spec)

    def prepare(self, spec: ProbeSpec) -> None:
        self._call("prepare", spec)

    def run(self, spec: ProbeSpec, iterations: int, cancel: threading.Event) -> list[float]:
        return self._call("run", spec, iterations, cancel=cancel)

    def run_observed(self, spec: ProbeSpec, iterations: int, cancel: threading.Event, *,
                     max_s: float | None = None, min_iters: int = 1) -> Run:
        return self._call("run_observed", spec, iterations, max_s, min_iters, cancel=cancel)

    def clock(self) -> float:
        """The parent's monotonic clock (the real backends' clock too: it is system-wide),
        on which a call's timeout is counted. Everything timed on the device's clock (the
        measurement protocol, run_observed) runs in the child; asking the child would start
        a killed worker again, for nothing."""
        return time.monotonic()

    def energy_j(self) -> float | None:
        return self._call("energy_j")

    def power_w(self) -> float | None:
        return self._call("power_w")

    def close(self) -> None:
        """Ask the child to stop; kill it if it doesn't (e.g. hung in a kernel)."""
        proc, conn = self._proc, self._conn
        if proc is None:
            return
        try:
            conn.send(("stop", ()))
        except (OSError, ValueError, AttributeError):
            pass
        proc.join(2)
        self._kill(proc)
