"""The predictions' commands: ``gemmd predict`` (runtime, power, energy of one GEMM) and
``gemmd advise`` (the fastest and most energy-efficient known configuration).

They use what the daemon predicts with (``ModelRegistry.load_active``): the newest usable
fitted model, else the roofline estimate, said as such; or ``--model FILE``.
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gemmd.cli.args import (
    DATA_KERNELS,
    DTYPES,
    LAYOUTS,
    UsageError,
    finite,
    gpu_spec_option,
    int_range,
    mnk,
    nonempty,
    path_arg,
)
from gemmd.cli.context import gpu_catalog, load_config, no_store, open_store, store_path
from gemmd.cli.output import fmt_value, json_text, print_table
from gemmd.config import Config
from gemmd.errors import GemmdError
from gemmd.gemm import COLUMN

if TYPE_CHECKING:
    import numpy as np

    from gemmd.hardware import Catalogue
    from gemmd.model import ForestModel, RooflinePredictor, TransferModel
    from gemmd.records import DeviceInfo


# ------------------------------------------------------------------ predict, advise


@dataclass
class Predictor:
    """What predict and advise predict with, and what they know of devices."""

    model: ForestModel | TransferModel | RooflinePredictor
    version: str  # as the daemon labels it (rf-3, roofline...), or the --model file
    catalog: Catalogue  # the GPU catalogue plus --gpu-spec GPUs
    spec_keys: list[str]  # the GPUs --gpu-spec added
    store_devices: list[DeviceInfo] = field(default_factory=list)
    missing_store: Path | None = None  # the store that does not exist, if none does
    calibrated: list[DeviceInfo] = field(default_factory=list)  # --calibrate's devices

    @property
    def roofline(self) -> bool:
        return self.model.kind == "roofline"

    @property
    def what(self) -> str:
        return "the roofline estimate" if self.roofline else "the model"

    def label(self) -> str:
        return "roofline estimate: no fitted model yet" if self.roofline else \
            f"model {self.version}"

    def roofline_note(self) -> str:
        """What the roofline estimate is, in a line ("" for a fitted model)."""
        from gemmd.model import RooflinePredictor

        m = self.model
        if not isinstance(m, RooflinePredictor):
            return ""
        return (f"  as the daemon predicts until its first fit: the roofline at "
                f"{100 * m.efficiency:.0f}% efficiency, within x{m.interval_factor:g} either way")

    def predict(self, rows: Sequence[dict[str, Any]], info: DeviceInfo
                ) -> dict[str, dict[str, np.ndarray]]:
        """Per target: point, lo, hi, in_domain, domain, one entry per row."""
        import numpy as np

        from gemmd.features import Table, spec_of
        from gemmd.model import RooflinePredictor

        if not isinstance(self.model, RooflinePredictor):
            return self.model.predict_table(Table.from_rows(rows, [info] * len(rows)))
        # The roofline predicts probes (ProbeSpec), as in the daemon: runtime only.
        odd = [opt for opt, key, plain in (("--batch", "batch", 1), ("--beta", "beta", 0.0),
                                           ("--out-dtype", "out_dtype", ""))
               if any(r.get(key, plain) != plain for r in rows)]
        if odd:
            raise UsageError(f"{', '.join(odd)}: the roofline estimate (no fitted model yet) "
                             "predicts the daemon's probes only (batch 1, beta 0, the "
                             "dtype's own output); fit a model or give --model FILE")
        preds = self.model.predict([spec_of(r) for r in rows], [info] * len(rows))
        return {"runtime": {
            "point": np.array([p.runtime_s for p in preds], dtype=float),
            "lo": np.array([p.runtime_lo for p in preds], dtype=float),
            "hi": np.array([p.runtime_hi for p in preds], dtype=float),
            "in_domain": np.array([p.in_domain for p in preds]),
            "domain": np.array([p.domain for p in preds], dtype=object)}}


def _predictor(args: argparse.Namespace, cfg: Config) -> Predictor:
    """--model FILE, else what the daemon predicts with: the registry's active model on
    the store (a fitted one, calibrated to model.reference where configured), the roofline
    estimate before the first fit or where no store exists yet. With --calibrate FILE...,
    that model carried over to the files' device (transfer)."""
    from gemmd.model import ForestModel, RooflinePredictor, TransferModel
    from gemmd.modelfile import check_archive
    from gemmd.registry import ModelRegistry, device_infos

    catalog, spec_keys = gpu_catalog(args.gpu_spec)
    pred: Predictor
    if args.model:
        check_archive(args.model)  # before anything is inflated
        pred = Predictor(ForestModel.load(args.model), str(args.model), catalog, spec_keys)
    elif not store_path(cfg).is_file():
        pred = Predictor(RooflinePredictor(cfg.model.roofline_efficiency), "roofline",
                         catalog, spec_keys, missing_store=store_path(cfg))
    else:
        store = open_store(cfg)
        try:
            reg = ModelRegistry(store, cfg.resolved_state_dir() / "models", cfg.model)
            reg.load_active()
            infos = list(device_infos(store).values())
        finally:
            store.close()
        pred = Predictor(reg.current, reg.current.version, catalog, spec_keys, infos)
    if not args.calibrate:
        return pred
    from gemmd import datasets

    base = pred.model.base_prior if isinstance(pred.model, TransferModel) else pred.model
    if not isinstance(base, ForestModel):
        raise GemmdError("--calibrate carries a fitted model over to a device, and there is "
                         "none yet (run gemmd fit, or give --model FILE)")
    ds = datasets.load("auto", args.calibrate, gpu=args.gpu, catalog=catalog)
    pred.model = TransferModel.fit(base, ds.table, cfg.model)
    pred.version = f"{pred.version if args.model else base.version}+calibrated on " \
                   f"{len(ds.table):,} rows"
    pred.calibrated = list(ds.table.devices)
    return pred


