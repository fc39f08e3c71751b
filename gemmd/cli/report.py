"""``gemmd report``: one self-contained HTML page of figures.

Without ``--fleet``: the model report (gemmd's model and GPPerf's pipeline refitted on a
split of the data, and the deployed model judged as it is). With ``--fleet``: each GPU's
sentinel probes over time from the daemon's store, measured against predicted."""

from __future__ import annotations

import argparse

from gemmd.cli.args import UsageError, data_options
from gemmd.cli.context import load_config, load_dataset
from gemmd.cli.output import Progress


def cmd_report(args: argparse.Namespace) -> int:
    from gemmd import report

    cfg = load_config(args)
    if args.fleet:
        given = [o for o, v in (("FILE", args.files), ("--source", args.source),
                                ("--gpu", args.gpu), ("--gpu-spec", args.gpu_spec)) if v]
        if given:
            raise UsageError(f"--fleet reads the daemon's store: give no {', '.join(given)}")
        out = report.check_out("gemmd-fleet.html" if args.out is None else args.out)
        path = report.write_fleet(out, state_dir=cfg.resolved_state_dir(), drift_cfg=cfg.drift,
                                  model_cfg=cfg.model, days=args.days, devices=args.device)
    else:
        if args.device:
            raise UsageError("--device selects GPUs of the fleet report: add --fleet")
        # checked before the data is loaded and fitted ('' is refused, not the default)
        out = report.check_out("gemmd-report.html" if args.out is None else args.out)
        ds = load_dataset(args, cfg)
        bar = Progress(report.work_units(), "report")
        try:
            path = report.write(ds, out, cfg=cfg.model, split=args.split, n_jobs=args.jobs,
                                progress=bar, state_dir=cfg.resolved_state_dir())
        finally:
            bar.close()
    print(f"wrote {path}")
    return 0


def add_commands(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    r = sub.add_parser("report", parents=[common],
                       help="HTML report: the model against measurements, or (--fleet) "
                            "each GPU's probes over time")
    data_options(r)
    r.add_argument("--out", default=None, metavar="FILE.html",
                   help="the report's file (default gemmd-report.html; gemmd-fleet.html "
                        "with --fleet)")
    r.add_argument("--split", choices=("random", "shape"), default="shape")
    r.add_argument("--fleet", action="store_true",
                   help="the fleet report: each GPU's sentinel probes over time, from the "
                        "daemon's store")
    r.add_argument("--days", type=float, default=7.0,
                   help="--fleet: the window in days, ending at the newest result (default 7)")
    r.add_argument("--device", action="append", default=[], metavar="IDX|UUID",
                   help="--fleet: only these GPUs (repeatable)")
    r.set_defaults(func=cmd_report)
