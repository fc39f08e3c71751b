"""Carrying the model over to a new GPU, and honest intervals in and off the training domain.

On the shared datasets (../shared/data: GPPerf's RTX 4070 CUTLASS/tiled runs, the B200
GEMMs, XLA's table for H100, B200 and MI355X), per GPU:

- **coverage**: the share of measurements inside the nominal interval (model.interval,
  90%), before (the trees' spread and the noise, as gemmd had it) and after (interval
  scale from out-of-bag residuals, widening outside the domain), for predictions on the
  model's own GPU (random and unseen-shape splits), on a GPU left out of training, and on
  a dtype/kernel left out of a GPU's training data;
- **transfer**: for every ordered pair of GPUs (source -> target) and for all other GPUs
  -> target: error and coverage on the target's held-out shapes (whole (M, N, K) held
  out, a quarter of its rows, at most 1,500) with 0, 5, 20, 50 and 200 probes of the
  target (random rows of the rest), for the roofline estimate
  (model.roofline_efficiency), gemmd's forest fitted on the target's probes alone, the
  transfer model's few-probe trees on the probes alone, and the transfer model
  (gemmd.model.TransferModel: the source model carried over by the probes); and the error
  gemmd's forest reaches with all of the target's data but the held-out shapes.

    python bench/transfer.py [--data ../shared/data] [--probes 0,5,20,50,200] [--seeds 2]
                             [--trees 50] [--coverage-only | --transfer-only]
                             [--json out.json] [--markdown]

Targets (issue 14; figures, not assertions), printed per pair as met/missed: (a) at 0
probes never worse than the roofline; (b) with 20 probes within 1.5x of the error with
all of the target's data; (c) other GPUs' data never worse than the target's probes alone
(gemmd's forest on them; stricter: the few-probe trees on them); coverage near 90% in
and off the domain.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

from gemmd import datasets, evaluate, features
from gemmd.config import ModelConfig
from gemmd.features import Table, concat
from gemmd.hardware import gpu_model_key
from gemmd.model import ForestModel, TransferModel, _fit_trees, from_model_space

GPUS = ("rtx4070", "b200", "h100-sxm", "mi355x")
# Rows per GPU (random subsample; GPPerf's tiled rows are always kept): bounds the run
# time on 2 cores. The B200 data has 244k rows, mostly tiny GEMMs.
CAPS = {"rtx4070": 5000, "b200": 8000, "h100-sxm": 5000, "mi355x": 4000}
TEST_SHARE, TEST_MAX = 0.25, 1500


def per_gpu(data: Path, seed: int = 0) -> dict[str, Table]:
    t = concat([datasets.load_shared(n, data).table for n in datasets.SHARED])
    keys = np.array([gpu_model_key(d) for d in t.devices])[t.device]
    rng = np.random.default_rng(seed)
    ok = np.isfinite(t["runtime_s"])
    out = {}
    for g in GPUS:
        idx = np.flatnonzero((keys == g) & ok)
        if len(idx) > CAPS[g]:
            tiled = idx[t["kernel"][idx] == "tiled"]
            rest = np.setdiff1d(idx, tiled)
            idx = np.concatenate([tiled, rng.choice(rest, CAPS[g] - len(tiled), replace=False)])
        out[g] = t.take(np.sort(idx))
    return out


def ape(pred: np.ndarray, y: np.ndarray) -> np.ndarray:
    ok = np.isfinite(pred) & np.isfinite(y)
    return np.abs(pred[ok] - y[ok]) / y[ok]


def scores(res: dict, t: Table, target: str = "runtime") -> dict:
    y = t[{"runtime": "runtime_s", "power": "power_w", "energy": "energy_j"}[target]]
    r = res[target]
    ok = np.isfinite(y)
    a = ape(r["point"][ok], y[ok])
    out = {"n": int(ok.sum()), "mape": float(a.mean()), "median_ape": float(np.median(a))}
    if "lo" in r:
        out["coverage"] = float(np.mean((r["lo"][ok] <= y[ok]) & (y[ok] <= r["hi"][ok])))
        out["in_domain"] = float(np.mean(r["in_domain"][ok])) if "in_domain" in r else 1.0
    return out


def before(model: ForestModel, t: Table) -> dict:
    """gemmd's intervals before this change: the raw forest, sd = sqrt(spread^2 + sigma^2)."""
    out = {}
    for target, (mu, sd) in model.raw_logs(t, scaled=False).items():
        out[target] = {"point": np.exp(mu), "lo": np.exp(mu - model.z * sd),
                       "hi": np.exp(mu + model.z * sd)}
    return out


