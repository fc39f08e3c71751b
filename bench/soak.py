"""Memory over a week: the real daemon on 8 fake GPUs, a simulated week in minutes.

`gemmd run` (backend fake, 8 H100s, gemmd's defaults except the schedule's intervals and
a duty cycle of 1: simulated GPU time is not wall time) probes its fake GPUs in fast rounds
(``--round-s``, every sentinel and exploration probe of the plan) and refits back to back
(``schedule.refit_interval_s`` 10 s, the least allowed), while this script writes each
simulated day of an 8-GPU host into the daemon's store through the store's API
(``Store.insert_probes``): a round every ``--interval-s`` (the default schedule: 120 s,
720 rounds a day) of the default plan (2 sentinels and 1 exploration probe per GPU: 17,280
results a day), built with the daemon's own plan and exploration code (``build_plan``,
``exploration_specs``) and the fake GPUs' physics, timestamped on the simulated day (the
week ends now). After each day the daemon's own refit job must finish two refits (the one
in flight may have read the store before the day was written), then the daemon process is
sampled from /proc: RSS (VmRSS), the day's peak (VmHWM, reset each day through
/proc/PID/clear_refs), threads and open file descriptors, with the store's size, the
model's training rows (from /metrics) and the peak RSS of the refits' own processes (the
daemon logs it: `gemmd run` refits in a child process, gemmd.refit). Every refit, prune
and drift re-reference is the daemon's own code, on every row of the simulated week.

    python bench/soak.py [--days 7] [--gpus 8] [--settle 3] [--interval-s 120]
                         [--set model.max_leaf_nodes=0] [--env MALLOC_ARENA_MAX=2]
                         [--emulate-trim] [--flat-mb 150] [--target-mb 150]
                         [--json FILE] [--keep DIR]
    python bench/soak.py --quick   # minutes: 3 days of a round every 20 s (the store
                                   # reaches the 200,000-row training cap on day 2)

"Flat": over the last ``--flat-days`` simulated days (3; 2 with ``--quick``) and the
``--settle`` refits after the last day (the store no longer grows), the daemon's lowest
RSS between samples (between refits: where it spends all but a minute of each hour with
the default schedule) and its peak RSS (during a refit) each stay within ``--flat-mb``
(max - min, default 150 MB: less than one more copy of a model kept, ~175 MB at the
default bound, while the peak varies by ~100 MB with what the refit in progress does: an
accepted one also saves the model and re-takes drift references). The RSS sampled when a
day's refits are done is shown too; refits run back to back here, so it falls at some
point of the next one.
``--target-mb`` (150 by default): the goal for the daemon's steady RSS (the lowest between
refits over the last days), said beside the figures.
Figures, not assertions: the exit status is 3 if RSS is not flat, 1 if the daemon failed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from scrape import GEMMD, free_port, machine, samples, scrape, stop  # noqa: E402

from gemmd.config import load  # noqa: E402
from gemmd.devices import open_devices  # noqa: E402
from gemmd.devices.fake import FakeDevice, simulated_runtime  # noqa: E402
from gemmd.probes import build_plan, exploration_specs  # noqa: E402
from gemmd.store import Store  # noqa: E402

DAY_S = 86400.0


# ------------------------------------------------------------------ the host's week


def write_config(path: Path, state_dir: Path, gpus: int, round_s: float,
                 sets: dict[str, Any]) -> None:
    """gemmd's defaults, but: fake GPUs, a local port, fast rounds, back-to-back refits."""
    cfg: dict[str, Any] = {
        "listen": {"address": "127.0.0.1"}, "state_dir": str(state_dir), "backend": "fake",
        "log_level": "info", "schedule": {"probe_interval_s": round_s, "refit_interval_s": 10},
        # the simulated GPUs' time is not wall time: a whole round (7 probes, 7.7 s of
        # simulated GPU time) fits a 10 s round
        "budget": {"duty_cycle": 1.0},
        "fake": {"devices": [{"model": "H100-SXM"} for _ in range(gpus)]}}
    for key, value in sets.items():
        *parents, leaf = key.split(".")
        node = cfg
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    path.write_text(json.dumps(cfg, indent=1))  # JSON is valid YAML


