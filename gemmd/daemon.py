"""The long-running daemon: APScheduler jobs, HTTP exporter, signals, systemd notify.

One probe job per device (never overlapping itself, misfires coalesced), one refit job, and
a watchdog job that declares a probe hung. SIGTERM/SIGINT cancel the probe in flight and
stop within ``STOP_TIMEOUT_S``; a probe that does not return in time is abandoned.
"""

from __future__ import annotations

import logging
import statistics
import threading
import time
from datetime import datetime, timedelta
from typing import Any

from gemmd import rebaseline
from gemmd.clockwatch import CHECK_S, ClockWatch, interval, on_jump
from gemmd.config import Config, load_web_config
from gemmd.devices import Device
from gemmd.drift import predicted_of, residual_of, stand_in
from gemmd.errors import GemmdError
from gemmd.exporter import Exposition, host_name, serve
from gemmd.features import spec_of
from gemmd.gemm import COLUMN, ProbeSpec
from gemmd.records import Measurement
from gemmd.refit import RefitFailed, RefitProcess, error_text
from gemmd.registry import RefitResult
from gemmd.rounds import DeviceRunner, device_label, save_events
from gemmd.runtime import build
from gemmd.state import ProbeState
from gemmd.store import DAEMON_SOURCE, InstanceLock
from gemmd.systemd import sd_notify, watchdog_interval

logger = logging.getLogger(__name__)

STOP_TIMEOUT_S = 8.0  # leaves headroom under systemd's and the tests' 10 s


BUSY_FIRST_RETRY_S = 5.0


def busy_backoff_s(skips: int, cap_s: float) -> float:
    """When to look again after ``skips`` rounds skipped as busy in a row: 5 s, then twice
    as long each time, at most ``cap_s`` (schedule.busy_retry_s; 0: not before the next
    round)."""
    if cap_s <= 0 or skips <= 0:
        return 0.0
    return min(cap_s, BUSY_FIRST_RETRY_S * 2.0 ** min(skips - 1, 30))


