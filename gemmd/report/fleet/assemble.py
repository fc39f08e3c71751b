"""``write_fleet``: the fleet report read from the store and assembled from its sections: the
header, the fleet table, one section per GPU (live error per probe, drift alarms, figures),
the models in the window, and what the store records.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gemmd.config import DriftConfig, ModelConfig
from gemmd.errors import InputError
from gemmd.gemm import TARGETS
from gemmd.report import readonly
from gemmd.report.fleet.alarms import (
    _alarm_spans_of,
    _Drift,
    _drift_now,
    _drift_state,
    _rebaselines_of,
    _trouble,
)
from gemmd.report.fleet.data import BandCounts, GpuData, _Bands, _context, _series, probe_label
from gemmd.report.fleet.figures import MAX_POINTS, _fig_context, _fig_probes, _fig_ratio
from gemmd.report.fleet.tables import (
    _deployed_rows,
    _events_table,
    _fleet_table,
    _live,
    _model_events,
    _which_rows,
)
from gemmd.report.page import (
    MIN_ROWS,
    TARGET_TITLE,
    Page,
    check_out,
    esc,
    fmt_count,
    fmt_pct,
    fmt_time,
    plain,
    plt_setup,
    table,
    to_svg,
    write_atomic,
)

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
