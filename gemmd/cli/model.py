"""The model's commands: ``gemmd fit`` and ``gemmd evaluate`` (``gemmd predict`` and
``gemmd advise`` are predict.py's).

Data comes from files (any format gemmd reads; see docs/model.md) or from the store by
source name (the daemon's probes are source "daemon"; imports are named).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from gemmd.cli.args import UsageError, data_options, int_range, model_out, path_arg
from gemmd.cli.context import gpu_catalog, load_config, load_dataset, open_store, store_path
from gemmd.cli.output import Progress, json_text, num, pct, print_table
from gemmd.errors import InputError
from gemmd.files import file_identity
from gemmd.store import SIDECARS

# ------------------------------------------------------------------ fit, evaluate


def cmd_fit(args: argparse.Namespace) -> int:
    from gemmd.model import TARGETS, ForestModel

    if args.files and not args.out:
        raise UsageError("fitting on files needs --out FILE (the daemon's registry only "
                         "takes models fitted on the store)")
    cfg = load_config(args)
    if args.out:
        _not_an_input(Path(args.out), args, cfg)
    ds = load_dataset(args, cfg)
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

        store = open_store(cfg)
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
        print(f"  {target:<8} out-of-bag MAPE {pct(s['oob_mape'])}, median "
              f"{pct(s['oob_median_ape'])}{how}")
    return 0


def _not_an_input(out: Path, args: argparse.Namespace, cfg: Any) -> None:
    """Refuse an --out that would overwrite what gemmd reads: a measurement file, a
    --gpu-spec file, the configuration, the store (its database and journal files) or
    the model registry's directory (the active model's file, whose checksum the registry
    keeps: overwritten, the daemon would fall back to the roofline)."""
    def same(a: Path, b: Path) -> bool:
        return (ident := file_identity(a)) is not None and ident == file_identity(b)

    inputs = [(f, "one of the measurement files") for f in args.files] + \
        [(f, "a --gpu-spec file") for f in args.gpu_spec] + \
        ([(args.config, "the configuration")] if args.config else [])
    try:  # (a file fit needs no state directory: one that cannot be resolved is no input)
        state: Path | None = cfg.resolved_state_dir()
    except (RuntimeError, KeyError, OSError):
        state = None
    if state is not None:
        db = store_path(cfg)
        inputs += [(f, f"the store ({db})") for f in (
            db, *(db.with_name(db.name + s) for s in SIDECARS))]
    for f, what in inputs:
        if same(out, Path(f)):
            raise UsageError(f"--out {out}: that is {what}; the model would overwrite it")
    models = state / "models" if state is not None else None
    if models is not None and models.is_dir() and out.resolve().parent == models.resolve():
        raise UsageError(f"--out {out}: that is in the model registry ({models}), which "
                         "gemmd fit without --out writes to; choose another place")


def cmd_evaluate(args: argparse.Namespace) -> int:
    from gemmd import evaluate

    if args.model:
        return _evaluate_model(args)
    for opt, given in (("--calibrate", args.calibrate), ("--calibrate-rows",
                                                        args.calibrate_rows),
                       ("--seeds", args.seeds is not None)):
        if given:
            raise UsageError(f"{opt} judges a fitted model: give --model FILE")
    cfg = load_config(args)
    ds = load_dataset(args, cfg)
    split = args.split or "both"
    splits = evaluate.SPLITS if split == "both" else (split,)
    baseline = (args.baseline or "gpperf") == "gpperf"
    bar = Progress(evaluate.work_units(ds.table, splits, baseline), "evaluating")
    try:
        res = evaluate.evaluate(ds.table, splits=splits, baseline=baseline, cfg=cfg.model,
                                n_jobs=args.jobs, progress=bar)
    finally:
        bar.close()
    res = {"dataset": ds.name, "files": ds.paths, "notes": ds.notes, **res}
    if args.json:
        print(json_text(res))
        return 0
    print_evaluation(res)
    return 0


def _judgeable(model: Any, t: Any, name: str, cal: Any) -> None:
    """Refuse what evaluate --model could only answer with an empty table or a
    calibration that changes nothing: data that measure none of the model's targets, and
    --calibrate probes of devices (uuid or GPU model) none of the data's."""
    import numpy as np

    from gemmd.gemm import COLUMN, TARGETS
    from gemmd.hardware import gpu_model_key

    predicted = [tg for tg in TARGETS if tg in model.forests or
                 tg in model.meta.get("derived", {})]
    if not any(np.isfinite(t[COLUMN[tg]]).any() for tg in predicted):
        measured = [tg for tg in TARGETS if np.isfinite(t[COLUMN[tg]]).any()]
        raise InputError(f"{name}: the data measure {', '.join(measured) or 'nothing'}, the "
                         f"model predicts {', '.join(predicted)}: nothing to judge")
    if cal is None:
        return

    def ids(table: Any) -> set[str]:
        return {d.uuid for d in table.devices} | {gpu_model_key(d) for d in table.devices}

    def names(table: Any) -> str:  # (with the key: two GPUs of one name may differ)
        return ", ".join(sorted({f"{d.name} [{gpu_model_key(d)}]" for d in table.devices}))

    if not ids(cal) & ids(t):
        raise InputError(f"--calibrate: its devices ({names(cal)}) are none of the data's "
                         f"({names(t)}): a calibration carries the model over to the device "
                         "it measured")


