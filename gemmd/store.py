"""SQLite (WAL) history of probe results, devices, fitted models and events.

Events (the ``events`` table) are what happened to a device or the fleet: a drift alarm
raised or cleared (per target, pooled or one probe's), a rebaseline, a model activated, a
refit rejected. They are pruned with the daemon's probes.

Each probe result is committed in its own transaction, so a killed daemon loses at most
the probe in flight. The schema is versioned with ``PRAGMA user_version`` and migrated
forward on open; a database from a newer gemmd is refused rather than guessed at.

Opening checks the file (``PRAGMA quick_check``, every table and column present, writable)
and refuses a damaged one with a :class:`StoreError` naming the file and the problem. It
logs what it found (results per source, last probe time) and compares it with the
high-water mark kept beside the database (``gemmd.db-seen``), so results lost outside
gemmd (a ``-wal`` file deleted or damaged after a crash, an older copy restored) are
reported instead of passing silently.

A failed write (disk full, I/O error) rolls back cleanly and raises
:class:`StoreWriteError`; the first failure of an episode is logged once with what is full
and where, the recovery once with how many results were not written.
"""

from __future__ import annotations

import errno
import json
import logging
import math
import os
import shutil
import sqlite3
import stat
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from gemmd.errors import StoreError

logger = logging.getLogger(__name__)

T = TypeVar("T")

DAEMON_SOURCE = "daemon"

PROBE_COLUMNS = (
    "ts", "source", "kind", "device_uuid", "device_index", "device_name", "backend",
    "m", "n", "k", "dtype", "kernel", "tile", "layout", "outcome", "iterations",
    "runtime_s", "runtime_mean_s", "runtime_min_s", "runtime_p90_s", "runtime_cv", "window_s",
    "energy_j", "power_w", "power_sample_w", "check_ok", "check_error",
    "pred_runtime_s", "pred_power_w", "pred_energy_j", "model_version", "flagged", "error",
    "context", "batch", "cta_m", "cta_n", "cta_k", "stages", "alpha", "beta", "out_dtype",
    "pred_runtime_lo", "pred_runtime_hi", "pred_power_lo", "pred_power_hi", "pred_energy_lo",
    "pred_energy_hi",
)
# Each result's prediction interval (schema 3; NULL where the predictor gave none, and in
# results stored before).
INTERVAL_COLUMNS = PROBE_COLUMNS[-6:]

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

# Each result's prediction interval, and what happened to the fleet: drift alarms raised
# and cleared, rebaselines, models activated (a result's ``flagged`` says only that its GPU
# was in alarm, and a rebaseline unflags it; the events keep the history).
_V3 = """
ALTER TABLE probes ADD COLUMN pred_runtime_lo REAL;
ALTER TABLE probes ADD COLUMN pred_runtime_hi REAL;
ALTER TABLE probes ADD COLUMN pred_power_lo REAL;
ALTER TABLE probes ADD COLUMN pred_power_hi REAL;
ALTER TABLE probes ADD COLUMN pred_energy_lo REAL;
ALTER TABLE probes ADD COLUMN pred_energy_hi REAL;
CREATE TABLE events (
    id INTEGER PRIMARY KEY,
    ts REAL NOT NULL,                 -- unix seconds
    device_uuid TEXT,                 -- NULL: no one device (a model, every device)
    kind TEXT NOT NULL,               -- alarm | clear | rebaseline | model | refit_rejected
    target TEXT,                      -- runtime | power | energy (alarm, clear)
    probe TEXT,                       -- the probe's name, NULL: the device's probes pooled
    detail TEXT NOT NULL DEFAULT '{}' -- JSON: ratio, shift, phase, version, rows...
);
CREATE INDEX events_ts ON events(ts);
CREATE INDEX events_device_ts ON events(device_uuid, ts);
"""

# Index i holds the script that migrates from version i to i + 1.
MIGRATIONS: Sequence[str] = (_V1, _V2, _V3)
SCHEMA_VERSION = len(MIGRATIONS)

EVENT_COLUMNS = ("ts", "device_uuid", "kind", "target", "probe", "detail")

