"""`gemmd import | export | fit | evaluate | predict | advise | report` end to end on small
files, and how the command line reports what goes wrong (one line, exit 1 or 2)."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np
import pytest

from gemmd.cli import main
from gemmd.cli.output import Progress
from gemmd.store import Store

SIZES = (256, 512, 768, 1024, 1536, 2048)
PEAK, BW = 29.1e12, 504e9  # RTX 4070 fp32


def make_csv(path, n: int = 90, seed: int = 0) -> None:
    """Generic CSV: the paper's tiled kernel at tile-dependent efficiency, with power."""
    rng = np.random.default_rng(seed)
    eff = {8: 0.09, 16: 0.15, 32: 0.12}
    lines = ["gpu,m,n,k,dtype,kernel,tile,runtime_ms,power_w"]
    for _ in range(n):
        m, nn, k = (int(x) for x in rng.choice(SIZES, 3))
        tile = int(rng.choice(list(eff)))
        t = 2 * m * nn * k / (PEAK * eff[tile]) * float(np.exp(rng.normal(0, 0.02)))
        p = {8: 110.0, 16: 125.0, 32: 100.0}[tile] * float(np.exp(rng.normal(0, 0.01)))
        lines.append(f"rtx4070,{m},{nn},{k},fp32,tiled,{tile},{t * 1e3:.6g},{p:.4g}")
    path.write_text("\n".join(lines) + "\n")


@pytest.fixture
def env(tmp_path):
    f = tmp_path / "tiled.csv"
    make_csv(f)
    return tmp_path, f, ["--state-dir", str(tmp_path / "state")]


def run(capsys, *argv: str) -> tuple[int, str, str]:
    try:
        rc = main(list(argv))
    except SystemExit as e:  # argparse usage errors
        rc = int(e.code)
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_import_fit_predict_advise(capsys, env):
    tmp, f, sd = env
    rc, out, _ = run(capsys, "import", "--format", "csv", str(f), "--name", "lab", *sd)
    assert rc == 0 and "imported 90 rows (runtime 90, power 90)" in out
    assert "source 'lab'" in out
    rc, out, _ = run(capsys, "fit", "--source", "lab", *sd)
    assert rc == 0 and "saved to the store as model rf-1" in out
    rc, out, _ = run(capsys, "predict", "1024", "1024", "1024", "--dtype", "fp32",
                     "--kernel", "tiled", "--tile", "16", "--json", *sd)
    assert rc == 0
    res = json.loads(out)
    truth = 2 * 1024**3 / (PEAK * 0.15)
    # SI units, the unit in each key
    assert res["runtime_s"]["value"] == pytest.approx(truth, rel=0.15)
    assert res["runtime_s"]["lo"] < res["runtime_s"]["value"] < res["runtime_s"]["hi"]
    assert res["energy_j"]["value"] == pytest.approx(res["power_w"]["value"] *
                                                     res["runtime_s"]["value"], rel=1e-6)
    assert res["in_domain"] is res["runtime_s"]["in_domain"] is True
    assert "runtime" not in res and "power" not in res
    rc, out, _ = run(capsys, "predict", "1024", "1024", "1024", "--dtype", "fp32", *sd)
    assert rc == 0 and "runtime" in out and "TFLOP/s" in out and "[" in out
    # The paper's finding as a tool: tile 16 is fastest, tile 32 draws the least power.
    rc, out, _ = run(capsys, "advise", "2048", "2048", "2048", "--json", *sd)
    assert rc == 0
    adv = json.loads(out)
    assert adv["fastest"]["config"]["tile"] == 16
    assert len(adv["configurations"]) == 3
    rc, out, _ = run(capsys, "advise", "2048", "2048", "2048", *sd)
    assert rc == 0 and "fastest:" in out and "most energy-efficient:" in out


def test_evaluate_table_and_json(capsys, env):
    tmp, f, sd = env
    rc, out, _ = run(capsys, "evaluate", str(f), "--json", *sd)
    assert rc == 0
    res = json.loads(out)
    assert set(res["splits"]) == {"random", "shape"}
    assert {"gemmd", "gpperf"} <= set(res["splits"]["shape"])
    assert res["splits"]["random"]["gemmd"]["targets"]["runtime"]["mape"] < 0.1
    rc, out, _ = run(capsys, "evaluate", str(f), "--split", "shape", "--baseline", "none", *sd)
    assert rc == 0 and re.search(r"shape\s+runtime\s+gemmd", out)
    assert " gpperf " not in out.split("SPLIT")[1]


def test_fit_on_files_writes_a_model_file(capsys, env):
    tmp, f, sd = env
    rc, _, err = run(capsys, "fit", str(f), *sd)
    assert rc == 2 and "needs --out FILE" in err
    rc, out, _ = run(capsys, "fit", str(f), "--out", str(tmp / "m.skops"), *sd)
    assert rc == 0 and (tmp / "m.skops").is_file()
    rc, out, _ = run(capsys, "predict", "512", "512", "512", "--dtype", "fp32", "--kernel",
                     "tiled", "--tile", "8", "--model", str(tmp / "m.skops"), *sd)
    assert rc == 0 and "NVIDIA GeForce RTX 4070" in out


