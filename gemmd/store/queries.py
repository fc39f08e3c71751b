"""The Store: its reads (probes, training columns, sentinels, events, models), on top of
its writes (writes.py) and its file (file.py), and the queries the reports' read-only
connection shares with it.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Sequence
from typing import Any

import numpy as np

from gemmd.errors import StoreError
from gemmd.store.schema import (
    DAEMON_SOURCE,
    EVENT_COLUMNS,
    INTERVAL_COLUMNS,
    SENTINEL_COLUMNS,
    TRAINING_GROUP,
    TRAINING_NUMERIC,
    TRAINING_SQL,
    TRAINING_TEXT,
)
from gemmd.store.writes import StoreWrites

_CHUNK = 20_000  # rows fetched at a time when reading training data


class Store(StoreWrites):
    """gemmd's SQLite (WAL) history of probe results, devices, fitted models and events."""

    # ------------------------------------------------------------- reads
    def probes(self, *, sources: Sequence[str] | None = ("daemon",), device_uuid: str | None = None,
               outcome: str | None = "ok", include_flagged: bool = False,
               since: float | None = None, limit: int | None = None) -> list[dict[str, Any]]:
        where: list[str] = []
        args: list[Any] = []
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
        _time_range(where, args, since, None)
        sql = "SELECT * FROM probes" + (" WHERE " + " AND ".join(where) if where else "")
        sql += " ORDER BY ts DESC, id DESC"
        if limit is not None:
            sql += f" LIMIT {int(limit)}"
        return self._query(sql, args)

    def training_columns(self, sources: Sequence[str] = (DAEMON_SOURCE,),
                         max_rows: int | None = None) -> tuple[dict[str, np.ndarray], int]:
        """Usable results (outcome ok, not flagged) of ``sources`` as columns, oldest first,
        reading only what a fit needs (TRAINING_TEXT, TRAINING_NUMERIC), in chunks.

        Returns (columns, rows matching). Beyond ``max_rows`` matching rows, each
        configuration (TRAINING_GROUP) keeps its newest ``q`` repeats, with ``q`` the
        largest quota that fits: every configuration stays (a single exploration probe as
        much as a sentinel), the most repeated ones lose their oldest repeats. Numbers
        are NaN where NULL; text is None where NULL.
        """
        marks = ", ".join("?" for _ in sources)
        where = f"source IN ({marks}) AND outcome = 'ok' AND flagged = 0"
        args = list(sources)
        names = TRAINING_TEXT + TRAINING_NUMERIC
        cols = ", ".join(TRAINING_SQL.get(c, c) for c in names)  # from probes
        plain = ", ".join(names)  # from a query of those
        with self._lock:
            try:
                total = self._db.execute(f"SELECT COUNT(*) FROM probes WHERE {where}",
                                         args).fetchone()[0]
                if max_rows is None or total <= max_rows:
                    sql = f"SELECT {cols} FROM probes WHERE {where} ORDER BY ts, id"
                else:
                    group = ", ".join(TRAINING_GROUP)
                    counts = np.fromiter(
                        (r[0] for r in self._db.execute(
                            f"SELECT COUNT(*) FROM probes WHERE {where} GROUP BY {group}", args)),
                        dtype=np.int64)
                    q = _quota(counts, max_rows)
                    # Newest by insertion (id), not by the wall clock: after the clock
                    # went back, fresh probes carry older times (issue 24).
                    ranked = (f"SELECT {cols}, id, ROW_NUMBER() OVER (PARTITION BY {group} "
                              f"ORDER BY id DESC) AS rn FROM probes WHERE {where}")
                    if q >= 1:
                        sql = f"SELECT {plain} FROM ({ranked}) WHERE rn <= {q} ORDER BY ts, id"
                    else:  # more configurations than max_rows: the newest ones, once each
                        sql = (f"SELECT {plain} FROM (SELECT * FROM ({ranked}) WHERE rn = 1 "
                               f"ORDER BY id DESC LIMIT {int(max_rows)}) ORDER BY ts, id")
                return _read_columns(self._db, sql, args), total
            except sqlite3.Error as e:
                raise StoreError(f"store {self.path}: cannot read training data: {e}") from e

    def latest_per_probe(self, source: str = "daemon") -> list[dict[str, Any]]:
        """The newest sentinel result of every (device, probe configuration)."""
        return self._query(
            "SELECT p.* FROM probes p JOIN (SELECT MAX(id) AS id FROM probes WHERE source = ? "
            "AND kind = 'sentinel' GROUP BY device_uuid, m, n, k, dtype, kernel, tile, layout) "
            "last ON p.id = last.id ORDER BY p.device_index, p.id", (source,))

    def sentinel_history(self, uuid: str, since: float | None = None,
                         until: float | None = None, source: str = DAEMON_SOURCE
                         ) -> list[dict[str, Any]]:
        """A device's sentinel results in [since, until] (every outcome, flagged or not),
        oldest first: SENTINEL_COLUMNS and INTERVAL_COLUMNS."""
        return self._query(*sentinels_sql(uuid, since, until, source, intervals=True))

    def events(self, since: float | None = None, until: float | None = None,
               uuids: Sequence[str] | None = None, kinds: Sequence[str] | None = None
               ) -> list[dict[str, Any]]:
        """Events in [since, until], oldest first, ``detail`` decoded. ``uuids``: those
        of these devices and those of no one device (a model, a rebaseline of every
        device); ``kinds``: of these kinds only."""
        return self._query(*events_sql(since, until, uuids, kinds))

    def last_events(self, kind: str) -> list[dict[str, Any]]:
        """The newest event of ``kind`` per device (device_uuid None: of no one device)."""
        return self._query("SELECT e.* FROM events e JOIN (SELECT MAX(id) AS id FROM events "
                           "WHERE kind = ? GROUP BY device_uuid) last ON e.id = last.id "
                           "ORDER BY e.device_uuid", (kind,))

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


