"""What the fleet report reads of each GPU: its sentinel results as one series per probe
(measured, predicted, interval, model version, flagged), with intervals re-computed from the
model files where the store has none (``_Bands``), and the device context after each probe.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gemmd.config import ModelConfig
from gemmd.errors import ModelError
from gemmd.gemm import COLUMN, TARGETS, ProbeSpec
from gemmd.records import DeviceInfo
from gemmd.report import readonly
from gemmd.report.page import shape_name
from gemmd.store import DAEMON_SOURCE

PRED = {t: f"pred_{COLUMN[t]}" for t in TARGETS}


@dataclass
class Series:
    """One sentinel probe's results on one GPU, oldest first."""

    spec: ProbeSpec
    ts: np.ndarray
    ok: np.ndarray  # outcome ok
    outcome: list[str]
    meas: dict[str, np.ndarray]
    pred: dict[str, np.ndarray]
    lo: dict[str, np.ndarray]  # interval bounds, NaN where not known
    hi: dict[str, np.ndarray]
    version: list[str]
    flagged: np.ndarray


@dataclass
class Context:
    """The device context read after each result, oldest first: numeric values by name
    and per clock-event reason whether it was active (None: the backend records none)."""

    ts: np.ndarray
    values: dict[str, np.ndarray]
    reasons: dict[str, np.ndarray] | None


@dataclass
class AlarmSpan:
    """A GPU's drift alarm for one target, from the store's events: from the first alarm
    raised (its pooled statistic's or a probe's) to the clear of the last one in alarm;
    ``end`` None: still in alarm."""

    target: str
    start: float
    end: float | None
    raised: dict[str, Any]  # the detail of the alarm that began it (scope, ratio, shift)
    by: list[str]  # what was in alarm over the span: "pooled" and/or probe names
    ended_by: str = ""  # cleared | rebaseline | "" (still in alarm)
    start_known: bool = True  # False: began before the events (a clear's or drift.json's)


@dataclass
class RebaselineMark:
    ts: float
    phase: str  # applied | automatic | requested (and not applied yet)
    unflagged: int  # results unflagged by it (request and application together)


@dataclass
class BandCounts:
    """Where the results' prediction intervals came from, counted per (result, target)."""

    stored: int = 0
    recomputed: int = 0
    none: int = 0


@dataclass
class GpuData:
    rec: dict[str, Any]
    info: DeviceInfo | None
    n_rows: int = 0
    series: list[Series] = field(default_factory=list)
    context: Context = field(default_factory=lambda: Context(np.zeros(0), {}, None))
    events: list[dict[str, Any]] = field(default_factory=list)  # alarm/clear/rebaseline
    alarms: list[AlarmSpan] = field(default_factory=list)  # those overlapping the window
    rebaselines: list[RebaselineMark] = field(default_factory=list)  # in the window
    window: tuple[float, float] = (0.0, 0.0)
    events_recorded: bool = True  # the store has an events table (schema 3 on)


def probe_label(s: ProbeSpec) -> str:
    """A sentinel as a person reads it: '8192×8192×8192 bf16 blas nn'."""
    kern = f"tiled (tile {s.tile})" if s.kernel == "tiled" else s.kernel
    return f"{shape_name(s.m, s.n, s.k, s.dtype)} {kern} {s.layout}"


# ------------------------------------------------------------------ reading


class _Bands:
    """Each model version's prediction interval per probe, re-computed with that model:
    (lower / point, upper / point) per target, applied to the stored point."""

    def __init__(self, mods: list[dict[str, Any]], cfg: ModelConfig):
        self.records = {f"rf-{m['version']}": m for m in mods}
        self.cfg = cfg
        self.models: dict[str, Any] = {}
        self.missing: dict[str, str] = {}  # version -> why no band
        self.counts = BandCounts()
        self.cache: dict[tuple[str, ProbeSpec, str], dict[str, tuple[float, float]]] = {}

    def _predictor(self, version: str) -> Any:
        if version in self.models:
            return self.models[version]
        model: Any = None
        if version == "roofline":
            from gemmd.model import RooflinePredictor

            model = RooflinePredictor(self.cfg.roofline_efficiency)
        elif version in self.records:
            try:
                model = readonly.load_model(self.records[version])
            except ModelError as e:
                self.missing[version] = f"its file is gone or unreadable ({e})"
        elif version:
            self.missing[version] = ("not a model registered in this store (a reference "
                                     "model calibrated per GPU is not re-computed)")
        self.models[version] = model
        return model

    def ratios(self, version: str, spec: ProbeSpec, info: DeviceInfo | None
               ) -> dict[str, tuple[float, float]]:
        key = (version, spec, info.uuid if info else "")
        if key in self.cache:
            return self.cache[key]
        out: dict[str, tuple[float, float]] = {}
        model = self._predictor(version) if info is not None else None
        if model is not None and info is not None:
            try:
                (p,) = model.predict([spec], [info], DAEMON_SOURCE)  # as the daemon did
            except Exception as e:  # a model that cannot predict here: no band, said once
                self.missing[version] = f"it cannot predict this probe ({type(e).__name__})"
                p = None
            for t in TARGETS if p is not None else ():
                point = getattr(p, COLUMN[t])
                lo, hi = getattr(p, f"{t}_lo"), getattr(p, f"{t}_hi")
                if point and lo is not None and hi is not None and point > 0:
                    out[t] = (lo / point, hi / point)
        self.cache[key] = out
        return out