# What a store must hold to be usable (every migration applied).
REQUIRED_COLUMNS = {
    "probes": ("id", *PROBE_COLUMNS),
    "devices": ("uuid", "idx", "name", "backend", "info", "first_seen", "last_seen"),
    "models": ("version", "created", "kind", "path", "n_samples", "data_hash", "meta",
               "active"),
    "events": ("id", *EVENT_COLUMNS),
}

# What a report reads of a sentinel result (Store.sentinel_history; report/readonly.py),
# the interval columns aside (absent from a store of schema 2, read as NULL there).
SENTINEL_COLUMNS = ("id", "ts", "m", "n", "k", "dtype", "kernel", "tile", "layout", "outcome",
                    "runtime_s", "power_w", "energy_j", "pred_runtime_s", "pred_power_w",
                    "pred_energy_j", "model_version", "flagged", "context")
EVENT_KINDS = ("alarm", "clear", "rebaseline", "model", "refit_rejected")
# The newest events kept (besides store.retention_days): alarms are rare, but a bound is a
# bound.
MAX_EVENTS = 100_000
MIN_FREE_BYTES = 1 << 20  # an I/O error with less free than this names the full disk

# What a model fit reads from a probe row (no context, no prediction columns), and the
# configuration that makes two rows repeats of one another (features.CONFIG_KEYS + device).
TRAINING_TEXT = ("device_uuid", "dtype", "kernel", "layout", "out_dtype")
TRAINING_NUMERIC = ("ts", "m", "n", "k", "tile", "batch", "cta_m", "cta_n", "cta_k", "stages",
                    "alpha", "beta", "runtime_s", "power_w", "energy_j")
TRAINING_GROUP = ("device_uuid", "m", "n", "k", "dtype", "kernel", "tile", "layout", "batch",
                  "cta_m", "cta_n", "cta_k", "stages", "alpha", "beta", "out_dtype")
_CHUNK = 20_000  # rows fetched at a time when reading training data

# Writes that fail and recover over and over (a filesystem at the edge of full) log a
# "failing" and a "work again" line at most once per FLAP_S each, with the counts between.
FLAP_S = 300.0
_clock = time.time  # tests move it

_MOVE_ASIDE = ("to start a new history, stop gemmd and move {p} with its -wal and -shm "
               "aside (docs/runbook.md#gemmdstoreerrors)")


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


LOCK_NAME = "gemmd.lock"


class InstanceLock:
    """One daemon per state directory (as Prometheus's TSDB lock): an exclusive flock on
    ``state_dir/gemmd.lock`` while the daemon runs. Two daemons on one directory both
    wrote rows for the same GPUs (issue 24). The kernel drops the lock when the process
    ends however it ends (no stale lock after SIGKILL); the file says who holds it.
    One-shot commands (probe, import, status) take no lock: SQLite serializes them."""

    def __init__(self, state_dir: str | Path):
        self.path = Path(state_dir) / LOCK_NAME
        self._fd: int | None = None

    def acquire(self) -> InstanceLock:
        """Take the lock; StoreError naming the holder if another process has it. A
        directory that cannot be created or written is left for the store to explain."""
        import fcntl
        import socket

        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError:
            return self
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            try:
                holder = os.pread(fd, 512, 0).decode("utf-8", "replace").strip()
            except OSError:
                holder = ""
            os.close(fd)
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                logger.warning("state_dir %s: cannot lock %s (%s): make sure no other gemmd "
                               "runs on it", self.path.parent, self.path.name,
                               e.strerror or e)
                return self
            raise StoreError(f"state_dir {self.path.parent} is in use by another gemmd "
                             f"({holder or 'its lock file names no process'}): one daemon "
                             "per state directory; stop that one or give this one its own "
                             "state_dir") from None
        started = time.strftime("%Y-%m-%d %H:%M:%S %Z")
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}, started {started}\n"
                  .encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # the file stays: removing it would race a new daemon
            self._fd = None