def _time_range(where: list[str], args: list[Any], since: float | None,
                until: float | None) -> None:
    """Add ``since <= ts <= until`` (either end may be None: open) to a query's clauses."""
    if since is not None:
        where.append("ts >= ?")
        args.append(since)
    if until is not None:
        where.append("ts <= ?")
        args.append(until)


def sentinels_sql(uuid: str, since: float | None, until: float | None, source: str, *,
                  intervals: bool) -> tuple[str, tuple[Any, ...]]:
    """The query of a device's sentinel results (Store.sentinel_history, and the reports'
    read-only connection, which reads a store of schema 2 too: ``intervals`` False reads
    the interval columns as NULL)."""
    cols = list(SENTINEL_COLUMNS) + [c if intervals else f"NULL AS {c}"
                                     for c in INTERVAL_COLUMNS]
    where = ["source = ?", "kind = 'sentinel'", "device_uuid = ?"]
    args: list[Any] = [source, uuid]
    _time_range(where, args, since, until)
    return (f"SELECT {', '.join(cols)} FROM probes WHERE {' AND '.join(where)} "
            "ORDER BY ts, id", tuple(args))


def events_sql(since: float | None, until: float | None, uuids: Sequence[str] | None,
               kinds: Sequence[str] | None) -> tuple[str, tuple[Any, ...]]:
    """The query of events (Store.events, and the reports' read-only connection)."""
    where: list[str] = []
    args: list[Any] = []
    _time_range(where, args, since, until)
    if uuids is not None:
        where.append(f"(device_uuid IS NULL OR device_uuid IN "
                     f"({', '.join('?' for _ in uuids)}))")
        args.extend(uuids)
    if kinds is not None:
        where.append(f"kind IN ({', '.join('?' for _ in kinds)})")
        args.extend(kinds)
    return ("SELECT id, " + ", ".join(EVENT_COLUMNS) + " FROM events"
            + (" WHERE " + " AND ".join(where) if where else "") + " ORDER BY ts, id",
            tuple(args))


def _quota(counts: np.ndarray, cap: int) -> int:
    """The largest q with sum(min(counts, q)) <= cap (0 if even q = 1 is too many)."""
    lo, hi = 0, int(counts.max()) if len(counts) else 0
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if int(np.minimum(counts, mid).sum()) <= cap:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _read_columns(db: sqlite3.Connection, sql: str, args: Sequence[Any]
                  ) -> dict[str, np.ndarray]:
    """Run ``sql`` (selecting TRAINING_TEXT then TRAINING_NUMERIC) into numpy columns,
    ``_CHUNK`` rows at a time: no per-row dicts, one string object per distinct value."""
    names = TRAINING_TEXT + TRAINING_NUMERIC
    parts: dict[str, list[np.ndarray]] = {c: [] for c in names}
    interned: dict[str, str] = {}
    cur = db.cursor()
    cur.row_factory = None
    cur.execute(sql, args)
    while chunk := cur.fetchmany(_CHUNK):
        for c, values in zip(names, zip(*chunk)):
            if c in TRAINING_TEXT:
                parts[c].append(np.array([v if v is None else interned.setdefault(v, v)
                                          for v in values], dtype=object))
            else:
                parts[c].append(np.array(values, dtype=np.float64))
        del chunk
    cur.close()
    return {c: np.concatenate(p) if p else
            np.zeros(0, dtype=object if c in TRAINING_TEXT else np.float64)
            for c, p in parts.items()}
