"""The SQLite store (gemmd/store/), on real database files in tmp_path."""

import json
import logging
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
from contextlib import closing
from pathlib import Path

import numpy as np
import pytest

from gemmd.errors import StoreError
from gemmd.store import INTERVAL_COLUMNS, SCHEMA_VERSION, Store
from gemmd.store.writes import StoreWriteError

REPO = Path(__file__).resolve().parent.parent


def row(**over):
    r = {"ts": 1000.0, "source": "daemon", "kind": "sentinel", "device_uuid": "GPU-a",
         "device_index": 0, "device_name": "Fake GPU", "backend": "fake", "m": 1024, "n": 1024,
         "k": 1024, "dtype": "fp32", "kernel": "blas", "tile": 0, "layout": "nn",
         "outcome": "ok", "iterations": 10, "runtime_s": 1e-3, "context": {"sm_clock_hz": 1e9}}
    r.update(over)
    return r


def test_open_sets_wal_and_schema_version(store):
    assert store.journal_mode == "wal"
    assert store.schema_version == SCHEMA_VERSION >= 1


def test_creates_parent_directories(tmp_path):
    s = Store(tmp_path / "a" / "b" / "gemmd.db")
    try:
        assert (tmp_path / "a" / "b" / "gemmd.db").is_file()
    finally:
        s.close()


def test_reopen_keeps_data_and_decodes_json(tmp_path):
    s = Store(tmp_path / "gemmd.db")
    (pid,) = s.insert_probes([row(flagged=True)])
    s.close()
    s = Store(tmp_path / "gemmd.db")
    try:
        assert s.schema_version == SCHEMA_VERSION
        rows = s.probes(include_flagged=True)
        assert [r["id"] for r in rows] == [pid]
        assert rows[0]["context"] == {"sm_clock_hz": 1e9}  # JSON round trip
        assert rows[0]["flagged"] == 1
    finally:
        s.close()


def test_newer_schema_is_refused(tmp_path):
    path = tmp_path / "gemmd.db"
    db = sqlite3.connect(path)
    db.execute(f"PRAGMA user_version={SCHEMA_VERSION + 1}")
    db.close()
    with pytest.raises(StoreError, match="newer"):
        Store(path)


def test_garbage_file_is_a_store_error(tmp_path):
    path = tmp_path / "gemmd.db"
    path.write_bytes(os.urandom(8192))
    with pytest.raises(StoreError, match=str(path)):
        Store(path)


def test_insert_probes_is_all_or_nothing(store):
    bad = row(ts=1001.0)
    del bad["device_name"]  # NOT NULL column
    with pytest.raises((sqlite3.IntegrityError, StoreError)):
        store.insert_probes([row(), bad, row(ts=1002.0)])
    assert store.probes(sources=None, outcome=None, include_flagged=True) == []
    # The connection is usable afterwards (the transaction was rolled back, not left open).
    store.insert_probe(row())
    assert len(store.probes()) == 1


def test_probes_filters_and_order(store):
    store.insert_probes([
        row(ts=1.0),
        row(ts=3.0),
        row(ts=2.0),
        row(ts=4.0, source="import-x"),
        row(ts=5.0, outcome="failed"),
        row(ts=6.0, flagged=True),
        row(ts=7.0, device_uuid="GPU-b"),
    ])
    ts = [r["ts"] for r in store.probes()]
    assert ts == [7.0, 3.0, 2.0, 1.0]  # daemon, ok, unflagged; newest first
    assert [r["ts"] for r in store.probes(include_flagged=True)] == [7.0, 6.0, 3.0, 2.0, 1.0]
    assert [r["ts"] for r in store.probes(sources=("import-x",))] == [4.0]
    assert [r["ts"] for r in store.probes(sources=None)] == [7.0, 4.0, 3.0, 2.0, 1.0]
    assert [r["ts"] for r in store.probes(outcome="failed")] == [5.0]
    assert len(store.probes(sources=None, outcome=None, include_flagged=True)) == 7
    assert [r["ts"] for r in store.probes(limit=2)] == [7.0, 3.0]
    assert [r["ts"] for r in store.probes(device_uuid="GPU-a")] == [3.0, 2.0, 1.0]
    assert [r["ts"] for r in store.probes(since=2.5)] == [7.0, 3.0]


