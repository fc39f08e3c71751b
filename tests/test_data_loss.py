"""Issue 12, data loss, above the store: the daemon's retention and refit, probe rounds on
a full disk, bounded refits, and the CLI on damaged stores. Store-level cases are in
test_store.py."""

from __future__ import annotations

import csv
import dataclasses
import json
import logging
import os
import re
import sqlite3
import subprocess
import sys
import time
from contextlib import closing

import numpy as np
import pytest

from gemmd import datasets, importer
from gemmd.config import (
    Config,
    ExplorationConfig,
    FakeConfig,
    FakeDeviceConfig,
    MeasureConfig,
    ProbeGroup,
)
from gemmd.devices.fake import FakeDevice
from gemmd.features import Table
from gemmd.model import table_hash
from gemmd.registry import ModelRegistry, training_data, training_table
from gemmd.rounds import DeviceRunner
from gemmd.state import State
from gemmd.store import Store
from gemmd.store.schema import MEASURED_BY_SQL

CUTLASS = """\
timestamp,M,N,K,kernel,layout,cta_m,cta_n,cta_k,stages,epilogue,alpha,beta,runtime_ms,power_W
1600000000,512,1024,2048,k,nt,64,128,32,2,lc,1,0,0.5,70.0
1600000005,1024,1024,2048,k,nn,128,128,32,2,lc,0.5,0.5,0.9,[N/A]
"""


def _cfg(tmp_path, **over) -> Config:
    base = Config()
    probes = dataclasses.replace(
        base.probes,
        sentinels=(ProbeGroup(shapes=((1024, 1024, 1024), (4096, 4096, 4096)),
                              dtypes=("bf16", "fp32")),),
        exploration=(ExplorationConfig(per_round=2, m=(256, 4096), n=(256, 4096),
                                       k=(256, 4096)),),
        measure=MeasureConfig(window_s=0.1, warmup_s=0.0))
    return dataclasses.replace(
        base, backend="fake", state_dir=str(tmp_path), probes=probes,
        listen=dataclasses.replace(base.listen, address="127.0.0.1", port=0),
        budget=dataclasses.replace(base.budget, duty_cycle=1.0),
        model=dataclasses.replace(base.model, min_samples=10, n_estimators=10),
        fake=FakeConfig(devices=(FakeDeviceConfig(),)), **over)


def _gemmd(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gemmd", *args], capture_output=True,
                          text=True, timeout=120)


# ---------------------------------------------------------------- retention


def test_daemon_refit_prunes_its_own_probes_and_keeps_an_import(tmp_path):
    from gemmd.daemon import Daemon

    csv = tmp_path / "c.csv"
    csv.write_text(CUTLASS)  # measured in 2020: far beyond any retention
    cfg = _cfg(tmp_path)
    cfg = dataclasses.replace(cfg, store=dataclasses.replace(cfg.store, retention_days=1.0))
    d = Daemon(cfg)
    try:
        importer.import_dataset(d.store, datasets.load("auto", [csv]), "gpperf")
        uuid = d.runners[0].device.info.uuid
        d.store.insert_probe({"ts": 1.6e9, "source": "daemon", "kind": "sentinel",
                              "device_uuid": uuid, "device_name": "x", "backend": "fake",
                              "m": 1, "n": 1, "k": 1, "dtype": "fp32", "kernel": "blas",
                              "tile": 0, "layout": "nn", "outcome": "ok", "runtime_s": 1.0})
        d.runners[0].run_round()
        d.refit()
        assert len(d.store.probes(sources=("gpperf",))) == 2
        daemon_ts = [r["ts"] for r in d.store.probes(outcome=None)]
        assert daemon_ts and min(daemon_ts) > 1.6e9  # its own old probe went
    finally:
        d.stop()


