"""SQLite (WAL) history of probe results, devices and fitted models.

Each probe result is committed in its own transaction, so a killed daemon loses at most
the probe in flight. The schema is versioned with ``PRAGMA user_version`` and migrated
forward on open; a database from a newer gemmd is refused rather than guessed at.
"""

from __future__ import annotations

import json
import logging
import sqlite3
import threading
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from gemmd.errors import StoreError

logger = logging.getLogger(__name__)

PROBE_COLUMNS = (
    "ts", "source", "kind", "device_uuid", "device_index", "device_name", "backend",
    "m", "n", "k", "dtype", "kernel", "tile", "layout", "outcome", "iterations",
    "runtime_s", "runtime_mean_s", "runtime_min_s", "runtime_p90_s", "runtime_cv", "window_s",
    "energy_j", "power_w", "power_sample_w", "check_ok", "check_error",
    "pred_runtime_s", "pred_power_w", "pred_energy_j", "model_version", "flagged", "error",
    "context", "batch", "cta_m", "cta_n", "cta_k", "stages", "alpha", "beta", "out_dtype",
)

_V1 = """
CREATE TABLE probes (
    id INTEGER PRIMARY KEY,
    ts REAL NOT NULL,                 -- unix seconds at the end of the probe
    source TEXT NOT NULL,             -- 'daemon', or the name given to an import
    kind TEXT NOT NULL,               -- sentinel | exploration | import
    device_uuid TEXT NOT NULL,
    device_index INTEGER,
    device_name TEXT NOT NULL,
    backend TEXT NOT NULL,
    m INTEGER NOT NULL, n INTEGER NOT NULL, k INTEGER NOT NULL,
    dtype TEXT NOT NULL, kernel TEXT NOT NULL, tile INTEGER NOT NULL, layout TEXT NOT NULL,
    outcome TEXT NOT NULL,            -- ok | failed | mismatch
    iterations INTEGER,
    runtime_s REAL,                   -- median per-iteration seconds
    runtime_mean_s REAL, runtime_min_s REAL, runtime_p90_s REAL, runtime_cv REAL,
    window_s REAL,
    energy_j REAL,                    -- per GEMM
    power_w REAL,                     -- average over the window
    power_sample_w REAL,
    check_ok INTEGER, check_error REAL,
    pred_runtime_s REAL, pred_power_w REAL, pred_energy_j REAL, model_version TEXT,
    flagged INTEGER NOT NULL DEFAULT 0, -- taken while the device was flagged as drifting
    error TEXT,
    context TEXT                      -- JSON: clocks, temperature, throttle reasons...
);
CREATE INDEX probes_device_ts ON probes(device_uuid, ts);
CREATE INDEX probes_source_ts ON probes(source, ts);
CREATE TABLE devices (
    uuid TEXT PRIMARY KEY,
    idx INTEGER, name TEXT NOT NULL, backend TEXT NOT NULL,
    info TEXT NOT NULL, first_seen REAL NOT NULL, last_seen REAL NOT NULL
);
CREATE TABLE models (
    version INTEGER PRIMARY KEY AUTOINCREMENT,
    created REAL NOT NULL,
    kind TEXT NOT NULL,
    path TEXT NOT NULL,
    n_samples INTEGER NOT NULL,
    data_hash TEXT NOT NULL,
    meta TEXT NOT NULL,               -- JSON: features, targets, scores
    active INTEGER NOT NULL DEFAULT 0
);
"""

# Imported measurements carry configuration a daemon probe does not have (NULL = unknown:
# batch 1, no CTA tile, alpha 1, beta 0, output in the input dtype).
_V2 = """
ALTER TABLE probes ADD COLUMN batch INTEGER;
ALTER TABLE probes ADD COLUMN cta_m INTEGER;
ALTER TABLE probes ADD COLUMN cta_n INTEGER;
ALTER TABLE probes ADD COLUMN cta_k INTEGER;
ALTER TABLE probes ADD COLUMN stages INTEGER;
ALTER TABLE probes ADD COLUMN alpha REAL;
ALTER TABLE probes ADD COLUMN beta REAL;
ALTER TABLE probes ADD COLUMN out_dtype TEXT;
"""

# Index i holds the script that migrates from version i to i + 1.
MIGRATIONS: Sequence[str] = (_V1, _V2)
SCHEMA_VERSION = len(MIGRATIONS)