def test_latest_per_probe_one_row_per_device_and_config(store):
    store.insert_probes([
        row(ts=1.0, runtime_s=1.0),
        row(ts=2.0, runtime_s=2.0),  # newest of GPU-a / 1024 fp32
        row(ts=3.0, dtype="bf16", runtime_s=3.0),
        row(ts=4.0, device_uuid="GPU-b", device_index=1, runtime_s=4.0),
        row(ts=5.0, device_uuid="GPU-b", device_index=1, runtime_s=5.0, outcome="failed"),
        row(ts=6.0, kind="exploration", runtime_s=6.0),  # not a sentinel
        row(ts=7.0, source="import-x", runtime_s=7.0),  # not the daemon's
    ])
    latest = store.latest_per_probe()
    got = sorted((r["device_uuid"], r["dtype"], r["runtime_s"]) for r in latest)
    assert got == [("GPU-a", "bf16", 3.0), ("GPU-a", "fp32", 2.0), ("GPU-b", "fp32", 5.0)]
    assert [r["runtime_s"] for r in store.latest_per_probe("import-x")] == [7.0]


def test_prune_by_age(store):
    now = 100 * 86400.0
    store.insert_probes([row(ts=now - 10 * 86400), row(ts=now - 2 * 86400), row(ts=now)])
    assert store.prune(retention_days=5, max_rows=1000, now=now) == 1
    assert sorted(r["ts"] for r in store.probes()) == [now - 2 * 86400, now]


def test_prune_by_max_rows_keeps_newest(store):
    """The newest written (ids), whatever the clock said when they were (issue 24)."""
    store.insert_probes([row(ts=float(t)) for t in (5, 1, 4, 2, 3)])
    assert store.prune(retention_days=1000, max_rows=2, now=10.0) == 3
    assert [r["ts"] for r in store.probes()] == [3.0, 2.0]
    assert store.prune(retention_days=1000, max_rows=2, now=10.0) == 0


def test_models_activation(store):
    assert store.active_model() is None
    v1 = store.add_model("rf", "/m/1", 40, "h1", {"scores": {}}, activate=True)
    assert store.active_model()["version"] == v1
    v2 = store.add_model("rf", "/m/2", 50, "h2", {"scores": {"a": 1}}, activate=True)
    assert store.active_model()["version"] == v2
    assert {m["version"]: m["active"] for m in store.models()} == {v1: 0, v2: 1}
    v3 = store.add_model("rf", "/m/3", 60, "h3", {}, activate=False)
    assert store.active_model()["version"] == v2
    store.activate_model(v1)
    assert {m["version"]: m["active"] for m in store.models()} == {v1: 1, v2: 0, v3: 0}
    assert store.active_model()["meta"] == {"scores": {}}


def test_upsert_device_updates_in_place(store):
    store.upsert_device("GPU-a", 0, "old", "fake", {"x": 1})
    store.upsert_device("GPU-a", 1, "new", "fake", {"x": 2})
    (d,) = store.devices()
    assert (d["idx"], d["name"], d["info"]) == (1, "new", {"x": 2})
    assert d["last_seen"] >= d["first_seen"]


