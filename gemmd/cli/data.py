"""The store's data: ``gemmd import`` (measurements as a named source), ``gemmd export``
(stored results with their device, as the generic CSV that import and fit read) and
``gemmd prune`` (delete one source's results on request)."""

from __future__ import annotations

import argparse
import math
import sys
from typing import TYPE_CHECKING, Any

from gemmd.cli.args import (
    DTYPES,
    UsageError,
    format_choices,
    gpu_spec_option,
    int_range,
    nonempty,
    path_arg,
)
from gemmd.cli.context import gpu_catalog, load_config, open_or_create_store, open_store, store_path
from gemmd.errors import InputError

if TYPE_CHECKING:
    from gemmd.store import Store


def cmd_import(args: argparse.Namespace) -> int:
    import numpy as np

    from gemmd import datasets, importer
    from gemmd.gemm import COLUMN

    name = importer.check_source_name(args.name) if args.name is not None else None
    ds = datasets.load(args.format, args.files, gpu=args.gpu,
                       catalog=gpu_catalog(args.gpu_spec)[0])
    source = name or ds.name.replace("+", "_")
    store = open_or_create_store(load_config(args))
    try:
        n = importer.import_dataset(store, ds, source)
    finally:
        store.close()
    meas = ", ".join(f"{t} {int(np.isfinite(ds.table[c]).sum()):,}" for t, c in COLUMN.items()
                     if np.isfinite(ds.table[c]).any())
    gpus = ", ".join(d.name for d in ds.table.devices)
    print(f"imported {n:,} rows ({meas}) on {gpus} as source {source!r}")
    print(f"  kept apart from the daemon's probes; use them with --source {source}")
    for note in ds.notes:
        print(f"  note: {note}")
    return 0


# Columns of `gemmd export`, in order: gemmd's generic CSV (docs/model.md), so that
# `gemmd import` reads an export back, plus where each row came from.
EXPORT_COLUMNS = ("host", "source", "kind", "timestamp", "device_uuid", "gpu", "gpu_key",
                  "m", "n", "k", "batch", "dtype", "kernel", "tile", "layout", "cta_m",
                  "cta_n", "cta_k", "stages", "alpha", "beta", "out_dtype", "runtime_s",
                  "power_w", "energy_j")
EXPORT_DEVICE = (*(f"peak_{d}_tflops" for d in DTYPES), "mem_bandwidth_gbs", "sm_count",
                 "power_limit_w")


def export_rows(store: Store, sources: list[str] | None, include_flagged: bool = False,
                host: str | None = None) -> tuple[tuple[str, ...], list[list[Any]]]:
    """(header, rows) of ``gemmd export``: every stored result of ``sources`` (all when
    None) with its device's identity and figures, oldest first."""
    import socket

    from gemmd.hardware import gpu_model_key
    from gemmd.registry import device_infos
    from gemmd.store import measured_by

    infos = device_infos(store)
    host = host or socket.gethostname()
    header = (*EXPORT_COLUMNS, *EXPORT_DEVICE)
    dev_cols: dict[str, list[Any]] = {}
    for uuid, d in infos.items():
        dev_cols[uuid] = [_g(d.peak_flops.get(x), 1e-12) for x in DTYPES] + [
            _g(d.mem_bandwidth or None, 1e-9), d.sm_count or "",
            _g(d.power_limit_w)]
    out = []
    for r in reversed(store.probes(sources=sources, include_flagged=include_flagged)):
        dev = infos.get(r["device_uuid"])
        # whose measurement (an import's file said; store.measured_by), else the store's name
        rec = {**r, "source": measured_by(r) or r["source"],
               "host": host, "timestamp": _g(r["ts"]), "gpu": r.get("device_name") or
               (dev.name if dev else ""), "gpu_key": gpu_model_key(dev) if dev else ""}
        row = []
        for c in EXPORT_COLUMNS:
            v = rec.get(c)
            row.append("" if v is None else _g(v) if isinstance(v, float) else v)
        out.append(row + dev_cols.get(r["device_uuid"], [""] * len(EXPORT_DEVICE)))
    return header, out


def _g(v: Any, factor: float = 1.0) -> Any:
    """A number as exactly as it was stored (repr), '' for None/NaN."""
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return ""
    x = float(v) * factor
    if factor != 1.0:
        x = float(f"{x:.12g}")  # 2039e9 B/s -> 2039 GB/s, not 2039.0000000000002
    return int(x) if x.is_integer() and abs(x) < 2**53 else repr(x)


