"""Worker-process devices: a hung or dead worker is killed, reported and restarted."""

from __future__ import annotations

import dataclasses
import functools
import os
import signal
import threading
import time

import pytest
from conftest import HANG_S

from gemmd.config import FakeDeviceConfig, MeasureConfig
from gemmd.devices.fake import FakeDevice
from gemmd.devices.worker import WorkerDevice
from gemmd.errors import DeviceError, DeviceFault, ProbeCancelled, UnsupportedProbe
from gemmd.gemm import ProbeSpec

SPEC = ProbeSpec(1024, 1024, 1024, "bf16")
FAST = MeasureConfig(window_s=0.1, warmup_s=0.0, timeout_s=3.0)


def _worker(budget=1 << 30, **fake):
    return WorkerDevice(functools.partial(FakeDevice, index=0, cfg=FakeDeviceConfig(**fake),
                                          seed=0, noise=0.01, realtime=False,
                                          memory_budget=budget), "GPU 0")


@pytest.fixture
def worker():
    devs = []

    def make(**fake):
        d = _worker(**fake)
        devs.append(d)
        return d

    yield make
    for d in devs:
        d.close()


def test_measures_in_the_child_process(worker):
    d = worker()
    assert d.pid and d.pid != os.getpid()
    assert d.info.backend == "fake" and d.info.sm_count == 132
    m = d.measure(SPEC, FAST, check=True)
    assert m.iterations > 100 and m.energy_j and m.check_ok is True
    assert d.unsupported_reason(ProbeSpec(64, 64, 64, "fp16", "tiled", 16))
    assert d.busy_reason() is None and d.context()["sm_clock_hz"] > 0


def test_runs_reach_the_child_with_their_arguments(worker):
    """run() and run_observed(max_s=) cross the pipe: what the child ran comes back."""
    d = worker()
    d.prepare(SPEC)
    assert len(d.run(SPEC, 7, threading.Event())) == 7
    run = d.run_observed(SPEC, 9, threading.Event(), max_s=0.5)
    assert len(run.times) == 9 and run.t1 > run.t0 and run.e0 is not None


def test_device_error_in_child_is_raised_in_parent_and_worker_survives(worker):
    d = worker(fail_on_call=1)
    pid = d.pid
    with pytest.raises(DeviceError, match="injected failure"):
        d.measure(SPEC, FAST)
    assert d.pid == pid  # an error is not a crash: same worker


class TickingClock:
    """The worker's clock, injected: each reading 0.5 s after the previous one, so a call's
    timeout passes after a fixed number of polls, not after a race with the machine."""

    def __init__(self):
        self.now, self.reads = 0.0, 0

    def __call__(self) -> float:
        self.reads += 1
        self.now += 0.5
        return self.now


def test_hung_probe_is_killed_at_the_timeout_and_worker_restarted(worker):
    d = worker(hang_on_call=1)
    pid = d.pid
    d.clock = clock = TickingClock()  # the parent's clock, on which timeouts are counted
    try:
        with pytest.raises(DeviceError, match="did not return within 3 s; worker killed"):
            d.measure(SPEC, FAST)
    finally:
        del d.clock
    # Killed once the deadline (3 s after the first reading) had passed, not before.
    assert clock.reads == 1 + 6 and clock.now == 3.5
    assert d.pid is None  # killed
    # The next call starts a fresh worker (a call that runs no GEMM, so it doesn't hang).
    assert d.busy_reason() is None
    assert d.pid not in (None, pid) and d.restarts == 1


def test_dead_worker_is_reported_and_replaced(worker):
    d = worker()
    pid = d.pid
    os.kill(pid, signal.SIGKILL)
    time.sleep(0.2)
    with pytest.raises(DeviceError, match="worker died|unreachable"):
        d.measure(SPEC, FAST)
    m = d.measure(SPEC, FAST)
    assert m.runtime_s > 0 and d.pid != pid


def test_cancel_abandons_the_probe_and_kills_the_worker(worker):
    d = worker(hang_on_call=1)
    cancel = threading.Event()
    threading.Timer(0.5, cancel.set).start()
    with pytest.raises(ProbeCancelled):  # not DeviceError: the 60 s timeout did not end it
        d.measure(SPEC, dataclasses.replace(FAST, timeout_s=60), cancel=cancel)
    assert d.pid is None


def test_clock_is_the_parents_and_never_restarts_a_killed_worker(worker):
    d = worker(hang_on_call=1)
    with pytest.raises(DeviceError, match="worker killed"):
        d.measure(SPEC, FAST)
    assert d.pid is None
    before = time.monotonic()
    t = d.clock()
    assert before <= t <= time.monotonic()  # time.monotonic, read here
    assert d.pid is None and d.restarts == 0  # no child started to answer it


def test_close_kills_a_hung_worker(worker):
    d = worker(hang_on_call=1)
    proc = d._proc
    t = threading.Thread(target=lambda: pytest.raises(
        (DeviceError, ProbeCancelled), d.measure, SPEC, dataclasses.replace(FAST, timeout_s=60)))
    t.start()
    time.sleep(0.5)
    d.close()  # returns: the hung child was killed (its stop request goes unanswered)
    proc.join(HANG_S)  # reaped (close waits 5 s for that; a loaded machine may take longer)
    # The probe's thread polls the same Process (is_alive every 0.1 s): where its waitpid
    # reaps the child, this thread's can get ECHILD, and CPython's Popen.poll then answers
    # None until that thread stores the exit code. Once on a fresh clone's CI is_alive()
    # said True right after the join (the run took no 60 s longer): most likely that.
    deadline = time.monotonic() + HANG_S
    while proc.is_alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not proc.is_alive()
    t.join(HANG_S)
    assert not t.is_alive()


def test_worker_start_failure_is_a_clear_error():
    with pytest.raises(DeviceError, match="cannot build the device: KeyError: 'nope'"):
        _worker(model="nope")  # FakeDevice looks its model up: no such model


def test_unsupported_probe_reaches_the_parent_as_such():
    d = _worker(budget=1 << 20)
    try:
        with pytest.raises(UnsupportedProbe, match="over the memory budget"):
            d.measure(ProbeSpec(4096, 4096, 4096, "fp32"), FAST)
        assert d.restarts == 0 and d.pid is not None  # not a device failure
    finally:
        d.close()


def test_a_poisoned_context_ends_the_worker_and_the_next_call_gets_a_fresh_one(worker):
    d = worker(fault_on_call=1)
    pid = d.pid
    with pytest.raises(DeviceFault, match="cudaErrorIllegalAddress.*fresh one starts"):
        d.measure(SPEC, FAST)
    assert d.pid is None  # ended, not left serving with a dead context
    assert d.busy_reason() is None  # a call that runs no GEMM: the fresh worker answers
    assert d.pid not in (None, pid) and d.restarts == 1