def test_committed_row_survives_sigkill(tmp_path):
    path = tmp_path / "gemmd.db"
    script = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(REPO)!r})
        from gemmd.store import Store
        s = Store({str(path)!r})
        s.insert_probe({row(ts=42.0, runtime_s=0.5)!r})
        print("committed", flush=True)
        time.sleep(60)
    """)
    _kill_after_commit(script)
    s = Store(path)
    try:
        rows = s.probes()
        assert [(r["ts"], r["runtime_s"]) for r in rows] == [(42.0, 0.5)]
    finally:
        s.close()


# ---------------------------------------------------------------- retention (issue 12)


def test_prune_by_age_leaves_imported_sources_alone(store):
    now = 100 * 86400.0
    old = now - 10 * 86400
    store.insert_probes([row(ts=old), row(ts=now),
                         row(ts=old, source="gpperf", kind="import"),
                         row(ts=now, source="gpperf", kind="import")])
    assert store.prune(retention_days=5, max_rows=1000, now=now) == 1
    assert [r["ts"] for r in store.probes()] == [now]
    assert [r["ts"] for r in store.probes(sources=("gpperf",))] == [now, old]


def test_prune_max_rows_counts_and_deletes_the_daemons_probes_only(store):
    # The import is older than every daemon probe: "oldest first" must not reach it.
    store.insert_probes([row(ts=float(t), source="gpperf", kind="import") for t in (1, 2, 3)])
    store.insert_probes([row(ts=float(t)) for t in (4, 5, 6, 7)])
    assert store.prune(retention_days=1000, max_rows=2, now=10.0) == 2
    assert [r["ts"] for r in store.probes()] == [7.0, 6.0]
    assert len(store.probes(sources=("gpperf",))) == 3


def test_prune_and_delete_a_named_source_on_request(store):
    store.insert_probes([row(ts=float(t), source="gpperf", kind="import") for t in (1, 2, 3)])
    store.insert_probes([row(ts=float(t)) for t in (4, 5)])
    assert store.prune(None, 1, sources=("gpperf",)) == 2
    assert [r["ts"] for r in store.probes(sources=("gpperf",))] == [3.0]
    assert store.delete_source("gpperf") == 1
    assert store.probes(sources=("gpperf",)) == [] and len(store.probes()) == 2


def test_sources_summary(store):
    store.insert_probes([row(ts=5.0), row(ts=7.0, device_uuid="GPU-b"),
                         row(ts=3.0, source="gpperf", kind="import")])
    got = {s["source"]: (s["rows"], s["devices"], s["first"], s["last"])
           for s in store.sources()}
    assert got == {"daemon": (2, 2, 5.0, 7.0), "gpperf": (1, 1, 3.0, 3.0)}
    assert store.sources()[0]["source"] == "daemon"


# ---------------------------------------------------------------- disk full (issue 12)


def _fill(store):
    """SQLITE_FULL on the next write that needs a new page, as on a full filesystem."""
    assert store.limit_size(store.size_bytes) == store.size_bytes


def test_disk_full_fails_each_write_cleanly_logs_once_and_recovers(store, caplog):
    store.insert_probe(row(ts=1.0))
    _fill(store)
    big = "x" * 6000  # needs pages the file cannot grow by
    caplog.set_level(logging.INFO, logger="gemmd.store")
    for i in range(5):
        with pytest.raises(StoreWriteError) as e:
            store.insert_probe(row(ts=2.0 + i, error=big))
        assert e.value.full and e.value.reported
        assert "rollback" not in str(e.value) and str(store.path) in str(e.value)
        assert not store.in_transaction
    assert store.failing and store.rows_not_written == 5
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1, errors
    assert "full" in errors[0] and str(store.path) in errors[0] and "free" in errors[0]
    assert str(store.path.parent) in errors[0]
    assert not any(r.exc_info for r in caplog.records)
    # Space returns: the next write works, and one line says so with what was not written.
    store.limit_size(None)
    store.insert_probe(row(ts=10.0, error=big))
    back = [r.getMessage() for r in caplog.records if "work again after" in r.getMessage()]
    assert len(back) == 1 and "5 probe result(s) were not written" in back[0]
    assert not store.failing
    assert [r["ts"] for r in store.probes()] == [10.0, 1.0]
    store.insert_probe(row(ts=11.0))
    assert len([r for r in caplog.records if "work again after" in r.getMessage()]) == 1


def test_writes_failing_and_recovering_over_and_over_log_every_five_minutes(store, caplog,
                                                                           monkeypatch):
    import gemmd.store.writes as store_mod

    now = [1000.0]
    monkeypatch.setattr(store_mod, "_clock", lambda: now[0])
    caplog.set_level(logging.INFO, logger="gemmd.store")
    big = "x" * 6000
    for _ in range(60):  # 10 minutes of a filesystem full 8 s out of every 10
        _fill(store)
        for _ in range(4):
            with pytest.raises(StoreWriteError):
                store.insert_probe(row(error=big))
        now[0] += 8
        store.limit_size(None)
        store.insert_probe(row())
        now[0] += 2
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    failing = [x for x in lines if "writes failing" in x]
    back = [x for x in lines if "work again after" in x]
    assert len(failing) == 2 and len(back) == 2, lines  # t = 0 and 300 s, not 60 times
    assert "intermittently" in failing[1]
    assert "120 probe result(s) were not written" in back[1]  # 30 episodes x 4 since 300 s
    # Still failing after a suppressed start: said once the window has passed.
    _fill(store)
    for _ in range(40):
        with pytest.raises(StoreWriteError):
            store.insert_probe(row(error=big))
        now[0] += 10
    assert store.failing
    assert "writes failing" in [r.getMessage() for r in caplog.records][-1]


def test_a_failed_prune_leaves_no_transaction_open(store):
    store.insert_probes([row(ts=1.0), row(ts=2.0)])
    with closing(sqlite3.connect(store.path)) as db:  # a trigger that makes deletes fail
        db.execute("CREATE TRIGGER fail BEFORE DELETE ON probes "
                   "BEGIN SELECT RAISE(FAIL, 'simulated write failure'); END")
        with pytest.raises((StoreError, sqlite3.Error)):
            store.prune(retention_days=0.01, max_rows=1, now=1e9)
        db.execute("DROP TRIGGER fail")
    assert not store.in_transaction
    store.insert_probe(row(ts=3.0))  # not "cannot start a transaction within a transaction"
    assert len(store.probes()) == 3


# ---------------------------------------------------------------- damage (issue 12)


def _filled(tmp_path, n=300):
    path = tmp_path / "gemmd.db"
    s = Store(path)
    s.insert_probes([row(ts=float(i)) for i in range(n)])
    s.close()
    return path


def test_a_malformed_page_is_refused_naming_the_file(tmp_path):
    path = _filled(tmp_path)
    with open(path, "r+b") as f:  # one page of the probes table overwritten
        f.seek(4096 * 4)
        f.write(os.urandom(4096))
    with pytest.raises(StoreError, match="damaged") as e:
        Store(path)
    assert str(path) in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("damage, problem", [
    ("DROP TABLE models", "table models is missing"),
    ("DROP TABLE probes", "table probes is missing"),
    ("ALTER TABLE probes DROP COLUMN out_dtype", "table probes lacks column(s) out_dtype"),
])
def test_a_broken_schema_is_refused(tmp_path, damage, problem):
    path = _filled(tmp_path, 3)
    db = sqlite3.connect(path)
    db.execute(damage)
    db.close()
    with pytest.raises(StoreError, match="schema is broken") as e:
        Store(path)
    assert problem in str(e.value) and str(path) in str(e.value)


def test_another_programs_database_is_refused(tmp_path):
    path = tmp_path / "gemmd.db"
    db = sqlite3.connect(path)
    db.execute("CREATE TABLE notes (x)")
    db.close()
    with pytest.raises(StoreError, match="not gemmd's"):
        Store(path)


def test_a_read_only_store_is_refused(tmp_path, monkeypatch):
    path = _filled(tmp_path, 3)
    path.chmod(0o444)
    if os.geteuid() == 0:  # root writes anyway: make access() answer as for another user
        real = os.access
        monkeypatch.setattr(os, "access", lambda p, mode, **kw: False if Path(p) == path
                            and mode & os.W_OK else real(p, mode, **kw))
    with pytest.raises(StoreError, match="not writable") as e:
        Store(path)
    assert str(path) in str(e.value)


def test_an_empty_file_becomes_a_new_store_with_a_warning(tmp_path, caplog):
    path = tmp_path / "gemmd.db"
    path.write_bytes(b"")
    with caplog.at_level(logging.INFO, logger="gemmd.store"):
        s = Store(path)
    s.close()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("0-byte" in w and str(path) in w for w in warnings), warnings


def test_open_logs_rows_found_and_last_probe_time(tmp_path, caplog):
    path = _filled(tmp_path, 3)
    s = Store(path)
    s.insert_probe(row(ts=1e9, source="gpperf", kind="import"))
    s.close()
    with caplog.at_level(logging.INFO, logger="gemmd.store"):
        Store(path).close()
    (line,) = [r.getMessage() for r in caplog.records if "probe results" in r.getMessage()]
    assert str(path) in line and "4 probe results" in line and "daemon 3" in line
    assert "gpperf 1" in line and "2001-09-09" in line  # 1e9 in UTC; local may differ a day


def _write_then_sigkill(path, ts):
    """Rows committed by a process that is then killed: they are in the -wal only."""
    script = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(REPO)!r})
        from gemmd.store import Store
        s = Store({str(path)!r})
        for t in {list(ts)!r}:
            s.insert_probe({row()!r} | {{"ts": t}})
        print("committed", flush=True)
        time.sleep(60)
    """)
    _kill_after_commit(script)


