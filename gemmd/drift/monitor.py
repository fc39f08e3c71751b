"""The DriftMonitor: all drift state of a daemon, fed one probe result at a time; it
closes each device's rounds, raises and clears alarms, names their causes, takes speed-ups
as the new normal, and re-takes references (rebaseline, a new model)."""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections import deque
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from gemmd.config import DriftConfig
from gemmd.drift.causes import CAUSES, CTX_NORMAL, CTX_RECENT, context_row, name_cause
from gemmd.drift.device import (
    DEVICE_FIELDS,
    _alarm,
    baseline_check,
    device_step,
    fast_allowance,
    pool,
    pooled_deviation,
    pooled_settings,
    together,
    warm_level,
    young_threshold,
)
from gemmd.drift.params import (
    BASE_FIRST,
    BASE_HITS,
    CAP_POOLED,
    DEVICE_LEARN_Z,
    LEVEL_N,
    MISFIT_Z,
    SPEEDUP_ROUNDS,
    STEP,
)
from gemmd.drift.peers import compare_peers
from gemmd.drift.persistence import Persistence
from gemmd.drift.residuals import residual_of
from gemmd.drift.series import (
    _calm,
    allowance,
    innovations,
    long_run_scales,
    noise_of,
    set_reference,
    start,
    update,
)
from gemmd.drift.tracks import (
    TRANSITIONS_MAX,
    Alarm,
    DeviceDrift,
    DeviceTrack,
    Track,
    Transition,
    _from_arrays,
    _to_arrays,
)
from gemmd.gemm import ProbeSpec

logger = logging.getLogger(__name__)


