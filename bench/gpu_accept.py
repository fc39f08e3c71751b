"""GPU acceptance run of gemmd: one command, every GPU figure, one folder of results.

    python3 bench/gpu_accept.py OUTDIR [--backend nvidia|fake] [--quick] [--deadline S]
        [--only N,...] [--rounds N] [--gap S] [--slowdown clocks|power]

Run from the repository root of a bare checkout with ``PYTHONPATH=$PWD`` (on the lent GPU
machine: ``bench/gpu_accept.sh OUTDIR``, which first installs the wheels of
../shared/gpu/README.md). Steps, in order of value, each run whatever happened to the ones
before, each within its share of ``--deadline`` (default 480 s; the longest steps are cut
first, and SUMMARY.md says what was cut):

1. the machine       GPU, driver, CUDA, library versions, clocks, power limit, ECC, MIG,
                     persistence mode, virtualization (machine.txt, nvidia-smi -q)
2. fidelity.csv      probe TFLOP/s vs the best of cupy.matmul/torch.matmul, 8192^3
                     (target >= 0.98)
3. energy.csv        energy per GEMM over 10 repeats at 0.25-2 s windows, window delta and
                     counter-step method from the same run, the counter's update period
                     (target CV <= 2% at the default)
4. noise.csv         every default sentinel over 20 rounds (--rounds), 2 s apart on a GPU
                     (--gap): CV, lag-1 autocorrelation, and the shape of the
                     distribution (noise_stats.csv: kurtosis, tails)
5. round_cost.csv    energy and time of one default round, average power at the interval;
                     phases.csv: where each probe's time goes beyond its window, host reads
6. slowdown.csv      SM clocks lowered ~5% then ~10% (else the power limit), the default plan
                     at each, restored; the rounds replayed through gemmd's drift detector
                     (slowdown_drift.csv)
7. launch.csv        host cost of one direct cuBLAS launch vs GPU time per GEMM, by size
8. sweep.csv         cuBLAS dtype x layout at three shapes; the tiled kernel, tiles 1..32
9. probe_default.csv ``gemmd probe`` on the configured sentinels (the CLI, a subprocess)
10. pytest.txt       the NVIDIA tests on this GPU (tests/test_gpu_contract.py, test_nvidia.py)
11. run.txt          a 2-minute ``gemmd run`` (worker processes), /metrics scraped, RSS of the
                     daemon and each worker, SIGTERM

OUTDIR receives SUMMARY.md (the environment, every step's status and wall time, each figure
beside its target) and results.tar.gz (every file above), both rewritten after every step:
at most 6 files, as the lent machine returns at most 8, and a run killed at any point still
returns what it did. ``--backend fake`` runs what it can on the simulated GPU (steps 2, 6
and 7 need a real GPU and are skipped); ``--quick`` shortens every step. Exit status: 0 all
well, 1 a step failed, 2 bad arguments, 3 no step failed but a target was missed.
"""

from __future__ import annotations

import argparse
import atexit
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
import tarfile
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
# Idle between step 4's rounds on a GPU: back to back they heat the card, and an H100's
# power-capped bf16 sentinel read 2.1% runtime CV where 2 s apart it read 0.69%
# (bench/results/2026-11-26-h100*); the daemon's rounds are 120 s apart.
GPU_GAP_S = 2.0


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
    budget_s: float  # granted by the plan (--deadline)
    fn: Callable[[Ctx], None]
    nominal_s: float = 0.0  # asked for
    min_s: float = 0.0  # less than this, and the step is not worth starting
    status: str = "not run"
    note: str = ""
    wall_s: float = 0.0
    lines: list[str] = field(default_factory=list)


class Ctx:
    """What the steps share: the output folder, the in-process device, results, summary."""

    def __init__(self, out: Path, work: Path, backend: str, quick: bool):
        # ``out`` gets SUMMARY.md and one archive of ``work``, where steps write their files.
        self.out, self.work, self.backend, self.quick = out, work, backend, quick
        self.figures: list[Figure] = []
        self.data: dict[str, Any] = {}
        self.env: list[str] = []  # the machine, as SUMMARY.md describes it (step 1)
        self.step: Step | None = None
        self.deadline = math.inf  # the current step's
        self.end = math.inf  # the whole run's (--deadline)
        self._devices: list[Any] | None = None
        self.lock = threading.Lock()
        # Step 4's rounds and the idle seconds between them; step 6's lever.
        self.rounds, self.gap_s, self.slowdown = SENTINEL_ROUNDS, 0.0, "clocks"

    @property
    def gpu(self) -> bool:
        return self.backend == "nvidia"

    def left(self) -> float:
        """Seconds left of the current step's budget (never past the run's deadline)."""
        return min(self.deadline, self.end) - time.monotonic()

    def left_in_run(self) -> float:
        """Seconds left before the run's deadline."""
        return self.end - time.monotonic()

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
        path = self.work / name
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


def shape_stats(xs: Sequence[float | None]) -> dict[str, Any]:
    """The shape of a noise sample: CV, lag-1 autocorrelation, skewness, excess kurtosis,
    the largest deviation from the median in sd and in robust sd (1.4826 MAD), outliers
    (over 3.5 robust sd) per 100 values; None where too few values."""
    x = np.asarray([v for v in xs if v is not None and math.isfinite(v)], dtype=float)
    out: dict[str, Any] = {"n": len(x), "cv": cv(x), "lag1": lag1(x), "skew": None,
                           "excess_kurtosis": None, "max_dev_sd": None,
                           "max_dev_robust_sd": None, "outliers_per_100": None,
                           "robust_cv": None}
    if len(x) < 4:
        return out
    d = x - x.mean()
    sd = float(x.std(ddof=1))
    med = float(np.median(x))
    rsd = 1.4826 * float(np.median(np.abs(x - med)))
    if sd > 0:
        m2 = float(np.mean(d ** 2))
        out["skew"] = float(np.mean(d ** 3) / m2 ** 1.5)
        out["excess_kurtosis"] = float(np.mean(d ** 4) / m2 ** 2 - 3.0)
        out["max_dev_sd"] = float(np.max(np.abs(x - med)) / sd)
    if rsd > 0:
        out["max_dev_robust_sd"] = float(np.max(np.abs(x - med)) / rsd)
        out["outliers_per_100"] = float(100.0 * np.mean(np.abs(x - med) > 3.5 * rsd))
        out["robust_cv"] = rsd / med if med else None
    return out


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
    from gemmd.devices.base import measure
    from gemmd.errors import UnsupportedProbe

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
            "sm_clock_hz": after.get("sm_clock_hz"), "mem_clock_hz": after.get("mem_clock_hz"),
            "temperature_c": after.get("temperature_c"), "pstate": after.get("pstate"),
            "power_limit_w": after.get("power_limit_w"),
            "clock_event_reasons": "|".join(after.get("clock_event_reasons") or []),
            **{f"phase_{k}": v for k, v in (m.context.get("phases") or {}).items()},
            "t_end": time.monotonic()}


def fail_if_failed(rows: Sequence[dict[str, Any]], what: str) -> None:
    bad = [r for r in rows if r.get("outcome") == "failed"]
    if bad:
        raise Failed(f"{len(bad)} {what} failed, first: {bad[0]['probe']}: {bad[0]['error']}")


# ------------------------------------------------------------------ 1. pytest


