"""The store's writes: each in one transaction, failures rolled back and logged per episode.

Each probe result is committed in its own transaction, so a killed daemon loses at most
the probe in flight.

A failed write (disk full, I/O error) rolls back cleanly and raises
:class:`StoreWriteError`; the first failure of an episode is logged once with what is full
and where, the recovery once with how many results were not written.
"""

from __future__ import annotations

import json
import logging
import sqlite3
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, TypeVar

import numpy as np

from gemmd.errors import StoreError
from gemmd.store.file import StoreFile
from gemmd.store.schema import DAEMON_SOURCE, EVENT_KINDS, PROBE_COLUMNS

# The store's log lines keep the logger name they had as one module (tests filter on it).
logger = logging.getLogger("gemmd.store")

T = TypeVar("T")

# The newest events kept (besides store.retention_days): alarms are rare, but a bound is a
# bound.
MAX_EVENTS = 100_000

# Writes that fail and recover over and over (a filesystem at the edge of full) log a
# "failing" and a "work again" line at most once per FLAP_S each, with the counts between.
FLAP_S = 300.0
_clock = time.time  # tests move it


class StoreWriteError(StoreError):
    """A write failed for a storage reason (disk full, I/O error, read-only, locked).

    The transaction was rolled back and the store stays usable. ``reported`` is True when
    the store has already logged the episode this failure belongs to (callers count the
    failure and need not log it again).
    """

    def __init__(self, message: str, *, reported: bool, full: bool):
        super().__init__(message)
        self.reported = reported
        self.full = full