def test_status_shows_rows_per_source_and_prune_deletes_on_request(tmp_path):
    s = Store(tmp_path / "gemmd.db")
    csv = tmp_path / "c.csv"
    csv.write_text(CUTLASS)
    importer.import_dataset(s, datasets.load("auto", [csv]), "gpperf")
    s.close()
    r = _gemmd("status", "--state-dir", str(tmp_path))
    assert r.returncode == 0, r.stderr
    line = next(x for x in r.stdout.splitlines() if "gpperf" in x)
    assert "2 rows" in line and "2020-09-13" in line
    assert "kept: until gemmd prune --source gpperf" in line
    js = json.loads(_gemmd("status", "--state-dir", str(tmp_path), "--json").stdout)
    assert [(x["source"], x["rows"]) for x in js["sources"]] == [("gpperf", 2)]

    r = _gemmd("prune", "--state-dir", str(tmp_path), "--source", "nope", "--all")
    assert r.returncode == 1 and len(r.stderr.splitlines()) == 1
    assert "no such source" in r.stderr and "gpperf (2 rows)" in r.stderr
    r = _gemmd("prune", "--state-dir", str(tmp_path), "--source", "gpperf")
    assert r.returncode == 2 and "--older-than" in r.stderr
    r = _gemmd("prune", "--state-dir", str(tmp_path), "--source", "gpperf", "--max-rows", "1")
    assert r.returncode == 0 and "deleted 1 of 2 rows" in r.stdout, r.stderr
    r = _gemmd("prune", "--state-dir", str(tmp_path), "--source", "gpperf", "--all")
    assert r.returncode == 0 and "deleted 1 of 1 rows" in r.stdout, r.stderr


# ---------------------------------------------------------------- disk full


def _fill(store):
    """SQLITE_FULL on the next probe result, as on a full filesystem: no page more, and
    the slack left in the last pages taken by the smallest rows there can be. (A result
    that fits in that slack is written, as on a real disk: how many did moved with the
    rows' sizes, and the test counted 22 lost results of 24 once contexts grew.)"""
    size = store.limit_size(store.size_bytes)
    assert size == store.size_bytes
    with closing(sqlite3.connect(store.path)) as db:
        page = int(db.execute("PRAGMA page_size").fetchone()[0])
        db.execute(f"PRAGMA max_page_count={size // page}")
        # the device's own uuid and the time now: the index entries land where the next
        # results' would, so the index's last pages are full too
        uuid = db.execute("SELECT device_uuid FROM probes LIMIT 1").fetchone()[0]
        while True:
            try:
                with db:
                    db.execute("INSERT INTO probes (ts, source, kind, device_uuid, "
                               "device_name, backend, m, n, k, dtype, kernel, tile, layout, "
                               "outcome) VALUES (?, 'filler', 'import', ?, '', '', 1, 1, 1, "
                               "'', '', 0, '', '')", (time.time(), uuid))
            except sqlite3.OperationalError as e:
                assert "full" in str(e)
                break


def test_rounds_on_a_full_disk_keep_results_count_them_and_log_once(tmp_path, caplog):
    cfg = _cfg(tmp_path)
    store, state = Store(tmp_path / "gemmd.db"), State()
    dev = FakeDevice(0, FakeDeviceConfig())
    store.upsert_device(dev.info.uuid, 0, dev.info.name, "fake", dataclasses.asdict(dev.info))
    runner = DeviceRunner(dev, cfg, store, state, ModelRegistry(store, tmp_path / "m",
                                                                 cfg.model, state))
    try:
        runner.run_round()
        stored = len(store.probes(outcome=None))
        _fill(store)
        caplog.clear()
        caplog.set_level(logging.INFO)
        lost = 0
        for _ in range(4):
            results = runner.run_round()
            lost += len(results)
            assert all(r.outcome == "ok" for r in results)
        assert state.store_errors_total == lost == 24
        assert len(state.probes) == 4  # every sentinel's latest result still served
        assert len(store.probes(outcome=None)) == stored
        problems = [r for r in caplog.records if r.levelno >= logging.ERROR]
        assert len(problems) == 1 and "full" in problems[0].getMessage()
        assert not any(r.exc_info for r in caplog.records)
        store.limit_size(None)  # space is back
        runner.run_round()
        assert len(store.probes(outcome=None)) == stored + 6
        back = [r.getMessage() for r in caplog.records if "work again after" in r.getMessage()]
        assert len(back) == 1 and f"{lost} probe result(s) were not written" in back[0]
    finally:
        store.close()


