"""A device's offsets from a prior model: the DeviceCalibration record and the shrunk,
Huber-weighted level and dtype/kernel offsets (_robust_offsets) that calibrate and
fit-time validation both compute."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gemmd.features import Table
from gemmd.model.domain import ALIGN_LOG2, OOD_SD, align_log2, work_share
from gemmd.model.space import launch_s

# A device's first probes correct a prior model fitted on other GPUs (TransferModel): a
# device-wide offset in log space, then one per dtype/kernel, each shrunk toward the
# prior by the spread expected before any probe (OOD_SD where the prior has no such
# data, these where it has).
LEVEL_SD_KNOWN = 0.1  # another card of a GPU model the prior knows
GROUP_SD_KNOWN = 0.15  # a dtype/kernel the prior knows on that GPU model
RESID_SD0 = 0.3  # scatter left after the offsets on a new GPU, before the probes say
RESID_DOF0 = 3.0  # the weight of that guess, in probes
# Without leave-one-GPU-out evidence (a prior of one GPU model, which predicts a GPU it
# never saw by the roofline estimate plus a launch), the prior's level counts as this
# many probes, per number of probes: what the same validation chooses for that
# prediction on the shared data's four GPUs (`python bench/transfer.py --defaults`: the
# largest choice over three seeds). It was 0.36 (RESID_SD0 / sqrt(0.36) = OOD_SD's 0.5)
# whatever the probes: 5 probes were then worse than none on 9 of the shared data's 12
# one-GPU-prior pairs (H100 -> B200 27.8% -> 37.1%); with these, on 2 (the RTX 4070's
# prior, which never ran the others' kernel: such a kernel's offset is not this
# pseudo-count's).
# Runtime only: power and energy were not judged that way (their levels on a new GPU
# keep LEVEL_N0_DEFAULT; with 32 probes' worth, 5 power probes of the B200 prior on the
# RTX 4070 did worse than with it).
LEVEL_N0_DEFAULT_BY_N = {"5": 32.0, "20": 64.0, "50": 64.0}
LEVEL_N0_DEFAULT = 0.36
# How far a device's launch (the fixed cost the prior's runtime holds beside its work,
# space.launch_s) may stray from its work's level before its probes say (log, runtime):
# the launch is the host's, driver's and harness's as much as the GPU's. The shared
# data's B200 runs its launch-bound GEMMs 2-2.6x slower than a 3 us launch where its
# compute-bound ones are 6-10% off the roofline estimate; an H100 prior of the same
# harness is 0.3-0.6 off on the first, 0.0-0.1 on the second (bench/RESULTS.md, the
# seventeenth session). One level for both served the launch's offset to every row.
TAU_LAUNCH = 0.5


def level_n0(rec: Mapping[str, Any], probes: float, target: str = "runtime") -> float:
    """The prior's level's worth in probes, on a GPU model it never saw, for a
    calibration on ``probes`` probes: leave-one-GPU-out's choice at that many
    (interpolated in log-log between the counts it judged, the nearest beyond them);
    without that evidence LEVEL_N0_DEFAULT_BY_N for runtime, LEVEL_N0_DEFAULT for the
    other targets (a model saved with one value: it)."""
    by_n = rec.get("level_n0_by_n") or {}
    if not by_n and "level_n0" in rec:
        return float(rec["level_n0"])
    if not by_n and target != "runtime":
        return LEVEL_N0_DEFAULT
    by_n = by_n or LEVEL_N0_DEFAULT_BY_N
    ns = sorted((float(k), float(v)) for k, v in by_n.items())
    x = math.log(max(probes, 1.0))
    return float(math.exp(np.interp(x, [math.log(k) for k, _ in ns],
                                    [math.log(v) for _, v in ns])))


def group_n0(rec: Mapping[str, Any], group: str, probes: float) -> float | None:
    """A dtype/kernel offset's own worth in probes on a GPU model the prior never saw,
    for a calibration on ``probes`` probes, where leave-one-GPU-out chose one for that
    group (interpolated as level_n0); else None: as uncertain as the level."""
    by_n = (rec.get("group_n0_by_n") or {}).get(group)
    return level_n0({"level_n0_by_n": by_n}, probes) if by_n else None


def interval_scale(rec: Mapping[str, Any], probes: float) -> float:
    """The factor on a calibration's interval on a GPU model the prior never saw, for
    ``probes`` probes: leave-one-GPU-out's at that many (interpolated as level_n0); 1
    without that evidence."""
    by_n = rec.get("interval_scale_by_n") or {}
    if not by_n:
        return 1.0
    ns = sorted((float(k), float(v)) for k, v in by_n.items())
    return float(np.interp(math.log(max(probes, 1.0)), [math.log(k) for k, _ in ns],
                           [v for _, v in ns]))


def resid_dof0(rec: Mapping[str, Any], probes: float) -> float:
    """The weight in probes of the scatter guessed before a new GPU's probes, on a GPU
    model the prior never saw, for ``probes`` probes of kernels it ran: leave-one-GPU-out's
    choice at that many (interpolated as interval_scale); RESID_DOF0 without that
    evidence."""
    by_n = rec.get("resid_dof0_by_n") or {}
    if not by_n:
        return RESID_DOF0
    ns = sorted((float(k), float(v)) for k, v in by_n.items())
    return float(np.interp(math.log(max(probes, 1.0)), [math.log(k) for k, _ in ns],
                           [v for _, v in ns]))


@dataclass
class DeviceCalibration:
    """How one device departs from the prior, from its probes (log space, per target)."""

    uuid: str
    gpu: str  # GPU model key (hardware.gpu_model_key)
    n: int
    level: dict[str, float]  # device-wide offset
    groups: dict[str, dict[str, float]]  # "dtype/kernel" -> offset on top of the level
    counts: dict[str, dict[str, int]]  # probes per "dtype/kernel"
    group_sd: dict[str, dict[str, float]]  # prior spread of each group's offset
    sd: dict[str, float]  # residual scatter after the offsets
    dof: dict[str, float]  # its degrees of freedom
    precision: dict[str, float]  # of the level, in probes (n + s0^2 / tau^2)
    domain: dict[str, Any]  # per target: what the probes cover: pairs, kernels, sizes
    # per target and group of a kernel the prior never saw: that group's own scatter
    # (its efficiency may vary with size as no other kernel's does)
    group_scatter: dict[str, dict[str, float]] = field(default_factory=dict)
    # and the degrees of freedom of its interval's Student-t
    group_dof: dict[str, dict[str, float]] = field(default_factory=dict)
    # per target and dtype: what a GEMM aligned below 16 bytes adds on this device
    # (runtime and energy; the probes at such shapes, shrunk toward none)
    align_offset: dict[str, dict[str, float]] = field(default_factory=dict)
    # per target and "dtype/kernel": the aligned probes behind its offset (counts less
    # the unaligned ones, for runtime and energy: a kernel the prior ran has their loss
    # in align_offset; a kernel it never ran, in its offset, which they then set, but
    # how it runs aligned they only guess: without 3 aligned probes its rows are outside
    # the domain and its offset as uncertain as an unseen kernel's, 1.5 in log)
    offset_counts: dict[str, dict[str, int]] = field(default_factory=dict)
    # per target and dtype: whether that offset slows the work alone (else the whole
    # runtime: calibration._align_on_work)
    align_on_work: dict[str, dict[str, bool]] = field(default_factory=dict)
    # per target and dtype: the precision of align_offset, in probes whose loss moves one
    # for one with it (the sum of d loss / d offset squared over its probes, plus the
    # shrinkage's pseudo-count): its uncertainty (loss_variance)
    align_precision: dict[str, dict[str, float]] = field(default_factory=dict)
    # and the scatter of its unaligned rows about it (the loss varies with the shape
    # beyond what the work share says): the device's, as many probes' worth as the
    # device's scatter guess, and the dtype's unaligned probes' residuals
    align_scatter: dict[str, dict[str, float]] = field(default_factory=dict)
    # and the alignment (log2 bytes) half its probes had or less: rows aligned below it
    # lose more than they measured (calibration.probed_losses)
    align_least: dict[str, dict[str, float]] = field(default_factory=dict)
    # per target, on a GPU model the prior never saw: the factor on the interval that
    # leave-one-GPU-out's simulated calibrations found to hold the nominal share
    # (interval_scale; not on a kernel the prior never saw, which they did not judge)
    scale: dict[str, float] = field(default_factory=dict)
    # per target (runtime): how much slower (log) the launch runs than the work's level
    # says (TAU_LAUNCH), and its precision in probes whose launch share moves one for one
    # with it (the sum of loss_slope squared over the aligned probes, plus the
    # shrinkage's pseudo-count)
    launch: dict[str, float] = field(default_factory=dict)
    launch_precision: dict[str, float] = field(default_factory=dict)
    # whose measurements the probes were (features.row_sources), where all say the same:
    # what a prediction for this device that names no source is taken to be about
    source: str = ""

    def t_dof(self, target: str, group: str) -> float:
        """Degrees of freedom of the Student-t interval of ``group``'s predictions: a
        kernel the prior never ran has its own (as before the scatter guess's weight was
        validated), else the device's."""
        return self.group_dof.get(target, {}).get(group, self.dof[target])

    def offset(self, target: str, group: str, work: float = 0.0, share: float = 0.0
               ) -> float:
        """The calibrated prior's log offset for a row of ``group``; ``work``: where the
        row is unaligned, its work share (unaligned_work), which its dtype's
        align_offset slows (0 where aligned); ``share``: the launch's share of its prior
        runtime (launch_share), which ``launch`` slows."""
        dtype = group.split("/")[0]
        ca = self.align_offset.get(target, {}).get(dtype, 0.0) if work else 0.0
        if ca and not self.align_on_work.get(target, {}).get(dtype, True):
            work = 1.0
        # (not on a kernel the prior never ran: its offset holds its launch)
        dl = self.launch.get(target, 0.0) if share and group not in self.group_scatter.get(
            target, {}) else 0.0
        return self.level.get(target, 0.0) + self.groups.get(target, {}).get(group, 0.0) + (
            float(aligned_loss(ca, work)) if ca else 0.0) + (
            float(aligned_loss(dl, share)) if dl else 0.0)

    @staticmethod
    def measured(t: Table, cals: Sequence[DeviceCalibration | None]) -> np.ndarray:
        """Per row of ``t`` (``cals`` by device index): its device's probes measured its
        dtype's unaligned runtime loss (align_offset), which then stands for the loss the
        prior's training data measured (domain.align_loss)."""
        return np.array([c is not None and d in c.align_offset.get("runtime", {}) for c, d in
                         zip([cals[j] for j in t.device], t["dtype"].astype(str))], dtype=bool)

    def loss_variance(self, target: str, dtype: str, work: float) -> float:
        """The variance an unaligned row (``work``: its work share, 0 where aligned) adds
        to an aligned one's, where the probes measured its dtype's loss (else 0): its
        scatter is the unaligned probes' (align_scatter) where wider than the device's
        (an unaligned row is no surer than an aligned one: a few unaligned probes' small
        residuals beside the device's scatter guess are not evidence of it), and it
        takes the loss's uncertainty, that scatter over the loss's precision times the
        row's d loss / d offset squared (1 where the loss slows the whole runtime)."""
        prec = self.align_precision.get(target, {}).get(dtype)
        if not work or prec is None:
            return 0.0
        ca = self.align_offset[target][dtype]
        w = work if self.align_on_work.get(target, {}).get(dtype, True) else 1.0
        s2 = self.sd[target] ** 2
        su2 = self.align_scatter.get(target, {}).get(dtype, self.sd[target]) ** 2
        return max(su2 - s2, 0.0) + su2 * float(loss_slope(ca, w)) ** 2 / prec

    def variance(self, target: str, group: str, unseen_sd: float | None = None,
                 work: float = 0.0, share: float = 0.0) -> float:
        """Variance of a new measurement around the calibrated prediction (log space).
        ``unseen_sd``: the prior spread of ``group``'s offset where neither the prior nor
        the probes saw it (a kernel the prior never ran: OOD_SD's "kernel"); else that
        of a dtype outside the domain. ``work``: an unaligned row's work share (its
        loss's uncertainty, loss_variance); ``share``: its launch share (the launch's
        uncertainty, as the loss's)."""
        s2 = self.sd[target] ** 2
        own = self.group_scatter.get(target, {}).get(group)
        if own is not None:
            s2 = own**2
        var = s2 * (1.0 + 1.0 / self.precision[target]) + self.loss_variance(
            target, group.split("/")[0], work)
        if share and target in self.launch_precision and own is None:
            var += s2 * float(loss_slope(self.launch[target], share)) ** 2 / \
                self.launch_precision[target]
        n_g = self.offset_counts.get(target, self.counts.get(target, {})).get(group, 0)
        tau = self.group_sd.get(target, {}).get(group)
        if tau is None:  # a group neither the prior nor the probes saw
            tau = unseen_sd if unseen_sd is not None else \
                OOD_SD.get(target, OOD_SD["runtime"])["dtype"]
        var += tau**2 if n_g == 0 else s2 / (n_g + s2 / max(tau, 1e-6) ** 2)
        return var if own is not None else var * self.scale.get(target, 1.0) ** 2