# ------------------------------------------------------------------ coverage


def coverage(G: dict[str, Table], cfg: ModelConfig) -> list[dict]:
    rows = []

    def add(case: str, gpu: str, model: ForestModel, te: Table) -> None:
        new, old = model.predict_table(te), before(model, te)
        for target in ("runtime", "power"):
            if target not in new or np.isfinite(te[f"{target}_s" if target == "runtime"
                                                   else "power_w"]).sum() < 20:
                continue
            a, b = scores(new, te, target), scores(old, te, target)
            rows.append({"case": case, "gpu": gpu, "target": target, "n": a["n"],
                         "before": b["coverage"], "after": a["coverage"],
                         "mape": a["mape"], "mape_before": b["mape"],
                         "in_domain": a["in_domain"]})
            print(f"  coverage {case:<28} {gpu:<9} {target:<7} before {b['coverage']:.3f} "
                  f"after {a['coverage']:.3f}", file=sys.stderr, flush=True)

    for g, t in G.items():
        for kind in ("random", "shape"):
            tr, te = evaluate.split(t, kind)
            add(f"own GPU, {kind} split", g, ForestModel.fit_table(t.take(tr), cfg), t.take(te))
    for g in G:
        model = ForestModel.fit_table(concat([G[h] for h in G if h != g]), cfg)
        add("GPU left out", g, model, G[g])
    for g, t in G.items():
        pairs = sorted(set(zip(t["dtype"], t["kernel"])))
        for d, k in pairs if len(pairs) > 1 else ():
            sel = (t["dtype"] == d) & (t["kernel"] == k)
            model = ForestModel.fit_table(t.take(np.flatnonzero(~sel)), cfg)
            add(f"{d}/{k} left out", g, model, t.take(np.flatnonzero(sel)))
    return rows


# ------------------------------------------------------------------ transfer


def split_target(t: Table, seed: int = 0) -> tuple[Table, Table]:
    """(pool, test) of one GPU's rows: whole shapes (M, N, K) held out, about TEST_SHARE
    of the rows (at most TEST_MAX). Everything is scored on shapes it never saw: the
    forest on all of the pool ("all target data", the issue's denominator), the forest on
    the probes alone and the transfer (probes are drawn from the pool)."""
    groups = evaluate.shape_groups(t)
    cnt = np.bincount(groups)
    order = np.random.default_rng(seed).permutation(len(cnt))
    want = min(TEST_MAX, int(TEST_SHARE * len(t)))
    take = order[:int(np.searchsorted(np.cumsum(cnt[order]), want)) + 1]
    test = np.isin(groups, take)
    return t.take(np.flatnonzero(~test)), t.take(np.flatnonzero(test))


def few_alone(probes: Table, test: Table, cfg: ModelConfig) -> dict:
    """The transfer model's few-probe trees (gemmd.model._fit_trees) on the probes alone,
    without the other GPUs' data: what of the transfer's gain is the learner's."""
    trees, _ = _fit_trees(probes, cfg, ["runtime"])["runtime"]
    y = trees.predict(features.table_matrix(test).astype(np.float32))
    return {"runtime": {"point": from_model_space("runtime", test, y)}}