def step_pytest(ctx: Ctx) -> None:
    if ctx.backend == "fake" and ctx.quick:
        raise Skip("--quick on the fake backend")
    # No -x: one failing test must not hide the others (the real cuBLAS call among them).
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
           "tests/test_gpu_contract.py", "tests/test_nvidia.py"]
    rc, out, err = run_cmd(cmd, timeout=max(10.0, ctx.left() + 30))
    (ctx.work / "pytest.txt").write_text(
        f"$ python {' '.join(cmd[1:])}\n{out}{err}\nexit status {rc}\n")
    last = next((ln for ln in reversed((out + err).splitlines()) if ln.strip()), "")
    ctx.md(f"`python -m pytest -q tests/test_gpu_contract.py tests/test_nvidia.py`: "
           f"exit {rc}, `{last.strip()}` (pytest.txt)")
    if rc != 0:
        raise Failed(f"pytest exit {rc}: {last.strip()}")


# ------------------------------------------------------------------ 2. gemmd probe


def step_probe(ctx: Ctx) -> None:
    cmd = [sys.executable, "-m", "gemmd", "probe", "-c", str(ROOT / "gemmd.yaml"),
           "--backend", ctx.backend, "--format", "csv", "--no-store", "--force"]
    rc, out, err = run_cmd(cmd, timeout=max(10.0, ctx.left() + 30))
    (ctx.work / "probe_default.csv").write_text(out)
    (ctx.work / "probe_default.log").write_text(err)
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
    from gemmd.gemm import ProbeSpec

    dev = ctx.device()
    shapes = [(1024, 1024, 1024), (4096, 4096, 4096), (8192, 8192, 1024)]
    tiled_shapes = [(1024, 1024, 1024), (2048, 2048, 2048)]
    if ctx.quick:
        shapes, tiled_shapes = shapes[:2], tiled_shapes[:1]
    # The tiles first (GPPerf's finding); tiles 1 and 2 at 2048^3 take a good part of a
    # second per GEMM: last of them, so that the budget cuts them first.
    tiled = [ProbeSpec(*s, dtype="fp32", kernel="tiled", tile=t)
             for i, s in enumerate(tiled_shapes)
             for t in ((32, 16, 8, 4, 2, 1) if i else (1, 2, 4, 8, 16, 32))]
    specs = tiled[:-2] + [ProbeSpec(*s, dtype=d, layout=lay) for s in shapes
                          for d in ("fp64", "fp32", "tf32", "fp16", "bf16")
                          for lay in ("nn", "nt", "tn", "tt")] + tiled[-2:]
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
    # fp32 means fp32, as probed. torch >= 2.9 sets this with fp32_precision ("tf32" or
    # "ieee"); allow_tf32 is deprecated there.
    mm = torch.backends.cuda.matmul
    knob = "fp32_precision" if hasattr(mm, "fp32_precision") else "allow_tf32"
    was = getattr(mm, knob)
    want = ("tf32" if dtype == "tf32" else "ieee") if knob == "fp32_precision" \
        else dtype == "tf32"
    dev = torch.device("cuda", ordinal)
    with torch.cuda.device(ordinal):
        setattr(mm, knob, want)
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
            setattr(mm, knob, was)
            torch.cuda.synchronize(dev)
            torch.cuda.empty_cache()


