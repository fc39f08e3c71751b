"""The fleet report's figures per GPU: measured / predicted over time, each probe measured
against predicted with its interval, and the device context (clocks, temperature, power
limit, clock-event reasons); drift alarms, model changes and rebaselines marked on each.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from gemmd.gemm import TARGETS
from gemmd.report.fleet.alarms import _num
from gemmd.report.fleet.data import GpuData, probe_label
from gemmd.report.page import PROBE_COLORS, TARGET_TITLE, legend_above, unit_for, value_axis

MAX_POINTS = 600  # results per series drawn as they are; beyond, medians per time bin
ALARM_COLOR = "#d62728"
CLEAR_COLOR = "#2ca02c"
REBASELINE_COLOR = "#7b3fb5"


def _times(ts: np.ndarray) -> np.ndarray:
    return (np.asarray(ts) * 1e3).astype("int64").astype("datetime64[ms]")


def _bin(ts: np.ndarray, arrays: list[np.ndarray], flags: np.ndarray
         ) -> tuple[np.ndarray, list[np.ndarray], np.ndarray]:
    """At most MAX_POINTS points (``ts`` ascending): per equal time bin the median time
    and the median of each array (NaN ignored); a flag is set if set in the bin."""
    starts = _bin_edges(ts)
    if starts is None:
        return ts, arrays, flags
    return (_reduce(ts, starts, "median"), [_reduce(a, starts, "median") for a in arrays],
            np.logical_or.reduceat(flags, starts))


def _alarm_spans(g: GpuData) -> list[tuple[float, float]]:
    """Time spans of results taken while the GPU was flagged as drifting: from the first
    flagged result to the next unflagged one (or the last flagged one)."""
    ts = np.concatenate([s.ts for s in g.series]) if g.series else np.zeros(0)
    fl = np.concatenate([s.flagged for s in g.series]) if g.series else np.zeros(0, bool)
    order = np.argsort(ts, kind="stable")
    ts, fl = ts[order], fl[order]
    spans, start = [], None
    for t, f in zip(ts, fl):
        if f and start is None:
            start = t
        elif not f and start is not None:
            spans.append((start, t))
            start = None
    if start is not None:
        spans.append((start, float(ts[-1])))
    return spans


def _model_changes(g: GpuData) -> list[tuple[float, str]]:
    pairs = sorted((float(t), v) for s in g.series for t, v, o in zip(s.ts, s.version, s.ok)
                   if o and v)
    out, last = [], None
    for t, v in pairs:
        if v != last:
            if last is not None:
                out.append((t, v))
            last = v
    return out


def _mark_time(ax: Any, g: GpuData, spans: list[tuple[float, float]],
               changes: list[tuple[float, str]], label: bool, *, annotate: bool | None = None,
               target: str | None = None) -> None:
    """Shade the results taken in drift alarm; a dotted line where a new model took over;
    from the store's events, the drift alarms of ``target`` (None: every target) as a bar
    along the top with a line where each was raised and where it cleared, and a line at
    each rebaseline. ``label``: name them for the legend; ``annotate`` (default: label):
    write the model's version and the rebaselines on the panel."""
    annotate = label if annotate is None else annotate
    for i, (a, b) in enumerate(spans):
        ax.axvspan(_times(np.array([a]))[0], _times(np.array([b]))[0], color=ALARM_COLOR,
                   alpha=0.12, lw=0, zorder=0,
                   label="taken in drift alarm (flagged)" if label and i == 0 else None)
    for i, (t, v) in enumerate(changes):
        x = _times(np.array([t]))[0]
        ax.axvline(x, color="#777", ls=":", lw=1, zorder=1,
                   label="new model" if label and i == 0 else None)
        if annotate:
            ax.annotate(v, (x, 1.0), xycoords=("data", "axes fraction"), xytext=(2, -2),
                        textcoords="offset points", fontsize=7, color="#555", va="top")
    lo, hi = g.window
    raised = cleared = 0
    for i, sp in enumerate(x for x in g.alarms if target is None or x.target == target):
        x0, x1 = _times(np.array([max(sp.start, lo), sp.end if sp.end is not None else hi]))
        ax.axvspan(x0, x1, ymin=0.955, ymax=1.0, color=ALARM_COLOR, alpha=0.6, lw=0,
                   zorder=2, label="in drift alarm" if label and i == 0 else None)
        if sp.start_known and sp.start >= lo:
            ax.axvline(x0, color=ALARM_COLOR, lw=1.1, zorder=2,
                       label="drift alarm raised" if label and not raised else None)
            raised += 1
            ratio = _num(sp.raised.get("ratio"))
            if label and target is not None and ratio:
                ax.annotate(f"×{ratio:.3f}", (x0, 0.95), xycoords=("data", "axes fraction"),
                            xytext=(2, -2), textcoords="offset points", fontsize=7,
                            color=ALARM_COLOR, va="top")
        if sp.end is not None and sp.end <= hi and sp.ended_by == "cleared":
            ax.axvline(x1, color=CLEAR_COLOR, lw=1.1, ls="--", zorder=2,
                       label="drift alarm cleared" if label and not cleared else None)
            cleared += 1
    for i, m in enumerate(g.rebaselines):
        x = _times(np.array([m.ts]))[0]
        ax.axvline(x, color=REBASELINE_COLOR, lw=1.4, ls="-.", zorder=2,
                   label="rebaseline" if label and i == 0 else None)
        if annotate:
            what = "rebaseline" + (" requested" if m.phase == "requested" else "") + (
                " (automatic)" if m.phase == "automatic" else "") + (
                f": {m.unflagged:,} results unflagged" if m.unflagged else "")
            ax.annotate(what, (x, 0.0), xycoords=("data", "axes fraction"), xytext=(2, 2),
                        textcoords="offset points", fontsize=7, color=REBASELINE_COLOR,
                        va="bottom")