def transfer(G: dict[str, Table], cfg: ModelConfig, probes: list[int], seeds: int) -> dict:
    icfg = ModelConfig(**{**cfg.__dict__, "min_samples": 2})
    out: dict = {"full": {}, "roofline": {}, "pairs": []}
    pools, tests = {}, {}
    for g, t in G.items():
        pools[g], tests[g] = split_target(t)
        t0 = time.perf_counter()
        full = ForestModel.fit_table(pools[g], icfg)
        out["full"][g] = {**scores(full.predict_table(tests[g]), tests[g]),
                          "fit_s": time.perf_counter() - t0, "rows": len(pools[g]),
                          "test_rows": len(tests[g])}
        roof = features.roofline(tests[g]) / cfg.roofline_efficiency
        a = ape(roof, tests[g]["runtime_s"])
        out["roofline"][g] = {"mape": float(a.mean()), "median_ape": float(np.median(a))}
    sources = {g: [g] for g in G}
    sources.update({f"others->{g}": [h for h in G if h != g] for g in G})
    own_cache: dict[tuple, tuple[dict, dict]] = {}
    for sname, members in sources.items():
        t0 = time.perf_counter()
        prior = ForestModel.fit_table(concat([G[h] for h in members]), icfg)
        print(f"  prior {'+'.join(members)}: {time.perf_counter() - t0:.1f} s",
              file=sys.stderr, flush=True)
        for g in G:
            if g in members or (sname.startswith("others->") and not sname.endswith(g)):
                continue
            pool, test = pools[g], tests[g]
            for n in probes:
                reps = 1 if n == 0 or n >= len(pool) else seeds
                acc: dict[str, list[dict]] = {"transfer": [], "own": [], "few": []}
                fit_s = []
                for seed in range(reps):
                    rng = np.random.default_rng(1000 + seed)
                    idx = np.sort(rng.choice(len(pool), min(n, len(pool)), replace=False))
                    t1 = time.perf_counter()
                    if n == 0:
                        model = prior
                    else:
                        model = TransferModel.fit(prior, pool.take(idx), icfg)
                    fit_s.append(time.perf_counter() - t1)
                    acc["transfer"].append({**scores(model.predict_table(test), test),
                                            "choice": getattr(model, "choice", {}).get(
                                                "runtime", "prior")})
                    if n >= 5:
                        key = (g, n, seed)
                        if key not in own_cache:
                            own = ForestModel.fit_table(pool.take(idx), icfg)
                            own_cache[key] = (scores(own.predict_table(test), test),
                                              scores(few_alone(pool.take(idx), test, icfg),
                                                     test))
                        acc["own"].append(own_cache[key][0])
                        acc["few"].append(own_cache[key][1])
                rec = {"source": "+".join(members), "target": g, "probes": n, "reps": reps,
                       "fit_s": float(np.mean(fit_s))}
                for name, lst in acc.items():
                    if lst:
                        rec[name] = {k: float(np.mean([x[k] for x in lst]))
                                     for k in ("mape", "median_ape", "coverage") if k in lst[0]}
                rec["choices"] = sorted({x["choice"] for x in acc["transfer"]})
                out["pairs"].append(rec)
                own, few = rec.get("own", {}).get("mape"), rec.get("few", {}).get("mape")
                print(f"  {rec['source']:>24} -> {g:<9} n={n:<4} transfer "
                      f"{rec['transfer']['mape']:.3f} cov {rec['transfer']['coverage']:.2f}"
                      f" own {own if own is None else round(own, 3)}"
                      f" few {few if few is None else round(few, 3)} "
                      f"roof {out['roofline'][g]['mape']:.3f} full {out['full'][g]['mape']:.3f}"
                      f" {rec['choices']} {rec['fit_s']:.1f} s", file=sys.stderr, flush=True)
    return out


# ------------------------------------------------------------------ output


def pct(v) -> str:
    return "-" if v is None or not np.isfinite(v) else f"{100 * v:.1f}%"


