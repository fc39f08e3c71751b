"""`gemmd report`: the model report and the fleet report, each one self-contained HTML file.

Real data throughout: the shared GPPerf measurements (../shared/data) and synthetic CSVs
for the model report; a real SQLite store filled by the daemon's own probe rounds on the
fake backend (a fit, drift references, one GPU slowed into a drift alarm) for the fleet
report.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np
import pytest

import gemmd
from gemmd import datasets, report
from gemmd.config import (
    Config,
    FakeConfig,
    FakeDeviceConfig,
    MeasureConfig,
    ModelConfig,
    ProbeGroup,
)
from gemmd.errors import GemmdError, InputError, StoreError
from gemmd.report import page as report_page

DATA = datasets.shared_data_dir()
needs_data = pytest.mark.skipif(DATA is None, reason="shared datasets (../shared/data) absent")
PEAK = 29.1e12  # RTX 4070 fp32
SIZES = (256, 512, 768, 1024, 1536, 2048)


def make_csv(path: Path, n: int, power_rows: int, seed: int = 0, gpu: str = "rtx4070"
             ) -> Path:
    """Generic CSV of the paper's tiled kernel; power measured on the first rows only."""
    rng = np.random.default_rng(seed)
    eff = {8: 0.09, 16: 0.15, 32: 0.12}
    lines = ["gpu,m,n,k,dtype,kernel,tile,runtime_ms,power_w"]
    for i in range(n):
        m, nn, k = (int(x) for x in rng.choice(SIZES, 3))
        tile = int(rng.choice(list(eff)))
        t = 2 * m * nn * k / (PEAK * eff[tile]) * float(np.exp(rng.normal(0, 0.02)))
        p = f"{100 + 20 * (tile == 16) + rng.normal(0, 1):.4g}" if i < power_rows else ""
        lines.append(f"{gpu},{m},{nn},{k},fp32,tiled,{tile},{t * 1e3:.6g},{p}")
    path.write_text("\n".join(lines) + "\n")
    return path


def svgs(html: str) -> list[str]:
    return [m.group(0) for m in re.finditer(r"<svg\b.*?</svg>", html, flags=re.S)]


def assert_self_contained(html: str) -> None:
    """One file: no script, stylesheet or image fetched from elsewhere; figures inline
    and well-formed SVG (raster parts of a figure as data: URIs)."""
    assert html.startswith("<!doctype html>")
    assert "<script" not in html and "<link" not in html and "<img" not in html
    refs = re.findall(r'(?:src|href)="([^"]*)"', html) + \
        re.findall(r"(?:src|href)='([^']*)'", html)
    assert all(r.startswith(("#", "data:")) for r in refs), refs
    assert "@import" not in html and "url(http" not in html
    figures = svgs(html)
    assert figures
    for s in figures:
        ET.fromstring(s)  # well-formed


def header(html: str) -> dict[str, str]:
    head = html.split("<table class='header'>")[1].split("</table>")[0]
    return {k: re.sub(r"<[^>]+>", "", v) for k, v in
            re.findall(r"<tr><th>(.*?)</th><td>(.*?)</td></tr>", head, flags=re.S)}


# ------------------------------------------------------------------ the model report


@needs_data
def test_model_report_on_the_papers_data(tmp_path):
    ds = datasets.load_shared("gpperf-tiled", DATA)
    out = tmp_path / "reports" / "model.html"  # a directory that does not exist yet
    ticks = []
    path = report.write(ds, out, split="shape", progress=ticks.append)
    assert path == out and out.is_file()
    assert sorted(p.name for p in (tmp_path / "reports").iterdir()) == ["model.html"]
    assert sum(ticks) == report.work_units()
    html = out.read_text(encoding="utf-8")
    assert_self_contained(html)
    h = header(html)
    assert re.match(r"\d{4}-\d\d-\d\d \d\d:\d\d UTC", h["Generated"])
    assert h["gemmd version"] == gemmd.__version__
    assert "NVIDIA GeForce RTX 4070" in h["GPU(s)"]
    assert "336 rows" in h["Data"] and "execution_times_all.csv" in h["Data"]
    assert re.search(r"\d+ train / \d+ test rows", h["Split"])
    assert "gemmd (refit)" in h["Models"] and "GPPerf (refit)" in h["Models"]
    assert "no deployed model" not in h["Models"]  # none asked for
    # Both measured targets, each with its figures; units in proper case.
    assert "<h2>Runtime per GEMM (ms)</h2>" in html and "<h2>Average power (W)</h2>" in html
    assert "measured (W)" in html and "predicted (ms)" in html and "(w)" not in html
    assert len(svgs(html)) == 2 * 3
    # Shapes by name (M×N×K dtype), not by index; configurations by name.
    assert re.search(r">\d+×\d+×\d+ fp32<", html)
    assert "fp32 tiled tile 16 nn (n=" in html
    # Errors on a log scale, labelled in percent: both models' bars readable.
    assert "median absolute error (log scale)" in html and ">100%<" in html
    # 32 and 40 test rows: enough, no warning.
    assert "too few rows" not in html


