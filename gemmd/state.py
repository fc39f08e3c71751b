"""The daemon's in-memory state: what the exporter reads on a scrape.

Writers (probe rounds, refits) update it under one lock; the exporter takes a consistent
copy under the same lock and never touches a device, NVML or the store.
"""

from __future__ import annotations

import copy
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from gemmd.config import DriftConfig
from gemmd.drift import DeviceDrift, DriftMonitor, Track
from gemmd.gemm import ProbeSpec
from gemmd.records import DeviceInfo, Measurement, Prediction


@dataclass
class ProbeState:
    spec: ProbeSpec
    measurement: Measurement
    prediction: Prediction
    ts: float


@dataclass
class DeviceState:
    info: DeviceInfo
    up: bool = True
    down_reason: str = ""
    consecutive_failures: int = 0
    next_retry: float = 0.0  # on the runner's monotonic clock, not the wall clock
    # (kind, outcome) -> count; kind: sentinel | exploration; outcome: ok | failed | mismatch
    probes_total: Counter = field(default_factory=Counter)
    skipped_total: Counter = field(default_factory=Counter)  # reason -> count
    mismatches_total: int = 0
    rounds_total: int = 0
    probe_seconds_total: float = 0.0  # device time spent probing
    last_round_ts: float = 0.0
    in_flight_since: float | None = None
    in_flight: str = ""
    context: dict[str, Any] = field(default_factory=dict)  # from the latest probe
    plan_size: int = 0


@dataclass
class ModelState:
    version: str = "roofline"
    kind: str = "roofline"
    created: float | None = None
    n_samples: int = 0
    scores: dict[str, dict[str, float]] = field(default_factory=dict)
    refits_total: Counter = field(default_factory=Counter)  # outcome -> count
    last_refit_ts: float | None = None


class VersionedLock:
    """The state's lock: every release after a ``with`` block marks the state changed, so
    the exporter re-renders only when something may have changed."""

    def __init__(self) -> None:
        self.inner = threading.Lock()
        self.version = 0

    def __enter__(self) -> VersionedLock:
        self.inner.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.version += 1
        self.inner.release()


class State:
    """What a scrape reads (the daemon's live state), under one versioned lock.

    ``drift`` is the configured drift monitor (the runtime passes it; a bare State, as in
    tests, gets one with the default configuration)."""

    def __init__(self, drift: DriftMonitor | None = None) -> None:
        self.lock = VersionedLock()
        self.started = time.time()
        self.devices: dict[str, DeviceState] = {}
        self.probes: dict[tuple[str, ProbeSpec], ProbeState] = {}
        self.model = ModelState()
        self.store_errors_total = 0
        self.clock_jumps_total = 0  # wall-clock jumps the daemon saw (gemmd.clockwatch)
        self.drift: DriftMonitor = drift or DriftMonitor()
        self.probe_interval_s: float | None = None

    @property
    def version(self) -> int:
        return self.lock.version

    def add_device(self, info: DeviceInfo) -> None:
        with self.lock:
            self.devices.setdefault(info.uuid, DeviceState(info=info))

    def snapshot(self) -> Snapshot:
        """A consistent copy for one scrape (reading does not mark a change)."""
        with self.lock.inner:
            return Snapshot(copy.deepcopy(list(self.devices.values())),
                            [(uuid, copy.copy(p)) for (uuid, _), p in self.probes.items()],
                            copy.deepcopy(self.model), self.store_errors_total,
                            self.drift.snapshot(), self.probe_interval_s,
                            self.drift.device_snapshot(), self.drift.p)


@dataclass
class Snapshot:
    devices: list[DeviceState]
    probes: list[tuple[str, ProbeState]]
    model: ModelState
    store_errors_total: int
    drift: dict[tuple[str, ProbeSpec, str], Track]
    probe_interval_s: float | None
    # Per device: its pooled drift statistic per target and its standing among its peers.
    drift_devices: dict[str, DeviceDrift] = field(default_factory=dict)
    drift_config: DriftConfig | None = None