def _legend_of(axes: Sequence[Any]) -> tuple[list[Any], list[str]]:
    """The legend entries of several panels, each label once."""
    handles, labels = [], []
    for ax in axes:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            if lab not in labels:
                handles.append(h)
                labels.append(lab)
    return handles, labels


def _time_axis(ax: Any, g: GpuData) -> None:
    """The GPU's window of results (the same on each of its figures), dates readable."""
    import matplotlib.dates as mdates

    ts = g.context.ts
    if len(ts):
        a, b = float(ts.min()), float(ts.max())
        pad = max((b - a) * 0.02, 5.0)
        ax.set_xlim(_times(np.array([a - pad]))[0], _times(np.array([b + pad]))[0])
    loc = mdates.AutoDateLocator(minticks=4, maxticks=9)
    ax.xaxis.set_major_locator(loc)
    ax.xaxis.set_major_formatter(mdates.ConciseDateFormatter(loc, show_offset=True))


def _fig_ratio(plt: Any, g: GpuData) -> Any:
    """measured / predicted per probe over time, one panel per target."""
    targets = [t for t in TARGETS if any(np.isfinite(s.meas[t] / s.pred[t]).any()
                                         for s in g.series)]
    targets = targets or ["runtime"]
    fig, axes = plt.subplots(len(targets), 1, figsize=(12, 1.75 * len(targets) + 1.0),
                             sharex=True, squeeze=False)
    spans, changes = _alarm_spans(g), _model_changes(g)
    for row, target in enumerate(targets):
        ax = axes[row][0]
        # The scale follows the fitted models' results within 0.5-2 (the roofline's,
        # before the first fit, can be off by 2-50x: beyond, points sit at the edge). With
        # no fitted model at all, the roofline's ratios set a logarithmic scale.
        fitted = [s.meas[target][v] / s.pred[target][v] for s in g.series
                  for v in [np.array([x not in ("", "roofline") for x in s.version], bool)]]
        allr = np.concatenate(fitted) if fitted else np.zeros(0)
        allr = allr[np.isfinite(allr) & (allr > 0)]
        log = False
        if allr.size:
            lo, hi = np.percentile(allr, [0.5, 99.5])
            lo, hi = min(max(lo, 0.5), 0.98), max(min(hi, 2.0), 1.02)
        else:
            allr = np.concatenate([s.meas[target] / s.pred[target] for s in g.series])
            allr = allr[np.isfinite(allr) & (allr > 0)]
            lo, hi = (float(allr.min()), float(allr.max())) if allr.size else (0.9, 1.1)
            lo, hi = min(lo, 0.9), max(hi, 1.1)
            log = hi / lo > 5
        pad = (hi - lo) * 0.08
        ylo, yhi = (lo / 1.15, hi * 1.15) if log else (lo - pad, hi + pad)
        _mark_time(ax, g, spans, changes, label=True, annotate=row == 0, target=target)
        ax.axhline(1.0, color="#444", lw=0.9, zorder=1)
        for i, s in enumerate(g.series):
            r = s.meas[target] / s.pred[target]
            good = np.isfinite(r)
            if not good.any():
                continue
            ts, (rr,), _ = _bin(s.ts[good], [r[good]], s.flagged[good])
            c = PROBE_COLORS[i % len(PROBE_COLORS)]
            clipped = np.clip(rr, ylo, yhi)
            ax.plot(_times(ts), clipped, color=c, lw=0.9, alpha=0.85, ms=1.8,
                    marker="o" if len(ts) <= MAX_POINTS // 2 else None,
                    label=probe_label(s.spec) if row == 0 else None,
                    rasterized=len(ts) > MAX_POINTS)
            for out, mk in ((rr > yhi, "^"), (rr < ylo, "v")):
                if out.any():
                    ax.scatter(_times(ts[out]), clipped[out], marker=mk, s=16, color=c,
                               zorder=4)
        if row == 0:
            bad = [(t, o) for s in g.series for t, o in zip(s.ts, s.outcome) if o != "ok"]
            for kind, mk, col in (("failed", "x", "#555"), ("mismatch", "X", ALARM_COLOR)):
                tt = np.array([t for t, o in bad if o == kind])
                if tt.size:
                    ax.scatter(_times(tt), np.full(tt.size, yhi - pad / 2), marker=mk, s=22,
                               color=col, zorder=5,
                               label="failed probe" if kind == "failed" else "wrong result")
        value_axis(ax, "y", lo, hi, force_log=log)
        ax.set_ylim(ylo, yhi)
        ax.set_ylabel(f"{target}\nmeasured / predicted")
    _time_axis(axes[-1][0], g)
    axes[-1][0].set_xlabel("time (UTC)")
    handles, labels = _legend_of([a[0] for a in axes])
    axes[0][0].legend(handles, labels, loc="lower left", bbox_to_anchor=(0.0, 1.01), ncol=3,
                      borderaxespad=0.0, handlelength=1.6, columnspacing=1.2)
    axes[0][0].set_title("Measured / predicted over time: 1 = the model exactly; a step up "
                         "is a slowdown (points off the scale sit at its edge as ▲ ▼)",
                         loc="left", fontsize=10, fontweight="bold",
                         pad=16 + 12 * math.ceil(len(handles) / 3))
    fig.tight_layout()
    return fig


