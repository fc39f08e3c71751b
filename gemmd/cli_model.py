"""Offline model commands: fit, evaluate, predict, advise, import, export, report.

Data comes from files (any format gemmd reads; see docs/model.md) or from the store by
source name (the daemon's probes are source "daemon"; imports are named). Usage errors
exit 2, bad files and other expected failures exit 1, each with one line.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from gemmd.cli import int_range, mnk
from gemmd.errors import GemmdError, InputError
from gemmd.gemm import COLUMN, DTYPES, LAYOUTS

FORMAT_CHOICES = ("auto", "gpperf-cutlass", "gpperf-tiled", "b200", "xla", "csv")


class Progress:
    """A one-line progress bar on stderr, drawn only when stderr is a terminal."""

    def __init__(self, total: int, label: str, stream: Any = None):
        self.total, self.label, self.done = max(total, 1), label, 0
        self.stream = stream or sys.stderr
        self.on = bool(getattr(self.stream, "isatty", lambda: False)())
        self.t0 = time.monotonic()
        self._draw()

    def __call__(self, n: int = 1) -> None:
        self.done = min(self.done + n, self.total)
        self._draw()

    def _draw(self) -> None:
        if not self.on:
            return
        frac = self.done / self.total
        bar = "#" * int(30 * frac) + "." * (30 - int(30 * frac))
        self.stream.write(f"\r{self.label} [{bar}] {self.done}/{self.total} "
                          f"{time.monotonic() - self.t0:.0f}s")
        self.stream.flush()

    def close(self) -> None:
        if self.on:
            self.stream.write("\n")
            self.stream.flush()


# ------------------------------------------------------------------ helpers


def _cfg(args: argparse.Namespace):
    from gemmd.cli import _load_config

    return _load_config(args)


def _store(args: argparse.Namespace, must_exist: bool = True):
    from gemmd.store import Store

    cfg = _cfg(args)
    db = cfg.resolved_state_dir() / "gemmd.db"
    if must_exist and not db.is_file():
        raise GemmdError(f"no store at {db} (import data or run the daemon first; see "
                         "state_dir)")
    if not must_exist:
        from gemmd.runtime import open_state_dir

        return cfg, open_state_dir(cfg)[1]
    return cfg, Store(db)


def _dataset(args: argparse.Namespace):
    """The Dataset named by FILE arguments or --source (store), and the config."""
    from gemmd import datasets
    from gemmd.features import Table

    if args.files and args.source:
        args._parser.error("give input files or --source, not both")
    if args.files:
        return _cfg(args), datasets.load(args.format, args.files, gpu=args.gpu,
                                         catalog=_catalog(args))
    from gemmd.registry import training_data

    sources = args.source or ["daemon"]
    cfg, store = _store(args)
    try:
        rows, infos = training_data(store, sources)
    finally:
        store.close()
    if not rows:
        raise InputError(f"the store holds no usable rows for source {', '.join(sources)} "
                         "(see gemmd status; imports are named with gemmd import --name)")
    return cfg, datasets.Dataset("+".join(sources), Table.from_rows(rows, infos),
                                 [f"store:{s}" for s in sources])


def _catalog(args: argparse.Namespace):
    """The GPU catalogue (gemmd/hardware.py) plus the GPUs of --gpu-spec FILE."""
    from gemmd.hardware import CATALOGUE, SpecError, load_gpu_specs

    cat = getattr(args, "_catalog", None)
    if cat is None:
        specs = []
        for path in getattr(args, "gpu_spec", None) or []:
            try:
                specs += load_gpu_specs(path, CATALOGUE)
            except SpecError as e:
                raise InputError(f"--gpu-spec {e}") from None
        cat = args._catalog = CATALOGUE.with_specs(specs) if specs else CATALOGUE
        args._spec_keys = [x.key for x in specs]
    return cat


def _nonempty(what: str):
    def parse(text: str) -> str:
        if not text.strip():
            raise argparse.ArgumentTypeError(f"{what} must not be empty")
        return text
    parse.__name__ = what
    return parse


def _model_out(text: str) -> Path:
    """--out of fit: a new or regular file in an existing, writable directory (checked
    before a fit of minutes, not after; never a device node such as /dev/full)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("--out must not be empty")
    path = Path(text)
    if path.exists() and not path.is_file():
        raise argparse.ArgumentTypeError(f"--out {text}: exists and is not a regular file")
    parent = path.parent
    if not parent.is_dir():
        raise argparse.ArgumentTypeError(f"--out {text}: {parent} is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"--out {text}: {parent} is not writable")
    return path


def _data_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("files", nargs="*", metavar="FILE", help="measurement files (default: "
                   "the store, see --source)")
    p.add_argument("--format", choices=FORMAT_CHOICES, default="auto",
                   help="format of FILE (default: detected from the header)")
    p.add_argument("--gpu", help="GPU the rows ran on, for files without a GPU column (a "
                   "file that names its GPU and a different --gpu is an error): a catalogue "
                   "key or the name nvidia-smi prints, e.g. a100-sxm-80gb, 'NVIDIA L4'")
    _spec_arg(p)
    p.add_argument("--source", action="append", default=[], metavar="NAME",
                   help="store source to use (repeatable; default: daemon)")
    p.add_argument("--jobs", type=int_range("--jobs", 1, max(1, os.cpu_count() or 1) * 4),
                   default=1, help="CPU cores for fitting (default 1)")


def _spec_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--gpu-spec", action="append", default=[], metavar="FILE",
                   help="YAML/JSON file describing GPUs the catalogue lacks (name, "
                        "peak_tflops per dtype, bandwidth_gbs...; see docs/model.md)")