class Daemon:
    """Start, stop and the jobs; the parts come from gemmd.runtime."""

    def __init__(self, cfg: Config, devices: list[Device] | None = None, *,
                 refit_process: bool = False):
        """``refit_process``: refit in a child process (gemmd.refit; what `gemmd run` does),
        else in this one (tests that construct a daemon inject faults into its refit)."""
        self.cfg = cfg
        # One daemon per state directory: a second one is refused, naming the first.
        self._instance = InstanceLock(cfg.resolved_state_dir()).acquire()
        try:
            rt = build(cfg, devices=devices)
        except BaseException:
            self._instance.release()
            raise
        self.clock = ClockWatch()
        self.runtime = rt
        self.state_dir, self.store, self.state = rt.state_dir, rt.store, rt.state
        self.registry, self.devices, self.runners = rt.registry, rt.devices, rt.runners
        self.cancel = rt.cancel
        self.stopping = threading.Event()
        self._first_fit = threading.Event()
        self._first_fit_lock = threading.Lock()
        self._refit_lock = threading.Lock()
        self._refit_error: str | None = None  # the last refit's failure, logged once
        self._drift_save_failing = False
        self._model_noted: str | None = None  # the model the store's last model event names
        self.scheduler: Any = None  # APScheduler's BackgroundScheduler, made in start()
        self._refits = RefitProcess(self.state_dir, cfg.model, cfg.log_level) \
            if refit_process else None
        self.httpd: Any = None
        self.port: int | None = None

    # ----------------------------------------------------------------- start
    def start(self) -> None:
        self.registry.load_active()
        self._note_model("loaded at start")
        if self.state.drift.model_version != self.registry.current.version:
            self.rereference()
        self.apply_rebaseline_request()
        self._restore()
        self._serve()
        cfg = self.cfg.schedule
        # Imported here: `gemmd probe` and the other one-shot commands don't need it.
        from apscheduler.executors.pool import ThreadPoolExecutor
        from apscheduler.schedulers.background import BackgroundScheduler

        self.scheduler = BackgroundScheduler(
            executors={"default": ThreadPoolExecutor(len(self.runners) + 2)},
            # Two instances: while a round hangs (thread isolation), the next one starts,
            # finds the device's round lock taken and returns at once. With one, APScheduler
            # logged "maximum number of running instances reached" every interval, forever;
            # the round lock is what keeps a device's rounds from overlapping.
            job_defaults={"coalesce": True, "max_instances": 2,
                          "misfire_grace_time": int(cfg.probe_interval_s)},
            timezone="UTC")
        now = datetime.now().astimezone()
        for r in self.runners:
            self.scheduler.add_job(self._probe_job, interval(cfg.probe_interval_s), args=[r],
                                   next_run_time=now,
                                   id=f"probe-{r.device.info.uuid}",
                                   name=f"probe GPU {r.device.info.index}")
        self.scheduler.add_job(self.refit, interval(cfg.refit_interval_s),
                               next_run_time=now + timedelta(seconds=cfg.refit_interval_s),
                               id="refit", name="refit")
        self.scheduler.add_job(self._watchdog, interval(5), id="hang-watchdog",
                               name="hang watchdog")
        self.scheduler.start()
        # What is served: a web config without tls_server_config (or with an empty one)
        # is plain HTTP, whatever its name says.
        logger.info("gemmd started: %d device(s), backend %s, state in %s, metrics on "
                    "%s://%s:%s/metrics", len(self.devices), self.devices[0].info.backend,
                    self.state_dir, getattr(self.httpd, "scheme", "http"),
                    self.cfg.listen.address, self.port)
        sd_notify(f"READY=1\nSTATUS=probing {len(self.devices)} device(s)")

    def _serve(self) -> None:
        addr, port = self.cfg.listen.address, self.cfg.listen.port
        path = self.cfg.listen.web_config_file
        web = load_web_config(path) if path else None  # checked with the config already
        try:
            metrics = self.cfg.metrics
            self.httpd = serve(Exposition(self.state, profile=metrics.profile,
                                          hostname=host_name(metrics.hostname)),
                               addr, port, web_config=web, ready=self.ready)
        except OSError as e:
            raise GemmdError(f"listen {addr}:{port}: {e.strerror or e}") from e
        self.port = self.httpd.server_port

    def ready(self) -> bool:
        """For /-/ready: the store and devices are open (the daemon exists), its jobs are
        scheduled, and it is not stopping."""
        return self.scheduler is not None and self.scheduler.running and \
            not self.stopping.is_set()

    def _restore(self) -> None:
        """Show the last stored sentinel results again after a restart (with their age)."""
        runners = {r.device.info.uuid: r for r in self.runners}
        by_dev: dict[str, list] = {}
        for row in self.store.latest_per_probe():
            r = runners.get(row["device_uuid"])
            if r is None or row["outcome"] != "ok" or row["runtime_s"] is None:
                continue
            m = _measurement_from_row(row)
            if m.spec in r.plan:
                by_dev.setdefault(row["device_uuid"], []).append((row, m))
        restored = 0
        for uuid, items in by_dev.items():
            info = runners[uuid].device.info
            try:  # one batch per device: a forest predicts 100 rows about as fast as one
                preds, _ = self.registry.predict([m.spec for _, m in items], [info] * len(items))
            except Exception as e:  # restore is best-effort; probing will refresh it
                logger.warning("restore: cannot predict for %s: %s", uuid, e)
                continue
            with self.state.lock:
                for (row, m), pred in zip(items, preds):
                    self.state.probes[(uuid, m.spec)] = ProbeState(m.spec, m, pred, row["ts"])
            restored += len(items)
        if restored:
            logger.info("restored %d stored sentinel results", restored)

    # ----------------------------------------------------------------- jobs
    def _probe_job(self, runner: DeviceRunner) -> None:
        if self.stopping.is_set():
            return
        try:
            runner.run_round()
        except Exception:  # one device's bug must never stop the others
            logger.exception("%s: probe round crashed", runner.label)
        self._save_drift()
        retry = busy_backoff_s(runner.busy_skips, self.cfg.schedule.busy_retry_s)
        if runner.last_skip and retry and retry < self.cfg.schedule.probe_interval_s and \
                self.scheduler is not None and not self.stopping.is_set():
            # Busy now is not busy for a whole interval: look again soon (5 s, 10 s, ...).
            self.scheduler.add_job(self._probe_job, "date", args=[runner],
                                   run_date=datetime.now().astimezone()
                                   + timedelta(seconds=retry),
                                   id=f"retry-{runner.device.info.uuid}",
                                   name=f"retry {runner.label}", replace_existing=True)
        if self.registry.current.kind == "roofline" and self.scheduler and \
                not self.stopping.is_set() and not self._first_fit.is_set():
            # First model as soon as enough data exists, not an hour later.
            n = len(self.store.probes(limit=self.cfg.model.min_samples))
            with self._first_fit_lock:  # every device's job gets here: schedule it once
                if n >= self.cfg.model.min_samples and not self._first_fit.is_set():
                    self._first_fit.set()
                    self.scheduler.add_job(self.refit, id="first-fit", name="first fit",
                                           replace_existing=True)

    def refit(self) -> None:
        with self._refit_lock:
            self._refit()
        # A refit frees hundreds of MB (training table, forests, cross-validation fits) that
        # glibc keeps in the arena of the scheduler thread that ran it: RSS grew by about a
        # refit's working set every few refits (bench/RESULTS.md, "Memory over a week").
        release_freed_memory()

    def _refit(self) -> None:
        if self.stopping.is_set():
            return
        try:
            where = ""
            if self._refits is not None:
                result = self._refits.run()
                if self.stopping.is_set():
                    return
                if result.accepted or self.registry.prior is not None:
                    # The model the child registered (a reference model is calibrated on
                    # the store again here, as a refit in this process would have).
                    self.registry.load_active()
                if self._refits.peak_mib:
                    where = f", {self._refits.peak_mib:.0f} MiB at peak in its own process"
            else:
                result = self.registry.refit(cancel=self.stopping)
            self._record_refit(result)
            logger.info("refit: %s (%s; %d of %d stored probes, fit %.1f s, refit %.1f s%s); "
                        "predictions from %s", result.outcome, result.reason, result.rows,
                        result.rows_total, result.fit_s, result.seconds, where,
                        self.registry.current.version)
            self._refit_error = None
            if result.accepted:
                self.rereference()
            if result.outcome == "insufficient_data":
                self._first_fit.clear()  # try again after the next round
        except (OSError, GemmdError) as e:
            if self.stopping.is_set() and isinstance(e, RefitFailed):
                return  # ended by the stop: no failure
            # Weather (a full disk, a store that cannot be written), not a bug: one line,
            # and only when it changes (the store logs its own write failures once).
            msg = error_text(e)
            if msg != self._refit_error and not getattr(e, "reported", False):
                logger.error("refit failed: %s", msg)
            self._refit_error = msg
            self._record_refit(None)
        except Exception as e:
            logger.exception("refit failed: %s", e)
            self._record_refit(None)
        try:
            # The daemon's own probes only: imported sources are the user's data.
            n = self.store.prune(self.cfg.store.retention_days, self.cfg.store.max_rows,
                                 now=self.clock.now(), sources=(DAEMON_SOURCE,))
            if n:
                logger.info("store: pruned %d old probe results of the daemon", n)
        except Exception as e:
            if not getattr(e, "reported", False):
                logger.error("store: prune failed: %s", e)

    def _record_refit(self, result: RefitResult | None) -> None:
        """The one place a refit is recorded: in the live state (None: it failed) and, for
        the record, in the store's events (a model activated; a new model rejected)."""
        with self.state.lock:
            model = self.state.model
            if result is None:
                model.refits_total["failed"] += 1
            else:
                model.refits_total[result.outcome] += 1
                model.last_refit_ts = result.ts
        if result is None:
            return
        if result.outcome == "rejected":
            save_events(self.store, self.state, [{
                "ts": result.ts, "kind": "refit_rejected",
                "detail": {"reason": result.reason, "rows": result.rows,
                           "version": result.version}}])
        # A refit accepted registers a model; one that found too little data may still
        # re-calibrate a reference model: recorded when the model predictions come from
        # changes (or was registered anew).
        self._note_model(f"refit {result.outcome}: {result.reason}", ts=result.ts,
                         rows=result.rows, force=result.accepted)

    def _note_model(self, reason: str, *, ts: float | None = None, rows: int | None = None,
                    force: bool = False) -> None:
        """Record a ``model`` event when the model predictions come from is not the one
        the store's last model event names (``force``: a model registered anew). The
        roofline a daemon starts with, before any model, is no event."""
        current, created = self.registry.current, self.registry.created
        if self._model_noted is None:
            try:
                last = [e for e in self.store.last_events("model") if e["device_uuid"] is None]
            except GemmdError as e:
                logger.debug("cannot read the last model event: %s", e)
                last = []
            self._model_noted = str(last[0]["detail"].get("version", "")) if last and \
                isinstance(last[0]["detail"], dict) else ""
        if not force and (current.version == self._model_noted or
                          (not self._model_noted and current.kind == "roofline")):
            return  # unchanged; or the roofline before any model (back to it is recorded)
        meta = current.meta if isinstance(getattr(current, "meta", None), dict) else {}
        if save_events(self.store, self.state, [{"ts": ts, "kind": "model", "detail": {
                "version": current.version, "kind": current.kind,
                "rows": int(meta.get("n_samples", 0) or 0) if rows is None else rows,
                "created": created, "reason": reason}}]):
            self._model_noted = current.version

    def _save_drift(self) -> None:
        with self.state.lock:  # rounds of several devices save at once: one line, not two
            try:
                self.state.drift.save()
            except OSError as e:
                if not self._drift_save_failing:  # once per episode, not after every round
                    logger.error("cannot save drift state: %s (kept in memory; retried "
                                 "after every round)", e)
                self._drift_save_failing = True
                return
            if self._drift_save_failing:
                logger.warning("drift state saved again")
                self._drift_save_failing = False

    def rereference(self) -> None:
        """Re-take drift references under the current model from stored healthy results.

        Results taken while a device was flagged are not used, so a degradation that is
        in alarm stays in alarm across a refit.
        """
        drift = self.state.drift
        old_version = drift.model_version
        n = max(drift.p.baseline_probes * 2, 10)
        infos = {r.device.info.uuid: r.device.info for r in self.runners}
        with self.state.lock:
            keys = list(drift.tracks)
        by_dev: dict[str, dict[ProbeSpec, list[str]]] = {}
        for uuid, spec, target in keys:
            by_dev.setdefault(uuid, {}).setdefault(spec, []).append(target)
        for uuid, targets_of in by_dev.items():
            info = infos.get(uuid)
            if info is None:
                continue
            rows = self.store.probes(device_uuid=uuid, limit=5000)
            specs = list(targets_of)
            # A prediction depends on the spec and device only: one per spec, in one batch.
            preds, _ = self.registry.predict(specs, [info] * len(specs))
            limit = info.power_limit_w
            for spec, p in zip(specs, preds):
                ours = [r for r in rows if r["kind"] == "sentinel" and spec_of(r) == spec]
                mine = ours[:n]
                new = stand_in(predicted_of(p), limit)  # as the rounds compare (drift.stand_in)
                for target in targets_of[spec]:
                    col = COLUMN[target]
                    res = [x for x in (residual_of(r[col], new[target]) for r in mine)
                           if x is not None]
                    # The new model moves the probe's residuals by log(old / new
                    # prediction), known exactly from results predicted by the model the
                    # references were taken under: the drift state moves by it and keeps
                    # what it learnt (re-taking the level from a few results would cost
                    # hours of sensitivity after every refit).
                    moved = [x for x in (residual_of(stand_in(
                        {t: r[f"pred_{COLUMN[t]}"] for t in COLUMN}, limit)[target], new[target])
                        for r in ours if old_version and r["model_version"] == old_version)
                        if x is not None]
                    shift = statistics.median(moved) if moved else None
                    with self.state.lock:
                        drift.rereference(uuid, spec, target, res, p.sigma.get(target, 0.0),
                                          shift=shift)
        with self.state.lock:
            drift.model_version = self.registry.current.version
        self._save_drift()
        logger.info("drift references re-taken under model %s", self.registry.current.version)

    def apply_rebaseline_request(self) -> None:
        """Apply a pending `gemmd rebaseline` (see gemmd.rebaseline)."""
        if rebaseline.apply_request(self.state_dir, self.state, self.store):
            self._save_drift()

    def _watchdog(self) -> None:
        self.apply_rebaseline_request()
        self.store.check_file()  # deleted or replaced while running (logs itself)
        timeout = self.cfg.probes.measure.timeout_s
        for r in self.runners:
            since = self.state.devices[r.device.info.uuid].in_flight_since
            if since is not None and time.time() - since > timeout:
                r.mark_hung(since)

    # ----------------------------------------------------------------- run/stop
    def run_forever(self) -> None:
        wd = watchdog_interval()
        while not self.stopping.wait(min(wd, CHECK_S) if wd else CHECK_S):
            self.check_clock()  # here, not a job: the scheduler is what a jump stops
            if wd and self.scheduler is not None and self.scheduler.running:
                sd_notify("WATCHDOG=1")

    def check_clock(self) -> float | None:
        """A jump of the wall clock: re-arm the jobs, log and count it (gemmd.clockwatch)."""
        jump = self.clock.check()
        if jump is not None:
            on_jump(jump, self.state, self.scheduler)
        return jump

    def request_stop(self, signum: int | None = None) -> None:
        if not self.stopping.is_set():
            logger.info("stopping (signal %s)", signum)
        self.stopping.set()
        self.cancel.set()

    def stop(self) -> bool:
        """Stop everything; True if every probe finished, False if one was abandoned."""
        sd_notify("STOPPING=1")
        self.request_stop()
        deadline = time.monotonic() + STOP_TIMEOUT_S
        if self.scheduler is not None and self.scheduler.running:
            self.scheduler.shutdown(wait=False)
        clean = True
        for r in self.runners:
            if not r.wait_idle(max(0.0, deadline - time.monotonic())):
                clean = False
                logger.warning("%s: probe did not stop in time; abandoned", r.label)
        # A refit in a child process ends at once (SIGTERM; a model being registered is
        # finished first). One in this process cannot be interrupted inside scikit-learn:
        # wait until the deadline, then leave it (it registers nothing once stopping is
        # set) and keep the store open.
        if self._refits is not None:
            self._refits.stop(max(0.0, deadline - time.monotonic() - 1.0))
        refit_done = self._refit_lock.acquire(timeout=max(0.0, deadline - time.monotonic()))
        if not refit_done:
            clean = False
            logger.warning("refit still running at shutdown; abandoned")
        for d, e in self.runtime.close_devices():
            logger.warning("%s: close failed: %s", device_label(d.info), e)
        if self.httpd is not None:
            self.httpd.shutdown()
            self.httpd.server_close()
        if refit_done:
            self.store.close()
            self._refit_lock.release()
        self._instance.release()
        logger.info("stopped")
        return clean


