"""gemmd's model vs GPPerf's published pipeline on the shared datasets, in one run.

For each dataset (GPPerf CUTLASS runtime/power, GPPerf tiled, B200 runtime/power/energy,
XLA runtime): both models on the same random 80/20 split (seed 42) and the same split by
shape; on the smaller datasets also 5-fold cross-validation grouped by shape (every shape
held out once: steadier than one 80/20 draw of a few dozen shapes). Noise floor of each
dataset. Fit time of gemmd on 100,000 B200 rows (1 and 2 jobs) and single-prediction
latency on the daemon's path.

    python bench/model.py [--data ../shared/data] [--datasets gpperf-cutlass,xla]
                          [--json out.json] [--markdown]

Targets (figures, not assertions): CUTLASS runtime MAPE <= 3% random, <= 10% by shape;
B200 power median APE <= 2%; 100k-row fit <= 30 s on 2 cores; one prediction <= 1 ms.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from gemmd import datasets, evaluate
from gemmd.config import ModelConfig
from gemmd.gemm import COLUMN, TARGETS, ProbeSpec
from gemmd.model import ForestModel

ALL = ("gpperf-cutlass", "gpperf-tiled", "b200", "xla")
CV_MAX_ROWS = 50_000  # grouped 5-fold CV only where it is cheap
CFG = ModelConfig(min_samples=2)  # gemmd's defaults otherwise (gemmd.yaml's model section)


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def grouped_cv(t, folds: int = 5) -> dict:
    """Per model and target: MAPE / median APE over all rows, each predicted by a model
    that never saw its shape (GroupKFold over (M, N, K))."""
    from sklearn.model_selection import GroupKFold

    groups = evaluate.shape_groups(t)
    preds = {"gemmd": {}, "gpperf": {}}
    for train, test in GroupKFold(folds).split(np.zeros(len(t)), groups=groups):
        for model in (evaluate.GemmdModel(CFG), evaluate.GPPerfBaseline()):
            model.fit(t.take(train))
            for target, res in model.predict_table(t.take(test)).items():
                p = preds[model.name].setdefault(target, np.full(len(t), np.nan))
                p[test] = res["point"]
    return {name: {tg: evaluate.metrics(t[COLUMN[tg]], p) for tg, p in d.items()}
            for name, d in preds.items()}


def timer_floor(t) -> float | None:
    """Mean APE that whole-microsecond timing alone causes (B200 data): E|U(-.5,.5)| / t."""
    us = t["runtime_s"] * 1e6
    ok = np.isfinite(us)
    return float(np.mean(0.25 / us[ok])) if ok.any() else None


def fit_time(data: Path, rows: int = 100_000) -> dict:
    t = datasets.load_shared("b200", data).table
    sub = t.take(np.random.default_rng(0).choice(len(t), rows, replace=False))
    out = {}
    for jobs in (1, 2):
        t0 = time.perf_counter()
        ForestModel.fit_table(sub, CFG, n_jobs=jobs)
        out[f"jobs{jobs}"] = time.perf_counter() - t0
    return out


def latency(data: Path) -> dict:
    """Single prediction on the daemon's path (ProbeSpec -> Prediction with intervals)."""
    ds = datasets.load_shared("gpperf-cutlass", data)
    model = ForestModel.fit_table(ds.table, CFG)
    info = ds.table.devices[0]
    spec = [ProbeSpec(1024, 1024, 1024, "fp32")]
    for _ in range(20):
        model.predict(spec, [info])
    times = []
    for _ in range(500):
        t0 = time.perf_counter()
        model.predict(spec, [info])
        times.append(time.perf_counter() - t0)
    specs = [ProbeSpec(256 * (1 + i % 16), 1024, 512, "fp32") for i in range(1000)]
    t0 = time.perf_counter()
    model.predict(specs, [info] * len(specs))
    batch = time.perf_counter() - t0
    return {"single_median_s": statistics.median(times),
            "single_p99_s": float(np.percentile(times, 99)), "batch1000_s": batch,
            "forests": sorted(model.forests), "trees": CFG.n_estimators}


def run(names: list[str], data: Path) -> dict:
    res: dict = {"datasets": {}}
    for name in names:
        t0 = time.perf_counter()
        ds = datasets.load_shared(name, data)
        r = evaluate.evaluate(ds.table, cfg=CFG)
        r["notes"] = ds.notes
        if name == "b200":
            r["timer_floor_mape"] = timer_floor(ds.table)
        if len(ds.table) <= CV_MAX_ROWS:
            r["shape_cv5"] = grouped_cv(ds.table)
        r["seconds"] = time.perf_counter() - t0
        res["datasets"][name] = r
        print(f"{name}: done in {r['seconds']:.0f} s", file=sys.stderr, flush=True)
    res["fit_100k"] = fit_time(data)
    print("fit time: done", file=sys.stderr, flush=True)
    res["latency"] = latency(data)
    return res


