"""bench/gpu_accept.py on the simulated GPU, so that the GPU acceptance command cannot rot
where there is no GPU: every step that can run on the fake backend runs and writes rows,
into at most 6 files (the lent GPU machine returns 8), SUMMARY.md among them."""

from __future__ import annotations

import csv
import io
import os
import subprocess
import sys
import tarfile

import pytest
from conftest import ROOT


def _accept(out, *args):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("GEMMD_CONFIG", None)
    return subprocess.run([sys.executable, "bench/gpu_accept.py", str(out), "--backend", "fake",
                           "--quick", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)


def _archive(out) -> dict[str, str]:
    with tarfile.open(out / "results.tar.gz") as tar:
        return {m.name.split("/", 1)[1]: tar.extractfile(m).read().decode()
                for m in tar.getmembers() if m.isfile()}


def test_gpu_accept_runs_on_the_fake_backend(tmp_path):
    out = tmp_path / "accept"  # the script creates it
    p = _accept(out)
    assert p.returncode == 0, p.stdout + p.stderr
    assert sorted(f.name for f in out.iterdir()) == ["SUMMARY.md", "results.tar.gz"]
    summary = (out / "SUMMARY.md").read_text()
    assert "## Figures and targets" in summary and "FAILED" not in summary
    assert "- virtualization: " in summary and "- versions: " in summary
    files = _archive(out)
    for step in ("fidelity", "launch", "slowdown"):  # need CuPy/torch/NVML on a real GPU
        assert f"{step}.csv" not in files
    assert summary.count("skipped: needs a GPU") >= 3
    for name in ("probe_default", "sweep", "energy", "noise", "noise_stats", "round_cost"):
        rows = list(csv.DictReader(io.StringIO(files[f"{name}.csv"])))
        assert rows, name
    stats = list(csv.DictReader(io.StringIO(files["noise_stats.csv"])))
    assert {"excess_kurtosis", "max_dev_robust_sd", "outliers_per_100"} <= set(stats[0])
    # Where a probe's time goes: phases, host reads, and what a call costs beyond its GEMMs.
    phases = {r["what"]: r for r in csv.DictReader(io.StringIO(files["phases.csv"]))}
    for what in ("host call energy_j", "call overhead, run (warm-up)",
                 "call overhead, run_observed (window)"):
        assert float(phases[what]["elapsed_s"]) >= -1e-3, (what, phases[what])
    assert "SIGTERM: exit 0" in files["run.txt"] and "Resident memory" in files["run.txt"]
    assert files["SUMMARY.md"] == summary


def test_a_short_deadline_cuts_the_longest_steps_and_says_so(tmp_path):
    out = tmp_path / "accept"
    p = _accept(out, "--deadline", "20")
    assert p.returncode == 0, p.stdout + p.stderr
    summary = (out / "SUMMARY.md").read_text()
    assert "Cut by the deadline (granted / asked): " in summary
    # The 2-minute daemon run, the longest and last, is the one cut.
    assert "| 11 | gemmd run, scraped, SIGTERM, RSS | cut: deadline |" in summary
    assert len(list(out.iterdir())) <= 6


def test_the_plan_cuts_the_longest_steps_first():
    sys.path.insert(0, str(ROOT / "bench"))
    import gpu_accept

    assert gpu_accept.plan([10, 50, 150, 130], 400) == [10, 50, 150, 130]
    # Under its minimum a step gets nothing, and the others share what it leaves.
    assert gpu_accept.plan([10, 50, 150, 130], 150, [5, 20, 100, 40]) == \
        pytest.approx([10, 50, 0, 90])
    got = gpu_accept.plan([10, 50, 150, 130], 250)
    assert got[:2] == [10, 50] and abs(got[2] - 95) < 0.01 and abs(got[3] - 95) < 0.01
    assert abs(sum(gpu_accept.plan([10, 50, 150, 130], 100)) - 100) < 0.01


def test_a_folder_holding_other_files_is_refused(tmp_path):
    (tmp_path / "old.csv").write_text("x\n")
    p = _accept(tmp_path)
    assert p.returncode == 2 and "holds other files (old.csv)" in p.stderr
    assert sorted(f.name for f in tmp_path.iterdir()) == ["old.csv"]


@pytest.mark.parametrize("args, says", [
    (["--rounds", "2"], "--rounds 2: must be 3 to 1000"),
    (["--rounds", "x"], "--rounds: invalid int value"),
    (["--gap", "-1"], "--gap -1.0: must be 0 to 600 seconds"),
    (["--gap", "nan"], "--gap nan: must be 0 to 600 seconds"),
    (["--slowdown", "fans"], "--slowdown: invalid choice"),
])
def test_bad_step_options_are_one_line_and_write_nothing(tmp_path, args, says):
    p = _accept(tmp_path / "out", *args)
    assert p.returncode == 2 and says in p.stderr and "Traceback" not in p.stderr
    assert not (tmp_path / "out").exists()


def test_spaced_rounds_say_so_and_run_as_many_as_asked(tmp_path):
    p = _accept(tmp_path, "--only", "4", "--rounds", "4", "--gap", "0.05")
    assert p.returncode == 0, p.stderr
    summary = (tmp_path / "SUMMARY.md").read_text()
    assert "4 rounds of the 2 default sentinels, 0.05 s of idle between rounds" in summary
    rows = list(csv.DictReader(io.StringIO(_archive(tmp_path)["noise.csv"])))
    assert sorted({r["round"] for r in rows}) == ["0", "1", "2", "3"]
    # Without --gap the simulated GPU's rounds run back to back (a real one's 2 s apart).
    p = _accept(tmp_path / "again", "--only", "4", "--rounds", "3")
    assert p.returncode == 0, p.stderr
    assert "3 rounds of the 2 default sentinels, back to back" in \
        (tmp_path / "again" / "SUMMARY.md").read_text()


def test_a_past_gpu_runs_slowdown_replays_through_todays_detector():
    """The H200's real clock cap (bench/results/2026-11-26-h200), offline."""
    archive = ROOT / "bench/results/2026-11-26-h200/results.tar.gz"
    p = subprocess.run([sys.executable, "bench/gpu_accept.py", "--replay", str(archive)],
                       cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)),
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert "| 20 | clocks -5% (1875 MHz) |" in p.stdout
    assert "false alarms over the stock rounds (after the baseline) | 0 | 0 | yes" in p.stdout
    assert "`rebaseline` clears the alarm" in p.stdout