def _device(args: argparse.Namespace, pred: Predictor) -> DeviceInfo:
    """The device to predict for: --gpu, the one --calibrate or --gpu-spec describes, the
    --device of the model or the store, else the model's only device (the store's only
    device for the roofline estimate)."""
    from gemmd.datasets import known_gpu, known_gpu_names
    from gemmd.model import RooflinePredictor

    if args.gpu and args.device:
        raise UsageError("--gpu and --device: give one (--gpu names a GPU model, --device "
                         "one of the model's or the store's devices)")
    if args.gpu:
        info = known_gpu(args.gpu, pred.catalog)
        if info is None:
            raise UsageError(f"unknown GPU {args.gpu!r} (known: "
                             f"{known_gpu_names(pred.catalog)}; describe another with "
                             "--gpu-spec FILE)")
        return info
    if len(pred.calibrated) == 1 and not args.device:
        return pred.calibrated[0]
    if len(pred.spec_keys) == 1 and not args.device:
        spec = pred.catalog.info(pred.spec_keys[0])
        assert spec is not None  # the catalogue knows the GPUs it was given
        return spec
    trained = [] if isinstance(pred.model, RooflinePredictor) else pred.model.device_infos()
    if args.device:
        known: list[DeviceInfo] = []  # each uuid once, the model's record first
        for d in trained + pred.store_devices:
            if all(d.uuid != k.uuid for k in known):
                known.append(d)
        exact = [d for d in known if d.uuid == args.device]
        found = exact or [d for d in known if d.uuid.startswith(args.device)
                          or str(d.index) == args.device]
        if len(found) == 1:
            return found[0]
        if not found:
            raise UsageError(f"no device {args.device!r} in the model or the store")
        names = ", ".join(f"{d.uuid} ({d.name})" for d in found)
        raise UsageError(f"--device {args.device!r} matches several devices: {names}; give "
                         "more of its uuid")
    if len(trained) == 1:
        return trained[0]
    if not pred.roofline:
        names = ", ".join(f"{d.uuid} ({d.name})" for d in trained)
        raise UsageError(f"the model spans several devices; choose one with --device: {names}")
    if pred.missing_store is not None:
        raise no_store(pred.missing_store)
    if len(pred.store_devices) == 1:
        return pred.store_devices[0]
    if not pred.store_devices:
        raise GemmdError("the store knows no device yet: name one with --gpu NAME or "
                         "--gpu-spec FILE")
    names = ", ".join(f"{d.uuid} ({d.name})" for d in pred.store_devices)
    raise UsageError(f"the store holds several devices; choose one with --device: {names}")


def _row(args: argparse.Namespace) -> dict[str, Any]:
    row = {"m": args.m, "n": args.n, "k": args.k, "batch": args.batch,
           "dtype": args.dtype or "fp32", "kernel": args.kernel, "tile": args.tile or 0,
           "layout": args.layout, "stages": args.stages or 0, "alpha": args.alpha,
           "beta": args.beta, "out_dtype": args.out_dtype or ""}
    if args.cta:
        row["cta_m"], row["cta_n"], row["cta_k"] = args.cta
    if row["kernel"] == "tiled" and not row["tile"]:
        raise UsageError("--kernel tiled needs --tile")
    return row


