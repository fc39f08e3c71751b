"""The fleet report: per GPU, the daemon's sentinel probes over time, from its store.

For each GPU: the deployed model's live error per probe (median |measured / predicted - 1|
over the window), measured / predicted over time for every probe and target with the
results taken in drift alarm and the model changes marked, each probe's measured and
predicted runtime, power and energy with the prediction interval, and the device context
recorded with each probe (SM clock, temperature, power limit, clock-event reasons).

What the store keeps and what it does not (said on the page too): each result's
prediction with its interval, the model version that made it, whether the GPU was in
drift alarm when it was taken (``flagged``) and the device context; and its events: drift
alarms raised and cleared per target (the pooled statistic or a probe's own), rebaselines,
models activated. Results stored before intervals were (schema 2) get theirs re-computed
from the model files still kept (``model.keep``) with the same model, which gives the
daemon's interval exactly. A store the daemon has not migrated yet (schema 2) is read as
it is: no events there, alarms only by flagged results. The drift statistics over time are
not recorded (Prometheus has them).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from gemmd.config import DriftConfig, ModelConfig
from gemmd.errors import InputError, ModelError
from gemmd.gemm import COLUMN, TARGETS, ProbeSpec
from gemmd.records import DeviceInfo
from gemmd.report import readonly
from gemmd.report.page import (
    MIN_ROWS,
    PROBE_COLORS,
    TARGET_TITLE,
    Page,
    check_out,
    esc,
    fmt_count,
    fmt_pct,
    fmt_time,
    legend_above,
    plain,
    plt_setup,
    shape_name,
    table,
    to_svg,
    unit_for,
    value_axis,
    write_atomic,
)

MAX_POINTS = 600  # results per series drawn as they are; beyond, medians per time bin
MAX_EVENT_ROWS = 40  # a GPU's events listed (the newest), and as many models
PRED = {t: f"pred_{COLUMN[t]}" for t in TARGETS}
ALARM_COLOR = "#d62728"
CLEAR_COLOR = "#2ca02c"
REBASELINE_COLOR = "#7b3fb5"


@dataclass
class Series:
    """One sentinel probe's results on one GPU, oldest first."""

    spec: ProbeSpec
    ts: np.ndarray
    ok: np.ndarray  # outcome ok
    outcome: list[str]
    meas: dict[str, np.ndarray]
    pred: dict[str, np.ndarray]
    lo: dict[str, np.ndarray]  # interval bounds, NaN where not known
    hi: dict[str, np.ndarray]
    version: list[str]
    flagged: np.ndarray


@dataclass
class Context:
    """The device context read after each result, oldest first: numeric values by name
    and per clock-event reason whether it was active (None: the backend records none)."""

    ts: np.ndarray
    values: dict[str, np.ndarray]
    reasons: dict[str, np.ndarray] | None


@dataclass
class AlarmSpan:
    """A GPU's drift alarm for one target, from the store's events: from the first alarm
    raised (its pooled statistic's or a probe's) to the clear of the last one in alarm;
    ``end`` None: still in alarm."""

    target: str
    start: float
    end: float | None
    raised: dict[str, Any]  # the detail of the alarm that began it (scope, ratio, shift)
    by: list[str]  # what was in alarm over the span: "pooled" and/or probe names
    ended_by: str = ""  # cleared | rebaseline | "" (still in alarm)
    start_known: bool = True  # False: began before the events (a clear's or drift.json's)


@dataclass
class RebaselineMark:
    ts: float
    phase: str  # applied | automatic | requested (and not applied yet)
    unflagged: int  # results unflagged by it (request and application together)


@dataclass
class BandCounts:
    """Where the results' prediction intervals came from, counted per (result, target)."""

    stored: int = 0
    recomputed: int = 0
    none: int = 0


@dataclass
class GpuData:
    rec: dict[str, Any]
    info: DeviceInfo | None
    n_rows: int = 0
    series: list[Series] = field(default_factory=list)
    context: Context = field(default_factory=lambda: Context(np.zeros(0), {}, None))
    events: list[dict[str, Any]] = field(default_factory=list)  # alarm/clear/rebaseline
    alarms: list[AlarmSpan] = field(default_factory=list)  # those overlapping the window
    rebaselines: list[RebaselineMark] = field(default_factory=list)  # in the window
    window: tuple[float, float] = (0.0, 0.0)
    events_recorded: bool = True  # the store has an events table (schema 3 on)


def probe_label(s: ProbeSpec) -> str:
    """A sentinel as a person reads it: '8192×8192×8192 bf16 blas nn'."""
    kern = f"tiled (tile {s.tile})" if s.kernel == "tiled" else s.kernel
    return f"{shape_name(s.m, s.n, s.k, s.dtype)} {kern} {s.layout}"


MAX_DAYS = 36_500  # a century: more than any store keeps


def write_fleet(out: str | Path, *, state_dir: Path, drift_cfg: DriftConfig | None = None,
                model_cfg: ModelConfig | None = None, days: float = 7.0,
                devices: Sequence[str] | None = None, source: str = "daemon") -> Path:
    """Write the fleet report of ``state_dir``'s store to the HTML file ``out``.

    ``days``: the window, ending at the newest sentinel result; ``devices``: GPU indices
    or UUID prefixes (default every GPU in the store). Read-only: the store is opened with
    a read-only connection, the drift state and model files are only read. Raises
    InputError or StoreError (one line)."""
    path = check_out(out)
    if not 0 < days <= MAX_DAYS:  # nan fails too; 1e12 days overflowed datetime
        raise InputError(f"--days {days:g}: must be a number of days in (0, {MAX_DAYS:,}]")
    drift_cfg = drift_cfg or DriftConfig()
    model_cfg = model_cfg or ModelConfig()
    state_dir = Path(state_dir)
    db = state_dir / readonly.DB_NAME
    con = readonly.connect(db)
    try:
        devs = readonly.devices(con, db)
        mods = readonly.models(con, db)
        until = readonly.last_probe(con, db, source)
        if until is None:
            raise InputError(f"store {db} holds no sentinel results of source {source!r} yet "
                             "(run the daemon first)")
        since = until - days * 86400.0
        devs = _select(devs, devices, db)
        bands = _Bands(mods, model_cfg)
        has_events, schema = readonly.has_events(con), readonly.schema_version(con)
        drift = _drift_state(state_dir, drift_cfg)
        gpus = []
        for d in devs:  # one GPU's rows at a time: arrays kept, row dicts dropped
            rows = readonly.sentinels(con, db, d["uuid"], since, until, source)
            g = GpuData(d, readonly.device_info(d), len(rows), window=(since, until),
                        events_recorded=has_events)
            g.series, g.context = _series(g, rows, bands), _context(rows)
            # Every alarm, clear and rebaseline up to the window's end (events are few,
            # and bounded): an alarm raised before the window and still on shows in it.
            g.events = readonly.events(con, db, None, until, [str(d["uuid"])],
                                       ("alarm", "clear", "rebaseline"))
            g.alarms = _alarm_spans_of(g, drift)
            g.rebaselines = _rebaselines_of(g.events, since, until)
            gpus.append(g)
            del rows
        fleet_events = readonly.events(con, db, since, until, None, ("model", "refit_rejected"))
    finally:
        con.close()

    active = next((m for m in mods if m["active"]), None)
    deployed = f"rf-{active['version']}" if active else "roofline"

    page = Page("gemmd fleet report")
    n_rows = sum(g.n_rows for g in gpus)
    names: dict[str, int] = {}
    for g in gpus:
        names[str(g.rec["name"])] = names.get(str(g.rec["name"]), 0) + 1
    page.header += [
        ("Store", f"<code>{esc(str(db))}</code> (source {esc(source)}, read-only)"),
        ("Window", f"{esc(fmt_time(since))} to {esc(fmt_time(until))} ({plain(days)} day(s) "
                   f"up to the newest result): {fmt_count(n_rows)} sentinel results"),
        ("GPU(s)", f"{len(gpus)}: " + "; ".join(f"{n} × {esc(k)}" for k, n in names.items())),
        ("Deployed model", _model_text(active, model_cfg)),
        ("Drift", f"alarm on a {plain(100 * drift_cfg.shift)}% shift, a false alarm per "
                  f"{drift_cfg.arl0:,.0f} healthy rounds per CUSUM (drift.shift, drift.arl0); "
                  + ("state from <code>drift.json</code>" if drift is not None
                     else "no saved drift state (drift.json) in the state directory")),
    ]
    pending = _rebaseline_pending(state_dir)
    if pending:
        page.warnings.append(pending)
    if bands.missing:
        page.warnings.append(
            "No prediction interval for results predicted by " + ", ".join(
                esc(v) for v in sorted(bands.missing)) + ": " + esc(
                "; ".join(sorted(set(bands.missing.values())))) + ".")
    if not has_events:
        page.warnings.append(
            f"This store has schema {schema}, from an older gemmd: it records no drift "
            "alarms, rebaselines or models as events (the daemon migrates it at its next "
            "start). Alarms show only by their flagged results, which <code>gemmd "
            "rebaseline</code> unflags.")
    plt = plt_setup()
    page.sections.append(_fleet_table(gpus, deployed, drift))
    # GPUs in trouble first (in alarm, results flagged, failed or wrong), then by index.
    for g in sorted(gpus, key=lambda g: not _trouble(g, drift)):
        page.sections.append(_gpu_section(plt, g, deployed, drift, page))
    page.sections.append(_model_events(fleet_events))
    page.sections.append(_recorded(has_events, bands.counts))
    write_atomic(path, page.render())
    return path


