"""GPU acceptance run of gemmd: one command, every GPU figure, one folder of results.

    python3 bench/gpu_accept.py OUTDIR [--backend nvidia|fake] [--quick]

Run from the repository root of a bare checkout with ``PYTHONPATH=$PWD`` (on the lent GPU
machine: ``bench/gpu_accept.sh OUTDIR``, which first installs the wheels of
../shared/gpu/README.md). Steps, each timed against its own budget (about 7 minutes in
all on an H100), each run whatever happened to the ones before:

1. pytest.txt        the NVIDIA tests on this GPU (tests/test_gpu_contract.py, test_nvidia.py)
2. probe_default.csv ``gemmd probe`` on the configured sentinels (the CLI, a subprocess)
3. sweep.csv         cuBLAS dtype x layout at three shapes; the tiled kernel, tiles 1..32
4. fidelity.csv      probe TFLOP/s vs the best of cupy.matmul/torch.matmul, 8192^3
                     (target >= 0.98)
5. energy.csv        energy per GEMM over 10 repeats at 0.25-2 s windows, window delta and
                     counter-step method from the same run (target CV <= 2% at the default)
6. noise.csv         every default sentinel over 20 rounds: CV, lag-1 autocorrelation
7. launch.csv        host cost of one direct cuBLAS launch vs GPU time per GEMM, by size
8. run.txt           a 2-minute ``gemmd run`` (worker processes), /metrics scraped, SIGTERM
9. round_cost.csv    energy and time of one default round, average power at the interval

and SUMMARY.md with the environment, every step's status and wall time, and each figure
beside its target. ``--backend fake`` runs what it can on the simulated GPU (steps 4 and 7
need CuPy/torch on a real GPU and are skipped); ``--quick`` shortens every step. Exit
status: 0 all well, 1 a step failed, 3 no step failed but a target was missed.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import datetime
import io
import math
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # `python3 bench/gpu_accept.py` without PYTHONPATH works too
    sys.path.insert(0, str(ROOT))

TOTAL_TARGET_S = 480.0  # the whole run on an H100, full mode
SENTINEL_ROUNDS = 20


class Skip(Exception):
    """The step does not apply here (recorded as skipped, not failed)."""


class Failed(Exception):
    """The step ran and its pass criterion failed."""


@dataclass
class Figure:
    name: str
    value: str
    target: str
    met: bool | None
    counted: bool = True  # False: shown beside the target for reference only


@dataclass
class Step:
    num: int
    title: str
    budget_s: float
    fn: Callable[[Ctx], None]
    status: str = "not run"
    note: str = ""
    wall_s: float = 0.0
    lines: list[str] = field(default_factory=list)


class Ctx:
    """What the steps share: the output folder, the in-process device, results, summary."""

    def __init__(self, out: Path, backend: str, quick: bool):
        self.out, self.backend, self.quick = out, backend, quick
        self.figures: list[Figure] = []
        self.data: dict[str, Any] = {}
        self.step: Step | None = None
        self.deadline = math.inf
        self._devices: list[Any] | None = None
        self.lock = threading.Lock()

    @property
    def gpu(self) -> bool:
        return self.backend == "nvidia"

    def left(self) -> float:
        """Seconds left of the current step's budget."""
        return self.deadline - time.monotonic()

    def md(self, *lines: str) -> None:
        assert self.step is not None
        self.step.lines.extend(lines)

    def figure(self, name: str, value: str, target: str, met: bool | None,
               counted: bool = True) -> None:
        self.figures.append(Figure(f"{self.step.num}. {name}" if self.step else name, value,
                                   target, met, counted))

    def device(self) -> Any:
        """The first device, opened as the daemon opens it (in this process: isolation
        "thread"); the fake backend's devices are simulated (realtime=False)."""
        if self._devices is None:
            from gemmd.config import Config
            from gemmd.devices import open_devices

            cfg = dataclasses.replace(Config(), backend=self.backend, isolation="thread")
            self._devices = open_devices(cfg)
            for d in self._devices[1:]:
                d.close()
        return self._devices[0]

    def device_info(self) -> Any:
        return self._devices[0].info if self._devices else None

    def close(self) -> None:
        if self._devices:
            self._devices[0].close()

    def write_csv(self, name: str, rows: Sequence[dict[str, Any]]) -> Path:
        fields: dict[str, None] = {}
        for r in rows:
            fields.update(dict.fromkeys(r))
        path = self.out / name
        with open(path, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(fields), lineterminator="\n")
            w.writeheader()
            w.writerows(rows)
        return path


# ------------------------------------------------------------------ helpers


def fmt(v: Any, spec: str = ".3g", unit: str = "") -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "-"
    return f"{v:{spec}}{unit}"


def pct(v: float | None) -> str:
    return fmt(None if v is None else 100 * v, ".2f", "%")


def cv(xs: Sequence[float]) -> float | None:
    x = np.asarray([v for v in xs if v is not None and math.isfinite(v)], dtype=float)
    if len(x) < 2 or x.mean() == 0:
        return None
    return float(x.std(ddof=1) / x.mean())


def mean_of(xs: Sequence[float | None]) -> float | None:
    x = [v for v in xs if v is not None and math.isfinite(v)]
    return float(np.mean(x)) if x else None


def lag1(xs: Sequence[float]) -> float | None:
    """Lag-1 autocorrelation (the estimator drift.py's noise scale corrects for)."""
    x = np.asarray([v for v in xs if v is not None and math.isfinite(v)], dtype=float)
    if len(x) < 3:
        return None
    d = x - x.mean()
    den = float(d @ d)
    return float(d[:-1] @ d[1:] / den) if den > 0 else None