def test_refit_and_drift_save_on_a_full_disk_log_one_line_each(tmp_path, caplog,
                                                                monkeypatch):
    from gemmd.daemon import Daemon
    from gemmd.model import ForestModel

    d = Daemon(_cfg(tmp_path))
    try:
        for _ in range(3):
            d.runners[0].run_round()

        def full(*a, **k):
            raise OSError(28, "No space left on device", str(tmp_path / "models" / "m.skops"))

        monkeypatch.setattr(ForestModel, "save", full)
        monkeypatch.setattr(d.state.drift, "save", full)
        caplog.set_level(logging.INFO)
        for _ in range(3):
            d.refit()
            d._save_drift()
        assert d.state.model.refits_total["failed"] == 3
        errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
        assert len(errors) == 2, errors
        assert any("refit failed: No space left on device" in e and "m.skops" in e
                   for e in errors)
        assert any("cannot save drift state" in e for e in errors)
        assert not any(r.exc_info for r in caplog.records)
        monkeypatch.undo()
        d._save_drift()
        assert any("drift state saved again" in r.getMessage() for r in caplog.records)
    finally:
        d.stop()


def test_a_full_disk_names_the_file_a_refit_or_drift_save_could_not_write(tmp_path, caplog,
                                                                          monkeypatch):
    """A real ENOSPC from write() carries no file name ("No space left on device" alone,
    seen on a full tmpfs): the log line must still say which file."""
    import types

    import gemmd.drift.persistence
    from gemmd.daemon import Daemon

    def enospc(*a, **k):
        raise OSError(28, "No space left on device")  # no filename, as write() gives

    d = Daemon(_cfg(tmp_path))
    try:
        for _ in range(3):
            d.runners[0].run_round()
        monkeypatch.setattr(np.lib.format, "write_array", enospc)  # the model file's arrays
        monkeypatch.setattr(gemmd.drift.persistence, "json", types.SimpleNamespace(dump=enospc))
        caplog.set_level(logging.INFO)
        d.refit()
        d._save_drift()
        errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
        assert len(errors) == 2, errors
        assert any(e.startswith("refit failed: No space left on device: ") and
                   str(tmp_path) in e and e.endswith(".skops") for e in errors), errors
        assert any("cannot save drift state" in e and "drift.json" in e for e in errors)
        assert not list(tmp_path.rglob(".drift-*")) and not list(tmp_path.rglob(".tmp-*"))
    finally:
        d.stop()


# ---------------------------------------------------------------- bounded refits


def _populate(store, n_rounds=30, seed=0):
    """Two fake GPUs: 4 sentinels repeated every round, 2 unique exploration shapes per
    round, some failed and flagged rows, an import with CUTLASS columns, an unknown device."""
    rng = np.random.default_rng(seed)
    devs = [FakeDevice(i, FakeDeviceConfig(model=m)) for i, m in
            enumerate(("H100-SXM", "A100-SXM"))]
    for d in devs:
        store.upsert_device(d.info.uuid, d.info.index, d.info.name, "fake",
                            dataclasses.asdict(d.info))
    rows = []
    for rnd in range(n_rounds):
        for d in devs:
            shapes = [(1024, "bf16"), (4096, "bf16"), (1024, "fp32"), (4096, "fp32")]
            shapes += [(int(rng.integers(1, 64)) * 64, "fp32") for _ in range(2)]
            for j, (s, dt) in enumerate(shapes):
                rows.append({"ts": 1000.0 + rnd * 10 + j, "source": "daemon",
                             "kind": "sentinel" if j < 4 else "exploration",
                             "device_uuid": d.info.uuid, "device_index": d.info.index,
                             "device_name": d.info.name, "backend": "fake", "m": s, "n": s,
                             "k": s + j, "dtype": dt, "kernel": "blas", "tile": 0,
                             "layout": "nn", "outcome": "failed" if rnd == 3 else "ok",
                             "runtime_s": 1e-12 * s**3 * float(rng.lognormal(0, 0.02)),
                             "power_w": None if j == 5 else 300.0 + rnd,
                             "energy_j": 1.0, "flagged": rnd == 5, "context": {"x": 1}})
    rows.append(dict(rows[0], device_uuid="GPU-gone"))
    store.insert_probes(rows)
    importer.import_dataset(store, _cutlass_ds(), "imp")


