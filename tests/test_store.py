"""The SQLite store (gemmd/store.py), on real database files in tmp_path."""

import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from gemmd.errors import StoreError
from gemmd.store import SCHEMA_VERSION, Store

REPO = Path(__file__).resolve().parent.parent


def row(**over):
    r = {"ts": 1000.0, "source": "daemon", "kind": "sentinel", "device_uuid": "GPU-a",
         "device_index": 0, "device_name": "Fake GPU", "backend": "fake", "m": 1024, "n": 1024,
         "k": 1024, "dtype": "fp32", "kernel": "blas", "tile": 0, "layout": "nn",
         "outcome": "ok", "iterations": 10, "runtime_s": 1e-3, "context": {"sm_clock_hz": 1e9}}
    r.update(over)
    return r


def test_open_sets_wal_and_schema_version(store):
    assert store._db.execute("PRAGMA journal_mode").fetchone()[0].lower() == "wal"
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
    store.insert_probes([row(ts=float(t)) for t in (5, 1, 4, 2, 3)])
    assert store.prune(retention_days=1000, max_rows=2, now=10.0) == 3
    assert [r["ts"] for r in store.probes()] == [5.0, 4.0]
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
    s = Store(path)
    try:
        rows = s.probes()
        assert [(r["ts"], r["runtime_s"]) for r in rows] == [(42.0, 0.5)]
    finally:
        s.close()