@pytest.mark.parametrize("damage", ["deleted", "garbled"])
def test_a_lost_wal_after_a_crash_is_reported(tmp_path, caplog, damage):
    path = _filled(tmp_path, 100)  # closed cleanly: checkpointed into gemmd.db
    _write_then_sigkill(path, [1000.0 + i for i in range(44)])
    wal = tmp_path / "gemmd.db-wal"
    assert wal.stat().st_size > 0
    if damage == "deleted":
        wal.unlink()
    else:
        with open(wal, "r+b") as f:
            f.write(os.urandom(32))  # the header: SQLite then ignores every frame
    with caplog.at_level(logging.INFO, logger="gemmd.store"):
        s = Store(path)
    try:
        assert len(s.probes()) == 100  # the 44 are gone; SQLite cannot know
    finally:
        s.close()
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "100 probe results" in text  # what was found
    assert "44 probe results are missing" in text, text


def test_a_wal_lost_before_any_checkpoint_is_reported(tmp_path, caplog):
    path = tmp_path / "gemmd.db"
    _write_then_sigkill(path, [1000.0 + i for i in range(144)])
    (tmp_path / "gemmd.db-wal").unlink()
    with caplog.at_level(logging.INFO, logger="gemmd.store"):
        Store(path).close()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("144 probe results are missing" in w for w in warnings), warnings
    assert any("no schema" in w for w in warnings), warnings


