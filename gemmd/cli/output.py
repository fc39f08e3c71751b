"""How commands print: numbers with their unit, percentages, ages, tables, JSON, and a
progress bar. "-" stands for a value that is missing (None) or not finite."""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Sequence
from typing import Any

# Units of each target, largest first: a value is shown in the first unit it reaches.
UNITS = {"runtime": (("s", 1.0), ("ms", 1e-3), ("us", 1e-6), ("ns", 1e-9)),
         "power": (("kW", 1e3), ("W", 1.0), ("mW", 1e-3)),
         "energy": (("J", 1.0), ("mJ", 1e-3), ("uJ", 1e-6), ("nJ", 1e-9))}


def fmt_value(target: str, v: float | None, digits: int = 4) -> str:
    """A runtime, power or energy with its unit: fmt_value("runtime", 2.5e-4) = "250 us"."""
    if v is None or not math.isfinite(v):
        return "-"
    for unit, f in UNITS[target]:
        if abs(v) >= f:
            return f"{v / f:.{digits}g} {unit}"
    unit, f = UNITS[target][-1]
    return f"{v / f:.{digits}g} {unit}"


def num(v: float | None, spec: str = ".3f", unit: str = "") -> str:
    """A number formatted by ``spec``, then ``unit``: num(231.4, ".1f", " W") = "231.4 W"."""
    return "-" if v is None or not math.isfinite(v) else f"{v:{spec}}{unit}"


def pct(v: float | None) -> str:
    """A fraction as a percentage: pct(0.0291) = "2.91%"."""
    return "-" if v is None or not math.isfinite(v) else f"{100 * v:.2f}%"


def age(s: float) -> str:
    """A duration in its largest whole unit: age(7300) = "2h"."""
    for unit, f in (("d", 86400), ("h", 3600), ("m", 60)):
        if s >= f:
            return f"{s / f:.0f}{unit}"
    return f"{max(s, 0):.0f}s"


def stamp(ts: float) -> str:
    """A unix time as local date and minute."""
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(ts))


def print_table(rows: Sequence[Sequence[str]]) -> None:
    """Rows of cells (the first is the header), left-aligned in columns two spaces apart."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())


def json_default(v: Any) -> Any:
    """json.dumps(default=...): numpy numbers as Python numbers, anything else as text."""
    import numpy as np

    if isinstance(v, (np.floating, np.integer)):
        return v.item()
    return str(v)


def json_text(obj: Any, default: Any = json_default) -> str:
    """``obj`` as strict JSON (indented): a number that is not finite (an R² of one row,
    a missing figure) as null, never the bare NaN or Infinity that JSON parsers refuse."""
    import numpy as np

    def clean(v: Any) -> Any:
        if isinstance(v, (float, np.floating)):
            return float(v) if math.isfinite(v) else None
        if isinstance(v, dict):
            return {k: clean(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [clean(x) for x in v]
        if isinstance(v, np.ndarray):
            return clean(v.tolist())
        return v

    return json.dumps(clean(obj), indent=1, default=default, allow_nan=False)


class Progress:
    """A one-line progress bar on stderr, drawn only when stderr is a terminal."""

    def __init__(self, total: int, label: str, stream: Any = None):
        self.total, self.label, self.done = max(total, 1), label, 0
        self.stream = stream or sys.stderr
        self.on = bool(getattr(self.stream, "isatty", lambda: False)())
        self.t0 = time.monotonic()
        self._draw()

    def __call__(self, n: int = 1) -> None:
        self.done = min(self.done + n, self.total)
        self._draw()

    def _draw(self) -> None:
        if not self.on:
            return
        frac = self.done / self.total
        bar = "#" * int(30 * frac) + "." * (30 - int(30 * frac))
        self.stream.write(f"\r{self.label} [{bar}] {self.done}/{self.total} "
                          f"{time.monotonic() - self.t0:.0f}s")
        self.stream.flush()

    def close(self) -> None:
        if self.on:
            self.stream.write("\n")
            self.stream.flush()