def _has_peak(info: DeviceInfo, row: dict[str, Any]) -> bool:
    """Whether ``info`` has a peak rate for the dtype ``row``'s kernel computes in
    (features.compute_dtype), as import asks of every row; devices whose figures are
    estimates (the CPU backend) are not held to it. Without one, the roofline would be
    at a made-up 1 TFLOP/s (a V100's bf16 at 0.7 TFLOP/s)."""
    from gemmd.bounds import UNBOUNDED_BACKENDS
    from gemmd.features import compute_dtype

    d = compute_dtype(str(row.get("dtype")), str(row.get("kernel")))
    return info.backend in UNBOUNDED_BACKENDS or bool(info.peak_flops.get(d))


def _no_peak(info: DeviceInfo, dtype: str) -> UsageError:
    return UsageError(f"{info.name} has no {dtype} peak (the catalogue "
                      f"knows none: no {dtype} units?); if it has, describe it with "
                      f"--gpu-spec FILE (peak_{dtype}_tflops)")


def cmd_predict(args: argparse.Namespace) -> int:
    cfg = load_config(args)
    pred = _predictor(args, cfg)
    info = _device(args, pred)
    row = _row(args)
    if not _has_peak(info, row):
        from gemmd.features import compute_dtype

        raise _no_peak(info, compute_dtype(row["dtype"], row["kernel"]))
    if args.source:
        row["source"] = args.source
    t0 = time.perf_counter()
    res = pred.predict([row], info)
    dt = time.perf_counter() - t0
    per: dict[str, dict[str, Any]] = {
        t: {"value": float(r["point"][0]), "lo": float(r["lo"][0]), "hi": float(r["hi"][0]),
            "in_domain": bool(r["in_domain"][0]),
            "domain": "" if r["in_domain"][0] else str(r["domain"][0])}
        for t, r in res.items()}
    in_domain, domain = _domain({t: (bool(v["in_domain"]), str(v["domain"]))
                                 for t, v in per.items()})
    # values in SI units, the unit in each key: runtime_s, power_w, energy_j
    out: dict[str, Any] = {
        "gemm": row, "device": info.name, "model": pred.version,
        "model_kind": pred.model.kind, "interval": pred.model.meta.get("interval"),
        "predict_seconds": dt, "in_domain": in_domain, "domain": domain,
        **{COLUMN[t]: v for t, v in per.items()}}
    if args.json:
        print(json_text(out))
        return 0
    interval = "" if pred.roofline else \
        f", {100 * pred.model.meta.get('interval', 0.9):.0f}% interval"
    print(f"{args.m}x{args.n}x{args.k} {_describe(row)} on {info.name} ({pred.label()}"
          f"{interval})")
    if pred.roofline:
        print(pred.roofline_note())
    elif not in_domain:
        print(f"  outside the training data: {domain}; a guess, its interval widened "
              "to say so")
    flops = 2.0 * args.batch * args.m * args.n * args.k
    for t in ("runtime", "power", "energy"):
        if t not in per:
            print(f"  {t:<8} - ({pred.what} has no {t} data)")
            continue
        v = per[t]
        extra = f"  ({flops / v['value'] / 1e12:.3g} TFLOP/s)" if t == "runtime" else ""
        print(f"  {t:<8} {fmt_value(t, v['value']):>11}   [{fmt_value(t, v['lo'])}, "
              f"{fmt_value(t, v['hi'])}]{extra}")
    return 0


def _domain(per: dict[str, tuple[bool, str]]) -> tuple[bool, str]:
    """(every target in the domain, why not): the runtime's reasons, then each other
    target's not said yet (power and energy are out where power was never measured;
    energy, power x runtime, wherever either is)."""
    reasons: list[str] = []
    out = False
    for t in ("runtime", "power", "energy"):
        ok, why = per.get(t, (True, ""))
        out |= not ok
        for part in ([] if ok else why.split("; ")):
            part = part if t == "runtime" or t in part else f"{t}: {part}"
            if part not in reasons and part.split(": ", 1)[-1] not in reasons:
                reasons.append(part)
    return not out, "; ".join(reasons)


def _describe(row: dict[str, Any]) -> str:
    parts = [str(row["dtype"]), str(row["kernel"])]
    if row.get("kernel") == "tiled":
        parts.append(f"tile {row['tile']}")
    if row.get("cta_m"):
        parts.append(f"cta {row['cta_m']}x{row['cta_n']}x{row['cta_k']}")
    parts.append(str(row["layout"]))
    if row.get("out_dtype"):  # (fp8 GEMMs of one layout differ by what they write)
        parts.append(f"-> {row['out_dtype']}")
    if row.get("batch", 1) != 1:
        parts.append(f"batch {row['batch']}")
    return " ".join(parts)