def _pct(v: float | None) -> str:
    return "-" if v is None or not math.isfinite(v) else f"{100 * v:.2f}%"


def _num(v: float | None, spec: str = ".3f") -> str:
    return "-" if v is None or not math.isfinite(v) else f"{v:{spec}}"


def _print_table(rows: list[tuple[str, ...]]) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())


UNITS = {"runtime": (("s", 1.0), ("ms", 1e-3), ("us", 1e-6), ("ns", 1e-9)),
         "power": (("kW", 1e3), ("W", 1.0), ("mW", 1e-3)),
         "energy": (("J", 1.0), ("mJ", 1e-3), ("uJ", 1e-6), ("nJ", 1e-9))}


def fmt_value(target: str, v: float | None) -> str:
    if v is None or not math.isfinite(v):
        return "-"
    for unit, f in UNITS[target]:
        if abs(v) >= f:
            return f"{v / f:.4g} {unit}"
    unit, f = UNITS[target][-1]
    return f"{v / f:.4g} {unit}"


# ------------------------------------------------------------------ commands


def cmd_fit(args: argparse.Namespace) -> int:
    from gemmd.model import TARGETS, ForestModel

    if args.files and not args.out:
        args._parser.error("fitting on files needs --out FILE (the daemon's registry only "
                           "takes models fitted on the store)")
    cfg, ds = _dataset(args)
    bar = Progress(len(TARGETS), "fitting")
    try:
        model = ForestModel.fit_table(ds.table, cfg.model, progress=bar, n_jobs=args.jobs)
    finally:
        bar.close()
    if args.out:
        try:
            sha = model.save(args.out)
        except OSError as e:
            raise InputError(f"--out {args.out}: cannot write the model: "
                             f"{e.strerror or e}") from e
        where = f"{args.out} (sha256 {sha[:12]})"
    else:
        from gemmd.registry import ModelRegistry

        cfg, store = _store(args)
        try:
            reg = ModelRegistry(store, cfg.resolved_state_dir() / "models", cfg.model)
            version = reg.register(model)
        finally:
            store.close()
        where = f"the store as model rf-{version} (active; a running daemon loads it at its " \
                "next start)"
    print(f"fitted on {len(ds.table):,} rows of {ds.name} in {model.meta['fit_seconds']:.1f} s;"
          f" saved to {where}")
    for target, s in model.meta["scores"].items():
        how = " (power x runtime)" if target in model.meta.get("derived", {}) else ""
        print(f"  {target:<8} out-of-bag MAPE {_pct(s['oob_mape'])}, median "
              f"{_pct(s['oob_median_ape'])}{how}")
    return 0


