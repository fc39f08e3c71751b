"""TransferModel: a prior model of other GPUs carried over to new devices by their
probes, with the recipe per target (the calibrated prior, few-probe trees, a blend,
residual trees, a forest of the device's own) chosen by cross-validation over them."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection, Sequence
from statistics import NormalDist
from typing import Any

import numpy as np

from gemmd import bounds, features
from gemmd.config import ModelConfig
from gemmd.errors import ModelError
from gemmd.features import Table
from gemmd.gemm import COLUMN, TARGETS, ProbeSpec
from gemmd.hardware import gpu_model_key
from gemmd.model.calibration import _calibrated_logs, calibrate, probed_losses, with_probe_sources
from gemmd.model.choosing import _select, held_devices, other_settings, served, setting_name
from gemmd.model.domain import (
    MIN_SD,
    align_loss,
    beyond_widening,
    domain_flags,
    domain_record,
    prior_domain,
    result,
    served_flags,
    shares,
    size_widening,
    to_predictions,
    upward,
    widen,
)
from gemmd.model.flat import _FLAT_MAX_ROWS, _FlatForest, _per_tree
from gemmd.model.forest import ForestModel
from gemmd.model.intervals import (
    _t_quantile,
    cv_interval_scale,
    min_cv_rows,
    min_narrow_rows,
)
from gemmd.model.offsets import DeviceCalibration, _groups, launch_share, unaligned_work
from gemmd.model.persistence import _configs
from gemmd.model.repeats import shape_hashes
from gemmd.model.space import from_model_space
from gemmd.model.trees import _fit_trees
from gemmd.records import DeviceInfo, Prediction

MIN_GROUP_PROBES = 10  # probes of a dtype/kernel before trees on the probes predict it
# Probes before the cross-validation over them runs, at least (first_cv_probes: 9 at 90%)
MIN_SELECT = 5
MIN_RESIDUAL = 10  # probes in a fold's training before trees on the calibrated residuals
CV_FOLDS = 5
CV_MAX_ROWS = 2000  # cross-validation of the choice reads at most this many probes
CHOICES = ("calibrated", "residual", "own", "few", "blend")
# "blend": the calibrated prior and the few-probe trees averaged in log space, the trees
# weighted by one of these (the one cross-validation over the probes finds best): the
# prediction moves from the prior toward the device's own data as far as the probes show
# skill, not all at once.
BLEND_WEIGHTS = (0.25, 0.5, 0.75)
# The recipe is the calibrated prior (its shrinkage validated at fit time: a few probes
# cannot make it worse than none on the training GPUs); from MIN_OVERRIDE probes another
# (few-probe trees, a blend of them with the calibrated prior, residual trees, gemmd's
# forest on the probes; another transfer setting) replaces it where cross-validation
# over the probes finds it better by choosing.SELECT_SE standard errors of the paired
# difference. Until issue 25 "few" was the default from 5 probes: 5 probes were then
# worse than none on 5 of 9 GPUs of one evaluation (V100 55.5% against 25.2%) and here
# on B200 -> H100 (27.2% against 18.0%).
DEFAULT_CHOICE = "calibrated"
MIN_OVERRIDE = 10


class TransferModel:
    """A prior model of other GPUs, carried over to the devices of ``calibrations``.

    Per device: without probes, the prior's prediction (an unknown GPU carried over as
    leave-one-GPU-out chose, ForestModel.transfer_runtime); from one probe, the prior
    corrected by the device's calibration (a device-wide offset, then per dtype/kernel,
    shrunk toward the prior by the pseudo-count validation chose: calibrate); from
    first_cv_probes (9 at the nominal 90%), a cross-validation over the probes (grouped
    by shape) that may widen or narrow the calibrated prior's interval; from MIN_OVERRIDE
    probes, per target, the recipe it finds better than the calibrated prior by SELECT_SE
    standard errors: the few-probe trees ("few"), a blend of them with the calibrated
    prior ("blend"), the calibrated prior plus trees on what it leaves unexplained
    ("residual", in the folds that train on MIN_RESIDUAL probes: from about 12) or gemmd's
    forest on the probes ("own"), or on a GPU the prior never saw the calibrated prior
    carried by another transfer setting than its own (choosing, runtime only). A
    dtype/kernel the device has no probe of is predicted by the calibrated prior whatever
    the recipe, a kernel the prior never saw by the trees from MIN_GROUP_PROBES of it.
    Inside the physical bounds (gemmd.bounds). Same interface as ForestModel.
    """

    kind = "transfer"

    def __init__(self, prior: ForestModel, calibrations: dict[str, DeviceCalibration],
                 choice: dict[str, str] | None = None, own: ForestModel | None = None,
                 residual: dict[str, tuple[Any, float]] | None = None,
                 cv_scale: dict[str, float] | None = None, meta: dict[str, Any] | None = None,
                 few: dict[str, tuple[Any, float]] | None = None,
                 probe_domain: dict[str, Any] | None = None,
                 few_groups: dict[str, list[str]] | None = None):
        self.prior = prior
        self.calibrations = calibrations
        self.choice = choice or {}
        self.own = own
        # target -> (trees, noise of one measurement): on log(measured / calibrated prior)
        self.residual = residual or {}
        self.few = few or {}  # on the probes' model space
        self.cv_scale = cv_scale or {}  # per target: the chosen recipe's interval factor
        self.probe_domain = probe_domain  # domain_record of the probes
        # per target: probed dtype/kernel groups whose kernel the prior never saw (its
        # prediction there is the roofline estimate, with no shape at all): the
        # few-probe trees predict them whatever the recipe (unknown_kernel_groups)
        self.few_groups = few_groups or {}
        self.blend: dict[str, float] = {}  # per target choosing "blend": the trees' weight
        self.z = prior.z
        self.base_prior = prior  # as given to fit: a refit starts from it (choosing)
        self.meta = {**prior.meta, **(meta or {})}
        self.version = f"{prior.version}+cal"
        self.devices: list[DeviceInfo] = []  # the calibrated devices (set by fit)
        self._flat: dict[str, _FlatForest] = {}

    def device_infos(self) -> list[DeviceInfo]:
        """The prior's training devices and the calibrated ones."""
        known = self.prior.device_infos()
        return known + [d for d in self.devices if d.uuid not in {k.uuid for k in known}]

    # ------------------------------------------------------------- fitting
    @classmethod
    def fit(cls, prior: ForestModel, t: Table, cfg: ModelConfig, *,
            own: ForestModel | None = None, n_jobs: int = 1,
            select: bool = True, launch: Collection[str] = ()) -> TransferModel:
        """Calibrate ``prior`` to the devices of ``t`` (their probes) and, with enough
        probes, choose per target between the calibrated prior, residual trees, own
        forest and few-probe trees by cross-validation, and for runtime on a GPU the
        prior never saw, from MIN_OVERRIDE probes, the prior's transfer setting (the
        calibrated prior carried as another (w, a) says), on any a launch offset (choosing;
        the choice in ``meta["transfer"]["setting"]``). ``own``: a forest already fitted
        on ``t`` (else fitted here when chosen); ``launch``: calibrate's."""
        cals = calibrate(prior, t, launch) if len(t) else {}
        n = len(t)
        choice = {tg: "calibrated" for tg in TARGETS}
        cv_scale: dict[str, float] = {}
        meta: dict[str, Any] = {"transfer": {"probes": n, "devices": sorted(cals)},
                                "probe_configs": _configs(t)}
        devices = [d for j, d in enumerate(t.devices) if (t.device == j).any()]
        if not select or n < first_cv_probes(cfg.interval):
            out = cls(prior, cals, choice, meta=meta)
            out.devices = devices
            return out
        # a GPU model the prior never saw, with as many probes of its own as may replace
        # the default: how far the prior carries to it competes with the recipes
        settings, gpus = other_settings(prior, t, MIN_OVERRIDE)
        sub, picked, held = cls._cv(prior, t, cfg, n_jobs, settings, gpus)
        base = prior
        if picked.get("runtime") in settings:  # served as the calibrated prior
            name, was = picked["runtime"], setting_name(*prior.transfer_setting())
            prior, launch, (w, a) = served(prior, name, gpus, t, MIN_OVERRIDE)
            cals, rec = calibrate(prior, t, launch), sub["runtime"]
            rec[was], rec["calibrated"] = rec["calibrated"], rec.pop(name)
            picked["runtime"] = "calibrated"
            meta["transfer"]["setting"] = dict(w=w, a=a, was=was, gpus=gpus, launch=bool(launch))
        for target, c in picked.items():
            choice[target] = c
            cv_scale[target] = sub[target][c]["scale"]
        meta["transfer"]["cv"] = sub
        icfg = dataclasses.replace(cfg, min_samples=2)
        if "own" in choice.values() and own is None:
            try:
                own = ForestModel.fit_table(t, icfg, n_jobs=n_jobs)
            except ModelError:
                own = None
        few_groups = unknown_kernel_groups(prior, t)
        wanted = {c: [tg for tg, x in choice.items() if x == c or (
            c == "few" and (tg in few_groups or x == "blend"))] for c in ("few", "residual")}
        uuids = np.array([d.uuid for d in t.devices], dtype=object)

        def learnt(tg: str) -> np.ndarray:
            """The probes the trees of ``tg`` learn from: a held device's only where they
            serve it (a kernel the prior never ran). Two cards, the held one's probes in
            the other's trees: the other 11.5 / 16.7 / 17.0 / 12.5% off, without them
            9.8 / 16.6 / 11.5 / 9.5% (bench/RESULTS.md, the eighteenth session)."""
            if not held.get(tg) or choice[tg] == "calibrated":
                return np.arange(len(t))
            return np.flatnonzero(~(np.isin(uuids[t.device], held[tg]) & ~np.isin(
                _groups(t), few_groups.get(tg, []))))

        few: dict[str, tuple[Any, float]] = {}
        residual: dict[str, tuple[Any, float]] = {}
        base_logs = _calibrated_logs(prior, cals, t) if wanted["residual"] else {}
        for tg in wanted["few"]:
            few.update(_fit_trees(t.take(learnt(tg)), cfg, [tg], n_jobs=n_jobs))
        for tg in wanted["residual"]:
            residual.update(_fit_trees(t.take(i := learnt(tg)), cfg, [tg], {
                k: v[i] for k, v in base_logs.items()}, n_jobs))
        residual = {tg: (et, math.hypot(noise, sub.get(tg, {}).get("residual", {}).get(
            "floor", 0.0))) for tg, (et, noise) in residual.items()}
        for target, c in choice.items():
            if (c == "own" and (own is None or target not in own.forests)) or \
                    (c == "residual" and target not in residual) or \
                    (c in ("few", "blend") and target not in few):
                choice[target] = "calibrated"
                cv_scale[target] = sub.get(target, {}).get("calibrated", {}).get("scale", 1.0)
        meta["transfer"]["choice"] = dict(choice)
        # per target, the devices whose own probes keep the calibrated prior
        meta["transfer"]["held"] = {tg: held[tg] for tg, c in choice.items()
                                    if c != "calibrated" and held.get(tg)}
        few_groups = {tg: g for tg, g in few_groups.items() if tg in few}
        meta["transfer"]["few_groups"] = few_groups
        out = cls(prior, cals, choice, own if "own" in choice.values() else None, residual,
                  cv_scale, meta, few, domain_record(t), few_groups)
        out.base_prior = base
        out.blend = {tg: float(sub[tg]["blend"]["weight"]) for tg, c in choice.items()
                     if c == "blend"}
        out.devices = devices
        return out

    @classmethod
    def _cv(cls, prior: ForestModel, t: Table, cfg: ModelConfig, n_jobs: int,
            settings: Sequence[str] = (), gpus: Sequence[str] = ()
            ) -> tuple[dict[str, dict[str, dict[str, float]]], dict[str, str],
                       dict[str, list[str]]]:
        """Cross-validation over the probes, grouped by shape (the recipes fitted without a
        fold have seen none of its shapes): per target and recipe, the mean absolute
        percentage error of the out-of-fold predictions ("err"), their number ("n") and
        the interval "scale" that makes the nominal share of them covered
        (cv_interval_scale; per kernel too, "by_kernel"); for "blend", the best of
        BLEND_WEIGHTS ("weight"); and per target the recipe chosen: DEFAULT_CHOICE
        unless, from MIN_OVERRIDE probes, another has a lower error by SELECT_SE standard
        errors of the paired difference; per target the devices whose own probes keep
        the calibrated prior (choosing.held_devices). ``settings``: transfer settings
        (choosing) whose calibrated prior, carried so for the GPU models ``gpus``, is
        judged beside them for runtime, as one more recipe."""
        from sklearn.model_selection import GroupKFold

        cap = cv_max_rows(cfg.interval)
        if len(t) > cap:
            t = t.take(np.sort(np.random.default_rng(0).choice(len(t), cap, replace=False)))
        gid = np.unique(shape_hashes(t), return_inverse=True)[1].ravel()
        folds = min(CV_FOLDS, len(np.unique(gid)))
        if folds < 2:
            return {}, {}, {}
        icfg = dataclasses.replace(cfg, min_samples=2, n_estimators=min(cfg.n_estimators, 50))
        z = NormalDist().inv_cdf(0.5 + cfg.interval / 2)
        # recipe -> target -> (log point, log sd) per row, NaN where not predicted
        pred: dict[str, dict[str, tuple[np.ndarray, np.ndarray]]] = {
            c: {} for c in (*CHOICES, *settings) if c != "blend"}
        ways = {name: served(prior, name, gpus, t, MIN_OVERRIDE)[:2] for name in settings}
        for train, test in GroupKFold(folds).split(np.zeros(len(t)), groups=gid):
            tr, te = t.take(train), t.take(test)
            base = cls.fit(prior, tr, cfg, select=False)
            cals, dom = base.calibrations, domain_record(tr)
            recipes: dict[str, TransferModel] = {"calibrated": base}
            try:
                own = ForestModel.fit_table(tr, icfg, n_jobs=n_jobs)
                recipes["own"] = cls(prior, cals, dict.fromkeys(own.forests, "own"), own)
            except ModelError:
                pass
            few = _fit_trees(tr, icfg, list(prior.forests), n_jobs=n_jobs)
            recipes["few"] = cls(prior, cals, dict.fromkeys(few, "few"), few=few,
                                 probe_domain=dom)
            fg = {tg: g for tg, g in unknown_kernel_groups(prior, tr).items() if tg in few}
            if fg:  # the calibrated prior as served: few-probe trees where it has no shape
                recipes["calibrated"] = cls(prior, cals, few=few, probe_domain=dom,
                                            few_groups=fg)
            if len(tr) >= MIN_RESIDUAL:
                res = _fit_trees(tr, icfg, list(prior.forests),
                                 _calibrated_logs(prior, cals, tr), n_jobs)
                # served as it will be: few-probe trees where the prior has no shape
                recipes["residual"] = cls(prior, cals, dict.fromkeys(res, "residual"), None,
                                          res, probe_domain=dom, few=few, few_groups=fg)
            for name, (pr, launch) in ways.items():  # the calibrated prior as served
                c = cls.fit(pr, tr, cfg, select=False, launch=launch)
                recipes[name] = cls(c.prior, c.calibrations, few=few, probe_domain=dom,
                                    few_groups=fg) if fg else c
            for name, model in recipes.items():
                for target, r in model.predict_table(te).items():
                    if name in settings and target != "runtime":
                        continue  # (the setting moves runtime only)
                    p = pred[name].setdefault(target, (np.full(len(t), np.nan),
                                                       np.full(len(t), np.nan)))
                    p[0][test] = np.log(r["point"])
                    p[1][test] = (np.log(r["hi"]) - np.log(r["point"])) / z
        out: dict[str, dict[str, dict[str, float]]] = {}
        apes: dict[str, dict[str, np.ndarray]] = {}
        for target in pred["few"]:
            if target not in pred["calibrated"]:
                continue
            (mc, sc), (mf, sf) = pred["calibrated"][target], pred["few"][target]
            with np.errstate(divide="ignore", invalid="ignore"):
                y = np.log(t[COLUMN[target]])
            err_f = np.abs(y - mf)
            err_f = err_f[np.isfinite(err_f)]
            if err_f.size < MIN_SELECT:
                continue
            floor = 1.4826 * float(np.median(err_f))
            sf = np.hypot(sf, floor)
            for lam in BLEND_WEIGHTS:
                pred.setdefault(f"blend:{lam:g}", {})[target] = (
                    (1 - lam) * mc + lam * mf, np.sqrt((1 - lam) * sc**2 + lam * sf**2))
        for name, per in pred.items():
            for target, (mu, sd) in per.items():
                with np.errstate(divide="ignore", invalid="ignore"):
                    y = np.log(t[COLUMN[target]])
                ok = np.isfinite(y) & np.isfinite(mu) & np.isfinite(sd)
                if ok.sum() < MIN_SELECT:
                    continue
                err = np.abs(y[ok] - mu[ok])
                rec: dict[str, Any] = {}
                sdv, hi = sd[ok], 4.0
                if name in ("few", "residual"):
                    # The trees' spread vanishes on a configuration they were fitted on,
                    # and without repeats the noise of a measurement is unknown: a floor
                    # of the typical out-of-fold error (as the forests' OOB residual).
                    rec["floor"] = float(1.4826 * np.median(err))
                    sdv, hi = np.hypot(sdv, rec["floor"]), 8.0
                scores = err / np.maximum(sdv, 1e-9)
                q = cv_interval_scale(scores, cfg.interval, z, hi)
                # Kernels differ in how well they are predicted (GPPerf's naive tiled
                # kernel is off by 50-100% where CUTLASS is off by 5%): one factor for
                # both over-covers the one and under-covers the other. A kernel with
                # enough out-of-fold errors gets its own.
                kern = t["kernel"][ok]
                if len(set(kern)) > 1:
                    rec["by_kernel"] = {
                        str(k): cv_interval_scale(scores[kern == k], cfg.interval, z, hi)
                        for k in np.unique(kern)
                        if (kern == k).sum() >= min_cv_rows(cfg.interval)}
                ape = np.full(len(t), np.nan)
                ape[ok] = np.abs(np.expm1(mu[ok] - y[ok]))  # what MAPE averages
                apes.setdefault(target, {})[name] = ape
                out.setdefault(target, {})[name] = {"err": float(np.nanmean(ape)),
                                                    "scale": q,
                                                    "n": int(ok.sum()), **rec}
        for target, recs_ in out.items():  # the blend: its best weight only
            blends = [n for n in recs_ if n.startswith("blend:")]
            if blends:
                best = min(blends, key=lambda n: recs_[n]["err"])
                recs_["blend"] = {**recs_[best], "weight": float(best.split(":")[1])}
                apes[target]["blend"] = apes[target][best]
            for n in blends:
                del recs_[n]
                del apes[target][n]
        picked = {target: _select(errs, DEFAULT_CHOICE, override=len(t) >= MIN_OVERRIDE)
                  for target, errs in apes.items()}
        held = {tg: held_devices(apes[tg], c, t.device, [d.uuid for d in t.devices])
                for tg, c in picked.items()}
        return out, picked, held

    # ------------------------------------------------------------- predicting
    def predict(self, specs: Sequence[ProbeSpec], infos: Sequence[DeviceInfo],
                source: str = "") -> list[Prediction]:
        if not specs:
            return []
        return to_predictions(self.predict_table(Table.from_specs(specs, infos, source)),
                              len(specs))

    def calibration_of(self, info: DeviceInfo) -> DeviceCalibration | None:
        """The device's calibration; else that of a calibrated card of the same model: one
        held for no target if any (a held card is unlike the others), the most probed
        (an unprobed card beside a held one and a slow one, alike the slow one, took the
        held one's calibration with the recipe: 16-29% off)."""
        cal = self.calibrations.get(info.uuid)
        if cal is None:
            key = gpu_model_key(info)
            held = {u for v in self.meta.get("transfer", {}).get("held", {}).values()
                    for u in v}
            cal = min((c for c in self.calibrations.values() if c.gpu == key),
                      key=lambda c: (c.uuid in held, -c.n), default=None)
        return cal

    def predict_table(self, t: Table) -> dict[str, dict[str, np.ndarray]]:
        if not len(t):
            return {}
        cals = [self.calibration_of(d) for d in t.devices]
        t = with_probe_sources(t, cals)
        logs, flags0 = self.prior.prior_logs(t)
        extra: dict[str, dict[str, Any]] = {}
        for cal_ in (c for c in cals if c is not None):
            for target, dom in cal_.domain.items():
                extra.setdefault(target, {})[cal_.gpu] = dom
        # the trees' and own forest's flags: no upward widening where their probes measured
        # the loss (they learn it: the H200's fp32 at 10 probes kept a 10x upper end, 1.1x
        # off); the calibrated prior's: prior flags for unaligned shapes, its pairs
        trees_f = self.prior.target_flags(t, extra) if extra else flags0
        prior_f = self.prior.target_flags(t, prior_domain(extra)) if extra else flags0
        flags, flags_prior = probed_losses(t, cals, trees_f, prior_f)
        on_prior: dict[str, np.ndarray] = {}  # per target: the calibrated prior's rows
        zrows: dict[str, np.ndarray] = {}  # per target: each row's interval quantile
        groups, work, share = _groups(t), unaligned_work(t, logs), launch_share(t, logs)
        has = np.array([c is not None for c in cals])[t.device]
        used = {self.choice.get(tg, "calibrated") for tg in logs} if has.any() else set()
        if has.any() and (self.few_groups or "blend" in used):
            used.add("few")
        out: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        own_res = self.own.predict_table(t) if self.own is not None and "own" in used else {}
        res_logs = self._tree_logs("residual", self.residual, t) if "residual" in used else {}
        few_logs = self._tree_logs("few", self.few, t) if "few" in used else {}
        # how far outside the probes' sizes a row is (the trees on them extrapolate flat)
        near_fl = domain_flags(self.probe_domain, t) if self.probe_domain and \
            "few" in used else None
        q = NormalDist().inv_cdf(0.5 + float(self.meta.get("interval", 0.9)) / 2)
        recs = self.prior.meta.get("domain_targets") or {}
        align = shares(t, logs)
        for target, (mu, sd) in logs.items():
            tau = self.prior.ood_sd(target)
            kernels = set((recs.get(target) or self.prior.meta.get("domain") or {}).get(
                "kernels", []))
            mu, sd = mu.copy(), widen(target, sd, flags0[target], tau=tau, share=align)
            choice = self.choice.get(target, "calibrated")
            zrow = zrows[target] = np.full(len(t), self.z)
            onp = on_prior[target] = np.zeros(len(t), dtype=bool)
            # per row, the widening for lying beyond the probes' sizes (the trees on them
            # extrapolate flat), and beyond the prior's
            near = size_widening(tau, near_fl, least=False) if near_fl is not None else \
                np.zeros(len(t))
            beyond = beyond_widening(target, tau, flags[target], align)
            beyond_prior = beyond_widening(target, tau, flags_prior[target], align)
            scale = self._row_scale(target, choice, t["kernel"],
                                    self.cv_scale.get(target, 1.0))
            # the calibrated prior's factor: its own where it is not the chosen recipe
            held = set(self.meta.get("transfer", {}).get("held", {}).get(target, ()))
            cal_scale = scale if choice == "calibrated" else self._row_scale(
                target, "calibrated", t["kernel"],
                self._cv_record(target, "calibrated").get("scale", 1.0))
            for j, cal in enumerate(cals):
                sel = t.device == j
                if cal is None or target not in cal.level or not sel.any():
                    continue
                idx = np.flatnonzero(sel)
                # the recipe, unless the device's own probes kept the calibrated prior
                ch, sc = ("calibrated", cal_scale) if t.devices[j].uuid in held else \
                    (choice, scale)
                # the device's own data only speak for the dtypes/kernels they cover, and
                # for a kernel the prior never saw only from MIN_GROUP_PROBES: trees on a
                # few probes of it, set beside the others, give all its rows those
                # probes' level (GPPerf's tiled kernel: one probe among 50 of CUTLASS,
                # its other shapes 140x off)
                need = {g: MIN_GROUP_PROBES if g.split("/")[1] not in kernels else 1
                        for g in set(groups[idx])}
                probed = np.array([cal.counts.get(target, {}).get(g, 0) >= need[g]
                                   for g in groups[idx]])
                if ch == "own" and target in own_res:
                    r, i = own_res[target], idx[probed]
                    mu[i], sd[i], zrow[i] = np.log(r["point"][i]), r["sigma"][i] * sc[i], q
                    idx = idx[~probed]
                elif target in few_logs and (ch == "few" or target in self.few_groups):
                    mine = probed.copy()
                    if ch != "few":  # only the groups the prior has no shape for
                        mine &= np.isin(groups[idx], self.few_groups[target])
                    i = idx[mine]
                    fm, fs = few_logs[target]
                    mu[i] = np.log(from_model_space(target, t.take(i), fm[i]))
                    sd[i] = np.sqrt(fs[i] ** 2 + near[i] ** 2 + self._floor(target, ch)
                                    ** 2) * sc[i]
                    zrow[i] = q
                    idx, probed = idx[~mine], probed[~mine]
                blend = ch == "blend" and target in few_logs and target in self.blend
                if blend:  # the trees' prediction for the probed rows, blended below
                    b_rows = idx[probed]
                    fm, fs = few_logs[target]
                    b_mu = np.log(from_model_space(target, t.take(b_rows), fm[b_rows]))
                    b_sd = np.sqrt(fs[b_rows] ** 2 + near[b_rows] ** 2 +
                                   self._floor(target, "few") ** 2)
                if not len(idx):
                    continue
                rows = list(zip(groups[idx], work[idx], share[idx]))
                off = np.array([cal.offset(target, g, w, h) for g, w, h in rows])
                # a kernel the prior never ran keeps its spread until probes of it say
                # otherwise (before, 0.35 as a dtype: GPPerf's tiled kernel, 50-100x off
                # the estimate, went from a 14x interval at no probe to a 3x one at 5
                # probes of CUTLASS)
                var = np.array([cal.variance(target, g, None if g.split("/")[1] in kernels
                                             else tau["kernel"], w, h) for g, w, h in rows])
                mu[idx] += off
                extra_sz = beyond[idx] ** 2
                if ch == "residual" and target in res_logs:
                    i = np.flatnonzero(probed)
                    rm, rs = res_logs[target]
                    mu[idx[i]] += rm[idx[i]]
                    sd[idx[i]] = np.sqrt(rs[idx[i]] ** 2 + extra_sz[i]) * sc[idx[i]]
                    zrow[idx[i]] = q
                    idx, var, extra_sz = idx[~probed], var[~probed], extra_sz[~probed]
                # the calibrated prior
                extra_sz = beyond_prior[idx] ** 2
                onp[idx] = True
                sd[idx] = np.sqrt(var + extra_sz) * cal_scale[idx]
                ug, gi = np.unique(groups[idx].astype(str), return_inverse=True)
                zrow[idx] = np.array([_t_quantile(cal.t_dof(target, g), 0.5 + float(
                    self.meta.get("interval", 0.9)) / 2) for g in ug])[gi.ravel()]
                if blend and len(b_rows):
                    lam = self.blend[target]
                    own_sd = np.sqrt(var + extra_sz)[np.isin(idx, b_rows)]
                    mu[b_rows] = (1 - lam) * mu[b_rows] + lam * b_mu
                    sd[b_rows] = np.sqrt((1 - lam) * own_sd**2 + lam * b_sd**2) * \
                        sc[b_rows]
                    zrow[b_rows] = q
            out[target] = (mu, sd)
        if self.prior.meta.get("derived", {}).get("energy") and {"power", "runtime"} <= set(out):
            (lp, sp), (lr, sr) = out["power"], out["runtime"]
            out["energy"] = (lp + lr, np.hypot(sp, sr))
        per, z = served_flags(out, on_prior, zrows, flags_prior, flags)
        aligned = shares(t, out)
        # the prior's unaligned loss, on the point alone, where no probe of the device
        # measured its dtype's (its offset is that loss: measured at 8 bytes it stands for
        # 2 too); in full on trees on aligned probes, which carry none of it
        lost = DeviceCalibration.measured(t, cals)
        carried = np.where(lost, 1.0, np.where(has & ~on_prior.get("runtime", has), 0.0,
                                               self.prior.shape_carried(t, flags0["runtime"])))
        res = result(out, per, z, upward(out, per, self.prior.ood_sd, self.prior.meta,
                                         aligned),
                     align_loss(t, per, self.prior.ood_sd, self.prior.meta, aligned, carried))
        bounds.clip(res, t)
        return res

    def _cv_record(self, target: str, recipe: str) -> dict[str, Any]:
        """What the fit's cross-validation over the probes found for ``recipe`` on
        ``target`` (``meta["transfer"]["cv"]``), or {}."""
        return self.meta.get("transfer", {}).get("cv", {}).get(target, {}).get(recipe, {})

    def _floor(self, target: str, recipe: str) -> float:
        """The floor under the few-probe trees' spread where they serve ``recipe``: as the
        cross-validation judged it, that recipe's ("few", "residual"; "few" for "blend",
        whose trees' part it judged with it); none for the calibrated prior, judged on
        those trees without one (a factor judged on one interval is not for another)."""
        if recipe == "calibrated":
            return 0.0
        rec = self._cv_record(target, "few" if recipe == "blend" else recipe)
        return float(rec.get("floor", 0.0))

    def _row_scale(self, target: str, recipe: str, kernels: np.ndarray, default: float
                   ) -> np.ndarray:
        """Per row (its ``kernels``): the interval factor cross-validation found for
        ``recipe`` on that kernel (``by_kernel``), else ``default`` (over all kernels)."""
        by = self._cv_record(target, recipe).get("by_kernel") or {}
        if not by:
            return np.full(len(kernels), default, dtype=float)
        names, inv = np.unique(np.asarray(kernels).astype(str), return_inverse=True)
        return np.array([by.get(k, default) for k in names], dtype=float)[inv.ravel()]

    def _tree_logs(self, kind: str, trees: dict[str, tuple[Any, float]], t: Table
                   ) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """Per target and row of ``t``: the mean of the trees' predictions (log space),
        and their spread combined with the noise of one measurement (the sd before the
        interval scale)."""
        if not trees:
            return {}
        X32 = features.table_matrix(t).astype(np.float32)
        out = {}
        for target, (et, noise) in trees.items():
            key = f"{kind}/{target}"
            flat = self._flat.get(key)
            if flat is None and X32.shape[0] <= _FLAT_MAX_ROWS:
                flat = self._flat[key] = _FlatForest(et.estimators_)
            per_tree = _per_tree(et, flat, X32)
            out[target] = (per_tree.mean(axis=0),
                           np.maximum(np.sqrt(per_tree.std(axis=0) ** 2 + noise**2), MIN_SD))
        return out


