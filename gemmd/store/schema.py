"""The store's schema: its tables and columns, the migrations that build them (one per
schema version, applied forward on open), and the column sets the store's reads select.

Events (the ``events`` table) are what happened to a device or the fleet: a drift alarm
raised or cleared (per target, pooled or one probe's), a rebaseline, a model activated, a
refit rejected. They are pruned with the daemon's probes.

The schema is versioned with ``PRAGMA user_version`` and migrated forward on open; a
database from a newer gemmd is refused rather than guessed at.
"""

from __future__ import annotations

from collections.abc import Sequence

from gemmd.gemm import DAEMON_SOURCE as DAEMON_SOURCE  # (its home: the GEMM vocabulary)

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

# What a model fit reads from a probe row (no context, no prediction columns), and the
# configuration that makes two rows repeats of one another (features.CONFIG_KEYS + device).
TRAINING_TEXT = ("device_uuid", "dtype", "kernel", "layout", "out_dtype", "measured_by")
TRAINING_NUMERIC = ("ts", "m", "n", "k", "tile", "batch", "cta_m", "cta_n", "cta_k", "stages",
                    "alpha", "beta", "runtime_s", "power_w", "energy_j")
# Whose measurement a stored row is (features.row_sources), as SQL and in Python
# (measured_by): the daemon's own probes "daemon"; an import's rows what the imported file
# said (its source column, else its format's: kept as "measured_by" in the row's
# context by gemmd.importer), else unknown (''). The store's source of an import is the
# name it was given (kept apart from the daemon's probes); a gemmd export imported as
# "host1" was still measured by a daemon.
MEASURED_BY_SQL = ("CASE WHEN kind != 'import' THEN source WHEN json_valid(context) THEN "
                   "COALESCE(json_extract(context, '$.measured_by'), '') ELSE '' END")
TRAINING_SQL = {"measured_by": f"{MEASURED_BY_SQL} AS measured_by"}


def measured_by(row: dict) -> str:
    """MEASURED_BY_SQL of a store row read as a dict (its context decoded)."""
    if row.get("kind") != "import":
        return str(row.get("source") or "")
    ctx = row.get("context")
    return str(ctx.get("measured_by") or "") if isinstance(ctx, dict) else ""


TRAINING_GROUP = ("device_uuid", "m", "n", "k", "dtype", "kernel", "tile", "layout", "batch",
                  "cta_m", "cta_n", "cta_k", "stages", "alpha", "beta", "out_dtype")