def _idle(out, *args):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("GEMMD_CONFIG", None)
    return subprocess.run([sys.executable, "bench/power_after_idle.py", str(out), *args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_power_after_idle_writes_a_row_per_probe_and_gap(tmp_path):
    r = _idle(tmp_path, "--backend", "fake", "--gaps", "0,0.1")
    assert r.returncode == 0, r.stderr
    rows = list(csv.DictReader(open(tmp_path / "power_after_idle.csv")))
    assert [(x["round"], x["gap_s"]) for x in rows] == [("0", "0.0")] * 2 + [("1", "0.1")] * 2
    assert {x["probe"] for x in rows} == {"blas-bf16-nn-8192x8192x8192",
                                          "blas-fp32-nn-8192x8192x8192"}
    for x in rows:
        assert x["outcome"] == "ok"
        assert float(x["power_over_limit"]) == pytest.approx(
            float(x["power_w"]) / float(x["power_limit_w"]))


@pytest.mark.parametrize("gaps", ["a,b", "-1", "", "5000"])
def test_power_after_idle_refuses_bad_gaps_in_one_line(tmp_path, gaps):
    r = _idle(tmp_path, "--backend", "fake", "--gaps", gaps)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert f"--gaps {gaps!r}" in r.stderr
    assert not (tmp_path / "power_after_idle.csv").exists()


def _sweep(out, budget: str, **more: str):
    env = dict(os.environ, PYTHONPATH=str(ROOT), GEMMD_SWEEP_BACKEND="fake",
               GEMMD_SWEEP_SIZES="256 512", GEMMD_SWEEP_DTYPES="bf16 fp32",
               PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])
    env.update(more)
    env.pop("GEMMD_CONFIG", None)
    return subprocess.run(["bash", "bench/gpu_sweep.sh", str(out), budget], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)


def test_the_gpu_sweep_exports_every_shape_and_dtype_for_the_transfer_bench(tmp_path):
    """bench/gpu_sweep.sh on the simulated GPU (2 devices): every (M, N, K) of the sizes
    for each dtype, exported as a file that bench/transfer.py --holdout (and gemmd
    evaluate) reads, per GPU model and per dtype; a run with no time left measures
    nothing and says so, with a non-zero exit."""
    out = tmp_path / "sweep"
    p = _sweep(out, "300")
    assert p.returncode == 0, p.stdout + p.stderr
    rows = list(csv.DictReader((out / "sweep.csv").open()))
    assert len(rows) == 2 * 2 * 2**3  # devices x dtypes x shapes
    assert {(r["m"], r["n"], r["k"]) for r in rows} == {
        (m, n, k) for m in ("256", "512") for n in ("256", "512") for k in ("256", "512")}
    assert {r["dtype"] for r in rows} == {"bf16", "fp32"}
    assert all(float(r["runtime_s"]) > 0 for r in rows)
    sys.path.insert(0, str(ROOT / "bench"))
    import transfer

    by = transfer.by_gpu([out / "sweep.csv"])
    assert len(by) == 1 and sum(len(t) for t in by.values()) == 32
    per = transfer.by_gpu([out / "sweep.csv"], per_dtype=True)
    assert sorted(k.split("/")[1] for k in per) == ["bf16", "fp32"]
    assert all(set(t["dtype"]) == {k.split("/")[1]} for k, t in per.items())
    late = tmp_path / "late"
    p = _sweep(late, "0")
    assert p.returncode != 0 and "done in" in p.stdout and "0 rows" in p.stdout
    assert (late / "sweep.log").read_text().count("cut by the budget") == 4
    assert not (late / "sweep.csv").exists()


def test_the_random_sweep_draws_seeded_shapes_half_of_them_unaligned(tmp_path):
    """GEMMD_SWEEP_RANDOM=N: N shapes per dtype between the least and largest size, half
    rounded to multiples of 64 and half left as drawn (odd sizes, which cuBLAS runs on
    other kernels), the same shapes for the same seed, every dtype in each chunk of 25."""
    runs = []
    for name in ("a", "b"):
        p = _sweep(tmp_path / name, "300", GEMMD_SWEEP_RANDOM="30", GEMMD_SWEEP_SEED="7",
                   GEMMD_SWEEP_SIZES="128 4096")
        assert p.returncode == 0, p.stdout + p.stderr
        runs.append(list(csv.DictReader((tmp_path / name / "sweep.csv").open())))
    rows = runs[0]
    assert len(rows) == 2 * 2 * 30  # devices x dtypes x shapes
    shapes = {(int(r["m"]), int(r["n"]), int(r["k"])) for r in rows}
    assert shapes == {(int(r["m"]), int(r["n"]), int(r["k"])) for r in runs[1]}
    assert all(128 <= d <= 4096 for s in shapes for d in s)
    aligned = [s for s in shapes if all(d % 64 == 0 for d in s)]
    assert 10 <= len(aligned) <= 40 and len(shapes) - len(aligned) >= 10
    log = (tmp_path / "a" / "sweep.log").read_text()
    assert [x.split(":")[0] for x in log.splitlines() if "-random-" in x and "exit" in x] == [
        "bf16-random-0", "fp32-random-0", "bf16-random-1", "fp32-random-1"]


@pytest.mark.parametrize("content, args, says", [
    ("x,y\n", ["--holdout"], "no data rows"),
    (None, ["--holdout"], "cannot read"),
    (None, ["--holdout-only"], "need --holdout FILE"),
    ("x,y\n", ["--defaults", "--holdout"], "not with --defaults"),
    ("x,y\n", ["--align", "--holdout"], "--coverage-only or --align"),
])
def test_the_transfer_bench_refuses_a_bad_holdout_in_one_line(tmp_path, content, args, says):
    """bench/transfer.py --holdout: a file it cannot use, or options that need one, stop
    it with one line and exit 2 before any model is fitted."""
    (tmp_path / "data" / "gpperf").mkdir(parents=True)  # past the shared-data check
    f = tmp_path / "holdout.csv"
    if content is not None:
        f.write_text(content)
    argv = [a for x in args for a in ([x, str(f)] if x == "--holdout" else [x])]
    r = subprocess.run([sys.executable, "bench/transfer.py", "--data",
                        str(tmp_path / "data"), *argv], cwd=ROOT, capture_output=True,
                       text=True, timeout=120, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and says in r.stderr
