"""``gemmd report``: predicted vs measured as the paper's figures, one HTML page."""

from __future__ import annotations

import argparse
from pathlib import Path

from gemmd.cli.args import data_options
from gemmd.cli.context import load_config, load_dataset
from gemmd.cli.output import Progress


def cmd_report(args: argparse.Namespace) -> int:
    from gemmd import report

    cfg = load_config(args)
    ds = load_dataset(args, cfg)
    bar = Progress(report.work_units(), "report")
    try:
        path = report.write(ds, Path(args.out), cfg=cfg.model, split=args.split,
                            n_jobs=args.jobs, progress=bar)
    finally:
        bar.close()
    print(f"wrote {path}")
    return 0


def add_commands(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    r = sub.add_parser("report", parents=[common],
                       help="HTML report: predicted vs measured, error by size and config")
    data_options(r)
    r.add_argument("--out", default="gemmd-report", help="output folder (default "
                                                         "gemmd-report)")
    r.add_argument("--split", choices=("random", "shape"), default="shape")
    r.set_defaults(func=cmd_report)