def test_errors_are_one_line(capsys, env):
    tmp, f, sd = env
    bad = tmp / "bad.csv"
    bad.write_text("gpu,m,n,k,dtype,runtime_ms\nrtx4070,8,8,8,fp32,1\nrtx4070,8,x,8,fp32,1\n")
    rc, _, err = run(capsys, "import", str(bad), "--format", "csv", *sd)
    assert rc == 1
    assert err == f"gemmd: error: {bad}: row 3, column n: 'x' is not a number\n"
    store = Store(tmp / "state" / "gemmd.db")
    assert store.counts() == []  # nothing half-imported
    store.close()
    # no model yet: the roofline estimate, for a device the store does not know yet
    rc, _, err = run(capsys, "predict", "8", "8", "8", "--dtype", "fp32", *sd)
    assert rc == 1 and "the store knows no device yet: name one with --gpu" in err
    assert err.count("\n") == 1
    rc, _, err = run(capsys, "predict", "8", "8", "--dtype", "fp32", *sd)
    assert rc == 2 and err.count("\n") == 1
    rc, _, err = run(capsys, "evaluate", str(f), "--source", "x", *sd)
    assert rc == 2 and "not both" in err
    rc, _, err = run(capsys, "fit", "--source", "nothing", *sd)
    assert rc == 1 and "no usable rows for source nothing" in err


def test_report_writes_html_with_figures(capsys, env):
    tmp, f, sd = env
    dest = tmp / "rep" / "report.html"  # a file, in a directory made for it
    rc, out, _ = run(capsys, "report", str(f), "--out", str(dest), *sd)
    assert rc == 0 and out == f"wrote {dest}\n"
    page = dest.read_text()
    svgs = page.count("<svg")
    assert svgs == 6  # 3 figures x (runtime, power)
    for chunk in page.split("<svg")[1:]:
        ET.fromstring("<svg" + chunk.split("</svg>")[0] + "</svg>")  # well-formed


def test_report_out_is_a_file_and_fleet_options_are_checked(capsys, env):
    tmp, f, sd = env
    rc, _, err = run(capsys, "report", str(f), "--out", str(tmp), *sd)
    assert rc == 1
    assert err == f"gemmd: error: --out {tmp}: is a directory; give an .html file to write\n"
    rc, _, err = run(capsys, "report", "--fleet", str(f), *sd)
    assert rc == 2 and "--fleet reads the daemon's store" in err
    rc, _, err = run(capsys, "report", str(f), "--device", "0", *sd)
    assert rc == 2 and "add --fleet" in err
    rc, _, err = run(capsys, "report", "--fleet", "--days", "nan", "--out",
                     str(tmp / "f.html"), *sd)
    assert rc == 1 and err.count("\n") == 1 and "--days nan" in err


def test_progress_bar_only_on_a_terminal():
    plain = io.StringIO()
    p = Progress(3, "fitting", stream=plain)
    p(1)
    p.close()
    assert plain.getvalue() == ""

    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    tty = Tty()
    p = Progress(2, "fitting", stream=tty)
    p(1)
    p(1)
    p.close()
    assert "fitting [" in tty.getvalue() and "2/2" in tty.getvalue()


