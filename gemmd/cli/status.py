"""``gemmd status``: what the store holds (sources, devices, probe counts, the latest
sentinel results, drift, the model), as text or JSON."""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Any

from gemmd.cli.context import load_config, open_store, store_path
from gemmd.cli.output import age, fmt_value, num, stamp
from gemmd.config import Config


def cmd_status(args: argparse.Namespace) -> int:
    from gemmd.features import spec_of

    cfg = load_config(args)
    db = store_path(cfg)
    store = open_store(cfg)
    try:
        devices, counts, latest = store.devices(), store.counts(), store.latest_per_probe()
        model, models, sources = store.active_model(), store.models(), store.sources()
        last_alarm = {e["device_uuid"]: e for e in store.last_events("alarm")}
    finally:
        store.close()
    drift = _drift_summary(cfg, db.parent)
    keep = cfg.store
    for src in sources:
        src["retention"] = (f"{keep.retention_days:g} days, at most {keep.max_rows:,} rows"
                            if src["source"] == "daemon" else
                            f"until gemmd prune --source {src['source']}")
    if args.json:
        print(json.dumps({"store": str(db), "sources": sources, "devices": devices,
                          "counts": counts, "latest": latest, "model": model,
                          "models": len(models), "drift": drift, "last_alarm": last_alarm},
                         indent=1, default=str))
        return 0
    now = time.time()
    print(f"store: {db}")
    if not sources:
        print("  no probe results yet")
    for src in sources:
        kind = "probes" if src["source"] == "daemon" else "imported"
        print(f"  {src['source']:<16} {src['rows']:>9,} rows ({kind}) on {src['devices']} "
              f"device(s), last {stamp(src['last'])} ({age(now - src['last'])} ago); "
              f"kept: {src['retention']}")
    for d in devices:
        # Imported measurements have a reference device, not a GPU index of this host.
        label = ("CPU" if d["backend"] == "cpu" else f"GPU {d['idx']}") \
            if d["idx"] is not None else "reference"
        # Its newest stored result (the device record itself is refreshed only at start).
        seen = max([c["last"] for c in counts if c["device_uuid"] == d["uuid"]]
                   + [d["last_seen"] or 0])
        print(f"\n{label}  {d['name']}  ({d['backend']}, {d['uuid']})  "
              f"last probe {age(now - seen)} ago")
        dr = drift.get(d["uuid"])
        if dr:
            for a in dr.get("pooled", []):
                print(f"  drift: {a['target']} in alarm over its {a['probes']} probes pooled, "
                      f"x{a['ratio']:.3f} of normal since {age(now - a['since'])}")
            if dr.get("peer_ratio"):
                print(f"  peers: normal runtime x{dr['peer_ratio']:.3f} of the median of its "
                      f"{dr['peers']} same-model siblings"
                      + (" (slower than its peers)" if dr.get("slower") else ""))
            alarms = "; ".join(f"{a['probe']} {a['target']} x{a['ratio']:.3f} of normal "
                               f"since {age(now - a['since'])}" for a in dr["drifting"])
            print(f"  drift: {len(dr['drifting'])} of {dr['tracks']} tracks in alarm"
                  + (f": {alarms}" if alarms else "")
                  + (f"; {dr['baselining']} still taking their baseline"
                     if dr["baselining"] else ""))
        if (a := last_alarm.get(d["uuid"])) is not None:  # from the store's events
            det = a["detail"] if isinstance(a["detail"], dict) else {}
            ratio = f", x{det['ratio']:.3f} of normal" if det.get("ratio") else ""
            print(f"  last drift alarm: {a['target']} on {a['probe'] or 'its probes pooled'}"
                  f"{ratio}, {stamp(a['ts'])} ({age(now - a['ts'])} ago)")
        for c in (c for c in counts if c["device_uuid"] == d["uuid"]):
            print(f"  {c['source']:>8} {c['outcome']:<9} {c['n']:>7} probes, last "
                  f"{age(now - c['last'])} ago")
        rows = [r for r in latest if r["device_uuid"] == d["uuid"]]
        if rows:
            print(f"  {'PROBE':<34} {'AGE':>6} {'RUNTIME':>10} {'PREDICTED':>10} {'RATIO':>6} "
                  f"{'POWER':>8} {'OUTCOME'}")
        for r in rows:
            rt, pr = r["runtime_s"], r["pred_runtime_s"]
            name = spec_of(r).name
            ratio = num(rt / pr if rt and pr else None, ".3f")
            print(f"  {name:<34} {age(now - r['ts']):>6} {fmt_value('runtime', rt, 3):>10} "
                  f"{fmt_value('runtime', pr, 3):>10} {ratio:>6} "
                  f"{num(r['power_w'], '.1f', ' W'):>8} {r['outcome']}")
    if model:
        scores = model["meta"].get("scores", {})
        err = ", ".join(f"{t} {100 * s['oob_mape']:.1f}%" for t, s in scores.items())
        print(f"\nmodel: rf-{model['version']} fitted {age(now - model['created'])} ago on "
              f"{model['n_samples']} probes; out-of-bag MAPE: {err}; {len(models)} kept")
    else:
        print("\nmodel: none fitted yet (predictions come from the roofline estimate)")
    return 0


def _drift_summary(cfg: Config, state_dir: Path) -> dict[str, dict[str, Any]]:
    """Per device, from the daemon's saved drift state: tracks, those in alarm (probe,
    target, measured/normal ratio, since when) and those still taking their baseline."""
    from gemmd.drift import DriftMonitor

    path = state_dir / "drift.json"
    if not path.is_file():
        return {}
    out: dict[str, dict[str, Any]] = {}
    mon = DriftMonitor(cfg.drift, path)
    for uuid, dev in mon.devices.items():
        d = out.setdefault(uuid, {"tracks": 0, "baselining": 0, "drifting": []})
        d["pooled"] = [{"target": t, "probes": x.members, "ratio": x.ratio or 1.0,
                        "cusum": x.cusum, "threshold": x.h, "since": x.since or 0.0}
                       for t, x in dev.targets.items() if x.drifting]
        rt = dev.targets.get("runtime")
        if rt is not None and rt.peer_ratio is not None:
            d.update(peer_ratio=rt.peer_ratio, peers=rt.peers, slower=rt.slower)
    for (uuid, spec, target), tr in mon.tracks.items():
        d = out.setdefault(uuid, {"tracks": 0, "baselining": 0, "drifting": []})
        d["tracks"] += 1
        if not tr.ready():
            d["baselining"] += 1
        elif tr.drifting:
            ratio = math.exp(tr.prev)  # the latest result, relative to its normal
            d["drifting"].append({"probe": spec.name, "target": target, "ratio": ratio,
                                  "cusum": tr.cusum, "threshold": tr.h,
                                  "since": tr.since or 0.0})
    return out


def add_commands(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    st = sub.add_parser("status", parents=[common], help="what the store holds")
    st.add_argument("--json", action="store_true")
    st.set_defaults(func=cmd_status)
