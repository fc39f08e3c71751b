"""ForestModel: one Random Forest per target, fitted (with intervals, the training domain
and fit-time validation), predicting inside the physical bounds of each GPU, saved and
loaded without executing code."""

from __future__ import annotations

import base64
import json
import math
import os
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from statistics import NormalDist
from typing import Any

import numpy as np

from gemmd import bounds, features
from gemmd.config import ModelConfig
from gemmd.errors import ModelError, naming
from gemmd.features import Table
from gemmd.files import file_sha256
from gemmd.gemm import COLUMN, TARGETS, ProbeSpec
from gemmd.gpulibs import import_hiding_cupy
from gemmd.model.domain import (
    ANCHOR_CONFIG,
    DEFAULT_TRANSFER,
    MIN_SD,
    OOD_SD,
    _reference_shapes,
    align_loss,
    domain_flags,
    domain_record,
    flags_both,
    result,
    shares,
    to_predictions,
    upward,
    widen,
)
from gemmd.model.flat import _FLAT_MAX_ROWS, _FlatForest, _per_tree
from gemmd.model.intervals import (
    MAX_FEATURES,
    MAX_SAMPLES,
    _fit_one,
    _noise_floors,
    _noise_groups,
    _row_floors,
)
from gemmd.model.persistence import (
    MODEL_FORMAT,
    TRUSTED_TYPES,
    _check_forests,
    _check_payload,
    _configs,
    _device_meta,
    _plain,
    check_format,
    check_meta,
    is_flat,
    read_flat,
    write_flat,
)
from gemmd.model.repeats import (
    _encode_repeats,
    _repeat_stats,
    _shape_scale,
    config_hashes,
    shape_hashes,
)
from gemmd.model.space import (
    from_model_space,
    launch_s,
    runtime_reference,
    table_hash,
    to_model_space,
)
from gemmd.model.validation import _row_gpu_keys, _validate
from gemmd.records import DeviceInfo, Prediction

Progress = Callable[[int], None]


def _energy_is_derived(t: Table, forests: dict[str, Any]) -> bool:
    """True when a power and a runtime forest exist and energy was either never measured
    (energy per GEMM is then average power x runtime by definition) or is power x runtime
    within 5% at the median on the rows that have all three."""
    if not {"power", "runtime"} <= set(forests):
        return False
    e, p, r = t["energy_j"], t["power_w"], t["runtime_s"]
    if not np.isfinite(e).any():
        return True
    both = np.isfinite(e) & np.isfinite(p) & np.isfinite(r)
    if not both.any() or both.sum() < np.isfinite(e).sum() / 2:
        return False
    return float(np.median(np.abs(np.log(e[both] / (p[both] * r[both]))))) < 0.05