@pytest.mark.parametrize("argv, gist", [
    (["import", "/dev/zero"], "/dev/zero: not a regular file"),
    (["import", "--format", "csv", "/dev/zero"], "/dev/zero: not a regular file"),
    (["import", "--name", "", "FILE"], "source name '' must be 1-64 letters"),
    (["evaluate", "--jobs", "0", "FILE"], "--jobs 0 is outside 1.."),
    (["evaluate", "--jobs", "1000000000000", "FILE"], "--jobs 1000000000000 is outside 1.."),
    (["fit", "FILE", "--out", "/dev/full"], "--out /dev/full: exists and is not a regular"),
    (["fit", "FILE", "--out", "/proc/gemmd.skops"], "--out /proc/gemmd.skops: cannot write"),
    (["fit", "FILE", "--out", "/sys/gemmd.skops"], "--out /sys/gemmd.skops: cannot write in"),
    (["fit", "FILE", "--out", "FILE/model.skops"], "is not a directory"),
    (["fit", "FILE", "--out", "DIR"], "exists and is not a regular file"),
    (["fit", "FILE", "--out", ""], "--out must not be empty"),
    (["predict", "64", "64", "64", "--dtype", "fp32", "--device", ""],
     "--device must not be empty"),
    # found by bench/fuzz_cli.py: tracebacks (File name too long), a state dir in the cwd,
    # an endless --gpu-spec read until the kernel killed gemmd
    (["fit", "FILE", "--out", "x" * 5000], "a path of 5,000 bytes is longer than the 4,095"),
    (["report", "--fleet", "--out", "y" * 300 + ".html"], "a file name of 305 bytes is longer"),
    (["predict", "64", "64", "64", "--dtype", "fp32", "--model", "m" * 256],
     "a file name of 256 bytes is longer than the 255 allowed"),
    (["import", "f" * 4100], "FILE ffff"),
    (["advise", "64", "64", "64", "--gpu-spec", "/dev/full"],
     "--gpu-spec /dev/full: larger than 1024 KiB"),
    (["evaluate", "FILE", "--gpu-spec", "/dev/zero"], "--gpu-spec /dev/zero: larger than"),
    (["evaluate", "FILE", "--gpu-spec", "DIR"], "cannot read: Is a directory"),
    (["run", "--config", "bad\nname"], "bad\\nname: cannot read"),
    (["predict", "64", "64", "64", "--dtype", "fp32", "--stages", "1" * 400],
     "--stages 1111"),  # OverflowError traceback
    (["predict", "64", "64", "64", "--dtype", "fp32", "--alpha", "nan"],
     "--alpha nan: not a finite number"),  # was accepted
    (["predict", "64", "64", "64", "--dtype", "fp32", "--beta=-inf"],
     "--beta -inf: not a finite number"),
    (["advise", "64", "64", "64", "--top", "-1"], "--top -1 is outside 1..100000"),
    (["predict", "64", "64", "64", "--dtype", "fp32", "--gpu", ""],
     "--gpu must not be empty"),  # was ignored
    (["import", "FILE", "--gpu", " "], "--gpu must not be empty"),
    (["report", "--fleet", "--days", "1e12"], "--days 1e+12: must be a number of days in (0, "
                                              "36,500]"),  # OSError traceback
    (["report", "--fleet", "--out", ""], "--out: no file given"),  # wrote gemmd-fleet.html
    (["report", "--fleet", "--gpu", "h100-sxm"], "--fleet reads the daemon's store: give no "
                                                 "--gpu"),  # was ignored
    (["export", "--out", " "], "--out must not be empty"),  # wrote a file named ' '
    (["export", "--all-sources", "--source", "x"], "--source NAME or --all-sources, not both"),
])
def test_hostile_arguments_are_one_line_errors(capsys, env, argv, gist):
    """Each was a traceback, or silently did something else (issue 12)."""
    tmp, f, sd = env
    argv = [str(f) if a == "FILE" else a.replace("FILE", str(f)) for a in argv]
    argv = [str(tmp) if a == "DIR" else a for a in argv]
    rc, out, err = run(capsys, *argv, *sd)
    assert rc in (1, 2) and gist in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) <= 2, err


@pytest.mark.parametrize("value, gist", [
    ("", "state_dir: must not be empty"),  # was the working directory
    ("s" * 5000, "a path of 5,000 bytes is longer than the 4,095 allowed"),  # traceback
    ("a/" + "s" * 300, "a file name of 300 bytes is longer than the 255 allowed"),
])
@pytest.mark.parametrize("command", [["status"], ["rebaseline"], ["run"], ["import", "FILE"]])
def test_a_state_dir_that_cannot_exist_is_one_line(capsys, env, monkeypatch, command, value,
                                                   gist):
    tmp, f, _ = env
    monkeypatch.chdir(tmp)
    before = sorted(tmp.iterdir())
    argv = [str(f) if a == "FILE" else a for a in command]
    rc, out, err = run(capsys, *argv, "--state-dir", value)
    assert rc == 2 and gist in err and err.count("\n") == 1, err
    assert sorted(tmp.iterdir()) == before  # nothing made in the working directory


def test_an_imported_runtime_that_underflows_to_zero_is_refused(capsys, env, tmp_path):
    tiny = tmp_path / "tiny.csv"
    tiny.write_text("m,n,k,dtype,runtime_ms\n64,64,64,fp32,4.9e-324\n")
    rc, _, err = run(capsys, "import", "--gpu", "h100-sxm", str(tiny), *env[2])
    assert rc == 1 and "row 2, column runtime_ms: 4.9e-324 ms is too small" in err


# ------------------------------------------------------------------ issue 14