MIN_WORK = 1e-3  # the least work share an unaligned row is taken to have (unaligned_work)


def unaligned(t: Table) -> np.ndarray:
    """Per row: aligned below 16 bytes (DeviceCalibration.align_offset applies)."""
    return align_log2(t) < ALIGN_LOG2


def unaligned_work(t: Table, logs: Mapping[str, tuple[np.ndarray, Any]]) -> np.ndarray:
    """Per row: where it is unaligned, the share of its runtime (``logs``' "runtime", the
    prior's log prediction) beyond a launch, which unaligned data slow (work_share; at
    least MIN_WORK, so that a launch-bound row stays unaligned: a row of a dtype whose
    loss is the whole runtime's takes all of it; 1 without a runtime); 0 where aligned."""
    share = work_share(logs["runtime"][0]) if "runtime" in logs else np.ones(len(t))
    return np.where(unaligned(t), np.maximum(share, MIN_WORK), 0.0)


def launch_share(t: Table, logs: Mapping[str, tuple[np.ndarray, Any]]) -> np.ndarray:
    """Per row: the share of its prior runtime (``logs``' "runtime") that is the launch
    (space.launch_s: none for CUTLASS profiler rows), which a device's launch offset
    slows (aligned_loss, as an unaligned loss slows the work); 0 without a runtime."""
    if "runtime" not in logs:
        return np.zeros(len(t))
    return np.clip(launch_s(t) / np.exp(logs["runtime"][0]), 0.0, 1.0)


