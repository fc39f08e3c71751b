"""Shared helpers: free ports, config files, a real `gemmd run` subprocess, real scrapes."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from gemmd.daemon import STOP_TIMEOUT_S

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


FAST_FAKE = {
    "backend": "fake",
    "listen": {"address": "127.0.0.1"},
    "probes": {
        "sentinels": [{"shapes": [[1024, 1024, 1024], [4096, 4096, 4096]],
                       "dtypes": ["bf16", "fp32"], "kernels": ["blas"]},
                      {"shapes": [[1024, 1024, 1024]], "kernels": ["tiled"], "tiles": [16]}],
        "exploration": [{"per_round": 2, "m": [256, 4096], "n": [256, 4096],
                         "k": [256, 4096], "dtypes": ["bf16", "fp32"]}],
        "measure": {"window_s": 0.2, "warmup_s": 0.01},
    },
    # Budget per round = 2 s of (simulated) device time: room for all 7 probes of ~0.21 s.
    "schedule": {"probe_interval_s": 2, "refit_interval_s": 30},
    "budget": {"duty_cycle": 1.0},
    "model": {"min_samples": 15, "n_estimators": 30},
}


def write_config(path: Path, **sections: Any) -> Path:
    path.write_text(yaml.safe_dump(sections, sort_keys=False))
    return path


def scrape(port: int, timeout: float = 2.0) -> dict[str, list]:
    """GET /metrics over HTTP; {sample name: [Sample, ...]}."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=timeout) as r:
        text = r.read().decode()
    out: dict[str, list] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, []).append(s)
    return out


# A bound on waiting that only a hang reaches: a test waits for an event, never races a
# clock, and this is how long it waits before calling the event missing. Far above what
# anything here takes on a loaded machine (CPU burners beside the suite: make test-loaded).
HANG_S = 60.0
# How long a stopped daemon may take: its own stop deadline, plus the margin that the
# systemd unit's TimeoutStopSec and the pod's grace period leave above it (both checked in
# test_systemd.py and test_kubernetes.py against this same expression).
STOP_GRACE_S = max(15.0, STOP_TIMEOUT_S + 5)


class ManualClock:
    """A monotonic clock that moves only when the test moves it (injected where gemmd
    takes a clock), so that what a test checks does not depend on the machine's speed."""

    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class _HostTimeStandingStill:
    """The ``time`` module as gemmd.devices.fake sees it under ``simulated_fake_clock``:
    monotonic() stands still; everything else is the real module's."""

    def __init__(self, clock: ManualClock):
        self.monotonic = clock

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)


@pytest.fixture
def simulated_fake_clock(monkeypatch) -> ManualClock:
    """The fake GPU's clock (host time + simulated device time) without the host's part:
    it moves by simulated device time only, so windows, energy steps and elapsed times
    are the same on an idle and on a loaded machine. In this process only (not in worker
    processes or daemons the test starts)."""
    from gemmd.devices import fake

    clock = ManualClock()
    monkeypatch.setattr(fake, "time", _HostTimeStandingStill(clock))
    return clock


def wait_for(pred: Callable[[], Any], timeout: float, what: str, proc=None) -> Any:
    deadline = time.monotonic() + timeout
    last_err: Exception | None = None
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"daemon exited ({proc.returncode}) while waiting for {what}:\n"
                                 f"{proc.read_log()}")
        try:
            v = pred()
            if v:
                return v
        except (OSError, ValueError) as e:
            last_err = e
        time.sleep(0.2)
    log = proc.read_log() if proc is not None else ""
    raise AssertionError(f"timed out after {timeout}s waiting for {what} ({last_err})\n{log}")


class LoggedProc:
    """A real subprocess whose stdout and stderr go to a log file the test can read."""

    def __init__(self, cmd: list[str], log: Path, env: dict | None = None, mode: str = "ab"):
        self.log = log
        self._f = open(log, mode)
        self.p = subprocess.Popen(cmd, stdout=self._f, stderr=self._f, cwd=ROOT,
                                  env=env if env is not None else dict(os.environ))
        self.pid = self.p.pid

    def poll(self):
        return self.p.poll()

    @property
    def returncode(self):
        return self.p.returncode

    def read_log(self) -> str:
        self._f.flush()
        return self.log.read_text(errors="replace")

    def kill(self) -> None:
        if self.p.poll() is None:
            self.p.kill()
            self.p.wait(timeout=10)
        self._f.close()


class DaemonProc(LoggedProc):
    """`python -m gemmd run` as a real subprocess, stderr captured to a file."""

    def __init__(self, config: Path, log: Path, *args: str, env: dict | None = None):
        super().__init__([sys.executable, "-m", "gemmd", "run", "--config", str(config),
                          *args], log, {**os.environ, **(env or {})})

    def terminate(self, timeout: float = STOP_GRACE_S) -> tuple[int, float]:
        t0 = time.monotonic()
        self.p.send_signal(signal.SIGTERM)
        rc = self.p.wait(timeout=timeout)
        return rc, time.monotonic() - t0


@pytest.fixture
def store(tmp_path):
    """A real SQLite store in a temporary directory."""
    from gemmd.store import Store

    s = Store(tmp_path / "gemmd.db")
    yield s
    s.close()


@pytest.fixture
def daemon_factory(tmp_path):
    procs: list[DaemonProc] = []

    def start(config: Path, *args: str, env: dict | None = None) -> DaemonProc:
        d = DaemonProc(config, tmp_path / f"daemon-{len(procs)}.log", *args, env=env)
        procs.append(d)
        return d

    yield start
    for d in procs:
        d.kill()