def pct(v) -> str:
    return "-" if v is None or not np.isfinite(v) else f"{100 * v:.1f}%"


def markdown(res: dict) -> str:
    lines = ["| dataset | target | split | gemmd MAPE | gemmd median APE | gemmd R² | "
             "gemmd coverage (90%) | GPPerf MAPE | GPPerf median APE | GPPerf R² | test rows |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in res["datasets"].items():
        for target in TARGETS:
            for kind, sp in r["splits"].items():
                g = sp["gemmd"]["targets"].get(target)
                b = sp["gpperf"]["targets"].get(target)
                if not g or not g.get("n"):
                    continue
                lines.append(f"| {name} | {target} | {kind} | {pct(g['mape'])} | "
                             f"{pct(g['median_ape'])} | {g['r2']:.3f} | {pct(g['coverage'])} | "
                             f"{pct(b['mape'])} | {pct(b['median_ape'])} | {b['r2']:.3f} | "
                             f"{g['n']:,} |")
            cv = r.get("shape_cv5")
            if cv and target in cv["gemmd"] and cv["gemmd"][target].get("n"):
                g, b = cv["gemmd"][target], cv["gpperf"][target]
                lines.append(f"| {name} | {target} | shape, 5-fold CV | {pct(g['mape'])} | "
                             f"{pct(g['median_ape'])} | {g['r2']:.3f} | - | {pct(b['mape'])} | "
                             f"{pct(b['median_ape'])} | {b['r2']:.3f} | {g['n']:,} |")
    lines += ["", "| dataset | target | noise floor: median CV of repeats | "
              "mean of the others predicts a repeat: MAPE / median APE | configurations |",
              "|---|---|---|---|---|"]
    for name, r in res["datasets"].items():
        for target, nf in r["noise_floor"].items():
            if not r["measured"].get(target):
                continue
            if nf is None:
                extra = ""
                if name == "b200" and target == "runtime":
                    extra = (f"; whole-microsecond timing alone: MAPE "
                             f"{pct(r['timer_floor_mape'])}")
                lines.append(f"| {name} | {target} | no repeated configuration{extra} | - | - |")
            else:
                lines.append(f"| {name} | {target} | {pct(nf['median_cv'])} | "
                             f"{pct(nf['loo_mape'])} / {pct(nf['loo_median_ape'])} | "
                             f"{nf['configs']:,} |")
    lines += ["", "| fit and prediction | value |", "|---|---|"]
    for name, r in res["datasets"].items():
        for kind, sp in r["splits"].items():
            lines.append(f"| fit {name} ({kind} split, {sp['train_rows']:,} rows): gemmd / "
                         f"GPPerf | {sp['gemmd']['fit_s']:.1f} s / {sp['gpperf']['fit_s']:.1f} s |")
    f = res["fit_100k"]
    lines.append(f"| gemmd fit, 100,000 B200 rows (runtime + power forests, energy derived), "
                 f"1 job / 2 jobs | {f['jobs1']:.1f} s / {f['jobs2']:.1f} s |")
    lt = res["latency"]
    lines.append(f"| one prediction with intervals (daemon path), median / p99 | "
                 f"{lt['single_median_s'] * 1e3:.2f} ms / {lt['single_p99_s'] * 1e3:.2f} ms |")
    lines.append(f"| 1,000 predictions in one call | {lt['batch1000_s'] * 1e3:.0f} ms |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=Path, default=datasets.shared_data_dir())
    ap.add_argument("--datasets", default=",".join(ALL))
    ap.add_argument("--json", type=Path, help="write all figures here")
    ap.add_argument("--markdown", action="store_true", help="print tables in Markdown")
    args = ap.parse_args()
    if args.data is None or not (args.data / "gpperf").is_dir():
        print("bench/model.py: shared datasets not found (../shared/data or --data); skipped",
              file=sys.stderr)
        return 0
    load0 = os.getloadavg()[0]
    t0 = time.time()
    res = run([n for n in args.datasets.split(",") if n], args.data)
    res["machine"] = {"cpu": cpu_model(), "cores": os.cpu_count(),
                      "python": platform.python_version(), "load_start": load0,
                      "load_end": os.getloadavg()[0], "seconds": time.time() - t0}
    if args.json:
        args.json.write_text(json.dumps(res, indent=1, default=float))
    print(markdown(res) if args.markdown else json.dumps(res, indent=1, default=float))
    m = res["machine"]
    print(f"\n{m['cpu']}, {m['cores']} cores, load {m['load_start']:.2f} -> "
          f"{m['load_end']:.2f}, {m['seconds']:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
