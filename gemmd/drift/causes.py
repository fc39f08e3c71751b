"""What changed with an alarm: a probe's context as drift keeps it, and the cause named
from the probes' context against the reference period's (CAUSES, and in words)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Collection, Mapping
from typing import Any

# What changed with an alarm, from the probes' context against the reference period's:
# a bounded vocabulary (a label value), each with its words.
CAUSES = {
    "power_limit": "power limit changed",
    "clocks_thermal": "SM clocks down: thermal slowdown",
    "clocks_power_cap": "SM clocks down at the power cap (more power per clock: hotter or "
                        "aging card)",
    "clocks_hw_slowdown": "SM clocks down: hardware slowdown (power brake, external signal)",
    "clocks_other": "SM clocks down with no throttle reason (locked or application clocks)",
    "memory_clock": "memory clock down",
    "clocks_up": "SM clocks up",
    "temperature": "hotter at the same clocks",
    "same_clocks": "same clocks, less work: no counter explains it",
    "same_clocks_power": "same clocks, more power: no counter explains it",
    "unknown": "no probe context recorded",
}
THERMAL = {"sw_thermal_slowdown", "hw_thermal_slowdown"}
HW_SLOW = {"hw_slowdown", "hw_power_brake_slowdown"}
CTX_NORMAL = 30  # contexts per probe that describe the reference period
CTX_RECENT = 3  # ... and the latest
CLOCK_DROP = 0.01  # a clock 1% lower (or higher) has changed
TEMP_UP = 8.0  # degrees C hotter has changed


def context_row(ctx: Mapping[str, Any] | None) -> list[Any] | None:
    """A probe's context as drift keeps it: [SM MHz, memory MHz, C, power limit W,
    "reason|reason"] (None where a value is missing)."""
    if not ctx:
        return None

    def num(key: str, scale: float = 1.0) -> float | None:
        v: Any = ctx.get(key)
        try:
            f = float(v) / scale
        except (TypeError, ValueError):
            return None
        return f if math.isfinite(f) else None

    reasons = ctx.get("clock_event_reasons") or []
    if isinstance(reasons, str):
        reasons = [r for r in reasons.split("|") if r]
    return [num("sm_clock_hz", 1e6), num("mem_clock_hz", 1e6), num("temperature_c"),
            num("power_limit_w"), "|".join(sorted(str(r) for r in reasons))]


def _med(rows: list[list[Any]], i: int) -> float | None:
    vals = [r[i] for r in rows if r and r[i] is not None]
    return statistics.median(vals) if vals else None


def _reasons(rows: list[list[Any]]) -> set[str]:
    return {x for r in rows if r for x in str(r[4]).split("|") if x}


def name_cause(target: str, contexts: Mapping[str, Mapping[str, list[list[Any]]]],
               moved: Collection[str], runtime_cause: tuple[str, str] | None = None
               ) -> tuple[str, str]:
    """(cause, in words) of an alarm on ``target`` from the probes' contexts (per probe
    name: its reference period's rows, "normal", and the latest, "recent"; see
    ``context_row``), looking at the probes that moved (all where none is named).

    A changed power limit first (it moves every probe at the cap); then, for a slower
    runtime, SM clocks down on the probes that moved (and why: a thermal or hardware
    clock-event reason that was not there before, the power cap, or none), the memory
    clock; for more power or energy, clocks up, a hotter card; otherwise "same clocks":
    the case no counter explains, the one that needs a human. Energy follows the runtime's
    cause when the runtime is in alarm too (``runtime_cause``)."""
    have = {p: c for p, c in contexts.items() if c.get("normal") and c.get("recent")}
    if not have:
        return "unknown", CAUSES["unknown"]
    if target == "energy" and runtime_cause is not None and runtime_cause[0] != "unknown":
        return runtime_cause
    normal = [r for c in have.values() for r in c["normal"]]
    recent = [r for c in have.values() for r in c["recent"]]
    pl_n, pl_r = _med(normal, 3), _med(recent, 3)
    if pl_n and pl_r and abs(pl_r / pl_n - 1) >= CLOCK_DROP:
        return "power_limit", f"power limit {pl_n:.0f} -> {pl_r:.0f} W"
    probes = [p for p in have if p in moved] or list(have)
    ratios, mem, temps, new, capped = [], [], [], set(), False
    for p in probes:
        n, r = have[p]["normal"], have[p]["recent"]
        sm_n, sm_r = _med(n, 0), _med(r, 0)
        if sm_n and sm_r:
            ratios.append(sm_r / sm_n)
        mn, mr = _med(n, 1), _med(r, 1)
        if mn and mr:
            mem.append(mr / mn)
        tn, tr_ = _med(n, 2), _med(r, 2)
        if tn is not None and tr_ is not None:
            temps.append(tr_ - tn)
        new |= _reasons(r) - _reasons(n)
        capped |= bool({"sw_power_cap", "board_limit"} & _reasons(r))
    clock = statistics.median(ratios) if ratios else None
    hot = statistics.median(temps) if temps else None
    warm = f", {hot:+.0f} C" if hot is not None and abs(hot) >= 1 else ""
    if target == "runtime":
        if clock is not None and clock <= 1 - CLOCK_DROP:
            drop = f"SM clocks {100 * (clock - 1):+.1f}%{warm}"
            if new & THERMAL:
                return "clocks_thermal", f"{drop}: thermal slowdown ({', '.join(sorted(new))})"
            if new & HW_SLOW:
                return "clocks_hw_slowdown", f"{drop}: hardware slowdown " \
                                             f"({', '.join(sorted(new))})"
            if capped:
                return "clocks_power_cap", f"{drop} at the power cap (sw_power_cap): more " \
                                           "power per clock"
            return "clocks_other", f"{drop}, no throttle reason (locked or application " \
                                   "clocks?)"
        m = statistics.median(mem) if mem else None
        if m is not None and m <= 1 - CLOCK_DROP:
            return "memory_clock", f"memory clock {100 * (m - 1):+.1f}%"
        return "same_clocks", f"same clocks, less work{warm}"
    if clock is not None and clock >= 1 + CLOCK_DROP:
        return "clocks_up", f"SM clocks {100 * (clock - 1):+.1f}%{warm}"
    if hot is not None and hot >= TEMP_UP:
        return "temperature", f"{hot:+.0f} C at the same clocks (leakage, cooling)"
    return "same_clocks_power", f"same clocks, more {target}{warm}"