def md_table(head: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[str]:
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return out


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    env.pop("GEMMD_CONFIG", None)
    return env


def run_cmd(cmd: Sequence[str], timeout: float) -> tuple[int, str, str]:
    """(exit status, stdout, stderr); 124 and what was written when it ran out of time."""
    try:
        p = subprocess.run(cmd, cwd=ROOT, env=child_env(), capture_output=True, text=True,
                           timeout=timeout)
        return p.returncode, p.stdout, p.stderr
    except subprocess.TimeoutExpired as e:
        def text(b: Any) -> str:
            return b.decode(errors="replace") if isinstance(b, bytes) else (b or "")
        return 124, text(e.stdout), text(e.stderr) + f"\n(killed after {timeout:.0f} s)\n"


def measure_row(dev: Any, spec: Any, cfg: Any) -> dict[str, Any]:
    """One probe measured in-process, flattened; a failure is a row, not an exception."""
    from gemmd.errors import UnsupportedProbe
    from gemmd.probes import measure

    row: dict[str, Any] = {"probe": spec.name, **dataclasses.asdict(spec)}
    try:
        m = measure(dev, spec, cfg)
    except UnsupportedProbe as e:
        return {**row, "outcome": "unsupported", "error": str(e)}
    except Exception as e:
        return {**row, "outcome": "failed", "error": f"{type(e).__name__}: {e}"}
    after = m.context.get("after") or {}
    return {**row, "outcome": "ok", "error": "", "iterations": m.iterations,
            "window_s": m.window_s, "runtime_s": m.runtime_s, "runtime_cv": m.runtime_cv,
            "tflops": m.tflops, "power_w": m.power_w, "energy_j": m.energy_j,
            "energy_method": after.get("energy_method"), "elapsed_s": m.elapsed_s,
            "sm_clock_hz": after.get("sm_clock_hz"), "temperature_c": after.get("temperature_c"),
            "clock_event_reasons": "|".join(after.get("clock_event_reasons") or [])}


def fail_if_failed(rows: Sequence[dict[str, Any]], what: str) -> None:
    bad = [r for r in rows if r.get("outcome") == "failed"]
    if bad:
        raise Failed(f"{len(bad)} {what} failed, first: {bad[0]['probe']}: {bad[0]['error']}")


# ------------------------------------------------------------------ 1. pytest


def step_pytest(ctx: Ctx) -> None:
    if ctx.backend == "fake" and ctx.quick:
        raise Skip("--quick on the fake backend")
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "tests/test_gpu_contract.py",
           "tests/test_nvidia.py"]
    rc, out, err = run_cmd(cmd, timeout=240)
    (ctx.out / "pytest.txt").write_text(
        f"$ python {' '.join(cmd[1:])}\n{out}{err}\nexit status {rc}\n")
    last = next((ln for ln in reversed((out + err).splitlines()) if ln.strip()), "")
    ctx.md(f"`python -m pytest -q -x tests/test_gpu_contract.py tests/test_nvidia.py`: "
           f"exit {rc}, `{last.strip()}` (pytest.txt)")
    if rc != 0:
        raise Failed(f"pytest exit {rc}: {last.strip()}")


# ------------------------------------------------------------------ 2. gemmd probe


def step_probe(ctx: Ctx) -> None:
    cmd = [sys.executable, "-m", "gemmd", "probe", "-c", str(ROOT / "gemmd.yaml"),
           "--backend", ctx.backend, "--format", "csv", "--no-store", "--force"]
    rc, out, err = run_cmd(cmd, timeout=180)
    (ctx.out / "probe_default.csv").write_text(out)
    (ctx.out / "probe_default.log").write_text(err)
    rows = list(csv.DictReader(io.StringIO(out)))
    ctx.data["probe_rows"] = rows

    def f(r: dict, k: str) -> float | None:
        try:
            return float(r[k])
        except (KeyError, TypeError, ValueError):
            return None

    table = []
    for r in rows:
        rt, pr = f(r, "runtime_s"), f(r, "pred_runtime_s")
        table.append((r["gpu"], r["probe"], r["kind"], r["outcome"], fmt(rt and rt * 1e3),
                      fmt(f(r, "tflops")), fmt(f(r, "power_w"), ".0f"),
                      fmt(f(r, "energy_j")), fmt(rt / pr if rt and pr else None, ".3f")))
    ctx.md(f"`gemmd probe -c gemmd.yaml --backend {ctx.backend} --format csv --no-store "
           f"--force`: exit {rc}, {len(rows)} probes (probe_default.csv, log in "
           "probe_default.log)", "",
           *md_table(("GPU", "probe", "kind", "outcome", "runtime ms", "TFLOP/s", "power W",
                      "energy J", "measured/predicted"), table))
    if rc != 0 or not rows:
        tail = " | ".join(err.strip().splitlines()[-3:])
        raise Failed(f"gemmd probe exit {rc}, {len(rows)} rows: {tail}")


# ------------------------------------------------------------------ 3. sweep


