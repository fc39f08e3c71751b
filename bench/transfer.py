"""Carrying the model over to a new GPU, and honest intervals in and off the training domain.

On the shared datasets (../shared/data: GPPerf's RTX 4070 CUTLASS/tiled runs, the B200
GEMMs, XLA's table for H100, B200 and MI355X), per GPU:

- **coverage**: the share of measurements inside the nominal interval (model.interval,
  90%), before (the trees' spread and the noise, as gemmd had it) and after (interval
  scale from out-of-bag residuals, widening outside the domain), for predictions on the
  model's own GPU (random and unseen-shape splits), on a GPU left out of training, and on
  a dtype/kernel left out of a GPU's training data;
- **transfer**: for every ordered pair of GPUs (source -> target) and for all other GPUs
  -> target: error and coverage on the target's held-out rows with 0, 5, 20, 50 and 200
  probes of the target (random rows of its data), for the roofline estimate
  (model.roofline_efficiency), a forest fitted on the target's probes alone, and the
  transfer model (gemmd.model.TransferModel: the source model calibrated by the probes);
  and the error a forest reaches with all of the target's data.

    python bench/transfer.py [--data ../shared/data] [--probes 0,5,20,50,200] [--seeds 2]
                             [--trees 50] [--coverage-only | --transfer-only]
                             [--json out.json] [--markdown]

Targets (figures, not assertions): at 0 probes never worse than the roofline; with 20
probes within 1.5x of the error with all of the target's data; other GPUs' data never
worse than the target's probes alone; coverage near 90% in and off the domain.
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
from gemmd.model import ForestModel, TransferModel

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
    rng = np.random.default_rng(seed)
    n_test = min(TEST_MAX, int(TEST_SHARE * len(t)))
    perm = rng.permutation(len(t))
    return t.take(np.sort(perm[n_test:])), t.take(np.sort(perm[:n_test]))


def transfer(G: dict[str, Table], cfg: ModelConfig, probes: list[int], seeds: int) -> dict:
    icfg = ModelConfig(**{**cfg.__dict__, "min_samples": 2})
    out: dict = {"full": {}, "roofline": {}, "pairs": []}
    pools, tests = {}, {}
    for g, t in G.items():
        pools[g], tests[g] = split_target(t)
        t0 = time.perf_counter()
        full = ForestModel.fit_table(pools[g], icfg)
        out["full"][g] = {**scores(full.predict_table(tests[g]), tests[g]),
                          "fit_s": time.perf_counter() - t0, "rows": len(pools[g])}
        roof = features.roofline(tests[g]) / cfg.roofline_efficiency
        a = ape(roof, tests[g]["runtime_s"])
        out["roofline"][g] = {"mape": float(a.mean()), "median_ape": float(np.median(a))}
    sources = {g: [g] for g in G}
    sources.update({f"others->{g}": [h for h in G if h != g] for g in G})
    own_cache: dict[tuple, dict] = {}
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
                acc: dict[str, list[dict]] = {"transfer": [], "own": []}
                for seed in range(reps):
                    rng = np.random.default_rng(1000 + seed)
                    idx = np.sort(rng.choice(len(pool), min(n, len(pool)), replace=False))
                    if n == 0:
                        model = prior
                    else:
                        model = TransferModel.fit(prior, pool.take(idx), icfg)
                    acc["transfer"].append({**scores(model.predict_table(test), test),
                                            "choice": getattr(model, "choice", {}).get(
                                                "runtime", "prior")})
                    if n >= 5:
                        key = (g, n, seed)
                        if key not in own_cache:
                            own = ForestModel.fit_table(pool.take(idx), icfg)
                            own_cache[key] = scores(own.predict_table(test), test)
                        acc["own"].append(own_cache[key])
                rec = {"source": "+".join(members), "target": g, "probes": n, "reps": reps}
                for name, lst in acc.items():
                    if lst:
                        rec[name] = {k: float(np.mean([x[k] for x in lst]))
                                     for k in ("mape", "median_ape", "coverage") if k in lst[0]}
                rec["choices"] = sorted({x["choice"] for x in acc["transfer"]})
                out["pairs"].append(rec)
                own = rec.get("own", {}).get("mape")
                print(f"  {rec['source']:>24} -> {g:<9} n={n:<4} transfer "
                      f"{rec['transfer']['mape']:.3f} cov {rec['transfer']['coverage']:.2f}"
                      f" own {own if own is None else round(own, 3)} "
                      f"roof {out['roofline'][g]['mape']:.3f} full {out['full'][g]['mape']:.3f}"
                      f" {rec['choices']}", file=sys.stderr, flush=True)
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
        lines += ["Runtime MAPE on the target's held-out rows: transfer / target's probes "
                  "alone (coverage of the transfer model's 90% interval)", ""]
        lines += ["| source -> target | roofline | all target data | " +
                  " | ".join(f"{n} probes" for n in probes) + " |",
                  "|---|---|---|" + "---|" * len(probes)]
        by = {}
        for p in tr["pairs"]:
            by.setdefault((p["source"], p["target"]), {})[p["probes"]] = p
        for (src, dst), cells in by.items():
            row = [f"{src} -> {dst}", pct(tr["roofline"][dst]["mape"]),
                   pct(tr["full"][dst]["mape"])]
            for n in probes:
                c = cells.get(n)
                if c is None:
                    row.append("-")
                    continue
                own = c.get("own", {}).get("mape")
                row.append(f"{pct(c['transfer']['mape'])} / {pct(own)} "
                           f"({pct(c['transfer'].get('coverage'))})" if own is not None else
                           f"{pct(c['transfer']['mape'])} ({pct(c['transfer'].get('coverage'))})")
            lines.append("| " + " | ".join(row) + " |")
        lines.append("")
        lines.append(targets_met(tr))
    return "\n".join(lines)


def targets_met(tr: dict) -> str:
    bad0, bad20, worse = [], [], []
    for p in tr["pairs"]:
        name = f"{p['source']}->{p['target']}"
        m = p["transfer"]["mape"]
        if p["probes"] == 0 and m > tr["roofline"][p["target"]]["mape"] * (1 + 1e-9):
            bad0.append(name)
        if p["probes"] == 20 and m > 1.5 * tr["full"][p["target"]]["mape"]:
            bad20.append(f"{name} ({pct(m)} vs 1.5 x {pct(tr['full'][p['target']]['mape'])})")
        if "own" in p and m > p["own"]["mape"]:
            worse.append(f"{name} at {p['probes']} ({pct(m)} vs {pct(p['own']['mape'])})")
    n0 = sum(p["probes"] == 0 for p in tr["pairs"])
    n20 = sum(p["probes"] == 20 for p in tr["pairs"])
    nown = sum("own" in p for p in tr["pairs"])
    return "\n".join([
        f"- 0 probes, not worse than the roofline: {n0 - len(bad0)}/{n0}"
        + (f" (missed: {', '.join(bad0)})" if bad0 else ""),
        f"- 20 probes, within 1.5x of all the target's data: {n20 - len(bad20)}/{n20}"
        + (f" (missed: {'; '.join(bad20)})" if bad20 else ""),
        f"- other GPUs' data not worse than the probes alone: {nown - len(worse)}/{nown}"
        + (f" (missed: {'; '.join(worse)})" if worse else "")])


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
