"""Jumps of the wall clock, seen against the monotonic clock (issue 24).

APScheduler fires by the wall clock: after the clock went back a day, every interval job
waited a day (no probe round, /metrics frozen, nothing logged); after it went forward,
retention counted recent results as old. ``ClockWatch.check()``, called every few seconds
from a thread that does not depend on the scheduler, compares how far each clock moved
since the last call: a difference over ``threshold_s`` is a jump. The daemon then re-arms
its jobs, logs the jump once, counts it (``gemmd_clock_jumps_total``) and keeps the sum of
jumps (``skew``), so that retention counts age on the clock it started with.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any

from gemmd.state import State

logger = logging.getLogger("gemmd.daemon")

JUMP_S = 10.0  # wall clock moved this much more or less than the monotonic one: a jump
CHECK_S = 5.0  # how often the daemon looks


class ClockWatch:
    def __init__(self, threshold_s: float = JUMP_S,
                 wall: Callable[[], float] = time.time,
                 mono: Callable[[], float] = time.monotonic):
        self.threshold_s = threshold_s
        self.wall, self.mono = wall, mono
        self._offset = wall() - mono()
        self.skew = 0.0  # sum of the jumps seen (s): forward positive
        self.jumps = 0

    def check(self) -> float | None:
        """The jump since the last call (seconds, forward positive), or None."""
        offset = self.wall() - self.mono()
        jump = offset - self._offset
        self._offset = offset
        if abs(jump) < self.threshold_s:
            return None
        self.skew += jump
        self.jumps += 1
        return jump

    def now(self) -> float:
        """The wall clock less the jumps seen: what retention counts from."""
        return self.wall() - self.skew


def interval(seconds: float) -> Any:
    """APScheduler's interval trigger, except that a job far behind its time (the wall
    clock jumped forward) fires once now: APScheduler lists every missed time first, one
    interval at a time with its lock held (100 days of the 5 s watchdog: 1.7 million, of a
    1 s probe interval: 8.6 million; the whole daemon stalled for half a minute)."""
    from apscheduler.triggers.interval import IntervalTrigger

    class Interval(IntervalTrigger):
        def get_next_fire_time(self, previous_fire_time: Any, now: datetime) -> Any:
            if previous_fire_time is not None and \
                    (now - previous_fire_time).total_seconds() > 2 * self.interval_length:
                return now
            return super().get_next_fire_time(previous_fire_time, now)

    return Interval(seconds=seconds, timezone="UTC")


def describe(jump: float) -> str:
    s = abs(jump)
    for unit, n in (("days", 86400), ("hours", 3600), ("minutes", 60)):
        if s >= n:
            return f"{'forward' if jump > 0 else 'back'} {s / n:.1f} {unit}"
    return f"{'forward' if jump > 0 else 'back'} {s:.0f} s"


def on_jump(jump: float, state: State, scheduler: Any) -> None:
    """What the daemon does about a jump of ``jump`` seconds: count it; shift the in-flight
    times the hang watchdog compares with the wall clock (forward, every probe in flight
    looked hung); log it once; give each of APScheduler's jobs back what was left of its
    wait (it fires by the wall clock: back a day, every job waited a day)."""
    with state.lock:
        state.clock_jumps_total += 1
        for ds in state.devices.values():
            if ds.in_flight_since is not None:
                ds.in_flight_since += jump
    logger.warning("the wall clock jumped %s against the monotonic clock: the probe, refit "
                   "and watchdog jobs are re-armed; retention counts age on the clock as it "
                   "was", describe(jump))
    if scheduler is None or not scheduler.running:
        return
    now = datetime.now().astimezone()
    for job in scheduler.get_jobs():
        if job.next_run_time is None:
            continue
        interval = getattr(job.trigger, "interval", None)
        left = job.next_run_time - (now - timedelta(seconds=jump))
        left = max(timedelta(0), min(left, interval) if interval else left)
        job.modify(next_run_time=now + left)