def step_fidelity(ctx: Ctx) -> None:
    if not ctx.gpu:
        raise Skip("needs a GPU (compares with cupy.matmul and torch.matmul)")
    from gemmd.config import MeasureConfig
    from gemmd.devices.base import measure
    from gemmd.gemm import ProbeSpec

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
    from gemmd.devices.base import energy_figures, iterations_for_window, power_between_steps
    from gemmd.gemm import ProbeSpec

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
            # ONE window for both methods, time-bounded as measure()'s
            run = dev.run_observed(spec, iters, cancel, max_s=w)
            n, span = len(run.times), run.t1 - run.t0
            e_win, p_win = energy_figures(run.e0, run.e1, span, n)
            p_step = power_between_steps(run.steps, span)
            mean_t = float(np.mean(run.times)) if run.times else None
            gaps = np.diff([t for t, _ in run.steps])
            rows.append({"window_s": w, "repeat": rep, "iterations": n, "run_window_s": span,
                         "counter_steps": len(run.steps),
                         "counter_period_s": float(np.median(gaps)) if len(gaps) else None,
                         "counter_period_p10_s": float(np.percentile(gaps, 10))
                         if len(gaps) else None,
                         "counter_period_p90_s": float(np.percentile(gaps, 90))
                         if len(gaps) else None,
                         "mean_gemm_s": mean_t,
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
    periods = [r["counter_period_s"] for r in rows if r["counter_period_s"]]
    if periods:
        lo = float(np.percentile([r["counter_period_p10_s"] for r in rows
                                  if r["counter_period_p10_s"]], 50))
        hi = float(np.percentile([r["counter_period_p90_s"] for r in rows
                                  if r["counter_period_p90_s"]], 50))
        ctx.figure("NVML energy counter update period (median of windows; p10-p90)",
                   f"{np.median(periods) * 1e3:.1f} ms ({lo * 1e3:.1f}-{hi * 1e3:.1f})",
                   "(reported: sets the step method's precision)", None, counted=False)
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
    rounds = 5 if ctx.quick and ctx.gpu else ctx.rounds
    rows, totals = [], []
    for rnd in range(rounds):
        # The 20 rounds are the point: cut short only far past the budget.
        if ctx.left() < -0.5 * ctx.step.budget_s or ctx.left_in_run() < 0:
            ctx.step.note = f"only {rnd} of {rounds} rounds: step budget spent"
            break
        if rnd and ctx.gap_s:
            time.sleep(ctx.gap_s)  # --gap: the GPU idles between rounds, as in the daemon
        e0, t0 = dev.energy_j(), dev.clock()
        for spec in plan:
            rows.append({"round": rnd, **measure_row(dev, spec, cfg.probes.measure)})
        e1, t1 = dev.energy_j(), dev.clock()
        totals.append({"round": rnd, "time_s": t1 - t0,
                       "energy_j": e1 - e0 if e0 is not None and e1 is not None else None})
    ctx.data["noise_rounds"] = totals
    ctx.data["noise_rows"], ctx.data["noise_plan"] = rows, plan
    ctx.write_csv("noise.csv", rows)
    table, shape_rows, shape_table = [], [], []
    for spec in plan:
        rs = [r for r in rows if r["probe"] == spec.name and r["outcome"] == "ok"]
        cells = []
        for k in ("runtime_s", "power_w", "energy_j"):
            xs = [r[k] for r in rs]
            cells += [pct(cv(xs)), fmt(lag1(xs), "+.2f")]
            st = shape_stats(xs)
            shape_rows.append({"probe": spec.name, "quantity": k, **st})
            shape_table.append((spec.name, k.split("_")[0], st["n"], fmt(st["skew"], "+.2f"),
                                fmt(st["excess_kurtosis"], "+.2f"), fmt(st["max_dev_sd"], ".2f"),
                                fmt(st["max_dev_robust_sd"], ".2f"),
                                fmt(st["outliers_per_100"], ".1f"), pct(st["robust_cv"])))
        mean_ms = float(np.mean([r["runtime_s"] for r in rs])) * 1e3 if rs else None
        table.append((spec.name, len(rs), fmt(mean_ms, ".4g"), *cells))
    ctx.write_csv("noise_stats.csv", shape_rows)
    spacing = f"{ctx.gap_s:g} s of idle between rounds" if ctx.gap_s else "back to back"
    ctx.md(f"{len(totals)} rounds of the {len(plan)} default sentinels, {spacing}, default "
           "MeasureConfig (noise.csv; the daemon's rounds are 2 minutes apart):",
           "", *md_table(("probe", "rounds ok", "runtime ms", "runtime CV", "r1", "power CV",
                          "r1", "energy CV", "r1"), table), "",
           "The shape of the noise (noise_stats.csv): sample skewness and excess kurtosis "
           "(0 for a Gaussian), the largest deviation from the median in standard deviations "
           "and in robust ones (1.4826 x MAD), outliers (over 3.5 robust sd) per 100 probes, "
           "robust CV:", "",
           *md_table(("probe", "quantity", "n", "skew", "ex. kurtosis", "max dev / sd",
                      "max dev / robust sd", "outliers /100", "robust CV"), shape_table))
    if dropped:
        ctx.md("", "Left out of the plan: " + "; ".join(f"{s.name}: {r}"
                                                        for s, r in dropped.items()))
    if len(totals) < rounds:
        ctx.md("", f"Only {len(totals)} rounds ran within the step budget.")
    fail_if_failed(rows, "sentinel probes")


# ------------------------------------------------------------------ 6. a real slowdown

# What undoes a change to the GPU's clocks or power limit: run at the end of the step, at a
# watchdog's exit, and at the interpreter's (atexit), so that no run leaves the GPU slowed.
_RESTORE: list[Callable[[], Any]] = []


def restore_clocks() -> None:
    while _RESTORE:
        fn = _RESTORE.pop()
        try:
            fn()
        except Exception as e:
            print(f"gpu_accept: restoring the GPU's settings: {type(e).__name__}: {e}",
                  file=sys.stderr, flush=True)


atexit.register(restore_clocks)
SLOW_ROUNDS = 3  # rounds at each lowered level: the target is an alarm within 3


def replay_drift(rounds: Sequence[tuple[str, list[dict[str, Any]]]], plan: Sequence[Any],
                 uuid: str, interval_s: float, rebaseline_after: str | None = None
                 ) -> list[dict[str, Any]]:
    """Feed measured rounds to gemmd's DriftMonitor as rounds.py does (default drift
    config, the plan closing each round, power/energy only from counter steps), one round
    every ``interval_s`` of simulated time. The predictions are each probe's first
    measured values, held fixed: a fitted model's prediction of a sentinel is a constant
    between refits (it depends on the shape and the GPU model only), and the detector
    judges log residuals against a reference it learns, so the constant's level cancels.
    Returns one row per round: alarms raised (probe and pooled), what is drifting."""
    from gemmd.config import Config
    from gemmd.drift import DriftMonitor

    mon = DriftMonitor(Config().drift)
    by_name = {spec.name: spec for spec in plan}
    first: dict[str, dict[str, float | None]] = {}
    out = []
    now = 0.0
    for i, (phase, rows) in enumerate(rounds):
        raised = []
        for r in rows:
            if r.get("outcome") != "ok" or r["probe"] not in by_name:
                continue
            steps_ok = r.get("energy_method") == "steps"
            measured = {"runtime": r["runtime_s"],
                        "power": r["power_w"] if steps_ok else None,
                        "energy": r["energy_j"] if steps_ok else None}
            pred = first.setdefault(r["probe"], dict(measured))
            context = {k: r.get(k) for k in CONTEXT_KEYS}
            raised += [f"{a.target}:{a.spec.name if a.spec else 'pooled'}"
                       for a in mon.observe(uuid, by_name[r["probe"]], measured, pred, {},
                                            now=now, plan=plan, context=context)]
        drifting = sorted({f"{t}:{s.name}" for (u, s, t), tr in mon.tracks.items()
                           if tr.drifting})
        pooled = sorted(t for t, d in mon.devices.get(uuid, _NoDev).targets.items()
                        if d.drifting)
        out.append({"round": i, "phase": phase, "alarms_raised": " ".join(raised),
                    "device_drifting": mon.device_drifting(uuid),
                    "pooled_drifting": " ".join(pooled), "probes_drifting": " ".join(drifting),
                    "cause": "; ".join(f"{t}: {mon.cause(uuid, t)[1]}" for t in pooled)})
        now += interval_s
        if rebaseline_after is not None and phase == rebaseline_after and (
                i + 1 == len(rounds) or rounds[i + 1][0] != phase):
            mon.rebaseline(uuid, now=now)
            out.append({"round": i, "phase": "after `rebaseline` (in-process)",
                        "alarms_raised": "", "device_drifting": mon.device_drifting(uuid),
                        "pooled_drifting": "", "probes_drifting": " ".join(sorted(
                            f"{t}:{s.name}" for (u, s, t), tr in mon.tracks.items()
                            if tr.drifting))})
    return out


CONTEXT_KEYS = ("sm_clock_hz", "mem_clock_hz", "temperature_c", "power_limit_w",
                "clock_event_reasons")


def replay_report(rounds: Sequence[tuple[str, list[dict[str, Any]]]], plan: Sequence[Any],
                  uuid: str, levels: Sequence[str], interval_s: float
                  ) -> tuple[list[dict[str, Any]], list[str], list[Figure]]:
    """Replay (``replay_drift``, a rebaseline after the last level) and say what it
    shows: (rows, markdown lines, figures)."""
    from gemmd.config import Config

    replay = replay_drift(rounds, plan, uuid, interval_s, rebaseline_after=levels[-1])
    lines = ["Drift replayed (slowdown_drift.csv): the stock rounds (the first "
             f"{Config().drift.baseline_probes} the baseline), then the lowered ones, "
             f"{interval_s:.0f} s apart in simulated time, probes "
             f"{', '.join(s.name for s in plan)}:", "",
             *md_table(("round", "phase", "alarms raised", "device alarm", "pooled",
                        "cause named", "probes drifting"),
                       [(r["round"], r["phase"], r["alarms_raised"] or "-",
                         "yes" if r["device_drifting"] else "no", r["pooled_drifting"] or "-",
                         r.get("cause") or "-", r["probes_drifting"] or "-")
                        for r in replay])]
    figures = []
    healthy = [r for r in replay if r["phase"] == "stock"]
    false_alarms = sum(bool(r["alarms_raised"]) for r in healthy)
    figures.append(Figure("false alarms over the stock rounds (after the baseline)",
                          str(false_alarms), "0", false_alarms == 0))
    slowed = [r for r in replay if r["phase"] == levels[0]]
    hit = next((k for k, r in enumerate(slowed) if r["device_drifting"]), None)
    figures.append(Figure(f"rounds until the device alarm at {levels[0]}",
                          str(hit + 1) if hit is not None else f"none in {len(slowed)}",
                          "<= 3", hit is not None and hit < 3))
    if hit is not None:
        cause = slowed[hit].get("cause") or ""
        want = "power limit" if levels[0].startswith("power limit") else "clocks"
        figures.append(Figure("the cause the alarm names", cause or "-", f"{want} down",
                              want in cause))
    after = [r for r in replay if r["phase"].startswith("after `rebaseline`")]
    if after:
        figures.append(Figure("`rebaseline` clears the alarm (in-process "
                              "DriftMonitor.rebaseline)",
                              "yes" if not after[0]["device_drifting"] else "no", "yes",
                              not after[0]["device_drifting"]))
    return replay, lines, figures


def replay_archive(archive: Path, probes: Sequence[str] = ()) -> int:
    """``--replay ARCHIVE``: the slowdown of a past run (results.tar.gz) through today's
    drift detector; ``probes`` limits the plan (e.g. today's default sentinels)."""
    from gemmd.config import Config
    from gemmd.gemm import ProbeSpec

    with tarfile.open(archive) as tar:
        def rows_of(name: str) -> list[dict[str, Any]]:
            m = next(m for m in tar.getmembers() if m.name.endswith("/" + name))
            f = tar.extractfile(m)
            assert f is not None
            return [{k: _num(v) for k, v in r.items()}
                    for r in csv.DictReader(io.StringIO(f.read().decode()))]
        base, slow = rows_of("noise.csv"), rows_of("slowdown.csv")
    names = list(dict.fromkeys(r["probe"] for r in base))
    names = [n for n in names if not probes or n in probes]
    first = {r["probe"]: r for r in base}
    plan = [ProbeSpec(int(first[n]["m"]), int(first[n]["n"]), int(first[n]["k"]),
                      first[n]["dtype"], first[n]["kernel"], int(first[n]["tile"]),
                      first[n]["layout"]) for n in names]
    rounds: list[tuple[str, list[dict[str, Any]]]] = []
    for rows, key in ((base, "stock"), (slow, None)):
        for rnd in dict.fromkeys(r["round"] for r in rows):
            rr = [r for r in rows if r["round"] == rnd]
            rounds.append((key or rr[0]["phase"], rr))
    levels = [p for p in dict.fromkeys(ph for ph, _ in rounds) if p not in ("stock",
                                                                             "restored")]
    _, lines, figures = replay_report(rounds, plan, "GPU-replay", levels,
                                      Config().schedule.probe_interval_s)
    print(f"Replay of {archive} with today's drift defaults:\n")
    print("\n".join(lines))
    print()
    print("\n".join(md_table(("figure", "value", "target", "met"),
                              [(f.name, f.value, f.target, "-" if f.met is None else
                                "yes" if f.met else "**NO**") for f in figures])))
    return 0


def _num(v: str) -> Any:
    try:
        return float(v) if v not in ("", "True", "False") else (v == "True" if v else None)
    except ValueError:
        return v


class _NoDev:
    targets: dict[str, Any] = {}


class _NotTried(Exception):
    """A lever of step 6 left alone on purpose."""


def step_slowdown(ctx: Ctx) -> None:
    """Lower the SM clocks (NVML locked clocks; else the power limit) by ~5% then ~10% of
    the clock the sentinels ran at (with --slowdown power: the power limit by 10% then
    20%), measure the default plan at each, restore; replay the stock rounds of step 4 and
    these through gemmd's drift detector."""
    if not ctx.gpu:
        raise Skip("needs a GPU (NVML clock and power-limit control)")
    base = ctx.data.get("noise_rows")
    plan = ctx.data.get("noise_plan")
    if not base or not plan:
        raise Skip("no stock rounds to compare with: step 4 did not run")
    import pynvml as nv

    from gemmd.config import Config

    dev = ctx.device()
    nv.nvmlInit()
    h = nv.nvmlDeviceGetHandleByIndex(dev.info.index)
    answers: dict[str, str] = {}
    clocks: dict[str, list[float]] = {}
    for r in base:
        if r.get("sm_clock_hz"):
            clocks.setdefault(r["probe"], []).append(float(r["sm_clock_hz"]) / 1e6)
    max_sm = nv.nvmlDeviceGetMaxClockInfo(h, nv.NVML_CLOCK_SM)
    f0 = max(float(np.median(v)) for v in clocks.values()) if clocks else float(max_sm)
    mem = max(nv.nvmlDeviceGetSupportedMemoryClocks(h))
    supported = sorted(nv.nvmlDeviceGetSupportedGraphicsClocks(h, mem))

    def snap(target: float) -> int:
        return max((c for c in supported if c <= target), default=supported[0])

    levels: list[tuple[str, Callable[[], None], str]] = []
    power_levels = (("-15%", 0.85), ("-30%", 0.70))
    if ctx.slowdown == "power":  # --slowdown power: the power-capped probes' lever
        power_levels = (("-10%", 0.90), ("-20%", 0.80))
    try:  # nvidia-smi -lgc: locked clocks, a range; the top is what lowers them
        if ctx.slowdown != "clocks":
            raise _NotTried("not tried (--slowdown power)")
        nv.nvmlDeviceSetGpuLockedClocks(h, supported[0], snap(f0))
        answers["locked clocks (nvidia-smi -lgc)"] = "permitted"
        _RESTORE.append(lambda: nv.nvmlDeviceResetGpuLockedClocks(h))
        for pct_, frac in (("-5%", 0.95), ("-10%", 0.90)):
            c = snap(frac * f0)
            levels.append((f"clocks {pct_} ({c} MHz)",
                           lambda c=c: nv.nvmlDeviceSetGpuLockedClocks(h, supported[0], c),
                           f"SM clock capped at {c} MHz ({c / f0 - 1:+.1%} of {f0:.0f})"))
    except _NotTried as e:
        answers["locked clocks (nvidia-smi -lgc)"] = str(e)
    except nv.NVMLError as e:
        answers["locked clocks (nvidia-smi -lgc)"] = f"refused: {e}"
    limit_mw = nv.nvmlDeviceGetPowerManagementLimit(h)
    try:  # nvidia-smi -pl: set to what it is (no change) to learn whether it is allowed
        nv.nvmlDeviceSetPowerManagementLimit(h, limit_mw)
        answers["power limit (nvidia-smi -pl)"] = "permitted"
        _RESTORE.append(lambda: nv.nvmlDeviceSetPowerManagementLimit(h, limit_mw))
        if not levels:
            lo = nv.nvmlDeviceGetPowerManagementLimitConstraints(h)[0]
            for pct_, frac in power_levels:
                mw = int(max(lo, frac * limit_mw))
                levels.append((f"power limit {pct_} ({mw / 1000:.0f} W)",
                               lambda mw=mw: nv.nvmlDeviceSetPowerManagementLimit(h, mw),
                               f"power limit {mw / 1000:.0f} W (was {limit_mw / 1000:.0f})"))
    except nv.NVMLError as e:
        answers["power limit (nvidia-smi -pl)"] = f"refused: {e}"
    ctx.md("What root may change on this GPU: " + "; ".join(f"{k}: {v}"
                                                            for k, v in answers.items()))
    ctx.data["slowdown_answers"] = answers
    if not levels:
        raise Skip("neither the clocks nor the power limit can be lowered here: "
                   + "; ".join(f"{k}: {v}" for k, v in answers.items()))
    cfg = Config()
    rows: list[dict[str, Any]] = []
    rounds: list[tuple[str, list[dict[str, Any]]]] = []
    stock = sorted({r["round"] for r in base})
    rounds += [("stock", [r for r in base if r["round"] == i]) for i in stock]
    schedule = [(name, apply, note, SLOW_ROUNDS) for name, apply, note in levels]
    schedule.append(("restored", restore_clocks, "settings restored", 1))
    try:
        for name, apply, note, n in schedule:
            apply()
            time.sleep(0.2)  # the new clocks to take
            for k in range(n):
                if ctx.left_in_run() < 8 and name != "restored":
                    ctx.step.note = f"{name}: {k} of {n} rounds before the deadline"
                    break
                rr = [{"phase": name, "setting": note, "round": len(rounds),
                       **measure_row(dev, spec, cfg.probes.measure)} for spec in plan]
                rows += rr
                rounds.append((name, rr))
    finally:
        restore_clocks()
    ctx.write_csv("slowdown.csv", rows)
    replay, replay_lines, replay_figures = replay_report(
        rounds, plan, dev.info.uuid, [name for name, _, _ in levels],
        cfg.schedule.probe_interval_s)
    ctx.write_csv("slowdown_drift.csv", replay)
    # Per level and probe: runtime against the stock median, and what NVML said.
    stock_med = {spec.name: float(np.median([r["runtime_s"] for r in base
                                             if r["probe"] == spec.name and r.get("runtime_s")]))
                 for spec in plan}
    table = []
    for name, _, _ in levels + [("restored", None, None)]:  # type: ignore[list-item]
        for spec in plan:
            rs = [r for r in rows if r["phase"] == name and r["probe"] == spec.name
                  and r.get("outcome") == "ok"]
            if not rs:
                continue
            ratio = float(np.median([r["runtime_s"] for r in rs])) / stock_med[spec.name]
            reasons = sorted({x for r in rs for x in (r["clock_event_reasons"] or "").split("|")
                              if x})
            table.append((name, spec.name, f"{ratio:.3f}",
                          fmt(float(np.median([r["sm_clock_hz"] for r in rs])) / 1e6, ".0f"),
                          ", ".join(reasons) or "-"))
    ctx.md("", f"Stock SM clock under the sentinels: {f0:.0f} MHz (max {max_sm}). Each level "
           f"{SLOW_ROUNDS} rounds of the default plan (slowdown.csv):", "",
           *md_table(("level", "probe", "runtime / stock median", "SM MHz",
                      "clock event reasons"), table))
    ctx.md("", *replay_lines)
    for f in replay_figures:
        ctx.figure(f.name, f.value, f.target, f.met, f.counted)


# ------------------------------------------------------------------ 7. launch vs GPU


def step_launch(ctx: Ctx) -> None:
    if not ctx.gpu:
        raise Skip("needs a GPU (host cost of cuBLAS launches)")
    from gemmd.config import MeasureConfig
    from gemmd.devices.base import measure
    from gemmd.gemm import ProbeSpec

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


def rss_tree(pid: int) -> dict[int, tuple[str, int]]:
    """{pid: (role, resident bytes)} of a process and its descendants, from /proc."""
    kids: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            kids.setdefault(ppid, []).append(int(d.name))
    out, todo = {}, [pid]
    while todo:
        p = todo.pop()
        try:
            status = Path(f"/proc/{p}/status").read_text()
            cmd = Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        rss = next((int(ln.split()[1]) * 1024 for ln in status.splitlines()
                    if ln.startswith("VmRSS:")), 0)
        role = "daemon" if p == pid else "worker" if "multiprocessing" in cmd or \
            "spawn" in cmd else "child"
        out[p] = (role, rss)
        todo += kids.get(p, [])
    return out


def step_run(ctx: Ctx) -> None:
    import yaml

    # Two minutes, less where the deadline is nearer (SIGTERM and the log take ~15 s).
    duration = min(20.0 if ctx.quick else 120.0, max(10.0, ctx.left() - 15))
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
            rss_max: dict[int, tuple[str, int]] = {}
            rss_last: dict[int, tuple[str, int]] = {}
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
                    rss_last = rss_tree(proc.pid)
                    for p, (role, rss) in rss_last.items():
                        if rss >= rss_max.get(p, (role, 0))[1]:
                            rss_max[p] = (role, rss)
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
    (ctx.work / "run.txt").write_text("\n".join(log) + "\n")
    rss_lines = [f"{role} pid {p}: RSS {rss_last.get(p, (role, 0))[1] / 2**20:.0f} MiB at the "
                 f"end, {mx / 2**20:.0f} MiB at most"
                 for p, (role, mx) in sorted(rss_max.items(), key=lambda kv: kv[0])]
    with open(ctx.work / "run.txt", "a") as f:
        f.write("\nResident memory (sampled at each scrape):\n" + "\n".join(rss_lines) + "\n")
    ctx.md(f"`gemmd run` (backend {ctx.backend}, isolation process) for "
           f"{ran_s:.0f} s, "
           f"/metrics scraped every {every:.0f} s (run.txt): " + "; ".join(verdict) + ".", "",
           "Resident memory: " + "; ".join(rss_lines) + ".")
    daemon_rss = [mx for role, mx in rss_max.values() if role == "daemon"]
    worker_rss = [mx for role, mx in rss_max.values() if role != "daemon"]
    ctx.figure("gemmd run: peak RSS of the daemon / of each worker process",
               f"{fmt(max(daemon_rss, default=None) and max(daemon_rss) / 2**20, '.0f')} MiB"
               f" / {', '.join(f'{x / 2**20:.0f}' for x in worker_rss) or '-'} MiB",
               "(recorded)", None, counted=False)
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
    rows = []
    probe_rows = [r for r in ctx.data.get("probe_rows", [])
                  if r["kind"] == "sentinel" and r["outcome"] == "ok"]
    if probe_rows:
        gpu = min(r["gpu"] for r in probe_rows)
        rs = [r for r in probe_rows if r["gpu"] == gpu]
        energies = [float(r["energy_j"]) * int(r["iterations"]) for r in rs if r["energy_j"]]
        rows.append({"source": f"step 9 gemmd probe, GPU {gpu}, timed windows only",
                     "probes": len(rs), "time_s": sum(float(r["window_s"]) for r in rs),
                     "energy_j": sum(energies) if len(energies) == len(rs) else None})
    totals = ctx.data.get("noise_rounds") or []
    if totals:
        en = [t["energy_j"] for t in totals if t["energy_j"] is not None]
        rows.append({"source": f"step 4, mean of {len(totals)} rounds, whole protocol "
                               "(allocation, warm-up, windows; energy counter)",
                     "probes": None, "time_s": float(np.mean([t["time_s"] for t in totals])),
                     "energy_j": float(np.mean(en)) if en else None})
    if not rows:
        raise Skip("no default-round measurements: step 4 did not run")
    dev = ctx.device()
    idle_s = 1.0 if ctx.quick else 2.0
    e0, t0 = dev.energy_j(), dev.clock()
    time.sleep(idle_s)
    e1, t1 = dev.energy_j(), dev.clock()
    idle_w = (e1 - e0) / (t1 - t0) if e0 is not None and e1 is not None and t1 > t0 else None
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
    probe_phases(ctx, dev)
    whole = rows[-1]
    ctx.figure("round device time vs the duty-cycle budget", f"{whole['time_s']:.2f} s",
               f"<= {duty_s:.1f} s", whole["time_s"] <= duty_s)
    ctx.figure("average power a default round adds at the interval",
               fmt(whole["added_power_at_interval_w"], ".2f", " W"), "(reported)", None,
               counted=False)


def probe_phases(ctx: Ctx, dev: Any) -> None:
    """Where each default sentinel's device time goes beyond its window (step 4's rows,
    median per phase), and what the host-side reads around a window cost (30 calls each):
    the overhead that decides the default plan's cost (issue 23)."""
    noise = [r for r in ctx.data.get("noise_rows") or [] if r.get("outcome") == "ok"]
    rows: list[dict[str, Any]] = []
    for name in dict.fromkeys(r["probe"] for r in noise):
        rs = [r for r in noise if r["probe"] == name]
        keys = [k for k in rs[0] if k.startswith("phase_")]
        rows.append({"what": name, "n": len(rs), "elapsed_s": float(np.median(
            [r["elapsed_s"] for r in rs])), **{k[6:]: float(np.median([r[k] for r in rs]))
                                               for k in keys}})
    calls: dict[str, Callable[[], Any]] = {
        "energy_j": dev.energy_j, "power_w": dev.power_w, "context": dev.context,
        "busy_reason": dev.busy_reason}
    for name, fn in calls.items():
        took = []
        for _ in range(30):
            t0 = time.perf_counter()
            try:
                fn()
            except Exception as e:  # a figure, not a failure of the step
                rows.append({"what": f"host call {name}", "error": f"{type(e).__name__}: {e}"})
                break
            took.append(time.perf_counter() - t0)
        if took:
            rows.append({"what": f"host call {name}", "n": len(took),
                         "elapsed_s": float(np.median(took)), "max_s": max(took)})
    rows.extend(call_overhead(dev))
    ctx.write_csv("phases.csv", rows)
    cols = ("prepare_s", "warmup_s", "before_window_s", "window_s", "after_window_s",
            "check_s")
    ctx.md("", "Where a default probe's device time goes (phases.csv, medians over step 4's "
           "rounds, ms) and the host reads around a window:", "",
           *md_table(("probe or call", "n", "elapsed", *(c[:-2] for c in cols), "max"),
                     [(r["what"], r.get("n", "-"), fmt(_ms(r.get("elapsed_s")), ".2f"),
                       *(fmt(_ms(r.get(c)), ".2f") for c in cols),
                       fmt(_ms(r.get("max_s")), ".2f")) for r in rows]))


def call_overhead(dev: Any, repeats: int = 10) -> list[dict[str, Any]]:
    """Host time a device call costs beyond its GEMMs, one bf16 8192^3 GEMM a call (the
    default plan's): the warm-up's run() (no energy counter) against the window's
    run_observed() (the counter read and watched). plan_cost.csv's probes paid ~26 ms
    a call (bench/call_overhead.py); which of the two pays it decides the plan's cost."""
    from gemmd.gemm import ProbeSpec

    spec, cancel = ProbeSpec(8192, 8192, 8192, dtype="bf16"), threading.Event()
    dev.prepare(spec)
    dev.run(spec, 2, cancel)  # the chunk's calibration, outside the figures
    calls = {"run (warm-up)": lambda: dev.run(spec, 1, cancel),
             "run_observed (window)": lambda: dev.run_observed(spec, 1, cancel).times}
    rows = []
    for name, call in calls.items():
        over = []
        for _ in range(repeats):  # on the device's clock (the fake's is simulated)
            t0 = dev.clock()
            times = call()
            over.append(dev.clock() - t0 - sum(times))
        rows.append({"what": f"call overhead, {name}", "n": repeats,
                     "elapsed_s": float(np.median(over)), "max_s": max(over)})
    return rows


def _ms(x: Any) -> float | None:
    return None if x is None else 1e3 * float(x)


# ------------------------------------------------------------------ 1. the machine


def _try(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except Exception as e:
        return f"unavailable ({type(e).__name__}: {e})"


def virtualization() -> str:
    """What the kernel says it runs on: gVisor (a user-space kernel: uname -r 4.4.0), a VM
    (the cpuinfo hypervisor flag; DMI names Firecracker, KVM, ...) or bare metal."""
    rel = platform.release()
    parts = [f"uname -r {rel}"]
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
        parts.append("hypervisor flag " + ("set" if " hypervisor" in cpuinfo else "not set"))
    except OSError:
        pass
    for f in ("sys_vendor", "product_name"):
        try:
            v = Path(f"/sys/class/dmi/id/{f}").read_text().strip()
            if v:
                parts.append(f"DMI {f} {v!r}")
        except OSError:
            pass
    try:
        dm = subprocess.run(["dmesg"], capture_output=True, text=True, timeout=5).stdout
        if "gVisor" in dm:
            parts.append("dmesg: gVisor")
    except (OSError, subprocess.SubprocessError):
        pass
    verdict = "gVisor" if rel.startswith("4.4.0") or "gVisor" in " ".join(parts) else \
        "VM" if "flag set" in " ".join(parts) else "no hypervisor seen"
    return f"{verdict} ({', '.join(parts)})"


def versions() -> dict[str, str]:
    from importlib import metadata

    out = {"python": platform.python_version()}
    for dist in ("numpy", "scipy", "scikit-learn", "prometheus-client", "PyYAML",
                 "nvidia-ml-py", "cupy-cuda13x", "cupy-cuda12x", "torch",
                 "nvidia-cublas", "nvidia-cublas-cu12", "nvidia-cuda-nvrtc", "APScheduler",
                 "skops"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    try:
        rev = subprocess.run(["git", "-C", str(ROOT), "describe", "--always", "--dirty"],
                             capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        rev = ""
    import gemmd

    out["gemmd"] = gemmd.__version__ + (f" (git {rev})" if rev else "")
    return out


def nvml_facts(index: int) -> dict[str, Any]:
    """What NVML says of one GPU, each query on its own (one unsupported query is a
    value, not a failure)."""
    import pynvml as nv

    nv.nvmlInit()
    h = nv.nvmlDeviceGetHandleByIndex(index)

    def s(v: Any) -> Any:
        return v.decode() if isinstance(v, bytes) else v

    q: dict[str, Callable[[], Any]] = {
        "name": lambda: s(nv.nvmlDeviceGetName(h)),
        "uuid": lambda: s(nv.nvmlDeviceGetUUID(h)),
        "driver": lambda: s(nv.nvmlSystemGetDriverVersion()),
        "cuda_driver": lambda: "{}.{}".format(*divmod(
            nv.nvmlSystemGetCudaDriverVersion_v2() // 10, 100)),
        "vbios": lambda: s(nv.nvmlDeviceGetVbiosVersion(h)),
        "sm_clock_mhz": lambda: nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM),
        "mem_clock_mhz": lambda: nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_MEM),
        "max_sm_clock_mhz": lambda: nv.nvmlDeviceGetMaxClockInfo(h, nv.NVML_CLOCK_SM),
        "max_mem_clock_mhz": lambda: nv.nvmlDeviceGetMaxClockInfo(h, nv.NVML_CLOCK_MEM),
        "app_sm_clock_mhz": lambda: nv.nvmlDeviceGetApplicationsClock(h, nv.NVML_CLOCK_SM),
        "default_app_sm_clock_mhz": lambda: nv.nvmlDeviceGetDefaultApplicationsClock(
            h, nv.NVML_CLOCK_SM),
        "power_limit_w": lambda: nv.nvmlDeviceGetEnforcedPowerLimit(h) / 1000,
        "default_power_limit_w": lambda: nv.nvmlDeviceGetPowerManagementDefaultLimit(h)
        / 1000,
        "power_limit_range_w": lambda: tuple(
            v / 1000 for v in nv.nvmlDeviceGetPowerManagementLimitConstraints(h)),
        "power_now_w": lambda: nv.nvmlDeviceGetPowerUsage(h) / 1000,
        "temperature_c": lambda: nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU),
        "ecc_mode_current_pending": lambda: tuple(nv.nvmlDeviceGetEccMode(h)),
        "mig_mode_current_pending": lambda: tuple(nv.nvmlDeviceGetMigMode(h)),
        "persistence_mode": lambda: nv.nvmlDeviceGetPersistenceMode(h),
        "compute_mode": lambda: nv.nvmlDeviceGetComputeMode(h),
        "pstate": lambda: nv.nvmlDeviceGetPerformanceState(h),
        "pcie_gen_width": lambda: (nv.nvmlDeviceGetCurrPcieLinkGeneration(h),
                                   nv.nvmlDeviceGetCurrPcieLinkWidth(h)),
        "memory_total_gib": lambda: nv.nvmlDeviceGetMemoryInfo(h).total / 2**30,
        "clock_event_reasons": lambda: hex(nv.nvmlDeviceGetCurrentClocksEventReasons(h)),
        "energy_counter_j": lambda: nv.nvmlDeviceGetTotalEnergyConsumption(h) / 1000,
        "supported_sm_clocks_mhz": lambda: _clock_range(nv, h),
    }
    return {k: _try(f) for k, f in q.items()}


def _clock_range(nv: Any, h: Any) -> str:
    mem = max(nv.nvmlDeviceGetSupportedMemoryClocks(h))
    sm = sorted(nv.nvmlDeviceGetSupportedGraphicsClocks(h, mem))
    return f"{len(sm)} from {sm[0]} to {sm[-1]} (memory {mem})"


def environment(ctx: Ctx) -> list[str]:
    """Date and host; the device where one is open (step 1 adds the rest)."""
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
    return out


def step_machine(ctx: Ctx) -> None:
    dev = ctx.device()
    lines = environment(ctx)
    lines.append(f"- virtualization: {virtualization()}")
    lines.append("- versions: " + ", ".join(f"{k} {v}" for k, v in versions().items()))
    if ctx.gpu:
        facts = nvml_facts(dev.info.index)
        ctx.data["nvml_facts"] = facts
        lines.append("- NVML: " + "; ".join(f"{k} {v}" for k, v in facts.items()))
        try:
            import cupy

            v = cupy.cuda.runtime.runtimeGetVersion()
            lines.append(f"- CUDA runtime (CuPy's): {v // 1000}.{v % 1000 // 10}")
        except Exception as e:
            lines.append(f"- CUDA runtime: unavailable ({e})")
        for args, name in ((["nvidia-smi", "-q"], "nvidia-smi-q.txt"),
                           (["nvidia-smi"], "nvidia-smi.txt")):
            rc, o, e = run_cmd(args, timeout=20) if _which(args[0]) else (127, "", "absent")
            (ctx.work / name).write_text(f"$ {' '.join(args)}\nexit {rc}\n{o}{e}")
            if name == "nvidia-smi.txt":
                lines.append(f"- nvidia-smi: {'exit ' + str(rc) if rc != 127 else 'absent'}"
                             " (nvidia-smi*.txt in the archive)")
    ctx.env = lines
    (ctx.work / "machine.txt").write_text("\n".join(lines) + "\n")
    ctx.md(*lines)


def _which(cmd: str) -> bool:
    import shutil

    return shutil.which(cmd) is not None


# ------------------------------------------------------------------ main

STEPS = [
    # (number, title, nominal seconds on an H100/H200 (560 in all), minimum worth starting,
    # the step), in order of value: what nobody has measured first, the 2-minute daemon
    # run last. --deadline cuts the longest steps first; --quick asks a third.
    (1, "the machine", 10, 2, step_machine),
    (2, "throughput fidelity vs cupy/torch", 25, 10, step_fidelity),
    (3, "energy per GEMM: CV by window and method", 50, 15, step_energy),
    (4, "run-to-run noise of the default sentinels", 150, 40, step_noise),
    (5, "round cost", 5, 2, step_round_cost),
    (6, "a real slowdown: clocks lowered, drift replayed", 60, 25, step_slowdown),
    (7, "host launch vs GPU time", 12, 5, step_launch),
    (8, "dtype x layout x tile sweep", 35, 10, step_sweep),
    (9, "gemmd probe, default plan", 25, 10, step_probe),
    (10, "NVIDIA tests on the GPU", 60, 20, step_pytest),
    (11, "gemmd run, scraped, SIGTERM, RSS", 130, 40, step_run),
]
DEFAULT_DEADLINE_S = 480.0
MAX_OUT_FILES = 6  # what the lent machine brings back is 8 files at most


def _cap(nominal: Sequence[float], deadline: float) -> float:
    """The largest cap with sum(min(n, cap)) <= deadline."""
    if sum(nominal) <= deadline:
        return max(nominal, default=0.0)
    lo, hi = 0.0, max(nominal)
    for _ in range(60):
        cap = (lo + hi) / 2
        if sum(min(n, cap) for n in nominal) > deadline:
            hi = cap
        else:
            lo = cap
    return lo


def plan(nominal: Sequence[float], deadline: float,
         minimum: Sequence[float] | None = None) -> list[float]:
    """Seconds granted to each step so that they sum to at most ``deadline``: every step
    gets min(nominal, cap), with the one cap that fits, so the longest are cut first; a
    step that would get less than its ``minimum`` gets nothing (the longest of those
    first), and what it leaves goes to the others."""
    minimum = minimum or [0.0] * len(nominal)
    active = [i for i, n in enumerate(nominal) if n > 0]
    while True:
        cap = _cap([nominal[i] for i in active], deadline)
        granted = {i: min(nominal[i], cap) for i in active}
        short = [i for i in active if granted[i] < minimum[i]]
        if not short:
            return [granted.get(i, 0.0) for i in range(len(nominal))]
        active.remove(max(short, key=lambda i: nominal[i]))


def write_summary(ctx: Ctx, steps: Sequence[Step], total_s: float, deadline: float,
                  final: bool) -> None:
    """SUMMARY.md in the output folder and the archive of every other file beside it;
    written after every step (atomically), so that a run killed at any point returns what
    was done."""
    cut = [s for s in steps if s.budget_s < s.nominal_s - 0.5]
    lines = ["# gemmd GPU acceptance (bench/gpu_accept.py)", "",
             *(ctx.env or environment(ctx)),
             f"- wall time so far: {total_s:.0f} s of a {deadline:.0f} s deadline"
             + ("" if final else " (**run in progress or killed**: later steps missing)"),
             f"- every CSV and log: {ARCHIVE} (tar -xzf)", "", "## Steps", ""]
    if cut:
        lines += ["Cut by the deadline (granted / asked): " + "; ".join(
            f"{s.num}. {s.title} {s.budget_s:.0f} / {s.nominal_s:.0f} s" for s in cut), ""]
    lines += md_table(("#", "step", "status", "wall s", "budget s", "note"),
                      [(s.num, s.title, s.status, f"{s.wall_s:.1f}", f"{s.budget_s:.0f}",
                        s.note) for s in steps])
    lines += ["", "## Figures and targets", ""]
    lines += md_table(("figure", "value", "target", "met"),
                      [(f.name, f.value, f.target,
                        "-" if f.met is None else ("yes" if f.met else "**NO**")
                        + ("" if f.counted else " (not counted)")) for f in ctx.figures])
    for s in steps:
        lines += ["", f"## {s.num}. {s.title}", "", f"Status: {s.status}"
                  + (f" ({s.note})" if s.note else "") + f", {s.wall_s:.1f} s.", ""]
        lines += s.lines
    text = "\n".join(lines) + "\n"
    (ctx.work / "SUMMARY.md").write_text(text)
    _atomic(ctx.out / "SUMMARY.md", text.encode())
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for f in sorted(ctx.work.iterdir()):
            tar.add(f, arcname=f"gpu_accept/{f.name}")
    _atomic(ctx.out / ARCHIVE, buf.getvalue())


ARCHIVE = "results.tar.gz"


def _atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("outdir", type=Path, nargs="?")
    ap.add_argument("--replay", type=Path, metavar="ARCHIVE",
                    help="no GPU: replay the slowdown of a past run's results.tar.gz through "
                         "today's drift detector and print what it shows")
    ap.add_argument("--probes", default="", metavar="NAME,...",
                    help="with --replay: only these probes (e.g. today's default sentinels)")
    ap.add_argument("--backend", choices=("nvidia", "fake"), default="nvidia")
    ap.add_argument("--quick", action="store_true", help="shorter steps (a smoke test)")
    ap.add_argument("--deadline", type=float, default=DEFAULT_DEADLINE_S, metavar="SECONDS",
                    help="the whole run ends within about this long (default %(default)s); "
                         "the longest steps are cut first, and SUMMARY.md says what was cut")
    ap.add_argument("--only", metavar="N,N,...", default="",
                    help="run only these steps (numbers; e.g. a re-measurement)")
    ap.add_argument("--rounds", type=int, default=SENTINEL_ROUNDS, metavar="N",
                    help="step 4's rounds of the default sentinels (default %(default)s)")
    ap.add_argument("--gap", type=float, default=None, metavar="SECONDS",
                    help=f"step 4: idle seconds between rounds (default {GPU_GAP_S:g} on a "
                         "GPU, 0 with --quick or on the fake backend)")
    ap.add_argument("--slowdown", choices=("clocks", "power"), default="clocks",
                    help="step 6 lowers the SM clocks 5%% and 10%% (default), or the power "
                         "limit 10%% and 20%%")
    args = ap.parse_args(argv)
    if args.replay is not None:
        if not args.replay.is_file():
            ap.error(f"--replay {args.replay}: no such file")
        return replay_archive(args.replay, [p for p in args.probes.split(",") if p])
    if args.outdir is None:
        ap.error("OUTDIR is required (unless --replay)")
    if not (math.isfinite(args.deadline) and args.deadline >= 10):
        ap.error(f"--deadline {args.deadline}: must be at least 10 seconds")
    if not 3 <= args.rounds <= 1000:
        ap.error(f"--rounds {args.rounds}: must be 3 to 1000")
    if args.gap is None:
        args.gap = GPU_GAP_S if args.backend == "nvidia" and not args.quick else 0.0
    if not (math.isfinite(args.gap) and 0 <= args.gap <= 600):
        ap.error(f"--gap {args.gap}: must be 0 to 600 seconds")
    try:
        only = {int(x) for x in args.only.split(",") if x.strip()}
    except ValueError:
        ap.error(f"--only {args.only!r}: step numbers separated by commas")
    if only - {n for n, *_ in STEPS}:
        ap.error(f"--only: no step {sorted(only - {n for n, *_ in STEPS})} (1-{len(STEPS)})")
    out = args.outdir.resolve()
    out.mkdir(parents=True, exist_ok=True)
    strays = [f.name for f in out.iterdir() if f.name not in ("SUMMARY.md", ARCHIVE)]
    if strays:
        print(f"gpu_accept: {out} holds other files ({', '.join(sorted(strays)[:5])}): "
              "use an empty folder (at most 8 files come back from the GPU machine)",
              file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="gemmd-accept-"))
    ctx = Ctx(out, work, args.backend, args.quick)
    ctx.rounds, ctx.gap_s, ctx.slowdown = args.rounds, args.gap, args.slowdown
    scale = 1 / 3 if args.quick else 1.0
    granted = plan([n * scale if not only or num in only else 0.0
                    for num, _, n, _, _ in STEPS], args.deadline,
                   [m * scale for _, _, _, m, _ in STEPS])
    steps = [Step(num, title, g, fn, nominal_s=n * scale, min_s=m * scale)
             for (num, title, n, m, fn), g in zip(STEPS, granted)]
    start = time.monotonic()
    ctx.end = start + args.deadline

    def give_up(why: str, step: Step | None) -> None:
        # A GEMM that never returns, or a step far past the deadline, would hang this
        # process: record it, leave the summary, and go.
        if step is not None:
            step.status = f"FAILED: {why}"
            step.wall_s = time.monotonic() - step_t0[0]
        with ctx.lock:
            write_summary(ctx, steps, time.monotonic() - start, args.deadline, final=True)
        print(f"{why}; SUMMARY.md written; exiting", flush=True)
        restore_clocks()
        os._exit(1)

    # The last word: the deadline plus a grace (a step mid-GEMM finishes its GEMM).
    grace = min(60.0, 0.15 * args.deadline)
    final_guard = threading.Timer(args.deadline + grace, lambda: give_up(
        f"still running {grace:.0f} s past the {args.deadline:.0f} s deadline, abandoned",
        ctx.step))
    final_guard.daemon = True
    final_guard.start()
    step_t0 = [start]
    print(f"gemmd GPU acceptance -> {out} (backend {args.backend}"
          f"{', quick' if args.quick else ''}, deadline {args.deadline:.0f} s)", flush=True)
    for step in steps:
        left = ctx.left_in_run()
        if only and step.num not in only:
            step.status, step.nominal_s = "skipped: not in --only", 0.0
            continue
        if step.budget_s < step.min_s or left < step.min_s:
            step.status = "cut: deadline"
            step.note = (f"{max(0.0, min(step.budget_s, left)):.0f} s left of the "
                         f"{step.nominal_s:.0f} s it needs, at least {step.min_s:.0f}")
            step.wall_s = 0.0
            print(f"[{step.num}] {step.title}: cut ({step.note})", flush=True)
            continue
        ctx.step, ctx.deadline = step, time.monotonic() + step.budget_s
        print(f"[{step.num}] {step.title} (budget {step.budget_s:.0f} s) ...", flush=True)
        limit = step.budget_s * 2 + 120
        watchdog = threading.Timer(limit, give_up, (f"still running after {limit:.0f} s, "
                                                    "abandoned", step))
        watchdog.daemon = True
        watchdog.start()
        t0 = step_t0[0] = time.monotonic()
        try:
            step.fn(ctx)
            step.status = "ok"
        except Skip as e:
            step.status = f"skipped: {e}"
        except Failed as e:
            step.status = f"FAILED: {e}"
        except Exception as e:
            step.status = f"FAILED: {type(e).__name__}: {e}"
            with open(work / "errors.txt", "a") as f:
                f.write(f"step {step.num} ({step.title}):\n{traceback.format_exc()}\n")
        finally:
            watchdog.cancel()
        step.wall_s = time.monotonic() - t0
        over = " (over budget)" if step.wall_s > step.budget_s else ""
        print(f"[{step.num}] {step.status} in {step.wall_s:.1f} s{over}", flush=True)
        with ctx.lock:
            write_summary(ctx, steps, time.monotonic() - start, args.deadline, final=False)
    ctx.step = None
    total = time.monotonic() - start
    ctx.figure("total wall time of this run", f"{total:.0f} s",
               f"<= {args.deadline:.0f} s (--deadline)", total <= args.deadline + grace,
               counted=False)
    try:
        ctx.close()
    except Exception as e:
        print(f"closing the device: {e}", file=sys.stderr)
    final_guard.cancel()
    with ctx.lock:
        write_summary(ctx, steps, total, args.deadline, final=True)
    files = sorted(f.name for f in out.iterdir())
    assert len(files) <= MAX_OUT_FILES, files
    failed = [s for s in steps if s.status.startswith("FAILED")]
    missed = [f for f in ctx.figures if f.counted and f.met is False]
    cut = [s for s in steps if s.status.startswith("cut")]
    print(f"done in {total:.0f} s: {len(failed)} step(s) failed, {len(cut)} cut, "
          f"{len(missed)} target(s) missed; {out / 'SUMMARY.md'}", flush=True)
    for f in missed:
        print(f"  target missed: {f.name}: {f.value} (target {f.target})", flush=True)
    return 1 if failed else 3 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