_malloc_trim: Any = None  # glibc's malloc_trim, False where there is none


def release_freed_memory() -> None:
    """Hand the heap the C allocator keeps after freeing back to the OS (glibc's
    malloc_trim, which trims every thread's arena; a no-op with other C libraries)."""
    global _malloc_trim
    if _malloc_trim is None:
        import ctypes

        try:
            _malloc_trim = ctypes.CDLL(None).malloc_trim
        except (OSError, AttributeError):
            _malloc_trim = False
    if _malloc_trim:
        _malloc_trim(0)


def _measurement_from_row(row: dict) -> Measurement:
    from gemmd.features import spec_of

    return Measurement(
        spec=spec_of(row), iterations=row["iterations"] or 0, runtime_s=row["runtime_s"],
        runtime_mean_s=row["runtime_mean_s"] or row["runtime_s"],
        runtime_min_s=row["runtime_min_s"] or row["runtime_s"],
        runtime_p90_s=row["runtime_p90_s"] or row["runtime_s"],
        runtime_cv=row["runtime_cv"] or 0.0, window_s=row["window_s"] or 0.0,
        energy_j=row["energy_j"], power_w=row["power_w"], power_sample_w=row["power_sample_w"],
        context=row["context"] if isinstance(row["context"], dict) else {})