class Store:
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
        self._identity = self._file_identity()
        self._file_problem: str | None = None  # the last one logged by check_file()

    # ------------------------------------------------------ the file, while open
    def _file_identity(self) -> tuple[int, int] | None:
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return st.st_dev, st.st_ino

    def check_file(self) -> str | None:
        """Whether the database file is still the one this store writes (the daemon asks
        every few seconds). Deleted (``rm gemmd.db*``): everything written went on into
        the deleted file and was lost at stop, without a word (issue 24); now the open
        database is copied back to its path and the store goes on there, with a warning.
        Replaced by another file: an error, logged once; this store keeps writing to the
        file it opened (a restart uses the new one). Returns the problem, or None."""
        with self._lock:
            now = self._file_identity()
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
            for suffix in ("-wal", "-shm"):  # the deleted database's, if left behind
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
        self._identity = self._file_identity()
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

    # ------------------------------------------------------------- writes
    def _rollback(self) -> None:
        """Roll back if a transaction is open: SQLite ends one itself on some errors
        (SQLITE_FULL, SQLITE_IOERR), and a second error must not hide the first."""
        if self.in_transaction:
            try:
                self._db.execute("ROLLBACK")
            except sqlite3.Error as e:
                logger.debug("store %s: rollback failed: %s", self.path, e)

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

    # ------------------------------------------------------------- reads
    def _query(self, sql: str, args: Sequence[Any] = ()) -> list[dict[str, Any]]:
        with self._lock:
            try:
                rows = self._db.execute(sql, args).fetchall()
            except sqlite3.Error as e:
                raise StoreError(f"store {self.path}: cannot read: {e}") from e
        return [_decode(dict(r)) for r in rows]

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
        if since is not None:
            where.append("ts >= ?")
            args.append(since)
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
        cols = ", ".join(TRAINING_TEXT + TRAINING_NUMERIC)
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
                        sql = f"SELECT {cols} FROM ({ranked}) WHERE rn <= {q} ORDER BY ts, id"
                    else:  # more configurations than max_rows: the newest ones, once each
                        sql = (f"SELECT {cols} FROM (SELECT * FROM ({ranked}) WHERE rn = 1 "
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

    def sources(self) -> list[dict[str, Any]]:
        """Rows per source: how many, on how many devices, first and last probe time."""
        return self._query("SELECT source, COUNT(*) AS rows, COUNT(DISTINCT device_uuid) AS "
                           "devices, MIN(ts) AS first, MAX(ts) AS last FROM probes GROUP BY "
                           "source ORDER BY source = 'daemon' DESC, source")

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


def sentinels_sql(uuid: str, since: float | None, until: float | None, source: str, *,
                  intervals: bool) -> tuple[str, tuple[Any, ...]]:
    """The query of a device's sentinel results (Store.sentinel_history, and the reports'
    read-only connection, which reads a store of schema 2 too: ``intervals`` False reads
    the interval columns as NULL)."""
    cols = list(SENTINEL_COLUMNS) + [c if intervals else f"NULL AS {c}"
                                     for c in INTERVAL_COLUMNS]
    where = ["source = ?", "kind = 'sentinel'", "device_uuid = ?"]
    args: list[Any] = [source, uuid]
    if since is not None:
        where.append("ts >= ?")
        args.append(since)
    if until is not None:
        where.append("ts <= ?")
        args.append(until)
    return (f"SELECT {', '.join(cols)} FROM probes WHERE {' AND '.join(where)} "
            "ORDER BY ts, id", tuple(args))


def events_sql(since: float | None, until: float | None, uuids: Sequence[str] | None,
               kinds: Sequence[str] | None) -> tuple[str, tuple[Any, ...]]:
    """The query of events (Store.events, and the reports' read-only connection)."""
    where: list[str] = []
    args: list[Any] = []
    if since is not None:
        where.append("ts >= ?")
        args.append(since)
    if until is not None:
        where.append("ts <= ?")
        args.append(until)
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


def _hms(ts: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(ts))


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


def _encode(col: str, v: Any) -> Any:
    if col == "flagged":
        return int(bool(v))
    if col == "context" and v is not None and not isinstance(v, str):
        return json.dumps(v, default=str)
    if isinstance(v, bool):
        return int(v)
    return v


def _decode(row: dict[str, Any]) -> dict[str, Any]:
    for key in ("context", "info", "meta", "detail"):
        if isinstance(row.get(key), str):
            try:
                row[key] = json.loads(row[key])
            except ValueError:
                pass
    return row