def host_week(config: Path) -> tuple[Any, list[FakeDevice]]:
    """The daemon's configuration and fake GPUs (same UUIDs and silicon offsets as the
    daemon's, opened in this process)."""
    cfg = dataclasses.replace(load(config), isolation="thread")
    devices = open_devices(cfg)
    assert all(isinstance(d, FakeDevice) for d in devices)
    return cfg, devices  # type: ignore[return-value]


def day_rows(cfg: Any, devices: list[FakeDevice], day: int, rng: np.random.Generator,
             t0: float, probe_interval_s: float = 120.0) -> list[dict[str, Any]]:
    """One day of the host's results at the default schedule (a round every
    ``probe_interval_s`` per GPU: every sentinel and the exploration draws), as the daemon
    stores them. A probe's median runtime carries the fake's per-GEMM noise over a 1 s
    window (sigma / sqrt(iterations)); power and context come from the fake GPU."""
    out: list[dict[str, Any]] = []
    plans = [build_plan(cfg.probes.sentinels, d)[0] for d in devices]
    noise = cfg.fake.noise
    for r in range(int(DAY_S / probe_interval_s)):
        ts = t0 + day * DAY_S + r * probe_interval_s
        for d, plan in zip(devices, plans):
            todo = [(s, "sentinel") for s in plan] + [
                (s, "exploration") for s in exploration_specs(
                    [g for g in cfg.probes.exploration if r % g.every_rounds == 0], d, rng)]
            for j, (spec, kind) in enumerate(todo):
                base, util = simulated_runtime(d.model, spec)
                iters = int(min(max(1.0 / base, 3), 100_000))
                rt = base * d._offset * math.exp(rng.normal(0.0, 1.25 * noise / math.sqrt(iters)))
                pw = d._power_for(util, 1.0, spec)
                ctx = {**d.context(), "energy_method": "steps"}
                out.append({
                    "ts": ts + 1.2 * j, "source": "daemon", "kind": kind,
                    "device_uuid": d.info.uuid, "device_index": d.info.index,
                    "device_name": d.info.name, "backend": "fake", "m": spec.m, "n": spec.n,
                    "k": spec.k, "dtype": spec.dtype, "kernel": spec.kernel, "tile": spec.tile,
                    "layout": spec.layout, "outcome": "ok", "iterations": iters,
                    "runtime_s": rt, "runtime_mean_s": rt * 1.001, "runtime_min_s": rt * 0.99,
                    "runtime_p90_s": rt * 1.01, "runtime_cv": noise, "window_s": iters * rt,
                    "energy_j": rt * pw, "power_w": pw, "power_sample_w": pw,
                    "check_ok": None, "check_error": None, "context": ctx, "flagged": 0})
    return out


def write_day(db: Path, rows: list[dict[str, Any]], chunk: int = 5000) -> float:
    """Insert through the store's API in short transactions (the daemon writes too)."""
    t = time.perf_counter()
    store = Store(db, check=False)
    try:
        for i in range(0, len(rows), chunk):
            store.insert_probes(rows[i:i + chunk])
    finally:
        store.close()
    return time.perf_counter() - t


# ------------------------------------------------------------------ the daemon, sampled


def proc_sample(pid: int) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, val = line.partition(":")
        if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
            out[key] = int(val.split()[0]) / 1024
        elif key == "Threads":
            out[key] = int(val)
    out["fds"] = len(os.listdir(f"/proc/{pid}/fd"))
    return out


