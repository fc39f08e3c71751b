"""`gemmd report`: one self-contained HTML page of figures, after the GPPerf paper's.

Predicted vs measured (every test row, and the mean per shape sorted by M x N as the
paper plots it), error by size and error by configuration, for gemmd and GPPerf's
pipeline fitted on the same split. Figures are inline SVG: no plotting library needed.
"""

from __future__ import annotations

import html
import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from gemmd import evaluate
from gemmd.config import ModelConfig
from gemmd.datasets import Dataset
from gemmd.features import Table, flops
from gemmd.gemm import COLUMN, TARGETS

COLORS = {"gemmd": "#1f77b4", "gpperf": "#d62728", "measured": "#222222"}
W, H, PAD = 560, 360, 56


def work_units() -> int:
    return 2 * len(TARGETS)


class _Svg:
    """A minimal chart: axes (linear or log10), points, polylines, bars, legend."""

    def __init__(self, title: str, xlabel: str, ylabel: str, xlim: tuple[float, float],
                 ylim: tuple[float, float], xlog: bool = False, ylog: bool = False):
        self.title, self.xlabel, self.ylabel = title, xlabel, ylabel
        self.xlog, self.ylog = xlog, ylog
        self.x0, self.x1 = (math.log10(v) for v in xlim) if xlog else xlim
        self.y0, self.y1 = (math.log10(v) for v in ylim) if ylog else ylim
        if self.x1 <= self.x0:
            self.x1 = self.x0 + 1
        if self.y1 <= self.y0:
            self.y1 = self.y0 + 1
        self.items: list[str] = []
        self.legend: list[tuple[str, str]] = []

    def px(self, x: float) -> float:
        v = math.log10(x) if self.xlog else x
        return PAD + (v - self.x0) / (self.x1 - self.x0) * (W - 1.5 * PAD)

    def py(self, y: float) -> float:
        v = math.log10(y) if self.ylog else y
        return H - PAD - (v - self.y0) / (self.y1 - self.y0) * (H - 1.8 * PAD)

    def points(self, xs: Sequence[float], ys: Sequence[float], color: str, label: str,
               r: float = 1.6) -> None:
        for x, y in zip(xs, ys):
            if _ok(x, self.xlog) and _ok(y, self.ylog):
                self.items.append(f'<circle cx="{self.px(x):.1f}" cy="{self.py(y):.1f}" '
                                  f'r="{r}" fill="{color}" fill-opacity="0.45"/>')
        self.legend.append((label, color))

    def line(self, xs: Sequence[float], ys: Sequence[float], color: str, label: str | None,
             dash: str = "") -> None:
        pts = " ".join(f"{self.px(x):.1f},{self.py(y):.1f}" for x, y in zip(xs, ys)
                       if _ok(x, self.xlog) and _ok(y, self.ylog))
        style = f' stroke-dasharray="{dash}"' if dash else ""
        self.items.append(f'<polyline points="{pts}" fill="none" stroke="{color}" '
                          f'stroke-width="1.5"{style}/>')
        if label:
            self.legend.append((label, color))

    def bars(self, groups: Sequence[str], series: dict[str, Sequence[float]]) -> None:
        """Grouped vertical bars; x axis is categorical (0..len(groups))."""
        n = len(series)
        width = 0.8 / max(n, 1)
        for j, (label, vals) in enumerate(series.items()):
            color = COLORS.get(label, "#888")
            for i, v in enumerate(vals):
                if not _ok(v, self.ylog):
                    continue
                x = i + 0.1 + j * width
                y0 = self.py(10 ** self.y0 if self.ylog else max(self.y0, 0.0))
                y1 = self.py(v)
                self.items.append(f'<rect x="{self.px(x):.1f}" y="{min(y0, y1):.1f}" '
                                  f'width="{self.px(x + width) - self.px(x):.1f}" '
                                  f'height="{abs(y0 - y1):.1f}" fill="{color}"/>')
            self.legend.append((label, color))
        for i, g in enumerate(groups):
            x = self.px(i + 0.5)
            self.items.append(f'<text x="{x:.1f}" y="{H - PAD + 12}" font-size="9" '
                              f'text-anchor="end" transform="rotate(-35 {x:.1f} '
                              f'{H - PAD + 12})">{html.escape(g)}</text>')
        self._categorical = True

    def render(self) -> str:
        out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" '
               f'font-family="sans-serif" font-size="11">',
               f'<rect width="{W}" height="{H}" fill="white"/>',
               f'<text x="{W / 2}" y="16" text-anchor="middle" font-size="13">'
               f'{html.escape(self.title)}</text>']
        left, right, top, bottom = PAD, W - PAD / 2, 0.8 * PAD, H - PAD
        out.append(f'<rect x="{left}" y="{top}" width="{right - left}" '
                   f'height="{bottom - top}" fill="none" stroke="#999"/>')
        for v, label in self._ticks(self.y0, self.y1, self.ylog):
            y = self.py(v)
            out.append(f'<line x1="{left}" x2="{right}" y1="{y:.1f}" y2="{y:.1f}" '
                       f'stroke="#eee"/><text x="{left - 4}" y="{y + 3:.1f}" '
                       f'text-anchor="end">{label}</text>')
        if not getattr(self, "_categorical", False):
            for v, label in self._ticks(self.x0, self.x1, self.xlog):
                x = self.px(v)
                out.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{top}" y2="{bottom}" '
                           f'stroke="#eee"/><text x="{x:.1f}" y="{bottom + 14}" '
                           f'text-anchor="middle">{label}</text>')
        out.extend(self.items)
        out.append(f'<text x="{(left + right) / 2}" y="{H - 6}" text-anchor="middle">'
                   f'{html.escape(self.xlabel)}</text>')
        out.append(f'<text x="12" y="{(top + bottom) / 2}" text-anchor="middle" '
                   f'transform="rotate(-90 12 {(top + bottom) / 2})">'
                   f'{html.escape(self.ylabel)}</text>')
        seen = []
        for label, color in self.legend:
            if label not in seen:
                seen.append(label)
                y = top + 6 + 14 * len(seen)
                out.append(f'<rect x="{left + 8}" y="{y - 8}" width="10" height="10" '
                           f'fill="{color}"/><text x="{left + 22}" y="{y + 1}">'
                           f'{html.escape(label)}</text>')
        out.append("</svg>")
        return "\n".join(out)

    @staticmethod
    def _ticks(lo: float, hi: float, log: bool) -> list[tuple[float, str]]:
        if log:
            return [(10.0**e, f"1e{e}") for e in range(math.ceil(lo), math.floor(hi) + 1)]
        step = 10 ** math.floor(math.log10(max(hi - lo, 1e-12)))
        if (hi - lo) / step < 4:
            step /= 2
        v = math.ceil(lo / step) * step
        out = []
        while v <= hi + 1e-12:
            out.append((v, f"{v:g}"))
            v += step
        return out


