"""Rebaseline: accept devices' current behaviour as their new normal.

The protocol in one place. ``gemmd rebaseline`` (another process, maybe while the daemon
runs) unflags the stored results taken while drifting and leaves a request file in the
state directory; the daemon applies the request (drift references reset) within seconds,
or at its next start, and removes the file. Both steps are recorded in the store as
``rebaseline`` events (phase requested, then applied; per device, with how many results
were unflagged), written with the unflagging, and the alarms the rebaseline ended as
``clear`` events: the history survives the unflagging.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

from gemmd.state import State
from gemmd.store import Store

logger = logging.getLogger(__name__)

REQUEST = "rebaseline.request"


def request(state_dir: Path, store: Store, uuids: list[str] | None) -> int:
    """Unflag the stored results of ``uuids`` (None: every device) and ask the daemon to
    reset their drift references; returns how many stored results were unflagged."""
    n = store.unflag(uuids, event={"phase": "requested"})
    path = state_dir / REQUEST
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"devices": uuids, "ts": time.time()}))
    os.replace(tmp, path)
    return n


def apply_request(state_dir: Path, state: State, store: Store) -> bool:
    """Apply a pending request (drift references reset, stored results unflagged); True if
    there was one. An unreadable request is logged and dropped."""
    path = state_dir / REQUEST
    if not path.exists():
        return False
    try:
        uuids = json.loads(path.read_text()).get("devices")
    except (OSError, ValueError, AttributeError) as e:
        logger.error("ignoring unreadable %s: %s", path, e)
        path.unlink(missing_ok=True)
        return False
    with state.lock:
        for uuid in uuids if uuids is not None else [None]:
            state.drift.rebaseline(uuid)
        cleared = state.drift.drain()  # the alarms it ended (and any not yet recorded)
    store.unflag(uuids, event={"phase": "applied"})
    path.unlink(missing_ok=True)
    from gemmd.rounds import save_events, transition_event  # the daemon's side only

    save_events(store, state, [transition_event(t) for t in cleared])
    logger.warning("rebaseline of %s: drift references reset; results taken while "
                   "drifting now count for training", ", ".join(uuids or ["all devices"]))
    return True