class DriftMonitor(Persistence):
    """All drift state of a daemon, configured by the ``drift`` section of the
    configuration; thread-safe use is the caller's (under State.lock). ``use_model_sigma``
    also floors a track's residual scale by the model's own uncertainty (off: see
    bench/RESULTS.md)."""

    def __init__(self, cfg: DriftConfig | None = None, path: Path | None = None, *,
                 use_model_sigma: bool = False):
        self.p = cfg or DriftConfig()
        self.use_model_sigma = use_model_sigma
        self.path = path
        # The CUSUMs allow for the tolerance: a wiggle of that amplitude drains them.
        self.kappa = allowance(self.p.shift, self.p.tolerance)
        # ... except the pooled one, whose reference follows the slow wiggles instead.
        self.kappa_fast = fast_allowance(self.p.shift)
        self.tol = math.log1p(min(self.p.tolerance, self.p.shift))
        self.tracks: dict[tuple[str, ProbeSpec, str], Track] = {}
        self.devices: dict[str, DeviceDrift] = {}
        self.model_version: str | None = None  # the model the references were taken under
        # The round being collected per device: the probes seen, per target what each
        # ready probe contributes to the pooled statistic, the targets a probe's own
        # track raised an alarm on.
        self._seen: dict[str, set[ProbeSpec]] = {}
        self._pending: dict[str, dict[str, dict[ProbeSpec, tuple[float, ...]]]] = {}
        self._probe_raised: dict[str, set[str]] = {}
        # Baselines just completed (per device and target): the pooled statistic's start.
        self._warm: dict[str, dict[str, dict[ProbeSpec, tuple[list[float], float, int]]]] = {}
        # The plan each device last reported (not saved: the first result after a start
        # retires the tracks of probes that left it).
        self._plans: dict[str, frozenset[ProbeSpec]] = {}
        # Alarms raised and cleared, rebaselines: until a caller drains them (bounded).
        self.transitions: deque[Transition] = deque(maxlen=TRANSITIONS_MAX)
        if path is not None and path.exists():
            self._load(path)

    def drain(self) -> list[Transition]:
        """The transitions since the last drain, oldest first (and forget them)."""
        out = list(self.transitions)
        self.transitions.clear()
        return out

    def _note(self, kind: str, uuid: str, target: str, spec: ProbeSpec | None, tr: Track,
              now: float, since: float | None = None, **extra: Any) -> None:
        """Record an alarm raised or cleared on ``tr`` (a probe's track, or with spec None
        the device's): how far off (the latest measured / normal: the probe's latest
        result, or the round's pooled ratio), the CUSUM and its threshold; for the device,
        why and what changed with it."""
        ratio = tr.ratio if isinstance(tr, DeviceTrack) else \
            (math.exp(tr.prev) if tr.ready() else None)
        detail: dict[str, Any] = {"scope": "probe" if spec is not None else "pooled",
                                  "ratio": _finite(ratio),
                                  "shift": _finite(ratio - 1 if ratio is not None else None),
                                  "z": _finite(tr.last_z), "cusum": _finite(tr.cusum),
                                  "threshold": _finite(tr.h)}
        if isinstance(tr, DeviceTrack):
            detail["probes"] = tr.members
            detail["level_ratio"] = _finite(math.exp(tr.level)) if tr.ready() else None
            if kind == "alarm":
                detail.update(reason=tr.reason, cause=tr.cause, cause_text=tr.cause_text)
        if kind == "clear":
            detail["since"] = _finite(since)
        detail.update(extra)
        self.transitions.append(Transition(now, kind, uuid, target, spec, detail))

    def _update(self, tr: Track, value: float, floor: float, now: float, *,
                learn: bool) -> bool:
        """A probe's own track."""
        return update(tr, value, 0.0, shift=self.p.shift, arl0=self.p.arl0,
                      baseline_probes=self.p.baseline_probes, min_scale=floor, now=now,
                      learn=learn, kappa=self.kappa, tails=True)

    def _update_pooled(self, ds: DeviceTrack, z: float, gain: float, now: float, *,
                       learn: bool) -> bool:
        """A device's pooled statistic (``pooled_settings``)."""
        how = pooled_settings(ds.n, ds.band, gain, self.p.shift, self.p.tolerance)
        return update(ds, z - float(how["offset"]), 0.0, shift=self.p.shift, arl0=self.p.arl0,
                      baseline_probes=self.p.baseline_probes, min_scale=1.0, now=now,
                      learn=learn, gain=gain, phi_z=float(how["phi_z"]),
                      learn_z=DEVICE_LEARN_Z, kappa=float(how["kappa"]), cap_h=CAP_POOLED,
                      misfit_z=MISFIT_Z, tails=True, chi_z=float(how["chi_z"]),
                      level_z=float(how["level_z"]))

    # ------------------------------------------------------------------ updates
    def observe(self, uuid: str, spec: ProbeSpec, measured: Mapping[str, float | None],
                predicted: Mapping[str, float | None], sigma: Mapping[str, float],
                now: float | None = None, model_version: str | None = None, *,
                gpu_model: str | None = None, plan: Collection[ProbeSpec] | None = None,
                context: Mapping[str, Any] | None = None) -> list[Alarm]:
        """Feed one probe result; returns the alarms it raised: of the probe's own tracks,
        and of the device when it completed a round. Alarms raised and cleared are also
        kept in ``transitions`` (see ``drain``) for the record.

        A round is complete when every probe of ``plan`` (the device's sentinels) has
        reported, or, without a plan or when a probe failed, when a probe reports a second
        time. ``gpu_model`` names the device's peers (devices of the same model);
        ``context`` is the probe's (clocks, clock-event reasons, power limit, temperature:
        what names an alarm's cause). A result predicted by another model than the
        references were taken under (a refit just replaced it; references are being
        re-taken) is not judged.
        """
        now = time.time() if now is None else now
        if model_version is not None and self.model_version is not None and \
                model_version != self.model_version:
            return []
        dev = self.devices.setdefault(uuid, DeviceDrift())
        if gpu_model:
            dev.gpu_model = gpu_model
        if plan is not None:
            self._retire(uuid, plan, now)
        raised: list[Alarm] = []
        if spec in self._seen.get(uuid, ()):
            raised += self._close_round(uuid, now)
        seen = self._seen.setdefault(uuid, set())
        seen.add(spec)
        row = context_row(context)
        if row is not None:
            ctx = dev.contexts.setdefault(spec.name, {"normal": [], "recent": []})
            ctx["recent"] = [*ctx["recent"], row][-CTX_RECENT:]
            if len(ctx["normal"]) < CTX_NORMAL and not self.device_drifting(uuid):
                ctx["normal"].append(row)
        pending = self._pending.setdefault(uuid, {})
        for target in self.p.targets:
            r = residual_of(measured.get(target), predicted.get(target))
            if r is None:
                continue
            tr = self.tracks.setdefault((uuid, spec, target), Track())
            ds = dev.track(target)
            floor = max(self.p.min_scale,
                        sigma.get(target, 0.0) if self.use_model_sigma else 0.0)
            was_ready, values = tr.ready(), [*tr.baseline, r]
            was, since = tr.drifting, tr.since
            # Learnt only while the device is in control: no alarm, no speed-up counting,
            # its slow level not confidently beyond the tolerance.
            calm = _calm(ds) and not ds.drifting and not ds.faster and self._settled(ds)
            if self._update(tr, r, floor, now, learn=calm):
                raised.append(Alarm(target, spec))
                self._probe_raised.setdefault(uuid, set()).add(target)
                self._note("alarm", uuid, target, spec, tr, now)
            elif was and not tr.drifting:
                self._note("clear", uuid, target, spec, tr, now, since)
            if tr.ready() and not was_ready and not ds.ready():
                self._warm.setdefault(uuid, {}).setdefault(target, {})[spec] = \
                    (values, floor, tr.cut)
            if tr.ready() and tr.last_u is not None:
                scale = max(tr.scale or floor, floor)
                pending.setdefault(target, {})[spec] = (
                    tr.last_u, tr.gain, tr.prev, scale,
                    scale * scale / max(tr.level_n, 1.0))
        if plan is not None and seen >= set(plan):
            raised += self._close_round(uuid, now)
        if self.p.accept_after_s and self.device_drifting(uuid):
            since = min(s for s in self._alarm_starts(uuid))
            if now - since >= self.p.accept_after_s:
                logger.warning("device %s drifting for %.0f s: accepting its behaviour as the "
                               "new normal (drift.accept_after_s)", uuid, now - since)
                self.transitions.append(Transition(now, "rebaseline", uuid, None, None, {
                    "phase": "automatic", "reason": "drift.accept_after_s",
                    "drifting_s": now - since}))
                self.rebaseline(uuid, now=now)
        return raised

    def _retire(self, uuid: str, plan: Collection[ProbeSpec], now: float) -> None:
        """Drop the tracks of the device's probes that are no longer in its plan (a
        sentinel removed from the configuration). Kept, they were never ready again
        after a rebaseline, and the device's pooled statistic, which starts once all its
        probes' tracks are, never re-armed; one in alarm kept the device's alarm alive."""
        keep = frozenset(plan)
        if self._plans.get(uuid) == keep:
            return
        self._plans[uuid] = keep
        gone = [key for key in self.tracks if key[0] == uuid and key[1] not in keep]
        for key in gone:
            tr = self.tracks.pop(key)
            if tr.drifting:
                self._note("clear", uuid, key[2], key[1], tr, now, tr.since,
                           reason="left the plan")
        for part in (self._warm.get(uuid, {}), self._pending.get(uuid, {})):
            for per in part.values():
                for spec in [s for s in per if s not in keep]:
                    del per[spec]
        if gone:
            names = sorted({key[1].name for key in gone})
            dev = self.devices.get(uuid)
            if dev is not None:
                for name in names:
                    dev.contexts.pop(name, None)
            logger.info("device %s: %s left the probe plan: drift tracks dropped", uuid,
                        ", ".join(names))

    def end_round(self, uuid: str, now: float | None = None) -> list[Alarm]:
        """Close the device's round now (callers that know a round ended)."""
        return self._close_round(uuid, time.time() if now is None else now)

    def _mine(self, uuid: str, target: str) -> dict[ProbeSpec, Track]:
        return {spec: tr for (u, spec, t), tr in self.tracks.items()
                if u == uuid and t == target}

    def _close_round(self, uuid: str, now: float) -> list[Alarm]:
        self._seen[uuid] = set()
        pending = self._pending.pop(uuid, {})
        probe_raised = self._probe_raised.pop(uuid, set())
        dev = self.devices.setdefault(uuid, DeviceDrift())
        raised: list[Alarm] = []
        faster: list[str] = []
        for target in self.p.targets:
            if dev.gpu_model:
                compare_peers(self.devices, self.tracks, self.p, uuid, target, now)
            ds = dev.track(target)
            mine = self._mine(uuid, target)
            members = pending.get(target) or {}
            if not ds.ready():
                self._pooled_baseline(uuid, target, ds, mine, members, now, raised)
                continue
            if not members:
                continue
            u, g, d, sc, lvar = (np.array(col, float) for col in zip(*members.values()))
            z, gain = pool(u, g, kappa=self.kappa_fast)
            calm = not any(mine[s].drifting for s in members) and not ds.drifting and \
                not ds.faster and self._settled(ds)
            fast = self._update_pooled(ds, float(z), float(gain), now, learn=calm)
            ds.members = len(members)
            y, prior = pooled_deviation(d, sc)
            ds.ratio = math.exp(float(y))
            w = 1.0 / (sc * sc)
            ref_var = float((w * w * lvar).sum() / w.sum() ** 2)
            alive = ds.fast or ds.cusum > (ds.h or math.inf) / 2
            was, since = ds.drifting, ds.since
            dv = _to_arrays(ds, DEVICE_FIELDS)
            common = min(max(ds.scale or 1.0, 1.0), math.sqrt(len(members)))
            up, down, speed = device_step(
                dv, [float(y)], [float(prior) * common], [ref_var],
                fast_raised=[fast], fast_alive=[alive], probe_raised=[target in probe_raised],
                probe_alive=[any(tr.drifting for tr in mine.values())], kappa=self.kappa,
                tolerance=self.p.tolerance, now=now, moved=together(d[None, :]))
            _from_arrays(ds, dv, DEVICE_FIELDS)
            for spec in members:  # what a speed-up moves each probe's normal by
                tr = mine[spec]
                tr.spd = tr.spd + tr.prev if ds.faster > 0 else 0.0
            self._after(uuid, target, ds, bool(up[0]), was and bool(down[0]), since, now,
                        raised)
            if speed[0]:
                faster.append(target)
        # A speed-up becomes the new normal only while nothing is in alarm (power that
        # drops while clocks are capped comes back when they are restored).
        for target in faster:
            if not self.device_drifting(uuid):
                self._speedup(uuid, target, dev.targets[target], self._mine(uuid, target),
                              now)
        return raised

    def _settled(self, ds: DeviceTrack) -> bool:
        """Not a device whose slow level is confidently beyond half the tolerance once its
        references have settled (a day of results learnt): a small sustained shift is no
        noise to learn. (While they settle, a daily cycle may still sit off them.)"""
        return not (ds.ready() and ds.level_n >= LEVEL_N and self.tol > 0 and
                    abs(ds.level) - 2 * (ds.level_se or 0.0) > self.tol / 2)

    def _after(self, uuid: str, target: str, ds: DeviceTrack, up: bool, down: bool,
               since: float | None, now: float, raised: list[Alarm]) -> None:
        """Name the cause of a device alarm raised or in progress; record raises, clears."""
        if ds.drifting:
            ds.cause, ds.cause_text = self.cause(uuid, target)
        if up:
            raised.append(Alarm(target, None))
            self._note("alarm", uuid, target, None, ds, now)
        if down:
            self._note("clear", uuid, target, None, ds, now, since)
            ds.cause = ds.cause_text = ""

    def cause(self, uuid: str, target: str) -> tuple[str, str]:
        """What changed with the device's alarm on ``target`` (see ``name_cause``)."""
        dev = self.devices.get(uuid)
        if dev is None:
            return "unknown", CAUSES["unknown"]
        moved = {s.name for s, tr in self._mine(uuid, target).items()
                 if tr.ready() and (tr.drifting or tr.cusum > 0 or tr.prev > self.kappa / 2)}
        rt = dev.targets.get("runtime")
        runtime = (rt.cause, rt.cause_text) if rt is not None and rt.drifting and \
            target != "runtime" and rt.cause else None
        return name_cause(target, dev.contexts, moved, runtime)

    def _pooled_baseline(self, uuid: str, target: str, ds: DeviceTrack,
                         mine: dict[ProbeSpec, Track], members: Mapping[ProbeSpec, Any],
                         now: float, raised: list[Alarm]) -> None:
        """A round before the device's pooled statistic is ready: start it from its
        probes' baselines once they are all taken; until then, compare each round with
        the first ones (a step this early would otherwise become the card's normal)."""
        if not mine:
            return
        warm = self._warm.get(uuid, {}).get(target)
        if all(tr.ready() for tr in mine.values()):
            if warm and set(warm) == set(mine):
                del self._warm[uuid][target]
                lens = {len(v) for v, _, _ in warm.values()}
                if len(lens) == 1 and lens.pop() >= BASE_FIRST + 1:
                    b = np.array([warm[s][0] for s in mine], float).T[:, None, :]
                    self._check_baseline(uuid, target, ds, mine, b, now, raised, warm)
                if self._warm_start(ds, warm):
                    return
            if members:  # no usable warm start: the pooled statistic takes its own baseline
                u, g = (np.array(col, float) for col in list(zip(*members.values()))[:2])
                z, gain = pool(u, g, kappa=self.kappa_fast)
                self._update_pooled(ds, float(z), float(gain), now, learn=True)
            return
        lens = {len(tr.baseline) for tr in mine.values()}
        if any(tr.ready() for tr in mine.values()) or len(lens) != 1:
            return
        n = lens.pop()
        if n < BASE_FIRST + 1:
            return
        b = np.array([tr.baseline for tr in mine.values()], float).T[:, None, :]
        self._check_baseline(uuid, target, ds, mine, b, now, raised, None)

    def _check_baseline(self, uuid: str, target: str, ds: DeviceTrack,
                        mine: dict[ProbeSpec, Track], b: np.ndarray, now: float,
                        raised: list[Alarm],
                        warm: dict[ProbeSpec, tuple[list[float], float, int]] | None) -> None:
        """One round of the baseline check (``b``: the baselines so far; ``warm``: they are
        complete, references just taken). Two rounds in a row far above the first ones are
        an alarm, and the values before them the normal; a complete baseline that ends far
        above its start takes its references before that end."""
        n = b.shape[0]
        hit = bool(baseline_check(b, self.p.min_scale, self.kappa)[0])
        ds.hits = ds.hits + 1 if hit else 0.0
        least = 1 if warm is not None else BASE_HITS
        if ds.hits >= least and not any(tr.cut for tr in mine.values()):
            cut = n - int(ds.hits)  # the values before the step are the normal
            for spec, tr in mine.items():
                tr.cut = cut
                if warm is not None:
                    values, floor, _ = warm[spec]
                    set_reference(tr, values, cut)
                    warm[spec] = (values, floor, cut)
        was, since = ds.drifting, ds.since
        dv = _to_arrays(ds, DEVICE_FIELDS)
        up, down = _alarm(dv, np.array([ds.hits >= BASE_HITS]), np.array([STEP]),
                          np.array([hit]), np.array([hit]), np.array([not hit]), now)
        _from_arrays(ds, dv, DEVICE_FIELDS)
        self._after(uuid, target, ds, bool(up[0]), was and bool(down[0]), since, now, raised)

    def _warm_start(self, ds: DeviceTrack,
                    warm: dict[ProbeSpec, tuple[list[float], float, int]]) -> bool:
        """The pooled statistic and the slow level over the rounds of its probes'
        baselines (taken together), so that they are ready with them rather than a
        baseline later. False where the baselines do not line up."""
        lengths = {len(v) for v, _, _ in warm.values()}
        if len(lengths) != 1 or lengths.pop() < 3:
            return False
        us, gs, devs, scales = [], [], [], []
        cut = 0
        for values, floor, c in warm.values():
            v = np.asarray(values, float)[:, None]
            st = start(v, [c or len(values)])
            u, g = innovations(st, v, floor)
            us.append(u[:, 0])
            gs.append(g[0])
            devs.append(v[:, 0] - st["reference"][0])
            scales.append(float(long_run_scales(st, floor)[0]))
            cut = max(cut, c)
        z, _ = pool(np.array(us).T, np.array(gs), kappa=self.kappa_fast)
        set_reference(ds, [float(x) for x in z], cut=max(cut - 1, 0))
        ys, _ = pooled_deviation(np.array(devs).T, np.array(scales))
        dv = _to_arrays(ds, DEVICE_FIELDS)
        warm_level(dv, ys[:, None])
        b = np.array([v for v, _, _ in warm.values()], float).T[:, None, :]
        dv["young_thr"] = young_threshold(b, np.array([cut]), self.p.min_scale, self.kappa)
        dv["young"] = np.zeros(1)
        _from_arrays(ds, dv, DEVICE_FIELDS)
        return True

    def _speedup(self, uuid: str, target: str, ds: DeviceTrack, mine: dict[ProbeSpec, Track],
                 now: float) -> None:
        """A speed-up held for SPEEDUP_ROUNDS rounds: each probe's normal moves to where
        it has been since (its mean deviation over those rounds, where lower), so that
        what follows is judged against it rather than hidden under it."""
        ratio = math.exp(ds.level)
        moved = 0
        n = max(ds.faster, 1.0)
        for tr in mine.values():
            sh = min(tr.spd / n, 0.0)
            tr.spd = 0.0
            if not tr.ready() or sh == 0.0 or tr.reference is None:
                continue
            tr.reference += sh
            tr.lx, tr.ly, tr.mx, tr.my, tr.last = (tr.lx + sh, tr.ly + sh, tr.mx + sh,
                                                   tr.my + sh, tr.last + sh)
            tr.prev -= sh
            tr.slow -= sh
            moved += 1
        ds.level, ds.faster, ds.band = 0.0, 0.0, 0.0
        ds.speedups += 1
        if target == "runtime":  # the new normal's context is re-taken too
            for ctx in self.devices[uuid].contexts.values():
                ctx["normal"] = []
        logger.warning("device %s: %s faster than normal (x%.3f) for %d rounds: taken as the "
                       "new normal", uuid, target, ratio, SPEEDUP_ROUNDS)
        self.transitions.append(Transition(now, "rebaseline", uuid, target, None, {
            "phase": "speedup", "target": target, "ratio": _finite(ratio), "probes": moved}))

    # ------------------------------------------------------------------ queries
    def _alarm_starts(self, uuid: str) -> list[float]:
        out = [t.since for (u, _, _), t in self.tracks.items()
               if u == uuid and t.drifting and t.since is not None]
        dev = self.devices.get(uuid)
        if dev is not None:
            out += [t.since for t in dev.targets.values() if t.drifting and t.since is not None]
        return out

    def target_drifting(self, uuid: str, target: str) -> bool:
        """The device's alarm for ``target`` (raised by its pooled statistic, its slow
        level or a probe's own track)."""
        dev = self.devices.get(uuid)
        if dev is not None and target in dev.targets and dev.targets[target].drifting:
            return True
        return any(t.drifting for (u, _, tg), t in self.tracks.items()
                   if u == uuid and tg == target)

    def device_drifting(self, uuid: str) -> bool:
        dev = self.devices.get(uuid)
        if dev is not None and any(t.drifting for t in dev.targets.values()):
            return True
        return any(t.drifting for (u, _, _), t in self.tracks.items() if u == uuid)

    # ------------------------------------------------------------------ references
    def rebaseline(self, uuid: str | None = None, now: float | None = None) -> int:
        """Forget references (of one device, or all): the next results set new ones; the
        alarms in progress end (noted as cleared by the rebaseline). Returns the number
        of probe tracks reset."""
        now = time.time() if now is None else now
        n = 0
        for key in list(self.tracks):
            if uuid is None or key[0] == uuid:
                old = self.tracks[key]
                if old.drifting:
                    self._note("clear", key[0], key[2], key[1], old, now, old.since,
                               reason="rebaseline")
                self.tracks[key] = Track(alarms=old.alarms, noise=noise_of(old))
                n += 1
        for u, dev in self.devices.items():
            if uuid is None or u == uuid:
                for t, d in dev.targets.items():
                    if d.drifting:
                        self._note("clear", u, t, None, d, now, d.since, reason="rebaseline")
                dev.targets = {t: DeviceTrack(alarms=d.alarms, fast_alarms=d.fast_alarms,
                                              speedups=d.speedups, noise=noise_of(d))
                               for t, d in dev.targets.items()}
                dev.contexts = {}
                self._seen.pop(u, None)
                self._pending.pop(u, None)
                self._warm.pop(u, None)
                self._probe_raised.pop(u, None)
        return n

    def rereference(self, uuid: str, spec: ProbeSpec, target: str,
                    residuals: list[float], model_sigma: float,
                    shift: float | None = None) -> None:
        """References under a new model, keeping the noise estimate and the alarm state.

        ``shift``: how much the new model moves this probe's residuals (log of the old
        prediction over the new one), where known: the track moves by it and keeps all it
        learnt. Otherwise its level is re-taken from past healthy residuals (newest
        first), and learnt again from there."""
        tr = self.tracks.setdefault((uuid, spec, target), Track())
        if shift is not None and math.isfinite(shift):
            tr.baseline = [v + shift for v in tr.baseline]
            if tr.ready() and tr.reference is not None:
                tr.reference += shift
                tr.lx, tr.ly, tr.mx, tr.my = tr.lx + shift, tr.ly + shift, tr.mx + shift, \
                    tr.my + shift
                tr.last += shift
            return
        if len(residuals) < self.p.baseline_probes:
            if not tr.drifting:
                self.tracks[(uuid, spec, target)] = Track(alarms=tr.alarms)
            return
        values = list(reversed(residuals))  # oldest first, as they happened
        if not tr.ready() or tr.n < 2:
            set_reference(tr, values)
        else:
            # Central moments do not move with the level: only the level is re-taken.
            ref = statistics.median(values)
            shift = ref - (tr.reference or 0.0)
            tr.reference, tr.level_n, tr.lx, tr.ly = ref, float(len(values)), ref, ref
            tr.mx, tr.my = tr.mx + shift, tr.my + shift
            tr.last, tr.prev = values[-1], values[-1] - ref
            tr.baseline = []
        # The device's pooled level was learnt against the old references: learn it again.
        dev = self.devices.get(uuid)
        if dev is not None and target in dev.targets and dev.targets[target].ready():
            ds = dev.targets[target]
            ds.level_n = min(ds.level_n, float(self.p.baseline_probes))
        self._pending.pop(uuid, None)
        self._seen.pop(uuid, None)
        self._warm.pop(uuid, None)


def _finite(v: Any) -> float | None:
    """A number for the record: None where there is none (NaN, infinite)."""
    return float(v) if v is not None and math.isfinite(v) else None