def test_the_high_water_mark_follows_deliberate_deletes(tmp_path, caplog):
    path = _filled(tmp_path, 5)
    s = Store(path)
    s.insert_probes([row(ts=9.0, source="x", kind="import")])
    s.delete_source("x")
    s.close()
    assert json.loads((tmp_path / "gemmd.db-seen").read_text())["max_id"] == 5
    with caplog.at_level(logging.WARNING, logger="gemmd.store"):
        Store(path).close()
    assert not caplog.records


def _kill_after_commit(script: str) -> None:
    """Run ``script`` in a child that prints "committed" after its writes, then SIGKILL it
    (no chance to checkpoint or close the store)."""
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.strip() == "committed", proc.stderr.read() if not line else line
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(timeout=10) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        proc.stderr.close()


# ---------------------------------------------------------------- schema 3: events, intervals

# A store as gemmd wrote it at schema 2 (gemmd/store/schema.py's _V1 and _V2 before schema 3).
V2_SCHEMA = """
CREATE TABLE probes (
    id INTEGER PRIMARY KEY, ts REAL NOT NULL, source TEXT NOT NULL, kind TEXT NOT NULL,
    device_uuid TEXT NOT NULL, device_index INTEGER, device_name TEXT NOT NULL,
    backend TEXT NOT NULL, m INTEGER NOT NULL, n INTEGER NOT NULL, k INTEGER NOT NULL,
    dtype TEXT NOT NULL, kernel TEXT NOT NULL, tile INTEGER NOT NULL, layout TEXT NOT NULL,
    outcome TEXT NOT NULL, iterations INTEGER, runtime_s REAL, runtime_mean_s REAL,
    runtime_min_s REAL, runtime_p90_s REAL, runtime_cv REAL, window_s REAL, energy_j REAL,
    power_w REAL, power_sample_w REAL, check_ok INTEGER, check_error REAL,
    pred_runtime_s REAL, pred_power_w REAL, pred_energy_j REAL, model_version TEXT,
    flagged INTEGER NOT NULL DEFAULT 0, error TEXT, context TEXT);
CREATE INDEX probes_device_ts ON probes(device_uuid, ts);
CREATE INDEX probes_source_ts ON probes(source, ts);
CREATE TABLE devices (
    uuid TEXT PRIMARY KEY, idx INTEGER, name TEXT NOT NULL, backend TEXT NOT NULL,
    info TEXT NOT NULL, first_seen REAL NOT NULL, last_seen REAL NOT NULL);
CREATE TABLE models (
    version INTEGER PRIMARY KEY AUTOINCREMENT, created REAL NOT NULL, kind TEXT NOT NULL,
    path TEXT NOT NULL, n_samples INTEGER NOT NULL, data_hash TEXT NOT NULL,
    meta TEXT NOT NULL, active INTEGER NOT NULL DEFAULT 0);
ALTER TABLE probes ADD COLUMN batch INTEGER;
ALTER TABLE probes ADD COLUMN cta_m INTEGER;
ALTER TABLE probes ADD COLUMN cta_n INTEGER;
ALTER TABLE probes ADD COLUMN cta_k INTEGER;
ALTER TABLE probes ADD COLUMN stages INTEGER;
ALTER TABLE probes ADD COLUMN alpha REAL;
ALTER TABLE probes ADD COLUMN beta REAL;
ALTER TABLE probes ADD COLUMN out_dtype TEXT;
PRAGMA user_version = 2;
"""