def test_model_report_warns_where_few_test_rows_measure_a_target(tmp_path):
    f = make_csv(tmp_path / "tiled.csv", n=240, power_rows=24)
    ds = datasets.load("csv", [f])
    out = report.write(ds, tmp_path / "r.html", cfg=ModelConfig(min_samples=2,
                                                                n_estimators=20))
    html = out.read_text(encoding="utf-8")
    assert_self_contained(html)
    power_rows = int(re.search(r"power (\d+)\)", header(html)["Split"]).group(1))
    assert 0 < power_rows < report.MIN_ROWS
    # Said at the top and in the power section, and not for runtime (enough rows).
    warn = re.findall(r'<p class="warn">⚠ (.*?)</p>', html)
    assert any(w.startswith("Average power: only") for w in warn)
    assert any(w.startswith(f"Only {power_rows} test row(s) measure power") for w in warn)
    assert not any("runtime" in w.lower() for w in warn)


def test_the_deployed_model_is_judged_as_it_is(tmp_path):
    from gemmd.model import ForestModel
    from gemmd.registry import ModelRegistry
    from gemmd.store import Store

    f = make_csv(tmp_path / "tiled.csv", n=200, power_rows=200)
    ds = datasets.load("csv", [f])
    cfg = ModelConfig(min_samples=2, n_estimators=20)
    state = tmp_path / "state"
    store = Store(state / "gemmd.db")
    try:
        ModelRegistry(store, state / "models", cfg).register(
            ForestModel.fit_table(ds.table, cfg))
    finally:
        store.close()
    out = report.write(ds, tmp_path / "r.html", cfg=cfg, state_dir=state)
    html = out.read_text(encoding="utf-8")
    models = header(html)["Models"]
    assert "deployed rf-1" in models and "not refitted" in models
    # It was fitted on these very rows: said, as in-sample.
    assert "of the test rows have shapes it was trained on" in models
    assert html.count(">deployed rf-1<") >= 2  # in each target's table
    assert len(svgs(html)) == 2 * 3

    # Judged on another GPU's rows: said; and, never trained on them, judged on all rows.
    other = datasets.load("csv", [make_csv(tmp_path / "l4.csv", n=120, power_rows=0,
                                           seed=1, gpu="l4")])
    html = report.write(other, tmp_path / "l4.html", cfg=cfg, state_dir=state
                        ).read_text(encoding="utf-8")
    assert "It never saw NVIDIA L4: it predicts those rows from another GPU" in html
    assert ">deployed rf-1, all rows<" in html

    # A state directory without a store: the report says there is nothing deployed.
    out = report.write(ds, tmp_path / "r2.html", cfg=cfg, state_dir=tmp_path / "none")
    assert "no deployed model to judge" in header(out.read_text(encoding="utf-8"))["Models"]


# ------------------------------------------------------------------ --out


