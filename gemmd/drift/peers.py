"""Peers: a device's levels compared with those of the other devices of the same model on
the host, probe by probe (a card slow from its first result is its own reference)."""

from __future__ import annotations

import logging
import math
import statistics
from collections.abc import Mapping

from gemmd.config import DriftConfig
from gemmd.drift.params import PEER_MIN_RESULTS, PEER_Z, RHO_MAX
from gemmd.drift.series import long_run_scale
from gemmd.drift.tracks import DeviceDrift, Track
from gemmd.gemm import ProbeSpec

logger = logging.getLogger(__name__)


def _level_of(tr: Track, floor: float) -> tuple[float, float] | None:
    """(level, variance of its estimate) of a track, from its baseline while it is taken;
    None with fewer than PEER_MIN_RESULTS results behind it."""
    if tr.ready():
        if tr.level_n < PEER_MIN_RESULTS or tr.reference is None:
            return None
        scale = long_run_scale(tr, floor)
        return tr.reference, scale * scale / tr.level_n
    b = tr.baseline
    if len(b) < PEER_MIN_RESULTS:
        return None
    mean = statistics.fmean(b)
    sd = max(statistics.stdev(b), floor)
    d = [x - mean for x in b]
    rho = min(max(sum(p * q for p, q in zip(d, d[1:])) / max(sum(x * x for x in d), 1e-300),
                  0.0), RHO_MAX)
    return mean, sd * sd * (1 + rho) / (1 - rho) / len(b)


def compare_peers(devices: Mapping[str, DeviceDrift],
                  tracks: Mapping[tuple[str, ProbeSpec, str], Track], p: DriftConfig,
                  uuid: str, target: str, now: float) -> None:
    """Compare the device's levels for ``target`` with its same-model siblings'."""
    dev = devices[uuid]
    ds = dev.track(target)
    sibs = [u for u, d in devices.items()
            if u != uuid and dev.gpu_model and d.gpu_model == dev.gpu_model]
    levels: dict[str, dict[ProbeSpec, tuple[float, float]]] = {}
    for (u, spec, t), tr in tracks.items():
        if t == target and (u == uuid or u in sibs):
            found = _level_of(tr, p.min_scale)
            if found is not None:
                levels.setdefault(u, {})[spec] = found
    num = den = 0.0
    peers = 0
    for spec, (lv, var) in levels.get(uuid, {}).items():
        others = [levels[s][spec] for s in sibs if spec in levels.get(s, {})]
        if len(others) < p.peer_min_siblings:
            continue
        peers = max(peers, len(others))
        diff = lv - statistics.median(o[0] for o in others)
        v = var + math.pi / 2 * statistics.fmean(o[1] for o in others) / len(others)
        num, den = num + diff / v, den + 1 / v
    if not den:
        ds.peer_ratio = ds.peer_se = None
        ds.peers, ds.slower, ds.slower_since = 0, False, None
        return
    est = num / den
    # Correlated probes carry less evidence than independent ones: the pooled series'
    # long-run scale (1 when independent, up to sqrt(probes)) widens the error.
    infl = max(1.0, long_run_scale(ds)) if ds.ready() else 1.0
    se = math.sqrt(1 / den) * infl
    ds.peer_ratio, ds.peer_se, ds.peers = math.exp(est), se, peers
    # Flagged at PEER_Z standard errors past the margin; cleared only once the estimate
    # itself is back within it (a GPU near the margin does not flap).
    margin = math.log1p(p.peer_margin)
    slower = target == "runtime" and (est > margin if ds.slower
                                      else est - PEER_Z * se > margin)
    if slower and not ds.slower:
        logger.warning("device %s is slower than its %d %s peers on this host: %.3fx "
                       "their median (drift.peer_margin %.2f)", uuid, peers,
                       dev.gpu_model, math.exp(est), p.peer_margin)
        ds.slower_since = now
    elif not slower:
        ds.slower_since = None
    ds.slower = slower
