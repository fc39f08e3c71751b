"""Drift state as kept between results: a series' Track, a device's DeviceTrack and
DeviceDrift, the Alarm and Transition records, and the conversion of a track to the arrays
the arithmetic runs on and back."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from gemmd.drift.params import REASONS
from gemmd.gemm import ProbeSpec

# The per-series state, as arrays in ``step`` and as floats in Track.
SERIES_FIELDS = ("reference", "level_n", "lx", "ly", "n", "mx", "my", "cxx", "cxy", "cyy",
                 "last", "prev", "scale", "phi", "cusum", "drifting", "since", "alarms",
                 "h", "k", "last_z", "last_u", "gain", "slow", "eu", "ev", "lcusum", "tail",
                 "tail_hi", "tn", "wander")
# A DeviceTrack keeps its pooled series' own alarm apart: its ``drifting``, ``since`` and
# ``alarms`` are the device's alarm.
_POOLED_NAMES = {"drifting": "fast", "since": "fast_since", "alarms": "fast_alarms"}
_BOOL_FIELDS = {"drifting", "bad_prev"}
_INT_FIELDS = {"alarms"}
_OPTIONAL_FIELDS = {"since", "h", "k", "last_z", "last_u", "reference", "scale", "level_se"}
# What a series learnt about its noise, not its level: its AR(1) moments, misfit and tails.
NOISE_FIELDS = ("n", "cxx", "cxy", "cyy", "ev", "tail", "tail_hi", "tn", "wander")


@dataclass
class Track:
    """Drift state of one series: a (device, probe, target), or a device's pooled
    statistic (DeviceTrack). ``reference``: the learnt level (log ratio; None while
    the baseline is taken)."""

    baseline: list[float] = field(default_factory=list)  # values while (re)baselining
    reference: float | None = None  # level L
    level_n: float = 0.0  # results behind the level (frozen at LEVEL_N)
    lx: float = 0.0  # level accumulators: mean of previous and current values learnt
    ly: float = 0.0
    n: float = 0.0  # results behind the noise estimate (at most NOISE_N)
    mx: float = 0.0  # running means and (co)variances of (previous, current) value pairs
    my: float = 0.0
    cxx: float = 0.0
    cxy: float = 0.0
    cyy: float = 0.0
    last: float = 0.0  # the previous value, winsorized (the AR(1) filter's memory)
    prev: float = 0.0  # the latest value's deviation from the reference
    scale: float | None = None  # long-run scale sigma_e / (1 - phi), at its upper bound
    phi: float = 0.0  # lag-1 autocorrelation
    cusum: float = 0.0
    drifting: bool = False
    since: float | None = None  # when the current alarm started
    alarms: int = 0
    h: float | None = None  # alarm threshold
    k: float | None = None  # allowance
    last_z: float | None = None  # latest standardized innovation, as the CUSUM took it
    last_u: float | None = None  # the same at the raw noise estimate (what is pooled)
    gain: float = 0.0  # response of last_u to a unit log shift (the pooling weight)
    slow: float = 0.0  # EWMA of the deviation from the reference (half-life SLOW_HALF)
    eu: float = 0.0  # EWMA of the innovations (1/EU_N) and its mean square: how much more
    ev: float = 0.0  # they wander together than independent ones would (model misfit)
    lcusum: float = 0.0  # the lower CUSUM: evidence of a speed-up (stops learning; no alarm)
    tail: float = 0.0  # share of its in-control innovations below -TAIL_Z (heavy tails) ...
    tail_hi: float = 0.0  # ... and above TAIL_Z ...
    tn: float = 0.0  # ... over this many results (at most NOISE_N)
    wander: float = 1.0  # its misfit as learnt over its reference period (then frozen)
    cut: int = 0  # baseline values before a step seen during the baseline (0: none)
    # Its noise model as learnt before a rebaseline (NOISE_FIELDS, series.noise_of), kept
    # by the reference its next baseline takes (series.set_reference); None otherwise.
    noise: dict[str, float] | None = None
    spd: float = 0.0  # sum of its deviations while its device counts a speed-up

    def ready(self) -> bool:
        return self.reference is not None


@dataclass
class DeviceTrack(Track):
    """A device's pooled statistic for one target, its slow level, its alarm (``drifting``,
    ``since``, ``alarms``: raised, with its reason and cause) and its standing among its
    peers."""

    members: int = 0  # probes pooled in the latest round
    ratio: float | None = None  # latest round's measured/normal, pooled over its probes
    peer_ratio: float | None = None  # normal against the median of same-model siblings
    peer_se: float | None = None  # standard error of log(peer_ratio)
    peers: int = 0  # siblings compared with
    slower: bool = False  # slower than its peers by more than peer_margin
    slower_since: float | None = None
    fast: bool = False  # the pooled CUSUM's own alarm
    fast_since: float | None = None
    fast_alarms: int = 0
    reason: str = ""  # why the device is in alarm: REASONS
    cause: str = ""  # what changed with it (CAUSES), and in words
    cause_text: str = ""
    quiet: float = 0.0  # rounds without evidence during the alarm
    gap_max: float = 0.0  # its longest quiet spell so far
    episodes: float = 0.0  # bad spells during the alarm
    good: float = 0.0  # normal rounds during the alarm
    span: float = 0.0  # rounds of the alarm
    bad_prev: bool = False
    level: float = 0.0  # slow level m (log units, EWMA of the rounds' deviations)
    level_se: float | None = None  # its standard error (noise and reference)
    faster: float = 0.0  # rounds in a row faster than normal beyond the tolerance
    hits: float = 0.0  # rounds in a row far above the first ones (baseline, young)
    young: float = 0.0  # rounds since the pooled statistic started
    young_thr: float = 0.0  # the young check's bar (log units)
    band: float = 0.0  # where slow wiggles have it now (log; the pooled CUSUM's reference)
    speedups: int = 0  # speed-ups taken as the new normal

    def armed(self) -> bool:
        """The pooled statistic has its reference: the device's alarms work fully."""
        return self.ready()