def _recorded(has_events: bool, counts: BandCounts) -> str:
    """What the store records and what it does not, with where this page's intervals came
    from."""
    total = counts.stored + counts.recomputed + counts.none
    where = (f" Here: {fmt_count(counts.stored)} of {fmt_count(total)} (result, target) "
             f"predictions with their stored interval, {fmt_count(counts.recomputed)} "
             f"re-computed, {fmt_count(counts.none)} without one." if total else "")
    events = (
        "<li>Events: each drift alarm raised and cleared, per GPU and target (the probes' "
        "pooled statistic or one probe's own), with the shift it saw; each rebaseline "
        "(requested with <code>gemmd rebaseline</code>, applied by the daemon, or automatic "
        "after <code>drift.accept_after_s</code>) with the results it unflagged, so an alarm "
        "a rebaseline accepted still shows; each model activated and each refit rejected. "
        "They are pruned with the daemon's probes (<code>store.retention_days</code>). "
        "Alarms from before the store recorded events (an older gemmd) show only by their "
        "flagged results.</li>" if has_events else
        "<li>Events (drift alarms raised and cleared, rebaselines, models) are recorded from "
        "schema 3 on; this store is older and not yet migrated, so alarms show only by "
        "their flagged results (<i>flagged</i>: the GPU in alarm for some target, not "
        "which), which <code>gemmd rebaseline</code> unflags.</li>")
    return (
        "<h2>What the store records, and what it does not</h2><ul class=note>"
        "<li>Recorded with every result: measured and predicted runtime, power and energy, "
        "the prediction interval, the model version that predicted it, its outcome, "
        "whether the GPU was in drift alarm when it was taken (<i>flagged</i>), and the "
        "device context (SM and memory clock, temperature, power limit, clock-event "
        "reasons) read after the probe.</li>"
        "<li>Results stored before intervals were (an older gemmd) have theirs re-computed "
        "here with the model that made each prediction, from its file while kept "
        "(<code>model.keep</code>); such results of models whose file is gone, or of a "
        "reference model calibrated per GPU, show no band." + where + "</li>"
        + events +
        "<li>Not recorded: the drift statistics over time (CUSUM, z); Prometheus has "
        "them.</li></ul>")


def _rebaseline_pending(state_dir: Path) -> str:
    """A rebaseline requested (gemmd rebaseline) but not yet applied by the daemon."""
    import json

    from gemmd.rebaseline import REQUEST

    path = state_dir / REQUEST
    try:
        req = json.loads(path.read_text())
    except (OSError, ValueError):
        return ""
    if not isinstance(req, dict):
        return ""
    who = req.get("devices")
    return (f"A rebaseline of {esc(', '.join(map(str, who)) if who else 'every device')} was "
            f"requested {esc(fmt_time(req.get('ts')))} and is not applied yet (the daemon "
            "applies it within seconds while it runs): the drift state shown predates it; "
            "its results are already unflagged.")


def _select(devs: list[dict[str, Any]], wanted: Sequence[str] | None, db: Path
            ) -> list[dict[str, Any]]:
    if not devs:
        raise InputError(f"store {db} knows no devices yet (run the daemon first)")
    if not wanted:
        return devs
    out = []
    for w in wanted:
        hit = [d for d in devs if str(d["idx"]) == str(w).strip() or
               str(d["uuid"]).lower().startswith(str(w).strip().lower())]
        if len(hit) != 1:
            known = ", ".join(f"{d['idx']} ({d['uuid']})" for d in devs)
            what = "matches several devices" if hit else "is no device in the store"
            raise InputError(f"--device {w}: {what} (known: {known})")
        if hit[0] not in out:
            out.append(hit[0])
    return out


def _model_text(active: dict[str, Any] | None, cfg: ModelConfig) -> str:
    if active is None:
        return (f"none fitted yet: predictions come from the roofline estimate (runtime only, "
                f"efficiency {plain(cfg.roofline_efficiency)})")
    meta = active.get("meta") if isinstance(active.get("meta"), dict) else {}
    gpus = sorted({d.get("name", "?") for d in (meta or {}).get("devices", [])})
    oob = ((meta or {}).get("scores") or {}).get("runtime", {}).get("oob_mape")
    return (f"rf-{active['version']} ({esc(str(active['kind']))}), fitted "
            f"{esc(fmt_time(active['created']))} on {fmt_count(int(active['n_samples']))} "
            f"stored probes of {esc(', '.join(gpus) or '?')}"
            + (f"; runtime out-of-bag error {fmt_pct(oob)} at fit time" if oob else ""))


# ------------------------------------------------------------------ reading