class StoreWrites(StoreFile):
    """The store file with its writes (Store adds the reads)."""

    def _write(self, what: str, fn: Callable[[sqlite3.Connection], T], rows: int = 0) -> T:
        """Run ``fn`` in one transaction: all or nothing.

        A storage failure (disk full, I/O error, read-only, locked) becomes a
        StoreWriteError and is logged once per episode. Errors in the data itself
        (a constraint, a bad value) are raised as they are: they are bugs, not weather.
        """
        with self._lock:
            try:
                self._db.execute("BEGIN IMMEDIATE")
                try:
                    out = fn(self._db)
                    self._db.execute("COMMIT")
                except BaseException:
                    self._rollback()
                    raise
            except (sqlite3.IntegrityError, sqlite3.ProgrammingError,
                    sqlite3.InterfaceError):
                raise
            except sqlite3.Error as e:
                raise self._write_failed(what, e, rows) from e
            self._write_ok()
            self._mark_seen()
        return out

    def _write_failed(self, what: str, e: sqlite3.Error, rows: int) -> StoreWriteError:
        """Count a failed write; log when writes start failing (once per episode, and at
        most once per FLAP_S while they fail and recover over and over)."""
        name = getattr(e, "sqlite_errorname", "") or type(e).__name__
        full = name.startswith("SQLITE_FULL") or "is full" in str(e)
        detail = f"{e}{self._space(e, always=full)}"
        now = _clock()
        if not self._failed_writes:
            self._failing_since = now
        changed = self._failing is not None and self._failing != name
        self._failing = name
        self.rows_not_written += rows
        self._episode_rows += rows
        self._failed_writes += 1
        if changed or (not self._reported_failing and now - self._last_fail_line >= FLAP_S):
            earlier = (f" ({self._failed_writes - 1} write(s) failed intermittently since "
                       f"{_hms(self._failing_since)})" if self._failed_writes > 1 else "")
            logger.error("store %s: writes failing (%s): %s%s; results stay in memory "
                         "(metrics) and are counted in gemmd_store_errors_total until writes "
                         "work again", self.path, what, detail, earlier)
            self._reported_failing, self._last_fail_line = True, now
        else:
            logger.debug("store %s: %s failed: %s", self.path, what, detail)
        return StoreWriteError(f"store {self.path}: {what} failed: {detail}", reported=True,
                               full=full)

    def _write_ok(self) -> None:
        self._failing = None
        if not self._reported_failing:
            return  # nothing failed, or failures not reported yet (counted for the next line)
        now = _clock()
        if now - self._last_ok_line < FLAP_S:
            return  # flapping: said on a later success
        logger.warning("store %s: writes work again after %.0f s: %d write(s) failed, %d "
                       "probe result(s) were not written", self.path,
                       now - self._failing_since, self._failed_writes, self._episode_rows)
        self._reported_failing, self._last_ok_line = False, now
        self._failed_writes, self._episode_rows = 0, 0

    @property
    def failing(self) -> bool:
        """True while writes fail (between the episode's first failure and a success)."""
        return self._failing is not None

    def insert_probe(self, row: dict[str, Any]) -> int:
        return self.insert_probes([row])[0]

    def insert_probes(self, rows: Iterable[dict[str, Any]]) -> list[int]:
        """Insert rows in one transaction: all or nothing."""
        rows = list(rows)
        cols = ", ".join(PROBE_COLUMNS)
        marks = ", ".join("?" for _ in PROBE_COLUMNS)

        def insert(db: sqlite3.Connection) -> list[int]:
            ids = []
            for row in rows:
                vals = [_encode(c, row.get(c)) for c in PROBE_COLUMNS]
                ids.append(int(db.execute(f"INSERT INTO probes ({cols}) VALUES ({marks})",
                                          vals).lastrowid or 0))
            return ids

        return self._write("insert probe results", insert, rows=len(rows))

    def upsert_device(self, uuid: str, index: int | None, name: str, backend: str,
                      info: dict[str, Any]) -> None:
        now = time.time()
        self._write("record device", lambda db: db.execute(
            "INSERT INTO devices (uuid, idx, name, backend, info, first_seen, last_seen) "
            "VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT(uuid) DO UPDATE SET idx=excluded.idx, "
            "name=excluded.name, backend=excluded.backend, info=excluded.info, "
            "last_seen=excluded.last_seen",
            (uuid, index, name, backend, json.dumps(info, default=str), now, now)))

    def add_model(self, kind: str, path: str, n_samples: int, data_hash: str,
                  meta: dict[str, Any], *, activate: bool) -> int:
        def add(db: sqlite3.Connection) -> int:
            if activate:
                db.execute("UPDATE models SET active=0")
            return int(db.execute(  # type: ignore[arg-type]  # lastrowid after an INSERT
                "INSERT INTO models (created, kind, path, n_samples, data_hash, meta, active)"
                " VALUES (?, ?, ?, ?, ?, ?, ?)",
                (time.time(), kind, path, n_samples, data_hash, json.dumps(meta),
                 int(activate))).lastrowid)

        return self._write("record model", add)

    def activate_model(self, version: int) -> None:
        self._write("activate model", lambda db: db.execute(
            "UPDATE models SET active = (version = ?)", (version,)))

    def unflag(self, uuids: Sequence[str] | None = None, *,
               event: Mapping[str, Any] | None = None) -> int:
        """Make results taken while drifting usable for training again (rebaseline).

        ``event``: the rebaseline's detail (its phase...), recorded in the same
        transaction as a ``rebaseline`` event per device (one of no device when ``uuids``
        is None: every device) with how many of its results were unflagged."""
        now = time.time()

        def unflag(db: sqlite3.Connection) -> int:
            if uuids is None:
                n = db.execute("UPDATE probes SET flagged = 0 WHERE flagged = 1").rowcount
                if event is not None:
                    _insert_events(db, [{"ts": now, "kind": "rebaseline", "detail": {
                        **event, "devices": "all", "unflagged": n}}])
                return n
            total = 0
            for u in dict.fromkeys(uuids):
                n = db.execute("UPDATE probes SET flagged = 0 WHERE flagged = 1 AND "
                               "device_uuid = ?", (u,)).rowcount
                total += n
                if event is not None:
                    _insert_events(db, [{"ts": now, "device_uuid": u, "kind": "rebaseline",
                                         "detail": {**event, "devices": list(uuids),
                                                    "unflagged": n}}])
            return total

        return self._write("unflag", unflag)

    def add_event(self, kind: str, *, device_uuid: str | None = None,
                  target: str | None = None, probe: str | None = None,
                  detail: Mapping[str, Any] | None = None, ts: float | None = None) -> int:
        """Record one event (EVENT_KINDS): what happened to a device or the fleet."""
        return self.add_events([{"ts": ts, "device_uuid": device_uuid, "kind": kind,
                                 "target": target, "probe": probe, "detail": detail}])[0]

    def add_events(self, events: Iterable[Mapping[str, Any]]) -> list[int]:
        """Record events (dicts of EVENT_COLUMNS; ``ts`` defaults to now, ``detail`` is
        JSON-encoded) in one transaction: all or nothing."""
        rows = list(events)
        return self._write("record events", lambda db: _insert_events(db, rows))

    def prune(self, retention_days: float | None, max_rows: int | None,
              now: float | None = None, sources: Sequence[str] = (DAEMON_SOURCE,)) -> int:
        """Delete probes of ``sources`` older than the retention or beyond ``max_rows``
        (the first written first: insertion order does not move with the clock), each
        source on its own; other sources are never touched. ``now``: the time retention
        counts from (the daemon passes its clock corrected for jumps it saw).

        The daemon prunes its own probes only: imported measurements are the user's data,
        removed only when asked (``gemmd prune --source NAME``). None: no limit.
        """
        now = time.time() if now is None else now

        def prune(db: sqlite3.Connection) -> int:
            n = 0
            for source in sources:
                if retention_days is not None:
                    n += db.execute("DELETE FROM probes WHERE source = ? AND ts < ?",
                                    (source, now - retention_days * 86400)).rowcount
                if max_rows is not None:
                    n += db.execute(
                        "DELETE FROM probes WHERE id IN (SELECT id FROM probes WHERE source = ? "
                        "ORDER BY id DESC LIMIT -1 OFFSET ?)",
                        (source, int(max_rows))).rowcount
            if DAEMON_SOURCE in sources:  # the daemon's events go with its probes
                if retention_days is not None:
                    db.execute("DELETE FROM events WHERE ts < ?",
                               (now - retention_days * 86400,))
                db.execute("DELETE FROM events WHERE id IN (SELECT id FROM events ORDER BY "
                           "ts DESC, id DESC LIMIT -1 OFFSET ?)", (MAX_EVENTS,))
            return n

        return self._write("prune", prune)

    def delete_source(self, source: str) -> int:
        """Delete every probe of one source (e.g. an import, before importing it again)."""
        return self._write("delete source", lambda db: db.execute(
            "DELETE FROM probes WHERE source = ?", (source,)).rowcount)


def _insert_events(db: sqlite3.Connection, rows: Sequence[Mapping[str, Any]]) -> list[int]:
    now = time.time()
    ids = []
    for r in rows:
        if r.get("kind") not in EVENT_KINDS:
            raise ValueError(f"not an event kind: {r.get('kind')!r}")
        ts = r.get("ts")
        ids.append(int(db.execute(  # type: ignore[arg-type]  # lastrowid after an INSERT
            "INSERT INTO events (ts, device_uuid, kind, target, probe, detail) "
            "VALUES (?, ?, ?, ?, ?, ?)",
            (now if ts is None else float(ts), r.get("device_uuid"), r["kind"],
             r.get("target"), r.get("probe"),
             json.dumps(dict(r.get("detail") or {}), default=_json_default))).lastrowid))
    return ids


def _json_default(v: Any) -> Any:
    """numpy scalars as numbers; anything else as text."""
    if isinstance(v, np.generic):
        return v.item()
    return str(v)


def _hms(ts: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(ts))


def _encode(col: str, v: Any) -> Any:
    if col == "flagged":
        return int(bool(v))
    if col == "context" and v is not None and not isinstance(v, str):
        return json.dumps(v, default=str)
    if isinstance(v, bool):
        return int(v)
    return v
