"""SQLite (WAL) history of probe results, devices, fitted models and events.

The store in layers: ``schema`` (tables, columns, migrations), ``file`` (the database file
opened, checked, migrated and watched), ``writes`` (each write in one transaction, failures
logged per episode), ``queries`` (the reads, and the :class:`Store` they complete), and
``lock`` (one daemon per state directory).
"""

from gemmd.store.file import SIDECARS
from gemmd.store.lock import InstanceLock
from gemmd.store.queries import Store, events_sql, sentinels_sql
from gemmd.store.schema import (
    DAEMON_SOURCE,
    INTERVAL_COLUMNS,
    REQUIRED_COLUMNS,
    SCHEMA_VERSION,
    measured_by,
)

__all__ = ["DAEMON_SOURCE", "INTERVAL_COLUMNS", "REQUIRED_COLUMNS", "SCHEMA_VERSION",
           "SIDECARS", "InstanceLock", "Store", "events_sql", "measured_by", "sentinels_sql"]