def _configs(args: argparse.Namespace, pred: Predictor, info: DeviceInfo
             ) -> tuple[list[dict[str, Any]], bool]:
    """The configurations advise ranks, and whether they were seen on other GPUs: those
    the model was fitted on (on this GPU, else on any); for the roofline estimate, which
    tells dtypes apart but not kernels, tiles or layouts, each dtype the GPU has a peak
    rate for (or --dtype) with the daemon's default kernel and layout."""
    if pred.roofline:
        dtypes = [args.dtype] if args.dtype else [d for d in DTYPES if info.peak_flops.get(d)]
        return [{"dtype": d, "kernel": "blas", "tile": 0, "layout": "nn"} for d in dtypes], \
            False
    # the prior's configurations, and those the device's own probes (--calibrate) ran
    known = pred.model.meta.get("configs", []) + pred.model.meta.get("probe_configs", [])
    configs = [c for c in known if c["device"] == info.uuid
               and (not args.dtype or c["dtype"] == args.dtype)]
    if configs:
        return configs, False
    seen: dict[tuple[tuple[str, str], ...], dict[str, Any]] = {}
    for c in known:  # a GPU the model never saw: the configurations it saw elsewhere
        if not args.dtype or c["dtype"] == args.dtype:
            seen.setdefault(tuple(sorted((k, str(v)) for k, v in c.items()
                                         if k != "device")), c)
    return list(seen.values()), True


def cmd_advise(args: argparse.Namespace) -> int:
    import numpy as np

    cfg = load_config(args)
    pred = _predictor(args, cfg)
    info = _device(args, pred)
    configs, borrowed = _configs(args, pred, info)
    if args.dtype and configs and not any(_has_peak(info, c) for c in configs):
        raise _no_peak(info, args.dtype)
    # a dtype this GPU has no units for is no advice (its roofline would be made up)
    configs = [c for c in configs if _has_peak(info, c)]
    if not configs:
        which = f" for {args.dtype}" if args.dtype else ""
        raise GemmdError(f"{pred.what} knows no configuration{which} on {info.name}")
    rows = []
    for c in configs:
        r = {k: v for k, v in c.items() if k != "device"}
        rows.append({**r, "m": args.m, "n": args.n, "k": args.k, "batch": args.batch,
                     **({"source": args.source} if args.source else {})})
    res = pred.predict(rows, info)
    rt = res["runtime"]["point"]
    # in the domain as predict says it: every target, each configuration
    doms = [_domain({t: (bool(r["in_domain"][i]), str(r["domain"][i]))
                     for t, r in res.items()}) for i in range(len(rows))]
    dom = np.array([d for d, _ in doms])
    reason = next((why for d, why in doms if not d), "")
    en = res["energy"]["point"] if "energy" in res else np.full(len(rows), np.nan)
    pw = res["power"]["point"] if "power" in res else np.full(len(rows), np.nan)
    fastest = int(np.argmin(rt))
    frugal = int(np.nanargmin(en)) if np.isfinite(en).any() else None
    ranked = sorted(range(len(rows)), key=lambda i: rt[i])
    if args.json:
        print(json_text({"gemm": [args.m, args.n, args.k], "device": info.name,
                          "model": pred.version, "model_kind": pred.model.kind,
                          "in_domain": bool(dom.all()), "domain": reason,
                          "configurations_from_other_gpus": borrowed,
                          "fastest": _advice(rows[fastest], rt, pw, en, fastest),
                          "most_energy_efficient": None if frugal is None else
                          _advice(rows[frugal], rt, pw, en, frugal),
                          "configurations": [_advice(rows[i], rt, pw, en, i) for i in ranked]}))
        return 0
    what = "known configurations" if not pred.roofline else \
        "dtypes" if len(rows) > 1 else "dtype"
    print(f"{args.m}x{args.n}x{args.k} on {info.name}: {len(rows)} {what} ({pred.label()})")
    if pred.roofline:
        print(pred.roofline_note())
        print("  the roofline estimate tells dtypes apart, not kernels, tiles or layouts")
    elif borrowed:
        print("  no configuration was measured on this GPU: those seen on other GPUs")
    if not dom.all() and not pred.roofline:
        print(f"  outside the training data: {reason}; the ranking is a guess")
    print(f"  fastest:                {_describe(rows[fastest])}: "
          f"{fmt_value('runtime', rt[fastest])}, {fmt_value('energy', en[fastest])}")
    if frugal is not None:
        print(f"  most energy-efficient:  {_describe(rows[frugal])}: "
              f"{fmt_value('runtime', rt[frugal])}, {fmt_value('energy', en[frugal])}")
    else:
        print(f"  most energy-efficient:  - ({pred.what} has no energy data)")
    table = [("CONFIGURATION", "RUNTIME", "POWER", "ENERGY")]
    for i in ranked[:args.top]:
        table.append((_describe(rows[i]), fmt_value("runtime", rt[i]),
                      fmt_value("power", pw[i]), fmt_value("energy", en[i])))
    print()
    print_table(table)
    return 0