class _Bands:
    """Each model version's prediction interval per probe, re-computed with that model:
    (lower / point, upper / point) per target, applied to the stored point."""

    def __init__(self, mods: list[dict[str, Any]], cfg: ModelConfig):
        self.records = {f"rf-{m['version']}": m for m in mods}
        self.cfg = cfg
        self.models: dict[str, Any] = {}
        self.missing: dict[str, str] = {}  # version -> why no band
        self.counts = BandCounts()
        self.cache: dict[tuple[str, ProbeSpec, str], dict[str, tuple[float, float]]] = {}

    def _predictor(self, version: str) -> Any:
        if version in self.models:
            return self.models[version]
        model: Any = None
        if version == "roofline":
            from gemmd.model import RooflinePredictor

            model = RooflinePredictor(self.cfg.roofline_efficiency)
        elif version in self.records:
            try:
                model = readonly.load_model(self.records[version])
            except ModelError as e:
                self.missing[version] = f"its file is gone or unreadable ({e})"
        elif version:
            self.missing[version] = ("not a model registered in this store (a reference "
                                     "model calibrated per GPU is not re-computed)")
        self.models[version] = model
        return model

    def ratios(self, version: str, spec: ProbeSpec, info: DeviceInfo | None
               ) -> dict[str, tuple[float, float]]:
        key = (version, spec, info.uuid if info else "")
        if key in self.cache:
            return self.cache[key]
        out: dict[str, tuple[float, float]] = {}
        model = self._predictor(version) if info is not None else None
        if model is not None and info is not None:
            try:
                (p,) = model.predict([spec], [info])
            except Exception as e:  # a model that cannot predict here: no band, said once
                self.missing[version] = f"it cannot predict this probe ({type(e).__name__})"
                p = None
            for t in TARGETS if p is not None else ():
                point = getattr(p, COLUMN[t])
                lo, hi = getattr(p, f"{t}_lo"), getattr(p, f"{t}_hi")
                if point and lo is not None and hi is not None and point > 0:
                    out[t] = (lo / point, hi / point)
        self.cache[key] = out
        return out


def _series(g: GpuData, rows: list[dict[str, Any]], bands: _Bands) -> list[Series]:
    by: dict[ProbeSpec, list[dict[str, Any]]] = {}
    for r in rows:
        spec = ProbeSpec(int(r["m"]), int(r["n"]), int(r["k"]), str(r["dtype"]),
                         str(r["kernel"]), int(r["tile"] or 0), str(r["layout"]))
        by.setdefault(spec, []).append(r)
    out = []
    for spec in sorted(by, key=lambda s: (s.kernel, s.dtype, s.m * s.n * s.k, s.layout)):
        mine = by[spec]

        def col(name: str, rows: list[dict[str, Any]] = mine) -> np.ndarray:
            return np.array([np.nan if r[name] is None else float(r[name]) for r in rows])

        ok = np.array([r["outcome"] == "ok" for r in mine])
        meas = {t: np.where(ok, col(COLUMN[t]), np.nan) for t in TARGETS}
        pred = {t: np.where(ok, col(PRED[t]), np.nan) for t in TARGETS}
        versions = [str(r["model_version"] or "") for r in mine]
        # The interval stored with each result; re-computed (with the model that made the
        # prediction) only for results stored without one (an older gemmd).
        lo = {t: np.where(ok, col(f"pred_{t}_lo"), np.nan) for t in TARGETS}
        hi = {t: np.where(ok, col(f"pred_{t}_hi"), np.nan) for t in TARGETS}
        vers = np.array(versions, dtype=object)
        lack = {t: np.isfinite(pred[t]) & ~(np.isfinite(lo[t]) & np.isfinite(hi[t]))
                for t in TARGETS}
        for t in TARGETS:
            bands.counts.stored += int((np.isfinite(pred[t]) & ~lack[t]).sum())
        for v in {v for v, need in zip(versions, np.logical_or.reduce(
                [lack[t] for t in TARGETS])) if need}:
            for t, (a, b) in bands.ratios(v, spec, g.info).items():
                sel = lack[t] & (vers == v)
                lo[t][sel], hi[t][sel] = pred[t][sel] * a, pred[t][sel] * b
                bands.counts.recomputed += int(sel.sum())
        for t in TARGETS:
            bands.counts.none += int((lack[t] & ~(np.isfinite(lo[t]) & np.isfinite(hi[t]))
                                      ).sum())
        out.append(Series(spec, col("ts"), ok, [str(r["outcome"]) for r in mine], meas, pred,
                          lo, hi, versions, np.array([bool(r["flagged"]) for r in mine])))
    return out


@dataclass
class _Drift:
    tracks: dict[tuple[str, ProbeSpec, str], Any]
    devices: dict[str, Any]
    baseline_probes: int


def _drift_state(state_dir: Path, cfg: DriftConfig) -> _Drift | None:
    path = state_dir / "drift.json"
    if not path.is_file():
        return None
    from gemmd.drift import DriftMonitor

    mon = DriftMonitor(cfg, path)  # reads the file; a report never saves it
    return _Drift(mon.snapshot(), mon.device_snapshot(), cfg.baseline_probes)


def _drift_now(drift: _Drift | None, uuid: str) -> tuple[str, int]:
    """(the GPU's drift state now, as HTML; alarms raised so far)."""
    if drift is None:
        return "unknown (no drift state)", 0
    dev = drift.devices.get(uuid)
    tracks = {k: v for k, v in drift.tracks.items() if k[0] == uuid}
    alarms = sum(t.alarms for t in tracks.values()) + (
        sum(t.alarms for t in dev.targets.values()) if dev else 0)
    parts = []
    for target in TARGETS:
        pooled = dev.targets.get(target) if dev else None
        own = sorted(k[1].name for k, t in tracks.items() if k[2] == target and t.drifting)
        since = [t.since for k, t in tracks.items() if k[2] == target and t.drifting
                 and t.since]
        if pooled is not None and pooled.drifting:
            if pooled.since:
                since.append(pooled.since)
            ratio = f", ×{pooled.ratio:.3f} of normal" if pooled.ratio else ""
            parts.append(f"<span class=bad>{target} in alarm (probes pooled{ratio}) since "
                         f"{esc(fmt_time(min(since)))}</span>")
        elif own:
            parts.append(f"<span class=bad>{target} in alarm on {len(own)} probe(s) since "
                         f"{esc(fmt_time(min(since) if since else None))}</span>")
    slower = dev.targets.get("runtime") if dev else None
    if slower is not None and slower.slower and slower.peer_ratio:
        parts.append(f"<span class=bad>slower than its {slower.peers} peer(s): "
                     f"×{slower.peer_ratio:.3f}</span>")
    if parts:
        return "; ".join(parts), alarms
    if not tracks:
        return "no drift tracks yet", alarms
    baselining = sum(1 for t in tracks.values() if t.reference is None)
    if baselining == len(tracks):
        return "taking references (no alarm possible yet)", alarms
    return "<span class=ok>in control</span>" + (
        f" ({baselining} of {len(tracks)} tracks still taking references)" if baselining
        else ""), alarms


def _trouble(g: GpuData, drift: _Drift | None) -> bool:
    return ("class=bad" in _drift_now(drift, str(g.rec["uuid"]))[0] or bool(g.alarms)
            or any(s.flagged.any() or not s.ok.all() for s in g.series))


# ------------------------------------------------------------------ events


def _detail(e: dict[str, Any]) -> dict[str, Any]:
    return e["detail"] if isinstance(e.get("detail"), dict) else {}


