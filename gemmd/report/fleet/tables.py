"""The fleet report's tables: the fleet at a glance (the deployed model's live error per
GPU), a GPU's drift alarms and rebaselines, and the models activated or rejected.
"""

from __future__ import annotations

import math
import time
from typing import Any

import numpy as np

from gemmd.gemm import TARGETS
from gemmd.report.fleet.alarms import _detail, _Drift, _drift_now, _num
from gemmd.report.fleet.data import AlarmSpan, GpuData, RebaselineMark, Series, probe_label
from gemmd.report.page import MIN_ROWS, esc, fmt_count, fmt_pct, fmt_time, table

MAX_EVENT_ROWS = 40  # a GPU's events listed (the newest), and as many models


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
