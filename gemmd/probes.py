"""The probe plan: which GEMMs a device runs each round.

A probe is one GEMM configuration run back to back for a timed window (the measurement
protocol: gemmd.devices). The plan is the configuration's sentinel groups expanded for one
device, what it cannot run set aside with the reason, and a few random exploration shapes
per round.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import numpy as np

from gemmd.config import ExplorationConfig, ProbeGroup
from gemmd.devices import Device
from gemmd.gemm import ProbeSpec


def _expand(shapes: Iterable[tuple[int, int, int]], dtypes: Sequence[str],
            kernels: Sequence[str], tiles: Sequence[int], layouts: Sequence[str]
            ) -> list[ProbeSpec]:
    out = []
    for (m, n, k) in shapes:
        for dtype in dtypes:
            for kernel in kernels:
                for tile in (tiles if kernel == "tiled" else (0,)):
                    # The tiled kernel reads row-major A and B only (as in the paper).
                    for layout in (layouts if kernel == "blas" else ("nn",)):
                        out.append(ProbeSpec(m, n, k, dtype, kernel, tile, layout))
    return out


def build_plan(groups: Sequence[ProbeGroup], device: Device) -> tuple[list[ProbeSpec],
                                                                       dict[ProbeSpec, str]]:
    """Sentinel probes for one device: (runnable specs in order, {dropped spec: reason})."""
    plan: list[ProbeSpec] = []
    dropped: dict[ProbeSpec, str] = {}
    for g in groups:
        if g.backends and device.info.backend not in g.backends:
            continue
        for spec in _expand(g.shapes, g.dtypes, g.kernels, g.tiles, g.layouts):
            if spec in plan or spec in dropped:
                continue
            reason = device.unsupported_reason(spec)
            if reason:
                dropped[spec] = reason
            else:
                plan.append(spec)
    return plan, dropped


def exploration_specs(groups: Sequence[ExplorationConfig], device: Device,
                      rng: np.random.Generator) -> list[ProbeSpec]:
    """Random supported specs for this round from every group that applies to the device
    (DeviceRunner passes the groups due: one every ``every_rounds`` rounds, kept due until
    its draws have run)."""
    out: list[ProbeSpec] = []
    for g in groups:
        if not g.backends or device.info.backend in g.backends:
            out.extend(_explore(g, device, rng))
    return out


def _explore(cfg: ExplorationConfig, device: Device, rng: np.random.Generator
             ) -> list[ProbeSpec]:
    """Draw ``per_round`` random supported specs, shapes log-uniform in the configured
    ranges, rounded to ``align`` but for the ``unaligned`` share of them."""
    out: list[ProbeSpec] = []
    for _ in range(cfg.per_round * 10):  # bounded retries when many draws are unsupported
        if len(out) >= cfg.per_round:
            break
        align = 1 if cfg.unaligned and rng.uniform() < cfg.unaligned else cfg.align
        m, n, k = (_draw_dim(rng, lo, hi, align) for lo, hi in (cfg.m, cfg.n, cfg.k))
        kernel = str(rng.choice(cfg.kernels))
        spec = ProbeSpec(m, n, k, dtype=str(rng.choice(cfg.dtypes)), kernel=kernel,
                         tile=int(rng.choice(cfg.tiles)) if kernel == "tiled" else 0,
                         layout=str(rng.choice(cfg.layouts)) if kernel == "blas" else "nn")
        if device.unsupported_reason(spec) is None:
            out.append(spec)
    return out


def _draw_dim(rng: np.random.Generator, lo: int, hi: int, align: int) -> int:
    v = math.exp(rng.uniform(math.log(lo), math.log(hi)))
    v = round(v / align) * align
    return int(min(max(v, lo), hi)) or lo
