"""The /metrics body, cached between state changes.

Text formatting costs ~15 us per labelled sample in prometheus_client (bench/RESULTS.md),
so the state's families are rendered once per state change and served from that cache;
only the live gauges (probe in flight, self-metrics, process) are rendered per scrape.
Scrapes that arrive together share one render: the first renders under the lock, the
others wait for it and copy the result.
"""

from __future__ import annotations

import gzip
import threading
import time

from prometheus_client import generate_latest

from gemmd.exporter.assembly import assemble
from gemmd.state import State


class Exposition:
    """The /metrics body: the state's families re-rendered only after the state changed."""

    def __init__(self, state: State, *, process: bool = True, profile: str = "full",
                 hostname: str | None = None):
        self.state = state
        self.metrics = assemble(state, process=process, profile=profile, hostname=hostname)
        self._lock = threading.Lock()
        self._version: int | None = None
        self._text = b""
        self._gzip: bytes | None = None
        self.renders = 0

    def body(self, gzip_ok: bool = False) -> bytes:
        t0 = time.perf_counter()
        with self._lock:
            version = self.state.version  # read before rendering: a change during it re-renders
            if version != self._version:
                self._text = generate_latest(self.metrics.cached)
                self._gzip, self._version = None, version
                self.renders += 1
            if not gzip_ok:
                cached = self._text
            elif self._gzip is not None:
                cached = self._gzip
            else:
                cached = self._gzip = gzip.compress(self._text, 6)
        live = generate_latest(self.metrics.live)
        self.metrics.live_collector.last_duration = time.perf_counter() - t0
        # Text format 0.0.4 is a plain sequence of families; gzip members concatenate.
        return cached + (gzip.compress(live, 6) if gzip_ok else live)