def cmd_evaluate(args: argparse.Namespace) -> int:
    from gemmd import evaluate

    cfg, ds = _dataset(args)
    splits = evaluate.SPLITS if args.split == "both" else (args.split,)
    baseline = args.baseline == "gpperf"
    bar = Progress(evaluate.work_units(ds.table, splits, baseline), "evaluating")
    try:
        res = evaluate.evaluate(ds.table, splits=splits, baseline=baseline, cfg=cfg.model,
                                n_jobs=args.jobs, progress=bar)
    finally:
        bar.close()
    res = {"dataset": ds.name, "files": ds.paths, "notes": ds.notes, **res}
    if args.json:
        print(json.dumps(res, indent=1, default=_json_default))
        return 0
    print_evaluation(res)
    return 0


def _json_default(v: Any) -> Any:
    if isinstance(v, (np.floating, np.integer)):
        return v.item()
    return str(v)


def print_evaluation(res: dict[str, Any]) -> None:
    meas = ", ".join(f"{t} {n:,}" for t, n in res["measured"].items() if n)
    print(f"dataset {res['dataset']}: {res['rows']:,} rows, {res['shapes']:,} shapes "
          f"(measured: {meas})")
    for note in res.get("notes", []):
        print(f"  note: {note}")
    print("noise floor (repeats of one configuration):")
    for target, nf in res["noise_floor"].items():
        if res["measured"].get(target):
            print(f"  {target:<8} " + ("no configuration measured twice" if nf is None else
                  f"median CV {_pct(nf['median_cv'])}; predicting each repeat by the mean "
                  f"of the others: MAPE {_pct(nf['loo_mape'])}, median "
                  f"{_pct(nf['loo_median_ape'])} ({nf['configs']:,} configurations)"))
    rows = [("SPLIT", "TARGET", "MODEL", "R2", "MAPE", "MEDIAN APE", "P90 APE", "COVERAGE",
             "FIT", "TEST ROWS")]
    for kind, sp in res["splits"].items():
        for target in ("runtime", "power", "energy"):
            for model in ("gemmd", "gpperf"):
                m = sp.get(model, {}).get("targets", {}).get(target)
                if not m or not m.get("n"):
                    continue
                rows.append((kind, target, model, _num(m["r2"]), _pct(m["mape"]),
                             _pct(m["median_ape"]), _pct(m["p90_ape"]),
                             _pct(m.get("coverage")), f"{sp[model]['fit_s']:.1f} s",
                             f"{m['n']:,}"))
    print()
    _print_table(rows)
    print("\nrandom: 80/20 split of rows, seed 42 (as GPPerf); shape: no (M, N, K) in both "
          "train and test. COVERAGE: share of test rows inside gemmd's interval.")


def _load_model(args: argparse.Namespace):
    """(model, version label, store devices) from --model FILE or the store's active one;
    with --calibrate FILE..., that model carried over to the files' device (transfer)."""
    model, version, infos = _load_base_model(args)
    if not getattr(args, "calibrate", None):
        return model, version, infos
    from gemmd import datasets
    from gemmd.model import TransferModel

    ds = datasets.load("auto", args.calibrate, gpu=args.gpu, catalog=_catalog(args))
    cfg = _cfg(args)
    model = TransferModel.fit(model, ds.table, cfg.model)
    args._calibrated = ds.table.devices
    return model, f"{version}+calibrated on {len(ds.table):,} rows", infos


def _load_base_model(args: argparse.Namespace):
    from gemmd.model import ForestModel

    if args.model:
        return ForestModel.load(args.model), str(args.model), []
    cfg, store = _store(args)
    try:
        rec = store.active_model()
        infos = _store_infos(store)
    finally:
        store.close()
    if rec is None:
        raise GemmdError("no fitted model in the store (run gemmd fit, or give --model FILE)")
    return ForestModel.load(rec["path"], rec["meta"].get("sha256")), f"rf-{rec['version']}", \
        infos


def _store_infos(store) -> list:
    from gemmd.registry import device_infos

    return list(device_infos(store).values())


