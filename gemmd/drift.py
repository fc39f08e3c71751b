"""Residual tracking and drift alarms per device, probe and target.

residual  r = log(measured / predicted)                       (per probe result)
reference r0 = median of r over the first ``baseline_probes`` healthy results: a card's
               steady offset from the model (silicon lottery, cooling) is not drift
scale     s = the probe's own long-run noise: sqrt(var (1 + rho) / (1 - rho)), var and
               lag-1 autocorrelation rho first from the baseline (sample variance: an
               outlier inflates it, the safe direction), then learnt slowly (EWMA, alpha
               0.01) from results taken while the CUSUM was at 0, winsorized at 4 s, and
               taken at its 99% upper confidence bound for the effective sample count
               (chi-square): a CUSUM's false-alarm rate is exponential in its threshold,
               so a noise estimate 10% low alarms ~10x as often; at least min_scale (and
               the model's log-space sigma when ``use_model_sigma``). A new model changes
               the reference only: the probe's noise does not depend on the model.
               Correlated noise (temperature, clocks) makes a CUSUM alarm far more often
               than iid theory says; the rho term accounts for it.
z         = (r - r0) / s, capped at +-Z_CAP in the CUSUM so that one outlier (energy
               counters are heavy-tailed) cannot raise an alarm on its own
CUSUM     S = max(0, S + z - k), k = log(1 + shift) / (2 s): half the shift to detect, in
               scales (the textbook choice); alarm while S > h; clears when S is back at 0.
threshold h from the wanted in-control average run length (``arl0``, healthy results
               between false alarms of one track) by Siegmund's approximation
               ARL0 = (exp(2kb) - 2kb - 1) / (2k^2), b = h + 1.166: a fixed h would give a
               noisy probe (small k) a false alarm every few days.

Only the upper side alarms: slower, hungrier, more joules. A device with any alarm is
"flagged": results stored meanwhile are kept out of refits until an operator re-baselines
(or ``accept_after_s`` passes). State is saved to a JSON file so a restart does not take
a degraded card as its new baseline.
"""

from __future__ import annotations

import json
import logging
import math
import os
import statistics
import tempfile
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from gemmd.config import DriftConfig
from gemmd.gemm import COLUMN, TARGETS, ProbeSpec

logger = logging.getLogger(__name__)



@dataclass
class Track:
    """Drift state of one (device, probe, target)."""

    baseline: list[float] = field(default_factory=list)  # residuals while (re)baselining
    reference: float | None = None  # r0
    scale: float | None = None
    cusum: float = 0.0
    last_z: float | None = None
    drifting: bool = False
    since: float | None = None  # when the current alarm started
    alarms: int = 0
    h: float | None = None  # alarm threshold for this track's k
    var: float = 0.0  # noise variance of the residual (log units squared)
    cov: float = 0.0  # lag-1 autocovariance
    prev: float = 0.0  # last deviation from the reference
    n: float = 0.0  # effective samples behind var

    def ready(self) -> bool:
        return self.reference is not None


ALPHA = 0.01  # noise learning rate: about the last 100 in-control results
RHO_MAX = 0.9
Z_CAP = 4.0


def upper_bound_factor(n_eff: float) -> float:
    """sigma_99% / sigma_hat for a variance estimated from n_eff samples: sqrt(nu / chi2_0.01)
    with nu = n_eff - 1, the chi-square quantile by Wilson-Hilferty."""
    if math.isinf(n_eff):
        return 1.0
    nu = max(n_eff - 1.0, 1.0)
    c = 1 - 2 / (9 * nu) - 2.326 * math.sqrt(2 / (9 * nu))
    return math.sqrt(nu / (nu * max(c, 0.05) ** 3))


def long_run_scale(var: float, cov: float, floor: float, n_eff: float = math.inf) -> float:
    """Std of the level a CUSUM integrates: inflated by positive autocorrelation and taken
    at the 99% upper bound of an estimate from ``n_eff`` samples."""
    rho = min(max(cov / var, 0.0), RHO_MAX) if var > 0 else 0.0
    return max(floor, upper_bound_factor(n_eff) *
               math.sqrt(max(var, 0.0) * (1 + rho) / (1 - rho)))