def _num(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and \
        math.isfinite(v) else None


def _alarm_spans_of(g: GpuData, drift: _Drift | None) -> list[AlarmSpan]:
    """The GPU's alarms per target over the window, from its events (oldest first): a
    target is in alarm from its first alarm raised while none was, until every alarm
    raised on it (pooled or a probe's) cleared, or a rebaseline. An alarm in the saved
    drift state that no event began (raised before the store recorded events) counts from
    its start there."""
    spans: list[AlarmSpan] = []
    open_: dict[str, AlarmSpan] = {}
    members: dict[str, set[str]] = {}
    for e in g.events:
        kind, target, det, ts = e["kind"], e.get("target"), _detail(e), float(e["ts"])
        who = str(e.get("probe") or "pooled")
        if kind == "alarm" and target:
            span = open_.get(target)
            if span is None:
                span = open_[target] = AlarmSpan(target, ts, None, det, [])
                spans.append(span)
            members.setdefault(target, set()).add(who)
            if who not in span.by:
                span.by.append(who)
            if who == "pooled" and span.raised.get("scope") != "pooled":
                span.raised = det  # the device's estimate of the shift, where there is one
        elif kind == "clear" and target:
            how = "rebaseline" if det.get("reason") == "rebaseline" else "cleared"
            span = open_.get(target)
            if span is None:  # raised before the events began (or were pruned)
                began = _num(det.get("since"))
                spans.append(AlarmSpan(target, began if began is not None else ts, ts, {},
                                       [who], how, start_known=False))
                continue
            members[target].discard(who)
            if not members[target]:
                span.end, span.ended_by = ts, how
                del open_[target]
        elif kind == "rebaseline" and det.get("phase") != "requested":
            for span in open_.values():
                span.end, span.ended_by = ts, "rebaseline"
            open_.clear()
            members.clear()
    for target, (began, by) in _open_alarms(drift, str(g.rec["uuid"])).items():
        if target not in open_:
            spans.append(AlarmSpan(target, began, None, {}, by, start_known=False))
    a, b = g.window
    return [sp for sp in _merge(spans) if sp.start <= b and (sp.end is None or sp.end >= a)]


def _open_alarms(drift: _Drift | None, uuid: str) -> dict[str, tuple[float, list[str]]]:
    """Per target in alarm in the saved drift state: since when, and on what."""
    if drift is None:
        return {}
    out = {}
    dev = drift.devices.get(uuid)
    for target in TARGETS:
        by, since = [], []
        pooled = dev.targets.get(target) if dev else None
        if pooled is not None and pooled.drifting:
            by.append("pooled")
            since.append(pooled.since)
        for (u, spec, t), tr in drift.tracks.items():
            if u == uuid and t == target and tr.drifting:
                by.append(spec.name)
                since.append(tr.since)
        known = [x for x in since if _num(x) is not None]
        if by and known:
            out[target] = (float(min(known)), by)
    return out


def _merge(spans: list[AlarmSpan]) -> list[AlarmSpan]:
    """Overlapping spans of one target as one, oldest first."""
    out: list[AlarmSpan] = []
    for sp in sorted(spans, key=lambda x: (x.target, x.start)):
        last = out[-1] if out and out[-1].target == sp.target else None
        if last is not None and (last.end is None or sp.start <= last.end):
            if last.end is not None and (sp.end is None or sp.end > last.end):
                last.end, last.ended_by = sp.end, sp.ended_by
            last.by += [w for w in sp.by if w not in last.by]
            continue
        out.append(sp)
    return sorted(out, key=lambda x: x.start)


def _rebaselines_of(events: list[dict[str, Any]], since: float, until: float
                    ) -> list[RebaselineMark]:
    """The rebaselines in the window: each applied by the daemon (with the results its
    request unflagged) or automatic, and one requested but not applied yet."""
    marks: list[RebaselineMark] = []
    pending: RebaselineMark | None = None
    for e in events:
        if e["kind"] != "rebaseline":
            continue
        det = _detail(e)
        phase, n = str(det.get("phase") or "applied"), int(_num(det.get("unflagged")) or 0)
        if phase == "requested":
            pending = RebaselineMark(float(e["ts"]), phase,
                                     n + (pending.unflagged if pending else 0))
            continue
        if phase == "applied" and pending is not None:
            n, pending = n + pending.unflagged, None
        marks.append(RebaselineMark(float(e["ts"]), phase, n))
    if pending is not None:
        marks.append(pending)
    return [m for m in marks if since <= m.ts <= until]


def _fmt_ts(ts: float | None) -> str:
    """An event's time, to the second."""
    if ts is None or not math.isfinite(ts):
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(ts))


def _duration(s: float) -> str:
    for unit, f in (("d", 86400), ("h", 3600), ("min", 60)):
        if s >= f:
            return f"{s / f:.1f} {unit}" if s < 10 * f else f"{s / f:.0f} {unit}"
    return f"{max(s, 0.0):.0f} s"


def _span_row(sp: AlarmSpan, labels: dict[str, str], until: float) -> tuple[float, list[str]]:
    """One alarm of one target, as a row: when raised, on what, how far off, how it
    ended."""
    probes = [labels.get(w, w) for w in sp.by if w != "pooled"]
    on = ["its probes pooled"] if "pooled" in sp.by else []
    if probes:
        on.append(", ".join(probes) if len(probes) <= 2 else f"{len(probes)} probes alone")
    ratio = _num(sp.raised.get("ratio"))
    detail = [f"×{ratio:.3f} of normal when raised" if ratio else ""]
    length = (sp.end if sp.end is not None else until) - sp.start
    if sp.end is None:
        detail.append(f"<span class=bad>still in alarm</span> at the window's end, after "
                      f"{_duration(length)}")
    elif sp.ended_by == "rebaseline":
        detail.append(f"ended by the rebaseline {_fmt_ts(sp.end)}, after {_duration(length)}")
    else:
        detail.append(f"<span class=ok>cleared</span> {_fmt_ts(sp.end)}, after "
                      f"{_duration(length)}")
    when = _fmt_ts(sp.start) if sp.start_known else \
        f"{_fmt_ts(sp.start)} (before the events were recorded)"
    return sp.start, [when, "<span class=bad>drift alarm</span>", esc(sp.target),
                      esc(" and ".join(on)) or "-", "; ".join(x for x in detail if x)]


def _rebaseline_row(m: RebaselineMark, everyone: bool) -> tuple[float, list[str]]:
    who = "every GPU" if everyone else "this GPU"
    unflagged = (f"{fmt_count(m.unflagged)} result(s) taken while drifting unflagged"
                 if m.unflagged else "no result taken while drifting to unflag")
    text = {"requested": f"<code>gemmd rebaseline</code> for {who}: {unflagged}; not "
                         "applied by the daemon yet",
            "applied": f"<code>gemmd rebaseline</code> for {who}: {unflagged}; drift "
                       "references reset by the daemon",
            "automatic": "<code>drift.accept_after_s</code> passed: its behaviour taken as "
                         "the new normal"}.get(m.phase, esc(m.phase))
    return m.ts, [_fmt_ts(m.ts), f"<b>rebaseline{' requested' if m.phase == 'requested' else ''}"
                  "</b>", "every target", "-", text]


def _events_table(g: GpuData) -> str:
    """The GPU's drift alarms (per target, from raised to cleared) and rebaselines in the
    window, from the store's events."""
    if not g.events_recorded:
        return ""
    if not g.alarms and not g.rebaselines:
        return ("<p class=note>No drift alarm or rebaseline recorded for this GPU in the "
                "window.</p>")
    labels = {s.spec.name: probe_label(s.spec) for s in g.series}
    everyone = {float(e["ts"]) for e in g.events
                if e["kind"] == "rebaseline" and e.get("device_uuid") is None}
    rows = sorted([_span_row(sp, labels, g.window[1]) for sp in g.alarms]
                  + [_rebaseline_row(m, m.ts in everyone) for m in g.rebaselines],
                  key=lambda r: r[0])
    shown = rows[-MAX_EVENT_ROWS:]
    more = f" (the newest {len(shown)} of {len(rows)})" if len(shown) < len(rows) else ""
    return (f"<h3>Drift alarms and rebaselines in the window{more}</h3>"
            + table(["time", "event", "target", "on", "detail"], [r for _, r in shown],
                    left={0, 1, 2, 3, 4}))