def test_predict_says_when_it_is_guessing(capsys, env):
    tmp, f, sd = env
    rc, _, _ = run(capsys, "fit", str(f), "--out", str(tmp / "m.skops"), *sd)
    assert rc == 0
    rc, out, _ = run(capsys, "predict", "1024", "1024", "1024", "--dtype", "fp32", "--kernel",
                     "tiled", "--tile", "16", "--model", str(tmp / "m.skops"), "--json", *sd)
    assert rc == 0 and json.loads(out)["in_domain"] is True
    rc, out, _ = run(capsys, "predict", "1024", "1024", "1024", "--dtype", "fp32", "--kernel",
                     "tiled", "--tile", "16", "--model", str(tmp / "m.skops"), "--gpu",
                     "NVIDIA A100-SXM4-80GB", "--json", *sd)
    res = json.loads(out)
    assert rc == 0 and res["in_domain"] is False
    assert res["domain"] == "no data on NVIDIA A100-SXM4-80GB; no power data on NVIDIA " \
                            "A100-SXM4-80GB"
    assert res["runtime_s"]["domain"] == "no data on NVIDIA A100-SXM4-80GB"
    rc, out, _ = run(capsys, "predict", "1024", "1024", "1024", "--dtype", "fp32", "--kernel",
                     "tiled", "--tile", "16", "--model", str(tmp / "m.skops"), "--gpu", "t4",
                     *sd)
    assert rc == 0 and "outside the training data: no data on Tesla T4" in out
    spec = tmp / "gpu.yaml"
    spec.write_text("name: Lab GPU\npeak_tflops: {fp32: 40}\nbandwidth_gbs: 900\n")
    rc, out, _ = run(capsys, "predict", "1024", "1024", "1024", "--dtype", "fp32", "--kernel",
                     "tiled", "--tile", "16", "--model", str(tmp / "m.skops"), "--gpu-spec",
                     str(spec), *sd)
    assert rc == 0 and "on Lab GPU" in out
    # the device's own measurements carry the model over to it
    probes = tmp / "probes.csv"
    make_csv(probes, n=12, seed=3)
    probes.write_text(probes.read_text().replace("rtx4070", "NVIDIA L4"))
    rc, out, _ = run(capsys, "predict", "1024", "1024", "1024", "--dtype", "fp32", "--kernel",
                     "tiled", "--tile", "16", "--model", str(tmp / "m.skops"), "--calibrate",
                     str(probes), "--json", *sd)
    res = json.loads(out)
    assert rc == 0 and res["device"] == "NVIDIA L4" and res["in_domain"] is True
    assert "calibrated on 12 rows" in res["model"]
    # advise agrees: the configurations the probes ran on this GPU, in the domain
    rc, out, _ = run(capsys, "advise", "1024", "1024", "1024", "--model",
                     str(tmp / "m.skops"), "--calibrate", str(probes), "--json", *sd)
    adv = json.loads(out)
    assert rc == 0 and adv["in_domain"] is True and adv["domain"] == ""
    assert adv["configurations_from_other_gpus"] is False
    rc, out, _ = run(capsys, "advise", "1024", "1024", "1024", "--model",
                     str(tmp / "m.skops"), "--calibrate", str(probes), *sd)
    assert rc == 0 and "no configuration was measured" not in out
    assert "outside the training data" not in out


def test_export_then_import_elsewhere(capsys, env, tmp_path):
    tmp, f, sd = env
    assert run(capsys, "import", str(f), "--name", "lab", *sd)[0] == 0
    out = tmp / "export.csv"
    rc, _, err = run(capsys, "export", "--source", "lab", "--out", str(out), *sd)
    assert rc == 0 and "exported 90 rows" in err
    head = out.read_text().splitlines()[0].split(",")
    assert {"host", "device_uuid", "gpu", "runtime_s", "peak_fp32_tflops",
            "mem_bandwidth_gbs"} <= set(head)
    other = ["--state-dir", str(tmp_path / "elsewhere")]
    rc, text, _ = run(capsys, "import", str(out), "--name", "fleet", *other)
    assert rc == 0 and "imported 90 rows (runtime 90, power 90) on NVIDIA GeForce RTX 4070" \
        in text
    assert "ignored columns host, kind, device_uuid, gpu_key" in text
    rc, _, err = run(capsys, "export", "--source", "nothing", *sd)
    assert rc == 1 and "holds no results of source nothing" in err
    rc, _, err = run(capsys, "export", "--source", "lab", "--out", str(tmp / "x.parquet"), *sd)
    try:
        import pyarrow  # noqa: F401
    except ImportError:
        assert rc == 1 and "needs pyarrow" in err
    else:
        assert rc == 0


def test_gpu_flag_and_the_files_gpu_column_must_agree(capsys, env):
    tmp, f, sd = env
    rc, _, err = run(capsys, "import", str(f), "--gpu", "h100-sxm", *sd)
    assert rc == 1 and "row 2, column gpu: 'rtx4070' is not --gpu 'h100-sxm'" in err
    assert err.count("\n") == 1
    rc, out, _ = run(capsys, "import", str(f), "--gpu", "NVIDIA GeForce RTX 4070", *sd)
    assert rc == 0


# ------------------------------------------------------------------ issue 13


