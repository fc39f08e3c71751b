"""Carrying the model over to a new GPU, and honest intervals in and off the training domain.

On the shared datasets (../shared/data: GPPerf's RTX 4070 CUTLASS/tiled runs, the B200
GEMMs, XLA's table for H100, B200 and MI355X), per GPU:

- **coverage**: the share of measurements inside the nominal interval (model.interval,
  90%), before (the trees' spread and the noise, as gemmd had it) and after (interval
  scale from out-of-bag residuals, widening outside the domain), for predictions on the
  model's own GPU (random and unseen-shape splits), on a GPU left out of training, on
  a dtype/kernel left out of a GPU's training data, on sizes beyond the training's
  (the largest ~15% of M, N or K held out, at a distinct size) and on shapes aligned
  below it (a GPU's rows aligned below 16 bytes left out of a prior of all; ``--align``
  alone: with the upward spread they need, domain.OOD_SD's "align");
- **transfer** (leave one GPU out): a prior fitted on the other GPUs (``--pairs``: also
  on each other GPU alone), saved, loaded and judged on the left-out GPU by the code of
  ``gemmd evaluate --model FILE --calibrate-rows N --seeds S`` (evaluate.evaluate_model):
  as it is (0 rows) and carried over by 5, 20, 50, 200 rows of the GPU (one per shape,
  drawn at random; the other shapes judged), the mean of S draws: runtime MAPE, coverage
  of the 90% interval, share in domain, and the share of predictions below the roofline
  at the catalogued peaks (none allowed); beside it the roofline estimate
  (model.roofline_efficiency) and gemmd's forest on the GPU's own data, unseen shapes;
  ``--holdout FILE``: also a GPU outside the shared data (e.g. bench/gpu_sweep.sh's
  sweep.csv), judged from the prior of all four; a file of a shared GPU model (gemmd's
  own probes of an H100) also from the prior of the other three.

    python bench/transfer.py [--data ../shared/data] [--probes 0,5,20,50,200] [--seeds 3]
                             [--trees 50] [--pairs] [--caps rtx4070=2000,...]
                             [--coverage-only | --transfer-only | --defaults | --align]
                             [--holdout FILE... [--holdout-only] [--holdout-per-dtype]]
                             [--json out.json]
                             [--markdown]

Targets (issue 25; figures, not assertions): no prediction faster than physics;
uncalibrated transfer no worse than the roofline on every left-out GPU; with 20 rows
<= 10% where the GPU's own data give <= 5%; 5 rows never worse than 0; coverage 85-95%
at every row count.
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

from gemmd import bounds, datasets, evaluate, features
from gemmd.config import ModelConfig
from gemmd.errors import GemmdError, InputError
from gemmd.features import Table, concat
from gemmd.model import ForestModel
from gemmd.model.domain import align_share
from gemmd.model.intervals import conformal_quantile
from gemmd.model.offsets import unaligned as unaligned_rows
from gemmd.model.validation import _need, _row_gpu_keys, share_cut

GPUS = ("rtx4070", "b200", "h100-sxm", "mi355x")
# Rows per GPU (random subsample; GPPerf's tiled rows are always kept): bounds the run
# time on 2 cores. The B200 data has 244k rows, mostly tiny GEMMs.
CAPS = {"rtx4070": 5000, "b200": 8000, "h100-sxm": 5000, "mi355x": 4000}
TEST_SHARE, TEST_MAX = 0.25, 1500


def per_gpu(data: Path, seed: int = 0) -> dict[str, Table]:
    t = concat([datasets.load_shared(n, data).table for n in datasets.SHARED])
    keys = _row_gpu_keys(t)
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


def by_gpu(paths: list[Path], per_dtype: bool = False) -> dict[str, Table]:
    """The rows of ``paths`` (any format gemmd reads) by GPU model (``per_dtype``: by GPU
    model and dtype, "h200/fp16"), runtime measured."""
    if not paths:
        return {}
    t = datasets.load("auto", paths).table
    keys = _row_gpu_keys(t)
    if per_dtype:
        keys = np.array([f"{k}/{d}" for k, d in zip(keys, t["dtype"])], dtype=object)
    ok = np.isfinite(t["runtime_s"])
    out = {g: t.take(np.flatnonzero((keys == g) & ok)) for g in np.unique(keys[ok])}
    if not out:
        raise InputError(f"{', '.join(map(str, paths))}: no row with a measured runtime")
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
    for g, t in G.items():
        for dim in ("m", "n", "k"):
            cut = beyond_cut(t[dim])
            if cut is None:
                continue
            sel = t[dim] > cut
            model = ForestModel.fit_table(t.take(np.flatnonzero(~sel)), cfg)
            add(f"{dim.upper()} > {cut:,} (trained <=)", g, model, t.take(np.flatnonzero(sel)))
    return rows


def unaligned(G: dict[str, Table], cfg: ModelConfig) -> list[dict]:
    """Per shared GPU with rows aligned below ALIGN_BYTES (the B200's fp16 and fp8): a
    prior of all the GPUs without them, judged on them: coverage, MAPE, and the spread
    (log, per unit of domain.align_share) the upper end of each row's
    interval needs to hold it, as domain.align_widening applies it: the conformal
    quantile at the nominal share over all the rows and over those above 1e6-1e10 FLOPs."""
    out = []
    for g, t in G.items():
        low = unaligned_rows(t)
        if low.sum() < 20 or (~low).sum() < 20:
            continue
        rest = [G[h] for h in G if h != g] + [t.take(np.flatnonzero(~low))]
        model = ForestModel.fit_table(concat(rest), cfg)
        te = t.take(np.flatnonzero(low))
        res = model.predict_table(te)["runtime"]
        y = te["runtime_s"]
        r = np.log(y) - np.log(res["point"])
        share = np.maximum(align_share(te, np.log(res["point"])), 1e-3)
        need = np.where(r > 0, _need(r, res["sigma"], model.z, share), 0.0)
        f = features.flops(te)
        rec = {"case": "unaligned left out", "gpu": g, "target": "runtime", "n": int(len(te)),
               "dtypes": sorted(set(te["dtype"].tolist())),
               "before": scores(before(model, te), te)["coverage"],
               "after": float(np.mean((res["lo"] <= y) & (y <= res["hi"]))),
               "mape": float(np.mean(ape(res["point"], y))),
               "in_domain": float(np.mean(res["in_domain"])),
               "need": {f"{lo:.0e}": (int((f >= lo).sum()),
                                      conformal_quantile(need[f >= lo], cfg.interval))
                        for lo in (0.0, 1e6, 1e8, 1e9, 1e10) if (f >= lo).sum() >= 20}}
        out.append(rec)
        print(f"  unaligned left out {g}: {rec['n']} rows {rec['dtypes']}, coverage "
              f"{rec['after']:.3f}, MAPE {rec['mape']:.3f}, in domain {rec['in_domain']:.3f}; "
              "upward spread needed (rows, spread) from FLOPs " +
              ", ".join(f">= {k}: {v[0]}, {v[1]:.2f}" for k, v in rec["need"].items()),
              file=sys.stderr, flush=True)
    return out


def beyond_cut(v: np.ndarray, least: int = 20) -> int | None:
    """The distinct size of ``v`` above which the largest ~15% of rows lie (as fit-time
    validation holds them out: validation.share_cut), to judge a model on sizes beyond
    its training (issue 25: a size beyond the trained range in M, N or K is flagged and
    its interval widened); None where fewer than ``least`` rows would be held out or
    kept."""
    if len(np.unique(v)) < 2:
        return None
    cut = int(share_cut(v))
    n = int((v > cut).sum())
    return cut if least <= n <= len(v) - least else None


# ------------------------------------------------------------------ transfer


def physics(model, t: Table) -> dict:
    """How the model's runtime predictions on ``t`` sit against the roofline at the
    catalogued peaks: the share below it (none, since issue 25) and the share of the
    measurements themselves below it."""
    res = model.predict_table(t)["runtime"]
    floor = bounds.runtime_floor(t)
    return {"predicted_below": float(np.mean(res["point"] < floor * (1 - 1e-12))),
            "lo_below": float(np.mean(res["lo"] < floor * (1 - 1e-12))),
            "measured_below": float(np.mean(t["runtime_s"] < floor))}


def transfer(G: dict[str, Table], cfg: ModelConfig, probes: list[int], seeds: int,
             pairs: bool = False, tmp: Path | None = None,
             holdout: dict[str, Table] | None = None, holdout_only: bool = False) -> dict:
    """Leave one GPU out: a prior fitted on the other GPUs (and with ``pairs``, on each
    other GPU alone), saved and judged on the left-out GPU through gemmd evaluate
    --model's own code (evaluate.evaluate_model): as it is and carried over by N rows of
    the GPU (one per shape, drawn at random; the other shapes judged), mean of ``seeds``
    draws. Beside it the roofline estimate on the same rows and gemmd's forest fitted on
    the GPU's own data, judged on unseen shapes (evaluate's shape split). ``holdout``: GPUs
    outside the shared data (--holdout), never in a prior, judged the same way from the
    prior of all of ``G``; one of a shared GPU model (gemmd's own probes of an H100, say)
    also from the prior of the other shared GPUs: leave one GPU out, on that file's
    measurement protocol."""
    out: dict = {"full": {}, "roofline": {}, "pairs": [], "shared": list(G)}
    # a file of a shared GPU model is judged under its own name, not in its place
    named = {g: f"{g} (--holdout)" if g.split("/")[0] in G else g for g in holdout or {}}
    base = {named[g]: g.split("/")[0] for g in named}  # the GPU model of each
    holdout = {named[g]: t for g, t in (holdout or {}).items()}
    for g, t in (holdout if holdout_only else {**G, **holdout}).items():
        full = evaluate.evaluate(t, splits=("shape",), baseline=False, cfg=cfg)
        out["full"][g] = full["splits"]["shape"]["gemmd"]["targets"]["runtime"]
        roof = features.roofline(t) / cfg.roofline_efficiency
        a = ape(roof, t["runtime_s"])
        out["roofline"][g] = {"mape": float(a.mean()), "median_ape": float(np.median(a))}
    # source name -> (the GPUs its prior is fitted on, the GPUs it is judged on)
    sources = {} if holdout_only else {f"others->{g}": ([h for h in G if h != g], [g])
                                        for g in G}
    if pairs and not holdout_only:
        sources.update({g: ([g], [h for h in G if h != g]) for g in G})
    if holdout:
        sources["all"] = (list(G), list(holdout))
        for g in holdout:
            if base[g] in G:
                sources[f"others->{g}"] = ([h for h in G if h != base[g]], [g])
    tmp = tmp or Path(os.environ.get("TMPDIR", "/tmp"))
    for members, targets in sources.values():
        t0 = time.perf_counter()
        fitted = ForestModel.fit_table(concat([G[h] for h in members]), cfg)
        fit_s = time.perf_counter() - t0
        path = tmp / f"transfer-prior-{os.getpid()}-{'+'.join(members)}.skops"
        fitted.save(path)
        prior = ForestModel.load(path)  # what gemmd evaluate --model reads
        path.unlink()
        logo = prior.meta.get("logo", {}).get("runtime", {})
        ood = prior.meta.get("ood_sd", {}).get("runtime", {})
        print(f"  prior {'+'.join(members)}: {fit_s:.1f} s, w, a = {logo.get('w')}, "
              f"{logo.get('a')}, level worth {logo.get('level_n0_by_n') or logo.get('level_n0')} "
              f"probes (per number of probes), the scatter guess worth "
              f"{logo.get('resid_dof0_by_n')}, a new kernel's scatter {ood.get('scatter')}, "
              f"unaligned shapes' upward spread {ood.get('align')}", file=sys.stderr, flush=True)
        for g in targets:
            tg = holdout[g] if g in holdout else G[g]
            t1 = time.perf_counter()
            res = evaluate.evaluate_model(prior, tg, cfg=cfg, calibrate_rows=probes,
                                          seeds=seeds)
            rec = {"source": "+".join(members), "target": g, "fit_s": fit_s,
                   "seconds": time.perf_counter() - t1, "logo": logo,
                   "physics": physics(prior, tg), "curve": {}}
            for name, sp in res["splits"].items():
                if name == "model":
                    continue
                m = sp["gemmd"]["targets"].get("runtime", {})
                sd = sp["gemmd"].get("spread", {}).get("runtime", {})
                rec["curve"][sp["calibration_rows"]] = {
                    **{k: m.get(k) for k in ("mape", "median_ape", "p90_ape", "coverage",
                                             "in_domain")},
                    **{f"{k}_sd": v for k, v in sd.items()},
                    "test_rows": sp["test_rows"], "choices": sp["gemmd"].get("choices", [])}
            out["pairs"].append(rec)
            line = " ".join(f"{n}: {pct(c['mape'])} cov {pct(c['coverage'])} dom "
                            f"{pct(c['in_domain'])}" for n, c in rec["curve"].items())
            print(f"  {rec['source']:>24} -> {g:<9} roof {pct(out['roofline'][g]['mape'])}"
                  f" full {pct(out['full'][g]['mape'])} | {line} | below roofline "
                  f"{pct(rec['physics']['predicted_below'])}", file=sys.stderr, flush=True)
    return out


def defaults(G: dict[str, Table], cfg: ModelConfig, seeds: int) -> dict:
    """What leave-one-GPU-out's calibration validation (validation._validate_calibration)
    chooses for a prior of one GPU model, which predicts a GPU it never saw by the default
    transfer (the roofline estimate plus a launch: no forest level or shape carried),
    judged on each shared GPU: the evidence behind offsets.LEVEL_N0_DEFAULT_BY_N (the
    largest choice over the seeds, per number of probes)."""
    from gemmd.model.offsets import RESID_SD0, _groups
    from gemmd.model.validation import _validate_calibration

    resid = []
    for g, t in G.items():
        # a GPU that ran the same kernels where one did (a kernel the prior never saw is
        # calibrated by its own offset, not by this pseudo-count)
        mine = set(t["kernel"].tolist())
        other = max((h for h in G if h != g),
                    key=lambda h: len(mine & set(G[h]["kernel"].tolist())))
        prior = ForestModel.fit_table(G[other], cfg)
        assert prior.transfer_setting() == (0.0, 0.0)  # one GPU model: the default
        pred = prior.predict_table(t)["runtime"]["point"]
        resid.append((np.log(t["runtime_s"] / pred), _groups(t)))
    runs = [_validate_calibration(resid, RESID_SD0, seed, cfg.interval)
            for seed in range(seeds)]
    chosen = {n: max(r[0][n] for r in runs) for n in runs[0][0]}
    for seed, (n0s, gain, scale, _, _) in enumerate(runs):
        print(f"  seed {seed}: level worth {n0s} probes, error against none {gain}, "
              f"interval scale {scale}", file=sys.stderr)
    return {"runs": runs, "level_n0_by_n": chosen}


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
        probes = sorted({n for p in tr["pairs"] for n in p["curve"]})
        lines += ["Runtime MAPE on the target's other shapes (coverage of the 90% interval "
                  "± its standard deviation over the draws, share in domain), mean of the "
                  "draws; roofline and all target data: the "
                  "roofline estimate on all its rows, gemmd's forest on its own data judged "
                  "on unseen shapes", ""]
        lines += ["| source -> target | roofline | all target data | " +
                  " | ".join(f"{n} rows" for n in probes) + " | below roofline |",
                  "|---|---|---|" + "---|" * len(probes) + "---|"]
        for p in tr["pairs"]:
            dst = p["target"]
            row = [f"{p['source']} -> {dst}", pct(tr["roofline"][dst]["mape"]),
                   pct(tr["full"][dst]["mape"])]
            for n in probes:
                c = p["curve"].get(n)
                sd = f" ±{100 * c['coverage_sd']:.1f}" if c and "coverage_sd" in c else ""
                row.append("-" if c is None else f"{pct(c['mape'])} ({pct(c['coverage'])}"
                                                 f"{sd}, {pct(c['in_domain'])})")
            row.append(f"{pct(p['physics']['predicted_below'])} (measured "
                       f"{pct(p['physics']['measured_below'])})")
            lines.append("| " + " | ".join(row) + " |")
        lines += ["", targets_met(tr)]
    return "\n".join(lines)


def targets_met(tr: dict) -> str:
    """Issue 25's targets on GPUs no prior saw: leave one GPU out (the "others" priors)
    and the --holdout files (the prior of all); not the one-GPU priors of --pairs."""
    logo = [p for p in tr["pairs"] if "+" in p["source"] or
            len(tr.get("shared", tr["full"])) == 2]
    twice = {p["target"] for p in logo if sum(q["target"] == p["target"] for q in logo) > 1}

    def name(p: dict) -> str:  # a --holdout file of a shared GPU model: judged by two priors
        return f"{p['target']} from {p['source']}" if p["target"] in twice else p["target"]

    out = []
    below = [p for p in tr["pairs"] if p["physics"]["predicted_below"] > 0]
    out.append(f"- no prediction faster than physics: {len(tr['pairs']) - len(below)}/"
               f"{len(tr['pairs'])} (source, GPU) cases")
    a = [(name(p), p["curve"][0]["mape"], tr["roofline"][p["target"]]["mape"])
         for p in logo if 0 in p["curve"]]
    out.append("- uncalibrated transfer <= the roofline's error: "
               f"{sum(m <= r * (1 + 1e-9) for _, m, r in a)}/{len(a)} held-out GPUs ("
               + ", ".join(f"{g} {pct(m)} vs {pct(r)}" for g, m, r in a) + ")")
    b = [(name(p), p["curve"][20]["mape"], tr["full"][p["target"]]["mape"])
         for p in logo if 20 in p["curve"]]
    out.append("- 20 rows <= 10% where all the GPU's own data give <= 5%: " + (", ".join(
        f"{g} {pct(m)} (own data {pct(f)})" for g, m, f in b if f <= 0.05) or
        "no GPU judged here has <= 5%") + "; elsewhere " + ", ".join(
        f"{g} {pct(m)} (own {pct(f)})" for g, m, f in b if f > 0.05))
    c = [(name(p), p["curve"][5]["mape"], p["curve"][0]["mape"]) for p in logo
         if 5 in p["curve"] and 0 in p["curve"]]
    out.append(f"- 5 rows never worse than 0: {sum(m5 <= m0 * (1 + 1e-9) for _, m5, m0 in c)}"
               f"/{len(c)} (" + ", ".join(f"{g} {pct(m5)} vs {pct(m0)}" for g, m5, m0 in c)
               + ")")
    cov = [(name(p), n, c["coverage"]) for p in logo for n, c in p["curve"].items()
           if c.get("coverage") is not None]
    ok = [x for x in cov if 0.85 <= x[2] <= 0.95]
    out.append(f"- coverage 85-95% at every n: {len(ok)}/{len(cov)} (GPU, rows) cases; "
               "outside: " + (", ".join(f"{g} at {n}: {pct(v)}" for g, n, v in cov
                                        if not 0.85 <= v <= 0.95) or "none"))
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=Path, default=datasets.shared_data_dir())
    ap.add_argument("--probes", default="0,5,20,50,200",
                    help="rows of the left-out GPU to calibrate on (evaluate --calibrate-rows)")
    ap.add_argument("--seeds", type=int, default=3, help="draws per count (mean)")
    ap.add_argument("--pairs", action="store_true",
                    help="also each single other GPU as the prior")
    ap.add_argument("--caps", default="",
                    help="rows per GPU, e.g. rtx4070=2000,b200=3000 (default: CAPS)")
    ap.add_argument("--trees", type=int, default=50, help="trees per forest (default 50)")
    ap.add_argument("--coverage-only", action="store_true")
    ap.add_argument("--transfer-only", action="store_true")
    ap.add_argument("--align", action="store_true",
                    help="only the unaligned shapes left out, with the spread they need")
    ap.add_argument("--defaults", action="store_true",
                    help="only the level pseudo-counts a prior of one GPU model gets "
                         "(offsets.LEVEL_N0_DEFAULT_BY_N), from the shared GPUs")
    ap.add_argument("--holdout", type=Path, action="append", default=[], metavar="FILE",
                    help="measurements of GPUs outside the shared data (e.g. a gemmd export, "
                         "bench/results/*-sweep/sweep.csv), judged from the prior of all the "
                         "shared GPUs (repeatable)")
    ap.add_argument("--holdout-only", action="store_true",
                    help="with --holdout: only those GPUs, no leave-one-out of the shared ones")
    ap.add_argument("--holdout-per-dtype", action="store_true",
                    help="with --holdout: each of their dtypes judged on its own (as a file "
                         "of one GPU and one dtype would be)")
    ap.add_argument("--json", type=Path, help="write all figures here")
    ap.add_argument("--markdown", action="store_true", help="print tables in Markdown")
    args = ap.parse_args()
    if (args.holdout_only or args.holdout_per_dtype) and not args.holdout:
        print("bench/transfer.py: --holdout-only and --holdout-per-dtype need --holdout FILE",
              file=sys.stderr)
        return 2
    if args.holdout and (args.defaults or args.coverage_only or args.align):
        print("bench/transfer.py: --holdout is judged by the transfer part; not with "
              "--defaults, --coverage-only or --align", file=sys.stderr)
        return 2
    if args.data is None or not (args.data / "gpperf").is_dir():
        print("bench/transfer.py: shared datasets not found (../shared/data or --data); "
              "skipped", file=sys.stderr)
        return 0
    cfg = ModelConfig(min_samples=2, n_estimators=args.trees)
    t0, load0 = time.time(), os.getloadavg()[0]
    for kv in filter(None, args.caps.split(",")):
        k, v = kv.split("=")
        CAPS[k] = int(v)
    try:
        holdout = by_gpu(args.holdout, args.holdout_per_dtype)
    except GemmdError as e:
        print(f"bench/transfer.py: --holdout: {e}", file=sys.stderr)
        return 2
    G = per_gpu(args.data)
    res: dict = {"rows": {g: len(t) for g, t in G.items()}, "trees": args.trees}
    if args.defaults:
        res["defaults"] = defaults(G, cfg, args.seeds)
        if args.json:
            args.json.write_text(json.dumps(res, indent=1, default=float))
        print(json.dumps(res["defaults"]["level_n0_by_n"]))
        return 0
    if args.align:
        res["unaligned"] = unaligned(G, cfg)
        if args.json:
            args.json.write_text(json.dumps(res, indent=1, default=float))
        if args.markdown:
            print(markdown({"coverage": res["unaligned"]}))
        return 0
    if not args.transfer_only:
        res["coverage"] = coverage(G, cfg) + unaligned(G, cfg)
    if not args.coverage_only:
        res["transfer"] = transfer(G, cfg, [int(x) for x in args.probes.split(",") if x],
                                   args.seeds, args.pairs, holdout=holdout,
                                   holdout_only=args.holdout_only)
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