class ForestModel:
    """One RandomForestRegressor per target, each on the rows where that target was measured."""

    kind = "random_forest"

    def __init__(self, forests: dict[str, Any], sigma: dict[str, float], z: float,
                 meta: dict[str, Any]):
        self.forests = forests
        self.sigma = sigma  # out-of-bag residual std per target, log space
        self.z = z
        self.meta = meta
        self.version = str(meta.get("version", "rf"))
        self._flat: dict[str, _FlatForest] = {}
        self._anchor_cache: dict[tuple, float] = {}
        self._shape_set: np.ndarray | None = None
        self._repeats: dict[str, tuple[np.ndarray, np.ndarray]] | None = None

    @classmethod
    def fit(cls, rows: Sequence[Mapping[str, Any]], infos: Sequence[DeviceInfo],
            cfg: ModelConfig, *, progress: Progress | None = None) -> ForestModel:
        """Fit on probe rows (store dicts) with the DeviceInfo of each row's device."""
        if len(rows) < cfg.min_samples:
            raise ModelError(f"{len(rows)} samples, fewer than model.min_samples "
                             f"({cfg.min_samples})")
        # One identity for one training set: fit_table's table_hash.
        return cls.fit_table(Table.from_rows(rows, infos), cfg, progress=progress)

    @classmethod
    def fit_table(cls, t: Table, cfg: ModelConfig, *, progress: Progress | None = None,
                  n_jobs: int = 1, targets: Sequence[str] = TARGETS) -> ForestModel:
        """Fit on a Table; ``progress(1)`` is called as each target is done.

        Repeated measurements of one configuration are fitted as one row (their median in
        log space, weighted by their count): the forest learns the configuration's typical
        value, not its noise, and a month of sentinel repeats costs one row, not thousands.
        Energy is power x runtime (no forest of its own) where the data agree with that.
        """
        if len(t) < cfg.min_samples:
            raise ModelError(f"{len(t)} samples, fewer than model.min_samples "
                             f"({cfg.min_samples})")
        t0 = time.perf_counter()
        X = features.table_matrix(t).astype(np.float32)
        gid = features.config_ids(t)
        forests: dict[str, Any] = {}
        sigma: dict[str, float] = {}
        counts: dict[str, int] = {}
        oob: dict[str, np.ndarray] = {}  # SI units per row, NaN where none
        derived = {}
        scale: dict[str, float] = {}
        # The measurement noise no interval is narrower than: overall, per noise group.
        floor: dict[str, float] = {}
        floor_group: dict[str, dict[str, float]] = {}
        floor_rows: dict[str, np.ndarray] = {}
        repeats: dict[str, dict[str, str]] = {}  # per repeated configuration (_repeat_stats)
        stats: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        hashes = config_hashes(t)
        groups = _noise_groups(t)
        for target in targets:
            y = to_model_space(target, t)
            ok = np.isfinite(y)
            counts[target] = int(ok.sum())
            if target == "energy" and _energy_is_derived(t, forests):
                derived["energy"] = "power*runtime"
                oob["energy"] = oob["power"] * oob["runtime"]
                sigma["energy"] = float(math.hypot(sigma["power"], sigma["runtime"]))
                if {"power", "runtime"} <= set(stats):  # offsets add, noises in quadrature
                    (kr, orr, nr), (kp, op, n_p) = stats["runtime"], stats["power"]
                    both, i, j = np.intersect1d(kr, kp, assume_unique=True,
                                                return_indices=True)
                    repeats["energy"] = _encode_repeats(both, orr[i] + op[j],
                                                        np.hypot(nr[i], n_p[j]), cfg.interval)
            elif counts[target] >= cfg.min_samples:
                rf, s, o, scale[target] = _fit_one(X[ok], y[ok], gid[ok], cfg, n_jobs,
                                                   groups[ok])
                forests[target], sigma[target] = rf, s
                floor[target], floor_group[target] = _noise_floors(
                    y[ok], gid[ok], groups[ok], cfg.interval)
                floor_rows[target] = _row_floors(groups, floor[target], floor_group[target],
                                                 len(t))
                s0 = np.where(floor_rows[target] > 0, floor_rows[target], s)[ok]
                stats[target] = _repeat_stats(rf, X[ok], y[ok], gid[ok], hashes[ok], s0,
                                              cfg.interval)
                repeats[target] = _encode_repeats(*stats[target], cfg.interval)
                oob[target] = np.full(len(t), np.nan)
                oob[target][ok] = from_model_space(target, t.take(np.flatnonzero(ok)), o)
            if progress:
                progress(1)
        if "runtime" not in forests:
            raise ModelError("no runtime measurements to fit on")
        shape_scale, shape_set = _shape_scale(t, X, forests, sigma, scale, cfg, floor_rows)
        domain_targets = {tg: domain_record(t.take(np.flatnonzero(np.isfinite(
            t[COLUMN[tg]])))) for tg in forests}
        if "energy" in derived:  # power x runtime: known where power was measured
            domain_targets["energy"] = domain_targets["power"]
        in_scale = {tg: shape_scale.get(tg, scale.get(tg, 1.0)) for tg in forests}
        ood, transfer = _validate(t, X, gid, forests, sigma, in_scale, cfg, cls)
        scores = {}
        for target, pred in oob.items():
            meas = t[COLUMN[target]]
            has = np.isfinite(pred) & np.isfinite(meas)
            if has.any():
                ape = np.abs(pred[has] - meas[has]) / meas[has]
                scores[target] = {"oob_mape": float(np.mean(ape)),
                                  "oob_median_ape": float(np.median(ape))}
        z = NormalDist().inv_cdf(0.5 + cfg.interval / 2)
        meta = {"format": MODEL_FORMAT, "n_samples": len(t),
                "targets": {k: v for k, v in counts.items() if k in forests or k in derived},
                "derived": derived, "scores": scores, "features": list(features.FEATURES),
                "interval": cfg.interval, "data_hash": table_hash(t),
                "fit_seconds": time.perf_counter() - t0, "created": time.time(),
                "params": {"n_estimators": cfg.n_estimators, "max_depth": cfg.max_depth,
                           "min_samples_leaf": cfg.min_samples_leaf,
                           "max_leaf_nodes": cfg.max_leaf_nodes,
                           "max_features": MAX_FEATURES, "max_samples": MAX_SAMPLES,
                           "seed": cfg.seed},
                "devices": _device_meta(t), "configs": _configs(t),
                "interval_scale": scale, "interval_scale_shape": shape_scale,
                "interval_noise_floor": floor, "interval_noise_floor_group": floor_group,
                "repeats": repeats,
                "shapes": shape_set, "domain": domain_record(t),
                "domain_targets": domain_targets, "ood_sd": ood, "logo": transfer,
                "reference_shapes": _reference_shapes(t),
                "roofline_efficiency": cfg.roofline_efficiency}
        return cls(forests, sigma, z, meta)

    # ------------------------------------------------------------- predicting
    def predict(self, specs: Sequence[ProbeSpec], infos: Sequence[DeviceInfo],
                source: str = "") -> list[Prediction]:
        """``source``: whose measurements these are (Table.from_specs; the daemon's
        "daemon"): a GPU model trained on only through another source's is not in the
        domain (domain_flags)."""
        if not specs:
            return []
        out = self.predict_table(Table.from_specs(specs, infos, source))
        return to_predictions(out, len(specs))

    def predict_table(self, t: Table) -> dict[str, dict[str, np.ndarray]]:
        """Per target: point, lo, hi (SI units), sigma (log space), in_domain (bool) and
        domain (why not, '' when in domain), one entry per row; inside the physical
        bounds of each row's device (gemmd.bounds)."""
        if not len(t):
            return {}
        logs, flags = self.prior_logs(t)
        share = shares(t, logs)
        for target, (mu, sd) in list(logs.items()):
            logs[target] = (mu, widen(target, sd, flags[target], tau=self.ood_sd(target),
                                      share=share))
        logs = self._with_energy(logs, t)
        per = {tg: flags.get(tg, flags["runtime"]) for tg in logs}
        out = result(logs, per, self.z, upward(logs, per, self.ood_sd, self.meta, share),
                     align_loss(t, per, self.ood_sd, self.meta, share,
                                self.shape_carried(t, flags["runtime"])))
        bounds.clip(out, t)
        return out

    def ood_sd(self, target: str) -> dict[str, float]:
        """The log-space spread added per way a row lies outside the domain (OOD_SD),
        with the model's own validated figures where it measured them at fit time
        (leave-one-GPU-out for "gpu", extrapolation beyond a trained size for "size" and
        per dimension "size_m", "size_n", "size_k"; for runtime, "scatter": a kernel the
        model never saw; for runtime and energy, "align" and "align_work": unaligned
        shapes held out). A model fitted before "align_work" measured "align" per unit of
        work_share: that is its "align_work", and "align" is OOD_SD's."""
        own = dict((self.meta.get("ood_sd") or {}).get(target, {}))
        if "align" in own and "align_work" not in own:
            own["align_work"] = own.pop("align")
        return {**OOD_SD.get(target, OOD_SD["runtime"]), **own}

    def transfer_setting(self) -> tuple[float, float]:
        """(w, a) for an unknown GPU's runtime: the weight of the forest's own efficiency
        level against the roofline estimate's, and of its shape dependence (how
        efficiency changes with size and configuration) against none; chosen at fit time
        by leave-one-GPU-out validation, else DEFAULT_TRANSFER."""
        rec = (self.meta.get("logo") or {}).get("runtime") or {}
        return float(rec.get("w", DEFAULT_TRANSFER[0])), float(rec.get("a", DEFAULT_TRANSFER[1]))

    def prior_logs(self, t: Table) -> tuple[dict[str, tuple[np.ndarray, np.ndarray]],
                                            dict[str, dict[str, Any]]]:
        """(per forest target: log point and in-domain log sd, per target: domain flags):
        the raw forest with an unknown GPU's runtime carried over by transfer_setting
        and an unknown kernel's runtime from the roofline; the interval not yet widened
        for being outside the domain."""
        logs = self.raw_logs(t)
        flags = self.target_flags(t)
        for target, (mu, sd) in list(logs.items()):
            if target == "runtime":
                mu = self.transfer_runtime(t, mu, flags["runtime"])
            logs[target] = (self._fallback(target, t, mu, flags[target]), sd)
        return logs, flags

    def target_flags(self, t: Table, extra: Mapping[str, Mapping[str, Any]] | None = None
                     ) -> dict[str, dict[str, Any]]:
        """domain_flags per target: runtime against the rows trained with a runtime,
        power and energy against those with power (energy measured, where it has a
        forest of its own): power is not in the domain of a GPU whose power was never
        measured. ``extra``: per target, domain_flags' extra (a calibration's probes)."""
        recs = self.meta.get("domain_targets") or {}
        out = {}
        derived = self.meta.get("derived", {})
        for target in self.forests:
            rec = recs.get(target, self.meta.get("domain"))
            out[target] = domain_flags(rec, t, (extra or {}).get(target))
            if target != "runtime" and target in recs:  # say which data is missing
                out[target]["reason"] = np.array(
                    [r.replace("no data on", f"no {target} data on") for r in
                     out[target]["reason"]], dtype=object)
        if "runtime" not in out:
            out["runtime"] = domain_flags(self.meta.get("domain"), t,
                                          (extra or {}).get("runtime"))
        for target in derived:  # power x runtime: known where both are
            out[target] = flags_both(out.get("power", out["runtime"]), out["runtime"])
        return out

    def domain_flags(self, t: Table) -> dict[str, Any]:
        """The runtime's domain flags (target_flags for the others)."""
        return self.target_flags(t)["runtime"]

    def forest_levels(self, t: Table, todo: np.ndarray) -> np.ndarray:
        """Per row where ``todo``: the forest's efficiency level for the row's device and
        configuration, the median over the shapes it was trained on (meta
        "reference_shapes") of its log(runtime / runtime_reference); NaN elsewhere. One
        figure per (device, configuration), whatever else is predicted alongside."""
        out = np.full(len(t), np.nan)
        shapes = self.meta.get("reference_shapes") or []
        if not todo.any() or not shapes or "runtime" not in self.forests:
            return out
        ref = np.asarray(shapes, dtype=np.float64)
        for i in np.flatnonzero(todo):
            info = t.info(i)
            cfg = tuple((c, _plain(t[c][i])) for c in ANCHOR_CONFIG)
            key = (info.uuid, cfg)
            level = self._anchor_cache.get(key)
            if level is None:
                rows = [{"m": a, "n": b, "k": c, "batch": d, **dict(cfg)} for a, b, c, d in ref]
                rt = Table.from_rows(rows, [info] * len(rows))
                mu, _ = self.raw_logs(rt, scaled=False)["runtime"]
                level = float(np.median(mu - np.log(runtime_reference(rt))))
                if len(self._anchor_cache) < 4096:
                    self._anchor_cache[key] = level
            out[i] = level
        return out

    def transfer_runtime(self, t: Table, mu: np.ndarray, flags: Mapping[str, Any]
                         ) -> np.ndarray:
        """Log runtime per row: on a GPU the model never saw (and a kernel
        it knows), log(reference) + (1 - w) log(1 / roofline_efficiency) + w L + a z,
        where L is the forest's level there (forest_levels), z = log efficiency - L the
        forest's shape dependence and (w, a) = transfer_setting(), or on a GPU model its
        probes chose another for (choosing.carried), that one; elsewhere the forest's
        own. What a forest says of an unknown GPU carries its training GPUs'
        efficiency level and shape, which need not be the new GPU's: how far they carry
        is what leave-one-GPU-out validation on the training data measured."""
        todo = flags["gpu"] & ~flags["kernel"]
        if not todo.any():
            return mu
        w, a = self._settings(t)
        eff = float(self.meta.get("roofline_efficiency", 0.7))
        level = self.forest_levels(t, todo)
        ref = np.log(runtime_reference(t))
        z = np.where(todo, mu - ref - level, 0.0)
        carried = ref + (1.0 - w) * math.log(1.0 / eff) + w * level + a * z
        return np.where(todo, carried, mu)

    def _settings(self, t: Table) -> tuple[np.ndarray, np.ndarray]:
        """Per row, the (w, a) transfer_runtime carries an unknown GPU's runtime with:
        transfer_setting, or on a GPU model its probes chose another for
        (choosing.carried), that one."""
        w0, a0 = self.transfer_setting()
        w, a = np.full(len(t), w0), np.full(len(t), a0)
        by = ((self.meta.get("logo") or {}).get("runtime") or {}).get("by_gpu") or {}
        if by:
            keys = _row_gpu_keys(t)
            for key, (wk, ak) in by.items():
                w[keys == key], a[keys == key] = wk, ak
        return w, a

    def shape_carried(self, t: Table, flags: Mapping[str, Any]) -> np.ndarray:
        """Per row, the weight of the forest's shape dependence in its runtime point
        (prior_logs, ``flags`` its runtime flags): all of it on a GPU model it was
        trained on, a transfer setting's "a" on one it never saw (transfer_runtime), none
        on a kernel it never ran (_fallback): how much of what unaligned rows of other
        GPU models taught the forest the point already holds (domain.align_loss)."""
        return np.where(flags["kernel"], 0.0, np.where(flags["gpu"], self._settings(t)[1],
                                                       1.0))

    def raw_logs(self, t: Table, scaled: bool = True
                 ) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """Per forest target: (log of the point prediction, log-space sd as if in domain:
        the trees' spread and the single-measurement noise, times the interval scale
        unless not ``scaled``; never below the measurement noise; for a configuration
        trained on with repeats on this device, its own (see _repeat_stats))."""
        X32 = features.table_matrix(t).astype(np.float32)
        scale = self.meta.get("interval_scale", {})
        shape_scale = self.meta.get("interval_scale_shape") or {}
        floor = self.meta.get("interval_noise_floor") or {}
        floor_group = self.meta.get("interval_noise_floor_group") or {}
        groups = _noise_groups(t) if floor_group else None
        seen = self._seen_shapes(t) if shape_scale else None
        own = self._repeat_sds(t) if scaled else {}
        if not scaled:
            scale, shape_scale, seen, floor = {}, {}, None, {}
        logs: dict[str, tuple[np.ndarray, np.ndarray]] = {}  # log point, log-space sd
        for target, rf in self.forests.items():
            flat = self._flat.get(target)
            if flat is None and X32.shape[0] <= _FLAT_MAX_ROWS and \
                    not isinstance(rf, _FlatForest):
                flat = self._flat[target] = _FlatForest(rf.estimators_)
            per_tree = _per_tree(rf, flat, X32)
            mean, spread = per_tree.mean(axis=0), per_tree.std(axis=0)
            c = scale.get(target, 1.0)
            if seen is not None and target in shape_scale:
                c = np.where(seen, c, shape_scale[target])
            sd = np.maximum(np.sqrt(spread**2 + self.sigma.get(target, 0.0) ** 2) * c,
                            _row_floors(groups, floor.get(target, 0.0),
                                        floor_group.get(target, {}), len(t)))
            if target in own:
                sd = np.where(np.isnan(own[target]), sd, own[target])
            logs[target] = (np.log(from_model_space(target, t, mean)), np.maximum(sd, MIN_SD))
        return logs

    def _repeat_sds(self, t: Table, targets: Sequence[str] | None = None
                    ) -> dict[str, np.ndarray]:
        """Per target with a repeat table (forest targets unless ``targets``): each row's
        own sd where its configuration was trained on with repeats on its device, NaN
        elsewhere."""
        if self._repeats is None:
            self._repeats = {}
            for target, rec in (self.meta.get("repeats") or {}).items():
                if rec:
                    self._repeats[target] = (
                        np.frombuffer(base64.b64decode(rec["keys"]), dtype=np.uint64),
                        np.frombuffer(base64.b64decode(rec["sd"]), dtype=np.float32))
        wanted = {k: v for k, v in self._repeats.items()
                  if k in (targets if targets is not None else self.forests)}
        if not wanted or not len(t):
            return {}
        h = config_hashes(t)
        out = {}
        for target, (keys, sds) in wanted.items():
            i = np.minimum(np.searchsorted(keys, h), len(keys) - 1)
            out[target] = np.where(keys[i] == h, sds[i].astype(np.float64), np.nan)
        return out

    def _seen_shapes(self, t: Table) -> np.ndarray:
        """Per row: was its shape (GPU model, M, N, K, batch) in the training data? All
        False when the model did not keep the set (too many shapes)."""
        if self._shape_set is None:
            raw = self.meta.get("shapes")
            self._shape_set = np.frombuffer(base64.b64decode(raw), dtype=np.uint64) \
                if raw else np.zeros(0, dtype=np.uint64)
        if not self._shape_set.size:
            return np.zeros(len(t), dtype=bool)
        return np.isin(shape_hashes(t), self._shape_set)

    def _fallback(self, target: str, t: Table, mu: np.ndarray, flags: dict[str, Any]
                  ) -> np.ndarray:
        """A kernel the forest never saw: its runtime is the roofline estimate (what the
        forest says there is an extrapolation from other kernels, often off by 10-100x)."""
        if target != "runtime" or not flags["kernel"].any():
            return mu
        eff = float(self.meta.get("roofline_efficiency", 0.7))
        return np.where(flags["kernel"], np.log(features.roofline(t) / eff + launch_s(t)),
                        mu)

    def _with_energy(self, logs: dict[str, tuple[np.ndarray, np.ndarray]],
                     t: Table | None = None) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        if self.meta.get("derived", {}).get("energy") and {"power", "runtime"} <= set(logs):
            (lp, sp), (lr, sr) = logs["power"], logs["runtime"]
            sd = np.hypot(sp, sr)
            # A configuration trained on with repeats: its runtime and power offsets add
            # (in quadrature a known offset counts as noise: a sentinel's energy covered
            # 65-79% where its runtime was 1% off).
            own = self._repeat_sds(t, ("energy",)).get("energy") if t is not None else None
            if own is not None:
                sd = np.where(np.isnan(own), sd, np.maximum(own, MIN_SD))
            logs["energy"] = (lp + lr, sd)
        return logs

    # -------------------------------------------------------------- persistence
    def save(self, path: str | Path) -> str:
        """Write atomically (temp file + rename); returns the file's sha256. The file holds
        the forests as flat arrays (persistence: read without scikit-learn)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        flats = {t: rf if isinstance(rf, _FlatForest) else
                 self._flat.get(t) or _FlatForest(rf.estimators_)
                 for t, rf in self.forests.items()}
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".skops")
        os.close(fd)
        try:
            write_flat(tmp, flats, self.sigma, self.z, self.meta)
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
            digest = file_sha256(tmp)
            os.replace(tmp, path)
        except OSError as e:
            Path(tmp).unlink(missing_ok=True)
            raise naming(e, path) from None
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return digest

    @classmethod
    def load(cls, path: str | Path, sha256: str | None = None) -> ForestModel:
        """Load without executing code: checksum first, then the flat arrays (numpy, no
        pickle: scikit-learn is not imported) or, for a file written before them, skops
        with trusted types only."""
        path = Path(path)
        if not path.is_file():
            raise ModelError(f"model file {path} " + ("is not a regular file" if path.exists()
                                                      else "does not exist"))
        if sha256 and file_sha256(path) != sha256:
            raise ModelError(f"model file {path} does not match its recorded checksum "
                             "(tampered with or truncated)")
        if is_flat(path):
            try:
                return cls(*read_flat(path))._self_check(path)
            except ModelError:
                raise
            except Exception as e:  # zipfile/numpy/json raise many types on a corrupt file
                raise ModelError(f"model file {path} cannot be read: {type(e).__name__}: "
                                 f"{e}") from e
        sio = import_hiding_cupy("skops.io")
        try:
            untrusted = sio.get_untrusted_types(file=str(path))
            extra = sorted(set(untrusted) - set(TRUSTED_TYPES))
            if extra:
                raise ModelError(f"model file {path} contains untrusted types: "
                                 f"{', '.join(extra)}")
            payload = sio.load(str(path), trusted=sorted(set(untrusted)))
            _check_payload(payload, path)
            meta = json.loads(payload["meta"])
        except ModelError:
            raise
        except Exception as e:  # skops/zipfile/json raise many types on a corrupt file
            raise ModelError(f"model file {path} cannot be read: {type(e).__name__}: {e}") from e
        check_format(meta, path)
        _check_forests(payload, path)
        check_meta(meta, payload["sigma"], payload["z"], path)
        return cls(payload["forests"], dict(payload["sigma"]), float(payload["z"]),
                   meta)._self_check(path)

    def _self_check(self, path: Path) -> ForestModel:
        """One prediction on each device the model knows (its first configuration there)
        and on a GPU it never saw: what an edited or damaged field breaks beyond
        check_meta's types shows here, as one line naming the file, not at the daemon's
        first probe or as a traceback."""
        import dataclasses

        infos = self.device_infos()[:8]
        if infos:
            infos.append(dataclasses.replace(infos[0], uuid="self-check",
                                             name="self-check GPU", extra={}))
        configs = self.meta.get("configs") or []
        rows = []
        for info in infos:
            c = next((c for c in configs if c["device"] == info.uuid), None) or \
                (configs[0] if configs else {"dtype": "fp32", "kernel": "blas"})
            rows.append({**{k: v for k, v in c.items() if k != "device"},
                         "m": 1024, "n": 1024, "k": 1024})
        if not rows:
            return self
        try:
            res = self.predict_table(Table.from_rows(rows, infos))
            ok = all(np.all(np.isfinite(r[k])) and np.all(r[k] > 0) for r in res.values()
                     for k in ("point", "lo", "hi")) and all(
                np.all(r["lo"] <= r["point"] * (1 + 1e-9)) and
                np.all(r["point"] <= r["hi"] * (1 + 1e-9)) for r in res.values())
        except Exception as e:  # whatever a damaged field raises
            raise ModelError(f"model file {path}: its metadata do not predict "
                             f"({type(e).__name__}: {e}); edited or damaged? refit it") from e
        if not ok:
            raise ModelError(f"model file {path}: its metadata predict no finite, ordered "
                             "interval; edited or damaged? refit it")
        return self

    def device_infos(self) -> list[DeviceInfo]:
        """The devices the model was trained on (from its metadata)."""
        return [DeviceInfo(**d) for d in self.meta.get("devices", [])]