def _fig_probes(plt: Any, g: GpuData) -> Any:
    """Per probe (rows) and target (columns): measured, predicted and its interval."""
    targets = [t for t in TARGETS if any(np.isfinite(s.meas[t]).any() for s in g.series)]
    n = len(g.series)
    fig, axes = plt.subplots(n, len(targets), figsize=(12, 1.6 * n + 1.0), sharex=True,
                             squeeze=False)
    spans, changes = _alarm_spans(g), _model_changes(g)
    for i, s in enumerate(g.series):
        for j, target in enumerate(targets):
            ax = axes[i][j]
            m, p = s.meas[target], s.pred[target]
            unit, f = unit_for(target, m)
            ts, (mm, pp, lo, hi), fl = _bin(s.ts, [m, p, s.lo[target], s.hi[target]],
                                             s.flagged)
            t = _times(ts)
            _mark_time(ax, g, spans, changes, label=False, target=target)
            band = np.isfinite(lo) & np.isfinite(hi)
            if band.any():
                ax.fill_between(t, np.where(band, lo / f, np.nan), np.where(band, hi / f,
                                np.nan), color="#0072B2", alpha=0.16, lw=0, step="mid",
                                label="prediction interval" if i == 0 and j == 0 else None)
            ax.plot(t, pp / f, color="#0072B2", lw=1.1, drawstyle="steps-mid",
                    label="predicted" if i == 0 and j == 0 else None)
            good = np.isfinite(mm)
            vals = np.concatenate([mm[good], pp[np.isfinite(pp)]]) / f
            if vals.size:
                lo_v, hi_v = (float(x) for x in np.percentile(vals, [0.5, 99.5]))
                value_axis(ax, "y", lo_v, hi_v, force_log=False)
                ylo, yhi = ax.get_ylim()
                y = np.clip(mm / f, ylo, yhi)  # off the scale: at its edge, as a triangle
                off = good & ((mm / f < ylo) | (mm / f > yhi))
                for sel, col, lab in ((good & ~fl, "#222", "measured"),
                                      (good & fl, ALARM_COLOR, "measured, in drift alarm")):
                    if sel.any():
                        ax.scatter(t[sel & ~off], y[sel & ~off], s=5, color=col, zorder=3,
                                   linewidths=0, label=lab if i == 0 and j == 0 else None,
                                   rasterized=len(ts) > MAX_POINTS)
                        for side, mk in ((mm / f > yhi, "^"), (mm / f < ylo, "v")):
                            if (sel & side).any():
                                ax.scatter(t[sel & side], y[sel & side], s=16, color=col,
                                           zorder=3, marker=mk, linewidths=0, clip_on=False)
                ax.set_ylim(ylo, yhi)
            else:
                ax.text(0.5, 0.5, f"{target} not measured", transform=ax.transAxes,
                        ha="center", va="center", color="#777")
            ax.set_ylabel(unit, labelpad=2)
            if i == 0:
                ax.set_title(TARGET_TITLE[target], fontsize=9.5, pad=18)
            if j == 0:
                ax.annotate(probe_label(s.spec), (0, 1), xycoords="axes fraction",
                            xytext=(2, 3), textcoords="offset points", fontsize=8.5,
                            fontweight="bold", va="bottom")
    for j in range(len(targets)):
        _time_axis(axes[-1][j], g)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower right", bbox_to_anchor=(1.0, 1.0),
               ncol=len(handles), frameon=False)
    fig.suptitle("Each probe: measured against predicted, with the prediction interval",
                 x=0.01, ha="left", y=1.0, va="bottom", fontsize=10, fontweight="bold")
    fig.tight_layout(h_pad=1.6)
    return fig