def make_v2_store(path: Path) -> sqlite3.Connection:
    """An empty store of schema 2, in WAL mode as gemmd leaves one; the open connection."""
    db = sqlite3.connect(path)
    db.executescript(V2_SCHEMA)
    db.execute("PRAGMA journal_mode=WAL")
    return db


def test_a_schema_2_store_is_migrated_in_place_and_keeps_its_results(tmp_path):
    path = tmp_path / "gemmd.db"
    with closing(make_v2_store(path)) as db:
        db.execute("INSERT INTO probes (ts, source, kind, device_uuid, device_index, "
                   "device_name, backend, m, n, k, dtype, kernel, tile, layout, outcome, "
                   "runtime_s, pred_runtime_s, model_version, flagged, context, out_dtype) "
                   "VALUES (5.0, 'daemon', 'sentinel', 'GPU-a', 0, 'Fake GPU', 'fake', 1024, "
                   "1024, 1024, 'fp32', 'blas', 0, 'nn', 'ok', 1e-3, 9e-4, 'rf-1', 1, "
                   "'{\"x\": 1}', 'fp32')")
        db.execute("INSERT INTO models (created, kind, path, n_samples, data_hash, meta, "
                   "active) VALUES (1.0, 'random_forest', '/m/1', 40, 'h', '{}', 1)")
        db.commit()
    s = Store(path)
    try:
        assert s.schema_version == SCHEMA_VERSION >= 3
        assert s.journal_mode == "wal"
        (old,) = s.probes(include_flagged=True)
        assert (old["ts"], old["runtime_s"], old["pred_runtime_s"], old["flagged"],
                old["context"], old["out_dtype"]) == (5.0, 1e-3, 9e-4, 1, {"x": 1}, "fp32")
        # Intervals unknown for results stored before; read as NULL.
        assert all(old[c] is None for c in INTERVAL_COLUMNS)
        assert s.active_model()["version"] == 1
        assert s.events() == []
        # The migrated store takes events and intervals like a new one.
        s.add_event("alarm", device_uuid="GPU-a", target="runtime", detail={"ratio": 1.06})
        s.insert_probe(row(ts=6.0, pred_runtime_s=1e-3, pred_runtime_lo=8e-4,
                           pred_runtime_hi=1.2e-3))
        (hist_old, hist_new) = s.sentinel_history("GPU-a")
        assert hist_old["pred_runtime_lo"] is None
        assert (hist_new["pred_runtime_lo"], hist_new["pred_runtime_hi"]) == (8e-4, 1.2e-3)
    finally:
        s.close()
    # Opened again: nothing to migrate, everything still there.
    s = Store(path)
    try:
        assert len(s.probes(include_flagged=True)) == 2 and len(s.events()) == 1
    finally:
        s.close()


def test_events_are_recorded_and_read_by_time_device_and_kind(store):
    store.add_event("model", ts=1.0, detail={"version": "rf-1", "kind": "random_forest"})
    store.add_event("alarm", ts=2.0, device_uuid="GPU-a", target="runtime", probe=None,
                    detail={"scope": "pooled", "ratio": np.float64(1.06)})
    store.add_events([
        {"ts": 3.0, "device_uuid": "GPU-b", "kind": "alarm", "target": "power",
         "probe": "blas-fp32-nn-1024x1024x1024", "detail": {"scope": "probe"}},
        {"ts": 4.0, "device_uuid": "GPU-a", "kind": "clear", "target": "runtime",
         "detail": {"since": 2.0}}])
    assert [e["ts"] for e in store.events()] == [1.0, 2.0, 3.0, 4.0]
    a = store.events(kinds=("alarm",), uuids=["GPU-a"])
    assert len(a) == 1 and a[0]["detail"] == {"scope": "pooled", "ratio": 1.06}
    assert a[0]["probe"] is None and a[0]["target"] == "runtime"
    # A device's events include those of no one device (a model, every device).
    assert [e["kind"] for e in store.events(uuids=["GPU-a"])] == ["model", "alarm", "clear"]
    assert [e["ts"] for e in store.events(since=2.0, until=3.0)] == [2.0, 3.0]
    assert {e["device_uuid"]: e["ts"] for e in store.last_events("alarm")} == \
        {"GPU-a": 2.0, "GPU-b": 3.0}
    with pytest.raises(ValueError, match="not an event kind"):
        store.add_event("oops")
    assert len(store.events()) == 4  # nothing half-written