@pytest.mark.parametrize("make, why", [
    (lambda tmp: tmp, "is a directory"),
    (lambda tmp: tmp / "sub" / "report.html", "cannot create directory"),  # sub is a file
    (lambda tmp: Path("/proc/x.html"), "cannot write in /proc"),
    (lambda tmp: Path("/proc/x"), "not an .html file name"),
    (lambda tmp: tmp / "report.png", "not an .html file name"),
    (lambda tmp: "", "no file given"),
])
def test_out_problems_are_one_line_errors(tmp_path, make, why):
    (tmp_path / "sub").write_text("a file, not a directory")
    out = make(tmp_path)
    with pytest.raises(InputError) as e:
        report.check_out(out)
    msg = str(e.value)
    assert why in msg and "\n" not in msg and msg.startswith("--out")
    # The reports check it first, before reading or fitting anything.
    with pytest.raises(InputError, match=re.escape(why)):
        report.write_fleet(out, state_dir=tmp_path / "no-state")


def test_a_failed_write_leaves_the_previous_file_and_no_partial_one(tmp_path, monkeypatch):
    out = tmp_path / "r.html"
    out.write_text("previous report")

    def full(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(report_page.os, "replace", full)
    with pytest.raises(InputError, match="cannot write: No space left on device"):
        report_page.write_atomic(out, "<!doctype html>new")
    assert out.read_text() == "previous report"
    assert [p.name for p in tmp_path.iterdir()] == ["r.html"]  # no temporary file left


# ------------------------------------------------------------------ the fleet report


def _daemon_cfg(state: Path) -> Config:
    base = Config()
    probes = dataclasses.replace(
        base.probes, exploration=(),
        sentinels=(ProbeGroup(shapes=((4096, 4096, 4096),), dtypes=("bf16", "fp32")),
                   ProbeGroup(shapes=((1024, 1024, 1024),), kernels=("tiled",),
                              tiles=(16,))),
        measure=MeasureConfig(window_s=0.2, warmup_s=0.0))
    return dataclasses.replace(
        base, backend="fake", state_dir=str(state), probes=probes,
        listen=dataclasses.replace(base.listen, address="127.0.0.1", port=0),
        budget=dataclasses.replace(base.budget, duty_cycle=1.0),
        model=dataclasses.replace(base.model, min_samples=15, n_estimators=30),
        drift=dataclasses.replace(base.drift, baseline_probes=5),
        fake=FakeConfig(devices=(FakeDeviceConfig(), FakeDeviceConfig())))


def fill_store(state: Path, rounds_after_fit: int, rebaseline_rounds: int | None = None
               ) -> tuple[Config, list[str]]:
    """The daemon's own rounds on two fake H100s: 8 rounds, a fit (references taken
    under it), ``rounds_after_fit`` rounds, then GPU 1 slowed by 8% for 5 rounds (a drift
    alarm: its results flagged, its clocks show a thermal slowdown). With
    ``rebaseline_rounds``: then `gemmd rebaseline --device 1` (its protocol: results
    unflagged, the request applied by the daemon) and that many rounds more. Returns the
    config and the devices' UUIDs."""
    from gemmd import rebaseline
    from gemmd.daemon import Daemon

    cfg = _daemon_cfg(state)
    d = Daemon(cfg)
    try:
        for _ in range(8):
            for r in d.runners:
                r.run_round()
        d.refit()  # accepted: references re-taken under the new model
        assert d.registry.current.kind != "roofline"
        for _ in range(rounds_after_fit):
            for r in d.runners:
                r.run_round()
        d.runners[1].device.cfg = FakeDeviceConfig(slowdown_factor=1.08)
        for _ in range(5):
            for r in d.runners:
                r.run_round()
        uuids = [r.device.info.uuid for r in d.runners]
        assert d.state.drift.device_drifting(uuids[1])
        if rebaseline_rounds is not None:
            assert rebaseline.request(state, d.store, [uuids[1]]) > 0
            d.apply_rebaseline_request()
            for _ in range(rebaseline_rounds):
                for r in d.runners:
                    r.run_round()
        with d.state.lock:
            d.state.drift.save()
    finally:
        d.stop()
    return cfg, uuids


def digest(state: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(state.iterdir()) if p.is_file()}


def test_fleet_report_from_the_daemons_store(tmp_path):
    state = tmp_path / "state"
    cfg, (uuid0, uuid1) = fill_store(state, rounds_after_fit=32)
    before = digest(state)
    out = report.write_fleet(tmp_path / "fleet.html", state_dir=state, drift_cfg=cfg.drift,
                             model_cfg=cfg.model)
    # Read-only: the store, drift state and model files unchanged. (A reader of a WAL
    # database that the daemon closed cleanly leaves SQLite's empty -wal and its -shm.)
    after = digest(state)
    assert {k: after[k] for k in before} == before
    assert set(after) - set(before) <= {"gemmd.db-wal", "gemmd.db-shm"}
    assert not (state / "gemmd.db-wal").exists() or not (state / "gemmd.db-wal").stat().st_size
    html = out.read_text(encoding="utf-8")
    assert_self_contained(html)
    h = header(html)
    assert h["gemmd version"] == gemmd.__version__
    assert re.match(r"\d{4}-\d\d-\d\d \d\d:\d\d UTC", h["Generated"])
    assert "2 × NVIDIA H100 80GB HBM3 (fake)" in h["GPU(s)"]
    assert h["Deployed model"].startswith("rf-1 (random_forest)")
    assert "sentinel results" in h["Window"] and "gemmd.db" in h["Store"]
    # Per GPU: the live-error table, the three figures; probes by name.
    for i, uuid in enumerate((uuid0, uuid1)):
        assert f"<h2 id='gpu-{uuid}'>GPU {i}: NVIDIA H100 80GB HBM3 (fake)</h2>" in html
    assert len(svgs(html)) == 2 * 3
    for name in ("4096×4096×4096 bf16 blas nn", "4096×4096×4096 fp32 blas nn",
                 "1024×1024×1024 fp32 tiled (tile 16) nn"):
        assert html.count(name) >= 2 * 3  # table and two figures, per GPU
    assert html.count("<h3>Live error of rf-1</h3>") == 2
    # The slowed GPU first (a GPU in trouble leads): in alarm now, its flagged results
    # shaded; the other in control.
    gpu1, gpu0 = html.split("<h2 id='gpu-")[1:3]
    assert gpu1.startswith(uuid1) and gpu0.startswith(uuid0)
    assert "in alarm" in gpu1 and "in control" in gpu0
    fleet = html.split("<h2>Fleet</h2>")[1].split("</table>")[0]
    rows = re.findall(r"<tr>(.*?)</tr>", fleet)[1:]
    assert re.search(r"<td>0</td>", rows[0]) and re.search(r"class=bad>\d+<", rows[1])
    assert "taken in drift alarm (flagged)" in gpu1 and "new model" in gpu0
    # Intervals re-computed from the model file; clocks and clock-event reasons shown.
    assert "prediction interval" in html
    assert "SM clock (MHz)" in html and "temperature (°C)" in html
    assert "hw_thermal_slowdown" in gpu1 and "hw_thermal_slowdown" not in gpu0
    # 37 results of rf-1 per probe: no too-few warning; units in proper case.
    assert "rests on fewer than" not in html
    assert ">W<" in html and (">ms<" in html or ">µs<" in html)
    assert "What the store records, and what it does not" in html
    # The alarm from the store's events: raised on the slowed GPU's time plots and in its
    # list of events; none on the other. Every interval drawn was stored with its result.
    assert "drift alarm raised" in svgs(gpu1)[0] and "in drift alarm" in svgs(gpu1)[0]
    assert "drift alarm raised" not in "".join(svgs(gpu0))
    assert "<h3>Drift alarms and rebaselines in the window</h3>" in gpu1
    assert "still in alarm</span> at the window's end" in gpu1
    assert "No drift alarm or rebaseline recorded for this GPU in the window" in gpu0
    assert re.search(r"(\d[\d,]*) of \1 \(result, target\) predictions with their stored "
                     r"interval, 0 re-computed", html)
    assert "Rebaselines are not recorded" not in html


def test_fleet_report_marks_the_alarm_and_the_rebaseline_that_unflagged_its_results(
        tmp_path):
    """A rebaseline unflags the results taken in alarm: the alarm still shows (from the
    store's events), where it began and the rebaseline that ended it marked on the time
    plots and listed."""
    state = tmp_path / "state"
    cfg, (uuid0, uuid1) = fill_store(state, rounds_after_fit=10, rebaseline_rounds=6)
    out = report.write_fleet(tmp_path / "fleet.html", state_dir=state, drift_cfg=cfg.drift,
                             model_cfg=cfg.model)
    html = out.read_text(encoding="utf-8")
    assert_self_contained(html)
    gpu1, gpu0 = html.split("<h2 id='gpu-")[1:3]
    assert gpu1.startswith(uuid1)  # it had an alarm in the window: still first
    fleet = html.split("<h2>Fleet</h2>")[1].split("</table>")[0]
    rows = re.findall(r"<tr>(.*?)</tr>", fleet)[1:]
    assert re.search(r"[1-3] alarm\(s\) raised</span>, 1 rebaseline\(s\)", rows[1])
    assert "none" in rows[0]
    assert re.findall(r"<td>(\d+)</td>", rows[1])[1] == "0"  # flagged: none left
    ratio = svgs(gpu1)[0]
    assert "taken in drift alarm (flagged)" not in ratio  # unflagged, yet:
    for mark in ("drift alarm raised", "in drift alarm", "rebaseline", "×1.0"):
        assert mark in ratio, mark
    assert "drift alarm cleared" not in ratio  # ended by the rebaseline, not cleared
    assert "rebaseline" not in "".join(svgs(gpu0))
    # Listed: the alarm per target (runtime at least), each ended by the rebaseline, and
    # the rebaseline with the results it unflagged.
    events = gpu1.split("<h3>Drift alarms and rebaselines in the window</h3>")[1]
    events = events.split("</table>")[0]
    rows = [[re.sub(r"<[^>]+>", "", c) for c in re.findall(r"<td class=l>(.*?)</td>", r)]
            for r in re.findall(r"<tr>(.*?)</tr>", events)[1:]]
    alarms, last = rows[:-1], rows[-1]
    assert alarms and {r[1] for r in alarms} == {"drift alarm"}
    assert "runtime" in {r[2] for r in alarms}
    assert all("ended by the rebaseline" in r[4] for r in alarms)
    runtime = next(r for r in alarms if r[2] == "runtime")
    assert re.search(r"^×1\.0[5-9]\d of normal when raised", runtime[4])
    assert last[1] == "rebaseline" and "drift references reset by the daemon" in last[4]
    n = int(re.search(r"for this GPU: (\d+) result\(s\) taken while drifting unflagged",
                      last[4]).group(1))
    from gemmd.store import Store

    store = Store(state / "gemmd.db")
    try:  # the results it unflagged: GPU 1's, from the first alarm to the request
        began = store.events(kinds=("alarm",))[0]["ts"]
        asked = store.events(kinds=("rebaseline",))[0]["ts"]
        taken = [r for r in store.probes(device_uuid=uuid1, outcome=None)
                 if began <= r["ts"] <= asked]
    finally:
        store.close()
    assert n == len(taken) >= 3
    assert "No drift alarm or rebaseline recorded for this GPU in the window" in gpu0
    models = html.split("<h2>Models in the window</h2>")[1].split("</table>")[0]
    assert "model activated" in models and ">rf-1<" in models
    notes = html.split("What the store records, and what it does not")[1]
    assert "Rebaselines are not recorded" not in notes and "so an alarm a rebaseline " \
        "accepted still shows" in notes


def test_fleet_report_reads_a_schema_2_store_as_it_is(tmp_path):
    """A store the daemon has not migrated yet (schema 2): read-only, the report reads it
    as it is: no events (said), alarms by their flagged results, every interval
    re-computed with the model that predicted it, equal to what the daemon stores now."""
    import sqlite3

    from test_store import make_v2_store

    from gemmd.report import readonly
    from gemmd.report.fleet import data as fleet

    state = tmp_path / "state"
    cfg, uuids = fill_store(state, rounds_after_fit=10)
    old = tmp_path / "old"
    old.mkdir()
    v2 = make_v2_store(old / "gemmd.db")
    try:
        have = [r[1] for r in v2.execute("PRAGMA table_info(probes)")]
        v2.execute("ATTACH DATABASE ? AS new", (str(state / "gemmd.db"),))
        for table, cols in (("probes", have), ("devices", ["*"]), ("models", ["*"])):
            v2.execute(f"INSERT INTO main.{table} SELECT {', '.join(cols)} FROM new.{table}")
        v2.commit()
        v2.execute("DETACH DATABASE new")
    finally:
        v2.close()
    (old / "drift.json").write_bytes((state / "drift.json").read_bytes())
    before = digest(old)
    html = report.write_fleet(tmp_path / "old.html", state_dir=old, drift_cfg=cfg.drift,
                              model_cfg=cfg.model).read_text(encoding="utf-8")
    assert {k: v for k, v in digest(old).items() if k in before} == before
    with sqlite3.connect(old / "gemmd.db") as con:
        assert con.execute("PRAGMA user_version").fetchone()[0] == 2  # not migrated
    assert_self_contained(html)
    assert "This store has schema 2, from an older gemmd" in html
    assert "are recorded from schema 3 on; this store is older" in html
    gpu1 = html.split("<h2 id='gpu-")[1]
    assert gpu1.startswith(uuids[1]) and "taken in drift alarm (flagged)" in gpu1
    assert "<h3>Drift alarms and rebaselines" not in html
    assert re.search(r"with their stored interval, [1-9][\d,]* re-computed, 0 without",
                     html)
    # The intervals re-computed from the model files are those the daemon stored.
    for uuid in uuids:
        series = {}
        for where in (state, old):
            db = where / readonly.DB_NAME
            con = readonly.connect(db)
            try:
                devs = {d["uuid"]: d for d in readonly.devices(con, db)}
                g = fleet.GpuData(devs[uuid], readonly.device_info(devs[uuid]))
                rows = readonly.sentinels(con, db, uuid, 0.0, float("inf"))
                series[where] = fleet._series(g, rows, fleet._Bands(readonly.models(con, db),
                                                                    cfg.model))
            finally:
                con.close()
        for a, b in zip(series[state], series[old], strict=True):
            for t in ("runtime", "power", "energy"):
                known = np.isfinite(a.lo[t])
                assert known.sum() > 0 or t != "runtime"
                assert np.array_equal(known, np.isfinite(b.lo[t]))
                assert b.lo[t][known] == pytest.approx(a.lo[t][known], rel=1e-9)
                assert b.hi[t][known] == pytest.approx(a.hi[t][known], rel=1e-9)


def test_fleet_report_warns_on_few_results_and_selects_devices(tmp_path):
    state = tmp_path / "state"
    cfg, (uuid0, uuid1) = fill_store(state, rounds_after_fit=0)
    out = report.write_fleet(tmp_path / "f.html", state_dir=state, drift_cfg=cfg.drift,
                             model_cfg=cfg.model, devices=[uuid1[:14]])
    html = out.read_text(encoding="utf-8")
    assert "GPU 1:" in html and "GPU 0:" not in html
    assert "1: 1 × NVIDIA H100" in header(html)["GPU(s)"]
    # 5 results per probe since the fit (those the deployed model predicted): too few.
    assert f"rests on fewer than {report.MIN_ROWS} results of rf-1" in html
    with pytest.raises(InputError, match=r"^--device 7: is no device in the store \(known: "):
        report.write_fleet(tmp_path / "f.html", state_dir=state, devices=["7"])
    with pytest.raises(InputError, match=r"--days 0: must be a number of days in \(0, 36,500\]"):
        report.write_fleet(tmp_path / "f.html", state_dir=state, days=0)


def test_fleet_report_store_problems_are_one_line_errors(tmp_path):
    with pytest.raises(StoreError, match=r"^no store at .*gemmd\.db \(run the daemon"):
        report.write_fleet(tmp_path / "f.html", state_dir=tmp_path / "nothing")
    state = tmp_path / "state"
    state.mkdir()
    (state / "gemmd.db").write_bytes(b"not a database, just bytes " * 100)
    with pytest.raises(GemmdError) as e:
        report.write_fleet(tmp_path / "f.html", state_dir=state)
    assert str(e.value).startswith(f"store {state / 'gemmd.db'}") and "\n" not in str(e.value)
    assert not (tmp_path / "f.html").exists()
    assert os.listdir(tmp_path) == ["state"]
