"""What the daemon and `gemmd probe` share: the parts of a probe round, built from a
configuration in one place (state directory and store, live state with the configured
drift monitor, model registry, devices and their runners)."""

from __future__ import annotations

import dataclasses
import os
import stat
import threading
from dataclasses import dataclass
from pathlib import Path

from gemmd.config import Config
from gemmd.devices import Device, open_devices
from gemmd.drift import DriftMonitor
from gemmd.errors import GemmdError
from gemmd.registry import ModelRegistry
from gemmd.rounds import DeviceRunner
from gemmd.state import State
from gemmd.store import Store


def open_state_dir(cfg: Config, state_dir: Path | None = None) -> tuple[Path, Store]:
    """The state directory (created if needed, checked writable) and its store."""
    state_dir = state_dir or cfg.resolved_state_dir()
    try:
        state_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise GemmdError(f"state_dir {state_dir}: cannot create: {e.strerror}") from e
    if not os.access(state_dir, os.W_OK):
        try:
            read_only = bool(os.statvfs(state_dir).f_flag & os.ST_RDONLY)
            st = state_dir.stat()
        except OSError:
            read_only, st = False, None
        if read_only:
            raise GemmdError(f"state_dir {state_dir}: on a read-only filesystem (gemmd "
                             "writes its store there; see state_dir, StateDirectory=)")
        who = f"uid {os.geteuid()}" + (f" (directory mode {stat.filemode(st.st_mode)}, owner "
                                       f"uid {st.st_uid})" if st else "")
        raise GemmdError(f"state_dir {state_dir}: not writable by {who}")
    return state_dir, Store(state_dir / "gemmd.db")


@dataclass
class Runtime:
    cfg: Config
    state_dir: Path
    store: Store
    state: State
    registry: ModelRegistry
    devices: list[Device]
    runners: list[DeviceRunner]
    cancel: threading.Event

    def close_devices(self) -> list[tuple[Device, Exception]]:
        """Close every device; the ones that failed to, with their error."""
        failed = []
        for d in self.devices:
            try:
                d.close()
            except Exception as e:  # a broken device must not keep the others open
                failed.append((d, e))
        return failed


def build(cfg: Config, *, devices: list[Device] | None = None, state_dir: Path | None = None,
          budget_s: float | None = None) -> Runtime:
    """Everything a probe round needs. ``devices``: already opened (tests); ``state_dir``:
    instead of the configured one (gemmd probe --no-store); ``budget_s``: probe seconds a
    round may spend (default: the duty-cycle budget)."""
    state_dir, store = open_state_dir(cfg, state_dir)
    try:
        state = State(DriftMonitor(cfg.drift, state_dir / "drift.json"))
        state.probe_interval_s = cfg.schedule.probe_interval_s
        registry = ModelRegistry(store, state_dir / "models", cfg.model, state)
        devices = devices if devices is not None else open_devices(cfg)
        if not devices:
            raise GemmdError("no devices to probe (check 'devices' and 'backend')")
        cancel = threading.Event()
        runners = []
        for d in devices:
            store.upsert_device(d.info.uuid, d.info.index, d.info.name, d.info.backend,
                                dataclasses.asdict(d.info))
            runners.append(DeviceRunner(d, cfg, store, state, registry, cancel,
                                        budget_s=budget_s))
    except BaseException:
        store.close()
        raise
    return Runtime(cfg, state_dir, store, state, registry, devices, runners, cancel)