def test_predict_and_advise_use_the_roofline_until_a_model_is_fitted(capsys, env):
    """What the daemon predicts with: the roofline estimate before its first fit, then the
    fitted model; said as such in the text and in --json (it was "no fitted model")."""
    tmp, f, sd = env
    assert run(capsys, "import", str(f), "--name", "lab", *sd)[0] == 0
    gemm = ("1024", "1024", "1024", "--dtype", "fp32")
    rc, out, err = run(capsys, "predict", *gemm, "--json", *sd)
    assert rc == 0, err
    res = json.loads(out)
    assert res["model"] == "roofline" and res["model_kind"] == "roofline"
    assert res["device"] == "NVIDIA GeForce RTX 4070" and res["in_domain"] is False
    roofline = max(2 * 1024**3 / PEAK, 4 * 3 * 1024**2 / BW)
    assert res["runtime_s"]["value"] == pytest.approx(roofline / 0.7, rel=1e-6)  # efficiency
    assert "power_w" not in res and "energy_j" not in res
    rc, out, _ = run(capsys, "predict", *gemm, *sd)
    assert rc == 0 and "(roofline estimate: no fitted model yet)" in out
    assert "power    - (the roofline estimate has no power data)" in out
    rc, out, _ = run(capsys, "advise", "1024", "1024", "1024", "--json", *sd)
    adv = json.loads(out)
    assert rc == 0 and adv["model_kind"] == "roofline"
    times = [c["runtime_s"] for c in adv["configurations"]]
    assert times == sorted(times) and adv["fastest"]["runtime_s"] == times[0]
    assert adv["most_energy_efficient"] is None
    assert {c["config"]["dtype"] for c in adv["configurations"]} >= {"fp32", "fp16"}
    rc, out, _ = run(capsys, "advise", "1024", "1024", "1024", "--dtype", "fp32", *sd)
    assert rc == 0 and "1 dtype (roofline estimate: no fitted model yet)" in out
    assert "fastest:                fp32 blas nn:" in out
    # the roofline predicts the daemon's probes: options it cannot express are refused
    rc, _, err = run(capsys, "predict", *gemm, "--batch", "4", *sd)
    assert rc == 2 and err.startswith("gemmd: error: --batch: the roofline estimate")
    assert err.count("\n") == 1
    rc, _, err = run(capsys, "predict", *gemm, "--calibrate", str(f), *sd)
    assert rc == 1 and "--calibrate carries a fitted model over" in err
    # once fitted, the fitted model, as the daemon
    assert run(capsys, "fit", "--source", "lab", *sd)[0] == 0
    rc, out, _ = run(capsys, "predict", *gemm, "--json", *sd)
    res = json.loads(out)
    assert rc == 0 and res["model"] == "rf-1" and res["model_kind"] == "random_forest"
    assert "power_w" in res


def test_predict_without_a_store_is_the_roofline_for_a_named_gpu(capsys, env):
    tmp, f, sd = env
    rc, out, err = run(capsys, "predict", "4096", "4096", "4096", "--dtype", "bf16", "--gpu",
                       "h100-sxm", "--json", *sd)
    assert rc == 0, err
    assert json.loads(out)["model_kind"] == "roofline"
    assert not (tmp / "state").exists()  # predicting creates no store
    rc, _, err = run(capsys, "predict", "4096", "4096", "4096", "--dtype", "bf16", *sd)
    assert rc == 1 and err == (f"gemmd: error: no store at {tmp / 'state' / 'gemmd.db'} "
                               "(run gemmd run or gemmd import there first; see state_dir, "
                               "--state-dir)\n")


@pytest.mark.parametrize("argv", [
    ["status"], ["export"], ["prune", "--source", "lab", "--all"], ["rebaseline"],
    ["fit", "--source", "lab"], ["evaluate", "--source", "lab"], ["advise", "8", "8", "8"],
])
def test_every_command_says_the_same_when_there_is_no_store(capsys, env, argv):
    tmp, f, sd = env
    rc, _, err = run(capsys, *argv, *sd)
    assert rc == 1 and err == (f"gemmd: error: no store at {tmp / 'state' / 'gemmd.db'} "
                               "(run gemmd run or gemmd import there first; see state_dir, "
                               "--state-dir)\n")


def test_a_usage_error_of_a_command_is_one_line_naming_its_help(capsys, env):
    tmp, f, sd = env
    rc, _, err = run(capsys, "prune", "--source", "lab", "--all", "--max-rows", "1", *sd)
    assert rc == 2 and err == ("gemmd: error: --all deletes every row of the source: give it "
                               "alone (see gemmd prune --help)\n")
    rc, _, err = run(capsys, "predict", "8", "8", "8", "--dtype", "fp32", "--kernel", "tiled",
                     "--gpu", "rtx4070", *sd)
    assert rc == 2 and err == "gemmd: error: --kernel tiled needs --tile (see gemmd predict " \
                              "--help)\n"


@pytest.mark.parametrize("rows, gist", [
    (1, "the random split needs at least two rows (the data has 1)"),
    (2, "the random split trains on 1 of 2 rows: 1 samples, fewer than model.min_samples"),
])
def test_evaluate_on_a_file_too_small_to_split_is_one_line(capsys, env, rows, gist):
    """It was a scikit-learn traceback (issue 13)."""
    tmp, f, sd = env
    small = tmp / "small.csv"
    small.write_text("\n".join(f.read_text().splitlines()[:rows + 1]) + "\n")
    rc, out, err = run(capsys, "evaluate", str(small), *sd)
    assert rc == 1 and err.startswith(f"gemmd: error: {gist}") and err.count("\n") == 1, err
    rc, out, err = run(capsys, "evaluate", str(small), "--split", "shape", "--baseline",
                       "none", *sd)
    assert rc == 1 and err.startswith("gemmd: error: ") and err.count("\n") == 1, err