def test_unflag_records_the_rebaseline_with_the_results_it_unflagged(store):
    store.insert_probes([row(ts=1.0, flagged=True), row(ts=2.0, flagged=True),
                         row(ts=3.0, device_uuid="GPU-b", flagged=True), row(ts=4.0)])
    assert store.unflag(["GPU-a", "GPU-c"], event={"phase": "requested"}) == 2
    evs = store.events(kinds=("rebaseline",))
    assert [(e["device_uuid"], e["detail"]["unflagged"], e["detail"]["phase"])
            for e in evs] == [("GPU-a", 2, "requested"), ("GPU-c", 0, "requested")]
    assert evs[0]["detail"]["devices"] == ["GPU-a", "GPU-c"]
    assert store.unflag(event={"phase": "applied"}) == 1  # every device: GPU-b's one
    last = store.events(kinds=("rebaseline",))[-1]
    assert last["device_uuid"] is None and last["detail"] == {
        "phase": "applied", "devices": "all", "unflagged": 1}
    assert store.unflag() == 0 and len(store.events()) == 3  # no event asked, none written


def test_events_are_pruned_with_the_daemons_probes_and_bounded(store, monkeypatch):
    import gemmd.store.writes as store_mod

    now = 100 * 86400.0
    store.insert_probes([row(ts=now - 10 * 86400), row(ts=now)])
    store.add_events([{"ts": now - 10 * 86400, "kind": "model"},
                      *({"ts": now - i, "kind": "alarm", "device_uuid": "GPU-a",
                         "target": "runtime"} for i in range(5))])
    # An import's prune leaves the daemon's events alone.
    assert store.prune(retention_days=5, max_rows=None, now=now, sources=("imp",)) == 0
    assert len(store.events()) == 6
    assert store.prune(retention_days=5, max_rows=1000, now=now) == 1
    assert len(store.events()) == 5 and store.events(kinds=("model",)) == []
    monkeypatch.setattr(store_mod, "MAX_EVENTS", 3)
    store.prune(retention_days=None, max_rows=None, now=now)
    assert [e["ts"] for e in store.events()] == [now - 2, now - 1, now]  # the newest


def test_open_on_a_full_disk_names_the_disk_not_a_damaged_file(tmp_path, monkeypatch):
    """A full disk at start (no room for the -shm) said "not a SQLite database: disk I/O
    error" (issue 12 audit). RLIMIT_FSIZE makes the -shm fail as ENOSPC would; the disk's
    usage is faked to say it is full."""
    import collections
    import resource
    import shutil
    import signal

    Store(tmp_path / "gemmd.db").close()
    for p in tmp_path.glob("gemmd.db-*"):
        if p.name != "gemmd.db-seen":
            p.unlink()
    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(3 << 20, 3 << 20, 0))
    old = resource.getrlimit(resource.RLIMIT_FSIZE)
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, old[1]))
    try:
        with pytest.raises(StoreError) as e:
            Store(tmp_path / "gemmd.db")
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old)
        signal.signal(signal.SIGXFSZ, old_handler)
    msg = str(e.value)
    assert "not a SQLite database" not in msg and "disk I/O error" in msg
    assert f"0 B free of 3.0 MiB on the filesystem of {tmp_path} (full?)" in msg
    Store(tmp_path / "gemmd.db").close()  # space back: it opens, nothing lost


def test_a_store_on_a_read_only_filesystem_says_so(tmp_path, monkeypatch):
    """status on a read-only mount blamed the file's mode (bench/fuzz_faults.py mounts a
    real one; here os.access and statvfs answer as they do there)."""
    import os

    Store(tmp_path / "gemmd.db").close()
    real = os.statvfs

    class Ro:
        def __init__(self, st):
            self.f_flag = st.f_flag | os.ST_RDONLY

    monkeypatch.setattr(os, "access", lambda p, mode, **k: False)
    monkeypatch.setattr(os, "statvfs", lambda p: Ro(real(p)))
    with pytest.raises(StoreError, match="gemmd.db: on a read-only filesystem; gemmd must"):
        Store(tmp_path / "gemmd.db")