def _cutlass_ds():
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as tmp:
        f = Path(tmp) / "c.csv"
        f.write_text(CUTLASS)
        return datasets.load("auto", [f])


@pytest.mark.parametrize("sources", [("daemon",), ("daemon", "imp"), ("imp",)])
def test_training_table_is_the_rows_path_read_column_wise(store, sources):
    _populate(store)
    rows, infos = training_data(store, sources)
    t, total = training_table(store, sources, max_rows=None)
    ref = Table.from_rows(rows, infos)
    assert total == len(rows) + (1 if "daemon" in sources else 0)  # + the unknown device
    assert len(t) == len(rows) and table_hash(t) == table_hash(ref)
    assert [d.uuid for d in t.devices] == [d.uuid for d in ref.devices]
    assert sorted(t.cols) == sorted(ref.cols)
    # whose measurement each row is (the model's domain tells them apart:
    # features.row_sources): the daemon's own, the imported CUTLASS file's format's
    assert t["source"].tolist() == [r["source"] for r in rows]
    assert set(t["source"]) == {"daemon" if s == "daemon" else "gpperf" for s in sources}


def test_an_export_imported_elsewhere_is_still_the_daemons_measurement(store, tmp_path):
    """The fleet's way (docs/model.md): host A's probes exported, imported on host B under
    a name, fitted: the rows are still "daemon" measurements to the model, so host B's
    daemon predictions of that GPU model are in its domain; an imported file's own source
    (the CUTLASS file's format's) survives its export and a second import."""
    from gemmd.cli.data import export_rows

    d = FakeDevice(0, FakeDeviceConfig(model="H100-SXM"))
    store.upsert_device(d.info.uuid, 0, d.info.name, "fake", dataclasses.asdict(d.info))
    store.insert_probes([
        {"ts": 1000.0 + i, "source": "daemon", "kind": "sentinel", "device_uuid": d.info.uuid,
         "device_index": 0, "device_name": d.info.name, "backend": "fake", "m": s, "n": s,
         "k": s, "dtype": "bf16", "kernel": "blas", "tile": 0, "layout": "nn",
         "outcome": "ok", "runtime_s": 2e-12 * s**3, "power_w": 500.0,
         "energy_j": 500.0 * 2e-12 * s**3, "flagged": False, "context": {"x": 1}}
        for i, s in enumerate((1024, 2048, 4096) * 3)])
    importer.import_dataset(store, _cutlass_ds(), "imp")
    out = tmp_path / "a.csv"
    for src, name in ((["daemon"], "host1"), (["imp"], "again")):
        header, rows = export_rows(store, src)
        with out.open("w", newline="") as fh:
            w = csv.writer(fh)
            w.writerow(header)
            w.writerows(rows)
        other = Store(tmp_path / f"{name}.db")
        try:
            importer.import_dataset(other, datasets.load("auto", [out]), name)
            t, _ = training_table(other, [name], max_rows=None)
            r, _ = training_data(other, [name])
        finally:
            other.close()
        want = "daemon" if name == "host1" else "gpperf"
        assert set(t["source"]) == {want} and {x["source"] for x in r} == {want}