def _evaluate_model(args: argparse.Namespace) -> int:
    """gemmd evaluate --model FILE [--calibrate FILE | --calibrate-rows N [--seeds S]]:
    a fitted model judged on the data as it is, carried over by a device's probes, or
    by N rows of the data itself (by shape, the other shapes judged), without a refit."""
    from gemmd import datasets, evaluate
    from gemmd.model import ForestModel

    if args.split or args.baseline:
        raise UsageError("--split and --baseline refit on the data; --model judges the "
                         "fitted model as it is (drop one)")
    if args.calibrate and args.calibrate_rows:
        raise UsageError("give --calibrate FILE or --calibrate-rows N, not both")
    if args.seeds is not None and not args.calibrate_rows:
        raise UsageError("--seeds is the number of draws of --calibrate-rows")
    from gemmd.modelfile import check_archive

    cfg = load_config(args)
    check_archive(args.model)  # before anything is inflated (as predict does)
    model = ForestModel.load(args.model)
    ds = load_dataset(args, cfg)
    cal = None
    if args.calibrate:
        cal = datasets.load("auto", args.calibrate, gpu=args.gpu,
                            catalog=gpu_catalog(args.gpu_spec)[0]).table
    _judgeable(model, ds.table, ", ".join(map(str, ds.paths)) or ds.name, cal)
    seeds = args.seeds or 1
    bar = Progress(1 + (cal is not None) + len(args.calibrate_rows) * seeds, "evaluating")
    try:
        res = evaluate.evaluate_model(model, ds.table, cfg=cfg.model, calibrate=cal,
                                      calibrate_rows=args.calibrate_rows, seeds=seeds,
                                      progress=bar)
    finally:
        bar.close()
    res = {"dataset": ds.name, "files": ds.paths, "notes": ds.notes,
           "model_file": str(args.model), **res}
    if args.json:
        print(json_text(res))
        return 0
    print_model_evaluation(res)
    return 0


def print_model_evaluation(res: dict[str, Any]) -> None:
    meas = ", ".join(f"{t} {n:,}" for t, n in res["measured"].items() if n)
    print(f"model {res['model_file']} ({res['model']}) on {res['dataset']}: {res['rows']:,} "
          f"rows, {res['shapes']:,} shapes (measured: {meas})")
    for note in res.get("notes", []):
        print(f"  note: {note}")
    rows = [("CALIBRATION", "TARGET", "R2", "MAPE", "MEDIAN APE", "P90 APE", "COVERAGE",
             "IN DOMAIN", "TEST ROWS")]
    for name, sp in res["splits"].items():
        for target in ("runtime", "power", "energy"):
            m = sp["gemmd"]["targets"].get(target)
            if not m or not m.get("n"):
                continue
            sd = sp["gemmd"].get("spread", {}).get(target, {})
            rows.append(("none" if name == "model" else name, target, num(m.get("r2")),
                         _pct_sd(m, sd, "mape"), pct(m["median_ape"]), pct(m["p90_ape"]),
                         _pct_sd(m, sd, "coverage"), pct(m.get("in_domain")),
                         f"{m['n']:,.0f}"))
    print()
    print_table(rows)
    print(f"\nnone: the model as it is on every row. N rows: carried over by N rows of the "
          f"data (one per shape, drawn at random), judged on the other shapes, the mean of "
          f"{res['seeds']} draw{'s' if res['seeds'] > 1 else ''}"
          f"{' (± their standard deviation)' if res['seeds'] > 1 else ''}. COVERAGE: share of rows "
          "inside the interval; IN DOMAIN: share the model says it has data like.")