def aligned_loss(ca: Any, work: Any) -> Any:
    """The log slowdown of a GEMM whose work (its ``work`` share of the runtime) runs
    exp(``ca``) times slower unaligned, its launch not: log(1 + work (exp(ca) - 1)). On
    the H200's random shapes the loss of a mostly launch-bound GEMM was a third of a
    compute-bound one's (fp16 at a work share of 0.3-0.7: 1.27 in log; above 0.95: 1.71;
    docs/model.md, "Alignment")."""
    return np.log1p(np.asarray(work) * np.expm1(ca))


def loss_slope(ca: Any, work: Any) -> Any:
    """d aligned_loss / d ``ca``: how much of a change in the dtype's offset a row with
    that ``work`` share takes (1 at a share of 1)."""
    work = np.asarray(work)
    return work * np.exp(ca) / (1.0 + work * np.expm1(ca))


def _unaligned_loss(ca: np.ndarray, idx: np.ndarray, work: np.ndarray) -> np.ndarray:
    """Per probe: the unaligned loss of its dtype (offset ``ca[idx]`` on its ``work``
    share) where ``idx`` >= 0 (_robust_offsets' ``ai`` or ``an``), 0 elsewhere."""
    if not len(ca) or not (idx >= 0).any():
        return np.zeros(len(idx))
    return np.where(idx >= 0, aligned_loss(ca[np.maximum(idx, 0)], work), 0.0)


