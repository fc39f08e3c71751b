"""Validation at fit time: what the training data say about predicting outside
themselves. Sizes beyond the trained range held out (_validate_size), unaligned shapes
held out (_validate_align), each GPU model left out in turn (_validate_transfer) and a
new GPU's first probes simulated (_validate_calibration), on small forests fitted
quickly."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from statistics import NormalDist
from typing import Any

import numpy as np

from gemmd import bounds, features
from gemmd.config import ModelConfig
from gemmd.features import Table
from gemmd.gemm import COLUMN
from gemmd.hardware import gpu_model_key
from gemmd.model.domain import (
    OOD_SD,
    SIZE_MIN_D,
    TRANSFER_GRID,
    _reference_shapes,
    align_share,
    domain_flags,
    domain_record,
    median_losses,
    widen,
    work_share,
)
from gemmd.model.intervals import (
    MAX_FEATURES,
    _aggregate,
    _t_quantile,
    _weighted_conformal_quantile,
    conformal_quantile,
)
from gemmd.model.offsets import (
    RESID_DOF0,
    RESID_SD0,
    _groups,
    _robust_offsets,
    level_n0,
    unaligned,
)
from gemmd.model.space import runtime_reference, to_model_space

VALIDATION_TREES = 20  # trees of each forest fitted to validate (leave-one-GPU-out, sizes)
VALIDATION_TRAIN_MAX = 5_000  # configurations such a forest is fitted on, at most
VALIDATION_TEST_MAX = 1_500  # rows it is judged on, at most
LOGO_MAX_GPUS = 12  # GPU models left out in turn, at most (those with the most rows):
# no fewer than LOGO_TRUST_GPUS, or what they show would never be trusted alone
LOGO_MIN_ROWS = 20  # rows a GPU model needs to be left out and judged
LOGO_TRUST_GPUS = 9  # GPU models left out before their spread alone sets the "gpu" widening
# The least widening per factor of 2 beyond the trained sizes, whatever the folds found
# (log-space sd): what lies beyond the data can hold what no fold inside it shows.
SIZE_SD_FLOOR = 0.05
SIZE_SHARE = 0.15  # the largest (smallest) sizes held out to validate extrapolation
# What a fold is built as: ForestModel (forests, sigma, z, meta), passed in by
# ForestModel.fit_table, which calls this module (importing it here would close a circle).
ModelClass = Callable[[dict[str, Any], dict[str, float], float, dict[str, Any]], Any]


def _quick_forest(X: np.ndarray, y: np.ndarray, gid: np.ndarray, cfg: ModelConfig) -> Any:
    """A small forest on per-configuration medians (VALIDATION_TREES, at most
    VALIDATION_TRAIN_MAX configurations), as _fit_one fits but without its intervals."""
    from sklearn.ensemble import RandomForestRegressor

    first, med, cnt, _ = _aggregate(y, gid)
    if len(med) > VALIDATION_TRAIN_MAX:
        keep = np.sort(np.random.default_rng(cfg.seed).choice(len(med), VALIDATION_TRAIN_MAX,
                                                              replace=False))
        first, med, cnt = first[keep], med[keep], cnt[keep]
    return RandomForestRegressor(
        n_estimators=VALIDATION_TREES, max_depth=cfg.max_depth or None,
        min_samples_leaf=cfg.min_samples_leaf, max_leaf_nodes=cfg.max_leaf_nodes or None,
        max_features=MAX_FEATURES, random_state=cfg.seed, n_jobs=1,
    ).fit(X[first], med, sample_weight=cnt.astype(np.float64))


def _fold_model(t: Table, idx: np.ndarray, X: np.ndarray, gid: np.ndarray, target: str,
                y: np.ndarray, sigma: float, cfg: ModelConfig, model: ModelClass) -> Any:
    """A ``model`` (ForestModel) of one target fitted on the rows ``idx`` of ``t``
    (quickly): what a model trained on them alone predicts, with their domain and
    reference shapes."""
    tr = t.take(idx)
    rf = _quick_forest(X[idx], y[idx], gid[idx], cfg)
    meta = {"reference_shapes": _reference_shapes(tr), "domain": domain_record(tr),
            "roofline_efficiency": cfg.roofline_efficiency, "interval": cfg.interval}
    return model({target: rf}, {target: sigma}, NormalDist().inv_cdf(
        0.5 + cfg.interval / 2), meta)


def _test_rows(sel: np.ndarray, seed: int) -> np.ndarray:
    idx = np.flatnonzero(sel)
    if len(idx) > VALIDATION_TEST_MAX:
        idx = np.sort(np.random.default_rng(seed).choice(idx, VALIDATION_TEST_MAX,
                                                         replace=False))
    return idx


def _clip_logs(target: str, t: Table, mu: np.ndarray) -> np.ndarray:
    """Log points inside the physical bounds (gemmd.bounds), as predictions are served."""
    if target == "runtime":
        floor = bounds.runtime_floor(t)
        return np.where(floor > 0, np.maximum(mu, np.log(np.maximum(floor, 1e-300))), mu)
    if target == "power":
        idle, lim = bounds.power_range(t)
        with np.errstate(divide="ignore"):
            return np.clip(mu, np.log(idle), np.log(lim))
    return mu


def _need(r: np.ndarray, sd: np.ndarray, z: float, per: np.ndarray) -> np.ndarray:
    """Per residual: the spread ``per`` unit of distance must add (in quadrature to sd)
    for the interval z * sd to hold it; 0 where sd alone does."""
    return np.sqrt(np.maximum((np.abs(r) / z) ** 2 - sd**2, 0.0)) / np.maximum(per, 1e-12)


def _validate(t: Table, X: np.ndarray, gid: np.ndarray, forests: Mapping[str, Any],
              sigma: Mapping[str, float], in_scale: Mapping[str, float], cfg: ModelConfig,
              model: ModelClass) -> tuple[dict[str, dict[str, float]], dict[str, dict[str, Any]]]:
    """What the training data say about predicting outside themselves, per forest target:
    ({target: {"size", "size_m", "size_n", "size_k": spread per factor of 2 beyond the
    trained sizes, over all dimensions and per dimension; "gpu": spread on a GPU model
    never trained on; for runtime "scatter": how far a kernel strays from one efficiency
    level; for runtime and energy "align": unaligned shapes' upper ends}} where measured,
    {target: the leave-one-GPU-out record}); see _validate_size, _kernel_scatter,
    _validate_align and _validate_transfer. ``model``: what folds are built as
    (ModelClass)."""
    ood: dict[str, dict[str, float]] = {}
    transfer: dict[str, dict[str, Any]] = {}
    z = NormalDist().inv_cdf(0.5 + cfg.interval / 2)
    for target in forests:
        y = to_model_space(target, t)
        tau = dict(OOD_SD.get(target, OOD_SD["runtime"]))
        size = _validate_size(t, X, gid, target, y, sigma[target], in_scale[target], cfg, z,
                              model)
        if size:
            tau.update(size)
            ood.setdefault(target, {}).update(size)
        if target == "runtime":
            align = _validate_align(t, X, gid, y, sigma[target], in_scale[target], cfg, z,
                                    model)
            if align is not None:  # energy is runtime times power: the same upper end
                tau.update(align)
                for tg in ("runtime", "energy"):
                    ood.setdefault(tg, {}).update(align)
            scatter = _kernel_scatter(t, y, cfg.interval, z)
            if scatter is not None:
                ood.setdefault(target, {})["scatter"] = scatter
        rec = _validate_transfer(t, X, gid, target, y, sigma[target], in_scale[target], cfg,
                                 z, tau, model)
        if rec:
            transfer[target] = rec
            # GPUs left out are the units: below LOGO_TRUST_GPUS of them the nominal
            # share of GPUs cannot be told, and the spread is never taken below OOD_SD's
            gpu = rec["gpu_sd"] if len(rec["gpus"]) >= LOGO_TRUST_GPUS else \
                max(rec["gpu_sd"], tau["gpu"])
            ood.setdefault(target, {})["gpu"] = gpu
    return ood, transfer


def _row_gpu_keys(t: Table) -> np.ndarray:
    """Per row of ``t``, its GPU model key (hardware.gpu_model_key), an object array."""
    return np.array([gpu_model_key(d) for d in t.devices], dtype=object)[t.device]


def _kernel_scatter(t: Table, y: np.ndarray, p: float, z: float) -> float | None:
    """How far a kernel's runtime strays from one efficiency level across sizes, on the
    training data: within each (GPU model, dtype, kernel) with LOGO_MIN_ROWS measured
    rows, each row's distance of ``y`` (log runtime over the roofline reference) from its
    group's median; the sd whose interval at ``p`` (``z`` sds) holds ``p`` of them, each
    group weighted alike (a quantile, not a MAD: efficiency is skewed, 0.05-0.95 of peak
    with size, and a MAD's sd held 78% of a synthetic kernel's rows). A kernel the prior
    never ran is predicted with no shape (the roofline estimate), and its probes' scatter
    about their offset is taken as this until they say otherwise (calibrate): a new kernel
    as scattered as the training data's kernels are, together. The most scattered one
    alone (before) held 95-100% of the RTX 4070's CUTLASS rows at 5 probes; and on a
    prior with GPPerf's tiled kernel, 30-100x off in places, it was 1.95 for any new
    kernel. None without such a group."""
    ok = np.isfinite(y)
    keys = _row_gpu_keys(t).astype(str)
    groups = np.char.add(keys, np.char.add("/", _groups(t).astype(str)))
    dev = [np.abs(v - np.median(v)) for v in (y[ok & (groups == g)]
                                              for g in np.unique(groups[ok]))
           if len(v) >= LOGO_MIN_ROWS]
    if not dev:
        return None
    w = np.concatenate([np.full(len(v), 1.0 / len(v)) for v in dev])
    return _weighted_conformal_quantile(np.concatenate(dev), w, p) / z


def _validate_size(t: Table, X: np.ndarray, gid: np.ndarray, target: str, y: np.ndarray,
                   sigma: float, scale: float, cfg: ModelConfig, z: float, model: ModelClass
                   ) -> dict[str, float]:
    """The spread per factor of 2 beyond the trained sizes that makes the nominal interval
    hold there, per dimension: for each of M, N and K, its largest and smallest
    SIZE_SHARE of rows held out, a forest fitted on the rest, and each held-out row's
    residual set against the interval it would get in the domain, over how far beyond the
    range it lies (at least SIZE_MIN_D factors of 2); the conformal quantile of what each
    needs ("size_m", "size_n", "size_k"), and of all of them ("size": for a row beyond
    in FLOPs alone). Per dimension, because extrapolation is not alike in each: one
    spread for all held 78% of the MI355X's rows beyond the K it was trained on, 97% beyond
    its M (bench/transfer.py). {} when the data do not span sizes enough to try."""
    ok = np.isfinite(y)
    lg = np.column_stack([np.log2(t[c]) for c in ("m", "n", "k")])
    out_sd: dict[str, float] = {}
    needs = []
    for j, name in enumerate(("m", "n", "k")):
        v = lg[ok, j]
        u = np.unique(v)
        if len(u) < 4:
            continue
        out = np.zeros(len(t), dtype=bool)
        for side in (1, -1):
            out |= (side * (lg[:, j] - share_cut(v, side)) > 0) & ok
        train = ok & ~out
        if not out.any() or train.sum() < 3 * LOGO_MIN_ROWS:
            continue
        fold = _fold_model(t, np.flatnonzero(train), X, gid, target, y, sigma, cfg, model)
        te = t.take(_test_rows(out, cfg.seed + j))
        d = domain_flags(fold.meta["domain"], te)["size_by"][:, j]  # beyond in this one
        mu, sd = fold.raw_logs(te, scaled=False)[target]
        mu = _clip_logs(target, te, mu)
        r = np.log(te[COLUMN[target]]) - mu
        far = (d > 0) & np.isfinite(r)
        if far.any():
            needs.append(_need(r[far], sd[far] * scale, z, np.maximum(d[far], SIZE_MIN_D)))
            if far.sum() >= LOGO_MIN_ROWS:
                out_sd[f"size_{name}"] = _size_quantile(needs[-1], cfg.interval)
    if sum(len(x) for x in needs) >= LOGO_MIN_ROWS:
        out_sd["size"] = _size_quantile(np.concatenate(needs), cfg.interval)
    return out_sd


def _validate_align(t: Table, X: np.ndarray, gid: np.ndarray, y: np.ndarray, sigma: float,
                    scale: float, cfg: ModelConfig, z: float, model: ModelClass
                    ) -> dict[str, float] | None:
    """The runtime's "align" spread (domain.align_widening), where the training data
    hold GPU models and dtypes with both aligned and unaligned rows (LOGO_MIN_ROWS each):
    their unaligned rows held out, a forest fitted on the rest, and what the upper end of
    each held-out row's interval needs to hold it, per unit of its align_share (the
    conformal quantile at the nominal share); "align_work" the same per unit of work_share
    (a calibration's offset's prior spread); "align_loss:DTYPE" their median loss
    (median_losses): what unaligned shapes cost where probes were aligned. None if no data."""
    ok = np.isfinite(y)
    low = unaligned(t)
    keys = np.char.add(_row_gpu_keys(t).astype(str), np.char.add("/", t["dtype"].astype(str)))
    out = np.zeros(len(t), dtype=bool)
    for k in np.unique(keys[ok & low]):
        g = ok & (keys == k)
        if (g & low).sum() >= LOGO_MIN_ROWS and (g & ~low).sum() >= LOGO_MIN_ROWS:
            out |= g & low
    train = ok & ~out
    if out.sum() < LOGO_MIN_ROWS or train.sum() < 3 * LOGO_MIN_ROWS:
        return None
    fold = _fold_model(t, np.flatnonzero(train), X, gid, "runtime", y, sigma, cfg, model)
    te = t.take(_test_rows(out, cfg.seed + 7))
    mu, sd = fold.raw_logs(te, scaled=False)["runtime"]
    mu = _clip_logs("runtime", te, mu)
    r = np.log(te["runtime_s"]) - mu
    out_ = median_losses(te, r, (aligned := align_share(te, mu)), LOGO_MIN_ROWS)
    for name, share in (("align", aligned), ("align_work", work_share(mu))):
        need = np.where(r > 0, _need(r, sd * scale, z, np.maximum(share, 1e-3)), 0.0)
        out_[name] = float(np.clip(conformal_quantile(need[np.isfinite(need)], cfg.interval),
                                   SIZE_SD_FLOOR, 3.0))
    return out_


def share_cut(v: np.ndarray, side: int = 1, share: float = SIZE_SHARE) -> float:
    """The distinct value of ``v`` (at least two) whose share of ``v`` beyond it (above
    for ``side`` 1, below for -1) is nearest ``share``: sizes often lie on a grid, where
    a quantile would leave nothing beyond it."""
    u = np.unique(v)
    cut = u[:-1] if side > 0 else u[1:]
    beyond = np.array([np.mean(side * (v - c) > 0) for c in cut])
    return float(cut[int(np.argmin(np.abs(beyond - share)))])


def _size_quantile(needs: np.ndarray, p: float) -> float:
    return float(np.clip(conformal_quantile(needs, p), SIZE_SD_FLOOR, 2.0))


def _choose_transfer(grid: Sequence[tuple[float, float]],
                     err: Mapping[tuple[float, float], Sequence[float]],
                     roof_err: Sequence[float]) -> tuple[float, float]:
    """The (w, a) of ``grid`` an unknown GPU is predicted with, from each candidate's
    error on each held-out GPU (``err``) and the roofline estimate's (``roof_err``): the
    least mean error relative to the roofline's among the candidates no worse than it on
    any held-out GPU (a mean can hide one GPU made worse: what is asked of a transfer is
    to beat the roofline on every GPU); where none is, the one whose worst GPU fares
    best. Ties go to the earlier candidate (the roofline estimate's level first)."""
    roof = np.asarray(roof_err, dtype=float)
    rel = {c: np.asarray(err[c], dtype=float) / roof for c in grid}
    safe = [c for c in grid if np.all(rel[c] <= 1.0 + 1e-6)]
    if safe:
        return min(safe, key=lambda c: (float(np.mean(rel[c])), grid.index(c)))
    return min(grid, key=lambda c: (float(np.max(rel[c])), float(np.mean(rel[c])),
                                    grid.index(c)))


def _validate_transfer(t: Table, X: np.ndarray, gid: np.ndarray, target: str,
                       y: np.ndarray, sigma: float, scale: float, cfg: ModelConfig, z: float,
                       tau: Mapping[str, float], model: ModelClass) -> dict[str, Any]:
    """Leave-one-GPU-out on the training data (at least two GPU models with the target
    measured): each GPU model in turn predicted by a forest of the others, as the model
    predicts a GPU it never saw. For runtime, every (w, a) of TRANSFER_GRID is judged
    (ForestModel.transfer_runtime) and one chosen by _choose_transfer (the least mean
    error relative to the roofline estimate's, each held-out GPU counted once, among
    those no worse than it on any). Returns {} without two
    GPU models, else {"w", "a", "gpus", "scores" (per candidate: mean MAPE / roofline
    MAPE), "mape" (per held-out GPU at the choice), "roofline_mape", "level_sd" (how far
    a held-out GPU's level was off: the root mean square of their median log residual),
    "shape_sd" (the scatter around it: median of their MAD x 1.4826) and "gpu_sd" (the
    spread that makes the nominal interval, with the other widenings a row gets, hold
    on the held-out GPUs' rows, each GPU weighted alike)}."""
    ok = np.isfinite(y)
    if not ok.any():
        return {}
    keys = _row_gpu_keys(t)
    names, counts = np.unique(keys[ok], return_counts=True)
    if len(names) < 2:
        return {}
    order = np.argsort(-counts, kind="stable")
    gpus = [str(names[i]) for i in order[:LOGO_MAX_GPUS] if counts[i] >= LOGO_MIN_ROWS]
    if not gpus:
        return {}
    eff = cfg.roofline_efficiency
    grid = TRANSFER_GRID if target == "runtime" else ((1.0, 1.0),)
    err: dict[tuple[float, float], list[float]] = {c: [] for c in grid}
    roof_err: list[float] = []
    folds = []
    fold_groups: list[np.ndarray] = []
    for g_i, g in enumerate(gpus):
        fold = _fold_model(t, np.flatnonzero(ok & (keys != g)), X, gid, target, y, sigma, cfg,
                           model)
        te_idx = _test_rows(ok & (keys == g), cfg.seed + g_i)
        te = t.take(te_idx)
        yt = np.log(te[COLUMN[target]])
        flags = domain_flags(fold.meta["domain"], te)
        mu, sd = fold.raw_logs(te, scaled=False)[target]
        cands = {}
        if target == "runtime":
            todo = flags["gpu"] & ~flags["kernel"]
            level = fold.forest_levels(te, todo)
            ref = np.log(runtime_reference(te))
            zz = np.where(todo, mu - ref - level, 0.0)
            for w, a in grid:
                p = np.where(todo, ref + (1 - w) * math.log(1 / eff) + w * level + a * zz, mu)
                cands[(w, a)] = _clip_logs(target, te, fold._fallback(target, te, p, flags))
            roof = features.roofline(te) / eff
            roof_err.append(float(np.mean(np.abs(roof / np.exp(yt) - 1))))
        else:
            cands[(1.0, 1.0)] = _clip_logs(target, te, mu)
            roof_err.append(float("nan"))
        for c, p in cands.items():
            err[c].append(float(np.mean(np.abs(np.expm1(p - yt)))))
        folds.append((yt, cands, sd * scale, flags))
        fold_groups.append(_groups(te))
    ratio = {c: float(np.mean(np.array(e) / np.array(roof_err))) if target == "runtime"
             else float(np.mean(e)) for c, e in err.items()}
    best = _choose_transfer(grid, err, roof_err) if target == "runtime" else grid[0]
    levels, spreads, needs, weights = [], [], [], []
    for yt, cands, sd, flags in folds:
        r = yt - cands[best]
        med = float(np.median(r))
        levels.append(med)
        spreads.append(1.4826 * float(np.median(np.abs(r - med))))
        other = widen(target, np.zeros(len(r)), flags, skip=("gpu",), tau=tau)
        needs.append(_need(r, np.hypot(sd, other), z, np.ones(len(r))))
        weights.append(np.full(len(r), 1.0 / len(r)))
    gpu_sd = _weighted_conformal_quantile(np.concatenate(needs), np.concatenate(weights),
                                          cfg.interval)
    shape_sd = float(np.median(spreads)) or RESID_SD0
    n0s, gain, cal_scale, group_n0s, dof0s = _validate_calibration(
        [(yt - cands[best], g) for (yt, cands, _, _), g in zip(folds, fold_groups)],
        shape_sd, cfg.seed, cfg.interval, groups=target == "runtime")
    return {"w": best[0], "a": best[1], "gpus": gpus,
            "scores": {f"{w:g},{a:g}": v for (w, a), v in ratio.items()},
            "mape": dict(zip(gpus, err[best])),
            "roofline_mape": dict(zip(gpus, roof_err)) if target == "runtime" else {},
            "level_sd": float(np.sqrt(np.mean(np.square(levels)))),
            "shape_sd": shape_sd, "gpu_sd": float(np.clip(gpu_sd, 0.02, 3.0)),
            "level_n0": n0s.get("5", level_n0({}, 5, target)),
            "level_n0_by_n": n0s, "group_n0_by_n": group_n0s, "calibration_gain": gain,
            "interval_scale_by_n": cal_scale, "resid_dof0_by_n": dof0s}


# How many probes' worth the prior's level counts for against a new GPU's own
# (calibrate: the level is shrunk toward the prior by this pseudo-count), the candidates
# leave-one-GPU-out judges: simulated calibrations of each held-out GPU on CAL_PROBES
# random rows of it (CAL_DRAWS draws each), judged on all its rows, per number of
# probes: the pseudo-count with the least mean error relative to no calibration among
# those that are no worse than none on any held-out GPU (the largest among equals: the
# prior is kept unless the probes help; where none is, the one whose worst GPU fares
# best). Per number of probes, for one pseudo-count does not serve all: on heavy-tailed
# timings a few probes' level is noise that can cost more than the prior's bias. On the
# shared data one pseudo-count for 5 and 20 probes (by their mean) was 8 for the prior
# of the RTX 4070, H100 and MI355X: 5 probes of the held-out H100 were then worse than
# none there, and of the B200 (27.8% -> 28.7%) when it was left out; now 16-128 at 5
# probes, 8-128 at 50.
LEVEL_N0_GRID = (0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0)
# A dtype/kernel's own pseudo-count for its offset on top of the level (runtime), the
# candidates beside the level's: judged per group at the level chosen, the others as
# uncertain as the level. On the shared data tf32 sits 0.16-0.88 in log from a held-out
# GPU's median under the other GPUs' prior (H100, MI355X, B200) while fp16, bf16 and fp8
# sit within 0.09: one pseudo-count for all kept tf32 where the prior put it (a freed
# offset for every group made the B200 worse than no calibration). For the prior of all
# four, tf32 gets 1, bf16 4 at 20 and 50 probes (the level 32, 64). The H200, which no
# prior here saw, has tf32 at +0.165 (bench/RESULTS.md, the ninth session).
GROUP_N0_GRID = (1.0, 4.0)
# (1: what the first probes are served with, the scatter guess's weight above all: at half a
# probe's worth one probe's Student-t has half a degree of freedom)
CAL_PROBES = (1, 5, 20, 50)
CAL_DRAWS = 20
CAL_SCALE_MIN, CAL_SCALE_MAX = 0.5, 2.0  # the validated interval scale, within these
# The weight in probes of the scatter guessed before a new GPU's probes (the held-out
# GPUs' median, s0) against the probes' own, the candidates: the one whose simulated
# calibrations leave each held-out GPU's coverage nearest the nominal (one scale serves
# all GPUs; how much the probes' scatter counts decides which GPU gets how wide an
# interval). On the shared data 0.5 at 5 probes for four of the five priors (mean
# distance 2.3-2.9 -> 0.3-1.4 points; the prior without the H100 chose 3): a GPU whose
# probes scatter 0.05 around their offsets was given 0.23 by the guess worth 3 probes.
RESID_DOF0_GRID = (0.5, 1.0, 2.0, 3.0, 5.0, 10.0)


def _validate_calibration(resid: Sequence[tuple[np.ndarray, np.ndarray]], s0: float,
                          seed: int, interval: float = 0.9, groups: bool = False
                          ) -> tuple[dict[str, float], dict[str, float], dict[str, float],
                                     dict[str, dict[str, float]], dict[str, float]]:
    """({probes: the chosen pseudo-count of LEVEL_N0_GRID}, {probes: mean error relative
    to none at that choice}, {probes: the interval scale at that choice}, {dtype/kernel
    group: {probes: its own pseudo-count}}, {probes: the scatter guess's weight of
    RESID_DOF0_GRID}) from each held-out GPU's log residuals
    (measured minus predicted, as carried over) and dtype/kernel group per row:
    calibrate's level and group offsets, each with that pseudo-count, on random rows of
    the GPU, judged on all of its rows; the scale is what the calibrated prior's
    posterior interval (DeviceCalibration.variance, Student-t) needs to hold the nominal
    share of those rows (_calibration_scale) with the scatter's weight that leaves each
    GPU's share nearest it (_dof0_choice). With ``groups``, each group of at least two
    held-out GPUs, a minority of each one's rows, is then judged on its own at that level
    (GROUP_N0_GRID, the others' offsets as uncertain as the level; the level's among
    equals), kept where it chose otherwise and the choices together leave no held-out GPU
    worse than none (or than the level alone left it, where that was worse). Empty where
    no GPU has 2 x the probes."""
    rng = np.random.default_rng(seed)
    # one probe's draws from a generator of their own: the others' are as before it was
    # judged (a choice among 20 draws moves with them)
    rng1 = np.random.default_rng((seed, 1))
    # probes -> per held-out GPU: residuals, group index per row, group names, draws
    gpus: dict[int, list[tuple[np.ndarray, np.ndarray, np.ndarray, list[np.ndarray]]]] = {
        n: [] for n in CAL_PROBES}
    for r, grp in resid:
        ok = np.isfinite(r)
        r, grp = r[ok], grp[ok].astype(str)
        if float(np.mean(np.abs(np.expm1(-r)))) <= 0:
            continue
        names_all, g_all = np.unique(grp, return_inverse=True)
        for n in CAL_PROBES:
            if len(r) < 2 * n:
                continue
            gen = rng1 if n == 1 else rng
            gpus[n].append((r, g_all.ravel(), names_all,
                            [gen.choice(len(r), n, replace=False) for _ in range(CAL_DRAWS)]))

    def run(per_gpu: list[tuple[np.ndarray, np.ndarray, np.ndarray, list[np.ndarray]]],
            n0: float, own: Mapping[str, float], need: Sequence[float] = ()
            ) -> tuple[list[float], dict[float, list[np.ndarray]]]:
        """Per held-out GPU: the mean error relative to none of calibrations with the
        level's pseudo-count ``n0`` and the groups' ``own`` (else n0); per weight of the
        scatter guess in ``need``, what each row's interval must be scaled by (the same
        calibrations: their offsets do not depend on it)."""
        tau = s0 / math.sqrt(n0)
        ratios: list[float] = []
        needs: dict[float, list[np.ndarray]] = {d: [] for d in need}
        for r, g_all, names_all, draws in per_gpu:
            tau_all = np.array([s0 / math.sqrt(own.get(str(nm), n0)) for nm in names_all])
            errs: list[float] = []
            nd: dict[float, list[np.ndarray]] = {d: [] for d in need}
            for idx in draws:
                present, gi = np.unique(g_all[idx], return_inverse=True)
                b, cg, _, _ = _robust_offsets(r[idx], gi.ravel(), len(present), s0, tau,
                                              tau_all[present])
                shift = np.full(len(names_all), b)
                shift[present] += cg
                errs.append(float(np.mean(np.abs(np.expm1(shift[g_all] - r)))))
                for d in need:
                    nd[d].append(_calibration_need(r, g_all, idx, b + cg[gi.ravel()],
                                                   shift, s0, tau, interval, tau_all, d))
            ratios.append(float(np.mean(errs)) / float(np.mean(np.abs(np.expm1(-r)))))
            for d in need:
                needs[d].append(np.concatenate(nd[d]))
        return ratios, needs

    def best(cands: Sequence[float], ratio: Mapping[float, list[float]],
             keep: float | None = None) -> float:
        # the least mean error among the candidates no worse than none on any held-out
        # GPU, ``keep`` (the level's, for a group) among equals, else the largest (the
        # prior is kept unless the probes help); where none is, the one whose worst GPU
        # fares best
        safe = [c for c in cands if max(ratio[c]) <= 1.0]
        return min(safe, key=lambda c: (round(float(np.mean(ratio[c])), 4), c != keep, -c)) \
            if safe else min(cands, key=lambda c: (round(max(ratio[c]), 4), c != keep, -c))

    chosen: dict[str, float] = {}
    gain: dict[str, float] = {}
    scale: dict[str, float] = {}
    own_by_n: dict[str, dict[str, float]] = {}
    dof0_by_n: dict[str, float] = {}
    for n, per_gpu in gpus.items():
        if not per_gpu:
            continue
        ratio = {n0: run(per_gpu, n0, {})[0] for n0 in LEVEL_N0_GRID}
        n0 = best(LEVEL_N0_GRID, ratio)
        own: dict[str, float] = {}
        if groups:
            # groups of two held-out GPUs or more, a minority of the rows of each: where a
            # group is most of a GPU's rows its offset is that GPU's level, which the
            # level's pseudo-count already judged (freeing the H100's fp8, 60% of its rows,
            # freed its level, and the MI355X's fp8, whose variants run 2x apart, then made
            # 5 probes worse than none: 38.1% against 32.3%)
            seen: dict[str, int] = {}
            most: set[str] = set()
            for _, g_all, names_all, _ in per_gpu:
                share = np.bincount(g_all, minlength=len(names_all)) / len(g_all)
                for nm, sh in zip(names_all, share):
                    seen[str(nm)] = seen.get(str(nm), 0) + 1
                    if sh >= 0.5:
                        most.add(str(nm))
            for nm in sorted(g for g, k in seen.items() if k >= 2 and g not in most):
                cands = [n0, *[g0 for g0 in GROUP_N0_GRID if g0 != n0]]
                r_g = {n0: ratio[n0], **{g0: run(per_gpu, n0, {nm: g0})[0]
                                         for g0 in cands[1:]}}
                g0 = best(cands, r_g, keep=n0)
                if g0 != n0:
                    own[nm] = g0
        ratios, by_dof0 = run(per_gpu, n0, own, RESID_DOF0_GRID)
        # together: no held-out GPU worse than none, or than the level alone left it
        if own and any(a > max(1.0, b) for a, b in zip(ratios, ratio[n0])):
            own = {}
            ratios, by_dof0 = run(per_gpu, n0, own, RESID_DOF0_GRID)
        chosen[str(n)], gain[str(n)] = n0, float(np.mean(ratios))
        dof0_by_n[str(n)] = _dof0_choice(by_dof0, interval)
        scale[str(n)] = _calibration_scale(by_dof0[dof0_by_n[str(n)]], interval)
        for nm, g0 in own.items():
            own_by_n.setdefault(nm, {})[str(n)] = g0
    # a group that chose its own at some counts keeps the level's at the others
    for by_n in own_by_n.values():
        for k, v in chosen.items():
            by_n.setdefault(k, v)
    return chosen, gain, scale, own_by_n, dof0_by_n


def _dof0_choice(needs: Mapping[float, Sequence[np.ndarray]], interval: float) -> float:
    """Of the scatter guess's weights (``needs``: per weight, each held-out GPU's rows'
    need), the one whose pooled scale (_calibration_scale) leaves the GPUs' coverage
    nearest the nominal on average (to 0.1 points; among equals RESID_DOF0's, else the
    heavier guess)."""
    def spread(d: float) -> tuple[float, bool, float]:
        q = _calibration_scale(needs[d], interval)
        dev = np.mean([abs(float(np.mean(x <= q)) - interval) for x in needs[d]])
        return round(float(dev), 3), d != RESID_DOF0, -d
    return min(needs, key=spread)


def _calibration_need(r: np.ndarray, g_all: np.ndarray, idx: np.ndarray, fit: np.ndarray,
                      shift: np.ndarray, s0: float, tau: float, interval: float,
                      tau_g: np.ndarray | None = None, dof0: float = RESID_DOF0
                      ) -> np.ndarray:
    """Per row of a held-out GPU: its distance from the calibration on the rows ``idx``
    (offsets ``shift`` per group; ``fit`` at the probes) over the half-width of the
    interval calibrate gives it (DeviceCalibration.variance: the scatter after the
    offsets with the guess ``s0`` worth ``dof0`` probes, a Student-t on dof0 + probes - 1
    degrees of freedom, the offsets' uncertainty, a group's prior spread where no probe
    covers it: ``tau_g`` per group, else ``tau``)."""
    n = len(idx)
    dof = dof0 + max(n - 1, 0)
    s2 = (dof0 * s0**2 + float(np.sum((r[idx] - fit) ** 2))) / dof
    n_g = np.bincount(g_all[idx], minlength=len(shift))[g_all].astype(float)
    tg = np.full(len(shift), tau) if tau_g is None else tau_g
    tr = tg[g_all]
    var = s2 * (1.0 + 1.0 / (n + s0**2 / tau**2)) + np.where(
        n_g == 0, tr**2, s2 / (n_g + s2 / tr**2))
    half = _t_quantile(dof, 0.5 + interval / 2) * np.sqrt(var)
    return np.abs(r - shift[g_all]) / half


def _calibration_scale(per_gpu: Sequence[np.ndarray], interval: float) -> float:
    """The factor on the calibrated prior's interval that holds the nominal share of the
    held-out GPUs' rows, each GPU weighted alike (as the "gpu" widening is measured),
    within CAL_SCALE_MIN and CAL_SCALE_MAX. Where the probes can judge their own interval
    (TransferModel's cross-validation, from 9 out-of-fold errors at 90%) they take over:
    it rescales the interval as served, this factor included."""
    q = _weighted_conformal_quantile(
        np.concatenate(per_gpu), np.concatenate([np.full(len(x), 1.0 / len(x))
                                                 for x in per_gpu]), interval)
    return float(np.clip(q, CAL_SCALE_MIN, CAL_SCALE_MAX))
