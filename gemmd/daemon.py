"""The long-running daemon: APScheduler jobs, HTTP exporter, signals, systemd notify.

One probe job per device (never overlapping itself, misfires coalesced), one refit job, and
a watchdog job that declares a probe hung. SIGTERM/SIGINT cancel the probe in flight and
stop within ``STOP_TIMEOUT_S``; a probe that does not return in time is abandoned.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from gemmd.config import Config
from gemmd.devices import Device, open_devices
from gemmd.drift import DriftMonitor, DriftParams, residual_of
from gemmd.errors import GemmdError
from gemmd.exporter import Exposition, serve
from gemmd.features import spec_of
from gemmd.gemm import COLUMN, ProbeSpec
from gemmd.probes import Measurement
from gemmd.registry import ModelRegistry
from gemmd.rounds import DeviceRunner
from gemmd.state import ProbeState, State
from gemmd.store import DAEMON_SOURCE, Store

logger = logging.getLogger(__name__)

STOP_TIMEOUT_S = 8.0  # leaves headroom under systemd's and the tests' 10 s
REBASELINE_REQUEST = "rebaseline.request"  # written by `gemmd rebaseline`


def sd_notify(message: str) -> bool:
    """Send a systemd notification (READY=1, WATCHDOG=1, STOPPING=1...) if asked to."""
    addr = os.environ.get("NOTIFY_SOCKET")
    if not addr:
        return False
    if addr.startswith("@"):
        addr = "\0" + addr[1:]  # abstract namespace
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            s.connect(addr)
            s.sendall(message.encode())
        return True
    except OSError as e:
        logger.warning("systemd notify failed (%s): %s", message.split("=")[0], e)
        return False


def watchdog_interval() -> float | None:
    """Half of systemd's WatchdogSec, when it applies to this process."""
    usec = os.environ.get("WATCHDOG_USEC")
    pid = os.environ.get("WATCHDOG_PID")
    if not usec or (pid and pid != str(os.getpid())):
        return None
    try:
        return int(usec) / 2e6
    except ValueError:
        return None


def state_store(cfg: Config) -> tuple[Path, Store]:
    state_dir = cfg.resolved_state_dir()
    try:
        state_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise GemmdError(f"state_dir {state_dir}: cannot create: {e.strerror}") from e
    if not os.access(state_dir, os.W_OK):
        raise GemmdError(f"state_dir {state_dir}: not writable by this user")
    return state_dir, Store(state_dir / "gemmd.db")