def test_a_closed_stdout_ends_without_a_traceback(tmp_path):
    """gemmd export | head: the reader is gone; nothing to say on stderr."""
    read, write = os.pipe()
    os.close(read)  # every write to stdout fails with EPIPE
    try:
        r = subprocess.run([sys.executable, "-m", "gemmd", "predict", "64", "64", "64",
                            "--dtype", "fp32", "--gpu", "h100-sxm", "--state-dir",
                            str(tmp_path)], stdout=write, stderr=subprocess.PIPE, text=True,
                           timeout=120, cwd=Path(__file__).resolve().parent.parent)
    finally:
        os.close(write)
    assert r.returncode == 1 and r.stderr == ""


# ------------------------------------------------------------------ issue 25


def test_evaluate_a_fitted_model_without_refitting(capsys, env, tmp_path):
    tmp, f, sd = env
    assert run(capsys, "fit", str(f), "--out", str(tmp / "m.skops"), *sd)[0] == 0
    other = tmp / "other.csv"
    make_csv(other, n=60, seed=7)
    rc, out, err = run(capsys, "evaluate", "--model", str(tmp / "m.skops"), str(other),
                       "--json", *sd)
    assert rc == 0, err
    res = json.loads(out)
    assert set(res["splits"]) == {"model"} and res["rows"] == 60
    m = res["splits"]["model"]["gemmd"]["targets"]["runtime"]
    assert m["n"] == 60 and m["mape"] < 0.1 and m["in_domain"] > 0.9  # some sizes beyond
    assert {"median_ape", "p90_ape", "coverage", "r2"} <= set(m)
    # another GPU's first probes: as it is, then carried over by 5 and 20 rows
    l4 = tmp / "l4.csv"
    make_csv(l4, n=80, seed=8)
    l4.write_text(l4.read_text().replace("rtx4070", "NVIDIA L4"))
    rc, out, err = run(capsys, "evaluate", "--model", str(tmp / "m.skops"), str(l4),
                       "--calibrate-rows", "5,20", "--seeds", "2", "--json", *sd)
    assert rc == 0, err
    res = json.loads(out)
    assert list(res["splits"]) == ["model", "5 rows", "20 rows"] and res["seeds"] == 2
    assert res["splits"]["model"]["gemmd"]["targets"]["runtime"]["in_domain"] == 0.0
    five = res["splits"]["5 rows"]
    assert five["calibration_rows"] == 5 and five["test_rows"] < 80
    spread = five["gemmd"]["spread"]["runtime"]  # the same draws in the table, with +-
    rc, out, err = run(capsys, "evaluate", "--model", str(tmp / "m.skops"), str(l4),
                       "--calibrate-rows", "5", "--seeds", "2", *sd)
    assert rc == 0, err
    row = next(ln for ln in out.splitlines() if ln.startswith("5 rows") and "runtime" in ln)
    assert f"±{100 * spread['mape']:.1f}" in row and f"±{100 * spread['coverage']:.1f}" in row
    assert "(± their standard deviation)" in out
    rc, out, err = run(capsys, "evaluate", "--model", str(tmp / "m.skops"), str(l4),
                       "--calibrate", str(l4), *sd)
    assert rc == 0, err
    assert "calibrated on 80 rows" in out and "IN DOMAIN" in out
    # what does not go together
    for argv, gist in ((["--calibrate-rows", "5"], "give --model FILE"),
                       (["--model", str(tmp / "m.skops"), "--split", "shape"],
                        "--split and --baseline refit"),
                       (["--model", str(tmp / "m.skops"), "--seeds", "2"],
                        "--seeds is the number of draws"),
                       (["--model", str(tmp / "m.skops"), "--calibrate-rows", "5",
                         "--calibrate", str(l4)], "not both")):
        rc, _, err = run(capsys, "evaluate", str(l4), *argv, *sd)
        assert rc == 2 and gist in err and err.count("\n") == 1, err
    rc, _, err = run(capsys, "evaluate", "--model", str(tmp / "m.skops"), str(l4),
                     "--calibrate-rows", "79", *sd)
    assert rc == 1 and "too many for the data" in err and err.count("\n") == 1
    for text, gist in (("5,,20", "an empty item"), ("5,", "an empty item"),
                       (" ", "give a number of rows"), ("5,x", "'x' is not an integer")):
        rc, _, err = run(capsys, "evaluate", "--model", str(tmp / "m.skops"), str(l4),
                         "--calibrate-rows", text, *sd)
        assert rc == 2 and gist in err and err.count("\n") == 1, (text, err)


