"""gemmd's collectors put together, for the daemon and the tests.

``assemble()`` is the one place the groups are put together: the groups that change only
with the state go in one registry (rendered once per change, see ``Exposition``), the live
ones (probe in flight, self-metrics, process) in another.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, ProcessCollector
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gemmd.exporter.collectors import (
    DaemonCollector,
    DeviceCollector,
    DriftCollector,
    ModelCollector,
    ProbeCollector,
    Snapshots,
)
from gemmd.exporter.series import DEVICE_LABELS, PROFILES, _dev_labels, shaped
from gemmd.state import State


class LiveCollector(Collector):
    """What changes between scrapes without a state change: rendered on every scrape."""

    def __init__(self, state: State, snapshots: Snapshots, hostname: str | None = None):
        self.state = state
        self.snapshots = snapshots
        self.hostname = hostname
        self.last_duration = 0.0

    def collect(self) -> Iterator[Metric]:
        return shaped(self._collect(), "full", self.hostname)

    def _collect(self) -> Iterator[Metric]:
        inflight = GaugeMetricFamily("gemmd_device_probe_in_flight_seconds",
                                     "How long the probe now running has been running",
                                     labels=DEVICE_LABELS)
        now = time.time()
        with self.state.lock.inner:
            running = [(_dev_labels(d), d.in_flight_since) for d in self.state.devices.values()
                       if d.in_flight_since is not None]
        for lv, since in running:
            inflight.add_metric(lv, now - since)
        yield inflight
        yield GaugeMetricFamily("gemmd_scrape_collector_success",
                                "1 if the last collection of gemmd's own metrics succeeded",
                                value=0.0 if self.snapshots.failed else 1.0)
        yield GaugeMetricFamily("gemmd_scrape_duration_seconds",
                                "Time the previous /metrics response took to assemble, "
                                "rendering included", value=self.last_duration)


STATE_GROUPS = (DaemonCollector, DeviceCollector, ProbeCollector, DriftCollector,
                ModelCollector)


@dataclass
class Metrics:
    """gemmd's collectors, assembled: ``cached`` changes only with the state, ``live`` on
    every scrape."""

    cached: CollectorRegistry
    live: CollectorRegistry
    live_collector: LiveCollector

    def get_sample_value(self, name: str, labels: dict[str, str] | None = None
                         ) -> float | None:
        for reg in (self.cached, self.live):
            v = reg.get_sample_value(name, labels)
            if v is not None:
                return v
        return None


class _Process(Collector):
    """prometheus_client's process_* metrics, with the ``hostname`` label."""

    def __init__(self, hostname: str | None):
        self.process = ProcessCollector(registry=None)
        self.hostname = hostname

    def collect(self) -> Iterator[Metric]:
        return shaped(self.process.collect(), "full", self.hostname)


def assemble(state: State, *, process: bool = True, profile: str = "full",
             hostname: str | None = None) -> Metrics:
    """Every metric group of gemmd over ``state`` (the daemon's exposition and the tests):
    the ``profile``'s families (``PROFILES``), each series labelled ``hostname`` if given."""
    if profile not in PROFILES:
        raise ValueError(f"metrics profile {profile!r} is not one of {', '.join(PROFILES)}")
    snapshots = Snapshots(state)
    cached = CollectorRegistry(auto_describe=False)
    for group in STATE_GROUPS:
        cached.register(group(snapshots, profile, hostname))
    live_collector = LiveCollector(state, snapshots, hostname)
    live = CollectorRegistry(auto_describe=False)
    live.register(live_collector)
    if process:
        live.register(_Process(hostname))
    return Metrics(cached, live, live_collector)