def _device(args: argparse.Namespace, model, store_infos: list):
    from gemmd.datasets import known_gpu, known_gpu_names

    cat = _catalog(args)
    if args.gpu:
        info = known_gpu(args.gpu, cat)
        if info is None:
            args._parser.error(f"unknown GPU {args.gpu!r} (known: {known_gpu_names(cat)}; "
                               "describe another with --gpu-spec FILE)")
        return info
    calibrated = getattr(args, "_calibrated", None)
    if calibrated and len(calibrated) == 1 and not args.device:
        return calibrated[0]
    spec_keys = getattr(args, "_spec_keys", [])
    if len(spec_keys) == 1 and not args.device:
        return cat.info(spec_keys[0])
    trained = model.device_infos()
    if args.device:
        for d in trained + store_infos:
            if d.uuid.startswith(args.device) or str(d.index) == args.device:
                return d
        args._parser.error(f"no device {args.device!r} in the model or the store")
    if len(trained) == 1:
        return trained[0]
    names = ", ".join(f"{d.uuid} ({d.name})" for d in trained)
    args._parser.error(f"the model spans several devices; choose one with --device: {names}")


def _row(args: argparse.Namespace, m: int, n: int, k: int, **over: Any) -> dict[str, Any]:
    row = {"m": m, "n": n, "k": k, "batch": args.batch, "dtype": args.dtype or "fp32",
           "kernel": args.kernel, "tile": args.tile or 0, "layout": args.layout,
           "stages": args.stages or 0, "alpha": args.alpha, "beta": args.beta,
           "out_dtype": args.out_dtype or ""}
    if args.cta:
        row["cta_m"], row["cta_n"], row["cta_k"] = args.cta
    if row["kernel"] == "tiled" and not row["tile"]:
        args._parser.error("--kernel tiled needs --tile")
    row.update(over)
    return row


def cmd_predict(args: argparse.Namespace) -> int:
    from gemmd.features import Table

    model, version, infos = _load_model(args)
    info = _device(args, model, infos)
    row = _row(args, args.m, args.n, args.k)
    t0 = time.perf_counter()
    res = model.predict_table(Table.from_rows([row], [info]))
    dt = time.perf_counter() - t0
    first = next(iter(res.values()))
    out = {"gemm": row, "device": info.name, "model": version,
           "interval": model.meta.get("interval"), "predict_seconds": dt,
           "in_domain": bool(first["in_domain"][0]), "domain": str(first["domain"][0]),
           **{t: {"value": float(r["point"][0]), "lo": float(r["lo"][0]),
                  "hi": float(r["hi"][0])} for t, r in res.items()}}
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    cfg = _describe(row)
    print(f"{args.m}x{args.n}x{args.k} {cfg} on {info.name} (model {version}, "
          f"{100 * model.meta.get('interval', 0.9):.0f}% interval)")
    if not out["in_domain"]:
        print(f"  outside the training data: {out['domain']}; a guess, its interval widened "
              "to say so")
    flops = 2.0 * args.batch * args.m * args.n * args.k
    for t in ("runtime", "power", "energy"):
        if t not in out:
            print(f"  {t:<8} - (the model has no {t} data)")
            continue
        v = out[t]
        extra = f"  ({flops / v['value'] / 1e12:.3g} TFLOP/s)" if t == "runtime" else ""
        print(f"  {t:<8} {fmt_value(t, v['value']):>11}   [{fmt_value(t, v['lo'])}, "
              f"{fmt_value(t, v['hi'])}]{extra}")
    return 0


def _describe(row: dict[str, Any]) -> str:
    parts = [str(row["dtype"]), str(row["kernel"])]
    if row.get("kernel") == "tiled":
        parts.append(f"tile {row['tile']}")
    if row.get("cta_m"):
        parts.append(f"cta {row['cta_m']}x{row['cta_n']}x{row['cta_k']}")
    parts.append(str(row["layout"]))
    if row.get("batch", 1) != 1:
        parts.append(f"batch {row['batch']}")
    return " ".join(parts)