def _bin_edges(ts: np.ndarray, limit: int = MAX_POINTS) -> np.ndarray | None:
    """Starts of MAX_POINTS equal time bins over ``ts`` (ascending) where it holds more
    than ``limit`` values; None: few enough to draw each."""
    if len(ts) <= limit:
        return None
    edges = np.linspace(ts[0], ts[-1], MAX_POINTS + 1)
    idx = np.clip(np.searchsorted(edges, ts, side="right") - 1, 0, MAX_POINTS - 1)
    return np.flatnonzero(np.r_[True, idx[1:] != idx[:-1]])


def _reduce(a: np.ndarray, starts: np.ndarray, how: str) -> np.ndarray:
    """The "median", "min" or "max" of ``a`` per bin (bins start at ``starts``), NaN
    ignored, NaN for a bin without a value; vectorized (one sort)."""
    n = len(a)
    group = np.repeat(np.arange(len(starts)), np.diff(np.r_[starts, n]))
    ok = np.isfinite(a)
    g, v = group[ok], a[ok]
    order = np.lexsort((v, g))
    v = v[order]
    counts = np.bincount(g, minlength=len(starts))
    first = np.r_[0, np.cumsum(counts)[:-1]]
    has = counts > 0
    out = np.full(len(starts), np.nan)
    if how == "min":
        out[has] = v[first[has]]
    elif how == "max":
        out[has] = v[first[has] + counts[has] - 1]
    else:
        lo, hi = first + (counts - 1) // 2, first + counts // 2
        out[has] = (v[lo[has]] + v[hi[has]]) / 2
    return out