def step_sweep(ctx: Ctx) -> None:
    from gemmd.config import MeasureConfig
    from gemmd.probes import ProbeSpec

    dev = ctx.device()
    shapes = [(1024, 1024, 1024), (4096, 4096, 4096), (8192, 8192, 1024)]
    tiled_shapes = [(1024, 1024, 1024), (2048, 2048, 2048)]
    if ctx.quick:
        shapes, tiled_shapes = shapes[:2], tiled_shapes[:1]
    specs = [ProbeSpec(*s, dtype=d, layout=lay) for s in shapes
             for d in ("fp64", "fp32", "tf32", "fp16", "bf16") for lay in ("nn", "nt", "tn", "tt")]
    # Tiles 1 and 2 at 2048^3 take seconds per GEMM: last, so the budget cuts them first.
    specs += [ProbeSpec(*s, dtype="fp32", kernel="tiled", tile=t)
              for i, s in enumerate(tiled_shapes)
              for t in ((1, 2, 4, 8, 16, 32) if i == 0 else (32, 16, 8, 4, 2, 1))]
    # Short windows: this is a map of the configuration space, not a noise measurement.
    cfg = MeasureConfig(window_s=0.1 if ctx.quick else 0.2, warmup_s=0.05, warmup_iters=1,
                        min_iters=2)
    rows = []
    for spec in specs:
        if ctx.left() <= 0:
            rows.append({"probe": spec.name, **dataclasses.asdict(spec),
                         "outcome": "not run", "error": "step budget spent"})
            continue
        rows.append(measure_row(dev, spec, cfg))
    ctx.write_csv("sweep.csv", rows)
    by = {r["probe"]: r for r in rows}
    ok = sum(r["outcome"] == "ok" for r in rows)
    ctx.md(f"{ok} of {len(rows)} probes measured (window {cfg.window_s} s; sweep.csv). "
           "cuBLAS TFLOP/s by layout (power W of nn):", "")
    table = []
    for s in shapes:
        for d in ("fp64", "fp32", "tf32", "fp16", "bf16"):
            cells = [by[ProbeSpec(*s, dtype=d, layout=lay).name]
                     for lay in ("nn", "nt", "tn", "tt")]
            table.append(("x".join(map(str, s)), d,
                          *(fmt(c.get("tflops"), ".1f") if c["outcome"] == "ok"
                            else c["outcome"] for c in cells), fmt(cells[0].get("power_w"), ".0f")))
    ctx.md(*md_table(("shape", "dtype", "nn", "nt", "tn", "tt", "W (nn)"), table), "",
           "Tiled kernel (fp32; GPPerf found 16x16 best on an RTX 4070):", "")
    table = []
    for t in (1, 2, 4, 8, 16, 32):
        cells = []
        for s in tiled_shapes:
            r = by[ProbeSpec(*s, dtype="fp32", kernel="tiled", tile=t).name]
            cells.append(f"{fmt(r.get('runtime_s') and r['runtime_s'] * 1e3)} ms, "
                         f"{fmt(r.get('tflops'), '.2f')} TFLOP/s, {fmt(r.get('power_w'), '.0f')} W"
                         if r["outcome"] == "ok" else r["outcome"])
        table.append((f"{t}x{t}", *cells))
    ctx.md(*md_table(("tile", *("x".join(map(str, s)) for s in tiled_shapes)), table))
    for s in tiled_shapes:
        tiled = [r for r in rows if r["kernel"] == "tiled" and (r["m"], r["n"], r["k"]) == s
                 and r["outcome"] == "ok"]
        if tiled:
            best = min(tiled, key=lambda r: r["runtime_s"])
            ctx.figure(f"fastest tile at {'x'.join(map(str, s))}",
                       f"{best['tile']}x{best['tile']}", "16x16 (GPPerf, RTX 4070)",
                       best["tile"] == 16, counted=False)
    missing = sum(r["outcome"] == "not run" for r in rows)
    if missing:
        ctx.step.note = f"{missing} probes not run: step budget spent"
    fail_if_failed(rows, "sweep probes")


# ------------------------------------------------------------------ 4. fidelity


def _back_to_back_s(call: Callable[[], Any], event: Callable[[], Any],
                    record: Callable[[Any], None], elapsed_ms: Callable[[Any, Any], float],
                    target_s: float) -> float:
    """Median seconds per call over calls enqueued back to back with an event between
    each (the probe's own method), so launch gaps are not timed."""
    for _ in range(3):
        call()
    a, b = event(), event()
    record(a)
    call()
    record(b)
    b.synchronize()
    per = max(elapsed_ms(a, b) / 1e3, 1e-6)
    n = int(min(200, max(10, math.ceil(target_s / per))))
    evs = [event() for _ in range(n + 1)]
    record(evs[0])
    for i in range(n):
        call()
        record(evs[i + 1])
    evs[-1].synchronize()
    return float(np.median([elapsed_ms(evs[i], evs[i + 1]) for i in range(n)])) / 1e3


def cupy_seconds(ordinal: int, shape: tuple[int, int, int], dtype: str, target_s: float
                 ) -> float:
    import cupy as cp

    m, n, k = shape
    dt = {"fp16": cp.float16, "fp32": cp.float32}[dtype]
    with cp.cuda.Device(ordinal):
        stream = cp.cuda.Stream(non_blocking=True)
        with stream:
            a = cp.random.standard_normal((m, k), dtype=cp.float32).astype(dt)
            b = cp.random.standard_normal((k, n), dtype=cp.float32).astype(dt)
            c = cp.empty((m, n), dtype=dt)
            try:
                return _back_to_back_s(lambda: cp.matmul(a, b, out=c), cp.cuda.Event,
                                       lambda e: e.record(stream), cp.cuda.get_elapsed_time,
                                       target_s)
            finally:
                stream.synchronize()