def cmd_advise(args: argparse.Namespace) -> int:
    from gemmd.features import Table

    model, version, infos = _load_model(args)
    info = _device(args, model, infos)
    configs = [c for c in model.meta.get("configs", []) if c["device"] == info.uuid
               and (not args.dtype or c["dtype"] == args.dtype)]
    borrowed = False
    if not configs:  # a GPU the model never saw: the configurations it saw elsewhere
        seen: dict[tuple, dict[str, Any]] = {}
        for c in model.meta.get("configs", []):
            if not args.dtype or c["dtype"] == args.dtype:
                seen.setdefault(tuple(sorted((k, str(v)) for k, v in c.items()
                                             if k != "device")), c)
        configs, borrowed = list(seen.values()), True
    if not configs:
        which = f" for {args.dtype}" if args.dtype else ""
        raise GemmdError(f"the model knows no configuration{which} on {info.name}")
    rows = []
    for c in configs:
        r = {k: v for k, v in c.items() if k != "device"}
        rows.append({**r, "m": args.m, "n": args.n, "k": args.k, "batch": args.batch})
    res = model.predict_table(Table.from_rows(rows, [info] * len(rows)))
    rt = res["runtime"]["point"]
    dom = res["runtime"]["in_domain"]
    reason = next((str(r) for r, d in zip(res["runtime"]["domain"], dom) if not d), "")
    en = res["energy"]["point"] if "energy" in res else np.full(len(rows), np.nan)
    pw = res["power"]["point"] if "power" in res else np.full(len(rows), np.nan)
    fastest = int(np.argmin(rt))
    frugal = int(np.nanargmin(en)) if np.isfinite(en).any() else None
    ranked = sorted(range(len(rows)), key=lambda i: rt[i])
    if args.json:
        print(json.dumps({"gemm": [args.m, args.n, args.k], "device": info.name,
                          "model": version, "in_domain": bool(dom.all()),
                          "domain": reason, "configurations_from_other_gpus": borrowed,
                          "fastest": _advice(rows[fastest], rt, pw, en, fastest),
                          "most_energy_efficient": None if frugal is None else
                          _advice(rows[frugal], rt, pw, en, frugal),
                          "configurations": [_advice(rows[i], rt, pw, en, i) for i in ranked]},
                         indent=1))
        return 0
    print(f"{args.m}x{args.n}x{args.k} on {info.name}: {len(rows)} known configurations "
          f"(model {version})")
    if borrowed:
        print("  the model has no data on this GPU: configurations seen on other GPUs")
    if not dom.all():
        print(f"  outside the training data: {reason}; the ranking is a guess")
    print(f"  fastest:                {_describe(rows[fastest])}: "
          f"{fmt_value('runtime', rt[fastest])}, {fmt_value('energy', en[fastest])}")
    if frugal is not None:
        print(f"  most energy-efficient:  {_describe(rows[frugal])}: "
              f"{fmt_value('runtime', rt[frugal])}, {fmt_value('energy', en[frugal])}")
    else:
        print("  most energy-efficient:  - (the model has no energy data)")
    table = [("CONFIGURATION", "RUNTIME", "POWER", "ENERGY")]
    for i in ranked[:args.top]:
        table.append((_describe(rows[i]), fmt_value("runtime", rt[i]),
                      fmt_value("power", pw[i]), fmt_value("energy", en[i])))
    print()
    _print_table(table)
    return 0


def _advice(row: dict[str, Any], rt, pw, en, i: int) -> dict[str, Any]:
    def f(x: float) -> float | None:
        return float(x) if math.isfinite(x) else None

    return {"config": {k: v for k, v in row.items() if k not in ("m", "n", "k")},
            "runtime_s": f(rt[i]), "power_w": f(pw[i]), "energy_j": f(en[i])}


def cmd_import(args: argparse.Namespace) -> int:
    from gemmd import datasets, importer

    name = importer.check_source_name(args.name) if args.name is not None else None
    ds = datasets.load(args.format, args.files, gpu=args.gpu, catalog=_catalog(args))
    source = name or ds.name.replace("+", "_")
    _, store = _store(args, must_exist=False)
    try:
        n = importer.import_dataset(store, ds, source)
    finally:
        store.close()
    meas = ", ".join(f"{t} {int(np.isfinite(ds.table[c]).sum()):,}" for t, c in COLUMN.items()
                     if np.isfinite(ds.table[c]).any())
    gpus = ", ".join(d.name for d in ds.table.devices)
    print(f"imported {n:,} rows ({meas}) on {gpus} as source {source!r}")
    print(f"  kept apart from the daemon's probes; use them with --source {source}")
    for note in ds.notes:
        print(f"  note: {note}")
    return 0


# Columns of `gemmd export`, in order: gemmd's generic CSV (docs/model.md), so that
# `gemmd import` reads an export back, plus where each row came from.
EXPORT_COLUMNS = ("host", "source", "kind", "timestamp", "device_uuid", "gpu", "gpu_key",
                  "m", "n", "k", "batch", "dtype", "kernel", "tile", "layout", "cta_m",
                  "cta_n", "cta_k", "stages", "alpha", "beta", "out_dtype", "runtime_s",
                  "power_w", "energy_j")