def _model_events(evs: list[dict[str, Any]]) -> str:
    """Models activated and refits rejected in the window (the fleet's)."""
    if not evs:
        return ""
    rows = []
    for e in evs[-MAX_EVENT_ROWS:]:
        det = _detail(e)
        if e["kind"] == "model":
            rows.append([_fmt_ts(e["ts"]), "model activated",
                         esc(str(det.get("version", "?"))), esc(str(det.get("kind", "?"))),
                         fmt_count(int(_num(det.get("rows")) or 0)),
                         esc(str(det.get("reason", "")))])
        else:
            rows.append([_fmt_ts(e["ts"]), "refit rejected", esc(str(det.get("version", "?"))),
                         "-", fmt_count(int(_num(det.get("rows")) or 0)),
                         esc(str(det.get("reason", "")))])
    return ("<h2>Models in the window</h2>"
            + table(["time", "event", "predictions from", "kind", "rows", "why"], rows,
                    left={0, 1, 2, 3, 5}))


# ------------------------------------------------------------------ live error


def _deployed_rows(s: Series, deployed: str) -> np.ndarray:
    return s.ok & np.array([v == deployed for v in s.version], dtype=bool)


def _live(s: Series, target: str, sel: np.ndarray) -> dict[str, float]:
    m, p = s.meas[target], s.pred[target]
    good = sel & np.isfinite(m) & np.isfinite(p) & (p > 0)
    if not good.any():
        return {"n": 0}
    err = np.abs(m[good] / p[good] - 1)
    lo, hi = s.lo[target][good], s.hi[target][good]
    known = np.isfinite(lo) & np.isfinite(hi)
    inside = float(np.mean((lo[known] <= m[good][known]) & (m[good][known] <= hi[known]))) \
        if known.any() else math.nan
    return {"n": int(good.sum()), "median": float(np.median(err)),
            "p90": float(np.percentile(err, 90)), "inside": inside,
            "last": float(m[good][-1] / p[good][-1])}


def _which_rows(g: GpuData, deployed: str) -> tuple[str, bool]:
    """The model whose live error is shown: the deployed one where it predicted results in
    the window, else every prediction of the window."""
    if any(_deployed_rows(s, deployed).any() for s in g.series):
        return deployed, True
    return "all models in the window", False


def _fleet_table(gpus: list[GpuData], deployed: str, drift: _Drift | None) -> str:
    rows = []
    errs_of: set[str] = set()
    for g in gpus:
        label, only = _which_rows(g, deployed)
        oks = sum(int(s.ok.sum()) for s in g.series)
        outcomes = [o for s in g.series for o in s.outcome]
        failed, mismatch = outcomes.count("failed"), outcomes.count("mismatch")
        flagged = sum(int(s.flagged.sum()) for s in g.series)
        now, alarms = _drift_now(drift, str(g.rec["uuid"]))
        err = []
        for t in TARGETS:
            vals: list[float] = []
            ns = 0
            for s in g.series:
                sel = _deployed_rows(s, deployed) if only else s.ok
                lv = _live(s, t, sel)
                if lv["n"]:
                    vals.append(lv["median"])
                    ns += int(lv["n"])
            err.append(fmt_pct(float(np.median(vals))) + (" ⚠" if 0 < ns < MIN_ROWS else "")
                       if vals else "-")
        last = max((float(s.ts[-1]) for s in g.series if len(s.ts)), default=None)
        a, b = g.window
        began = sum(1 for sp in g.alarms if sp.start_known and sp.start >= a)
        events = ", ".join(x for x in (
            f"<span class=bad>{began} alarm(s) raised</span>" if began else "",
            f"{len(g.rebaselines)} rebaseline(s)" if g.rebaselines else "") if x) or \
            ("none" if g.events_recorded else "not recorded")
        rows.append([
            f"<a href='#gpu-{esc(str(g.rec['uuid']))}'>GPU {esc(str(g.rec['idx']))}</a>",
            esc(str(g.rec["name"])),
            f"{fmt_count(oks)}" + (f" <span class=bad>+{failed} failed</span>" if failed else "")
            + (f" <span class=bad>+{mismatch} wrong results</span>" if mismatch else ""),
            (f"<span class=bad>{fmt_count(flagged)}</span>" if flagged else "0"),
            now, str(alarms), events, *err, f"<span class=nw>{esc(fmt_time(last))}</span>"])
        errs_of.add(label)
    head = ["GPU", "model", "ok results", "flagged", "drift now", "alarms so far",
            "events in window", "live error: runtime", "power", "energy", "last result"]
    return ("<h2>Fleet</h2>" + table(head, rows, left={0, 1, 4, 6})
            + "<p class=note>Live error: the median over the GPU's sentinel probes of each "
              "probe's median |measured / predicted − 1| over the window, of "
              + esc(" / ".join(sorted(errs_of))) + " (⚠: fewer than "
              f"{MIN_ROWS} results). Flagged: results taken while the GPU was in drift alarm "
              "(kept out of refits). Alarms so far: raised since the drift state began (probe "
              "tracks and pooled). Events in window: drift alarms raised (per target) and "
              "rebaselines, from the store's events.</p>")


# ------------------------------------------------------------------ one GPU


def _gpu_section(plt: Any, g: GpuData, deployed: str, drift: _Drift | None, page: Page
                 ) -> str:
    uuid = str(g.rec["uuid"])
    title = f"GPU {g.rec['idx']}: {g.rec['name']}"
    parts = [f"<h2 id='gpu-{esc(uuid)}'>{esc(title)}</h2>"]
    info: dict[str, Any] = g.rec["info"] if isinstance(g.rec.get("info"), dict) else {}
    extra = info.get("extra") or {}
    facts = [f"UUID <code>{esc(uuid)}</code>", f"backend {esc(str(g.rec['backend']))}"]
    for key in ("driver_version", "cuda_driver_version", "pci_bus_id", "vbios_version"):
        if extra.get(key):
            facts.append(f"{key.replace('_', ' ')} {esc(str(extra[key]))}")
    if info.get("power_limit_w"):
        facts.append(f"power limit {plain(float(info['power_limit_w']))} W")
    facts.append(f"first seen {esc(fmt_time(g.rec.get('first_seen')))}")
    now, _ = _drift_now(drift, uuid)
    parts.append(f"<p class=note>{' · '.join(facts)}<br>Drift now: {now}</p>")
    if not g.series:
        parts.append("<p class=warn>⚠ No sentinel results of this GPU in the window.</p>")
        return "".join(parts)
    label, only = _which_rows(g, deployed)
    head = ["probe", "results"] + ["median |m/p − 1|", "p90", "in interval"] * len(TARGETS)
    groups = [("", 2)] + [(TARGET_TITLE[t], 3) for t in TARGETS]
    rows, few = [], 0
    for s in g.series:
        sel_all = _deployed_rows(s, deployed) if only else s.ok
        lives = [_live(s, t, sel_all) for t in TARGETS]
        n = int(max(lv["n"] for lv in lives))
        few += 0 < n < MIN_ROWS
        row = [esc(probe_label(s.spec)), fmt_count(n) + (" ⚠" if 0 < n < MIN_ROWS else "")]
        for lv in lives:
            row += [fmt_pct(lv.get("median")), fmt_pct(lv.get("p90")),
                    fmt_pct(lv.get("inside"), 0)]
        rows.append(row)
    parts.append(f"<h3>Live error of {esc(label)}</h3>" + table(head, rows, groups=groups))
    if few:
        parts.append(f"<p class=warn>⚠ The live error of {few} probe(s) rests on fewer than "
                     f"{MIN_ROWS} results of {esc(label)} in the window: too few to trust "
                     "(a longer window, --days, or more rounds).</p>")
    if not only:
        parts.append(f"<p class=note>The deployed model ({esc(deployed)}) predicted none of "
                     "this GPU's results in the window; the error shown is of the models that "
                     "did.</p>")
    parts.append(_events_table(g))
    binned = any(len(s.ts) > MAX_POINTS for s in g.series) or \
        len(g.context.ts) > 4 * MAX_POINTS
    parts.append(to_svg(_fig_ratio(plt, g), f"{title}: measured / predicted"))
    parts.append(to_svg(_fig_probes(plt, g), f"{title}: measured and predicted per probe"))
    parts.append(to_svg(_fig_context(plt, g), f"{title}: clocks and clock-event reasons"))
    if binned:
        parts.append(f"<p class=note>A probe's series of more than {MAX_POINTS:,} results, "
                     f"and a context of more than {4 * MAX_POINTS:,}, are drawn as medians per "
                     f"time bin ({MAX_POINTS:,} bins over the window; the context with its "
                     "range in each bin).</p>")
    return "".join(parts)