def test_predict_and_advise_say_whose_measurement_they_predict(capsys, tmp_path):
    """--source daemon: a model that knows the H100 only through XLA's table (whose timings
    are not gemmd's probes': bench/RESULTS.md, 2026-11-27) says so, in predict and advise
    alike; without it, the table's own domain; a bad name is one line, exit 2."""
    f = tmp_path / "xla.csv"
    lines = ["gpu_key,b,m,n,k,dtype,flops_per_s,runtime_us_derived"]
    for m in (256, 512, 1024, 2048, 4096):
        for n in (256, 1024, 4096):
            for k in (256, 1024, 4096):
                flops = 2 * m * n * k
                us = 5.0 + flops / 6e14 * 1e6
                lines.append(f"sm_90,1,{m},{n},{k},bf16xbf16->bf16,{flops / us * 1e6:.6g},{us}")
    f.write_text("\n".join(lines) + "\n")
    sd = ["--state-dir", str(tmp_path / "state")]
    model = tmp_path / "xla.skops"
    assert run(capsys, "fit", str(f), "--out", str(model), *sd)[0] == 0
    gemm = ["1024", "1024", "1024", "--model", str(model), "--gpu", "h100-sxm", *sd]
    rc, out, _ = run(capsys, "predict", *gemm, "--dtype", "bf16", "--json")
    assert rc == 0 and json.loads(out)["in_domain"] is True
    rc, out, _ = run(capsys, "predict", *gemm, "--dtype", "bf16", "--source", "daemon",
                     "--json")
    res = json.loads(out)
    assert rc == 0 and res["in_domain"] is False
    assert res["runtime_s"]["domain"] == "no daemon data on NVIDIA H100 80GB HBM3 (only xla)"
    rc, out, _ = run(capsys, "advise", *gemm, "--source", "daemon")
    assert rc == 0 and "no daemon data on NVIDIA H100 80GB HBM3 (only xla)" in out
    rc, out, _ = run(capsys, "predict", *gemm, "--dtype", "bf16", "--source", "xla")
    assert rc == 0 and "outside the training data" not in out
    rc, _, err = run(capsys, "predict", *gemm, "--dtype", "bf16", "--source", "a b")
    assert rc == 2 and err.count("\n") == 1 and "--source: 'a b' must be" in err