def markdown(res: dict) -> str:
    lines = []
    if "coverage" in res:
        lines += ["| case | GPU | target | rows | coverage before | coverage after | "
                  "MAPE | in domain |", "|---|---|---|---|---|---|---|---|"]
        for r in res["coverage"]:
            lines.append(f"| {r['case']} | {r['gpu']} | {r['target']} | {r['n']:,} | "
                         f"{pct(r['before'])} | {pct(r['after'])} | {pct(r['mape'])} | "
                         f"{pct(r['in_domain'])} |")
        lines.append("")
    if "transfer" in res:
        tr = res["transfer"]
        probes = sorted({p["probes"] for p in tr["pairs"]})
        lines += ["Runtime MAPE on the target's held-out shapes: transfer / gemmd's forest on "
                  "the probes alone / the few-probe trees on the probes alone (coverage of "
                  "the transfer model's 90% interval)", ""]
        lines += ["| source -> target | roofline | all target data | " +
                  " | ".join(f"{n} probes" for n in probes) + " |",
                  "|---|---|---|" + "---|" * len(probes)]
        for (src, dst), cells in by_pair(tr).items():
            row = [f"{src} -> {dst}", pct(tr["roofline"][dst]["mape"]),
                   pct(tr["full"][dst]["mape"])]
            for n in probes:
                c = cells.get(n)
                if c is None:
                    row.append("-")
                    continue
                cov = pct(c["transfer"].get("coverage"))
                if "own" in c:
                    row.append(f"{pct(c['transfer']['mape'])} / {pct(c['own']['mape'])} / "
                               f"{pct(c['few']['mape'])} ({cov})")
                else:
                    row.append(f"{pct(c['transfer']['mape'])} ({cov})")
            lines.append("| " + " | ".join(row) + " |")
        lines += ["", targets_table(tr), "", targets_met(tr)]
    return "\n".join(lines)


def by_pair(tr: dict) -> dict[tuple[str, str], dict[int, dict]]:
    out: dict[tuple[str, str], dict[int, dict]] = {}
    for p in tr["pairs"]:
        out.setdefault((p["source"], p["target"]), {})[p["probes"]] = p
    return out


def checks(tr: dict, src: str, dst: str, cells: dict[int, dict]) -> dict:
    """The issue's targets for one pair: (a) at 0 probes not worse than the roofline;
    (b) at 20 probes within 1.5x of the forest on all of the target's data (held-out
    shapes); (c) at every probe count, not worse than gemmd's forest on the target's probes
    alone (and, stricter, than the few-probe trees alone)."""
    out: dict = {}
    roof, full = tr["roofline"][dst]["mape"], tr["full"][dst]["mape"]
    if 0 in cells:
        m = cells[0]["transfer"]["mape"]
        out["a"] = {"met": m <= roof * (1 + 1e-9), "mape": m, "roofline": roof}
    if 20 in cells:
        m = cells[20]["transfer"]["mape"]
        out["b"] = {"met": m <= 1.5 * full, "ratio": m / full, "mape": m, "full": full}
    for key, name in (("c", "own"), ("c_few", "few")):
        worse = [(n, c["transfer"]["mape"], c[name]["mape"]) for n, c in sorted(cells.items())
                 if name in c and c["transfer"]["mape"] > c[name]["mape"] * (1 + 1e-9)]
        out[key] = {"met": not worse, "cases": sum(name in c for c in cells.values()),
                    "worse": worse}
    return out


