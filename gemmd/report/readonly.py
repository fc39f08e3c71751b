"""Reads of the daemon's store and model files for the reports: read-only, never a write.

The reports open ``state_dir/gemmd.db`` with a read-only SQLite connection (``mode=ro``),
so an operator can report on a store the daemon owns (a systemd ``DynamicUser``'s
``/var/lib/gemmd``) without write access, and a report can never change it. Store's own
methods open the file for writing (schema migration, WAL mode), which is why the few
SELECTs the reports need are here.
"""

from __future__ import annotations

import dataclasses
import json
import sqlite3
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

from gemmd.errors import ModelError, StoreError
from gemmd.records import DeviceInfo
from gemmd.store import (
    INTERVAL_COLUMNS,
    REQUIRED_COLUMNS,
    SCHEMA_VERSION,
    events_sql,
    sentinels_sql,
)

DB_NAME = "gemmd.db"

# What a report needs of a store: schema 2 (a store the daemon has not yet migrated, which
# a read-only report cannot do) has no prediction intervals and no events; they are read
# where present.
MINIMUM_COLUMNS = {t: tuple(c for c in cols if c not in INTERVAL_COLUMNS)
                   for t, cols in REQUIRED_COLUMNS.items() if t != "events"}


def connect(db: Path) -> sqlite3.Connection:
    """A read-only connection to a gemmd store; StoreError (one line) if it is missing,
    not a store, or from a newer gemmd. A store of schema 2 is read as it is (see
    ``has_events``, ``sentinels``)."""
    if not db.is_file():
        raise StoreError(f"no store at {db} (run the daemon, or import data, first; see "
                         "state_dir)")
    try:
        con = sqlite3.connect(f"file:{quote(str(db.resolve()))}?mode=ro", uri=True,
                              timeout=10.0)
        con.row_factory = sqlite3.Row
        version = con.execute("PRAGMA user_version").fetchone()[0]
    except sqlite3.Error as e:
        raise StoreError(f"store {db}: cannot open read-only: {e}") from None
    if version > SCHEMA_VERSION:
        con.close()
        raise StoreError(f"store {db} has schema version {version}, newer than this gemmd "
                         f"understands ({SCHEMA_VERSION}); upgrade gemmd")
    for table, required in MINIMUM_COLUMNS.items():
        have = _columns(con, table)
        if missing := [c for c in required if c not in have]:
            con.close()
            raise StoreError(f"store {db}: table {table} lacks column(s) "
                             f"{', '.join(missing)} (schema version {version}; run the "
                             "daemon once to migrate it)")
    return con


def _columns(con: sqlite3.Connection, table: str) -> set[str]:
    return {r[1] for r in con.execute(f"PRAGMA table_info({table})")}


def schema_version(con: sqlite3.Connection) -> int:
    return int(con.execute("PRAGMA user_version").fetchone()[0])


def has_events(con: sqlite3.Connection) -> bool:
    """The store records events (schema 3 on): alarms, rebaselines, models."""
    return bool(_columns(con, "events"))


def query(con: sqlite3.Connection, db: Path, sql: str, args: tuple[Any, ...] = ()
          ) -> list[dict[str, Any]]:
    try:
        rows = con.execute(sql, args).fetchall()
    except sqlite3.Error as e:
        raise StoreError(f"store {db}: cannot read: {e}") from None
    out = []
    for r in rows:
        d = dict(r)
        for key in ("context", "info", "meta", "detail"):
            if isinstance(d.get(key), str):
                try:
                    d[key] = json.loads(d[key])
                except ValueError:
                    d[key] = {}
        out.append(d)
    return out


def devices(con: sqlite3.Connection, db: Path) -> list[dict[str, Any]]:
    return query(con, db, "SELECT uuid, idx, name, backend, info, first_seen, last_seen "
                          "FROM devices ORDER BY idx, uuid")


def device_info(rec: dict[str, Any]) -> DeviceInfo | None:
    info = rec.get("info")
    if not isinstance(info, dict):
        return None
    names = {f.name for f in dataclasses.fields(DeviceInfo)}
    try:
        return DeviceInfo(**{k: v for k, v in info.items() if k in names})
    except TypeError:
        return None


def models(con: sqlite3.Connection, db: Path) -> list[dict[str, Any]]:
    return query(con, db, "SELECT version, created, kind, path, n_samples, data_hash, meta, "
                          "active FROM models ORDER BY version DESC")


def sentinels(con: sqlite3.Connection, db: Path, uuid: str, since: float, until: float,
              source: str = "daemon") -> list[dict[str, Any]]:
    """A device's sentinel results (every outcome, flagged or not) in [since, until], as
    Store.sentinel_history reads them; the interval columns NULL in a store of schema 2."""
    intervals = set(INTERVAL_COLUMNS) <= _columns(con, "probes")
    return query(con, db, *sentinels_sql(uuid, since, until, source, intervals=intervals))


def events(con: sqlite3.Connection, db: Path, since: float | None, until: float | None,
           uuids: list[str] | None = None, kinds: tuple[str, ...] | None = None
           ) -> list[dict[str, Any]]:
    """Events as Store.events reads them (none in a store of schema 2)."""
    if not has_events(con):
        return []
    return query(con, db, *events_sql(since, until, uuids, kinds))


def last_probe(con: sqlite3.Connection, db: Path, source: str = "daemon") -> float | None:
    rows = query(con, db, "SELECT MAX(ts) AS ts FROM probes WHERE source = ? AND "
                          "kind = 'sentinel'", (source,))
    return rows[0]["ts"] if rows else None


@dataclass
class Deployed:
    """The state directory's active model, as the daemon would load it."""

    model: Any  # ForestModel
    version: str  # "rf-N", as the store's rows and the metrics name it
    record: dict[str, Any]


def load_model(rec: dict[str, Any]) -> Any:
    """A registered model's file, verified against its recorded checksum (ModelError)."""
    from gemmd.model import ForestModel

    meta = rec.get("meta") if isinstance(rec.get("meta"), dict) else {}
    sha = meta.get("sha256") if meta else None
    if not sha:
        raise ModelError(f"model file {rec['path']} has no recorded checksum in the store")
    model = ForestModel.load(rec["path"], sha)
    model.version = f"rf-{rec['version']}"
    return model


def deployed_model(state_dir: Path) -> tuple[Deployed | None, str]:
    """(the active model of ``state_dir``'s store, or None; a sentence saying which, or
    why there is none). A missing store is not an error here: there is nothing deployed."""
    db = Path(state_dir) / DB_NAME
    if not db.is_file():
        return None, f"no store in {state_dir}: no deployed model to judge"
    con = connect(db)
    try:
        recs = models(con, db)
    finally:
        con.close()
    active = [r for r in recs if r["active"]]
    if not active:
        return None, (f"no fitted model in {db} yet (the daemon predicts with the roofline "
                      "estimate): no deployed model to judge")
    rec = active[0]
    try:
        model = load_model(rec)
    except ModelError as e:
        return None, f"the deployed model rf-{rec['version']} cannot be loaded: {e}"
    return Deployed(model, model.version, rec), ""