def _groups(t: Table) -> np.ndarray:
    return np.array([f"{d}/{k}" for d, k in zip(t["dtype"], t["kernel"])], dtype=object)


def _robust_offsets(e: np.ndarray, gi: np.ndarray, groups: int, s0: float, tau_b: float,
                    tau_g: np.ndarray, u: np.ndarray | None = None,
                    s0_g: np.ndarray | None = None, k: float = 1.345,
                    ai: np.ndarray | None = None, tau_a: float = 1.0,
                    work: np.ndarray | None = None, an: np.ndarray | None = None,
                    share: np.ndarray | None = None, tau_l: float = TAU_LAUNCH
                    ) -> tuple[float, np.ndarray, np.ndarray, float]:
    """Level b and group offsets with e ~ b + cg[gi] + noise: each shrunk toward 0 (the
    prior) by its prior spread, and Huber-weighted, so that one launch-bound or
    thermally throttled probe among five does not move a device's whole calibration.
    ``u``: each probe's weight in the level (1 / probes of its shape: the dtypes of one
    shape share its error, they are one piece of evidence about the level, not
    several). ``s0_g``: each group's prior scatter where it is not ``s0``. ``ai``: per
    probe, the index of its dtype's unaligned offset (-1 where aligned to 16 bytes), each
    shrunk toward none by ``tau_a``: an unaligned probe's loss is its own, not the
    device's level, and the level and groups are the aligned probes' (returned third,
    per index). ``work``: per probe, its work share, which alone the unaligned offset
    slows (aligned_loss; 1: the whole runtime; least squares in log runtime, so that a
    launch-bound probe, which says little of what its work lost, weighs little).
    ``an``: per probe, the index of a dtype's unaligned offset it takes without setting
    it (-1 elsewhere; an unaligned probe of a kernel the prior never ran): that loss is
    taken off it before it speaks for its level and group, which a row of its group is
    served beside the loss (before, its group's offset took its loss too: counted twice
    on its unaligned rows, and once on its aligned ones). ``share``: per probe, the
    launch's share of its prior runtime (launch_share): the launch's own offset beyond
    the level (returned fourth), from the aligned probes, shrunk toward none by
    ``tau_l``, slows that share alone (aligned_loss, as the loss the work)."""
    s0_g = np.full(groups, s0) if s0_g is None else s0_g
    u = np.ones(len(e)) if u is None else u
    ai = np.full(len(e), -1) if ai is None else ai
    an = np.full(len(e), -1) if an is None else an
    un = ai >= 0
    x = np.ones(len(e)) if work is None else np.maximum(work, MIN_WORK)
    ls = np.zeros(len(e)) if share is None else share
    w = np.ones(len(e))
    b, cg, ca, dl = 0.0, np.zeros(groups), np.zeros(int(ai.max(initial=-1)) + 1), 0.0
    for _ in range(8):
        for _ in range(3):  # backfitting: the level, then the groups, the unaligned loss
            # the level and the groups from aligned probes only: beside an unaligned
            # offset of its own an unaligned probe cannot tell its loss from the level
            # (a dtype probed unaligned only left the loss in the level)
            wa = np.where(un, 0.0, w)
            wu = wa * u
            el = e - aligned_loss(dl, ls)  # less the launch's own offset
            ea = el - _unaligned_loss(ca, an, x)
            b = float(np.sum(wu * (ea - cg[gi])) / (wu.sum() + s0**2 / tau_b**2))
            cg = np.bincount(gi, weights=wa * (ea - b), minlength=groups) / \
                (np.bincount(gi, weights=wa, minlength=groups) + s0_g**2 / tau_g**2)
            if ls.any():  # Gauss-Newton steps on d = aligned_loss(dl, share), shrunk
                d, lam = ea + aligned_loss(dl, ls) - b - cg[gi], s0**2 / tau_l**2
                for _ in range(3):
                    jac = loss_slope(dl, ls)
                    step = np.sum(wa * jac * (d - aligned_loss(dl, ls))) - lam * dl
                    dl = float(np.clip(dl + step / (np.sum(wa * jac**2) + lam), -3.0, 3.0))
                el = e - aligned_loss(dl, ls)
            if len(ca):  # Gauss-Newton steps on d = aligned_loss(ca, work), shrunk
                d, xu, iu, lam = (el - b - cg[gi])[un], x[un], ai[un], s0**2 / tau_a**2
                for _ in range(3):
                    f = 1.0 + xu * np.expm1(ca[iu])
                    jac = loss_slope(ca[iu], xu)
                    ca = np.clip(ca + (np.bincount(iu, weights=w[un] * jac * (d - np.log(f)),
                                                   minlength=len(ca)) - lam * ca) /
                                 (np.bincount(iu, weights=w[un] * jac**2, minlength=len(ca)) +
                                  lam), -3.0, 5.0)
        r = e - b - cg[gi] - _unaligned_loss(ca, ai, x) - _unaligned_loss(ca, an, x) - \
            aligned_loss(dl, ls)
        mad = 1.4826 * float(np.median(np.abs(r)))
        scale = math.sqrt((RESID_DOF0 * s0**2 + len(e) * mad**2) / (RESID_DOF0 + len(e)))
        # a group expected to scatter more than the others (a kernel the prior never
        # saw) is judged against its own scatter: its probes are not outliers of the rest
        rs = np.where(s0_g[gi] > s0, np.maximum(scale, s0_g[gi]), scale)
        w = np.minimum(1.0, k * rs / np.maximum(np.abs(r), 1e-12))
    return b, cg, ca, dl
