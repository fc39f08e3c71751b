"""How a device's probes choose between ways of predicting it (TransferModel's
cross-validation over them): the rule over out-of-fold errors (_select; per device,
held_devices), and the ways that differ in how far the prior's knowledge of other GPUs
carries to a GPU it never saw (the transfer setting (w, a) of
ForestModel.transfer_runtime, "carried:w,a")."""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from gemmd.features import Table
from gemmd.model.domain import TRANSFER_GRID
from gemmd.model.forest import ForestModel
from gemmd.model.validation import _row_gpu_keys

# Another way replaces the default where cross-validation over the probes finds it
# better by SELECT_SE standard errors of the paired difference (TransferModel._cv). With
# the blends, 1 took the MI355X at 20 probes from 28.4% to 27.0% and left the H100 at
# 14.8% (2: no blend chosen; 0: 26.4%, a minimum of a few probes' CV errors is often a
# fluke); with the transfer settings, 10 probes of an H200 took a prior of gemmd's H100
# from 13.8% to 5.9% at 1, to 9.5% at 2, and 20 of the shared H100 took a B200 prior
# from 15.2% to 16.8% at either.
SELECT_SE = 1.0
# The probes of a GPU the prior never saw may choose any transfer setting of
# TRANSFER_GRID, the grid leave-one-GPU-out validation chooses on at fit time. That
# validation judges the prior's GPUs, measured by other harnesses than the new
# GPU's may be: across the shared data's four sources the roofline estimate's level was
# best (an MI355X-trained forest predicts an H100 2x too slow), while between two GPUs
# measured by one harness (gemmd's own sweeps of an H100 and an H200) the forest's level
# and shape carry: its raw prediction was 6% off where the roofline estimate was 14%,
# and 20 probes of the H200 left the estimate at 13% (bench/RESULTS.md, the sixteenth
# session). The probes are the only evidence of which holds for the GPU at hand.
CARRIED = "carried:"
# The calibrated prior whose runtime's launch (space.launch_s, 3 us) takes an offset of
# its own beyond the level (calibrate(launch=devices), served), judged beside the
# settings: the launch is the host's, driver's and harness's as much as the GPU's.
# Chosen by the probes, not always on: free from the first probe it cost 5 heavy-tailed
# probes of a one-GPU prior 8% of MAPE where its level was right, and the shared MI355X
# 30.8% -> 34.5% at 5 probes of the other GPUs' prior (bench/RESULTS.md, the seventeenth
# session).
LAUNCH = "launch"


# A device keeps the calibrated prior where its own out-of-fold errors show the chosen
# recipe worse at HELD_CONFIDENCE (one-sided Student t on the paired differences,
# Bonferroni over the devices judged), from HELD_MIN_PROBES of them. At SELECT_SE with
# 3-4 probes, 20-30% of healthy new cards beside an alike sibling were held, and lost
# the recipe their sibling's probes earned them (14.7% -> 35.7% off in one); so, none
# of 60 (docs/model.md, "A card unlike the others").
HELD_CONFIDENCE = 0.95
HELD_MIN_PROBES = 5


def held_devices(apes: Mapping[str, np.ndarray], pick: str, device: np.ndarray,
                 uuids: Sequence[str], default: str = "calibrated") -> list[str]:
    """The devices (``uuids``, indexed by ``device`` per probe) that keep ``default``
    where the probes of all chose ``pick``: those whose own out-of-fold errors are worse
    under ``pick`` (HELD_CONFIDENCE). The recipes' trees are fitted on every device's
    probes, and cards of one GPU model look alike to them: a card measured as the prior
    predicts, beside one that is not and has more probes, was served the other's
    behaviour (6 probes, 14-29% off where its own calibration gave 3-4%)."""
    if pick == default or pick not in apes or default not in apes:
        return []
    diffs = {}
    for j, uuid in enumerate(uuids):
        d = (apes[pick] - apes[default])[device == j]
        if (d := d[np.isfinite(d)]).size >= HELD_MIN_PROBES:
            diffs[uuid] = d
    from scipy.stats import t as student_t  # with scikit-learn: fitting only

    p = 1.0 - (1.0 - HELD_CONFIDENCE) / max(len(diffs), 1)
    return [uuid for uuid, d in diffs.items() if float(np.mean(d)) > float(
        student_t.ppf(p, d.size - 1)) * float(np.std(d, ddof=1)) / math.sqrt(d.size)]


def setting_name(w: float, a: float) -> str:
    return f"{CARRIED}{w:g},{a:g}"


def parse_setting(name: str) -> tuple[float, float]:
    w, a = name[len(CARRIED):].split(",")
    return float(w), float(a)