def _times(ts: np.ndarray) -> np.ndarray:
    return (np.asarray(ts) * 1e3).astype("int64").astype("datetime64[ms]")


def _bin(ts: np.ndarray, arrays: list[np.ndarray], flags: np.ndarray
         ) -> tuple[np.ndarray, list[np.ndarray], np.ndarray]:
    """At most MAX_POINTS points (``ts`` ascending): per equal time bin the median time
    and the median of each array (NaN ignored); a flag is set if set in the bin."""
    starts = _bin_edges(ts)
    if starts is None:
        return ts, arrays, flags
    return (_reduce(ts, starts, "median"), [_reduce(a, starts, "median") for a in arrays],
            np.logical_or.reduceat(flags, starts))


def _alarm_spans(g: GpuData) -> list[tuple[float, float]]:
    """Time spans of results taken while the GPU was flagged as drifting: from the first
    flagged result to the next unflagged one (or the last flagged one)."""
    ts = np.concatenate([s.ts for s in g.series]) if g.series else np.zeros(0)
    fl = np.concatenate([s.flagged for s in g.series]) if g.series else np.zeros(0, bool)
    order = np.argsort(ts, kind="stable")
    ts, fl = ts[order], fl[order]
    spans, start = [], None
    for t, f in zip(ts, fl):
        if f and start is None:
            start = t
        elif not f and start is not None:
            spans.append((start, t))
            start = None
    if start is not None:
        spans.append((start, float(ts[-1])))
    return spans


def _model_changes(g: GpuData) -> list[tuple[float, str]]:
    pairs = sorted((float(t), v) for s in g.series for t, v, o in zip(s.ts, s.version, s.ok)
                   if o and v)
    out, last = [], None
    for t, v in pairs:
        if v != last:
            if last is not None:
                out.append((t, v))
            last = v
    return out


def _mark_time(ax: Any, g: GpuData, spans: list[tuple[float, float]],
               changes: list[tuple[float, str]], label: bool, *, annotate: bool | None = None,
               target: str | None = None) -> None:
    """Shade the results taken in drift alarm; a dotted line where a new model took over;
    from the store's events, the drift alarms of ``target`` (None: every target) as a bar
    along the top with a line where each was raised and where it cleared, and a line at
    each rebaseline. ``label``: name them for the legend; ``annotate`` (default: label):
    write the model's version and the rebaselines on the panel."""
    annotate = label if annotate is None else annotate
    for i, (a, b) in enumerate(spans):
        ax.axvspan(_times(np.array([a]))[0], _times(np.array([b]))[0], color=ALARM_COLOR,
                   alpha=0.12, lw=0, zorder=0,
                   label="taken in drift alarm (flagged)" if label and i == 0 else None)
    for i, (t, v) in enumerate(changes):
        x = _times(np.array([t]))[0]
        ax.axvline(x, color="#777", ls=":", lw=1, zorder=1,
                   label="new model" if label and i == 0 else None)
        if annotate:
            ax.annotate(v, (x, 1.0), xycoords=("data", "axes fraction"), xytext=(2, -2),
                        textcoords="offset points", fontsize=7, color="#555", va="top")
    lo, hi = g.window
    raised = cleared = 0
    for i, sp in enumerate(x for x in g.alarms if target is None or x.target == target):
        x0, x1 = _times(np.array([max(sp.start, lo), sp.end if sp.end is not None else hi]))
        ax.axvspan(x0, x1, ymin=0.955, ymax=1.0, color=ALARM_COLOR, alpha=0.6, lw=0,
                   zorder=2, label="in drift alarm" if label and i == 0 else None)
        if sp.start_known and sp.start >= lo:
            ax.axvline(x0, color=ALARM_COLOR, lw=1.1, zorder=2,
                       label="drift alarm raised" if label and not raised else None)
            raised += 1
            ratio = _num(sp.raised.get("ratio"))
            if label and target is not None and ratio:
                ax.annotate(f"×{ratio:.3f}", (x0, 0.95), xycoords=("data", "axes fraction"),
                            xytext=(2, -2), textcoords="offset points", fontsize=7,
                            color=ALARM_COLOR, va="top")
        if sp.end is not None and sp.end <= hi and sp.ended_by == "cleared":
            ax.axvline(x1, color=CLEAR_COLOR, lw=1.1, ls="--", zorder=2,
                       label="drift alarm cleared" if label and not cleared else None)
            cleared += 1
    for i, m in enumerate(g.rebaselines):
        x = _times(np.array([m.ts]))[0]
        ax.axvline(x, color=REBASELINE_COLOR, lw=1.4, ls="-.", zorder=2,
                   label="rebaseline" if label and i == 0 else None)
        if annotate:
            what = "rebaseline" + (" requested" if m.phase == "requested" else "") + (
                " (automatic)" if m.phase == "automatic" else "") + (
                f": {m.unflagged:,} results unflagged" if m.unflagged else "")
            ax.annotate(what, (x, 0.0), xycoords=("data", "axes fraction"), xytext=(2, 2),
                        textcoords="offset points", fontsize=7, color=REBASELINE_COLOR,
                        va="bottom")


def _legend_of(axes: Sequence[Any]) -> tuple[list[Any], list[str]]:
    """The legend entries of several panels, each label once."""
    handles, labels = [], []
    for ax in axes:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            if lab not in labels:
                handles.append(h)
                labels.append(lab)
    return handles, labels


def _time_axis(ax: Any, g: GpuData) -> None:
    """The GPU's window of results (the same on each of its figures), dates readable."""
    import matplotlib.dates as mdates

    ts = g.context.ts
    if len(ts):
        a, b = float(ts.min()), float(ts.max())
        pad = max((b - a) * 0.02, 5.0)
        ax.set_xlim(_times(np.array([a - pad]))[0], _times(np.array([b + pad]))[0])
    loc = mdates.AutoDateLocator(minticks=4, maxticks=9)
    ax.xaxis.set_major_locator(loc)
    ax.xaxis.set_major_formatter(mdates.ConciseDateFormatter(loc, show_offset=True))