def cv_max_rows(p: float) -> int:
    """The probes the cross-validation reads at most: CV_MAX_ROWS, or as many as
    narrowing needs at ``p`` (1,897 at 99.9%), so that no interval setting is left able
    only to widen."""
    return max(CV_MAX_ROWS, min_narrow_rows(p))


def first_cv_probes(p: float) -> int:
    """The fewest probes from which the cross-validation over them can change what is
    served at interval ``p``: its interval factor needs min_cv_rows out-of-fold errors
    (one per probe), another recipe MIN_OVERRIDE probes, a kernel the prior never saw
    MIN_GROUP_PROBES of it. Below, its folds' fits were work for nothing."""
    return max(MIN_SELECT, min(min_cv_rows(p), MIN_OVERRIDE, MIN_GROUP_PROBES))


def unknown_kernel_groups(prior: ForestModel, t: Table) -> dict[str, list[str]]:
    """Per prior target: the dtype/kernel groups of ``t``'s measured rows whose kernel
    the prior was never trained on (for that target), with MIN_GROUP_PROBES rows (trees
    on fewer probes of a kernel whose efficiency spans decades, GPPerf's tiled one, were
    off by up to 45x)."""
    recs = prior.meta.get("domain_targets") or {}
    if len(t) < MIN_OVERRIDE:
        return {}
    groups = _groups(t)
    out = {}
    for target in prior.forests:
        known = set((recs.get(target) or prior.meta.get("domain") or {}).get("kernels", []))
        ok = np.isfinite(t[COLUMN[target]])
        names_, counts = np.unique(groups[ok].astype(str), return_counts=True)
        names = [str(g) for g, c in zip(names_, counts)
                 if g.split("/")[1] not in known and c >= MIN_GROUP_PROBES]
        if names:
            out[target] = names
    return out
