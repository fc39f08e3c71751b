"""What a probe's power reads after idle: the default sentinels after growing idle gaps.

    python3 bench/power_after_idle.py OUTDIR [--gaps 0,0,1,3,10,30,60,90] [--backend B]

On a GPU (the lent machine: ``PYTHONPATH=/tmp/site:$PWD`` after the wheels, as
bench/gpu_accept.sh installs them). Each gap: the GPU idles that many seconds, then one
round of the default plan (its sentinels in order, the daemon's MeasureConfig). Why: an
H100's power-capped bf16 sentinel read 1.05-1.17x its 700 W limit over 0.5 s windows 2 s
apart, 0.96-1.09x back to back (bench/results/2026-11-26-h100*): the power controller acts
on a running average, and a window right after idle sees it overshoot. The daemon's
rounds are 120 s apart; gemmd's bounds (``bounds.LIMIT_TOLERANCE``) must hold for what a
window reads after that long. Writes OUTDIR/power_after_idle.csv (a row per probe, with
the gap before its round and power / limit), flushed after each round, so that a run cut
short keeps what it measured.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_accept import measure_row  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("outdir", type=Path)
    ap.add_argument("--gaps", default="0,0,1,3,10,30,60,90",
                    help="idle seconds before each round, comma-separated")
    ap.add_argument("--backend", choices=("nvidia", "fake"), default="nvidia")
    args = ap.parse_args(argv)
    try:
        gaps = [float(x) for x in args.gaps.split(",") if x.strip()]
    except ValueError:
        ap.error(f"--gaps {args.gaps!r}: seconds separated by commas")
    if not gaps or any(not 0 <= g <= 3600 for g in gaps):
        ap.error(f"--gaps {args.gaps!r}: each must be 0 to 3600 seconds")
    from gemmd.config import Config
    from gemmd.devices import open_devices
    from gemmd.probes import build_plan

    cfg = dataclasses.replace(Config(), backend=args.backend, isolation="thread")
    devs = open_devices(cfg)
    dev = devs[0]
    plan, _ = build_plan(cfg.probes.sentinels, dev)
    for spec in plan:  # buffers and graphs first, as a daemon that has run before has them
        measure_row(dev, spec, cfg.probes.measure)
    args.outdir.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    for rnd, gap in enumerate(gaps):
        time.sleep(gap)
        for spec in plan:
            r = measure_row(dev, spec, cfg.probes.measure)
            limit = r.get("power_limit_w")
            rows.append({"round": rnd, "gap_s": gap, **r,
                         "power_over_limit": r["power_w"] / limit
                         if r.get("power_w") and limit else None})
            print(f"gap {gap:g} s: {spec.name}: {r.get('outcome')} "
                  f"power {r.get('power_w')} W, /limit {rows[-1]['power_over_limit']}",
                  flush=True)
        # Rewritten whole after each round: a failed probe's row has fewer columns.
        with open(args.outdir / "power_after_idle.csv", "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(dict.fromkeys(k for r in rows for k in r)))
            w.writeheader()
            w.writerows(rows)
    for d in devs:
        d.close()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