def torch_seconds(torch: Any, ordinal: int, shape: tuple[int, int, int], dtype: str,
                  target_s: float) -> float:
    m, n, k = shape
    tdt = {"bf16": torch.bfloat16, "fp16": torch.float16, "tf32": torch.float32,
           "fp32": torch.float32}[dtype]
    tf32_was = torch.backends.cuda.matmul.allow_tf32
    dev = torch.device("cuda", ordinal)
    with torch.cuda.device(ordinal):
        torch.backends.cuda.matmul.allow_tf32 = dtype == "tf32"  # fp32 means fp32, as probed
        try:
            a = torch.randn(m, k, device=dev, dtype=tdt)
            b = torch.randn(k, n, device=dev, dtype=tdt)
            c = torch.empty(m, n, device=dev, dtype=tdt)
            torch.cuda.synchronize(dev)
            stream = torch.cuda.Stream(device=dev)
            with torch.cuda.stream(stream):
                return _back_to_back_s(lambda: torch.matmul(a, b, out=c),
                                       lambda: torch.cuda.Event(enable_timing=True),
                                       lambda e: e.record(stream),
                                       lambda x, y: x.elapsed_time(y), target_s)
        finally:
            torch.backends.cuda.matmul.allow_tf32 = tf32_was
            torch.cuda.synchronize(dev)
            torch.cuda.empty_cache()


def step_fidelity(ctx: Ctx) -> None:
    if not ctx.gpu:
        raise Skip("needs a GPU (compares with cupy.matmul and torch.matmul)")
    from gemmd.config import MeasureConfig
    from gemmd.probes import ProbeSpec, measure

    dev = ctx.device()
    ordinal = int(dev.info.extra["cuda_ordinal"])
    try:
        import torch
        torch_err = None
    except ImportError as e:
        torch, torch_err = None, f"torch not importable: {e}"
    shape = (8192, 8192, 8192)
    flops = 2.0 * math.prod(shape)
    target_s = 0.15 if ctx.quick else 0.3
    cfg = MeasureConfig()  # the window gemmd exports
    rows, table = [], []
    for dtype in ("bf16", "fp16", "tf32", "fp32"):
        notes = []
        m = measure(dev, ProbeSpec(*shape, dtype=dtype), cfg)
        libs: dict[str, float] = {}
        if dtype in ("fp16", "fp32"):
            libs["cupy"] = flops / cupy_seconds(ordinal, shape, dtype, target_s) / 1e12
            import cupy

            cupy.get_default_memory_pool().free_all_blocks()  # its inputs are gone now
        else:
            notes.append("cupy: no bf16 arrays; TF32 only process-wide via CUPY_TF32 at import")
        if torch is not None:
            libs["torch"] = flops / torch_seconds(torch, ordinal, shape, dtype, target_s) / 1e12
        else:
            notes.append(torch_err)
        best = max(libs, key=libs.get) if libs else None
        ratio = m.tflops / libs[best] if best else None
        rows.append({"dtype": dtype, "shape": "x".join(map(str, shape)),
                     "probe_tflops": m.tflops, "probe_runtime_s": m.runtime_s,
                     "probe_power_w": m.power_w, "cupy_tflops": libs.get("cupy"),
                     "torch_tflops": libs.get("torch"), "best_library": best,
                     "ratio_to_best": ratio, "note": "; ".join(notes)})
        table.append((dtype, fmt(m.tflops, ".1f"), fmt(libs.get("cupy"), ".1f"),
                      fmt(libs.get("torch"), ".1f"), fmt(ratio, ".3f"), "; ".join(notes)))
        ctx.figure(f"probe / best library TFLOP/s, {dtype} 8192^3", fmt(ratio, ".3f"),
                   ">= 0.98", None if ratio is None else ratio >= 0.98)
    ctx.write_csv("fidelity.csv", rows)
    ctx.md("TFLOP/s, each library timed on its own stream of the probed GPU (CUDA ordinal "
           f"{ordinal}), back to back with an event between calls, median (fidelity.csv):", "",
           *md_table(("dtype", "probe", "cupy.matmul", "torch.matmul", "ratio", "note"), table))


# ------------------------------------------------------------------ 5. energy


def step_energy(ctx: Ctx) -> None:
    from gemmd.config import MeasureConfig
    from gemmd.probes import (
        ProbeSpec,
        energy_figures,
        iterations_for_window,
        power_between_steps,
    )

    dev = ctx.device()
    default_w = MeasureConfig().window_s
    windows = sorted({0.25, default_w} if ctx.quick else {0.25, 0.5, 1.0, 2.0, default_w})
    repeats = 3 if ctx.quick else 10
    spec = ProbeSpec(8192, 8192, 8192, dtype="bf16")  # GPU-bound on any GPU
    cancel = threading.Event()
    dev.prepare(spec)
    per = float(np.median(dev.run(spec, 5, cancel)))  # also the warm-up of the shape
    warm = iterations_for_window(per, 0.1, 1, 100_000)
    rows = []
    for w in windows:
        iters = iterations_for_window(per, w, 3, 100_000)
        for rep in range(repeats):
            if ctx.left() < w and rep >= 2:
                ctx.step.note = "fewer repeats at the longest windows: step budget spent"
                break
            dev.run(spec, warm, cancel)  # as measure() warms up before its window
            run = dev.run_observed(spec, iters, cancel)  # ONE window for both methods
            n, span = len(run.times), run.t1 - run.t0
            e_win, p_win = energy_figures(run.e0, run.e1, span, n)
            p_step = power_between_steps(run.steps, span)
            mean_t = float(np.mean(run.times)) if run.times else None
            rows.append({"window_s": w, "repeat": rep, "iterations": n, "run_window_s": span,
                         "counter_steps": len(run.steps), "mean_gemm_s": mean_t,
                         "energy_window_j": e_win, "power_window_w": p_win,
                         "energy_step_j": p_step * mean_t if p_step and mean_t else None,
                         "power_step_w": p_step})
    ctx.write_csv("energy.csv", rows)
    table = []
    for w in windows:
        rs = [r for r in rows if r["window_s"] == w]
        dw, ds = [r["energy_window_j"] for r in rs], [r["energy_step_j"] for r in rs]
        c_w, c_s = cv(dw), cv(ds)
        n_s = sum(v is not None for v in ds)
        table.append((w, len(rs), fmt(mean_of(dw), ".4g"), pct(c_w), fmt(mean_of(ds), ".4g"),
                      pct(c_s), f"{n_s}/{len(rs)}"))
        if w == default_w:
            ctx.figure(f"energy per GEMM CV, step method (gemmd's), {w} s window", pct(c_s),
                       "<= 2%", None if c_s is None else c_s <= 0.02)
            ctx.figure(f"energy per GEMM CV, window delta, {w} s window", pct(c_w),
                       "<= 2% (reference: not gemmd's method)",
                       None if c_w is None else c_w <= 0.02, counted=False)
    ctx.md(f"{spec.name}, {repeats} repeats per window, both methods from the same "
           "`run_observed` window of each repeat (energy.csv). The step method needs two "
           "counter steps spanning half the window, else gemmd falls back to the delta:", "",
           *md_table(("window s", "repeats", "delta J/GEMM", "delta CV", "step J/GEMM",
                      "step CV", "step method usable"), table))


