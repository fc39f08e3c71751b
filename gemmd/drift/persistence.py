"""Drift state across restarts: the JSON file a monitor saves and loads (version 3;
versions 1 and 2 still load), and copies of its tracks for readers."""

from __future__ import annotations

import json
import logging
import os
import tempfile
from collections.abc import Mapping
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

import numpy as np

from gemmd.drift.causes import CTX_NORMAL, CTX_RECENT
from gemmd.drift.params import NOISE_N
from gemmd.drift.series import _phi
from gemmd.drift.tracks import DeviceDrift, DeviceTrack, Track
from gemmd.errors import naming
from gemmd.gemm import ProbeSpec

logger = logging.getLogger(__name__)


class Persistence:
    """What a DriftMonitor keeps across restarts (its tracks, devices, the model its
    references were taken under, and the warm starts pending), saved to ``path``."""

    path: Path | None
    model_version: str | None
    tracks: dict[tuple[str, ProbeSpec, str], Track]
    devices: dict[str, DeviceDrift]
    _warm: dict[str, dict[str, dict[ProbeSpec, tuple[list[float], float, int]]]]

    def save(self) -> None:
        if self.path is None:
            return
        data = {"version": 3, "model_version": self.model_version, "tracks": [
            {"uuid": u, "spec": asdict(s), "target": t, **asdict(tr)}
            for (u, s, t), tr in self.tracks.items()],
            "devices": [{"uuid": u, **asdict(d)} for u, d in self.devices.items()],
            # Baselines just completed whose pooled statistic has not started yet: a
            # restart between the two would otherwise take a second baseline.
            "warm": [{"uuid": u, "target": t, "spec": asdict(s), "values": v, "floor": f,
                      "cut": c}
                     for u, by in self._warm.items() for t, w in by.items()
                     for s, (v, f, c) in w.items()]}
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".drift-", suffix=".json")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(data, f)
            os.replace(tmp, self.path)
        except OSError as e:
            Path(tmp).unlink(missing_ok=True)
            raise naming(e, self.path) from None
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def _load(self, path: Path) -> None:
        try:
            data = json.loads(path.read_text())
            self.model_version = data.get("model_version")
            version = data.get("version", 1)
            for rec in data["tracks"]:
                key = (rec.pop("uuid"), ProbeSpec(**rec.pop("spec")), rec.pop("target"))
                self.tracks[key] = _v1_track(rec) if version < 2 else _make(Track, rec)
            for rec in data.get("devices", []):
                self.devices[rec["uuid"]] = DeviceDrift(
                    gpu_model=str(rec.get("gpu_model") or ""),
                    targets={t: _device_track(d, version)
                             for t, d in (rec.get("targets") or {}).items()},
                    contexts=_contexts(rec.get("contexts")))
            for rec in data.get("warm", []):
                self._warm.setdefault(rec["uuid"], {}).setdefault(rec["target"], {})[
                    ProbeSpec(**rec["spec"])] = ([float(x) for x in rec["values"]],
                                                 float(rec["floor"]), int(rec.get("cut", 0)))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            # A damaged state file must not stop the daemon: start over, loudly.
            logger.error("drift state %s unreadable (%s): references will be re-established",
                         path, e)
            self.tracks, self.devices, self._warm = {}, {}, {}

    def snapshot(self) -> dict[tuple[str, ProbeSpec, str], Track]:
        return {k: Track(**asdict(v)) for k, v in self.tracks.items()}

    def device_snapshot(self) -> dict[str, DeviceDrift]:
        return {u: DeviceDrift(d.gpu_model, {t: DeviceTrack(**asdict(x))
                                             for t, x in d.targets.items()})
                for u, d in self.devices.items()}


def _make(cls: type, rec: Mapping[str, Any]) -> Any:
    """A dataclass from a saved record; keys it does not know (a newer file) are ignored."""
    names = {f.name for f in fields(cls)}
    out = {k: v for k, v in rec.items() if k in names}
    if out.get("noise") is not None:  # a series' kept noise model: numbers, or unreadable
        out["noise"] = {str(k): float(v) for k, v in dict(out["noise"]).items()}
    return cls(**out)


def _device_track(rec: Mapping[str, Any], version: int) -> DeviceTrack:
    """A device's pooled track as saved; before version 3 its ``drifting`` was the pooled
    CUSUM's alarm, which is now the device's (raised by that CUSUM: a step)."""
    ds = _make(DeviceTrack, rec)
    if version < 3:
        ds.fast, ds.fast_since, ds.fast_alarms = ds.drifting, ds.since, ds.alarms
        ds.reason = "step" if ds.drifting else ""
    return ds


def _contexts(rec: Any) -> dict[str, dict[str, list[list[Any]]]]:
    if not isinstance(rec, dict):
        return {}
    return {str(p): {"normal": list(c.get("normal") or [])[:CTX_NORMAL],
                     "recent": list(c.get("recent") or [])[-CTX_RECENT:]}
            for p, c in rec.items() if isinstance(c, dict)}


def _v1_track(rec: Mapping[str, Any]) -> Track:
    """A track saved by gemmd before version 2 (reference, var, cov, prev, n): its
    reference and noise as the starting point, its alarm state as it was."""
    tr = Track(baseline=list(rec.get("baseline") or []), cusum=float(rec.get("cusum", 0.0)),
               drifting=bool(rec.get("drifting")), since=rec.get("since"),
               alarms=int(rec.get("alarms", 0)), h=rec.get("h"), last_z=rec.get("last_z"),
               scale=rec.get("scale"))
    ref = rec.get("reference")
    if ref is None:
        return tr
    var, cov = float(rec.get("var", 0.0)), float(rec.get("cov", 0.0))
    prev = float(rec.get("prev", 0.0))
    tr.reference, tr.level_n, tr.lx, tr.ly = float(ref), 10.0, float(ref), float(ref)
    tr.n = max(min(float(rec.get("n", 0.0)), NOISE_N), 2.0)
    tr.mx = tr.my = float(ref)
    tr.cxx = tr.cyy = var
    tr.cxy = cov
    tr.phi = float(_phi(np.array(var), np.array(cov)))
    tr.last, tr.prev = float(ref) + prev, prev
    return tr