@dataclass
class DeviceDrift:
    """Per device: its model name (who its peers are), a pooled track per target, and the
    probes' context: of the reference period (``normal``) and the latest results."""

    gpu_model: str = ""
    targets: dict[str, DeviceTrack] = field(default_factory=dict)
    contexts: dict[str, dict[str, list[list[Any]]]] = field(default_factory=dict)

    def track(self, target: str) -> DeviceTrack:
        return self.targets.setdefault(target, DeviceTrack())


class Alarm(NamedTuple):
    """A new alarm: of a probe's own track, or (spec None) of the device."""

    target: str
    spec: ProbeSpec | None


class Transition(NamedTuple):
    """A change of a device's drift state, for the record (the store's events): ``kind``
    alarm (raised), clear (ended: quiet again, or a rebaseline), or rebaseline
    (``drift.accept_after_s`` took the device's behaviour as its new normal; phase
    "speedup": a speed-up did, for one target). ``spec`` None: the device's alarm (or, for
    a rebaseline, every track)."""

    ts: float
    kind: str
    uuid: str
    target: str | None
    spec: ProbeSpec | None
    detail: dict[str, Any]


TRANSITIONS_MAX = 10_000  # kept for a caller that drains them (the daemon drains each result)


def _to_arrays(tr: Track, names: tuple[str, ...] = SERIES_FIELDS,
               rename: Mapping[str, str] | None = None) -> dict[str, np.ndarray]:
    out = {}
    for name in names:
        v = getattr(tr, (rename or {}).get(name, name))
        if name == "reason":
            v = float(REASONS.index(v)) if v in REASONS else 0.0
        out[name] = np.array([np.nan if v is None else v],
                             dtype=bool if name in _BOOL_FIELDS else float)
    return out


def _from_arrays(tr: Track, s: dict[str, np.ndarray], names: tuple[str, ...] = SERIES_FIELDS,
                 rename: Mapping[str, str] | None = None) -> None:
    for name in names:
        v = s[name][0]
        attr = (rename or {}).get(name, name)
        if name in _BOOL_FIELDS:
            setattr(tr, attr, bool(v))
        elif name in _INT_FIELDS:
            setattr(tr, attr, int(v))
        elif name == "reason":
            setattr(tr, attr, REASONS[int(v)] if 0 <= int(v) < len(REASONS) else "")
        elif name in _OPTIONAL_FIELDS:
            setattr(tr, attr, None if math.isnan(v) else float(v))
        else:
            setattr(tr, attr, float(v))
