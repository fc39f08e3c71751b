"""The store's database file: opened, checked, migrated and watched while open.

Opening checks the file (``PRAGMA quick_check``, every table and column present, writable)
and refuses a damaged one with a :class:`StoreError` naming the file and the problem. It
logs what it found (results per source, last probe time) and compares it with the
high-water mark kept beside the database (``gemmd.db-seen``), so results lost outside
gemmd (a ``-wal`` file deleted or damaged after a crash, an older copy restored) are
reported instead of passing silently.

:class:`StoreFile` is the lowest layer of the Store (writes.py writes on it, queries.py
reads): the connection, its lock, the rollback, and the one read that opening needs.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import sqlite3
import stat
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from gemmd.errors import StoreError
from gemmd.files import file_identity
from gemmd.store.schema import MIGRATIONS, REQUIRED_COLUMNS, SCHEMA_VERSION

# The store's log lines keep the logger name they had as one module (tests filter on it).
logger = logging.getLogger("gemmd.store")
# The files SQLite keeps beside the database in WAL mode (its name plus these).
SIDECARS = ("-wal", "-shm")

MIN_FREE_BYTES = 1 << 20  # an I/O error with less free than this names the full disk

_MOVE_ASIDE = ("to start a new history, stop gemmd and move {p} with its -wal and -shm "
               "aside (docs/runbook.md#gemmdstoreerrors)")


class StoreFile:
    """An open store file: checked, migrated, and watched (Store adds writes and reads)."""

    def __init__(self, path: str | Path, *, check: bool = True):
        """Open (creating if needed), check, migrate and describe the store at ``path``.

        ``check``: run ``PRAGMA quick_check`` (reads every page once; about 1 s per GB).
        """
        self.path = Path(path)
        self._lock = threading.RLock()
        self._failing: str | None = None  # error name while writes fail, else None
        self._reported_failing = False  # the last line logged said "writes failing"
        self._last_fail_line = self._last_ok_line = -math.inf
        self._failing_since = 0.0  # first failure since the last "work again" line
        self._failed_writes = 0  # since the last "work again" line
        self._episode_rows = 0  # probe results not written since the last "work again" line
        self.rows_not_written = 0  # since open
        self._max_pages: int | None = None  # SQLite's page limit before limit_size()
        self._seen_path = self.path.with_name(self.path.name + "-seen")
        existed = self.path.exists()
        size = self.path.stat().st_size if existed else 0
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._check_writable(existed)
            self._db = sqlite3.connect(str(self.path), check_same_thread=False,
                                       isolation_level=None, timeout=30.0)
        except StoreError:
            raise
        except (sqlite3.Error, OSError) as e:
            raise StoreError(f"cannot open store {self.path}: {e}") from e
        try:
            self._db.row_factory = sqlite3.Row
            version = self._check_version()
            tables = self._tables()
            if version == 0 and tables:
                raise StoreError(f"store {self.path} is a SQLite database but not gemmd's "
                                 f"(schema version 0, tables {', '.join(sorted(tables))})")
            if existed and version == 0:
                self._warn_empty(size)
            if check and version:
                self._quick_check()
            mode = self._db.execute("PRAGMA journal_mode=WAL").fetchone()[0]
            if mode.lower() != "wal":
                logger.warning("store %s: journal mode is %s, not WAL", self.path, mode)
            # NORMAL in WAL mode survives a process crash; only power loss may drop the tail.
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.execute("PRAGMA foreign_keys=ON")
            self._migrate()
            self._check_schema()
            if check:
                self._describe()
        except BaseException as e:
            self._db.close()
            if isinstance(e, sqlite3.Error):
                raise StoreError(f"cannot open store {self.path}: {e}{self._space(e)}") from e
            raise
        self._identity = file_identity(self.path)
        self._file_problem: str | None = None  # the last one logged by check_file()

    # ------------------------------------------------------ the file, while open
    def check_file(self) -> str | None:
        """Whether the database file is still the one this store writes (the daemon asks
        every few seconds). Deleted (``rm gemmd.db*``): everything written went on into
        the deleted file and was lost at stop, without a word (issue 24); now the open
        database is copied back to its path and the store goes on there, with a warning.
        Replaced by another file: an error, logged once; this store keeps writing to the
        file it opened (a restart uses the new one). Returns the problem, or None."""
        with self._lock:
            now = file_identity(self.path)
            if now == self._identity:
                self._file_problem = None
                return None
            if now is None:
                return self._restore_file()
            problem = (f"store {self.path} was replaced by another file while gemmd runs: "
                       "gemmd goes on writing to the file it opened, which is no longer "
                       "there and is lost when gemmd stops; restart gemmd to use the new "
                       "file, or put the old one back")
            if problem != self._file_problem:
                logger.error("%s", problem)
                self._file_problem = problem
            return problem

    def _restore_file(self) -> str | None:
        """The database file was deleted: write the open database back to its path (the
        SQLite backup API reads it through this connection), then use that file."""
        tmp = self.path.with_name(f".{self.path.name}.restore-{os.getpid()}")
        try:
            tmp.unlink(missing_ok=True)
            copy = sqlite3.connect(str(tmp))
            try:
                self._db.backup(copy)
            finally:
                copy.close()
            for suffix in SIDECARS:  # the deleted database's, if left behind
                self.path.with_name(self.path.name + suffix).unlink(missing_ok=True)
            os.replace(tmp, self.path)
            db = sqlite3.connect(str(self.path), check_same_thread=False,
                                 isolation_level=None, timeout=30.0)
            db.row_factory = sqlite3.Row
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=NORMAL")
            db.execute("PRAGMA foreign_keys=ON")
        except (sqlite3.Error, OSError) as e:
            tmp.unlink(missing_ok=True)
            problem = (f"store {self.path} was deleted while gemmd runs and cannot be written "
                       f"back ({e}): results are kept only until gemmd stops")
            if problem != self._file_problem:
                logger.error("%s", problem)
                self._file_problem = problem
            return problem
        old, self._db = self._db, db
        try:
            old.close()
        except sqlite3.Error:
            pass
        self._identity = file_identity(self.path)
        rows = self._db.execute("SELECT COUNT(*) FROM probes").fetchone()[0]
        problem = (f"store {self.path} was deleted while gemmd runs: written back from the "
                   f"open database ({rows:,} probe results); gemmd goes on storing there")
        logger.warning("%s", problem)
        self._file_problem = None
        return problem

    # ------------------------------------------------------------- checks on open
    def _check_writable(self, existed: bool) -> None:
        """gemmd writes the database and creates its -wal and -shm beside it."""
        for p in ([self.path] if existed else []) + [self.path.parent]:
            if not os.access(p, os.W_OK):
                if os.statvfs(p).f_flag & os.ST_RDONLY:
                    raise StoreError(f"store {self.path}: on a read-only filesystem; gemmd "
                                     "must be able to write it (see state_dir)")
                st = p.stat()
                what = "file" if p == self.path else "directory"
                raise StoreError(f"store {self.path}: {what} {p} is not writable by uid "
                                 f"{os.geteuid()} (mode {stat.filemode(st.st_mode)}, owner uid "
                                 f"{st.st_uid}; or a read-only filesystem or immutable file); "
                                 "gemmd must be able to write it")

    def _check_version(self) -> int:
        """Refuse a file that is not SQLite or is from a newer gemmd, before touching it."""
        try:
            version = self._db.execute("PRAGMA user_version").fetchone()[0]
        except sqlite3.DatabaseError as e:
            if getattr(e, "sqlite_errorname", "SQLITE_NOTADB") != "SQLITE_NOTADB":
                # An I/O error (a full disk: no room for the -shm) is not a damaged file.
                raise StoreError(f"cannot read store {self.path}: {e}{self._space(e)}") from e
            raise StoreError(f"store {self.path} is not a SQLite database: {e}") from e
        if version > SCHEMA_VERSION:
            raise StoreError(f"store {self.path} has schema version {version}, newer than this "
                             f"gemmd understands ({SCHEMA_VERSION}); upgrade gemmd")
        return version

    def _tables(self) -> set[str]:
        try:
            return {r[0] for r in self._db.execute(
                "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE "
                "'sqlite_%'")}
        except sqlite3.DatabaseError as e:
            raise StoreError(f"store {self.path} is damaged: {e}; "
                             + _MOVE_ASIDE.format(p=self.path)) from e

    def _warn_empty(self, size: int) -> None:
        """An existing file without gemmd's schema: a new store, unless data was lost."""
        if size == 0:
            logger.warning("store %s is an empty (0-byte) file: starting a new, empty history; "
                           "if it held probe results before, they are lost", self.path)
        else:
            logger.warning("store %s holds no schema although gemmd created it (%d bytes): its "
                           "-wal file, which held everything written so far, is missing or "
                           "damaged; starting a new, empty history", self.path, size)

    def _quick_check(self) -> None:
        try:
            problems = [r[0] for r in self._db.execute("PRAGMA quick_check(5)")]
        except sqlite3.DatabaseError as e:
            problems = [str(e)]
        if problems != ["ok"]:
            first = " ".join(problems[0].split())
            more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
            raise StoreError(f"store {self.path} is damaged: integrity check: {first}{more}; "
                             + _MOVE_ASIDE.format(p=self.path))

    def _check_schema(self) -> None:
        for table, required in REQUIRED_COLUMNS.items():
            have = set(self.columns(table))
            if not have:
                problem = f"table {table} is missing"
            elif missing := [c for c in required if c not in have]:
                problem = f"table {table} lacks column(s) {', '.join(missing)}"
            else:
                continue
            raise StoreError(f"store {self.path}: schema is broken: {problem} (schema version "
                             f"{self.schema_version}); " + _MOVE_ASIDE.format(p=self.path))

    def _describe(self) -> None:
        """Log what the store holds, and results written earlier that are no longer there."""
        summary = self.sources()
        total = sum(s["rows"] for s in summary)
        if summary:
            now = time.time()
            parts = [f"{s['source']} {s['rows']:,} (last {_when(s['last'], now)})"
                     for s in summary]
            logger.info("store %s: %d probe results: %s", self.path, total, "; ".join(parts))
        else:
            logger.info("store %s: no probe results yet", self.path)
        seen = self._read_seen()
        if not seen:
            return
        last_id, last_ts = self._high_water()
        if seen.get("max_id", 0) > last_id:
            logger.warning(
                "store %s ends at result #%d%s, but results up to #%d (last probe %s) were "
                "written to it: %d probe results are missing (its -wal file deleted or "
                "damaged after a crash, or an older copy restored? keep gemmd.db-wal with "
                "gemmd.db)", self.path, last_id,
                f" (last probe {_when(last_ts)})" if last_id else "", seen["max_id"],
                _when(seen.get("max_ts")), seen["max_id"] - last_id)

    def _high_water(self) -> tuple[int, float | None]:
        row = self._db.execute("SELECT id, ts FROM probes ORDER BY id DESC LIMIT 1").fetchone()
        return (row[0], row[1]) if row else (0, None)

    def _read_seen(self) -> dict[str, Any] | None:
        try:
            seen = json.loads(self._seen_path.read_text())
            return seen if isinstance(seen, dict) and isinstance(seen.get("max_id"), int) \
                else None
        except (OSError, ValueError):
            return None

    def _mark_seen(self) -> None:
        """Record the newest result id beside the database (after every write)."""
        try:
            max_id, max_ts = self._high_water()
            tmp = self._seen_path.with_name(self._seen_path.name + ".tmp")
            try:
                tmp.write_text(json.dumps({"max_id": max_id, "max_ts": max_ts,
                                           "written": time.time()}))
                os.replace(tmp, self._seen_path)
            except OSError:
                tmp.unlink(missing_ok=True)
                raise
        except (OSError, sqlite3.Error) as e:  # a full disk: the store reports that itself
            logger.debug("store %s: cannot record the high-water mark: %s", self.path, e)

    # ------------------------------------------------------------- schema
    def _migrate(self) -> None:
        version = self._check_version()
        if version == 0:  # a new store: one line, not one per migration
            logger.info("store %s: created (schema %d)", self.path, SCHEMA_VERSION)
        elif version < SCHEMA_VERSION:
            logger.info("store %s: migrating schema %d -> %d", self.path, version,
                        SCHEMA_VERSION)
        for v in range(version, SCHEMA_VERSION):
            logger.debug("store %s: migration %d -> %d", self.path, v, v + 1)
            with self._lock:
                try:
                    self._db.execute("BEGIN IMMEDIATE")
                    for stmt in MIGRATIONS[v].split(";"):
                        if stmt.strip():
                            self._db.execute(stmt)
                    self._db.execute(f"PRAGMA user_version={v + 1}")
                    self._db.execute("COMMIT")
                except sqlite3.Error as e:
                    self._rollback()
                    raise StoreError(f"store {self.path}: migration to {v + 1} failed: "
                                     f"{e}") from e

    @property
    def schema_version(self) -> int:
        return self._db.execute("PRAGMA user_version").fetchone()[0]

    def columns(self, table: str) -> list[str]:
        """The columns ``table`` has in this file, in order (none: no such table)."""
        if table not in REQUIRED_COLUMNS:
            raise ValueError(f"not a table of gemmd's store: {table!r}")
        with self._lock:
            return [r[1] for r in self._db.execute(f"PRAGMA table_info({table})")]

    @property
    def journal_mode(self) -> str:
        """SQLite's journal mode for this store: "wal" unless the filesystem refused it."""
        with self._lock:
            return str(self._db.execute("PRAGMA journal_mode").fetchone()[0]).lower()

    # ------------------------------------------------------------- size
    @property
    def size_bytes(self) -> int:
        """The database's size: its pages, the ones still in the -wal file included."""
        with self._lock:
            pages = self._db.execute("PRAGMA page_count").fetchone()[0]
            return int(pages) * int(self._db.execute("PRAGMA page_size").fetchone()[0])

    def limit_size(self, max_bytes: int | None) -> int:
        """Let the database grow to ``max_bytes`` at most (never below its size now; None:
        no limit): a write that needs more fails as on a full disk (StoreWriteError with
        ``full``). Returns the limit now in force, in bytes."""
        with self._lock:
            if self._max_pages is None:  # SQLite's default, for None
                self._max_pages = int(self._db.execute("PRAGMA max_page_count").fetchone()[0])
            page = int(self._db.execute("PRAGMA page_size").fetchone()[0])
            pages = self._max_pages if max_bytes is None else max(1, int(max_bytes) // page)
            got = self._db.execute(f"PRAGMA max_page_count={pages}").fetchone()[0]
            return int(got) * page

    def trace(self, callback: Callable[[str], object] | None) -> None:
        """Call ``callback`` with the text of every SQL statement this store runs from now
        on (None: stop). For debugging: what a read or write actually asks of SQLite."""
        with self._lock:
            self._db.set_trace_callback(callback)

    @property
    def in_transaction(self) -> bool:
        """True while a transaction is open: only inside a write, never between calls."""
        return self._db.in_transaction

    # ------------------------------------------ transactions (the writes: writes.py)
    def _rollback(self) -> None:
        """Roll back if a transaction is open: SQLite ends one itself on some errors
        (SQLITE_FULL, SQLITE_IOERR), and a second error must not hide the first."""
        if self.in_transaction:
            try:
                self._db.execute("ROLLBACK")
            except sqlite3.Error as e:
                logger.debug("store %s: rollback failed: %s", self.path, e)

    def _space(self, e: BaseException, always: bool = False) -> str:
        """': 0 B free of 3 MiB on the filesystem of DIR' where a full disk may be the cause
        of ``e`` (SQLITE_FULL, or an I/O error with under MIN_FREE_BYTES left), else ''."""
        try:
            du = shutil.disk_usage(self.path.parent)
        except OSError:
            return ""
        io = getattr(e, "sqlite_errorname", "").startswith(("SQLITE_IOERR", "SQLITE_CANTOPEN"))
        if always or (io and du.free < MIN_FREE_BYTES):
            return (f": {_size(du.free)} free of {_size(du.total)} on the filesystem of "
                    f"{self.path.parent}" + ("" if always else " (full?)"))
        return ""

    # ------------------------------------------------ reads (the rest: queries.py)
    def _query(self, sql: str, args: Sequence[Any] = ()) -> list[dict[str, Any]]:
        with self._lock:
            try:
                rows = self._db.execute(sql, args).fetchall()
            except sqlite3.Error as e:
                raise StoreError(f"store {self.path}: cannot read: {e}") from e
        return [_decode(dict(r)) for r in rows]

    def sources(self) -> list[dict[str, Any]]:
        """Rows per source: how many, on how many devices, first and last probe time."""
        return self._query("SELECT source, COUNT(*) AS rows, COUNT(DISTINCT device_uuid) AS "
                           "devices, MIN(ts) AS first, MAX(ts) AS last FROM probes GROUP BY "
                           "source ORDER BY source = 'daemon' DESC, source")

    def close(self) -> None:
        with self._lock:
            try:
                self._db.close()
            except sqlite3.Error as e:  # closing must never take the shutdown path down
                logger.warning("store %s: close failed: %s", self.path, e)


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _when(ts: float | None, now: float | None = None) -> str:
    """A probe time for a log line: ISO date and time, and how long ago."""
    if ts is None:
        return "never"
    now = time.time() if now is None else now
    age = max(0.0, now - ts)
    for unit, f in (("d", 86400), ("h", 3600), ("min", 60)):
        if age >= f:
            ago = f"{age / f:.0f} {unit}"
            break
    else:
        ago = f"{age:.0f} s"
    return f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(ts))}, {ago} ago"


def _decode(row: dict[str, Any]) -> dict[str, Any]:
    for key in ("context", "info", "meta", "detail"):
        if isinstance(row.get(key), str):
            try:
                row[key] = json.loads(row[key])
            except ValueError:
                pass
    return row