class Store:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._db = sqlite3.connect(str(self.path), check_same_thread=False,
                                       isolation_level=None, timeout=30.0)
            self._db.row_factory = sqlite3.Row
            self._check_version()
            mode = self._db.execute("PRAGMA journal_mode=WAL").fetchone()[0]
            if mode.lower() != "wal":
                logger.warning("store %s: journal mode is %s, not WAL", self.path, mode)
            # NORMAL in WAL mode survives a process crash; only power loss may drop the tail.
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.execute("PRAGMA foreign_keys=ON")
        except StoreError:
            self._db.close()
            raise
        except (sqlite3.Error, OSError) as e:
            raise StoreError(f"cannot open store {self.path}: {e}") from e
        self._lock = threading.RLock()
        self._migrate()

    # ------------------------------------------------------------- schema
    def _check_version(self) -> int:
        """Refuse a file that is not SQLite or is from a newer gemmd, before touching it."""
        try:
            version = self._db.execute("PRAGMA user_version").fetchone()[0]
        except sqlite3.DatabaseError as e:
            raise StoreError(f"store {self.path} is not a SQLite database: {e}") from e
        if version > SCHEMA_VERSION:
            raise StoreError(f"store {self.path} has schema version {version}, newer than this "
                             f"gemmd understands ({SCHEMA_VERSION}); upgrade gemmd")
        return version

    def _migrate(self) -> None:
        version = self._check_version()
        for v in range(version, SCHEMA_VERSION):
            logger.info("store %s: migrating schema %d -> %d", self.path, v, v + 1)
            with self._lock:
                try:
                    self._db.execute("BEGIN IMMEDIATE")
                    for stmt in MIGRATIONS[v].split(";"):
                        if stmt.strip():
                            self._db.execute(stmt)
                    self._db.execute(f"PRAGMA user_version={v + 1}")
                    self._db.execute("COMMIT")
                except sqlite3.Error as e:
                    self._db.execute("ROLLBACK")
                    raise StoreError(f"store {self.path}: migration to {v + 1} failed: "
                                     f"{e}") from e

    @property
    def schema_version(self) -> int:
        return self._db.execute("PRAGMA user_version").fetchone()[0]

    # ------------------------------------------------------------- writes
    def insert_probe(self, row: dict[str, Any]) -> int:
        return self.insert_probes([row])[0]

    def insert_probes(self, rows: Iterable[dict[str, Any]]) -> list[int]:
        """Insert rows in one transaction: all or nothing."""
        ids = []
        cols = ", ".join(PROBE_COLUMNS)
        marks = ", ".join("?" for _ in PROBE_COLUMNS)
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                for row in rows:
                    vals = [_encode(c, row.get(c)) for c in PROBE_COLUMNS]
                    cur = self._db.execute(f"INSERT INTO probes ({cols}) VALUES ({marks})", vals)
                    ids.append(cur.lastrowid)
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
        return ids

    def upsert_device(self, uuid: str, index: int | None, name: str, backend: str,
                      info: dict[str, Any]) -> None:
        now = time.time()
        with self._lock:
            self._db.execute(
                "INSERT INTO devices (uuid, idx, name, backend, info, first_seen, last_seen) "
                "VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT(uuid) DO UPDATE SET idx=excluded.idx, "
                "name=excluded.name, backend=excluded.backend, info=excluded.info, "
                "last_seen=excluded.last_seen",
                (uuid, index, name, backend, json.dumps(info, default=str), now, now))

    def add_model(self, kind: str, path: str, n_samples: int, data_hash: str,
                  meta: dict[str, Any], *, activate: bool) -> int:
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                if activate:
                    self._db.execute("UPDATE models SET active=0")
                cur = self._db.execute(
                    "INSERT INTO models (created, kind, path, n_samples, data_hash, meta, active)"
                    " VALUES (?, ?, ?, ?, ?, ?, ?)",
                    (time.time(), kind, path, n_samples, data_hash, json.dumps(meta),
                     int(activate)))
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
        return int(cur.lastrowid)

    def activate_model(self, version: int) -> None:
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            self._db.execute("UPDATE models SET active = (version = ?)", (version,))
            self._db.execute("COMMIT")

    def unflag(self, uuids: Sequence[str] | None = None) -> int:
        """Make results taken while drifting usable for training again (rebaseline)."""
        with self._lock:
            if uuids is None:
                return self._db.execute("UPDATE probes SET flagged = 0 WHERE flagged = 1"
                                        ).rowcount
            marks = ", ".join("?" for _ in uuids)
            return self._db.execute(f"UPDATE probes SET flagged = 0 WHERE flagged = 1 AND "
                                    f"device_uuid IN ({marks})", list(uuids)).rowcount

    def prune(self, retention_days: float, max_rows: int, now: float | None = None) -> int:
        """Delete probes older than the retention or beyond max_rows (oldest first)."""
        now = time.time() if now is None else now
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            n = self._db.execute("DELETE FROM probes WHERE ts < ?",
                                 (now - retention_days * 86400,)).rowcount
            n += self._db.execute(
                "DELETE FROM probes WHERE id IN (SELECT id FROM probes ORDER BY ts DESC "
                "LIMIT -1 OFFSET ?)", (max_rows,)).rowcount
            self._db.execute("COMMIT")
        return n

    # ------------------------------------------------------------- reads
    def _query(self, sql: str, args: Sequence[Any] = ()) -> list[dict[str, Any]]:
        with self._lock:
            rows = self._db.execute(sql, args).fetchall()
        return [_decode(dict(r)) for r in rows]

    def probes(self, *, sources: Sequence[str] | None = ("daemon",), device_uuid: str | None = None,
               outcome: str | None = "ok", include_flagged: bool = False,
               since: float | None = None, limit: int | None = None) -> list[dict[str, Any]]:
        where, args = [], []
        if sources is not None:
            where.append(f"source IN ({', '.join('?' for _ in sources)})")
            args.extend(sources)
        if device_uuid:
            where.append("device_uuid = ?")
            args.append(device_uuid)
        if outcome:
            where.append("outcome = ?")
            args.append(outcome)
        if not include_flagged:
            where.append("flagged = 0")
        if since is not None:
            where.append("ts >= ?")
            args.append(since)
        sql = "SELECT * FROM probes" + (" WHERE " + " AND ".join(where) if where else "")
        sql += " ORDER BY ts DESC, id DESC"
        if limit is not None:
            sql += f" LIMIT {int(limit)}"
        return self._query(sql, args)

    def latest_per_probe(self, source: str = "daemon") -> list[dict[str, Any]]:
        """The newest sentinel result of every (device, probe configuration)."""
        return self._query(
            "SELECT p.* FROM probes p JOIN (SELECT MAX(id) AS id FROM probes WHERE source = ? "
            "AND kind = 'sentinel' GROUP BY device_uuid, m, n, k, dtype, kernel, tile, layout) "
            "last ON p.id = last.id ORDER BY p.device_index, p.id", (source,))

    def counts(self) -> list[dict[str, Any]]:
        return self._query("SELECT source, device_uuid, device_name, outcome, COUNT(*) AS n, "
                           "MAX(ts) AS last FROM probes GROUP BY source, device_uuid, outcome "
                           "ORDER BY source, device_uuid, outcome")

    def devices(self) -> list[dict[str, Any]]:
        return self._query("SELECT * FROM devices ORDER BY idx, uuid")

    def models(self) -> list[dict[str, Any]]:
        return self._query("SELECT * FROM models ORDER BY version DESC")

    def active_model(self) -> dict[str, Any] | None:
        rows = self._query("SELECT * FROM models WHERE active = 1 ORDER BY version DESC LIMIT 1")
        return rows[0] if rows else None

    def close(self) -> None:
        with self._lock:
            try:
                self._db.close()
            except sqlite3.Error as e:  # closing must never take the shutdown path down
                logger.warning("store %s: close failed: %s", self.path, e)


def _encode(col: str, v: Any) -> Any:
    if col == "flagged":
        return int(bool(v))
    if col == "context" and v is not None and not isinstance(v, str):
        return json.dumps(v, default=str)
    if isinstance(v, bool):
        return int(v)
    return v


def _decode(row: dict[str, Any]) -> dict[str, Any]:
    for key in ("context", "info", "meta"):
        if isinstance(row.get(key), str):
            try:
                row[key] = json.loads(row[key])
            except ValueError:
                pass
    return row