def test_training_cap_keeps_every_configuration_and_the_newest_repeats(store):
    _populate(store, n_rounds=30)
    full, total = training_table(store, max_rows=None)
    assert total == len(full) + 1
    t, total2 = training_table(store, max_rows=200)
    assert total2 == total and 150 <= len(t) <= 200
    key = list(zip(t.device, t["m"], t["k"], t["dtype"]))
    full_key = list(zip(full.device, full["m"], full["k"], full["dtype"]))
    # Every configuration is still there; the most repeated ones (the sentinels, every
    # round) were cut to the same quota of repeats, their newest.
    assert set(key) == set(full_key)
    quota = max(key.count(k) for k in set(key))
    assert 1 < quota < 30
    for k in set(full_key):
        ts_all = sorted(full["ts"][[i for i, x in enumerate(full_key) if x == k]])
        ts_kept = sorted(t["ts"][[i for i, x in enumerate(key) if x == k]])
        assert ts_kept == ts_all[-min(len(ts_all), quota):]
    assert list(t["ts"]) == sorted(t["ts"])  # oldest first, as before


def test_training_cap_below_the_number_of_configurations(store):
    _populate(store, n_rounds=30)
    t, _ = training_table(store, max_rows=20)
    # The 20 configurations written last (ids: the clock may have jumped, issue 24); the
    # very last row is of a device the store no longer knows, and is dropped after.
    assert len(t) == 19 and len(set(zip(t.device, t["m"], t["k"], t["dtype"]))) == 19


def test_refit_reads_only_the_fits_columns_and_at_most_the_cap(tmp_path, monkeypatch):
    store = Store(tmp_path / "gemmd.db")
    try:
        _populate(store, n_rounds=30)
        statements: list[str] = []
        store.trace(statements.append)
        cfg = dataclasses.replace(Config().model, min_samples=10, n_estimators=10,
                                  max_training_rows=150)
        reg = ModelRegistry(store, tmp_path / "models", cfg)
        assert reg.refit().outcome == "accepted"
        assert reg.current.meta["n_samples"] <= 150
        reads = [s for s in statements if "FROM probes" in s]
        # the context is read only for an import's measured_by (none here), never returned
        reads = [s.replace(MEASURED_BY_SQL, "measured_by") for s in reads]
        assert reads and not [s for s in reads if "SELECT *" in s or "context" in s], reads
    finally:
        store.close()


# ---------------------------------------------------------------- damaged stores, CLI


def _damaged(tmp_path):
    s = Store(tmp_path / "gemmd.db")
    s.insert_probes([{"ts": float(i), "source": "daemon", "kind": "sentinel",
                      "device_uuid": "GPU-a", "device_name": "x", "backend": "fake", "m": 1,
                      "n": 1, "k": 1, "dtype": "fp32", "kernel": "blas", "tile": 0,
                      "layout": "nn", "outcome": "ok", "error": "e" * 200}
                     for i in range(300)])
    s.close()
    with open(tmp_path / "gemmd.db", "r+b") as f:
        f.seek(4096 * 4)
        f.write(os.urandom(4096))


@pytest.mark.parametrize("damage", ["malformed", "dropped"])
@pytest.mark.parametrize("command", [["status"], ["run", "--backend", "fake", "--port", "0"]])
def test_cli_on_a_damaged_store_prints_one_line_and_exits_1(tmp_path, damage, command):
    if damage == "malformed":
        _damaged(tmp_path)
    else:
        Store(tmp_path / "gemmd.db").close()
        import sqlite3

        db = sqlite3.connect(tmp_path / "gemmd.db")
        db.execute("DROP TABLE probes")
        db.close()
    r = _gemmd(*command, "--state-dir", str(tmp_path))
    assert r.returncode == 1, r.stderr
    assert "Traceback" not in r.stderr
    lines = [x for x in r.stderr.splitlines() if x.startswith("gemmd: error")]
    assert len(lines) == 1 and str(tmp_path / "gemmd.db") in lines[0]
    assert ("damaged" if damage == "malformed" else "table probes is missing") in lines[0]