def targets_table(tr: dict) -> str:
    lines = ["| source -> target | (a) 0 probes vs roofline | (b) 20 probes / all target "
             "data | (c) vs forest on the probes alone | (c, stricter) vs few-probe trees "
             "alone |", "|---|---|---|---|---|"]

    def c_cell(c: dict) -> str:
        if c["met"]:
            return f"met ({c['cases']}/{c['cases']})"
        return (f"missed ({c['cases'] - len(c['worse'])}/{c['cases']}: " + ", ".join(
            f"{n} probes {pct(a)} vs {pct(b)}" for n, a, b in c["worse"]) + ")")

    for (src, dst), cells in by_pair(tr).items():
        ck = checks(tr, src, dst, cells)
        a, b = ck.get("a"), ck.get("b")
        lines.append(" | ".join([
            f"| {src} -> {dst}",
            "-" if a is None else f"{'met' if a['met'] else 'missed'} ({pct(a['mape'])} vs "
                                  f"{pct(a['roofline'])})",
            "-" if b is None else f"{'met' if b['met'] else 'missed'} ({b['ratio']:.2f}x: "
                                  f"{pct(b['mape'])} vs {pct(b['full'])})",
            c_cell(ck["c"]), c_cell(ck["c_few"])]) + " |")
    return "\n".join(lines)


def targets_met(tr: dict) -> str:
    all_ck = [checks(tr, s, d, c) for (s, d), c in by_pair(tr).items()]
    a = [c["a"] for c in all_ck if "a" in c]
    b = [c["b"] for c in all_ck if "b" in c]
    ratios = [x["ratio"] for x in b]
    c_cases = sum(c["c"]["cases"] for c in all_ck)
    c_worse = sum(len(c["c"]["worse"]) for c in all_ck)
    f_cases = sum(c["c_few"]["cases"] for c in all_ck)
    f_worse = sum(len(c["c_few"]["worse"]) for c in all_ck)
    return "\n".join([
        f"- (a) 0 probes, not worse than the roofline: {sum(x['met'] for x in a)}/{len(a)} "
        "pairs",
        f"- (b) 20 probes, within 1.5x of all the target's data (held-out shapes): "
        f"{sum(x['met'] for x in b)}/{len(b)} pairs"
        + (f" ({min(ratios):.2f}-{max(ratios):.2f}x)" if ratios else ""),
        f"- (c) not worse than gemmd's forest on the target's probes alone: "
        f"{c_cases - c_worse}/{c_cases} (pair, probe count) cases",
        f"- (c, stricter) not worse than the few-probe trees on the probes alone: "
        f"{f_cases - f_worse}/{f_cases} cases"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=Path, default=datasets.shared_data_dir())
    ap.add_argument("--probes", default="0,5,20,50,200")
    ap.add_argument("--seeds", type=int, default=2, help="probe draws per count (mean)")
    ap.add_argument("--trees", type=int, default=50, help="trees per forest (default 50)")
    ap.add_argument("--coverage-only", action="store_true")
    ap.add_argument("--transfer-only", action="store_true")
    ap.add_argument("--json", type=Path, help="write all figures here")
    ap.add_argument("--markdown", action="store_true", help="print tables in Markdown")
    args = ap.parse_args()
    if args.data is None or not (args.data / "gpperf").is_dir():
        print("bench/transfer.py: shared datasets not found (../shared/data or --data); "
              "skipped", file=sys.stderr)
        return 0
    cfg = ModelConfig(min_samples=2, n_estimators=args.trees)
    t0, load0 = time.time(), os.getloadavg()[0]
    G = per_gpu(args.data)
    res: dict = {"rows": {g: len(t) for g, t in G.items()}, "trees": args.trees}
    if not args.transfer_only:
        res["coverage"] = coverage(G, cfg)
    if not args.coverage_only:
        res["transfer"] = transfer(G, cfg, [int(x) for x in args.probes.split(",") if x],
                                   args.seeds)
    res["machine"] = {"cpu": platform.processor() or platform.machine(),
                      "cores": os.cpu_count(), "python": platform.python_version(),
                      "load_start": load0, "load_end": os.getloadavg()[0],
                      "seconds": time.time() - t0}
    if args.json:
        args.json.write_text(json.dumps(res, indent=1, default=float))
    print(markdown(res) if args.markdown else json.dumps(res, indent=1, default=float))
    m = res["machine"]
    print(f"\n{m['cores']} cores, load {m['load_start']:.2f} -> {m['load_end']:.2f}, "
          f"{m['seconds']:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