EXPORT_DEVICE = (*(f"peak_{d}_tflops" for d in DTYPES), "mem_bandwidth_gbs", "sm_count",
                 "power_limit_w")


def export_rows(store, sources: list[str] | None, include_flagged: bool = False,
                host: str | None = None):
    """(header, rows) of ``gemmd export``: every stored result of ``sources`` (all when
    None) with its device's identity and figures, oldest first."""
    import socket

    from gemmd.hardware import gpu_model_key
    from gemmd.registry import device_infos

    infos = device_infos(store)
    host = host or socket.gethostname()
    header = (*EXPORT_COLUMNS, *EXPORT_DEVICE)
    dev_cols: dict[str, list[Any]] = {}
    for uuid, d in infos.items():
        dev_cols[uuid] = [_g(d.peak_flops.get(x), 1e-12) for x in DTYPES] + [
            _g(d.mem_bandwidth or None, 1e-9), d.sm_count or "",
            _g(d.power_limit_w)]
    out = []
    for r in reversed(store.probes(sources=sources, include_flagged=include_flagged)):
        d = infos.get(r["device_uuid"])
        rec = {**r, "host": host, "timestamp": _g(r["ts"]), "gpu": r.get("device_name") or
               (d.name if d else ""), "gpu_key": gpu_model_key(d) if d else ""}
        row = []
        for c in EXPORT_COLUMNS:
            v = rec.get(c)
            row.append("" if v is None else _g(v) if isinstance(v, float) else v)
        out.append(row + dev_cols.get(r["device_uuid"], [""] * len(EXPORT_DEVICE)))
    return header, out


def _g(v: Any, factor: float = 1.0) -> Any:
    """A number as exactly as it was stored (repr), '' for None/NaN."""
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return ""
    x = float(v) * factor
    if factor != 1.0:
        x = float(f"{x:.12g}")  # 2039e9 B/s -> 2039 GB/s, not 2039.0000000000002
    return int(x) if x.is_integer() and abs(x) < 2**53 else repr(x)


def cmd_export(args: argparse.Namespace) -> int:
    import csv

    sources = None if args.all_sources else (args.source or ["daemon"])
    _, store = _store(args)
    try:
        header, rows = export_rows(store, sources, args.include_flagged)
    finally:
        store.close()
    if not rows:
        which = "any source" if sources is None else f"source {', '.join(sources)}"
        raise InputError(f"the store holds no results of {which} (see gemmd status)")
    out = str(args.out)
    if out.endswith(".parquet"):
        try:
            import pyarrow as pa
            import pyarrow.parquet as pq
        except ImportError:
            raise InputError("--out *.parquet needs pyarrow (pip install pyarrow); "
                             "write a .csv instead") from None
        cols = {h: [r[i] if r[i] != "" else None for r in rows] for i, h in enumerate(header)}
        pq.write_table(pa.table({h: [None if v is None else str(v) for v in vals]
                                 for h, vals in cols.items()}), out)
    elif out == "-":
        w = csv.writer(sys.stdout, lineterminator="\n")
        w.writerow(header)
        w.writerows(rows)
        return 0
    else:
        try:
            with open(out, "w", newline="", encoding="utf-8") as f:
                w = csv.writer(f, lineterminator="\n")
                w.writerow(header)
                w.writerows(rows)
        except OSError as e:
            raise InputError(f"--out {out}: cannot write: {e.strerror or e}") from e
    print(f"exported {len(rows):,} rows to {out}", file=sys.stderr)
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from gemmd import report

    cfg, ds = _dataset(args)
    bar = Progress(report.work_units(), "report")
    try:
        path = report.write(ds, Path(args.out), cfg=cfg.model, split=args.split,
                            n_jobs=args.jobs, progress=bar)
    finally:
        bar.close()
    print(f"wrote {path}")
    return 0


# ------------------------------------------------------------------ parser


_cta = mnk("cta", "128x128x32")
_dim = int_range("dimension", 1, 1 << 24)