def _series(g: GpuData, rows: list[dict[str, Any]], bands: _Bands) -> list[Series]:
    by: dict[ProbeSpec, list[dict[str, Any]]] = {}
    for r in rows:
        spec = ProbeSpec(int(r["m"]), int(r["n"]), int(r["k"]), str(r["dtype"]),
                         str(r["kernel"]), int(r["tile"] or 0), str(r["layout"]))
        by.setdefault(spec, []).append(r)
    out = []
    for spec in sorted(by, key=lambda s: (s.kernel, s.dtype, s.m * s.n * s.k, s.layout)):
        mine = by[spec]

        def col(name: str, rows: list[dict[str, Any]] = mine) -> np.ndarray:
            return np.array([np.nan if r[name] is None else float(r[name]) for r in rows])

        ok = np.array([r["outcome"] == "ok" for r in mine])
        meas = {t: np.where(ok, col(COLUMN[t]), np.nan) for t in TARGETS}
        pred = {t: np.where(ok, col(PRED[t]), np.nan) for t in TARGETS}
        versions = [str(r["model_version"] or "") for r in mine]
        # The interval stored with each result; re-computed (with the model that made the
        # prediction) only for results stored without one (an older gemmd).
        lo = {t: np.where(ok, col(f"pred_{t}_lo"), np.nan) for t in TARGETS}
        hi = {t: np.where(ok, col(f"pred_{t}_hi"), np.nan) for t in TARGETS}
        vers = np.array(versions, dtype=object)
        lack = {t: np.isfinite(pred[t]) & ~(np.isfinite(lo[t]) & np.isfinite(hi[t]))
                for t in TARGETS}
        for t in TARGETS:
            bands.counts.stored += int((np.isfinite(pred[t]) & ~lack[t]).sum())
        for v in {v for v, need in zip(versions, np.logical_or.reduce(
                [lack[t] for t in TARGETS])) if need}:
            for t, (a, b) in bands.ratios(v, spec, g.info).items():
                sel = lack[t] & (vers == v)
                lo[t][sel], hi[t][sel] = pred[t][sel] * a, pred[t][sel] * b
                bands.counts.recomputed += int(sel.sum())
        for t in TARGETS:
            bands.counts.none += int((lack[t] & ~(np.isfinite(lo[t]) & np.isfinite(hi[t]))
                                      ).sum())
        out.append(Series(spec, col("ts"), ok, [str(r["outcome"]) for r in mine], meas, pred,
                          lo, hi, versions, np.array([bool(r["flagged"]) for r in mine])))
    return out


def _context(rows: list[dict[str, Any]]) -> Context:
    rows = sorted(rows, key=lambda r: r["ts"])
    ts = np.array([float(r["ts"]) for r in rows])
    after = [((r.get("context") or {}).get("after") or {}) if isinstance(r.get("context"),
             dict) else {} for r in rows]

    def num(key: str, scale: float = 1.0) -> np.ndarray:
        return np.array([float(a[key]) * scale if isinstance(a.get(key), (int, float))
                         else np.nan for a in after])

    values = {"SM clock (MHz)": num("sm_clock_hz", 1e-6),
              "memory clock (MHz)": num("mem_clock_hz", 1e-6),
              "temperature (°C)": num("temperature_c"),
              "power limit (W)": num("power_limit_w")}
    reasons: dict[str, np.ndarray] = {}
    if not any("clock_event_reasons" in a for a in after):
        return Context(ts, values, None)
    for i, a in enumerate(after):
        for name in a.get("clock_event_reasons") or []:
            reasons.setdefault(str(name), np.zeros(len(after), bool))[i] = True
    return Context(ts, values, reasons)
