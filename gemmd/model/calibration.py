"""Calibrating a prior model to a device from its probes (calibrate): per target, a
device-wide level and per dtype/kernel offsets, shrunk toward the prior by the spreads
fit-time validation measured; and the calibrated prior's log prediction."""

from __future__ import annotations

import functools
import math
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import numpy as np

from gemmd.features import Table, row_sources
from gemmd.gemm import COLUMN
from gemmd.hardware import gpu_model_key
from gemmd.model.domain import (
    ALIGN_UPWARD,
    _least_align,
    _log2_sizes,
    align_log2,
    size_range,
)
from gemmd.model.forest import ForestModel
from gemmd.model.offsets import (
    GROUP_SD_KNOWN,
    LEVEL_SD_KNOWN,
    RESID_DOF0,
    RESID_SD0,
    TAU_LAUNCH,
    DeviceCalibration,
    _groups,
    _robust_offsets,
    _unaligned_loss,
    aligned_loss,
    group_n0,
    interval_scale,
    launch_share,
    level_n0,
    loss_slope,
    resid_dof0,
    unaligned,
    unaligned_work,
)
from gemmd.model.repeats import shape_hashes

MIN_PROBES_IN_DOMAIN = 3  # probes of a dtype/kernel that make a device's predictions in domain
LEVEL_SD_FLOOR = 0.02  # a validated level spread is never taken below this
# a dtype's unaligned probes all below this work share (the prior's runtime within 11% of
# a launch) cannot tell a loss of the work from a fixed cost: its loss slows the whole
# runtime (_align_on_work)
WORK_IDENTIFIED = 0.1


def _unknown_priors(prior: ForestModel, target: str, probes: float) -> tuple[float, float]:
    """(level spread, scatter after the level) on a GPU model ``prior`` never saw, for a
    calibration on ``probes`` probes: the scatter as leave-one-GPU-out measured it on the
    training data (else RESID_SD0), the level's spread that scatter over the square root
    of the pseudo-count that validation chose for that many probes (level_n0; else
    LEVEL_N0_DEFAULT_BY_N, LEVEL_N0_DEFAULT): the prior's level counts as that many probes."""
    rec = (prior.meta.get("logo") or {}).get(target) or {}
    s0 = float(rec.get("shape_sd", RESID_SD0)) or RESID_SD0
    return max(s0 / math.sqrt(level_n0(rec, probes, target)), LEVEL_SD_FLOOR), s0


def _group_sd(rec: Mapping[str, Any], group: str, probes: float, s0: float, tied: float,
              cap: float) -> float:
    """A dtype/kernel offset's prior spread on a GPU model the prior never saw: ``s0``
    over the square root of the pseudo-count leave-one-GPU-out chose for that group
    (group_n0), at most ``cap`` (a dtype outside the domain, as the level's), else
    ``tied`` (as uncertain as the level)."""
    g0 = group_n0(rec, group, probes)
    return tied if g0 is None else min(max(s0 / math.sqrt(g0), LEVEL_SD_FLOOR), cap)