def _ok(v: float, log: bool) -> bool:
    return v is not None and math.isfinite(v) and (v > 0 or not log)


def _lims(*arrays: np.ndarray) -> tuple[float, float]:
    v = np.concatenate([a[np.isfinite(a) & (a > 0)] for a in arrays])
    if not v.size:
        return 1e-6, 1.0
    return float(v.min()) / 1.2, float(v.max()) * 1.2


# ------------------------------------------------------------------ figures


def fig_scatter(target: str, meas: np.ndarray, preds: dict[str, np.ndarray]) -> str:
    unit = COLUMN[target].split("_")[1]
    lo, hi = _lims(meas, *preds.values())
    c = _Svg(f"{target}: predicted vs measured (test rows)", f"measured ({unit})",
             f"predicted ({unit})", (lo, hi), (lo, hi), xlog=True, ylog=True)
    c.line([lo, hi], [lo, hi], "#999", None, dash="4 3")
    for name, p in preds.items():
        c.points(meas, p, COLORS[name], name)
    return c.render()


def fig_by_shape(target: str, t: Table, meas: np.ndarray, preds: dict[str, np.ndarray]
                 ) -> str:
    """Mean measured and predicted per shape, shapes sorted by M x N (then K), as GPPerf."""
    keys = np.column_stack([t["m"] * t["n"], t["k"], t["m"], t["n"]])
    uniq, inv = np.unique(keys, axis=0, return_inverse=True)
    inv = inv.ravel()
    ok = np.isfinite(meas)

    def mean(v: np.ndarray) -> np.ndarray:
        s = np.bincount(inv[ok], weights=v[ok], minlength=len(uniq))
        n = np.bincount(inv[ok], minlength=len(uniq))
        return np.where(n > 0, s / np.maximum(n, 1), np.nan)

    x = np.arange(len(uniq), dtype=float)
    m = mean(meas)
    lo, hi = _lims(m, *(mean(p) for p in preds.values()))
    unit = COLUMN[target].split("_")[1]
    c = _Svg(f"{target}: mean per shape, sorted by M x N", "shape (sorted by M x N, then K)",
             f"{target} ({unit})", (0, max(len(uniq) - 1, 1)), (lo, hi), ylog=True)
    c.line(x, m, COLORS["measured"], "measured", dash="5 3")
    for name, p in preds.items():
        c.line(x, mean(p), COLORS[name], name)
    return c.render()


def fig_by_size(target: str, t: Table, meas: np.ndarray, preds: dict[str, np.ndarray]
                ) -> str:
    f = flops(t)
    ok = np.isfinite(meas) & (f > 0)
    edges = np.unique(np.floor(np.log10(f[ok]))) if ok.any() else np.array([0.0])
    groups, series = [], {name: [] for name in preds}
    for e in edges:
        sel = ok & (np.floor(np.log10(f)) == e)
        groups.append(f"1e{int(e)} FLOP")
        for name, p in preds.items():
            ape = np.abs(p[sel] - meas[sel]) / meas[sel]
            series[name].append(100 * float(np.median(ape)) if ape.size else math.nan)
    return _bars(f"{target}: median error by size", "FLOPs per GEMM", groups, series)