# ---------------------------------- issue 24: a second daemon, a deleted file, a clock

def test_one_daemon_per_state_directory(tmp_path):
    """Two daemons on one state directory both started and wrote rows for the same GPUs:
    the second is refused with the first one's pid; the lock goes with the first."""
    from gemmd.store.lock import LOCK_NAME, InstanceLock

    first = InstanceLock(tmp_path).acquire()
    try:
        with pytest.raises(StoreError) as e:
            InstanceLock(tmp_path).acquire()
        assert f"state_dir {tmp_path} is in use by another gemmd (pid {os.getpid()} on " \
               in str(e.value)
        assert "one daemon per state directory" in str(e.value)
    finally:
        first.release()
    InstanceLock(tmp_path).acquire().release()  # free again
    # A process that dies holding it leaves no stale lock (the kernel drops flocks).
    code = ("import sys, os; from gemmd.store import InstanceLock; "
            f"InstanceLock({str(tmp_path)!r}).acquire(); os._exit(0)")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO, timeout=60)
    InstanceLock(tmp_path).acquire().release()
    assert (tmp_path / LOCK_NAME).is_file()


def test_a_database_deleted_while_open_is_written_back(tmp_path, caplog):
    """`rm gemmd.db*` while the daemon ran: it went on writing into the deleted file and
    everything was gone at stop, without a word."""
    path = tmp_path / "gemmd.db"
    s = Store(path)
    try:
        s.insert_probes([row(ts=1000.0 + i) for i in range(5)])
        assert s.check_file() is None
        for p in tmp_path.glob("gemmd.db*"):
            p.unlink()
        caplog.set_level(logging.WARNING)
        problem = s.check_file()
        assert problem and "was deleted while gemmd runs: written back" in problem
        assert "5 probe results" in caplog.text
        s.insert_probes([row(ts=2000.0)])
        with closing(sqlite3.connect(path)) as db:  # another process sees all of it
            assert db.execute("SELECT COUNT(*) FROM probes").fetchone()[0] == 6
        assert s.check_file() is None
    finally:
        s.close()
    s = Store(path)
    try:
        assert len(s.probes(limit=100)) == 6
    finally:
        s.close()


def test_a_database_replaced_while_open_is_an_error_logged_once(tmp_path, caplog):
    path = tmp_path / "gemmd.db"
    s = Store(path)
    try:
        other = tmp_path / "other.db"
        Store(other).close()
        os.replace(other, path)
        caplog.set_level(logging.ERROR)
        for _ in range(3):
            assert "was replaced by another file" in s.check_file()
        assert caplog.text.count("was replaced by another file") == 1
    finally:
        s.close()


def test_retention_and_caps_do_not_follow_a_jumping_clock(tmp_path):
    """The clock went back: fresh probes carry older times, and max_rows deleted them
    first (it ordered by time). It went forward 100 days: retention deleted everything
    (the daemon now counts from its clock less the jumps it saw)."""
    from gemmd.clockwatch import ClockWatch

    s = Store(tmp_path / "gemmd.db")
    try:
        t = 1.7e9
        before = s.insert_probes([row(ts=t + i) for i in range(5)])
        after = s.insert_probes([row(ts=t - 86400 + i) for i in range(5)])  # clock back
        assert s.prune(None, 5, now=t) == 5
        assert sorted(r["id"] for r in s.probes(limit=100)) == sorted(after)
        cols, _ = s.training_columns(max_rows=2)
        assert sorted(cols["ts"]) == [t - 86400 + 3, t - 86400 + 4]  # the newest written
        assert before
        wall = [t + 100.0]
        watch = ClockWatch(wall=lambda: wall[0], mono=lambda: 100.0)
        wall[0] += 100 * 86400  # forward 100 days
        assert watch.check() == 100 * 86400 and watch.jumps == 1
        assert s.prune(90, None, now=watch.now()) == 0
        assert len(s.probes(limit=100)) == 5
        assert s.prune(90, None, now=wall[0]) == 5  # what the wall clock alone did
    finally:
        s.close()