def _advice(row: dict[str, Any], rt: np.ndarray, pw: np.ndarray, en: np.ndarray, i: int
            ) -> dict[str, Any]:
    def f(x: float) -> float | None:
        return float(x) if math.isfinite(x) else None

    return {"config": {k: v for k, v in row.items() if k not in ("m", "n", "k")},
            "runtime_s": f(rt[i]), "power_w": f(pw[i]), "energy_j": f(en[i])}


# ------------------------------------------------------------------ parser


def _gemm_options(p: argparse.ArgumentParser, dtype_required: bool) -> None:
    dim = int_range("dimension", 1, 1 << 24)
    p.add_argument("m", type=dim)
    p.add_argument("n", type=dim)
    p.add_argument("k", type=dim)
    p.add_argument("--dtype", choices=DTYPES, required=dtype_required)
    p.add_argument("--batch", type=dim, default=1)
    p.add_argument("--model", type=path_arg("--model"),
                   help="model file (default: what the daemon predicts with: the store's "
                        "active model, else the roofline estimate)")
    p.add_argument("--gpu", type=nonempty("--gpu"),
                   help="a GPU of the catalogue (gemmd/hardware.py: V100 to B300, RTX "
                        "4070/4090/6000 Ada, MI300X/MI355X; key or nvidia-smi name) or of "
                        "--gpu-spec")
    gpu_spec_option(p)
    p.add_argument("--calibrate", action="append", default=[], metavar="FILE",
                   type=path_arg("--calibrate"),
                   help="measurements of the device (any format gemmd reads): carry the "
                        "model over to it, a device-wide then per dtype/kernel correction "
                        "(repeatable)")
    p.add_argument("--device", type=nonempty("--device"),
                   help="a device of the model or the store (uuid prefix or index)")
    p.add_argument("--source", type=_source_name, metavar="NAME",
                   help="whose measurement to predict: daemon (gemmd's own probes, which the "
                        "daemon compares with its predictions) or an imported source's (xla, "
                        "...): a GPU model the model knows only through other sources' "
                        "measurements is then out of its domain (default: none in particular)")
    p.add_argument("--json", action="store_true")


def _source_name(text: str) -> str:
    from gemmd.importer import SOURCE_NAME, SOURCE_NAME_RULE

    if not SOURCE_NAME.fullmatch(text):
        raise argparse.ArgumentTypeError(
            f"{text!r} must be {SOURCE_NAME_RULE} (daemon: gemmd's own probes)")
    return text


def add_commands(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("predict", parents=[common], help="runtime, power, energy of one GEMM")
    _gemm_options(p, dtype_required=True)
    p.add_argument("--kernel", choices=DATA_KERNELS, default="blas")
    p.add_argument("--tile", type=int_range("tile", 1, 32),
                   help="tile edge of the tiled kernel")
    p.add_argument("--cta", type=mnk("cta", "128x128x32"), help="CUTLASS CTA tile MxNxK")
    p.add_argument("--stages", type=int_range("--stages", 1, 32),
                   help="CUTLASS pipeline stages")
    p.add_argument("--layout", choices=LAYOUTS, default="nn")
    p.add_argument("--alpha", type=finite("--alpha"), default=1.0)
    p.add_argument("--beta", type=finite("--beta"), default=0.0)
    p.add_argument("--out-dtype", choices=DTYPES)
    p.set_defaults(func=cmd_predict)

    a = sub.add_parser("advise", parents=[common],
                       help="fastest and most energy-efficient known configuration")
    _gemm_options(a, dtype_required=False)
    a.add_argument("--top", type=int_range("--top", 1, 100_000), default=10,
                   help="configurations listed (default 10)")
    a.set_defaults(func=cmd_advise)
