"""Peak memory of one refit against the size of the store.

Builds stores of the daemon's own probes (two fake GPUs, 7 sentinels and 2 exploration
shapes per round, each row with its ~400-byte context, as `gemmd run` writes them), then
fits once per store in a fresh process and prints that process's peak RSS (VmHWM):

- ``bounded``: what the daemon's refit does now (ModelRegistry.refit: the fit's columns
  only, read in chunks, at most model.max_training_rows = 200,000 rows);
- ``all-rows``: what it did before (every stored row as a dict, context decoded, then
  ForestModel.fit), for comparison.

    python bench/refit_memory.py [--sizes 50000,200000,1000000] [--modes bounded,all-rows]
                                 [--trees 100] [--keep DIR]

Figures, not assertions. The store for the largest size takes about 30 s to build.

``--leaf-sweep 0,8192,4096,2048`` instead measures what ``model.max_leaf_nodes`` (the
bound on each tree's leaves, so on a forest's memory) costs in accuracy: gemmd's model with
each bound on the shared GEMM data (bench/model.py's random 80/20 and unseen-shape splits,
seed 42; B200 random only: its shapes are all distinct, the two splits coincide) and on a
simulated week of an 8-GPU host (bench/soak.py's data: 20% of the exploration
configurations held out), with each fitted model's node count and forest memory
(scikit-learn's 72 bytes per node plus the 40 of the flat copy used for fast prediction).

    python bench/refit_memory.py --leaf-sweep 0,8192,4096,2048 [--datasets b200,xla,...]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SENTINELS = [(1024, 1024, 1024, "bf16", "blas", 0), (4096, 4096, 4096, "bf16", "blas", 0),
             (8192, 8192, 8192, "bf16", "blas", 0), (1024, 1024, 1024, "fp32", "blas", 0),
             (4096, 4096, 4096, "fp32", "blas", 0), (8192, 8192, 8192, "fp32", "blas", 0),
             (1024, 1024, 1024, "fp32", "tiled", 16)]
EXPLORATION_PER_ROUND = 2
CONTEXT = {"before": {"sm_clock_hz": 1980000000.0, "mem_clock_hz": 2619000000.0,
                      "temperature_c": 77.68290457874072, "power_limit_w": 700,
                      "clock_event_reasons": [], "pstate": 0, "other_processes": 0},
           "after": {"sm_clock_hz": 1980000000.0, "mem_clock_hz": 2619000000.0,
                     "temperature_c": 78.1204377811, "power_limit_w": 700,
                     "clock_event_reasons": [], "pstate": 0, "other_processes": 0,
                     "energy_method": "window"}}


def build(path: Path, n_rows: int, seed: int = 0) -> None:
    from gemmd.config import FakeDeviceConfig
    from gemmd.devices.fake import FakeDevice
    from gemmd.store import Store
    from gemmd.store.schema import PROBE_COLUMNS

    rng = np.random.default_rng(seed)
    devs = [FakeDevice(i, FakeDeviceConfig(model=m)) for i, m in
            enumerate(("H100-SXM", "A100-SXM"))]
    store = Store(path, check=False)
    for d in devs:
        store.upsert_device(d.info.uuid, d.info.index, d.info.name, "fake",
                            dataclasses.asdict(d.info))
    per_round = len(SENTINELS) + EXPLORATION_PER_ROUND
    t0 = time.time() - 86400 * 60
    cols = ", ".join(PROBE_COLUMNS)
    marks = ", ".join("?" for _ in PROBE_COLUMNS)
    db = store._db
    db.execute("BEGIN")
    batch, i = [], 0
    while i < n_rows:
        rnd = i // (per_round * len(devs))
        for d in devs:
            peak = d.info.peak_flops
            explo = [(*(int(round(math.exp(rng.uniform(math.log(256), math.log(8192))) / 64)
                                  * 64) for _ in range(3)), str(rng.choice(["bf16", "fp32"])),
                      "blas", 0) for _ in range(EXPLORATION_PER_ROUND)]
            for j, (m, n, k, dt, kern, tile) in enumerate(SENTINELS + explo):
                if i >= n_rows:
                    break
                flops = 2.0 * m * n * k
                rt = flops / (0.7 * (peak.get("fp32" if kern == "tiled" else dt) or 1e14))
                rt *= math.exp(rng.normal(0, 0.02))
                pw = 300 + 300 * rng.random()
                kind = "sentinel" if j < len(SENTINELS) else "exploration"
                row = {"ts": t0 + rnd * 120.0 + j, "source": "daemon", "kind": kind,
                       "device_uuid": d.info.uuid, "device_index": d.info.index,
                       "device_name": d.info.name, "backend": "fake", "m": m, "n": n, "k": k,
                       "dtype": dt, "kernel": kern, "tile": tile, "layout": "nn",
                       "outcome": "ok", "iterations": 1000, "runtime_s": rt,
                       "runtime_mean_s": rt, "runtime_min_s": rt * 0.98,
                       "runtime_p90_s": rt * 1.02, "runtime_cv": 0.01, "window_s": 0.2,
                       "energy_j": rt * pw, "power_w": pw, "power_sample_w": pw,
                       "check_ok": 1, "check_error": 0.0, "pred_runtime_s": rt,
                       "pred_power_w": pw, "pred_energy_j": rt * pw, "model_version": "rf-1",
                       "flagged": 0, "context": json.dumps(CONTEXT)}
                batch.append([row.get(c) for c in PROBE_COLUMNS])
                i += 1
        if len(batch) >= 50_000:
            db.executemany(f"INSERT INTO probes ({cols}) VALUES ({marks})", batch)
            batch.clear()
    if batch:
        db.executemany(f"INSERT INTO probes ({cols}) VALUES ({marks})", batch)
    db.execute("COMMIT")
    store.close()


def _peak_rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def child(mode: str, db: str, trees: int) -> None:
    """One fit in this process; prints a JSON line."""
    import sklearn.ensemble  # noqa: F401  (imports counted in the baseline, not the fit)

    from gemmd.config import ModelConfig
    from gemmd.model import ForestModel
    from gemmd.registry import ModelRegistry, training_data, training_table
    from gemmd.store import Store

    store = Store(db, check=False)
    cfg = ModelConfig(n_estimators=trees)
    base = _peak_rss_mib()
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        reg = ModelRegistry(store, Path(tmp), cfg)
        if mode == "bounded":  # ModelRegistry.refit's first fit, step by step
            t, _ = training_table(store, max_rows=ModelConfig().max_training_rows)
            load_mib, load_s = _peak_rss_mib(), time.perf_counter() - t0
            reg.register(ForestModel.fit_table(t, cfg))
        else:  # the refit as it was: every row as a dict, then fit and register
            rows, infos = training_data(store)
            load_mib, load_s = _peak_rss_mib(), time.perf_counter() - t0
            reg.register(ForestModel.fit(rows, infos, cfg))
        n = reg.current.meta.get("n_samples", 0)
    print(json.dumps({"mode": mode, "peak_mib": _peak_rss_mib(), "base_mib": base,
                      "load_mib": load_mib, "load_s": load_s, "train_rows": n,
                      "seconds": time.perf_counter() - t0}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="50000,200000,1000000")
    ap.add_argument("--modes", default="bounded,all-rows")
    ap.add_argument("--trees", type=int, default=100, help="model.n_estimators (default 100)")
    ap.add_argument("--keep", type=Path, help="build/reuse the stores in this folder")
    ap.add_argument("--child", nargs=2, metavar=("MODE", "DB"), help=argparse.SUPPRESS)
    ap.add_argument("--leaf-sweep", metavar="L,L,...",
                    help="accuracy and forest size for these model.max_leaf_nodes (0 = none)")
    ap.add_argument("--datasets", default="gpperf-cutlass,gpperf-tiled,xla,b200,fake-week")
    args = ap.parse_args()
    if args.leaf_sweep:
        leaf_sweep([int(v) for v in args.leaf_sweep.split(",")], args.datasets.split(","),
                   args.trees)
        return
    if args.child:
        child(args.child[0], args.child[1], args.trees)
        return
    work = args.keep or Path(tempfile.mkdtemp(prefix="gemmd-refit-mem-"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"# {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"Python {platform.python_version()}; n_estimators {args.trees}")
    print("| stored rows | store size | mode | rows fitted | peak RSS: after reading / whole "
          "refit | baseline RSS | read / whole refit time |")
    print("|---|---|---|---|---|---|---|")
    for size in (int(s) for s in args.sizes.split(",")):
        db = work / f"store-{size}.db"
        if not db.exists():
            build(db, size)
        for mode in args.modes.split(","):
            r = subprocess.run([sys.executable, __file__, "--child", mode, str(db), "--trees",
                                str(args.trees)], capture_output=True, text=True)
            if r.returncode:
                print(f"| {size:,} | | {mode} | failed: {r.stderr.strip()[-200:]} | | | |")
                continue
            res = json.loads(r.stdout.strip().splitlines()[-1])
            print(f"| {size:,} | {db.stat().st_size / 2**20:.0f} MiB | {mode} | "
                  f"{res['train_rows']:,} | {res['load_mib']:.0f} / {res['peak_mib']:.0f} MiB | "
                  f"{res['base_mib']:.0f} MiB | {res['load_s']:.1f} / {res['seconds']:.1f} s |",
                  flush=True)


# ------------------------------------------------------------------ the leaf bound


def fake_week(days: int = 7) -> tuple[object, np.ndarray, np.ndarray]:
    """bench/soak.py's simulated week of an 8-GPU host as the refit reads it (capped at
    model.max_training_rows), with 20% of the exploration configurations held out."""
    sys.path.insert(0, str(ROOT / "bench"))
    import soak

    from gemmd.config import ModelConfig
    from gemmd.features import config_ids
    from gemmd.registry import training_table
    from gemmd.store import Store

    with tempfile.TemporaryDirectory() as tmp:
        conf = Path(tmp) / "gemmd.yaml"
        soak.write_config(conf, Path(tmp), 8, 10.0, {})
        cfg, devices = soak.host_week(conf)
        store = Store(Path(tmp) / "gemmd.db", check=False)
        for d in devices:
            store.upsert_device(d.info.uuid, d.info.index, d.info.name, "fake",
                                dataclasses.asdict(d.info))
        rng = np.random.default_rng(1)
        for day in range(days):
            store.insert_probes(soak.day_rows(cfg, devices, day, rng, time.time() - 8 * 86400))
        t, _ = training_table(store, max_rows=ModelConfig().max_training_rows)
        store.close()
    gid = config_ids(t)
    _, cnt = np.unique(gid, return_counts=True)
    cfgs = np.flatnonzero(cnt == 1)  # exploration configurations (drawn once)
    held = np.zeros(len(cnt), dtype=bool)
    held[np.random.default_rng(42).choice(cfgs, len(cfgs) // 5, replace=False)] = True
    test = np.flatnonzero(held[gid])
    return t, np.setdiff1d(np.arange(len(t)), test), test


def forest_size(model: object) -> tuple[int, float]:
    """(nodes in all forests, MiB: 72 bytes per node in scikit-learn + 40 in the flat copy)"""
    nodes = sum(e.tree_.node_count for rf in model.forests.values() for e in rf.estimators_)
    return nodes, nodes * (72 + 40) / 2**20


def leaf_sweep(leaves: list[int], names: list[str], trees: int) -> None:
    from gemmd import datasets, evaluate
    from gemmd.config import ModelConfig

    data = datasets.shared_data_dir()
    print(f"# {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"Python {platform.python_version()}; n_estimators {trees}, shared data {data}")
    print("| data | split | max_leaf_nodes | runtime MAPE / median APE | power | energy | "
          "nodes (all forests) | forest memory | fit |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name in names:
        if name == "fake-week":
            t, train, test = fake_week()
            splits = {"held-out exploration": (train, test)}
        else:
            if data is None:
                print(f"| {name} | shared data not found | | | | | | | |")
                continue
            t = datasets.load_shared(name, data).table
            kinds = ("random",) if name == "b200" else ("random", "shape")
            splits = {k: evaluate.split(t, k) for k in kinds}
        for kind, (train, test) in splits.items():
            tr, te = t.take(train), t.take(test)
            for leaf in leaves:
                cfg = ModelConfig(min_samples=2, n_estimators=trees, max_leaf_nodes=leaf)
                t0 = time.perf_counter()
                m = evaluate.GemmdModel(cfg).fit(tr)
                fit_s = time.perf_counter() - t0
                sc = evaluate.score(te, m.predict_table(te))
                cells = []
                for target in ("runtime", "power", "energy"):
                    g = sc.get(target, {})
                    cells.append(f"{100 * g['mape']:.2f}% / {100 * g['median_ape']:.2f}%"
                                 if g.get("n") else "-")
                nodes, mib = forest_size(m.model)
                print(f"| {name} | {kind} | {leaf or 'none'} | {' | '.join(cells)} | "
                      f"{nodes:,} | {mib:.0f} MiB | {fit_s:.0f} s |", flush=True)


if __name__ == "__main__":
    main()