@pytest.mark.parametrize("read_only, gist", [
    (True, "on a read-only filesystem"),  # said "not writable by this user" (issue 12)
    (False, f"not writable by uid {os.geteuid()} (directory mode d"),
])
def test_an_unwritable_state_dir_says_why(tmp_path, monkeypatch, read_only, gist):
    """A read-only filesystem is not a permission problem: the line says which. (The real
    read-only mount is bench/fuzz_faults.py's; CI cannot mount one, so os.access and
    statvfs answer as they do there.)"""
    from gemmd.errors import GemmdError
    from gemmd.runtime import open_state_dir

    real_statvfs = os.statvfs

    class Ro:
        def __init__(self, st):
            self.f_flag = st.f_flag | (os.ST_RDONLY if read_only else 0)

    monkeypatch.setattr(os, "access", lambda p, mode, **k: False)
    monkeypatch.setattr(os, "statvfs", lambda p: Ro(real_statvfs(p)))
    with pytest.raises(GemmdError) as e:
        open_state_dir(_cfg(tmp_path), tmp_path / "state")
    assert f"state_dir {tmp_path / 'state'}: " in str(e.value) and gist in str(e.value)


# ------------------------------------------- issue 24: a second daemon, a wrong clock

def test_a_second_daemon_on_the_same_state_directory_is_refused(tmp_path):
    from gemmd.daemon import Daemon
    from gemmd.errors import StoreError

    d = Daemon(_cfg(tmp_path))
    try:
        with pytest.raises(StoreError, match=f"in use by another gemmd \\(pid {os.getpid()} "):
            Daemon(_cfg(tmp_path))
        assert len(d.store.devices()) == 1  # the refused one wrote nothing
    finally:
        d.stop()
    Daemon(_cfg(tmp_path)).stop()  # free once the first has stopped


def test_a_clock_jump_rearms_the_jobs_logs_once_and_is_counted(tmp_path, caplog):
    """The wall clock went back a day: APScheduler (it fires by the wall clock) would
    wait a day for every job; nothing was logged. The daemon sees the jump against the
    monotonic clock, gives each job back what was left of its wait, logs once, counts
    it in gemmd_clock_jumps_total and shifts the in-flight times the hang watchdog
    compares. Both clocks are the test's: no faketime, any machine speed."""
    import time
    import urllib.request
    from datetime import datetime, timedelta

    from gemmd.clockwatch import ClockWatch
    from gemmd.daemon import Daemon

    cfg = _cfg(tmp_path)
    cfg = dataclasses.replace(cfg, schedule=dataclasses.replace(cfg.schedule,
                                                                probe_interval_s=60))
    d = Daemon(cfg)
    try:
        d.start()
        uuid = d.runners[0].device.info.uuid
        ds = d.state.devices[uuid]
        deadline = time.monotonic() + 60
        while not ds.last_round_ts:  # the first round done: no other for 60 s to race
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert d.runners[0].wait_idle(30)
        wall, mono = [time.time()], [1000.0]
        d.clock = ClockWatch(wall=lambda: wall[0], mono=lambda: mono[0])
        with d.state.lock:
            d.state.devices[uuid].in_flight_since = wall[0] - 1.0
        # What the scheduler holds once the clock went back a day: every job a day away.
        for job in d.scheduler.get_jobs():
            job.modify(next_run_time=job.next_run_time + timedelta(days=1))
        wall[0] -= 86400.0
        mono[0] += 5.0
        caplog.set_level(logging.WARNING)
        assert d.check_clock() == pytest.approx(-86405.0)
        assert d.check_clock() is None  # once per jump
        limit = datetime.now().astimezone() + timedelta(seconds=cfg.schedule.refit_interval_s)
        jobs = d.scheduler.get_jobs()
        assert jobs and all(j.next_run_time <= limit for j in jobs)
        probe = d.scheduler.get_job(f"probe-{uuid}")
        assert probe.next_run_time <= datetime.now().astimezone() + timedelta(seconds=60)
        assert caplog.text.count("wall clock jumped back 1.0 days") == 1
        assert d.state.devices[uuid].in_flight_since == pytest.approx(wall[0] - 6.0)
        with urllib.request.urlopen(f"http://127.0.0.1:{d.port}/metrics", timeout=10) as r:
            assert re.search(r'^gemmd_clock_jumps_total\{hostname="[^"]*"\} 1\.0$',
                             r.read().decode(), re.M)
    finally:
        d.stop()


