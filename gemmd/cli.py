"""Command line: ``gemmd run | probe | status | check-config``.

Every expected failure (bad config, bad argument, missing device, unreadable store) ends in
one line per problem on stderr and a non-zero exit status, never a traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import math
import os
import signal
import sqlite3
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gemmd import __version__
from gemmd.config import Config, ProbeGroup, budget_warnings, check, load
from gemmd.errors import ConfigError, GemmdError, InputError
from gemmd.gemm import DTYPES, KERNELS, LAYOUTS

logger = logging.getLogger("gemmd")

EXIT_CONFIG = 2  # configuration or usage error
EXIT_RUNTIME = 1  # a device, store or listen failure


def _default_config() -> str | None:
    """$GEMMD_CONFIG, else /etc/gemmd/gemmd.yaml if present, else built-in defaults."""
    env = os.environ.get("GEMMD_CONFIG")
    if env:
        return env
    return "/etc/gemmd/gemmd.yaml" if Path("/etc/gemmd/gemmd.yaml").is_file() else None


def setup_logging(level: str) -> None:
    # Under systemd, journald stamps time and priority itself.
    fmt = "%(levelname)s %(name)s: %(message)s" if os.environ.get("JOURNAL_STREAM") else \
        "%(asctime)s %(levelname)s %(name)s: %(message)s"
    logging.basicConfig(level=getattr(logging, level.upper()), format=fmt, stream=sys.stderr,
                        force=True)
    logging.getLogger("apscheduler").setLevel(logging.WARNING)


def _load_config(args: argparse.Namespace) -> Config:
    cfg = load(args.config)
    over: dict[str, Any] = {}
    if getattr(args, "state_dir", None):
        over["state_dir"] = str(args.state_dir)
    if getattr(args, "backend", None):
        over["backend"] = args.backend
    if over:
        cfg = _checked(dataclasses.replace(cfg, **over), over)
    return cfg


def _existing_store(cfg: Config) -> tuple[Path, Any]:
    """The store of the configured state directory, which a daemon must have made."""
    from gemmd.store import Store

    db = cfg.resolved_state_dir() / "gemmd.db"
    if not db.is_file():
        raise GemmdError(f"no store at {db} (has gemmd run there? see state_dir, "
                         "--state-dir)")
    return db, Store(db)


def _checked(cfg: Config, options: dict[str, Any]) -> Config:
    """A config changed by command-line options, checked by the rules of a file."""
    return check(cfg, "command line (" + ", ".join(
        f"{k}={v}" for k, v in options.items()) + ")")


# ------------------------------------------------------------------ commands


def cmd_check_config(args: argparse.Namespace) -> int:
    path = args.file if args.file is not None else args.config  # '' is a (bad) file name
    cfg = load(path)
    for w in budget_warnings(cfg):
        print(f"gemmd: warning: {w}", file=sys.stderr)
    print(f"{path or '<built-in defaults>'}: OK")
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    cfg = _load_config(args)  # before importing the daemon: a bad file is one line
    if args.port is not None:
        cfg = _checked(dataclasses.replace(cfg, listen=dataclasses.replace(
            cfg.listen, port=args.port)), {"--port": args.port})
    if args.web_config_file is not None:
        cfg = _checked(dataclasses.replace(cfg, listen=dataclasses.replace(
            cfg.listen, web_config_file=args.web_config_file)),
            {"--web.config.file": args.web_config_file})
    setup_logging(args.log_level or cfg.log_level)
    from gemmd.daemon import Daemon

    daemon = Daemon(cfg)
    signal.signal(signal.SIGTERM, lambda s, f: daemon.request_stop(s))
    signal.signal(signal.SIGINT, lambda s, f: daemon.request_stop(s))
    try:
        daemon.start()
        daemon.run_forever()
    finally:
        clean = daemon.stop()
    if not clean or [t for t in threading.enumerate()
                     if t is not threading.main_thread() and not t.daemon and t.is_alive()]:
        # A hung probe thread would keep the interpreter alive forever; the store is
        # consistent (each result is its own transaction), so leave without waiting.
        logging.shutdown()
        os._exit(0)
    return 0


def _probe_overrides(args: argparse.Namespace, cfg: Config) -> Config:
    if not any([args.shape, args.dtype, args.kernel, args.tile, args.layout]):
        return cfg
    base = cfg.probes.sentinels[0] if cfg.probes.sentinels else ProbeGroup()
    group = ProbeGroup(shapes=tuple(args.shape) or base.shapes,
                       dtypes=tuple(args.dtype) or base.dtypes,
                       kernels=tuple(args.kernel) or base.kernels,
                       tiles=tuple(args.tile) or base.tiles,
                       layouts=tuple(args.layout) or base.layouts)
    probes = dataclasses.replace(cfg.probes, sentinels=(group,), exploration=())
    return dataclasses.replace(cfg, probes=probes)


def cmd_probe(args: argparse.Namespace) -> int:
    from gemmd import runtime
    from gemmd.rounds import device_label

    cfg = _probe_overrides(args, _load_config(args))
    if args.window is not None:
        measure = dataclasses.replace(cfg.probes.measure, window_s=args.window)
        cfg = _checked(dataclasses.replace(cfg, probes=dataclasses.replace(
            cfg.probes, measure=measure)), {"--window": args.window})
    cfg = dataclasses.replace(cfg, schedule=dataclasses.replace(cfg.schedule,
                                                                skip_when_busy=not args.force))
    setup_logging(args.log_level or cfg.log_level)
    with contextlib.ExitStack() as stack:
        state_dir = None
        if args.no_store:
            state_dir = Path(stack.enter_context(
                tempfile.TemporaryDirectory(prefix="gemmd-probe-")))
        # One round runs every planned probe: the duty-cycle budget is for the daemon.
        rt = runtime.build(cfg, state_dir=state_dir, budget_s=math.inf)
        stack.callback(rt.store.close)
        stack.callback(rt.close_devices)
        registry = rt.registry
        registry.load_active()
        # Devices are probed at the same time, each result shown as it comes (stderr:
        # stdout holds the table, CSV or JSON at the end).
        results: dict[str, list] = {r.device.info.uuid: [] for r in rt.runners}
        lock = threading.Lock()

        def progress(runner, r) -> None:
            m = r.measurement
            what = f"{_fmt_time(m.runtime_s)}, {m.tflops:.3g} TFLOP/s" if m else r.error
            with lock:
                print(f"{runner.label}: {r.spec.name}: {r.outcome}" + (f" ({what})" if what
                                                                       else ""),
                      file=sys.stderr, flush=True)

        def round_of(runner) -> None:
            runner.on_result = lambda r: progress(runner, r)
            results[runner.device.info.uuid] = runner.run_round()

        threads = [threading.Thread(target=round_of, args=(r,), name=f"probe-{r.label}")
                   for r in rt.runners]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        rows: list[dict[str, Any]] = []
        skipped: dict[str, int] = {}
        for runner in rt.runners:
            d = runner.device
            rows += [_result_row(d, r) for r in results[d.info.uuid]]
            for reason, n in rt.state.devices[d.info.uuid].skipped_total.items():
                if n and reason not in ("duty_cycle",):
                    skipped[reason] = skipped.get(reason, 0) + n
                    print(f"{device_label(d.info)}: {n} probe(s) skipped: {reason}",
                          file=sys.stderr)
    if not rows:
        busy = sorted(set(skipped) - {"unsupported", "device_down"})
        hint = f" (busy: {', '.join(busy)}; --force probes a busy device anyway)" \
            if busy else ""
        print(f"gemmd: no probe ran{hint}", file=sys.stderr)
        return EXIT_RUNTIME
    _print_rows(rows, args.format, registry.current.version)
    failed = [r for r in rows if r["outcome"] in ("failed", "mismatch")]
    return EXIT_RUNTIME if failed else 0


RESULT_COLUMNS = (
    "gpu", "gpu_model", "kind", "m", "n", "k", "dtype", "kernel", "tile", "layout", "probe",
    "outcome", "error", "iterations", "window_s", "runtime_s", "runtime_cv", "tflops",
    "power_w", "energy_j", "power_sample_w", "check_ok", "check_error", "sm_clock_hz",
    "temperature_c", "clock_event_reasons", "pred_runtime_s", "pred_runtime_lo",
    "pred_runtime_hi", "pred_power_w", "pred_energy_j")


def _result_row(d, r) -> dict[str, Any]:
    m, p = r.measurement, r.prediction
    row: dict[str, Any] = dict.fromkeys(RESULT_COLUMNS)
    row |= {"gpu": d.info.index, "gpu_model": d.info.name, "kind": r.kind,
            **dataclasses.asdict(r.spec), "probe": r.spec.name, "outcome": r.outcome,
            "error": r.error}
    if m is not None:
        row.update(iterations=m.iterations, window_s=m.window_s, runtime_s=m.runtime_s,
                   runtime_cv=m.runtime_cv, tflops=m.tflops, power_w=m.power_w,
                   energy_j=m.energy_j, power_sample_w=m.power_sample_w,
                   check_ok=m.check_ok, check_error=m.check_error,
                   sm_clock_hz=(m.context.get("after") or {}).get("sm_clock_hz"),
                   temperature_c=(m.context.get("after") or {}).get("temperature_c"),
                   clock_event_reasons="|".join(
                       (m.context.get("after") or {}).get("clock_event_reasons", [])))
    if p is not None:
        row.update(pred_runtime_s=p.runtime_s, pred_runtime_lo=p.runtime_lo,
                   pred_runtime_hi=p.runtime_hi, pred_power_w=p.power_w,
                   pred_energy_j=p.energy_j)
    return row


def _fmt_time(s: float | None) -> str:
    if s is None:
        return "-"
    for unit, f in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if s >= f:
            return f"{s / f:.3g} {unit}"
    return f"{s / 1e-9:.3g} ns"


def _fmt(v: float | None, spec: str = ".3g", unit: str = "") -> str:
    return "-" if v is None else f"{v:{spec}}{unit}"


def _print_rows(rows: list[dict[str, Any]], fmt: str, model_version: str) -> None:
    if fmt == "json":
        print(json.dumps(rows, indent=1, default=str))
        return
    if fmt == "csv":
        import csv

        w = csv.DictWriter(sys.stdout, fieldnames=RESULT_COLUMNS, lineterminator="\n")
        w.writeheader()
        w.writerows(rows)
        return
    head = ("GPU", "PROBE", "KIND", "ITERS", "RUNTIME", "PREDICTED", "RATIO", "TFLOP/S",
            "POWER", "ENERGY", "OUTCOME")
    table = [head]
    for r in rows:
        rt, pr = r.get("runtime_s"), r.get("pred_runtime_s")
        table.append((
            str(r["gpu"]), r["probe"], r["kind"][:4], _fmt(r.get("iterations"), "d"),
            _fmt_time(rt), _fmt_time(pr), _fmt(rt / pr if rt and pr else None, ".3f"),
            _fmt(r.get("tflops"), ".3g"), _fmt(r.get("power_w"), ".1f", " W"),
            _fmt(r.get("energy_j"), ".3g", " J"),
            r["outcome"] + (f": {r['error']}" if r["error"] else "")))
    widths = [max(len(row[i]) for row in table) for i in range(len(head))]
    for row in table:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
    print(f"predictions: {model_version}")


def cmd_status(args: argparse.Namespace) -> int:
    from gemmd.features import spec_of

    cfg = _load_config(args)
    db, store = _existing_store(cfg)
    try:
        devices, counts, latest = store.devices(), store.counts(), store.latest_per_probe()
        model, models, sources = store.active_model(), store.models(), store.sources()
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
                          "models": len(models), "drift": drift}, indent=1, default=str))
        return 0
    now = time.time()
    print(f"store: {db}")
    if not sources:
        print("  no probe results yet")
    for src in sources:
        kind = "probes" if src["source"] == "daemon" else "imported"
        print(f"  {src['source']:<16} {src['rows']:>9,} rows ({kind}) on {src['devices']} "
              f"device(s), last {_stamp(src['last'])} ({_age(now - src['last'])} ago); "
              f"kept: {src['retention']}")
    for d in devices:
        # Imported measurements have a reference device, not a GPU index of this host.
        label = ("CPU" if d["backend"] == "cpu" else f"GPU {d['idx']}") \
            if d["idx"] is not None else "reference"
        # Its newest stored result (the device record itself is refreshed only at start).
        seen = max([c["last"] for c in counts if c["device_uuid"] == d["uuid"]]
                   + [d["last_seen"] or 0])
        print(f"\n{label}  {d['name']}  ({d['backend']}, {d['uuid']})  "
              f"last probe {_age(now - seen)} ago")
        dr = drift.get(d["uuid"])
        if dr:
            for a in dr.get("pooled", []):
                print(f"  drift: {a['target']} in alarm over its {a['probes']} probes pooled, "
                      f"x{a['ratio']:.3f} of normal since {_age(now - a['since'])}")
            if dr.get("peer_ratio"):
                print(f"  peers: normal runtime x{dr['peer_ratio']:.3f} of the median of its "
                      f"{dr['peers']} same-model siblings"
                      + (" (slower than its peers)" if dr.get("slower") else ""))
            alarms = "; ".join(f"{a['probe']} {a['target']} x{a['ratio']:.3f} of normal "
                               f"since {_age(now - a['since'])}" for a in dr["drifting"])
            print(f"  drift: {len(dr['drifting'])} of {dr['tracks']} tracks in alarm"
                  + (f": {alarms}" if alarms else "")
                  + (f"; {dr['baselining']} still taking their baseline"
                     if dr["baselining"] else ""))
        for c in (c for c in counts if c["device_uuid"] == d["uuid"]):
            print(f"  {c['source']:>8} {c['outcome']:<9} {c['n']:>7} probes, last "
                  f"{_age(now - c['last'])} ago")
        rows = [r for r in latest if r["device_uuid"] == d["uuid"]]
        if rows:
            print(f"  {'PROBE':<34} {'AGE':>6} {'RUNTIME':>10} {'PREDICTED':>10} {'RATIO':>6} "
                  f"{'POWER':>8} {'OUTCOME'}")
        for r in rows:
            rt, pr = r["runtime_s"], r["pred_runtime_s"]
            name = spec_of(r).name
            print(f"  {name:<34} {_age(now - r['ts']):>6} {_fmt_time(rt):>10} "
                  f"{_fmt_time(pr):>10} {_fmt(rt / pr if rt and pr else None, '.3f'):>6} "
                  f"{_fmt(r['power_w'], '.1f', ' W'):>8} {r['outcome']}")
    if model:
        scores = model["meta"].get("scores", {})
        err = ", ".join(f"{t} {100 * s['oob_mape']:.1f}%" for t, s in scores.items())
        print(f"\nmodel: rf-{model['version']} fitted {_age(now - model['created'])} ago on "
              f"{model['n_samples']} probes; out-of-bag MAPE: {err}; {len(models)} kept")
    else:
        print("\nmodel: none fitted yet (predictions come from the roofline estimate)")
    return 0


def _drift_summary(cfg: Config, state_dir: Path) -> dict[str, dict[str, Any]]:
    """Per device, from the daemon's saved drift state: tracks, those in alarm (probe,
    target, measured/normal ratio, since when) and those still taking their baseline."""
    import math

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


def cmd_rebaseline(args: argparse.Namespace) -> int:
    """Accept the current behaviour of devices as their new normal."""
    from gemmd import rebaseline

    cfg = _load_config(args)
    db, store = _existing_store(cfg)
    state_dir = db.parent
    try:
        known = store.devices()
        uuids: list[str] | None = None
        if args.device:
            uuids = []
            for sel in args.device:
                hit = [d["uuid"] for d in known if d["uuid"] == sel or str(d["idx"]) == sel]
                if not hit:
                    have = ", ".join(f"{d['idx']}={d['uuid']}" for d in known) or "none"
                    raise InputError(f"--device {sel}: no such device in {db} (known: {have})")
                uuids.extend(h for h in hit if h not in uuids)
        n = rebaseline.request(state_dir, store, uuids)
    finally:
        store.close()
    who = ", ".join(uuids) if uuids else "all devices"
    print(f"rebaseline {who}: {n} stored result(s) taken while drifting now count for "
          "training; a running daemon resets its drift references within 5 s (otherwise at "
          "its next start)")
    return 0


def _stamp(ts: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(ts))


def cmd_prune(args: argparse.Namespace) -> int:
    """Delete stored results of one source, on request (the daemon prunes only its own)."""

    if not (args.all or args.older_than is not None or args.max_rows is not None):
        args._parser.error("say what to delete: --older-than DAYS, --max-rows N or --all")
    if args.all and (args.older_than is not None or args.max_rows is not None):
        args._parser.error("--all deletes every row of the source: give it alone")
    if args.older_than is not None and not args.older_than >= 0:
        args._parser.error(f"--older-than {args.older_than:g}: must be 0 or more days")
    cfg = _load_config(args)
    db, store = _existing_store(cfg)
    try:
        known = {s["source"]: s["rows"] for s in store.sources()}
        if args.source not in known:
            have = ", ".join(f"{k} ({v:,} rows)" for k, v in known.items()) or "none"
            raise InputError(f"--source {args.source}: no such source in {db} (sources: "
                             f"{have})")
        if args.all:
            n = store.delete_source(args.source)
        else:
            n = store.prune(args.older_than, args.max_rows, sources=(args.source,))
    finally:
        store.close()
    print(f"deleted {n:,} of {known[args.source]:,} rows of source {args.source!r}")
    return 0


def _age(s: float) -> str:
    for unit, f in (("d", 86400), ("h", 3600), ("m", 60)):
        if s >= f:
            return f"{s / f:.0f}{unit}"
    return f"{max(s, 0):.0f}s"


# ------------------------------------------------------------------ parser


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2 (argparse's default prints usage too)
        self.exit(EXIT_CONFIG, f"gemmd: error: {message} (see gemmd {self.prog.split()[-1]} "
                               f"--help)\n" if " " in self.prog else f"gemmd: error: {message}\n")


def mnk(what: str, example: str, hi: int = 1 << 20):
    """An argparse type: "MxNxK", each a whole number in 1..hi, naming ``what``."""

    def parse(text: str) -> tuple[int, int, int]:
        try:
            m, n, k = (int(x) for x in text.lower().split("x"))
        except ValueError:
            raise argparse.ArgumentTypeError(f"{what} {text!r} is not MxNxK, e.g. {example}"
                                             ) from None
        if min(m, n, k) < 1 or max(m, n, k) > hi:
            raise argparse.ArgumentTypeError(f"{what} {text!r}: each dimension must be 1..{hi}")
        return m, n, k

    parse.__name__ = what
    return parse


_shape = mnk("shape", "1024x1024x1024")


def int_range(what: str, lo: int, hi: int):
    """An argparse type: an integer in [lo, hi], with a message naming ``what``."""

    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{what} {text!r} is not an integer") from None
        if not lo <= v <= hi:
            raise argparse.ArgumentTypeError(f"{what} {v} is outside {lo}..{hi}")
        return v

    parse.__name__ = what  # argparse names the type in its own messages
    return parse


_tile = int_range("tile", 1, 32)


def _common_options(parser: argparse.ArgumentParser, *, defaults: bool) -> None:
    def default(v: Any) -> Any:
        return v if defaults else argparse.SUPPRESS
    parser.add_argument("-c", "--config", default=default(_default_config()),
                        help="configuration file (default: $GEMMD_CONFIG, "
                             "/etc/gemmd/gemmd.yaml, else built-in defaults)")
    parser.add_argument("--state-dir", type=Path, default=default(None),
                        help="override state_dir")
    parser.add_argument("--log-level", choices=("debug", "info", "warning", "error"),
                        default=default(None))


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="gemmd", description="GEMM probes on every GPU, measured vs predicted, "
                                          "as Prometheus metrics.")
    p.add_argument("--version", action="version", version=f"gemmd {__version__}")
    # The common options work before the command (gemmd --state-dir X status) and after it
    # (gemmd status --state-dir X); after it wins. The copy on each command has no default,
    # so that not repeating an option there keeps what was given before the command.
    _common_options(p, defaults=True)
    common = argparse.ArgumentParser(add_help=False)
    _common_options(common, defaults=False)
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

    r = sub.add_parser("run", parents=[common], help="run the daemon")
    r.add_argument("--port", type=int, help="override listen.port (0: any free port)")
    r.add_argument("--web.config.file", dest="web_config_file", metavar="FILE",
                   help="TLS and basic auth: an exporter-toolkit web configuration file "
                        "(overrides listen.web_config_file)")
    r.add_argument("--backend", choices=("auto", "nvidia", "cpu", "fake"))
    r.set_defaults(func=cmd_run)

    pr = sub.add_parser("probe", parents=[common], help="run one probe round, print a table")
    pr.add_argument("--backend", choices=("auto", "nvidia", "cpu", "fake"))
    pr.add_argument("--shape", type=_shape, action="append", default=[],
                    help="MxNxK (repeatable); replaces the configured sentinels")
    pr.add_argument("--dtype", choices=DTYPES, action="append", default=[])
    pr.add_argument("--kernel", choices=KERNELS, action="append", default=[])
    pr.add_argument("--tile", type=_tile, action="append", default=[])
    pr.add_argument("--layout", choices=LAYOUTS, action="append", default=[])
    pr.add_argument("--window", type=float, help="override probes.measure.window_s")
    pr.add_argument("--force", action="store_true", help="probe even if the device is busy")
    pr.add_argument("--no-store", action="store_true", help="don't record results")
    pr.add_argument("--format", choices=("table", "csv", "json"), default="table")
    pr.set_defaults(func=cmd_probe)

    st = sub.add_parser("status", parents=[common], help="what the store holds")
    st.add_argument("--json", action="store_true")
    st.set_defaults(func=cmd_status)

    cc = sub.add_parser("check-config", parents=[common], help="validate a configuration")
    cc.add_argument("file", nargs="?", help="file to check (default: --config)")
    cc.set_defaults(func=cmd_check_config)

    rb = sub.add_parser("rebaseline", parents=[common],
                        help="accept devices' current behaviour as their new normal")
    rb.add_argument("--device", action="append", default=[],
                    help="index or UUID (repeatable; default: every device)")
    rb.set_defaults(func=cmd_rebaseline)

    pn = sub.add_parser("prune", parents=[common],
                        help="delete stored results of one source (e.g. an import)")
    pn.add_argument("--source", required=True, metavar="NAME",
                    help="the source: an import's name, or daemon (see gemmd status)")
    pn.add_argument("--older-than", type=float, metavar="DAYS",
                    help="delete its results older than this many days")
    pn.add_argument("--max-rows", type=int_range("--max-rows", 0, 1 << 40), metavar="N",
                    help="keep only its newest N results")
    pn.add_argument("--all", action="store_true", help="delete every result of the source")
    pn.set_defaults(func=cmd_prune, _parser=pn)

    # The model's offline commands (fit, evaluate, predict, advise, import, report).
    from gemmd import cli_model

    cli_model.add_commands(sub, common)
    return p


def _one_line(text: str) -> str:
    """Escape line breaks and other control characters: one problem, one line."""
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode() for c in text)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ConfigError as e:
        for problem in e.problems:
            print(f"gemmd: config error: {e.source}: {_one_line(problem)}", file=sys.stderr)
        return EXIT_CONFIG
    except GemmdError as e:
        print(f"gemmd: error: {_one_line(str(e))}", file=sys.stderr)
        return EXIT_RUNTIME
    except sqlite3.Error as e:  # a store error that escaped translation: still one line
        print(f"gemmd: error: store: {_one_line(str(e))}", file=sys.stderr)
        return EXIT_RUNTIME
    except KeyboardInterrupt:
        return 130