# ------------------------------------------------------------------ 6. noise


def step_noise(ctx: Ctx) -> None:
    from gemmd.config import Config
    from gemmd.probes import build_plan

    dev = ctx.device()
    cfg = Config()
    plan, dropped = build_plan(cfg.probes.sentinels, dev)
    if not plan:
        raise Failed(f"no default sentinel runs on this device: {dropped}")
    rounds = 5 if ctx.quick and ctx.gpu else SENTINEL_ROUNDS
    rows, totals = [], []
    for rnd in range(rounds):
        # The 20 rounds are the point: cut short only far past the budget.
        if ctx.left() < -0.5 * ctx.step.budget_s:
            ctx.step.note = f"only {rnd} of {rounds} rounds: step budget spent"
            break
        e0, t0 = dev.energy_j(), dev.clock()
        for spec in plan:
            rows.append({"round": rnd, **measure_row(dev, spec, cfg.probes.measure)})
        e1, t1 = dev.energy_j(), dev.clock()
        totals.append({"round": rnd, "time_s": t1 - t0,
                       "energy_j": e1 - e0 if e0 is not None and e1 is not None else None})
    ctx.data["noise_rounds"] = totals
    ctx.write_csv("noise.csv", rows)
    table = []
    for spec in plan:
        rs = [r for r in rows if r["probe"] == spec.name and r["outcome"] == "ok"]
        cells = []
        for k in ("runtime_s", "power_w", "energy_j"):
            xs = [r[k] for r in rs]
            cells += [pct(cv(xs)), fmt(lag1(xs), "+.2f")]
        mean_ms = float(np.mean([r["runtime_s"] for r in rs])) * 1e3 if rs else None
        table.append((spec.name, len(rs), fmt(mean_ms, ".4g"), *cells))
    ctx.md(f"{len(totals)} rounds of the {len(plan)} default sentinels back to back, default "
           "MeasureConfig (noise.csv; the daemon's rounds are 2 minutes apart, these are not):",
           "", *md_table(("probe", "rounds ok", "runtime ms", "runtime CV", "r1", "power CV",
                          "r1", "energy CV", "r1"), table))
    if dropped:
        ctx.md("", "Left out of the plan: " + "; ".join(f"{s.name}: {r}"
                                                        for s, r in dropped.items()))
    if len(totals) < rounds:
        ctx.md("", f"Only {len(totals)} rounds ran within the step budget.")
    fail_if_failed(rows, "sentinel probes")


# ------------------------------------------------------------------ 7. launch vs GPU


def step_launch(ctx: Ctx) -> None:
    if not ctx.gpu:
        raise Skip("needs a GPU (host cost of cuBLAS launches)")
    from gemmd.config import MeasureConfig
    from gemmd.probes import ProbeSpec, measure

    dev = ctx.device()
    sizes = [1 << p for p in range(6, 11 if ctx.quick else 13)]  # 64 .. 4096
    cfg = MeasureConfig(window_s=0.1, warmup_s=0.02)
    n_launch = 100  # far below CUDA's launch queue depth, so enqueueing never blocks
    rows = []
    for dtype in ("fp32", "tf32", "bf16", "fp16"):
        for s in sizes:
            if ctx.left() <= 0:
                ctx.step.note = "some sizes not run: step budget spent"
                break
            spec = ProbeSpec(s, s, s, dtype=dtype)
            gpu_s = measure(dev, spec, cfg).runtime_s  # graph replays: GPU time per GEMM
            # NvidiaDevice internals (_bufs, _key, _launcher): the same enqueue call the
            # probe captures into its graphs, launched directly here. A bench script may
            # read private members; the daemon never needs this figure.
            launch = dev._launcher(spec, dev._bufs[dev._key(spec)])
            per = []
            with dev.dev, dev.stream:
                for _ in range(5):
                    launch()
                dev.stream.synchronize()
                for _ in range(3):
                    t = time.perf_counter()
                    for _ in range(n_launch):
                        launch()
                    per.append((time.perf_counter() - t) / n_launch)
                    dev.stream.synchronize()
            host_s = float(np.median(per))
            rows.append({"dtype": dtype, "size": s, "host_launch_s": host_s, "gpu_s": gpu_s,
                         "host_over_gpu": host_s / gpu_s, "gpu_bound": host_s < gpu_s})
    ctx.write_csv("launch.csv", rows)
    table = []
    for dtype in ("fp32", "tf32", "bf16", "fp16"):
        rs = {r["size"]: r for r in rows if r["dtype"] == dtype}
        first = min((s for s, r in rs.items() if r["gpu_bound"]), default=None)
        table.append((dtype, *(f"{rs[s]['host_launch_s'] * 1e6:.1f} / {rs[s]['gpu_s'] * 1e6:.4g}"
                               if s in rs else "-" for s in sizes), first or "none"))
        ctx.figure(f"smallest GPU-bound square size, {dtype} (host enqueue < GPU time)",
                   str(first or "none"), "(reported)", None, counted=False)
    ctx.md(f"Host µs to enqueue one cuBLAS GEMM directly (median of 3 x {n_launch} launches, "
           "no graph) / GPU µs per GEMM from measure() (launch.csv):", "",
           *md_table(("dtype", *map(str, sizes), "GPU-bound from"), table))