def threshold(k: float, arl0: float) -> float:
    """CUSUM threshold h giving an in-control average run length ``arl0`` for allowance k."""
    k = max(k, 1e-3)
    b = 1.0
    # Fixed point of b = log(2k^2 ARL0 + 2kb + 1) / 2k: contraction ~1/(2k^2 ARL0), so a
    # few steps reach machine precision.
    for _ in range(20):
        nb = math.log(2 * k * k * arl0 + 2 * k * b + 1) / (2 * k)
        if abs(nb - b) < 1e-12:
            break
        b = nb
    return max(nb - 1.166, 0.5)


def set_reference(track: Track, residuals: list[float], floor: float,
                  keep_noise: bool = False) -> None:
    """Reference (and, unless ``keep_noise``, noise and autocorrelation) from a run of
    healthy residuals, oldest first."""
    track.reference = statistics.median(residuals)
    devs = [r - track.reference for r in residuals]
    track.prev = devs[-1]
    track.baseline = []
    if keep_noise and track.n > 0:
        return
    track.var = statistics.variance(residuals) if len(residuals) > 1 else 0.0
    pairs = list(zip(devs, devs[1:]))
    track.cov = statistics.fmean(a * b for a, b in pairs) if pairs else 0.0
    track.n = float(len(residuals))
    track.scale = long_run_scale(track.var, track.cov, floor, track.n)


def update(track: Track, residual: float, model_sigma: float, *, shift: float, arl0: float,
           baseline_probes: int, min_scale: float, now: float,
           use_model_sigma: bool = False) -> bool:
    """Feed one log-residual into ``track`` (updated in place: baseline, noise estimate,
    CUSUM, alarm); True when this result raised a new alarm. No I/O, no clock but ``now``."""
    floor = max(min_scale, model_sigma if use_model_sigma else 0.0)
    if not track.ready():
        track.baseline.append(residual)
        if len(track.baseline) >= baseline_probes:
            set_reference(track, track.baseline, floor)
        return False
    scale = max(track.scale or floor, floor)
    assert track.reference is not None  # ready()
    dev = residual - track.reference
    z = dev / scale
    k = math.log1p(shift) / (2 * scale)
    track.last_z = z
    if track.cusum == 0.0 and not track.drifting:
        # Learn the noise only while there is no evidence of a shift.
        d = min(max(dev, -4 * scale), 4 * scale)
        track.var = (1 - ALPHA) * track.var + ALPHA * d * d
        track.cov = (1 - ALPHA) * track.cov + ALPHA * d * track.prev
        track.n = (1 - ALPHA) * track.n + 1.0
        track.scale = long_run_scale(track.var, track.cov, floor, track.n)
    track.prev = dev
    track.cusum = max(0.0, track.cusum + min(max(z, -Z_CAP), Z_CAP) - k)
    h = track.h = threshold(k, arl0)
    if not track.drifting and track.cusum > h:
        track.drifting, track.since = True, now
        track.alarms += 1
        return True
    if track.drifting and track.cusum == 0.0:
        track.drifting, track.since = False, None
    return False


def residual_of(measured: float | None, predicted: float | None) -> float | None:
    if not measured or not predicted or measured <= 0 or predicted <= 0:
        return None
    return math.log(measured / predicted)