def _pct_sd(m: dict[str, Any], sd: dict[str, float], key: str) -> str:
    """``m[key]`` as a percentage, with ``sd[key]`` (over draws) where there is one."""
    return pct(m.get(key)) + (f" ±{100 * sd[key]:.1f}" if key in sd else "")


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
                  f"median CV {pct(nf['median_cv'])}; predicting each repeat by the mean "
                  f"of the others: MAPE {pct(nf['loo_mape'])}, median "
                  f"{pct(nf['loo_median_ape'])} ({nf['configs']:,} configurations)"))
    rows = [("SPLIT", "TARGET", "MODEL", "R2", "MAPE", "MEDIAN APE", "P90 APE", "COVERAGE",
             "FIT", "TEST ROWS")]
    for kind, sp in res["splits"].items():
        for target in ("runtime", "power", "energy"):
            for model in ("gemmd", "gpperf"):
                m = sp.get(model, {}).get("targets", {}).get(target)
                if not m or not m.get("n"):
                    continue
                rows.append((kind, target, model, num(m["r2"]), pct(m["mape"]),
                             pct(m["median_ape"]), pct(m["p90_ape"]),
                             pct(m.get("coverage")), f"{sp[model]['fit_s']:.1f} s",
                             f"{m['n']:,}"))
    print()
    print_table(rows)
    print("\nrandom: 80/20 split of rows, seed 42 (as GPPerf); shape: no (M, N, K) in both "
          "train and test. COVERAGE: share of test rows inside gemmd's interval.")


# ------------------------------------------------------------------ parser


def _counts(text: str) -> list[int]:
    """N[,N...]: row counts, each 0..1,000,000; an empty item is refused (a typo of
    "5,20" as "5,,20" or "5," says less than was meant)."""
    parse = int_range("--calibrate-rows", 0, 1_000_000)
    items = [x.strip() for x in text.split(",")]
    if not text.strip():
        raise argparse.ArgumentTypeError("--calibrate-rows: give a number of rows")
    if "" in items:
        raise argparse.ArgumentTypeError(f"--calibrate-rows {text!r}: an empty item; "
                                         "give counts separated by single commas")
    return [parse(x) for x in items]


def add_commands(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    f = sub.add_parser("fit", parents=[common], help="fit the model on files or the store")
    data_options(f)
    f.add_argument("--out", type=model_out, help="write the model to this file (default: "
                                                 "register it in the store)")
    f.set_defaults(func=cmd_fit)

    e = sub.add_parser("evaluate", parents=[common],
                       help="gemmd vs GPPerf's pipeline on the same splits, or a fitted "
                            "model (--model) on data")
    data_options(e)
    e.add_argument("--baseline", choices=("gpperf", "none"),
                   help="GPPerf's pipeline beside gemmd's (default gpperf)")
    e.add_argument("--split", choices=("random", "shape", "both"),
                   help="how to split the data for the refits (default both)")
    e.add_argument("--model", type=path_arg("--model"),
                   help="judge this fitted model on the data, no refit")
    e.add_argument("--calibrate", action="append", default=[], metavar="FILE",
                   type=path_arg("--calibrate"),
                   help="with --model: carry it over to the device of these measurements "
                        "first (repeatable)")
    e.add_argument("--calibrate-rows", type=_counts, default=[], metavar="N[,N...]",
                   help="with --model: carry it over by N rows of the data (one per shape, "
                        "drawn at random), judge it on the other shapes")
    e.add_argument("--seeds", type=int_range("--seeds", 1, 1000),
                   help="draws of --calibrate-rows to average (default 1)")
    e.add_argument("--json", action="store_true", help="machine-readable output")
    e.set_defaults(func=cmd_evaluate)
