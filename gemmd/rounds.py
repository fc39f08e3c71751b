"""One probe round on one device: do-no-harm checks, budget, measure, predict, store.

Used by the daemon's scheduled jobs and by ``gemmd probe``. A device error ends the round
for that device only; consecutive failed rounds mark it down and back off its retries.
"""

from __future__ import annotations

import copy
import logging
import math
import sqlite3
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from gemmd.config import Config
from gemmd.devices import BusyLimits, Device
from gemmd.drift import Alarm, Transition, measured_of, predicted_of, stand_in
from gemmd.errors import DeviceError, GemmdError, ProbeCancelled, UnsupportedProbe
from gemmd.gemm import ProbeSpec
from gemmd.probes import build_plan, exploration_specs
from gemmd.records import Measurement, Prediction, as_row
from gemmd.registry import ModelRegistry
from gemmd.state import ProbeState, State
from gemmd.store import Store

logger = logging.getLogger(__name__)


@dataclass
class Result:
    spec: ProbeSpec
    kind: str  # sentinel | exploration
    outcome: str  # ok | failed | mismatch | skipped
    measurement: Measurement | None = None
    prediction: Prediction | None = None
    error: str = ""


def _energy_trusted(m: Measurement, backend: str) -> bool:
    """Power/energy precise enough for drift: from observed counter steps, or a CPU's RAPL
    (updated every ~1 ms). A GPU window read between 100 ms steps errs by up to +-2 steps."""
    method = (m.context.get("after") or {}).get("energy_method")
    return method == "steps" or (method == "window" and backend == "cpu")


class _Results(list):
    """A round's results, each also handed to ``callback`` as it is appended."""

    def __init__(self, callback: Callable[[Result], None] | None):
        super().__init__()
        self.callback = callback

    def append(self, r: Result) -> None:
        super().append(r)
        if self.callback is not None:
            self.callback(r)


def transition_event(t: Transition) -> dict[str, Any]:
    """A drift transition as the store records it (an event)."""
    return {"ts": t.ts, "device_uuid": t.uuid, "kind": t.kind, "target": t.target,
            "probe": t.spec.name if t.spec is not None else None, "detail": t.detail}


def save_events(store: Store, state: State, events: Iterable[Mapping[str, Any]]) -> bool:
    """Record events (drift transitions, rebaselines, models); a write that fails is
    counted in the state's store errors (the store logs a failing episode once), never
    raised: the record must not stop what it records. True if written."""
    events = list(events)
    if not events:
        return True
    try:
        store.add_events(events)
        return True
    except (sqlite3.Error, GemmdError) as e:
        if not getattr(e, "reported", False):
            logger.error("cannot record %s event(s): %s",
                         ", ".join(sorted({str(ev.get("kind")) for ev in events})), e)
        with state.lock:
            state.store_errors_total += 1
        return False


def device_label(info: Any) -> str:
    """How logs name a device: "GPU 0", or "CPU" for the CPU backend."""
    return "CPU" if info.backend == "cpu" else f"GPU {info.index}"