def carried(prior: ForestModel, w: float, a: float, gpus: Sequence[str]) -> ForestModel:
    """``prior`` predicting the GPU models ``gpus`` (catalogue keys; models it never saw)
    with the transfer setting (w, a), any other as before: a copy sharing its forests
    and caches (the forest's levels do not depend on the setting)."""
    out = copy.copy(prior)
    logo = dict(prior.meta.get("logo") or {})
    rec = dict(logo.get("runtime") or {})
    rec["by_gpu"] = {**(rec.get("by_gpu") or {}), **{g: [float(w), float(a)] for g in gpus}}
    logo["runtime"] = rec
    out.meta = {**prior.meta, "logo": logo}
    return out


def other_settings(prior: ForestModel, t: Table, least: int) -> tuple[list[str], list[str]]:
    """(the ways other than the prior's own, by name; the GPU models they are for): the
    transfer settings other than ``prior``'s for the GPU models of ``t`` that it never
    saw with ``least`` probes or more of kernels it knows (where
    ForestModel.transfer_runtime carries it), and LAUNCH where any GPU model has that
    many (those never seen, else those probed); else none."""
    flags = prior.target_flags(t).get("runtime")
    if flags is None:
        return [], []
    keys = _row_gpu_keys(t)

    def models(rows: np.ndarray) -> list[str]:
        names, counts = np.unique(keys[rows].astype(str), return_counts=True)
        return [str(g) for g, c in zip(names, counts) if c >= least]

    new, probed = models(flags["gpu"] & ~flags["kernel"]), models(~flags["kernel"])
    if not probed:
        return [], []
    own = prior.transfer_setting()
    return [*(setting_name(w, a) for w, a in TRANSFER_GRID if new and not (
        math.isclose(w, own[0]) and math.isclose(a, own[1]))), LAUNCH], new or probed


def served(prior: ForestModel, name: str, gpus: Sequence[str], t: Table, least: int
           ) -> tuple[ForestModel, list[str], tuple[float, float]]:
    """What a way of other_settings calibrates: (the prior carried to ``gpus`` by the
    setting ``name``, or by its own for LAUNCH; the devices whose launch takes an offset
    of its own, for LAUNCH those of ``t`` of a GPU model of ``gpus`` with ``least``
    probes of their own of kernels the prior ran, which alone it is read on (a card with
    4 probes beside one with 16 took its launch offset from 4: 49-72% off where 3-8%
    without), else none; the setting)."""
    w, a = prior.transfer_setting() if name == LAUNCH else parse_setting(name)
    launch: list[str] = []
    if name == LAUNCH:
        keys = _row_gpu_keys(t)
        ok = np.isfinite(t["runtime_s"]) & ~prior.target_flags(t)["runtime"]["kernel"]
        counts = np.bincount(t.device[ok & np.isin(keys, list(gpus))],
                             minlength=len(t.devices))
        launch = [d.uuid for d, c in zip(t.devices, counts) if c >= least]
    return carried(prior, w, a, gpus), launch, (w, a)


def describe_calibration(model: Any) -> str:
    """What a calibrated model (TransferModel) chose, for the daemon's log: the recipe
    per target, the devices whose own probes kept the calibrated prior instead (a card
    unlike the others: held_devices), and a transfer setting its probes chose, if any."""
    rec = (model.meta.get("transfer") or {}).get("setting")
    held = (model.meta.get("transfer") or {}).get("held") or {}
    out = "recipes " + ", ".join(
        f"{tg} {c}" + (f" (calibrated for {', '.join(held[tg])}: unlike the others)"
                       if held.get(tg) else "") for tg, c in sorted(model.choice.items()))
    if rec and rec.get("launch"):
        out += f"; {', '.join(rec['gpus'])} with a launch offset (its probes chose it)"
    elif rec:
        out += (f"; {', '.join(rec['gpus'])} carried as w={rec['w']:g} a={rec['a']:g} "
                f"(its probes chose it over {rec['was'][len(CARRIED):]})")
    return out


def _select(apes: Mapping[str, np.ndarray], default: str = "calibrated",
            override: bool = True) -> str:
    """The way to predict from per-probe out-of-fold errors (NaN where none): the
    default (the calibrated prior where it has no errors), unless ``override`` and
    another's error is lower by SELECT_SE standard errors of the paired difference (then
    the lowest of those that are)."""
    default = default if default in apes else "calibrated"
    if default not in apes:
        return min(apes, key=lambda c: float(np.nanmean(apes[c])))
    if not override:
        return default
    best, best_err = default, float(np.nanmean(apes[default]))
    for name, ape in apes.items():
        d = apes[default] - ape
        d = d[np.isfinite(d)]
        if name == default or len(d) < 2:
            continue
        se = float(np.std(d, ddof=1)) / math.sqrt(len(d))
        err = float(np.nanmean(ape))
        if float(np.mean(d)) > SELECT_SE * se and err < best_err:
            best, best_err = name, err
    return best
