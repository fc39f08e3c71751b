"""bench/gpu_accept.py on the simulated GPU, so that the GPU acceptance command cannot rot
where there is no GPU: every step that can run on the fake backend runs and writes rows."""

from __future__ import annotations

import csv
import os
import subprocess
import sys

from conftest import ROOT


def test_gpu_accept_runs_on_the_fake_backend(tmp_path):
    out = tmp_path / "accept"  # the script creates it
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("GEMMD_CONFIG", None)
    p = subprocess.run([sys.executable, "bench/gpu_accept.py", str(out), "--backend", "fake",
                        "--quick"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    summary = (out / "SUMMARY.md").read_text()
    assert "## Figures and targets" in summary and "FAILED" not in summary
    for step in ("fidelity", "launch"):  # need CuPy/torch on a real GPU
        assert not (out / f"{step}.csv").exists()
    assert summary.count("skipped: needs a GPU") >= 2
    for name in ("probe_default", "sweep", "energy", "noise", "round_cost"):
        with open(out / f"{name}.csv", newline="") as f:
            rows = list(csv.DictReader(f))
        assert rows, name
    run = (out / "run.txt").read_text()
    assert "SIGTERM: exit 0" in run
