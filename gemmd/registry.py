"""Which model predictions come from: load the active one, refit, keep the last N.

A refit replaces the current model only if it is not worse on the probes the current model
has never seen (cross-validated predictions of the new recipe against the old model's):
comparing each model's error on its own training data would favour whichever overfits more.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import sqlite3
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from gemmd.config import ModelConfig
from gemmd.errors import ModelError, StoreError
from gemmd.features import NUMERIC_DEFAULTS, TARGET_COLUMNS, TEXT_DEFAULTS, Table
from gemmd.gemm import ProbeSpec
from gemmd.model import ForestModel, RooflinePredictor, TransferModel, describe_calibration
from gemmd.modelfile import check_archive
from gemmd.records import DeviceInfo, Prediction
from gemmd.state import State
from gemmd.store import DAEMON_SOURCE, Store, measured_by

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RefitResult:
    """What one refit did; the daemon's refit job records it in the live state.

    ``outcome``: accepted (registered, predictions come from it), rejected (the current
    model stays: nothing new to judge it on, or the new one is worse on unseen probes),
    insufficient_data, or cancelled (shutdown began during the fit: nothing registered).
    """

    outcome: str
    reason: str  # why, in words
    rows: int  # probes the fit used (model.max_training_rows keeps the newest repeats)
    rows_total: int  # usable probes stored
    fit_s: float  # seconds fitting the new forest (0 when none was fitted)
    seconds: float  # the whole refit, reading and validating included
    version: str  # the model predictions come from after the refit
    ts: float  # unix time the refit ended

    @property
    def accepted(self) -> bool:
        return self.outcome == "accepted"


def device_infos(store: Store) -> dict[str, DeviceInfo]:
    out = {}
    fields = {f.name for f in dataclasses.fields(DeviceInfo)}
    for d in store.devices():
        info = d["info"]
        if isinstance(info, dict):
            out[d["uuid"]] = DeviceInfo(**{k: v for k, v in info.items() if k in fields})
    return out


def training_data(store: Store, sources: Sequence[str] = ("daemon",)
                  ) -> tuple[list[dict[str, Any]], list[DeviceInfo]]:
    """Good probes (not flagged as drifting) whose device is known, oldest first."""
    infos = device_infos(store)
    rows = [r for r in reversed(store.probes(sources=sources)) if r["device_uuid"] in infos]
    for r in rows:  # whose measurement, not the store's name of an import
        r["source"] = measured_by(r)
    return rows, [infos[r["device_uuid"]] for r in rows]


def training_table(store: Store, sources: Sequence[str] = ("daemon",),
                   max_rows: int | None = 200_000) -> tuple[Table, int]:
    """What ``training_data`` gives, as a Table (with ``ts``), read column-wise and bounded:
    (table, rows matching before the cap). Same rows, same order, same table when the
    store holds at most ``max_rows`` usable probes."""
    infos = device_infos(store)
    cols, total = store.training_columns(sources, max_rows)
    uuids = cols.pop("device_uuid")
    known = np.fromiter((u in infos for u in uuids), dtype=bool, count=len(uuids))
    if not known.all():
        cols = {k: v[known] for k, v in cols.items()}
        uuids = uuids[known]
    index: dict[str, int] = {}  # device uuid -> position, in order of first appearance
    device = np.fromiter((index.setdefault(u, len(index)) for u in uuids), dtype=np.int64,
                         count=len(uuids))
    devices = [infos[u] for u in index]
    out: dict[str, np.ndarray] = {c: cols[c] for c in ("m", "n", "k")}
    for c, d in NUMERIC_DEFAULTS.items():
        out[c] = np.where(np.isnan(cols[c]), d, cols[c])
    n = len(device)
    for c, text in TEXT_DEFAULTS.items():
        out[c] = np.array([v or text for v in cols[c]], dtype=object) if c in cols else \
            np.full(n, text, dtype=object)
    for c in TARGET_COLUMNS:
        out[c] = cols[c]
    out["ts"] = cols["ts"]
    out["source"] = np.array([v or "" for v in cols["measured_by"]], dtype=object)
    return Table(out, devices, device), total


class ModelRegistry:
    """The active model. ``state``, if given, shows which one it is (version, scores);
    refit outcomes are returned, for the caller to record."""

    def __init__(self, store: Store, model_dir: Path, cfg: ModelConfig, state: State | None = None):
        self.store = store
        self.model_dir = Path(model_dir)
        self.cfg = cfg
        self.state = state
        self._lock = threading.Lock()
        self.current: Any = RooflinePredictor(cfg.roofline_efficiency)
        self.created: float | None = None
        self.prior: ForestModel | None = None  # the fleet's reference model, if configured
        if cfg.reference:
            try:
                check_archive(Path(cfg.reference).expanduser())  # a file that travelled
                self.prior = ForestModel.load(Path(cfg.reference).expanduser(),
                                              cfg.reference_sha256.lower() or None)
                self.prior.version = f"ref-{self.prior.meta.get('data_hash', '')[:8]}"
                logger.info("reference model %s (%s): each device is calibrated on its own "
                            "probes", cfg.reference, self.prior.version)
            except ModelError as e:
                logger.error("model.reference unusable, predicting without it: %s", e)

    # ------------------------------------------------------------- loading
    def load_active(self) -> None:
        """Load the newest usable model; a bad file is logged and the previous one tried."""
        models = self.store.models()
        active = [m for m in models if m["active"]]
        for rec in active + [m for m in models if not m["active"]]:
            try:
                sha = rec["meta"].get("sha256") if isinstance(rec["meta"], dict) else None
                if not sha:  # every registered model has one: its absence is tampering
                    raise ModelError(f"model file {rec['path']} has no recorded checksum in "
                                     "the store; refusing to load it unverified")
                model = ForestModel.load(rec["path"], sha)
            except ModelError as e:
                logger.error("model %d unusable: %s", rec["version"], e)
                continue
            model.version = f"rf-{rec['version']}"
            self._set(model, rec["created"])
            if not rec["active"]:
                self.store.activate_model(rec["version"])
            logger.info("loaded model %s (%d samples)", model.version, rec["n_samples"])
            self._calibrate_prior(model)
            return
        if self.prior is not None:
            self._calibrate_prior(None)
            return
        logger.info("no fitted model yet: predictions come from the roofline estimate")

    def _calibrate_prior(self, own: ForestModel | None) -> None:
        """With a reference model: predict with it, calibrated per device on the stored
        probes (and choosing the device's own forest where cross-validation prefers it)."""
        if self.prior is None:
            return
        t, _ = training_table(self.store, ("daemon",), self.cfg.max_training_rows or None)
        model = TransferModel.fit(self.prior, t, self.cfg, own=own)
        self._set(model, time.time())
        logger.info("predictions from %s calibrated on %d stored probes: %s", model.version,
                    len(t), describe_calibration(model))

    def _set(self, model: ForestModel | TransferModel | RooflinePredictor,
             created: float | None) -> None:
        """Make ``model`` the active one, and show it in the live state (if given)."""
        with self._lock:
            self.current = model
            self.created = created
        if self.state is not None:
            with self.state.lock:
                ms = self.state.model
                ms.version, ms.kind = model.version, model.kind
                ms.created = created
                ms.n_samples = int(model.meta.get("n_samples", 0))
                ms.scores = dict(model.meta.get("scores", {}))

    # ------------------------------------------------------------- predicting
    def predict(self, specs: Sequence[ProbeSpec], infos: Sequence[DeviceInfo]
                ) -> tuple[list[Prediction], str]:
        with self._lock:
            model = self.current
        # the daemon's own probes: a model that knows a GPU model only through an
        # imported source's timings does not call them in its domain
        return model.predict(specs, infos, DAEMON_SOURCE), model.version

    # ------------------------------------------------------------- refitting
    def refit(self, sources: Sequence[str] = ("daemon",), force: bool = False,
              cancel: threading.Event | None = None) -> RefitResult:
        """Fit on stored probes and register the new model unless it is worse than the
        current one on probes that one has never seen (``force``: register it anyway).

        Returns what happened, for the caller to log and record (only a rejection of a worse
        model is logged here, as a warning). Errors (a store that cannot be written, a
        full disk) are raised.
        """
        start = time.monotonic()
        cap = self.cfg.max_training_rows or None  # beyond it, see Store.training_columns
        t, total = training_table(self.store, sources, cap)
        fit_s = 0.0

        def result(outcome: str, reason: str) -> RefitResult:
            with self._lock:
                version = self.current.version
            return RefitResult(outcome, reason, len(t), total, fit_s,
                               time.monotonic() - start, version, time.time())

        if len(t) < total:
            logger.info("refit: training on %d of %d stored probes (model.max_training_rows "
                        "%d: each configuration keeps its newest repeats)", len(t), total, cap)
        if len(t) < self.cfg.min_samples:
            reason = f"{len(t)} samples, need model.min_samples={self.cfg.min_samples}"
            if self.prior is not None and len(t):  # the reference, calibrated on what exists
                self._calibrate_prior(None)
            return result("insufficient_data", reason)
        fit_start = time.monotonic()
        try:
            new = ForestModel.fit_table(t, self.cfg)
        except ModelError as e:
            return result("insufficient_data", str(e))
        fit_s = time.monotonic() - fit_start
        with self._lock:
            old, old_created = self.current, self.created
        if isinstance(old, TransferModel):  # a new forest is judged against the last one
            old = old.own
            old_created = old.meta.get("created") if old is not None else None
        if isinstance(old, ForestModel) and not force:
            unseen = np.flatnonzero(t["ts"] > (old_created or 0))
            if not len(unseen):
                return result("rejected", f"no probes since model {old.version}; keeping it")
            new_err, old_err = self._compare(new, old, t, unseen)
            if new_err > old_err:
                reason = (f"new model's runtime error {100 * new_err:.2f}% on {len(unseen)} "
                          f"unseen probes is worse than current {old.version}'s "
                          f"{100 * old_err:.2f}%")
                logger.warning("refit rejected: %s", reason)
                return result("rejected", reason)
        if cancel is not None and cancel.is_set():
            return result("cancelled", "shutting down; the new model is not registered")
        version = self.register(new)
        self._calibrate_prior(new)
        return result("accepted", f"model rf-{version} registered"
                      + (" (forced)" if force and isinstance(old, ForestModel) else ""))

    def _compare(self, new: ForestModel, old: ForestModel, t: Table, idx: np.ndarray
                 ) -> tuple[float, float]:
        """Runtime MAPE of each model on probes the old model never saw.

        The old model is scored directly. The new recipe is scored out of sample too: two
        forests, each fitted on everything but one half of those probes, predict that half
        (the new model's own fit has seen them, and its out-of-bag estimates leave out
        whole configurations, which the old model did see: neither would be fair).
        """
        unseen = np.asarray(idx)
        measured = t["runtime_s"][unseen]
        old_pred = old.predict_table(t.take(unseen))["runtime"]["point"]
        new_pred = np.full(len(unseen), np.nan)
        halves = (unseen[0::2], unseen[1::2])
        for j, held in enumerate(halves):
            if not len(held):
                continue
            keep = np.setdiff1d(np.arange(len(t)), held)
            try:
                cv = ForestModel.fit_table(t.take(keep), self.cfg, targets=("runtime",))
            except ModelError:
                return 0.0, 0.0  # too little data to validate: nothing to compare
            new_pred[j::2] = cv.predict_table(t.take(held))["runtime"]["point"]
        ok = np.isfinite(measured) & np.isfinite(new_pred) & np.isfinite(old_pred)
        if not ok.any():
            return 0.0, 0.0
        new_err = float(np.mean(np.abs(new_pred[ok] - measured[ok]) / measured[ok]))
        old_err = float(np.mean(np.abs(old_pred[ok] - measured[ok]) / measured[ok]))
        return new_err, old_err

    def register(self, model: ForestModel) -> int:
        """Save atomically, record in the store as active, keep the last ``keep`` files."""
        created = model.meta["created"]
        path = self.model_dir / f"model-{int(created * 1000)}-{model.meta['data_hash']}.skops"
        sha = model.save(path)
        model.meta["sha256"] = sha
        try:
            version = self.store.add_model(model.kind, str(path), model.meta["n_samples"],
                                           model.meta["data_hash"], model.meta, activate=True)
        except (StoreError, sqlite3.Error):
            path.unlink(missing_ok=True)  # a file no store record points at
            raise
        model.version = f"rf-{version}"
        self._set(model, created)
        oob = model.meta.get("scores", {}).get("runtime", {}).get("oob_mape", math.nan)
        logger.info("model %s fitted on %d samples: runtime OOB MAPE %.2f%%", model.version,
                    model.meta["n_samples"], 100 * oob)
        self._prune_files()
        return version

    def _prune_files(self) -> None:
        for rec in self.store.models()[self.cfg.keep:]:
            p = Path(rec["path"])
            if p.exists():
                p.unlink()
                logger.debug("removed old model file %s", p)