def _fig_ratio(plt: Any, g: GpuData) -> Any:
    """measured / predicted per probe over time, one panel per target."""
    targets = [t for t in TARGETS if any(np.isfinite(s.meas[t] / s.pred[t]).any()
                                         for s in g.series)]
    targets = targets or ["runtime"]
    fig, axes = plt.subplots(len(targets), 1, figsize=(12, 1.75 * len(targets) + 1.0),
                             sharex=True, squeeze=False)
    spans, changes = _alarm_spans(g), _model_changes(g)
    for row, target in enumerate(targets):
        ax = axes[row][0]
        # The scale follows the fitted models' results within 0.5-2 (the roofline's,
        # before the first fit, can be off by 2-50x: beyond, points sit at the edge). With
        # no fitted model at all, the roofline's ratios set a logarithmic scale.
        fitted = [s.meas[target][v] / s.pred[target][v] for s in g.series
                  for v in [np.array([x not in ("", "roofline") for x in s.version], bool)]]
        allr = np.concatenate(fitted) if fitted else np.zeros(0)
        allr = allr[np.isfinite(allr) & (allr > 0)]
        log = False
        if allr.size:
            lo, hi = np.percentile(allr, [0.5, 99.5])
            lo, hi = min(max(lo, 0.5), 0.98), max(min(hi, 2.0), 1.02)
        else:
            allr = np.concatenate([s.meas[target] / s.pred[target] for s in g.series])
            allr = allr[np.isfinite(allr) & (allr > 0)]
            lo, hi = (float(allr.min()), float(allr.max())) if allr.size else (0.9, 1.1)
            lo, hi = min(lo, 0.9), max(hi, 1.1)
            log = hi / lo > 5
        pad = (hi - lo) * 0.08
        ylo, yhi = (lo / 1.15, hi * 1.15) if log else (lo - pad, hi + pad)
        _mark_time(ax, g, spans, changes, label=True, annotate=row == 0, target=target)
        ax.axhline(1.0, color="#444", lw=0.9, zorder=1)
        for i, s in enumerate(g.series):
            r = s.meas[target] / s.pred[target]
            good = np.isfinite(r)
            if not good.any():
                continue
            ts, (rr,), _ = _bin(s.ts[good], [r[good]], s.flagged[good])
            c = PROBE_COLORS[i % len(PROBE_COLORS)]
            clipped = np.clip(rr, ylo, yhi)
            ax.plot(_times(ts), clipped, color=c, lw=0.9, alpha=0.85, ms=1.8,
                    marker="o" if len(ts) <= MAX_POINTS // 2 else None,
                    label=probe_label(s.spec) if row == 0 else None,
                    rasterized=len(ts) > MAX_POINTS)
            for out, mk in ((rr > yhi, "^"), (rr < ylo, "v")):
                if out.any():
                    ax.scatter(_times(ts[out]), clipped[out], marker=mk, s=16, color=c,
                               zorder=4)
        if row == 0:
            bad = [(t, o) for s in g.series for t, o in zip(s.ts, s.outcome) if o != "ok"]
            for kind, mk, col in (("failed", "x", "#555"), ("mismatch", "X", ALARM_COLOR)):
                tt = np.array([t for t, o in bad if o == kind])
                if tt.size:
                    ax.scatter(_times(tt), np.full(tt.size, yhi - pad / 2), marker=mk, s=22,
                               color=col, zorder=5,
                               label="failed probe" if kind == "failed" else "wrong result")
        value_axis(ax, "y", lo, hi, force_log=log)
        ax.set_ylim(ylo, yhi)
        ax.set_ylabel(f"{target}\nmeasured / predicted")
    _time_axis(axes[-1][0], g)
    axes[-1][0].set_xlabel("time (UTC)")
    handles, labels = _legend_of([a[0] for a in axes])
    axes[0][0].legend(handles, labels, loc="lower left", bbox_to_anchor=(0.0, 1.01), ncol=3,
                      borderaxespad=0.0, handlelength=1.6, columnspacing=1.2)
    axes[0][0].set_title("Measured / predicted over time: 1 = the model exactly; a step up "
                         "is a slowdown (points off the scale sit at its edge as ▲ ▼)",
                         loc="left", fontsize=10, fontweight="bold",
                         pad=16 + 12 * math.ceil(len(handles) / 3))
    fig.tight_layout()
    return fig


def _fig_probes(plt: Any, g: GpuData) -> Any:
    """Per probe (rows) and target (columns): measured, predicted and its interval."""
    targets = [t for t in TARGETS if any(np.isfinite(s.meas[t]).any() for s in g.series)]
    n = len(g.series)
    fig, axes = plt.subplots(n, len(targets), figsize=(12, 1.6 * n + 1.0), sharex=True,
                             squeeze=False)
    spans, changes = _alarm_spans(g), _model_changes(g)
    for i, s in enumerate(g.series):
        for j, target in enumerate(targets):
            ax = axes[i][j]
            m, p = s.meas[target], s.pred[target]
            unit, f = unit_for(target, m)
            ts, (mm, pp, lo, hi), fl = _bin(s.ts, [m, p, s.lo[target], s.hi[target]],
                                             s.flagged)
            t = _times(ts)
            _mark_time(ax, g, spans, changes, label=False, target=target)
            band = np.isfinite(lo) & np.isfinite(hi)
            if band.any():
                ax.fill_between(t, np.where(band, lo / f, np.nan), np.where(band, hi / f,
                                np.nan), color="#0072B2", alpha=0.16, lw=0, step="mid",
                                label="prediction interval" if i == 0 and j == 0 else None)
            ax.plot(t, pp / f, color="#0072B2", lw=1.1, drawstyle="steps-mid",
                    label="predicted" if i == 0 and j == 0 else None)
            good = np.isfinite(mm)
            vals = np.concatenate([mm[good], pp[np.isfinite(pp)]]) / f
            if vals.size:
                lo_v, hi_v = (float(x) for x in np.percentile(vals, [0.5, 99.5]))
                value_axis(ax, "y", lo_v, hi_v, force_log=False)
                ylo, yhi = ax.get_ylim()
                y = np.clip(mm / f, ylo, yhi)  # off the scale: at its edge, as a triangle
                off = good & ((mm / f < ylo) | (mm / f > yhi))
                for sel, col, lab in ((good & ~fl, "#222", "measured"),
                                      (good & fl, ALARM_COLOR, "measured, in drift alarm")):
                    if sel.any():
                        ax.scatter(t[sel & ~off], y[sel & ~off], s=5, color=col, zorder=3,
                                   linewidths=0, label=lab if i == 0 and j == 0 else None,
                                   rasterized=len(ts) > MAX_POINTS)
                        for side, mk in ((mm / f > yhi, "^"), (mm / f < ylo, "v")):
                            if (sel & side).any():
                                ax.scatter(t[sel & side], y[sel & side], s=16, color=col,
                                           zorder=3, marker=mk, linewidths=0, clip_on=False)
                ax.set_ylim(ylo, yhi)
            else:
                ax.text(0.5, 0.5, f"{target} not measured", transform=ax.transAxes,
                        ha="center", va="center", color="#777")
            ax.set_ylabel(unit, labelpad=2)
            if i == 0:
                ax.set_title(TARGET_TITLE[target], fontsize=9.5, pad=18)
            if j == 0:
                ax.annotate(probe_label(s.spec), (0, 1), xycoords="axes fraction",
                            xytext=(2, 3), textcoords="offset points", fontsize=8.5,
                            fontweight="bold", va="bottom")
    for j in range(len(targets)):
        _time_axis(axes[-1][j], g)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower right", bbox_to_anchor=(1.0, 1.0),
               ncol=len(handles), frameon=False)
    fig.suptitle("Each probe: measured against predicted, with the prediction interval",
                 x=0.01, ha="left", y=1.0, va="bottom", fontsize=10, fontweight="bold")
    fig.tight_layout(h_pad=1.6)
    return fig