def _context_line(ax: Any, ts: np.ndarray, v: np.ndarray, starts: np.ndarray | None,
                  color: str, label: str, dashed: bool = False) -> None:
    """A context value over time; binned: its median per bin and its min-max range (a dip
    of the clock within a bin stays visible)."""
    if starts is None:
        if dashed:
            ax.plot(_times(ts), v, color=color, lw=1.0, ls="--", label=label)
        else:
            ax.plot(_times(ts), v, color=color, lw=0, marker="o", ms=2.2, label=label)
        return
    t = _times(_reduce(ts, starts, "median"))
    ax.fill_between(t, _reduce(v, starts, "min"), _reduce(v, starts, "max"), color=color,
                    alpha=0.25, lw=0, step="mid")
    ax.plot(t, _reduce(v, starts, "median"), color=color, lw=1.0, ls="--" if dashed else "-",
            label=label + " (median, range per bin)")


def _fig_context(plt: Any, g: GpuData) -> Any:
    ts, values, reasons = g.context.ts, g.context.values, g.context.reasons
    starts = _bin_edges(ts, 4 * MAX_POINTS)  # a GPU's every result: binned beyond 2,400
    t = _times(ts)
    fig, axes = plt.subplots(3, 1, figsize=(12, 4.9), sharex=True,
                             gridspec_kw={"height_ratios": [1, 1, 0.8 + 0.12 * len(
                                 reasons or ())]})
    spans, changes = _alarm_spans(g), _model_changes(g)
    panels = [("SM clock (MHz)", "memory clock (MHz)"), ("temperature (°C)", "power limit (W)")]
    for ax, (a, b) in zip(axes[:2], panels):
        _mark_time(ax, g, spans, changes, label=False)
        va = values[a]
        if np.isfinite(va).any():
            _context_line(ax, ts, va, starts, "#0072B2", a)
            good = va[np.isfinite(va)]
            value_axis(ax, "y", float(good.min()), float(good.max()), force_log=False)
            ax.set_ylabel(a.split(" (")[0].replace(" clock", "\nclock") +
                          f" ({a.split('(')[1]}")
        else:
            ax.text(0.5, 0.5, f"{a} not recorded by this backend", transform=ax.transAxes,
                    ha="center", va="center", color="#777")
            ax.set_yticks([])
        vb = values[b]
        if np.isfinite(vb).any():
            tw = ax.twinx()
            _context_line(tw, ts, vb, starts, "#D55E00", b, dashed=True)
            good = vb[np.isfinite(vb)]
            value_axis(tw, "y", float(good.min()), float(good.max()), force_log=False)
            tw.set_ylabel(b, color="#D55E00")
            tw.tick_params(axis="y", colors="#D55E00")
            tw.grid(False)
            tw.spines["right"].set_visible(True)
            h1, l1 = ax.get_legend_handles_labels()
            h2, l2 = tw.get_legend_handles_labels()
            ax.legend(h1 + h2, l1 + l2, loc="lower left", bbox_to_anchor=(0.0, 1.0), ncol=2,
                      borderaxespad=0.0)
        else:
            legend_above(ax)
    ax = axes[2]
    _mark_time(ax, g, spans, changes, label=False)
    if reasons:
        names = sorted(reasons)
        tb = t if starts is None else _times(_reduce(ts, starts, "median"))
        for k, name in enumerate(names):
            on = reasons[name] if starts is None else \
                np.logical_or.reduceat(reasons[name], starts)
            ax.scatter(tb[on], np.full(int(on.sum()), k), marker="|", s=60,
                       color=ALARM_COLOR if "slowdown" in name or "cap" in name else "#555")
        ax.set_yticks(range(len(names)))
        ax.set_yticklabels(names, fontsize=7.5)
        ax.set_ylim(-0.7, len(names) - 0.3)
        ax.grid(axis="y", visible=False)
    else:
        ax.set_yticks([])
        ax.text(0.5, 0.5, "no clock-event (throttle) reason active after any probe"
                if reasons is not None else "clock-event reasons not recorded by this backend",
                transform=ax.transAxes, ha="center", va="center", color="#555")
    ax.set_title("clock-event (throttle) reasons active after each probe", loc="left",
                 fontsize=9)
    _time_axis(ax, g)
    ax.set_xlabel("time (UTC)")
    axes[0].set_title("Device context read after each probe", loc="left", fontsize=10,
                      fontweight="bold", pad=20)
    fig.tight_layout()
    return fig
