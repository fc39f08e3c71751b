"""`gemmd probe` as a user sees it: progress as probes finish, a hint when nothing ran."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _probe(tmp_path, config: str, *args: str) -> subprocess.CompletedProcess:
    cfg = tmp_path / "gemmd.yaml"
    cfg.write_text(config)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "gemmd", "probe", "--config", str(cfg),
                           "--no-store", "--window", "0.2", "--shape", "1024x1024x1024",
                           "--dtype", "fp32", "--dtype", "bf16", *args],
                          capture_output=True, text=True, timeout=120, env=env)


def test_each_result_is_shown_as_it_comes_for_every_device(tmp_path):
    r = _probe(tmp_path, "backend: fake\nisolation: thread\n")
    assert r.returncode == 0, r.stderr
    progress = [ln for ln in r.stderr.splitlines() if ": ok (" in ln]
    assert sorted(ln.split(":")[0] for ln in progress) == ["GPU 0", "GPU 0", "GPU 1", "GPU 1"]
    assert r.stdout.count(" ok") == 4 and r.stdout.startswith("GPU  PROBE")


def test_when_every_probe_was_skipped_it_says_why_and_how_to_force(tmp_path):
    busy = ("backend: fake\nisolation: thread\nfake:\n  devices:\n    - {busy: true}\n"
            "    - {other_utilization: 0.5}\n")
    r = _probe(tmp_path, busy)
    assert r.returncode == 1
    assert r.stderr.strip().splitlines()[-1] == (
        "gemmd: no probe ran (busy: other_processes, utilization; --force probes a busy "
        "device anyway)")
    r = _probe(tmp_path, busy, "--force")
    assert r.returncode == 0 and r.stdout.count(" ok") == 4, r.stderr