def fig_by_config(target: str, t: Table, meas: np.ndarray, preds: dict[str, np.ndarray],
                  limit: int = 16) -> str:
    label = _config_labels(t)
    ok = np.isfinite(meas)
    names, counts = np.unique(label[ok], return_counts=True)
    names = names[np.argsort(-counts)][:limit]
    series = {name: [] for name in preds}
    for g in names:
        sel = ok & (label == g)
        for name, p in preds.items():
            series[name].append(100 * float(np.median(np.abs(p[sel] - meas[sel]) / meas[sel])))
    return _bars(f"{target}: median error by configuration", "configuration", list(names),
                 series)


def _bars(title: str, xlabel: str, groups: list[str], series: dict[str, list[float]]) -> str:
    top = max([v for vals in series.values() for v in vals if math.isfinite(v)] or [1.0])
    c = _Svg(title, xlabel, "median APE (%)", (0, max(len(groups), 1)), (0, top * 1.15))
    c.bars(groups, series)
    return c.render()


def _config_labels(t: Table) -> np.ndarray:
    parts = [t["dtype"].astype(str), t["kernel"].astype(str)]
    out = []
    for i in range(len(t)):
        s = f"{parts[0][i]} {parts[1][i]}"
        if t["kernel"][i] == "tiled":
            s += f" t{int(t['tile'][i])}"
        if t["cta_m"][i] > 0:
            s += f" {int(t['cta_m'][i])}x{int(t['cta_n'][i])}"
        s += f" {t['layout'][i]}"
        out.append(s)
    return np.array(out, dtype=object)


# ------------------------------------------------------------------ the page


def write(ds: Dataset, out: Path, *, cfg: ModelConfig | None = None, split: str = "shape",
          n_jobs: int = 1, progress: Callable[[int], None] | None = None) -> Path:
    """Fit gemmd and the baseline on ``split``, write out/report.html; returns its path."""
    t = ds.table
    train, test = evaluate.split(t, split)
    tr, te = t.take(train), t.take(test)
    models: list[Any] = [evaluate.GemmdModel(cfg, n_jobs), evaluate.GPPerfBaseline()]
    preds: dict[str, dict[str, np.ndarray]] = {}
    fit_s: dict[str, float] = {}
    for m in models:
        t0 = time.perf_counter()
        m.fit(tr, progress)
        fit_s[m.name] = time.perf_counter() - t0
        for target, res in m.predict_table(te).items():
            preds.setdefault(target, {})[m.name] = res["point"]
    scores = {name: evaluate.score(te, {tg: {"point": p[name]} for tg, p in preds.items()
                                         if name in p}) for name in fit_s}
    sections = []
    for target in TARGETS:
        meas = te[COLUMN[target]]
        if target not in preds or not np.isfinite(meas).any():
            continue
        p = preds[target]
        rows = "".join(
            f"<tr><td>{n}</td><td>{scores[n][target]['r2']:.3f}</td>"
            f"<td>{100 * scores[n][target]['mape']:.2f}%</td>"
            f"<td>{100 * scores[n][target]['median_ape']:.2f}%</td></tr>"
            for n in p if scores[n].get(target, {}).get("n"))
        sections.append(
            f"<h2>{target}</h2><table><tr><th>model</th><th>R²</th><th>MAPE</th>"
            f"<th>median APE</th></tr>{rows}</table><div class='figs'>"
            + fig_scatter(target, meas, p) + fig_by_shape(target, te, meas, p)
            + fig_by_size(target, te, meas, p) + fig_by_config(target, te, meas, p)
            + "</div>")
    out.mkdir(parents=True, exist_ok=True)
    page = out / "report.html"
    notes = "".join(f"<li>{html.escape(n)}</li>" for n in ds.notes)
    split_text = ("no (M, N, K) in both train and test" if split == "shape"
                  else "random 80/20 split of rows")
    page.write_text(
        "<!doctype html><meta charset='utf-8'><title>gemmd model report</title>"
        "<style>body{font-family:sans-serif;max-width:1180px;margin:auto}"
        ".figs{display:flex;flex-wrap:wrap;gap:8px}table{border-collapse:collapse}"
        "td,th{border:1px solid #ccc;padding:2px 8px;text-align:right}</style>"
        f"<h1>gemmd model report: {html.escape(ds.name)}</h1>"
        f"<p>{len(t):,} rows from {html.escape(', '.join(ds.paths))}; test split: "
        f"{split_text} (seed {evaluate.SEED}), {len(train):,} train / {len(test):,} test "
        f"rows. gemmd fitted in {fit_s['gemmd']:.1f} s, GPPerf's pipeline in "
        f"{fit_s['gpperf']:.1f} s.</p><ul>{notes}</ul>" + "".join(sections),
        encoding="utf-8")
    return page
