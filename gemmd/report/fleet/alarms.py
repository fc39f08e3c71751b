"""The fleet report's drift view: each GPU's drift state now (from ``drift.json``), and its
alarms per target and rebaselines over the window, from the store's events.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gemmd.config import DriftConfig
from gemmd.gemm import TARGETS, ProbeSpec
from gemmd.report.fleet.data import AlarmSpan, GpuData, RebaselineMark
from gemmd.report.page import esc, fmt_time


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
