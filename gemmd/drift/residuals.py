"""What drift compares: the log residual of a result against its prediction, the stand-in
where the model predicts no power or energy yet, and a result's and a prediction's targets."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from gemmd.gemm import COLUMN, TARGETS


def residual_of(measured: float | None, predicted: float | None) -> float | None:
    if not measured or not predicted or measured <= 0 or predicted <= 0:
        return None
    return math.log(measured / predicted)


def stand_in(predicted: Mapping[str, float | None], power_limit_w: float | None
             ) -> dict[str, float | None]:
    """What drift compares a result with where the model predicts no power or energy (the
    roofline before the first fit): the power limit, and the power limit times the
    predicted runtime. A track follows the card's own history either way (its level is
    learnt); this only arms it before a model exists. A refit moves it by
    log(stand-in / new prediction), like any model change."""
    out = dict(predicted)
    if power_limit_w and power_limit_w > 0:
        if not out.get("power"):
            out["power"] = float(power_limit_w)
        if not out.get("energy") and out.get("runtime"):
            out["energy"] = float(power_limit_w) * float(out["runtime"] or 0.0) or None
    return out


def measured_of(m: Any) -> dict[str, float | None]:
    return {t: getattr(m, COLUMN[t]) for t in TARGETS}


def predicted_of(p: Any) -> dict[str, float | None]:
    return {t: getattr(p, COLUMN[t]) for t in TARGETS}