def reset_peak(pid: int) -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0), so that each day has its own peak."""
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def daemon_metrics(port: int) -> dict[str, float]:
    ss = samples(scrape(port, timeout=30.0))
    refits = sum(s.value for s in ss if s.name == "gemmd_model_refits_total")
    out = {"refits": refits, "failed_refits": sum(
        s.value for s in ss if s.name == "gemmd_model_refits_total"
        and s.labels.get("outcome") == "failed")}
    for s in ss:
        if s.name == "gemmd_model_training_samples":
            out["train_rows"] = s.value
        elif s.name == "gemmd_model_info":
            out["model"] = s.labels.get("version", "?")
    return out


def wait_refits(proc: subprocess.Popen, port: int, target: float, timeout: float
                ) -> dict[str, float]:
    """Poll until the daemon has done ``target`` refits; with the lowest RSS seen meanwhile
    (``low``: refits run back to back, so the RSS sampled at the end falls at some point of
    the next one; the low is the daemon between its peaks)."""
    t0, low = time.monotonic(), float("inf")
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"daemon exited with status {proc.returncode}")
        low = min(low, proc_sample(proc.pid)["VmRSS"])
        try:
            m = daemon_metrics(port)
            if m["refits"] >= target:
                return {**m, "low": low}
        except (OSError, RuntimeError):
            pass
        if time.monotonic() - t0 > timeout:
            raise RuntimeError(f"no refit in {timeout:.0f} s")
        time.sleep(1.0)


REFIT_PEAK = re.compile(r"refit: (\w+) .* (\d+) MiB at peak in its own process")


def refit_peaks(log: Path, since: int) -> tuple[list[float], int]:
    """The peak RSS of each refit process the daemon logged after line ``since``, and the
    number of lines now."""
    lines = log.read_text(errors="replace").splitlines()
    peaks = [float(m.group(2)) for ln in lines[since:] if (m := REFIT_PEAK.search(ln))]
    return peaks, len(lines)


def store_mb(db: Path) -> float:
    return sum(p.stat().st_size for p in (db, db.with_name(db.name + "-wal")) if p.exists()) \
        / 2**20


def model_mb(state: Path) -> float:
    """Size of the newest model file (a proxy for the forests' size in memory)."""
    files = sorted((state / "models").glob("*.skops"), key=lambda p: p.stat().st_mtime)
    return files[-1].stat().st_size / 2**20 if files else 0.0


TRIM_HOOK = '''# bench/soak.py --emulate-trim: malloc_trim(0) after each refit of the daemon
import ctypes, functools
import gemmd.daemon as _d
_libc = ctypes.CDLL("libc.so.6")
_refit = _d.Daemon.refit
@functools.wraps(_refit)
def refit(self):
    try:
        return _refit(self)
    finally:
        _libc.malloc_trim(0)
_d.Daemon.refit = refit
'''


IN_DAEMON_HOOK = '''# bench/soak.py --refit-in-daemon: the daemon refits in its own process (before)
import gemmd.daemon as _d
_init = _d.Daemon.__init__
def __init__(self, cfg, devices=None, *, refit_process=False):
    _init(self, cfg, devices, refit_process=False)
_d.Daemon.__init__ = __init__
'''


def soak(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    state, conf, port = work / "state", work / "gemmd.yaml", free_port()
    env = {**os.environ, **dict(kv.split("=", 1) for kv in args.env)}
    hooks = (TRIM_HOOK if args.emulate_trim else "") + \
        (IN_DAEMON_HOOK if args.refit_in_daemon else "")
    if hooks:  # changes to measure before making them, or the way it was
        (work / "hook").mkdir(exist_ok=True)
        (work / "hook" / "sitecustomize.py").write_text(hooks)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(work / "hook"),
                                                         env.get("PYTHONPATH")) if p)
    sets = dict(kv.split("=", 1) for kv in args.set)
    write_config(conf, state, args.gpus, args.round_s,
                 {k: json.loads(v) if v[:1] in "0123456789-[{tf\"" else v
                  for k, v in sets.items()})
    cfg, devices = host_week(conf)
    db = state / "gemmd.db"
    log = work / "gemmd.log"
    rng = np.random.default_rng(args.seed)
    t0 = time.time() - args.days * DAY_S  # the simulated week ends now
    rows: list[dict[str, Any]] = []
    with log.open("wb") as logf:
        proc = subprocess.Popen([*GEMMD, "run", "--config", str(conf), "--port", str(port)],
                                stdout=logf, stderr=subprocess.STDOUT, env=env)
    started = time.monotonic()
    seen = 0
    try:
        m = wait_refits(proc, port, 1, 300)
        while not str(m.get("model", "")).startswith("rf-"):  # the first forest, on the
            m = wait_refits(proc, port, m["refits"] + 1, 300)  # daemon's own probes
        s = proc_sample(proc.pid)
        child, seen = refit_peaks(log, seen)
        rows.append({"label": "start (first fit)", "day": 0, "rows_written": 0,
                     "store_mb": store_mb(db), "model_mb": model_mb(state), **m, **s,
                     "low": s["VmRSS"], "peak": s["VmHWM"], "child": max(child, default=0),
                     "wall_s": time.monotonic() - started})
        reset_peak(proc.pid)
        print(_line(rows[-1]), flush=True)
        for day in range(args.days):
            day_rows_ = day_rows(cfg, devices, day, rng, t0, args.interval_s)
            c0 = daemon_metrics(port)["refits"]
            write_s = write_day(db, day_rows_)
            n = len(day_rows_)
            del day_rows_
            m = wait_refits(proc, port, c0 + 2, args.refit_timeout)
            s = proc_sample(proc.pid)
            child, seen = refit_peaks(log, seen)
            rows.append({"label": f"day {day + 1}", "day": day + 1, "rows_written": n,
                         "write_s": write_s, "store_mb": store_mb(db),
                         "model_mb": model_mb(state), **m, **s, "child": max(child, default=0),
                         "peak": s["VmHWM"], "wall_s": time.monotonic() - started})
            reset_peak(proc.pid)
            print(_line(rows[-1]), flush=True)
        for k in range(args.settle):
            c0 = daemon_metrics(port)["refits"]
            m = wait_refits(proc, port, c0 + 1, args.refit_timeout)
            s = proc_sample(proc.pid)
            child, seen = refit_peaks(log, seen)
            rows.append({"label": f"day {args.days}, refit +{k + 1}", "day": args.days,
                         "rows_written": 0, "store_mb": store_mb(db),
                         "model_mb": model_mb(state), **m, **s, "child": max(child, default=0),
                         "peak": s["VmHWM"], "wall_s": time.monotonic() - started})
            reset_peak(proc.pid)
            print(_line(rows[-1]), flush=True)
        stop_s, code = stop(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = log.read_text(errors="replace").splitlines()
    problems = [ln for ln in text if " ERROR " in ln or "Traceback" in ln]
    tail = [r for r in rows if r["day"] >= args.days - args.flat_days + 1]
    spread = max(r["VmRSS"] for r in tail) - min(r["VmRSS"] for r in tail)
    low_spread = max(r["low"] for r in tail) - min(r["low"] for r in tail)
    peak_spread = max(r["peak"] for r in tail) - min(r["peak"] for r in tail)
    steady = max(r["low"] for r in tail)
    return {"rows": rows, "stop_s": stop_s, "exit": code, "log_lines": len(text),
            "problems": problems[:20], "n_problems": len(problems), "sampled_spread_mb": spread,
            "low_spread_mb": low_spread, "peak_spread_mb": peak_spread,
            "flat": max(low_spread, peak_spread) <= args.flat_mb, "sets": sets,
            "steady_mb": steady, "peak_mb": max(r["peak"] for r in tail),
            "child_peak_mb": max(r.get("child", 0) for r in rows),
            "wall_s": time.monotonic() - started}


def _line(r: dict[str, Any]) -> str:
    return (f"| {r['label']} | {r['rows_written']:,} | {r['store_mb']:.0f} MB | "
            f"{r.get('train_rows', 0):,.0f} | {r.get('model', '?')} ({r['model_mb']:.0f} MB) | "
            f"{r['refits']:.0f} | "
            f"{r['VmRSS']:.0f} MB | {r.get('low', r['VmRSS']):.0f} / {r['peak']:.0f} MB | "
            f"{r.get('child', 0):.0f} MB | {r['Threads']:.0f} | {r['fds']:.0f} | "
            f"{r['wall_s'] / 60:.1f} |")


HEADER = ("| simulated | results written | store (db + wal) | model's training rows | "
          "model (file) | refits so far | RSS | lowest / peak RSS since the last sample | "
          "refit process peak | threads | fds | wall min |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|---|")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="minutes, not a quarter hour: --days 3 --interval-s 20 --settle 2 "
                         "(the training cap is reached on day 2)")
    ap.add_argument("--days", type=int, default=7)
    ap.add_argument("--interval-s", type=float, default=120.0,
                    help="the written days' probe interval (default 120 s, gemmd's default)")
    ap.add_argument("--flat-days", type=int, default=3,
                    help="the last days judged for flatness (default 3; --quick: 2)")
    ap.add_argument("--target-mb", type=float, default=150.0,
                    help="goal for the daemon's steady RSS, said beside the figures")
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--round-s", type=float, default=10.0,
                    help="the daemon's own probe interval (default 10 s)")
    ap.add_argument("--settle", type=int, default=3,
                    help="refits sampled after the last day (default 3)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a configuration key of the daemon, e.g. model.max_leaf_nodes=0")
    ap.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                    help="environment of the daemon, e.g. MALLOC_ARENA_MAX=2")
    ap.add_argument("--emulate-trim", action="store_true",
                    help="the daemon calls glibc's malloc_trim(0) after each refit (a "
                         "sitecustomize hook: measures that change before making it)")
    ap.add_argument("--refit-in-daemon", action="store_true",
                    help="the daemon refits in its own process, as before gemmd.refit (a "
                         "sitecustomize hook): the comparison")
    ap.add_argument("--flat-mb", type=float, default=150.0,
                    help="flat: the lowest and the peak RSS of the last 3 days each within "
                         "this (default 150 MB)")
    ap.add_argument("--refit-timeout", type=float, default=900.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--keep", type=Path, help="work in this folder and keep it")
    args = ap.parse_args()
    if args.quick:
        args.days, args.interval_s, args.settle, args.flat_days = 3, 20.0, 2, 2
    work = args.keep or Path(tempfile.mkdtemp(prefix="gemmd-soak-"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"# {machine()}\n# {args.gpus} fake GPUs, {args.days} simulated days (a round "
          f"every {args.interval_s:g} s), "
          f"settings {args.set or 'defaults'}, environment {args.env or 'as is'}"
          f"{', malloc_trim after each refit (emulated)' if args.emulate_trim else ''}"
          f"{', refits in the daemon process' if args.refit_in_daemon else ''}; load "
          f"{os.getloadavg()[0]:.2f}\n")
    print(HEADER, flush=True)
    try:
        res = soak(args, work)
    except RuntimeError as e:
        print(f"soak failed: {e}; daemon log in {work / 'gemmd.log'}", file=sys.stderr)
        return 1
    res["machine"], res["load_end"] = machine(), os.getloadavg()[0]
    if args.json:
        args.json.write_text(json.dumps(res, indent=1, default=str))
    print(f"\nOver the last {args.flat_days} simulated days and {args.settle} refits after: "
          f"lowest RSS "
          f"within {res['low_spread_mb']:.0f} MB, peak within {res['peak_spread_mb']:.0f} MB "
          f"({'flat' if res['flat'] else 'NOT flat'}: both <= {args.flat_mb:.0f} MB; sampled "
          f"RSS within {res['sampled_spread_mb']:.0f} MB); the daemon's steady RSS (highest "
          f"lowest) {res['steady_mb']:.0f} MB against the {args.target_mb:.0f} MB goal "
          f"({'met' if res['steady_mb'] <= args.target_mb else 'missed'}), its peak "
          f"{res['peak_mb']:.0f} MB; refit processes up to {res['child_peak_mb']:.0f} MB; "
          f"SIGTERM {res['stop_s']:.1f} s (exit {res['exit']}); "
          f"{res['log_lines']} log lines, {res['n_problems']} errors/tracebacks; "
          f"{res['wall_s'] / 60:.1f} min")
    for p in res["problems"]:
        print("  ", p)
    return 0 if res["flat"] else 3


if __name__ == "__main__":
    sys.exit(main())
