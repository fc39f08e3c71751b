"""Bring external measurements into the store as a named source, all rows or none.

Imported rows are kept apart from the daemon's own probes (source "daemon"): the daemon's
refits never see them; `gemmd fit/evaluate --source NAME` uses them when asked. Each GPU
of the data becomes a store device from the datasheet table (uuid ``ref-<key>``).
"""

from __future__ import annotations

import dataclasses
import math
import re
import time
from typing import Any

import numpy as np

from gemmd.datasets import Dataset
from gemmd.errors import InputError
from gemmd.features import row_sources
from gemmd.store import DAEMON_SOURCE, Store

# A source's name (an import's --name, predict's --source)
SOURCE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
SOURCE_NAME_RULE = "1-64 letters, digits, '.', '_' or '-', starting with a letter or digit"


def check_source_name(name: str) -> str:
    if name == DAEMON_SOURCE:
        raise InputError("source name 'daemon' is reserved for the daemon's own probes; "
                         "give another --name")
    if not SOURCE_NAME.fullmatch(name):
        raise InputError(f"source name {name!r} must be {SOURCE_NAME_RULE}")
    return name


def existing_rows(store: Store, source: str) -> int:
    return sum(c["n"] for c in store.counts() if c["source"] == source)


def rows_of(ds: Dataset, source: str, now: float | None = None) -> list[dict[str, Any]]:
    """Store rows (PROBE_COLUMNS) for every row of the dataset."""
    t = ds.table
    now = time.time() if now is None else now
    ts = t.cols.get("ts")
    devs = t.devices
    c = t.cols
    src = row_sources(t)  # whose measurements: kept for the model (store.measured_by)
    out = []
    for i in range(len(t)):
        d = devs[int(t.device[i])]
        out.append({
            "ts": float(ts[i]) if ts is not None and np.isfinite(ts[i]) else now,
            "source": source, "kind": "import", "device_uuid": d.uuid, "device_index": None,
            "device_name": d.name, "backend": d.backend,
            "m": int(c["m"][i]), "n": int(c["n"][i]), "k": int(c["k"][i]),
            "dtype": str(c["dtype"][i]), "kernel": str(c["kernel"][i]),
            "tile": int(c["tile"][i]), "layout": str(c["layout"][i]), "outcome": "ok",
            "runtime_s": _opt(c["runtime_s"][i]), "power_w": _opt(c["power_w"][i]),
            "energy_j": _opt(c["energy_j"][i]), "flagged": False,
            "batch": int(c["batch"][i]), "cta_m": _opt_int(c["cta_m"][i]),
            "cta_n": _opt_int(c["cta_n"][i]), "cta_k": _opt_int(c["cta_k"][i]),
            "stages": _opt_int(c["stages"][i]), "alpha": float(c["alpha"][i]),
            "beta": float(c["beta"][i]), "out_dtype": str(c["out_dtype"][i]) or None,
            "context": {"measured_by": str(src[i])} if src[i] else None,
        })
    return out


def _opt(v: float) -> float | None:
    return None if math.isnan(v) else float(v)


def _opt_int(v: float) -> int | None:
    return int(v) if v > 0 else None


def import_dataset(store: Store, ds: Dataset, source: str) -> int:
    """Insert every row of ``ds`` under ``source`` in one transaction; returns the count.

    A source that already holds rows is refused (importing twice would double-count).
    """
    check_source_name(source)
    n = existing_rows(store, source)
    if n:
        raise InputError(f"source {source!r} already holds {n:,} rows; import under another "
                         "--name")
    rows = rows_of(ds, source)
    for d in ds.table.devices:
        store.upsert_device(d.uuid, None, d.name, d.backend, dataclasses.asdict(d))
    store.insert_probes(rows)
    return len(rows)