def _context(rows: list[dict[str, Any]]) -> Context:
    rows = sorted(rows, key=lambda r: r["ts"])
    ts = np.array([float(r["ts"]) for r in rows])
    after = [((r.get("context") or {}).get("after") or {}) if isinstance(r.get("context"),
             dict) else {} for r in rows]

    def num(key: str, scale: float = 1.0) -> np.ndarray:
        return np.array([float(a[key]) * scale if isinstance(a.get(key), (int, float))
                         else np.nan for a in after])

    values = {"SM clock (MHz)": num("sm_clock_hz", 1e-6),
              "memory clock (MHz)": num("mem_clock_hz", 1e-6),
              "temperature (°C)": num("temperature_c"),
              "power limit (W)": num("power_limit_w")}
    reasons: dict[str, np.ndarray] = {}
    if not any("clock_event_reasons" in a for a in after):
        return Context(ts, values, None)
    for i, a in enumerate(after):
        for name in a.get("clock_event_reasons") or []:
            reasons.setdefault(str(name), np.zeros(len(after), bool))[i] = True
    return Context(ts, values, reasons)


def _bin_edges(ts: np.ndarray, limit: int = MAX_POINTS) -> np.ndarray | None:
    """Starts of MAX_POINTS equal time bins over ``ts`` (ascending) where it holds more
    than ``limit`` values; None: few enough to draw each."""
    if len(ts) <= limit:
        return None
    edges = np.linspace(ts[0], ts[-1], MAX_POINTS + 1)
    idx = np.clip(np.searchsorted(edges, ts, side="right") - 1, 0, MAX_POINTS - 1)
    return np.flatnonzero(np.r_[True, idx[1:] != idx[:-1]])


def _reduce(a: np.ndarray, starts: np.ndarray, how: str) -> np.ndarray:
    """The "median", "min" or "max" of ``a`` per bin (bins start at ``starts``), NaN
    ignored, NaN for a bin without a value; vectorized (one sort)."""
    n = len(a)
    group = np.repeat(np.arange(len(starts)), np.diff(np.r_[starts, n]))
    ok = np.isfinite(a)
    g, v = group[ok], a[ok]
    order = np.lexsort((v, g))
    v = v[order]
    counts = np.bincount(g, minlength=len(starts))
    first = np.r_[0, np.cumsum(counts)[:-1]]
    has = counts > 0
    out = np.full(len(starts), np.nan)
    if how == "min":
        out[has] = v[first[has]]
    elif how == "max":
        out[has] = v[first[has] + counts[has] - 1]
    else:
        lo, hi = first + (counts - 1) // 2, first + counts // 2
        out[has] = (v[lo[has]] + v[hi[has]]) / 2
    return out


def _context_line(ax: Any, ts: np.ndarray, v: np.ndarray, starts: np.ndarray | None,
                  color: str, label: str, dashed: bool = False) -> None:
    """A context value over time; binned: its median per bin and its min-max range (a dip
    of the clock within a bin stays visible)."""
    if starts is None:
        if dashed:
            ax.plot(_times(ts), v, color=color, lw=1.0, ls="--", label=label)
        else:
            ax.plot(_times(ts), v, color=color, lw=0, marker="o", ms=2.2, label=label)
        return
    t = _times(_reduce(ts, starts, "median"))
    ax.fill_between(t, _reduce(v, starts, "min"), _reduce(v, starts, "max"), color=color,
                    alpha=0.25, lw=0, step="mid")
    ax.plot(t, _reduce(v, starts, "median"), color=color, lw=1.0, ls="--" if dashed else "-",
            label=label + " (median, range per bin)")


def _fig_context(plt: Any, g: GpuData) -> Any:
    ts, values, reasons = g.context.ts, g.context.values, g.context.reasons
    starts = _bin_edges(ts, 4 * MAX_POINTS)  # a GPU's every result: binned beyond 2,400
    t = _times(ts)
    fig, axes = plt.subplots(3, 1, figsize=(12, 4.9), sharex=True,
                             gridspec_kw={"height_ratios": [1, 1, 0.8 + 0.12 * len(
                                 reasons or ())]})
    spans, changes = _alarm_spans(g), _model_changes(g)
    panels = [("SM clock (MHz)", "memory clock (MHz)"), ("temperature (°C)", "power limit (W)")]
    for ax, (a, b) in zip(axes[:2], panels):
        _mark_time(ax, g, spans, changes, label=False)
        va = values[a]
        if np.isfinite(va).any():
            _context_line(ax, ts, va, starts, "#0072B2", a)
            good = va[np.isfinite(va)]
            value_axis(ax, "y", float(good.min()), float(good.max()), force_log=False)
            ax.set_ylabel(a.split(" (")[0].replace(" clock", "\nclock") +
                          f" ({a.split('(')[1]}")
        else:
            ax.text(0.5, 0.5, f"{a} not recorded by this backend", transform=ax.transAxes,
                    ha="center", va="center", color="#777")
            ax.set_yticks([])
        vb = values[b]
        if np.isfinite(vb).any():
            tw = ax.twinx()
            _context_line(tw, ts, vb, starts, "#D55E00", b, dashed=True)
            good = vb[np.isfinite(vb)]
            value_axis(tw, "y", float(good.min()), float(good.max()), force_log=False)
            tw.set_ylabel(b, color="#D55E00")
            tw.tick_params(axis="y", colors="#D55E00")
            tw.grid(False)
            tw.spines["right"].set_visible(True)
            h1, l1 = ax.get_legend_handles_labels()
            h2, l2 = tw.get_legend_handles_labels()
            ax.legend(h1 + h2, l1 + l2, loc="lower left", bbox_to_anchor=(0.0, 1.0), ncol=2,
                      borderaxespad=0.0)
        else:
            legend_above(ax)
    ax = axes[2]
    _mark_time(ax, g, spans, changes, label=False)
    if reasons:
        names = sorted(reasons)
        tb = t if starts is None else _times(_reduce(ts, starts, "median"))
        for k, name in enumerate(names):
            on = reasons[name] if starts is None else \
                np.logical_or.reduceat(reasons[name], starts)
            ax.scatter(tb[on], np.full(int(on.sum()), k), marker="|", s=60,
                       color=ALARM_COLOR if "slowdown" in name or "cap" in name else "#555")
        ax.set_yticks(range(len(names)))
        ax.set_yticklabels(names, fontsize=7.5)
        ax.set_ylim(-0.7, len(names) - 0.3)
        ax.grid(axis="y", visible=False)
    else:
        ax.set_yticks([])
        ax.text(0.5, 0.5, "no clock-event (throttle) reason active after any probe"
                if reasons is not None else "clock-event reasons not recorded by this backend",
                transform=ax.transAxes, ha="center", va="center", color="#555")
    ax.set_title("clock-event (throttle) reasons active after each probe", loc="left",
                 fontsize=9)
    _time_axis(ax, g)
    ax.set_xlabel("time (UTC)")
    axes[0].set_title("Device context read after each probe", loc="left", fontsize=10,
                      fontweight="bold", pad=20)
    fig.tight_layout()
    return fig