# ------------------------------------------ issue 24: numbers in imported files, checked

@pytest.mark.parametrize("cell, problem", [
    ('"0,12"', "'0,12' is not a number (a decimal comma?"),  # was 12 (',' stripped)
    ("0_1", "'0_1' is not a number"),  # was 1 (Python's digit separator)
    ("\uff11\uff10\uff12\uff14", "is not a number"),  # full-width 1024, was 1024
    ("1e300", "1e300 ms is above 3.6e+06 ms"),  # no upper bound
    ("inf", "'inf' is not a number"),
    ("0x10", "'0x10' is not a number"),
    ("1e99999", "'1e99999' is not a number"),
])
def test_import_numbers_are_strict_ascii_decimal_bounded_by_physics(tmp_path, cell, problem):
    f = tmp_path / "t.csv"
    f.write_text(f"gpu,m,n,k,dtype,runtime_ms\nNVIDIA L4,512,512,512,fp16,{cell}\n",
                 encoding="utf-8")
    with pytest.raises(Exception) as e:
        datasets.load("csv", [f])
    assert problem in str(e.value), str(e.value)


def test_import_stores_the_numbers_the_file_says(tmp_path):
    """Checked in the store, not by the exit code: what goes in is what the file says."""
    f = tmp_path / "t.csv"
    f.write_text("gpu,m,n,k,dtype,runtime_ms,power_w\n"
                 "NVIDIA L4,512,512,512,fp16,0.125,+70.5\nNVIDIA L4,1024,1024,1024,fp16,"
                 "1.5E-0,71\n")
    store = Store(tmp_path / "gemmd.db")
    try:
        importer.import_dataset(store, datasets.load("csv", [f]), "x")
        rows = sorted(store.probes(sources=("x",), limit=10), key=lambda r: r["m"])
        assert [(r["m"], r["runtime_s"], r["power_w"]) for r in rows] == [
            (512, 0.125e-3, 70.5), (1024, 1.5e-3, 71.0)]
    finally:
        store.close()


@pytest.mark.parametrize("header", ["time_ms,time_s", "runtime_ms,latency_us",
                                    "mean_time_ms,avg_time_us"])
def test_an_ambiguous_measurement_header_is_an_error(tmp_path, header):
    f = tmp_path / "t.csv"
    f.write_text(f"gpu,m,n,k,dtype,{header}\nNVIDIA L4,512,512,512,fp16,0.1,0.0001\n")
    with pytest.raises(Exception) as e:
        datasets.load("csv", [f])
    assert "the same statistic): which one is meant is not clear" in str(e.value)


def test_a_forward_jump_does_not_make_the_scheduler_list_every_missed_run():
    """+100 days with a 1 s probe interval: APScheduler listed 8.6 million missed run
    times, one interval at a time with its lock held; the daemon stalled ~30 s (found by
    bench/fuzz_faults.py --only peers under libfaketime). The daemon's trigger fires once
    now instead."""
    from datetime import datetime, timedelta, timezone

    from apscheduler.job import Job
    from apscheduler.schedulers.background import BackgroundScheduler

    from gemmd.clockwatch import interval

    now = datetime.now(timezone.utc)
    trigger = interval(1)
    assert trigger.get_next_fire_time(now - timedelta(seconds=1), now) == now
    assert trigger.get_next_fire_time(now - timedelta(days=100), now) == now
    job = Job(BackgroundScheduler(timezone="UTC"), id="j", func=print, args=(), kwargs={},
              trigger=trigger, executor="default", misfire_grace_time=1, coalesce=True,
              max_instances=1, next_run_time=now - timedelta(days=100), name="j")
    assert len(job._get_run_times(now)) == 2  # the missed one and now, coalesced into one