def cmd_export(args: argparse.Namespace) -> int:
    import csv

    if args.all_sources and args.source:
        raise UsageError("give --source NAME or --all-sources, not both")
    sources = None if args.all_sources else (args.source or ["daemon"])
    store = open_store(load_config(args))
    try:
        header, rows = export_rows(store, sources, args.include_flagged)
    finally:
        store.close()
    if not rows:
        which = "any source" if sources is None else f"source {', '.join(sources)}"
        raise InputError(f"the store holds no results of {which} (see gemmd status)")
    out = str(args.out)
    if out.endswith(".parquet"):
        try:
            import pyarrow as pa
            import pyarrow.parquet as pq
        except ImportError:
            raise InputError("--out *.parquet needs pyarrow (pip install pyarrow); "
                             "write a .csv instead") from None
        cols = {h: [r[i] if r[i] != "" else None for r in rows] for i, h in enumerate(header)}
        pq.write_table(pa.table({h: [None if v is None else str(v) for v in vals]
                                 for h, vals in cols.items()}), out)
    elif out == "-":
        w = csv.writer(sys.stdout, lineterminator="\n")
        w.writerow(header)
        w.writerows(rows)
        return 0
    else:
        try:
            with open(out, "w", newline="", encoding="utf-8") as f:
                w = csv.writer(f, lineterminator="\n")
                w.writerow(header)
                w.writerows(rows)
        except OSError as e:
            raise InputError(f"--out {out}: cannot write: {e.strerror or e}") from e
    print(f"exported {len(rows):,} rows to {out}", file=sys.stderr)
    return 0


def cmd_prune(args: argparse.Namespace) -> int:
    """Delete stored results of one source, on request (the daemon prunes only its own)."""
    if not (args.all or args.older_than is not None or args.max_rows is not None):
        raise UsageError("say what to delete: --older-than DAYS, --max-rows N or --all")
    if args.all and (args.older_than is not None or args.max_rows is not None):
        raise UsageError("--all deletes every row of the source: give it alone")
    if args.older_than is not None and not args.older_than >= 0:
        raise UsageError(f"--older-than {args.older_than:g}: must be 0 or more days")
    cfg = load_config(args)
    db = store_path(cfg)
    store = open_store(cfg)
    try:
        known = {s["source"]: s["rows"] for s in store.sources()}
        if args.source not in known:
            have = ", ".join(f"{k} ({v:,} rows)" for k, v in known.items()) or "none"
            raise InputError(f"--source {args.source}: no such source in {db} (sources: "
                             f"{have})")
        if args.all:
            n = store.delete_source(args.source)
        else:
            n = store.prune(args.older_than, args.max_rows, sources=(args.source,))
    finally:
        store.close()
    print(f"deleted {n:,} of {known[args.source]:,} rows of source {args.source!r}")
    return 0


def add_commands(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    i = sub.add_parser("import", parents=[common], help="bring measurements into the store")
    i.add_argument("files", nargs="+", metavar="FILE", type=path_arg("FILE"))
    i.add_argument("--format", choices=format_choices(), default="auto")
    i.add_argument("--name", help="source name (default: the format's name)")
    i.add_argument("--gpu", type=nonempty("--gpu"),
                   help="GPU of the rows when the file has no GPU column (a file that names "
                        "its GPU and a different --gpu is an error)")
    gpu_spec_option(i)
    i.set_defaults(func=cmd_import)

    x = sub.add_parser("export", parents=[common],
                       help="stored results with their device, as CSV for another host")
    x.add_argument("--source", action="append", default=[], metavar="NAME",
                   help="store source to export (repeatable; default: daemon)")
    x.add_argument("--all-sources", action="store_true", help="every source")
    x.add_argument("--include-flagged", action="store_true",
                   help="also results taken while a device was flagged as drifting")
    x.add_argument("--out", default="-", type=path_arg("--out"),
                   help="output file (default: stdout); *.parquet writes Parquet if pyarrow "
                        "is installed")
    x.set_defaults(func=cmd_export)

    pn = sub.add_parser("prune", parents=[common],
                        help="delete stored results of one source (e.g. an import)")
    pn.add_argument("--source", required=True, metavar="NAME",
                    help="the source: an import's name, or daemon (see gemmd status)")
    pn.add_argument("--older-than", type=float, metavar="DAYS",
                    help="delete its results older than this many days")
    pn.add_argument("--max-rows", type=int_range("--max-rows", 0, 1 << 40), metavar="N",
                    help="keep only its newest N results")
    pn.add_argument("--all", action="store_true", help="delete every result of the source")
    pn.set_defaults(func=cmd_prune)