class Daemon:
    def __init__(self, cfg: Config, devices: list[Device] | None = None):
        self.cfg = cfg
        self.state_dir, self.store = state_store(cfg)
        self.state = State()
        self.registry = ModelRegistry(self.store, self.state_dir / "models", cfg.model,
                                      self.state)
        self.devices = devices if devices is not None else open_devices(cfg)
        if not self.devices:
            raise GemmdError("no devices to probe (check 'devices' and 'backend')")
        self.state.probe_interval_s = cfg.schedule.probe_interval_s
        d = cfg.drift
        self.state.drift = DriftMonitor(
            DriftParams(shift=d.shift, arl0=d.arl0, baseline_probes=d.baseline_probes,
                        min_scale=d.min_scale, accept_after_s=d.accept_after_s,
                        targets=d.targets), self.state_dir / "drift.json")
        self.cancel = threading.Event()
        self.stopping = threading.Event()
        self._first_fit = threading.Event()
        self._first_fit_lock = threading.Lock()
        self._refit_lock = threading.Lock()
        self._refit_error: str | None = None  # the last refit's failure, logged once
        self._drift_save_failing = False
        self.runners: list[DeviceRunner] = []
        for d in self.devices:
            self.store.upsert_device(d.info.uuid, d.info.index, d.info.name, d.info.backend,
                                     _info_dict(d))
            self.runners.append(DeviceRunner(d, cfg, self.store, self.state, self.registry,
                                             self.cancel))
        self.scheduler: Any = None  # APScheduler's BackgroundScheduler, made in start()
        self.httpd = None
        self.port: int | None = None

    # ----------------------------------------------------------------- start
    def start(self) -> None:
        self.registry.load_active()
        if self.state.drift.model_version != self.registry.current.version:
            self._rereference()
        self._apply_rebaseline_request()
        self._restore()
        self._serve()
        cfg = self.cfg.schedule
        # Imported here: `gemmd probe` and the other one-shot commands don't need it.
        from apscheduler.executors.pool import ThreadPoolExecutor
        from apscheduler.schedulers.background import BackgroundScheduler

        self.scheduler = BackgroundScheduler(
            executors={"default": ThreadPoolExecutor(len(self.runners) + 2)},
            job_defaults={"coalesce": True, "max_instances": 1,
                          "misfire_grace_time": int(cfg.probe_interval_s)},
            timezone="UTC")
        now = datetime.now().astimezone()
        for r in self.runners:
            self.scheduler.add_job(self._probe_job, "interval", args=[r],
                                   seconds=cfg.probe_interval_s, next_run_time=now,
                                   id=f"probe-{r.device.info.uuid}",
                                   name=f"probe GPU {r.device.info.index}")
        self.scheduler.add_job(self.refit, "interval", seconds=cfg.refit_interval_s,
                               next_run_time=now + timedelta(seconds=cfg.refit_interval_s),
                               id="refit", name="refit")
        self.scheduler.add_job(self._watchdog, "interval", seconds=5, id="hang-watchdog",
                               name="hang watchdog")
        self.scheduler.start()
        logger.info("gemmd started: %d device(s), backend %s, state in %s, metrics on %s:%s",
                    len(self.devices), self.devices[0].info.backend, self.state_dir,
                    self.cfg.listen.address, self.port)
        sd_notify(f"READY=1\nSTATUS=probing {len(self.devices)} device(s)")

    def _serve(self) -> None:
        addr, port = self.cfg.listen.address, self.cfg.listen.port
        try:
            self.httpd = serve(Exposition(self.state), addr, port)
        except OSError as e:
            raise GemmdError(f"listen {addr}:{port}: {e.strerror or e}") from e
        self.port = self.httpd.server_port

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
            logger.exception("GPU %s: probe round crashed", runner.device.info.index)
        self._save_drift()
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

    def _refit(self) -> None:
        if self.stopping.is_set():
            return
        try:
            outcome = self.registry.refit(cancel=self.stopping)
            logger.info("refit: %s", outcome)
            self._refit_error = None
            if outcome == "accepted":
                self._rereference()
            if outcome == "insufficient_data":
                self._first_fit.clear()  # try again after the next round
        except (OSError, GemmdError) as e:
            # Weather (a full disk, a store that cannot be written), not a bug: one line,
            # and only when it changes (the store logs its own write failures once).
            msg = f"{e.strerror}: {e.filename}" if isinstance(e, OSError) and e.filename \
                else str(e)
            if msg != self._refit_error and not getattr(e, "reported", False):
                logger.error("refit failed: %s", msg)
            self._refit_error = msg
            with self.state.lock:
                self.state.model.refits_total["failed"] += 1
        except Exception as e:
            logger.exception("refit failed: %s", e)
            with self.state.lock:
                self.state.model.refits_total["failed"] += 1
        try:
            # The daemon's own probes only: imported sources are the user's data.
            n = self.store.prune(self.cfg.store.retention_days, self.cfg.store.max_rows,
                                 sources=(DAEMON_SOURCE,))
            if n:
                logger.info("store: pruned %d old probe results of the daemon", n)
        except Exception as e:
            if not getattr(e, "reported", False):
                logger.error("store: prune failed: %s", e)

    def _save_drift(self) -> None:
        try:
            with self.state.lock:
                self.state.drift.save()
        except OSError as e:
            if not self._drift_save_failing:  # once per episode, not after every round
                logger.error("cannot save drift state: %s (kept in memory; retried after "
                             "every round)", e)
            self._drift_save_failing = True
            return
        if self._drift_save_failing:
            logger.warning("drift state saved again")
            self._drift_save_failing = False

    def _rereference(self) -> None:
        """Re-take drift references under the current model from stored healthy results.

        Results taken while a device was flagged are not used, so a degradation that is
        in alarm stays in alarm across a refit.
        """
        drift = self.state.drift
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
            for spec, p in zip(specs, preds):
                mine = [r for r in rows if r["kind"] == "sentinel" and spec_of(r) == spec][:n]
                for target in targets_of[spec]:
                    col = COLUMN[target]
                    res = [x for x in (residual_of(r[col], getattr(p, col)) for r in mine)
                           if x is not None]
                    with self.state.lock:
                        drift.rereference(uuid, spec, target, res, p.sigma.get(target, 0.0))
        with self.state.lock:
            drift.model_version = self.registry.current.version
        self._save_drift()
        logger.info("drift references re-taken under model %s", self.registry.current.version)

    def _apply_rebaseline_request(self) -> None:
        path = self.state_dir / REBASELINE_REQUEST
        if not path.exists():
            return
        try:
            req = json.loads(path.read_text())
            uuids = req.get("devices")
        except (OSError, ValueError) as e:
            logger.error("ignoring unreadable %s: %s", path, e)
            path.unlink(missing_ok=True)
            return
        with self.state.lock:
            for uuid in uuids if uuids is not None else [None]:
                self.state.drift.rebaseline(uuid)
        self.store.unflag(uuids)
        path.unlink(missing_ok=True)
        self._save_drift()
        logger.warning("rebaseline of %s: drift references reset; results taken while "
                       "drifting now count for training", ", ".join(uuids or ["all devices"]))

    def _watchdog(self) -> None:
        self._apply_rebaseline_request()
        timeout = self.cfg.probes.measure.timeout_s
        for r in self.runners:
            since = self.state.devices[r.device.info.uuid].in_flight_since
            if since is not None and time.time() - since > timeout:
                r.mark_hung(since)

    # ----------------------------------------------------------------- run/stop
    def run_forever(self) -> None:
        wd = watchdog_interval()
        while not self.stopping.wait(wd or 3600.0):
            if wd and self.scheduler is not None and self.scheduler.running:
                sd_notify("WATCHDOG=1")

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
            left = max(0.0, deadline - time.monotonic())
            if r._round_lock.acquire(timeout=left):
                r._round_lock.release()
            else:
                clean = False
                logger.warning("GPU %s: probe did not stop in time; abandoned",
                               r.device.info.index)
        # A refit cannot be interrupted inside scikit-learn: wait until the deadline, then
        # leave it (it registers nothing once stopping is set) and keep the store open.
        refit_done = self._refit_lock.acquire(timeout=max(0.0, deadline - time.monotonic()))
        if not refit_done:
            clean = False
            logger.warning("refit still running at shutdown; abandoned")
        for d in self.devices:
            try:
                d.close()
            except Exception as e:
                logger.warning("GPU %s: close failed: %s", d.info.index, e)
        if self.httpd is not None:
            self.httpd.shutdown()
            self.httpd.server_close()
        if refit_done:
            self.store.close()
            self._refit_lock.release()
        logger.info("stopped")
        return clean


def _info_dict(d: Device) -> dict:
    import dataclasses

    return dataclasses.asdict(d.info)


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
