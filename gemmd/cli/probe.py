"""``gemmd probe``: one probe round on every device, printed as a table, CSV or JSON."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import sys
import tempfile
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gemmd.cli.args import BACKENDS, DTYPES, EXIT_RUNTIME, KERNELS, LAYOUTS, int_range, mnk
from gemmd.cli.context import checked, load_config, setup_logging
from gemmd.cli.output import fmt_value, num, print_table
from gemmd.config import Config, ProbeGroup

if TYPE_CHECKING:
    from gemmd.devices import Device
    from gemmd.rounds import DeviceRunner, Result

# Columns of --format csv (and the keys of --format json), in order.
RESULT_COLUMNS = (
    "gpu", "gpu_model", "kind", "m", "n", "k", "dtype", "kernel", "tile", "layout", "probe",
    "outcome", "error", "iterations", "window_s", "runtime_s", "runtime_cv", "tflops",
    "power_w", "energy_j", "power_sample_w", "check_ok", "check_error", "sm_clock_hz",
    "temperature_c", "clock_event_reasons", "pred_runtime_s", "pred_runtime_lo",
    "pred_runtime_hi", "pred_power_w", "pred_energy_j")


def _probe_overrides(args: argparse.Namespace, cfg: Config) -> Config:
    """--shape/--dtype/--kernel/--tile/--layout: one sentinel group instead of the
    configured ones (what is not given comes from the first configured group)."""
    if not any([args.shape, args.dtype, args.kernel, args.tile, args.layout]):
        return cfg
    base = cfg.probes.sentinels[0] if cfg.probes.sentinels else ProbeGroup()
    group = ProbeGroup(shapes=tuple(args.shape) or base.shapes,
                       dtypes=tuple(args.dtype) or base.dtypes,
                       kernels=tuple(args.kernel) or base.kernels,
                       tiles=tuple(args.tile) or base.tiles,
                       layouts=tuple(args.layout) or base.layouts)
    probes = dataclasses.replace(cfg.probes, sentinels=(group,), exploration=())
    return dataclasses.replace(cfg, probes=probes)


def cmd_probe(args: argparse.Namespace) -> int:
    from gemmd import runtime
    from gemmd.rounds import device_label

    cfg = _probe_overrides(args, load_config(args))
    if args.window is not None:
        measure = dataclasses.replace(cfg.probes.measure, window_s=args.window)
        cfg = checked(dataclasses.replace(cfg, probes=dataclasses.replace(
            cfg.probes, measure=measure)), {"--window": args.window})
    cfg = dataclasses.replace(cfg, schedule=dataclasses.replace(cfg.schedule,
                                                                skip_when_busy=not args.force))
    setup_logging(args.log_level or cfg.log_level)
    with contextlib.ExitStack() as stack:
        state_dir = None
        if args.no_store:
            state_dir = Path(stack.enter_context(
                tempfile.TemporaryDirectory(prefix="gemmd-probe-")))
        # One round runs every planned probe: the duty-cycle budget is for the daemon.
        rt = runtime.build(cfg, state_dir=state_dir, budget_s=math.inf)
        stack.callback(rt.store.close)
        stack.callback(rt.close_devices)
        registry = rt.registry
        registry.load_active()
        # Devices are probed at the same time, each result shown as it comes (stderr:
        # stdout holds the table, CSV or JSON at the end).
        results: dict[str, list[Result]] = {r.device.info.uuid: [] for r in rt.runners}
        lock = threading.Lock()

        def progress(runner: DeviceRunner, r: Result) -> None:
            m = r.measurement
            what = f"{fmt_value('runtime', m.runtime_s, 3)}, {m.tflops:.3g} TFLOP/s" if m \
                else r.error
            with lock:
                print(f"{runner.label}: {r.spec.name}: {r.outcome}" + (f" ({what})" if what
                                                                       else ""),
                      file=sys.stderr, flush=True)

        def round_of(runner: DeviceRunner) -> None:
            runner.on_result = lambda r: progress(runner, r)
            results[runner.device.info.uuid] = runner.run_round()

        threads = [threading.Thread(target=round_of, args=(r,), name=f"probe-{r.label}")
                   for r in rt.runners]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        rows: list[dict[str, Any]] = []
        skipped: dict[str, int] = {}
        for runner in rt.runners:
            d = runner.device
            rows += [_result_row(d, r) for r in results[d.info.uuid]]
            for reason, n in rt.state.devices[d.info.uuid].skipped_total.items():
                if n and reason not in ("duty_cycle",):
                    skipped[reason] = skipped.get(reason, 0) + n
                    print(f"gemmd: warning: {device_label(d.info)}: {n} probe(s) skipped: "
                          f"{reason}", file=sys.stderr)
    if not rows:
        busy = sorted(set(skipped) - {"unsupported", "device_down"})
        hint = f" (busy: {', '.join(busy)}; --force probes a busy device anyway)" \
            if busy else ""
        print(f"gemmd: no probe ran{hint}", file=sys.stderr)
        return EXIT_RUNTIME
    _print_rows(rows, args.format, registry.current.version)
    failed = [r for r in rows if r["outcome"] in ("failed", "mismatch")]
    return EXIT_RUNTIME if failed else 0


def _result_row(d: Device, r: Result) -> dict[str, Any]:
    m, p = r.measurement, r.prediction
    row: dict[str, Any] = dict.fromkeys(RESULT_COLUMNS)
    row |= {"gpu": d.info.index, "gpu_model": d.info.name, "kind": r.kind,
            **dataclasses.asdict(r.spec), "probe": r.spec.name, "outcome": r.outcome,
            "error": r.error}
    if m is not None:
        after = m.context.get("after") or {}
        row.update(iterations=m.iterations, window_s=m.window_s, runtime_s=m.runtime_s,
                   runtime_cv=m.runtime_cv, tflops=m.tflops, power_w=m.power_w,
                   energy_j=m.energy_j, power_sample_w=m.power_sample_w,
                   check_ok=m.check_ok, check_error=m.check_error,
                   sm_clock_hz=after.get("sm_clock_hz"),
                   temperature_c=after.get("temperature_c"),
                   clock_event_reasons="|".join(after.get("clock_event_reasons", [])))
    if p is not None:
        row.update(pred_runtime_s=p.runtime_s, pred_runtime_lo=p.runtime_lo,
                   pred_runtime_hi=p.runtime_hi, pred_power_w=p.power_w,
                   pred_energy_j=p.energy_j)
    return row


def _print_rows(rows: list[dict[str, Any]], fmt: str, model_version: str) -> None:
    if fmt == "json":
        print(json.dumps(rows, indent=1, default=str))
        return
    if fmt == "csv":
        import csv

        w = csv.DictWriter(sys.stdout, fieldnames=RESULT_COLUMNS, lineterminator="\n")
        w.writeheader()
        w.writerows(rows)
        return
    table: list[tuple[str, ...]] = [(
        "GPU", "PROBE", "KIND", "ITERS", "RUNTIME", "PREDICTED", "RATIO", "TFLOP/S", "POWER",
        "ENERGY", "OUTCOME")]
    for r in rows:
        rt, pr = r.get("runtime_s"), r.get("pred_runtime_s")
        table.append((
            str(r["gpu"]), r["probe"], r["kind"][:4], num(r.get("iterations"), "d"),
            fmt_value("runtime", rt, 3), fmt_value("runtime", pr, 3),
            num(rt / pr if rt and pr else None, ".3f"), num(r.get("tflops"), ".3g"),
            num(r.get("power_w"), ".1f", " W"), num(r.get("energy_j"), ".3g", " J"),
            r["outcome"] + (f": {r['error']}" if r["error"] else "")))
    print_table(table)
    print(f"predictions: {model_version}")


def add_commands(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    pr = sub.add_parser("probe", parents=[common], help="run one probe round, print a table")
    pr.add_argument("--backend", choices=BACKENDS)
    pr.add_argument("--shape", type=mnk("shape", "1024x1024x1024"), action="append",
                    default=[], help="MxNxK (repeatable); replaces the configured sentinels")
    pr.add_argument("--dtype", choices=DTYPES, action="append", default=[])
    pr.add_argument("--kernel", choices=KERNELS, action="append", default=[])
    pr.add_argument("--tile", type=int_range("tile", 1, 32), action="append", default=[])
    pr.add_argument("--layout", choices=LAYOUTS, action="append", default=[])
    pr.add_argument("--window", type=float, help="override probes.measure.window_s")
    pr.add_argument("--force", action="store_true", help="probe even if the device is busy")
    pr.add_argument("--no-store", action="store_true", help="don't record results")
    pr.add_argument("--format", choices=("table", "csv", "json"), default="table")
    pr.set_defaults(func=cmd_probe)