class DriftMonitor:
    """All tracks of a daemon, configured by the ``drift`` section of the configuration;
    thread-safe use is the caller's (under State.lock). ``use_model_sigma`` also floors a
    track's residual scale by the model's own uncertainty (off: see bench/RESULTS.md)."""

    def __init__(self, cfg: DriftConfig | None = None, path: Path | None = None, *,
                 use_model_sigma: bool = False):
        self.p = cfg or DriftConfig()
        self.use_model_sigma = use_model_sigma
        self.path = path
        self.tracks: dict[tuple[str, ProbeSpec, str], Track] = {}
        self.model_version: str | None = None  # the model the references were taken under
        if path is not None and path.exists():
            self._load(path)

    # ------------------------------------------------------------------ updates
    def observe(self, uuid: str, spec: ProbeSpec, measured: Mapping[str, float | None],
                predicted: Mapping[str, float | None], sigma: Mapping[str, float],
                now: float | None = None, model_version: str | None = None) -> list[str]:
        """Feed one probe result; returns the targets that raised a new alarm.

        A result predicted by another model than the references were taken under (a refit
        just replaced it; references are being re-taken) is not judged.
        """
        now = time.time() if now is None else now
        if model_version is not None and self.model_version is not None and \
                model_version != self.model_version:
            return []
        raised = []
        for target in self.p.targets:
            r = residual_of(measured.get(target), predicted.get(target))
            if r is None:
                continue
            tr = self.tracks.setdefault((uuid, spec, target), Track())
            if update(tr, r, sigma.get(target, 0.0), shift=self.p.shift, arl0=self.p.arl0,
                      baseline_probes=self.p.baseline_probes, min_scale=self.p.min_scale,
                      now=now, use_model_sigma=self.use_model_sigma):
                raised.append(target)
        if self.p.accept_after_s and self.device_drifting(uuid):
            since = min(t.since for (u, _, _), t in self.tracks.items()
                        if u == uuid and t.drifting and t.since is not None)
            if now - since >= self.p.accept_after_s:
                logger.warning("device %s drifting for %.0f s: accepting its behaviour as the "
                               "new normal (drift.accept_after_s)", uuid, now - since)
                self.rebaseline(uuid)
        return raised

    def device_drifting(self, uuid: str) -> bool:
        return any(t.drifting for (u, _, _), t in self.tracks.items() if u == uuid)

    def rebaseline(self, uuid: str | None = None) -> int:
        """Forget references (of one device, or all): the next results set new ones."""
        n = 0
        for key in list(self.tracks):
            if uuid is None or key[0] == uuid:
                self.tracks[key] = Track(alarms=self.tracks[key].alarms)
                n += 1
        return n

    def rereference(self, uuid: str, spec: ProbeSpec, target: str,
                    residuals: list[float], model_sigma: float) -> None:
        """New reference from past healthy residuals under a new model; alarm state kept."""
        tr = self.tracks.setdefault((uuid, spec, target), Track())
        if len(residuals) < self.p.baseline_probes:
            if not tr.drifting:
                self.tracks[(uuid, spec, target)] = Track(alarms=tr.alarms)
            return
        set_reference(tr, list(reversed(residuals)),  # oldest first, as they happened
                      max(self.p.min_scale, model_sigma if self.use_model_sigma else 0.0),
                      keep_noise=True)

    # ------------------------------------------------------------------ persistence
    def save(self) -> None:
        if self.path is None:
            return
        data = {"version": 1, "model_version": self.model_version, "tracks": [
            {"uuid": u, "spec": asdict(s), "target": t, **asdict(tr)}
            for (u, s, t), tr in self.tracks.items()]}
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".drift-", suffix=".json")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(data, f)
            os.replace(tmp, self.path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def _load(self, path: Path) -> None:
        try:
            data = json.loads(path.read_text())
            self.model_version = data.get("model_version")
            for rec in data["tracks"]:
                key = (rec.pop("uuid"), ProbeSpec(**rec.pop("spec")), rec.pop("target"))
                self.tracks[key] = Track(**rec)
        except (OSError, ValueError, KeyError, TypeError) as e:
            # A damaged state file must not stop the daemon: start over, loudly.
            logger.error("drift state %s unreadable (%s): references will be re-established",
                         path, e)
            self.tracks = {}

    def snapshot(self) -> dict[tuple[str, ProbeSpec, str], Track]:
        return {k: Track(**asdict(v)) for k, v in self.tracks.items()}


def measured_of(m: Any) -> dict[str, float | None]:
    return {t: getattr(m, COLUMN[t]) for t in TARGETS}


def predicted_of(p: Any) -> dict[str, float | None]:
    return {t: getattr(p, COLUMN[t]) for t in TARGETS}