def test_model_commands_refuse_what_they_could_only_answer_wrongly(capsys, env):
    """A review's findings (issue 25's commands): an --out over the data or the store,
    a file given twice, a dtype the GPU has no units for (predicted at a made-up 1
    TFLOP/s), an ambiguous --device, --calibrate probes of another GPU, data that
    measure nothing the model predicts: one line each, and nothing stored changes."""
    tmp, f, sd = env
    before = f.read_bytes()
    rc, _, err = run(capsys, "fit", str(f), "--out", str(f), *sd)
    assert rc == 2 and "one of the measurement files" in err and err.count("\n") == 1
    assert f.read_bytes() == before  # the measurements are still there
    assert run(capsys, "import", str(f), "--name", "lab", *sd)[0] == 0
    db = tmp / "state" / "gemmd.db"
    rc, _, err = run(capsys, "fit", "--source", "lab", "--out", str(db), *sd)
    assert rc == 2 and "that is the store" in err
    store = Store(db)
    assert sum(c["n"] for c in store.counts()) == 90  # the store is intact
    store.close()
    spec, conf = tmp / "lab.yaml", tmp / "gemmd.yaml"  # other files gemmd reads
    spec.write_text("- name: Lab GPU\n  base: l4\n")
    conf.write_text(f"state_dir: {tmp / 'state'}\n")
    for argv, what in ((["--gpu-spec", str(spec), "--out", str(spec)], "a --gpu-spec file"),
                       (["-c", str(conf), "--out", str(conf)], "the configuration")):
        kept = Path(argv[-1]).read_bytes()
        rc, _, err = run(capsys, "fit", str(f), *argv, *sd)
        assert rc == 2 and what in err and Path(argv[-1]).read_bytes() == kept, err
    rc, _, err = run(capsys, "fit", str(f), str(tmp / "." / f.name), "--out",
                     str(tmp / "m.skops"), *sd)
    assert rc == 1 and "given twice" in err and not (tmp / "m.skops").exists()
    # a V100 has no bf16 units: no prediction at a made-up rate, none advised
    v100 = ("--gpu", "v100-sxm2-16gb")
    rc, _, err = run(capsys, "predict", "1024", "1024", "1024", "--dtype", "bf16", *v100, *sd)
    assert rc == 2 and "Tesla V100-SXM2-16GB has no bf16 peak" in err
    assert err.count("\n") == 1
    rc, _, err = run(capsys, "advise", "1024", "1024", "1024", "--dtype", "bf16", *v100, *sd)
    assert rc == 2 and "has no bf16 peak" in err
    mixed = tmp / "mixed.csv"  # a model that knows bf16 and fp32 configurations
    lines = f.read_text().splitlines()
    mixed.write_text("\n".join([lines[0]] + [
        ln.replace(",fp32,tiled,", ",bf16,blas," if i % 2 else ",fp32,tiled,")
        for i, ln in enumerate(lines[1:])]) + "\n")
    l4 = tmp / "l4.csv"
    make_csv(l4, n=60, seed=9)
    l4.write_text(l4.read_text().replace("rtx4070", "NVIDIA L4"))
    model = tmp / "two.skops"
    assert run(capsys, "fit", str(mixed), str(l4), "--out", str(model), *sd)[0] == 0
    rc, out, err = run(capsys, "advise", "1024", "1024", "1024", "--model", str(model),
                       *v100, "--json", *sd)
    assert rc == 0, err
    dtypes = {c["config"]["dtype"] for c in json.loads(out)["configurations"]}
    assert dtypes == {"fp32"}  # (the tiled kernel computes in fp32: the V100 has its units)
    # a model of two devices (both index 0): --device must say which
    tiled = ("--dtype", "fp32", "--kernel", "tiled", "--tile", "8")
    rc, _, err = run(capsys, "predict", "512", "512", "512", *tiled, "--model", str(model),
                     "--device", "0", *sd)
    assert rc == 2 and "matches several devices" in err and err.count("\n") == 1
    rc, _, err = run(capsys, "predict", "512", "512", "512", *tiled, "--model", str(model),
                     "--device", "ref-l4", *v100, *sd)
    assert rc == 2 and "--gpu and --device: give one" in err
    rc, out, err = run(capsys, "predict", "512", "512", "512", *tiled, "--model", str(model),
                       "--device", "ref-l4", *sd)
    assert rc == 0 and "NVIDIA L4" in out, err
    # evaluate: probes of another GPU, data without a target the model predicts
    rc, _, err = run(capsys, "evaluate", "--model", str(model), "--calibrate", str(f), str(l4),
                     *sd)
    assert rc == 1 and err.count("\n") == 1 and \
        "its devices (NVIDIA GeForce RTX 4070 [rtx4070]) are none of the data's (NVIDIA L4 " \
        "[l4])" in err
    power = tmp / "power.csv"
    power.write_text("gpu,m,n,k,dtype,kernel,tile,power_w\nrtx4070,512,512,512,fp32,tiled,8,100\n")
    model_rt = tmp / "runtime-only.skops"
    runtime_only = tmp / "rt.csv"
    runtime_only.write_text("\n".join(ln.rsplit(",", 1)[0] for ln in lines) + "\n")
    assert run(capsys, "fit", str(runtime_only), "--out", str(model_rt), *sd)[0] == 0
    rc, _, err = run(capsys, "evaluate", "--model", str(model_rt), str(power), *sd)
    assert rc == 1 and "the data measure power, the model predicts runtime" in err
    rc, _, err = run(capsys, "predict", "8", "8", "8", "--dtype", "fp32", "--model", str(tmp),
                     *v100, *sd)
    assert rc == 1 and f"model file {tmp} is not a regular file" in err  # (not "missing")
    # configurations that differ only in what they write are told apart in advise's table
    from gemmd.cli.predict import _describe

    assert _describe({"dtype": "fp8", "kernel": "blas", "layout": "nn",
                      "out_dtype": "bf16"}) == "fp8 blas nn -> bf16"
    # the registry's active model: overwritten, the daemon would lose it
    assert run(capsys, "fit", "--source", "lab", *sd)[0] == 0  # into the registry
    active = next((tmp / "state" / "models").glob("*.skops"))
    rc, _, err = run(capsys, "fit", str(f), "--out", str(active), *sd)
    assert rc == 2 and "in the model registry" in err
    # strict JSON: the R² of one row is no number (null, not NaN)
    one = tmp / "one.csv"
    one.write_text("\n".join(lines[:2]) + "\n")
    rc, out, err = run(capsys, "evaluate", "--model", str(model), str(one), "--json", *sd)
    assert rc == 0, err

    def refuse(c: str) -> None:
        raise AssertionError(f"bare {c} in JSON")

    res = json.loads(out, parse_constant=refuse)
    assert res["splits"]["model"]["gemmd"]["targets"]["runtime"]["r2"] is None


def test_a_file_fit_needs_no_state_directory(capsys, env, monkeypatch):
    """fit FILE --out M reads no store: where the state directory cannot be resolved (no
    HOME, XDG_STATE_HOME or STATE_DIRECTORY, a uid without a passwd entry), it still fits
    (a review found the --out check resolving it first: a traceback)."""
    tmp, f, _ = env
    for var in ("HOME", "XDG_STATE_HOME", "STATE_DIRECTORY", "GEMMD_CONFIG"):
        monkeypatch.delenv(var, raising=False)

    def no_home() -> Path:
        raise RuntimeError("Could not determine home directory.")

    monkeypatch.setattr(Path, "home", staticmethod(no_home))
    monkeypatch.chdir(tmp)
    rc, out, err = run(capsys, "fit", str(f), "--out", str(tmp / "m.skops"))
    assert rc == 0 and (tmp / "m.skops").is_file(), err