def calibrate(prior: ForestModel, t: Table, launch: Collection[str] = ()
              ) -> dict[str, DeviceCalibration]:
    """Per device of ``t`` (its probes, measured): its offsets from ``prior``.

    Per target, log(measured / prior) = level + group offset + noise, each term shrunk
    toward 0 (the prior) by its prior spread (Bayesian shrinkage: with few probes the
    prior, with many the device's own level), Huber-weighted. On a GPU model the prior
    never saw, the level's spread and the scatter are what leave-one-GPU-out validation
    measured and chose at fit time (_unknown_priors, _validate_calibration). ``launch``:
    the devices (uuids) whose runtime's launch gets an offset of its own beyond the
    level, from the probes of kernels the prior ran (_robust_offsets' ``share``; where
    the probes choose it: choosing.LAUNCH)."""
    logs, flags = prior.prior_logs(t)
    groups = _groups(t)
    sizes = _log2_sizes(t)
    aligns = align_log2(t)
    # per row: aligned below 16 bytes, and then its work share (what such a loss slows)
    unal, work_all = unaligned(t), unaligned_work(t, logs)
    share_all = launch_share(t, logs)  # what a device's launch offset slows (runtime)
    out: dict[str, DeviceCalibration] = {}
    dom = prior.meta.get("domain_targets") or {}
    shape_ids = shape_hashes(t)
    for j, info in enumerate(t.devices):
        sel = t.device == j
        if not sel.any():
            continue
        key = gpu_model_key(info)
        cal = DeviceCalibration(info.uuid, key, int(sel.sum()), {}, {}, {}, {}, {}, {}, {},
                                {})
        said = set(row_sources(t)[sel].tolist())
        cal.source = said.pop() if len(said) == 1 else ""
        g_all = groups[sel]
        for target, (mu, sd_in) in logs.items():
            rec = dom.get(target, prior.meta.get("domain")) or {}
            known_pairs = set(rec.get("gpus", {}).get(key, {}).get("pairs", []))
            known_kernels = set(rec.get("kernels", []))
            # a GPU model the prior never saw, or saw only through another source's
            # measurements (domain_flags)
            unknown = bool(flags[target]["gpu"][sel].any())
            if unknown:  # nothing the prior has of this GPU model counts as its own
                known_pairs = set()
            r = np.log(t[COLUMN[target]][sel]) - mu[sel]
            ok = np.isfinite(r)
            if not ok.any():
                continue
            tau_o = prior.ood_sd(target)
            e, g = r[ok], g_all[ok]
            rec_logo = (prior.meta.get("logo") or {}).get(target) or {}
            names, gi = np.unique(g.astype(str), return_inverse=True)
            new_kernel = np.array([nm.split("/")[1] not in known_kernels for nm in names])
            # a probe aligned below 16 bytes ran another kernel, up to 4.6x slower: its
            # loss is its dtype's own offset, applied to such rows only (in the level it
            # moved every aligned row: the H200's fp16 at 5 random probes, half unaligned,
            # 82.5% off where none gave 15.1%); power is not shifted that way
            # (a kernel the prior never ran: its own offset, as wide as such a kernel's,
            # takes its probes whatever their alignment, its unaligned ones less their
            # dtype's loss where the other kernels' probes measured it: ``an``)
            d_un, di = np.unique(t["dtype"][sel][ok].astype(str), return_inverse=True)
            di = di.ravel()
            ai = np.where(unal[sel][ok] & ~new_kernel[gi], di, -1) \
                if target in ALIGN_UPWARD else np.full(len(e), -1)
            an = np.where(unal[sel][ok] & new_kernel[gi] & np.isin(di, ai), di, -1)
            # each probe's weight in the level: 1 / the aligned probes of its shape (the
            # dtypes of a shape share its error; an unaligned one has no part in the level)
            sid = np.unique(shape_ids[sel][ok], return_inverse=True)[1].ravel()
            u = np.where(ai < 0, 1.0 / np.maximum(np.bincount(sid[ai < 0], minlength=len(
                sid))[sid], 1), 0.0)
            # all the probes' shapes: the level's pseudo-count, the interval's factor and
            # the scatter guess's weight were chosen together per count of probes
            # (validation._validate_calibration), and the scatter takes the unaligned
            # probes' residuals too (by the aligned shapes alone, the H200's 5 random
            # probes of fp32 were covered 64.8% where they had been 80.1%)
            n_shapes = len(np.unique(sid))
            if unknown:
                tau_b, s0 = _unknown_priors(prior, target, n_shapes)
                cal.scale[target] = interval_scale(rec_logo, n_shapes)
            else:
                tau_b = LEVEL_SD_KNOWN
                s0 = max(float(np.median(sd_in[sel][ok])), 0.02)
            # a dtype/kernel's offset on top of the level: a kernel the prior never saw
            # as far off as such a kernel can be (OOD_SD's "kernel": no validation judged
            # the prior's level for it, and the level's pseudo-count was chosen on GPUs
            # whose kernels the prior knew); else on a GPU model the prior never saw, as
            # leave-one-GPU-out chose for that group where it chose apart from the level
            # (tf32, bf16 on the shared data), else as uncertain as the level (validation judged
            # them together, with the same pseudo-count); on a known one, GROUP_SD_KNOWN
            # where the prior knows the pair there, else as a dtype outside the domain
            tau_g = np.array([tau_o["kernel"] if name.split("/")[1] not in known_kernels
                              else _group_sd(rec_logo, str(name), n_shapes, s0,
                                             min(tau_b, tau_o["dtype"]), tau_o["dtype"])
                              if unknown else
                              GROUP_SD_KNOWN if name in known_pairs
                              else tau_o["dtype"] for name in names])
            n_g = np.bincount(gi, minlength=len(names)).astype(float)
            # a kernel the prior never saw: its offset counts a probe as half (scatter
            # as wide as the offset's prior spread: one probe of GPPerf's tiled kernel,
            # whose efficiency spans decades, is not its level), and its probes' scatter
            # is its own, until they say otherwise as wide as the training data's kernels
            # scatter, together (validation._kernel_scatter; else the offset's spread)
            s0_g = np.where(new_kernel, tau_o["kernel"], s0)
            s_new = max(tau_o.get("scatter", tau_o["kernel"]), s0)
            # what an unaligned probe's loss slows is its work, not its launch; unless
            # the dtype's probes say the loss is the whole runtime's (_align_on_work)
            work, tau_a = work_all[sel][ok], tau_o.get("align_work", 1.0)
            # the launch's own offset: runtime only (power has no launch in it), read on
            # the kernels the prior ran (a new kernel's offset is its own, launch and all:
            # 12 tiled probes beside 12 blas ones at the prior's launch read 2.1 in log)
            share = np.where(new_kernel[gi], 0.0, share_all[sel][ok]) if (
                info.uuid in launch and target == "runtime") else np.zeros(len(e))
            fit = functools.partial(_robust_offsets, e, gi, len(names), s0, tau_b, tau_g, u,
                                    s0_g, ai=ai, tau_a=tau_a, an=an, share=share)
            b, cg, ca, dl = fit(work=work)
            lost = np.unique(ai[ai >= 0])  # the dtypes (indices in d_un) probed unaligned
            if len(lost):
                on_work, ca, work = _align_on_work(e - b - cg[gi] - aligned_loss(dl, share),
                                                   ai, work, ca, fit()[2], an)
                if not all(on_work):  # the level and groups beside the loss as served (a
                    # new kernel's unaligned probes less the work's reading of it: its
                    # offset -0.35 where 0.03, the level -0.70 where 0.05)
                    b, cg, ca, dl = fit(work=work)
                cal.align_on_work[target] = {str(d_un[i]): on_work[i] for i in lost}
                slope = loss_slope(ca[np.maximum(ai, 0)], work) * (ai >= 0)
                cal.align_precision[target] = {str(d_un[i]): float(np.sum(slope[ai == i] ** 2) + (
                    s0 / tau_a) ** 2) for i in lost}
                # the alignment half its unaligned probes were at or below (its lower
                # median; the least of them let one probe at 2 bytes among four at 8,
                # whose loss the fit kept, vouch for every row at 2 bytes)
                al = aligns[sel][ok]
                cal.align_least[target] = {str(d_un[i]): float(np.sort(al[ai == i])[
                    (int(np.sum(ai == i)) - 1) // 2]) for i in lost}
            cal.align_offset[target] = {str(d_un[i]): float(ca[i]) for i in lost}
            resid = e - b - cg[gi] - _unaligned_loss(ca, ai, work) - _unaligned_loss(
                ca, an, work) - aligned_loss(dl, share)
            mine = ~new_kernel[gi]
            # the scatter guess s0 against the probes' own: as leave-one-GPU-out chose
            # on a GPU model the prior never saw, for as many probes of kernels it ran
            dof0 = resid_dof0(rec_logo, int(mine.sum())) if unknown else RESID_DOF0
            dof = dof0 + max(int(mine.sum()) - 1, 0)
            s2 = (dof0 * s0**2 + float(np.sum(resid[mine] ** 2))) / dof
            # an unaligned dtype's own scatter, the device's worth RESID_DOF0 probes (its
            # loss one more: a single probe's residual is nil); on a synthetic GPU the
            # unaligned rows scattered 0.056 in log where its probes, all of them, 0.034
            cal.align_scatter[target] = {str(d_un[i]): math.sqrt(
                (RESID_DOF0 * s2 + float(np.sum(resid[ai == i] ** 2))) /
                (RESID_DOF0 + int(np.sum(ai == i)) - 1)) for i in lost}
            for i in np.flatnonzero(new_kernel):
                r_g = resid[gi == i]
                cal.group_scatter.setdefault(target, {})[str(names[i])] = math.sqrt(
                    (RESID_DOF0 * s_new**2 + float(np.sum(r_g**2))) /
                    (RESID_DOF0 + len(r_g)))
                # its interval's Student-t as judged before the weight was validated (the
                # simulated calibrations judged the kernels the prior ran, not this one)
                cal.group_dof.setdefault(target, {})[str(names[i])] = \
                    RESID_DOF0 + max(int(mine.sum()) - 1, 0)
            cal.level[target] = b
            if share.any():
                cal.launch[target] = dl
                cal.launch_precision[target] = float(np.sum(loss_slope(dl, share[ai < 0]) ** 2)
                                                     + (s0 / TAU_LAUNCH) ** 2)
            cal.groups[target] = {str(nm): float(v) for nm, v in zip(names, cg)}
            cal.counts[target] = {str(nm): int(v) for nm, v in zip(names, n_g)}
            # the probes behind each group's offset and the level: the aligned ones (an
            # unaligned probe's loss is its dtype's own; they counted as evidence of the
            # aligned rows, three of them marking a group in the domain; a new kernel's,
            # set in its offset with or less the loss the other kernels' probes measured,
            # did until the fifteenth session: how it runs aligned they only guess)
            aligned = ~unal[sel][ok] if target in ALIGN_UPWARD else np.ones(len(e), bool)
            cal.offset_counts[target] = {str(nm): int(v) for nm, v in zip(names, np.bincount(
                gi[aligned], minlength=len(names)))}
            cal.group_sd[target] = {str(nm): float(v) for nm, v in zip(names, tau_g)}
            # groups the prior knows on this GPU but the probes did not cover
            for pair in known_pairs:
                cal.group_sd[target].setdefault(pair, GROUP_SD_KNOWN)
            cal.sd[target] = math.sqrt(s2)
            cal.dof[target] = dof
            cal.precision[target] = float(u[ai < 0].sum()) + s0**2 / tau_b**2
            probed = [p for p, n in cal.counts[target].items() if n >= MIN_PROBES_IN_DOMAIN]
            if probed:
                x, xa = sizes[sel][ok], sizes[sel][ok][aligned]
                cal.domain[target] = {
                    "pairs": probed, "kernels": sorted({p.split("/")[1] for p in probed}),
                    "size": size_range(x),
                    "align": _least_align(aligns, t["dtype"], np.flatnonzero(sel)[ok]),
                    # what the calibrated prior's offsets cover (domain.prior_domain)
                    "offset_pairs": [p for p, n in cal.offset_counts[target].items()
                                     if n >= MIN_PROBES_IN_DOMAIN],
                    "offset_size": size_range(xa) if len(xa) else None}
        out[info.uuid] = cal
    return out


def _align_on_work(d: np.ndarray, ai: np.ndarray, work: np.ndarray, ca_work: np.ndarray,
                   ca_whole: np.ndarray, an: np.ndarray | None = None
                   ) -> tuple[list[bool], np.ndarray, np.ndarray]:
    """Per dtype of the unaligned probes (``ai``; ``d`` their log residuals beyond the
    level and groups): whether its loss slows the work alone (offset ``ca_work``, the
    probes' ``work`` shares) or the whole runtime (``ca_whole``): the work, unless
    MIN_PROBES_IN_DOMAIN probes or more fit the whole runtime's better (median absolute
    residual), or all its probes are launch-bound (work shares below WORK_IDENTIFIED:
    two unaligned probes at a share of 0.03-0.05 each twice as slow, a fixed cost as much
    as a loss, read as a loss of the work were exp(3) = 20x on a compute-bound unaligned
    row). A prior that misses how efficiency grows with size (the roofline estimate
    of a GPU model it never saw) misses it more on the small GEMMs, which are the
    launch-bound ones: read on their work alone, that miss inflated the loss (a synthetic
    GPU whose efficiency spans 20x with size: 54% off at 5 unaligned probes, 26% with one
    loss for the whole runtime); on the H200's random shapes, reading it on the work took
    their unaligned rows at 5 probes from 31-71% off to 22-35% (bench/RESULTS.md, the
    thirteenth session).
    Returns the choice per dtype index, the offsets and the work shares as served (1
    where the whole runtime is slowed; ``an``'s probes, which take a dtype's loss
    without setting it, as their dtype's)."""
    on_work = [True] * len(ca_work)
    ca, served = ca_work.copy(), work.copy()
    for i in np.unique(ai[ai >= 0]):
        s = ai == i
        if work[s].max() < WORK_IDENTIFIED or s.sum() >= MIN_PROBES_IN_DOMAIN and np.median(
                np.abs(d[s] - ca_whole[i])) < np.median(np.abs(
                    d[s] - aligned_loss(ca_work[i], work[s]))):
            on_work[i], ca[i], served[s] = False, ca_whole[i], 1.0
            if an is not None:
                served[an == i] = 1.0
    return on_work, ca, served


def _calibrated_logs(prior: ForestModel, cals: Mapping[str, DeviceCalibration], t: Table
                     ) -> dict[str, np.ndarray]:
    """Per prior target: the calibrated prior's log prediction for each row of ``t``."""
    logs, _ = prior.prior_logs(t)
    groups = _groups(t)
    uuids = [d.uuid for d in t.devices]
    out = {}
    work, share = unaligned_work(t, logs), launch_share(t, logs)
    for target, (mu, _) in logs.items():
        off = np.array([cals[uuids[int(d)]].offset(target, g, a, h) if uuids[int(d)] in cals
                        else 0.0 for d, g, a, h in zip(t.device, groups, work, share)])
        out[target] = mu + off
    return out


def probed_losses(t: Table, cals: Sequence[DeviceCalibration | None],
                  *flag_sets: Mapping[str, Mapping[str, Any]]
                  ) -> list[dict[str, dict[str, Any]]]:
    """Each of ``flag_sets`` (domain flags per target: the calibrated prior's, the
    trees') with "align_probed" set on the unaligned rows of a target of ALIGN_UPWARD
    whose dtype's loss the row's device's probes measured (``cals`` by device index),
    half of them at the row's alignment or below it (align_least: a loss measured at 8
    bytes says little of 2): their offset holds that loss and their variance its uncertainty
    (DeviceCalibration.loss_variance), so their interval is not widened upward as if the
    loss were unknown (domain.align_widening; on the H200's random shapes at 5 probes,
    with one unaligned probe of the dtype or more, the upper ends sat 1.4-1.7 in log
    above the point and held every row, the lower ends missed up to 37%). Still outside
    the domain: one offset per dtype."""
    un, dts, al = unaligned(t), t["dtype"].astype(str), align_log2(t)
    probed: dict[str, np.ndarray] = {}  # per target, whichever set asks
    for target in {tg for flags in flag_sets for tg in flags}:
        least = {i: c.align_least.get(target, {}) for i, c in enumerate(cals) if c}
        probed[target] = np.array([bool(u) and target in ALIGN_UPWARD and int(d) in least
                                   and a >= least[int(d)].get(dt, np.inf)
                                   for u, dt, d, a in zip(un, dts, t.device, al)])
    return [{tg: dict(f, align_probed=probed[tg]) for tg, f in flags.items()}
            for flags in flag_sets]


def with_probe_sources(t: Table, cals: Sequence[DeviceCalibration | None]) -> Table:
    """``t`` with a calibrated device's rows that name no source taken as of its probes'
    source (DeviceCalibration.source): its offsets were measured against the prior's
    prediction for that source (domain_flags), and hold only there."""
    src = row_sources(t)
    fill = np.array([c.source if c is not None else "" for c in cals], dtype=object)[t.device]
    need = (src == "") & (fill != "")
    if not need.any():
        return t
    return Table({**t.cols, "source": np.where(need, fill, src).astype(object)}, t.devices,
                 t.device)