class DeviceRunner:
    def __init__(self, device: Device, cfg: Config, store: Store, state: State,
                 registry: ModelRegistry, cancel: threading.Event | None = None,
                 budget_s: float | None = None, clock: Callable[[], float] = time.monotonic,
                 rng: np.random.Generator | None = None):
        """``budget_s``: probe seconds a round may spend; by default the duty-cycle budget
        (``duty_cycle x probe_interval_s``); ``math.inf`` runs every probe (gemmd probe).
        ``clock``: the host's monotonic clock, on which the budget and the busy wait are
        counted (tests inject their own rather than depend on the machine's speed).
        ``rng``: draws the exploration probes; by default from the OS's entropy, so that
        the hosts of a fleet explore different shapes (tests pass a seeded one: the shapes
        explored move every later probe's windows against the energy counter's steps)."""
        self.device = device
        self._clock = clock
        self.label = device_label(device.info)
        self.cfg = cfg
        self.budget_s = budget_s
        self.store = store
        self.state = state
        self.registry = registry
        self.cancel = cancel or threading.Event()
        self.plan, dropped = build_plan(cfg.probes.sentinels, device)
        for spec, reason in dropped.items():
            logger.info("%s: probe %s left out of the plan: %s", self.label,
                        spec.name, reason)
        state.add_device(device.info)
        with state.lock:
            state.devices[device.info.uuid].plan_size = len(self.plan)
        self._rng = rng if rng is not None else np.random.default_rng()
        self._checks: Counter = Counter()
        self._round_lock = threading.Lock()
        self._offset = 0  # where the next round starts in its cycle of probes
        # per exploration group: rounds that probed since a draw of it last ran
        self._explore_wait: dict[int, int] = {}
        self.last_skip: str | None = None  # why the last round was skipped (busy), if it was
        self.busy_skips = 0  # rounds skipped as busy in a row
        self._busy_since: float | None = None  # monotonic time of the first of them
        # Called with each result as it comes (gemmd probe prints progress with it).
        self.on_result: Callable[[Result], None] | None = None

    @property
    def _ds(self):
        return self.state.devices[self.device.info.uuid]

    def _overdue(self, max_wait_s: float) -> bool:
        """A CPU trial that has waited ``max_wait_s`` for a quiet host waits no longer; a
        GPU always waits (its busy check protects someone else's job)."""
        return (self.device.info.backend == "cpu" and max_wait_s > 0
                and self._busy_since is not None
                and self._clock() - self._busy_since >= max_wait_s)

    def _skip_all(self, reason: str, n: int) -> None:
        with self.state.lock:
            self._ds.skipped_total[reason] += n

    def wait_idle(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s for a round in progress to end; True if none runs."""
        if self._round_lock.acquire(timeout=timeout):
            self._round_lock.release()
            return True
        return False

    def run_round(self) -> list[Result]:
        """Run one round; never raises for device trouble (it is recorded instead)."""
        if not self._round_lock.acquire(blocking=False):
            return []  # the previous round of this device is still running
        try:
            return self._round()
        finally:
            self._round_lock.release()

    def _round(self) -> list[Result]:
        ds = self._ds
        mcfg = self.cfg.probes.measure
        with self.state.lock:
            ds.rounds_total += 1
            down, retry_at = not ds.up, ds.next_retry
        if down and self._clock() < retry_at:
            self._skip_all("device_down", len(self.plan))
            return []
        try:
            sched = self.cfg.schedule
            busy = self.device.busy_reason(BusyLimits(
                sched.busy_utilization, sched.busy_memory_mb << 20)) \
                if sched.skip_when_busy else None
        except DeviceError as e:
            self._round_failed(str(e))
            return [Result(self.plan[0], "sentinel", "failed", error=str(e))] if self.plan else []
        if busy and self._overdue(sched.busy_max_wait_s):
            logger.warning("%s: busy (%s) for %.0f s: probing anyway, the results time the "
                           "contention (schedule.busy_max_wait_s)", self.label, busy,
                           self._clock() - (self._busy_since or 0.0))
            busy = None
        self.last_skip = busy
        if busy:
            if self._busy_since is None:
                self._busy_since = self._clock()
            self.busy_skips += 1
            logger.info("%s: skipping round: %s", self.label, busy)
            self._skip_all(busy, len(self.plan))
            return []
        self._busy_since, self.busy_skips = None, 0
        groups = self.cfg.probes.exploration
        # a group not yet run is due: the model's first shapes come from the first round
        wait = [self._explore_wait.get(i, g.every_rounds - 1) for i, g in enumerate(groups)]
        due = [w + 1 >= g.every_rounds for w, g in zip(wait, groups)]
        drawn = [exploration_specs([g], self.device, self._rng) if due[i] else []
                 for i, g in enumerate(groups)]
        todo = self._order([s for d in drawn for s in d])
        ran: set[ProbeSpec] = set()
        budget = self.budget_s if self.budget_s is not None else \
            self.cfg.budget.duty_cycle * self.cfg.schedule.probe_interval_s
        used, results, failed, started = 0.0, _Results(self.on_result), "", 0
        for i, (spec, kind) in enumerate(todo):
            if self.cancel.is_set():
                break
            if i and used + mcfg.warmup_s + mcfg.window_s > budget:
                self._skip_all("duty_cycle", 1)
                results.append(Result(spec, kind, "skipped", error="duty_cycle"))
                continue
            started += 1
            ran.add(spec)
            check = bool(mcfg.check_every) and self._checks[spec] % mcfg.check_every == 0
            # The parent's clock: asking a worker-process device for its clock would restart
            # a worker that was just killed for hanging.
            t0 = self._clock()
            m = None
            with self.state.lock:
                ds.in_flight_since, ds.in_flight = time.time(), spec.name
            try:
                m = self.device.measure(spec, mcfg, check=check, cancel=self.cancel)
            except ProbeCancelled:
                break
            except UnsupportedProbe as e:
                logger.warning("%s: %s", self.label, e)
                self._skip_all("unsupported", 1)
                continue
            except (DeviceError, GemmdError) as e:
                failed = str(e)
                logger.error("%s: probe %s failed: %s", self.label, spec.name, e)
                results.append(self._record_failure(spec, kind, failed))
                break  # a failing device fails every probe: don't hammer it this round
            finally:
                # A simulated device's time passes faster than the wall clock: count the
                # longer of the two.
                spent = max(self._clock() - t0, m.elapsed_s if m is not None else 0.0)
                used += spent
                with self.state.lock:
                    ds.in_flight_since, ds.in_flight = None, ""
                    ds.probe_seconds_total += spent
            self._checks[spec] += 1
            results.append(self._record(spec, kind, m))
        if len(todo) > started and not failed:
            # The budget cut this round short: the next one starts where this one stopped,
            # so every probe runs within a bounded number of rounds (exploration included).
            self._offset = (self._offset + started) % max(1, len(todo))
        # A group explores every every_rounds rounds that probe, and stays due until a draw
        # of it has run: a round cut short by the budget (or by a failure) does not skip
        # it for another every_rounds (the cycle's offset could leave it out for good).
        for i, d in enumerate(drawn):
            self._explore_wait[i] = 0 if ran.intersection(d) else wait[i] + 1
        with self.state.lock:
            ds.last_round_ts = time.time()
        if failed:
            self._round_failed(failed)
        elif results:
            with self.state.lock:
                if not ds.up:
                    logger.warning("%s is back up", self.label)
                ds.up, ds.down_reason, ds.consecutive_failures = True, "", 0
        return list(results)

    def _order(self, explore: list[ProbeSpec]) -> list[tuple[ProbeSpec, str]]:
        """This round's probes: the sentinels, then this round's exploration draws, as one
        cycle started at ``_offset``. The offset moves only when a round is cut short by
        the duty-cycle budget; while everything fits, the order (and so each probe's
        thermal history within a round) stays the same."""
        cycle = [(s, "sentinel") for s in self.plan] + [(s, "exploration") for s in explore]
        k = self._offset % len(cycle) if cycle else 0
        return cycle[k:] + cycle[:k]

    def _round_failed(self, error: str) -> None:
        cfg = self.cfg.schedule
        with self.state.lock:
            ds = self._ds
            ds.consecutive_failures += 1
            if ds.consecutive_failures >= cfg.max_failures:
                extra = ds.consecutive_failures - cfg.max_failures
                backoff = min(cfg.max_backoff_s, cfg.probe_interval_s * 2 ** extra)
                ds.next_retry = self._clock() + backoff  # monotonic: a wall-clock jump
                # back would otherwise keep the device down for as long as the jump
                if ds.up:
                    logger.error("%s marked down after %d failed rounds: %s",
                                 self.label, ds.consecutive_failures, error)
                ds.up, ds.down_reason = False, "failed"
                logger.info("%s: next retry in %.0f s", self.label, backoff)

    def mark_hung(self, since: float) -> None:
        """Called by the daemon's watchdog when a probe outlives probes.measure.timeout_s."""
        with self.state.lock:
            ds = self._ds
            if ds.up or ds.down_reason != "hung":
                logger.error("%s: probe %s running for %.0f s: marked down as hung",
                             self.label, ds.in_flight, time.time() - since)
                ds.probes_total[("sentinel", "failed")] += 1
            ds.up, ds.down_reason = False, "hung"

    def _base_row(self, spec: ProbeSpec, kind: str) -> dict[str, Any]:
        info = self.device.info
        return {"ts": time.time(), "source": "daemon", "kind": kind, "device_uuid": info.uuid,
                "device_index": info.index, "device_name": info.name, "backend": info.backend,
                "m": spec.m, "n": spec.n, "k": spec.k, "dtype": spec.dtype,
                "kernel": spec.kernel, "tile": spec.tile, "layout": spec.layout}

    def _save(self, row: dict[str, Any]) -> None:
        try:
            self.store.insert_probe(row)
        except (sqlite3.Error, GemmdError) as e:
            # The store logs a failing episode itself, once (what is full, where) and once
            # when writes work again; the result stays in memory and is counted here.
            if not getattr(e, "reported", False):
                logger.error("GPU %s: cannot store probe result: %s", self.device.info.index,
                             e)
            with self.state.lock:
                self.state.store_errors_total += 1

    def _record_failure(self, spec: ProbeSpec, kind: str, error: str) -> Result:
        row = self._base_row(spec, kind)
        row.update(outcome="failed", error=error[:500])
        self._save(row)
        with self.state.lock:
            self._ds.probes_total[(kind, "failed")] += 1
        return Result(spec, kind, "failed", error=error)

    def _log_alarm(self, alarm: Alarm, tr: Any, m: Measurement, p: Prediction,
                   in_alarm: list[str]) -> None:
        """One line with what an operator needs first: how far off, and the context. A
        device-level alarm (the probes' pooled evidence) names the probes in their own."""
        target = alarm.target
        after = m.context.get("after") or {}
        clock = after.get("sm_clock_hz")
        ghz = f"{clock / 1e9:.2f} GHz" if clock else "?"
        temp = f"{after['temperature_c']:.0f} C" if "temperature_c" in after else "?"
        events = ",".join(after.get("clock_event_reasons", [])) or "none"
        context = f"SM clock {ghz}, temperature {temp}, clock events {events}"
        if alarm.spec is None:
            logger.warning(
                "%s: %s drifting (%s): measured/normal %.3f over its %d probes pooled (z %.1f, "
                "CUSUM %.1f over threshold %.1f); probes in their own alarm: %s; cause: %s; %s",
                self.label, target, tr.reason or "?", tr.ratio or float("nan"), tr.members,
                tr.last_z or 0.0, tr.cusum, tr.h or 0.0, ", ".join(in_alarm) or "none",
                tr.cause_text or tr.cause or "?", context)
            return
        meas, pred = measured_of(m)[target], predicted_of(p)[target]
        ratio = meas / pred if meas and pred else float("nan")
        logger.warning(
            "%s: %s %s drifting: measured/predicted %.3f, normal %.3f for this card "
            "(z %.1f, CUSUM %.1f); %s", self.label, alarm.spec.name, target, ratio,
            math.exp(tr.reference or 0.0), tr.last_z or 0.0, tr.cusum, context)

    def _record(self, spec: ProbeSpec, kind: str, m: Measurement) -> Result:
        info = self.device.info
        try:
            (pred,), version = self.registry.predict([spec], [info])
        except Exception as e:  # a broken model must not lose the measurement
            logger.error("prediction failed for %s: %s", spec.name, e)
            pred, version = Prediction(), ""
        outcome = "mismatch" if m.check_ok is False else "ok"
        if outcome == "mismatch":
            logger.error("%s: probe %s returned wrong results (scaled error %.3g): possible "
                         "silent data corruption", self.label, spec.name, m.check_error)
        raised: list[Alarm] = []
        with self.state.lock:
            drift = self.state.drift
            if kind == "sentinel" and outcome == "ok":
                measured = measured_of(m)
                if not _energy_trusted(m, info.backend):
                    measured["power"] = measured["energy"] = None
                # The plan tells the monitor when the round is complete: the device's
                # pooled statistic is judged then, not a round later. Targets the model
                # does not predict yet (power and energy before the first fit) are compared
                # with a stand-in: drift arms after its baseline rounds, model or not. The
                # context names an alarm's cause.
                raised = drift.observe(info.uuid, spec, measured,
                                       stand_in(predicted_of(pred), info.power_limit_w),
                                       pred.sigma, model_version=version,
                                       gpu_model=info.name, plan=self.plan,
                                       context=m.context.get("after"))
            transitions = drift.drain()
            flagged = drift.device_drifting(info.uuid)
            found = [(a, copy.copy(drift.tracks.get((info.uuid, a.spec, a.target))
                                   if a.spec is not None else
                                   drift.devices[info.uuid].targets.get(a.target)),
                      sorted(s.name for (u, s, t), tr in drift.tracks.items()
                             if u == info.uuid and t == a.target and tr.drifting))
                     for a in raised]
        for alarm, tr, in_alarm in found:
            self._log_alarm(alarm, tr, m, pred, in_alarm)
        row = self._base_row(spec, kind)
        row.update(as_row(m))
        row.update(outcome=outcome, pred_runtime_s=pred.runtime_s, pred_power_w=pred.power_w,
                   pred_energy_j=pred.energy_j, model_version=version, flagged=flagged,
                   pred_runtime_lo=pred.runtime_lo, pred_runtime_hi=pred.runtime_hi,
                   pred_power_lo=pred.power_lo, pred_power_hi=pred.power_hi,
                   pred_energy_lo=pred.energy_lo, pred_energy_hi=pred.energy_hi)
        self._save(row)
        # Alarms raised and cleared (the result's flag says only that the GPU is in alarm).
        save_events(self.store, self.state, [transition_event(t) for t in transitions])
        with self.state.lock:
            ds = self._ds
            ds.probes_total[(kind, outcome)] += 1
            ds.context = dict(m.context.get("after") or {})
            # Exploration shapes are for training only: exporting them would make label
            # cardinality unbounded.
            if kind == "sentinel":
                self.state.probes[(info.uuid, spec)] = ProbeState(spec, m, pred, row["ts"])
        return Result(spec, kind, outcome, m, pred)
