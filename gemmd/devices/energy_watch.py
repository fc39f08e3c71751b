"""The energy watcher of the NVIDIA backend: NVML's energy counter read from its own thread
while a probe's GEMMs run, each change kept with its time."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

_POLL_S = 0.0005  # the energy watcher's polling period


class _EnergyWatcher:
    """Polls the energy counter from its own thread while the GPU works, keeping each
    change as (clock(), joules). The thread that enqueues GEMMs never polls, so watching
    cannot starve the GPU; NVML calls release the GIL.

    ``ticker`` (tests): a virtual clock with ``subscribe(fn, period)``/``unsubscribe``
    that calls ``poll`` as its time passes, in place of the thread."""

    def __init__(self, read: Any, period: float = _POLL_S,
                 clock: Callable[[], float] = time.monotonic, ticker: Any = None):
        self._read, self._period, self._clock, self._ticker = read, period, clock, ticker
        self.steps: list[tuple[float, float]] = []
        self.error: BaseException | None = None
        self.first: float | None = None  # the reading on entering: the window's start
        self._last: float | None = None
        self._sub: Any = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gemmd-energy-watch",
                                        daemon=True)

    def poll(self) -> None:
        """One reading; a change is kept with its time."""
        if self.error is not None:
            return
        try:
            e = self._read()
        except Exception as err:  # reported by the caller: watching is best effort
            self.error = err
            return
        if e is not None and e != self._last:
            self.steps.append((self._clock(), e))
            self._last = e

    def _run(self) -> None:
        while not self._stop.is_set() and self.error is None:
            self.poll()
            self._stop.wait(self._period)

    def __enter__(self) -> _EnergyWatcher:
        try:
            self.first = self._last = self._read()
        except Exception as err:
            self.error = err
        if self._ticker is not None:
            self._sub = self._ticker.subscribe(self.poll, self._period)
        else:
            self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._ticker is not None:
            self._ticker.unsubscribe(self._sub)
            return
        self._stop.set()
        self._thread.join(5)