def _gemm_args(p: argparse.ArgumentParser, dtype_required: bool) -> None:
    p.add_argument("m", type=_dim)
    p.add_argument("n", type=_dim)
    p.add_argument("k", type=_dim)
    p.add_argument("--dtype", choices=DTYPES, required=dtype_required)
    p.add_argument("--batch", type=_dim, default=1)
    p.add_argument("--model", type=Path, help="model file (default: the store's active model)")
    p.add_argument("--gpu", help="a GPU of the catalogue (gemmd/hardware.py: V100 to B300, "
                                 "RTX 4070/4090/6000 Ada, MI300X/MI355X; key or nvidia-smi "
                                 "name) or of --gpu-spec")
    _spec_arg(p)
    p.add_argument("--calibrate", action="append", default=[], metavar="FILE",
                   help="measurements of the device (any format gemmd reads): carry the "
                        "model over to it, a device-wide then per dtype/kernel correction "
                        "(repeatable)")
    p.add_argument("--device", type=_nonempty("--device"),
                   help="a device of the model or the store (uuid prefix or index)")
    p.add_argument("--json", action="store_true")


def add_commands(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    """Register the model's subcommands on the main parser."""
    f = sub.add_parser("fit", parents=[common], help="fit the model on files or the store")
    _data_args(f)
    f.add_argument("--out", type=_model_out, help="write the model to this file (default: "
                                                  "register it in the store)")
    f.set_defaults(func=cmd_fit, _parser=f)

    e = sub.add_parser("evaluate", parents=[common],
                       help="gemmd vs GPPerf's pipeline on the same splits")
    _data_args(e)
    e.add_argument("--baseline", choices=("gpperf", "none"), default="gpperf")
    e.add_argument("--split", choices=("random", "shape", "both"), default="both")
    e.add_argument("--json", action="store_true", help="machine-readable output")
    e.set_defaults(func=cmd_evaluate, _parser=e)

    p = sub.add_parser("predict", parents=[common], help="runtime, power, energy of one GEMM")
    _gemm_args(p, dtype_required=True)
    p.add_argument("--kernel", choices=("blas", "tiled", "cutlass"), default="blas")
    p.add_argument("--tile", type=int_range("tile", 1, 32),
                   help="tile edge of the tiled kernel")
    p.add_argument("--cta", type=_cta, help="CUTLASS CTA tile MxNxK")
    p.add_argument("--stages", type=int)
    p.add_argument("--layout", choices=LAYOUTS, default="nn")
    p.add_argument("--alpha", type=float, default=1.0)
    p.add_argument("--beta", type=float, default=0.0)
    p.add_argument("--out-dtype", choices=DTYPES)
    p.set_defaults(func=cmd_predict, _parser=p)

    a = sub.add_parser("advise", parents=[common],
                       help="fastest and most energy-efficient known configuration")
    _gemm_args(a, dtype_required=False)
    a.add_argument("--top", type=int, default=10, help="configurations listed (default 10)")
    a.set_defaults(func=cmd_advise, _parser=a)

    i = sub.add_parser("import", parents=[common], help="bring measurements into the store")
    i.add_argument("files", nargs="+", metavar="FILE")
    i.add_argument("--format", choices=FORMAT_CHOICES, default="auto")
    i.add_argument("--name", help="source name (default: the format's name)")
    i.add_argument("--gpu", help="GPU of the rows when the file has no GPU column (a file "
                   "that names its GPU and a different --gpu is an error)")
    _spec_arg(i)
    i.set_defaults(func=cmd_import, _parser=i)

    x = sub.add_parser("export", parents=[common],
                       help="stored results with their device, as CSV for another host")
    x.add_argument("--source", action="append", default=[], metavar="NAME",
                   help="store source to export (repeatable; default: daemon)")
    x.add_argument("--all-sources", action="store_true", help="every source")
    x.add_argument("--include-flagged", action="store_true",
                   help="also results taken while a device was flagged as drifting")
    x.add_argument("--out", default="-", help="output file (default: stdout); *.parquet "
                                              "writes Parquet if pyarrow is installed")
    x.set_defaults(func=cmd_export, _parser=x)

    r = sub.add_parser("report", parents=[common],
                       help="HTML report: predicted vs measured, error by size and config")
    _data_args(r)
    r.add_argument("--out", default="gemmd-report", help="output folder (default "
                                                         "gemmd-report)")
    r.add_argument("--split", choices=("random", "shape"), default="shape")
    r.set_defaults(func=cmd_report, _parser=r)