# ------------------------------------------------------------------ 8. gemmd run


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


RUNTIME_PREDICTED = "gemmd_probe_runtime_predicted_seconds"


def scrape(port: int) -> dict[str, int]:
    """Series per sample name on /metrics (the exposition parsed by prometheus_client)."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=3) as r:
        text = r.read().decode()
    out: dict[str, int] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[s.name] = out.get(s.name, 0) + 1
    return out


def step_run(ctx: Ctx) -> None:
    import yaml

    duration = 20.0 if ctx.quick else 120.0
    # --quick: past 20 s only while the first round's series have not appeared yet (a
    # worker on a real GPU takes a while to import CuPy and create its context).
    patience = 60.0 if ctx.quick else duration
    every = 2.0 if ctx.quick else 5.0
    port = free_port()
    log: list[str] = []
    with tempfile.TemporaryDirectory(prefix="gemmd-accept-") as tmp:
        # skip_when_busy off: this script's own CUDA context counts as another process on
        # the GPU, and the previous step leaves utilization up; the do-no-harm check has
        # its own tests. Everything else is the default configuration.
        cfg = {"backend": ctx.backend, "isolation": "process", "state_dir": f"{tmp}/state",
               "listen": {"address": "127.0.0.1", "port": port},
               "schedule": {"skip_when_busy": False}}
        cfg_path = Path(tmp) / "gemmd.yaml"
        cfg_path.write_text(yaml.safe_dump(cfg))
        cmd = [sys.executable, "-m", "gemmd", "run", "-c", str(cfg_path)]
        log += [f"$ python {' '.join(cmd[1:])}", f"config: {cfg}", ""]
        err_path = Path(tmp) / "daemon.log"
        with open(err_path, "wb") as err:
            proc = subprocess.Popen(cmd, cwd=ROOT, env=child_env(), stdout=err, stderr=err)
            seen: dict[str, int] = {}
            t0 = time.monotonic()
            try:
                while proc.poll() is None and (
                        (el := time.monotonic() - t0) < duration
                        or (el < patience and not (seen.get("gemmd_probe_runtime_seconds")
                                                   and seen.get(RUNTIME_PREDICTED)))):
                    time.sleep(every if el >= duration else min(every, duration - el))
                    try:
                        got = scrape(port)
                    except OSError as e:
                        log.append(f"{time.monotonic() - t0:6.1f} s  scrape failed: {e}")
                        continue
                    for k, v in got.items():
                        seen[k] = max(seen.get(k, 0), v)
                    log.append(
                        f"{time.monotonic() - t0:6.1f} s  runtime measured "
                        f"{got.get('gemmd_probe_runtime_seconds', 0)} / predicted "
                        f"{got.get(RUNTIME_PREDICTED, 0)}, power "
                        f"{got.get('gemmd_probe_power_watts', 0)} / "
                        f"{got.get('gemmd_probe_power_predicted_watts', 0)}, energy "
                        f"{got.get('gemmd_probe_energy_joules', 0)} / "
                        f"{got.get('gemmd_probe_energy_predicted_joules', 0)}, devices up "
                        f"{got.get('gemmd_device_up', 0)}")
                early = proc.poll()
                t_term = time.monotonic()
                ran_s = t_term - t0
                proc.send_signal(signal.SIGTERM)
                try:
                    rc: int | None = proc.wait(30)
                except subprocess.TimeoutExpired:
                    rc = None
                stop_s = time.monotonic() - t_term
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        tail = err_path.read_text(errors="replace").splitlines()[-60:]
    measured = seen.get("gemmd_probe_runtime_seconds", 0)
    predicted = seen.get(RUNTIME_PREDICTED, 0)
    verdict = [f"daemon exited on its own before SIGTERM: {early}" if early is not None else
               f"SIGTERM: exit {rc} after {stop_s:.1f} s" if rc is not None else
               "SIGTERM: still running after 30 s, killed",
               f"series seen: gemmd_probe_runtime_seconds {measured}, "
               f"gemmd_probe_runtime_predicted_seconds {predicted}"]
    log += ["", *verdict, "", "daemon log (tail):", *tail]
    (ctx.out / "run.txt").write_text("\n".join(log) + "\n")
    ctx.md(f"`gemmd run` (backend {ctx.backend}, isolation process) for "
           f"{ran_s:.0f} s, "
           f"/metrics scraped every {every:.0f} s (run.txt): " + "; ".join(verdict) + ".")
    ok_stop = early is None and rc == 0 and stop_s <= 30
    ctx.figure("gemmd run: measured and predicted series on /metrics",
               f"{measured} / {predicted}", "both > 0", bool(measured and predicted))
    ctx.figure("gemmd run: SIGTERM exit status, seconds",
               f"{rc}, {stop_s:.1f} s" if early is None else f"exited early ({early})",
               "0 within 30 s", ok_stop)
    if not (measured and predicted and ok_stop):
        raise Failed("; ".join(verdict))


# ------------------------------------------------------------------ 9. round cost


def step_round_cost(ctx: Ctx) -> None:
    from gemmd.config import Config

    cfg = Config()
    interval = cfg.schedule.probe_interval_s
    duty_s = cfg.budget.duty_cycle * interval
    dev = ctx.device()
    idle_s = 1.0 if ctx.quick else 2.0
    e0, t0 = dev.energy_j(), dev.clock()
    time.sleep(idle_s)
    e1, t1 = dev.energy_j(), dev.clock()
    idle_w = (e1 - e0) / (t1 - t0) if e0 is not None and e1 is not None and t1 > t0 else None
    rows = []
    probe_rows = [r for r in ctx.data.get("probe_rows", [])
                  if r["kind"] == "sentinel" and r["outcome"] == "ok"]
    if probe_rows:
        gpu = min(r["gpu"] for r in probe_rows)
        rs = [r for r in probe_rows if r["gpu"] == gpu]
        energies = [float(r["energy_j"]) * int(r["iterations"]) for r in rs if r["energy_j"]]
        rows.append({"source": f"step 2 gemmd probe, GPU {gpu}, timed windows only",
                     "probes": len(rs), "time_s": sum(float(r["window_s"]) for r in rs),
                     "energy_j": sum(energies) if len(energies) == len(rs) else None})
    totals = ctx.data.get("noise_rounds") or []
    if totals:
        en = [t["energy_j"] for t in totals if t["energy_j"] is not None]
        rows.append({"source": f"step 6, mean of {len(totals)} rounds, whole protocol "
                               "(allocation, warm-up, windows; energy counter)",
                     "probes": None, "time_s": float(np.mean([t["time_s"] for t in totals])),
                     "energy_j": float(np.mean(en)) if en else None})
    if not rows:
        raise Failed("no default-round measurements (steps 2 and 6 produced none)")
    for r in rows:
        e, t = r["energy_j"], r["time_s"]
        r["idle_power_w"] = idle_w
        r["avg_power_at_interval_w"] = e / interval if e is not None else None
        r["added_power_at_interval_w"] = (e - idle_w * t) / interval \
            if e is not None and idle_w is not None else None
        r["duty_cycle"] = t / interval
    ctx.write_csv("round_cost.csv", rows)
    ctx.md(f"Default probe interval {interval:.0f} s, duty-cycle budget {duty_s:.1f} s per "
           f"round; idle power {fmt(idle_w, '.1f', ' W')} (energy counter over {idle_s:.0f} s "
           "after the runs; round_cost.csv):", "",
           *md_table(("source", "time s", "energy J", "avg power at interval W",
                      "above idle W", "duty cycle"),
                     [(r["source"], fmt(r["time_s"], ".2f"), fmt(r["energy_j"], ".4g"),
                       fmt(r["avg_power_at_interval_w"], ".2f"),
                       fmt(r["added_power_at_interval_w"], ".2f"), pct(r["duty_cycle"]))
                      for r in rows]))
    whole = rows[-1]
    ctx.figure("round device time vs the duty-cycle budget", f"{whole['time_s']:.2f} s",
               f"<= {duty_s:.1f} s", whole["time_s"] <= duty_s)
    ctx.figure("average power a default round adds at the interval",
               fmt(whole["added_power_at_interval_w"], ".2f", " W"), "(reported)", None,
               counted=False)


# ------------------------------------------------------------------ main

STEPS = [
    # (number, title, budget in seconds on an H100: 480 in all; --quick: a third)
    (1, "NVIDIA tests on the GPU", 60, step_pytest),
    (2, "gemmd probe, default plan", 25, step_probe),
    (3, "dtype x layout x tile sweep", 35, step_sweep),
    (4, "throughput fidelity vs cupy/torch", 20, step_fidelity),
    (5, "energy per GEMM: CV by window and method", 48, step_energy),
    (6, f"run-to-run noise, {SENTINEL_ROUNDS} rounds", 150, step_noise),
    (7, "host launch vs GPU time", 12, step_launch),
    (8, "gemmd run, scraped, SIGTERM", 125, step_run),
    (9, "round cost", 5, step_round_cost),
]


def environment(ctx: Ctx) -> list[str]:
    """Date, host, device, and the versions the figures depend on; best effort."""
    out = [f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}",
           f"- host: {platform.node()}, {platform.platform()}, Python "
           f"{platform.python_version()}, {os.cpu_count()} CPUs",
           f"- backend: {ctx.backend}{' (--quick)' if ctx.quick else ''}"]
    info = ctx.device_info()
    if info is not None:
        ex = info.extra
        out.append(f"- device: {info.name} ({info.uuid}), compute capability "
                   f"{ex.get('compute_capability', '-')}, {info.sm_count} SMs, power limit "
                   f"{fmt(info.power_limit_w, '.0f', ' W')}, CUDA ordinal "
                   f"{ex.get('cuda_ordinal', '-')}")
    else:
        names = {r.get("gpu_model") for r in ctx.data.get("probe_rows", [])}
        out.append(f"- device: {', '.join(sorted(n for n in names if n)) or 'not opened'}")

    def ver(label: str, get: Callable[[], str]) -> None:
        try:
            out.append(f"- {label}: {get()}")
        except Exception as e:
            out.append(f"- {label}: unavailable ({type(e).__name__}: {e})")

    def driver() -> str:
        import pynvml

        pynvml.nvmlInit()
        v = pynvml.nvmlSystemGetCudaDriverVersion()
        return f"{pynvml.nvmlSystemGetDriverVersion()}, CUDA {v // 1000}.{v % 1000 // 10}"

    def cuda_runtime() -> str:
        import cupy

        v = cupy.cuda.runtime.runtimeGetVersion()
        return f"CuPy {cupy.__version__}, CUDA runtime {v // 1000}.{v % 1000 // 10}"

    def torch_version() -> str:
        import torch

        return f"{torch.__version__} (CUDA {torch.version.cuda})"

    def gemmd_version() -> str:
        import gemmd

        try:
            rev = subprocess.run(["git", "-C", str(ROOT), "describe", "--always", "--dirty"],
                                 capture_output=True, text=True, timeout=5).stdout.strip()
        except OSError:
            rev = ""
        return f"{gemmd.__version__}" + (f" (git {rev})" if rev else "")

    if ctx.gpu:
        ver("NVIDIA driver", driver)
        ver("CuPy / CUDA", cuda_runtime)
        ver("torch", torch_version)
    ver("numpy", lambda: np.__version__)
    ver("gemmd", gemmd_version)
    return out


def write_summary(ctx: Ctx, steps: Sequence[Step], total_s: float) -> None:
    lines = ["# gemmd GPU acceptance (bench/gpu_accept.py)", "", *environment(ctx),
             f"- total wall time: {total_s:.0f} s", "", "## Steps", ""]
    lines += md_table(("#", "step", "status", "wall s", "budget s", "note"),
                      [(s.num, s.title, s.status, f"{s.wall_s:.1f}", f"{s.budget_s:.0f}", s.note)
                       for s in steps])
    lines += ["", "## Figures and targets", ""]
    lines += md_table(("figure", "value", "target", "met"),
                      [(f.name, f.value, f.target,
                        "-" if f.met is None else ("yes" if f.met else "**NO**")
                        + ("" if f.counted else " (not counted)")) for f in ctx.figures])
    for s in steps:
        lines += ["", f"## {s.num}. {s.title}", "", f"Status: {s.status}"
                  + (f" ({s.note})" if s.note else "") + f", {s.wall_s:.1f} s.", ""]
        lines += s.lines
    (ctx.out / "SUMMARY.md").write_text("\n".join(lines) + "\n")


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("outdir", type=Path)
    ap.add_argument("--backend", choices=("nvidia", "fake"), default="nvidia")
    ap.add_argument("--quick", action="store_true", help="shorter steps (a smoke test)")
    args = ap.parse_args(argv)
    out = args.outdir.resolve()
    out.mkdir(parents=True, exist_ok=True)
    ctx = Ctx(out, args.backend, args.quick)
    steps = [Step(n, t, b / 3 if args.quick else b, fn) for n, t, b, fn in STEPS]
    start = time.monotonic()

    def hung(step: Step) -> None:
        # A GEMM that never returns would hang this process: record it and leave.
        step.status = f"FAILED: still running after {step.wall_s:.0f} s, abandoned"
        with ctx.lock:
            write_summary(ctx, steps, time.monotonic() - start)
        print(f"step {step.num} hung; SUMMARY.md written; exiting", flush=True)
        os._exit(1)

    print(f"gemmd GPU acceptance -> {out} (backend {args.backend}"
          f"{', quick' if args.quick else ''})", flush=True)
    for step in steps:
        ctx.step, ctx.deadline = step, time.monotonic() + step.budget_s
        print(f"[{step.num}] {step.title} (budget {step.budget_s:.0f} s) ...", flush=True)
        limit = step.budget_s * 2 + 300
        step.wall_s = limit
        watchdog = threading.Timer(limit, hung, (step,))
        watchdog.daemon = True
        watchdog.start()
        t0 = time.monotonic()
        try:
            step.fn(ctx)
            step.status = "ok"
        except Skip as e:
            step.status = f"skipped: {e}"
        except Failed as e:
            step.status = f"FAILED: {e}"
        except Exception as e:
            step.status = f"FAILED: {type(e).__name__}: {e}"
            with open(out / "errors.txt", "a") as f:
                f.write(f"step {step.num} ({step.title}):\n{traceback.format_exc()}\n")
        finally:
            watchdog.cancel()
        step.wall_s = time.monotonic() - t0
        over = " (over budget)" if step.wall_s > step.budget_s else ""
        print(f"[{step.num}] {step.status} in {step.wall_s:.1f} s{over}", flush=True)
    ctx.step = None
    total = time.monotonic() - start
    if ctx.gpu and not ctx.quick:
        ctx.figure("total wall time of this run", f"{total:.0f} s", f"< {TOTAL_TARGET_S:.0f} s",
                   total < TOTAL_TARGET_S, counted=False)
    try:
        ctx.close()
    except Exception as e:
        print(f"closing the device: {e}", file=sys.stderr)
    with ctx.lock:
        write_summary(ctx, steps, total)
    failed = [s for s in steps if s.status.startswith("FAILED")]
    missed = [f for f in ctx.figures if f.counted and f.met is False]
    print(f"done in {total:.0f} s: {len(failed)} step(s) failed, {len(missed)} target(s) "
          f"missed; {out / 'SUMMARY.md'}", flush=True)
    for f in missed:
        print(f"  target missed: {f.name}: {f.value} (target {f.target})", flush=True)
    return 1 if failed else 3 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
