"""What both reports share: the output file, the page, units, axes and figures as SVG.

A report is one self-contained HTML file: figures drawn by matplotlib (Agg, no screen)
and inlined as SVG, styles inline, nothing fetched from elsewhere. The file is written
atomically (a temporary file beside it, then a rename), so a failed write leaves the
previous file, or none, never half of one.
"""

from __future__ import annotations

import html
import io
import math
import os
import re
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

import gemmd
from gemmd.errors import InputError
from gemmd.files import cannot_write_in, path_problem, shown

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

# A figure or a figure's statistic resting on fewer rows than this carries a warning.
MIN_ROWS = 30
SUFFIXES = (".html", ".htm")

# One colour per model, the same in every figure (colour-blind-safe Okabe-Ito hues).
COLORS = {"measured": "#222222", "gemmd": "#0072B2", "gpperf": "#D55E00",
          "deployed": "#009E73"}
PROBE_COLORS = ("#0072B2", "#D55E00", "#009E73", "#CC79A7", "#E69F00", "#56B4E9",
                "#F0E442", "#000000", "#999999", "#882255")

esc = html.escape


# ------------------------------------------------------------------ the output file


def check_out(out: str | Path) -> Path:
    """The report's file: an .html path whose directory exists (or is created) and can be
    written. Raises InputError with one line naming the path and the problem. Checked
    before anything slow runs (a fit takes seconds to minutes)."""
    text = str(out)
    if not text.strip():
        raise InputError("--out: no file given (an .html path)")
    problem = path_problem(text)
    if problem:
        raise InputError(f"--out {shown(text)}: {problem}")
    path = Path(text)
    if path.is_dir():
        raise InputError(f"--out {text}: is a directory; give an .html file to write")
    if path.suffix.lower() not in SUFFIXES:
        raise InputError(f"--out {text}: not an .html file name (the report is one HTML "
                         "file, e.g. report.html)")
    if path.exists() and not path.is_file():
        raise InputError(f"--out {text}: exists and is not a regular file")
    parent = path.parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise InputError(f"--out {text}: cannot create directory {parent}: "
                         f"{e.strerror or e}") from None
    if not parent.is_dir():
        raise InputError(f"--out {text}: {parent} is not a directory")
    why = cannot_write_in(parent)
    if why:
        raise InputError(f"--out {text}: cannot write in {parent}: {why}")
    return path


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file in the same directory and a
    rename: readers see the old file or the new one, a failure leaves no partial file."""
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
        tmp = None
    except OSError as e:
        raise InputError(f"--out {path}: cannot write: {e.strerror or e}") from None
    finally:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)


# ------------------------------------------------------------------ formatting


def fmt_time(ts: float | None) -> str:
    if ts is None or not math.isfinite(ts):
        return "-"
    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(ts))


def fmt_pct(v: float | None, digits: int = 1) -> str:
    if v is None or not math.isfinite(v):
        return "-"
    p = 100 * v
    if abs(p) >= 1000:
        return f"{p:,.0f}%"
    if abs(p) >= 100:
        return f"{p:.0f}%"
    return f"{p:.{digits}f}%"


def fmt_num(v: float | None, spec: str = ".3f") -> str:
    return "-" if v is None or not math.isfinite(v) else format(v, spec)


def fmt_count(n: int) -> str:
    return f"{n:,}"


# Display units per target: (label, size of one unit in SI), largest first.
UNITS = {"runtime": (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6), ("ns", 1e-9)),
         "power": (("kW", 1e3), ("W", 1.0), ("mW", 1e-3)),
         "energy": (("kJ", 1e3), ("J", 1.0), ("mJ", 1e-3), ("µJ", 1e-6), ("nJ", 1e-9))}
TARGET_TITLE = {"runtime": "Runtime per GEMM", "power": "Average power",
                "energy": "Energy per GEMM"}


def unit_for(target: str, values: np.ndarray) -> tuple[str, float]:
    """The display unit that puts most of ``values`` (SI; the 75th percentile) at 1 or
    more: 0.05-150 ms rather than 50-150,000 µs."""
    v = np.asarray(values, dtype=float)
    v = np.abs(v[np.isfinite(v) & (v != 0)])
    if not v.size:
        return UNITS[target][1] if target == "power" else UNITS[target][0]
    mid = float(np.percentile(v, 75))
    for unit, f in UNITS[target]:
        if mid >= f:
            return unit, f
    return UNITS[target][-1]


def fmt_value(target: str, v: float | None) -> str:
    if v is None or not math.isfinite(v):
        return "-"
    unit, f = unit_for(target, np.array([v]))
    return f"{v / f:.4g} {unit}"


def shape_name(m: float, n: float, k: float, dtype: str | None = None) -> str:
    s = f"{int(m)}×{int(n)}×{int(k)}"
    return f"{s} {dtype}" if dtype else s


# ------------------------------------------------------------------ figures


def plt_setup() -> Any:
    """pyplot on the Agg backend (no screen), with the reports' style."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    matplotlib.rcParams.update({
        "font.size": 9, "axes.titlesize": 10, "axes.labelsize": 9, "legend.fontsize": 8,
        "xtick.labelsize": 8, "ytick.labelsize": 8, "axes.grid": True, "grid.color": "#e4e4e4",
        "grid.linewidth": 0.6, "axes.axisbelow": True, "axes.spines.top": False,
        "axes.spines.right": False, "figure.dpi": 100, "savefig.dpi": 100,
        # Text stays text (searchable, small); the font list ends in the browser's sans.
        "svg.hashsalt": "gemmd-report", "svg.fonttype": "none",
        "legend.frameon": False, "lines.linewidth": 1.4,
    })
    return plt


def to_svg(fig: Figure, title: str = "") -> str:
    """The figure as an inline <svg> element (scaled to the page's width), then closed.

    Dense artists may be rasterized by the caller (``rasterized=True``): they are kept as
    an embedded PNG inside the SVG, so the file stays small."""
    import matplotlib.pyplot as plt

    buf = io.StringIO()
    fig.savefig(buf, format="svg", bbox_inches="tight", pad_inches=0.06,
                metadata={"Date": None, "Creator": None, "Format": None, "Type": None})
    plt.close(fig)
    svg = buf.getvalue()
    svg = svg[svg.index("<svg"):]
    svg = re.sub(r"<metadata>.*?</metadata>\s*", "", svg, flags=re.S)
    # Drawn at its size (every figure at the same scale: fonts alike), narrower on a
    # narrow screen (CSS max-width, height from the viewBox).
    head_end = svg.index(">")
    label = f' role="img" aria-label="{esc(title)}"' if title else ""
    return svg[:head_end] + f' class="fig"{label}' + svg[head_end:]


def value_axis(ax: Axes, which: str, lo: float, hi: float, *, force_log: bool | None = None
               ) -> None:
    """A value axis between ``lo`` and ``hi`` (display units): logarithmic where the
    values span more than a factor of 20, linear otherwise; plain numbers as tick labels
    (no 1e-2 notation), enough of them to read a value off in either case."""
    from matplotlib.ticker import FuncFormatter, LogLocator, MaxNLocator, NullFormatter

    lo, hi = float(lo), float(hi)
    if not (math.isfinite(lo) and math.isfinite(hi)) or hi <= 0:
        lo, hi = 0.1, 1.0
    log = force_log if force_log is not None else (lo > 0 and hi / lo > 20)
    axis = ax.xaxis if which == "x" else ax.yaxis
    setlim = ax.set_xlim if which == "x" else ax.set_ylim
    if log:
        lo = max(lo, hi * 1e-9)
        (ax.set_xscale if which == "x" else ax.set_yscale)("log")
        setlim(lo / 1.15, hi * 1.15)
        decades = max(math.log10(hi / lo), 0.3)
        room = _label_room(ax, which)
        for subs in ((1.0, 1.5, 2.0, 3.0, 5.0, 7.0), (1.0, 2.0, 5.0), (1.0, 3.0), (1.0,)):
            if decades * len(subs) <= room:
                axis.set_major_locator(LogLocator(base=10, subs=subs))
                break
        else:
            axis.set_major_locator(LogLocator(base=10, numticks=max(2, int(room))))
        axis.set_minor_locator(LogLocator(base=10, subs=tuple(range(1, 10))))
        axis.set_major_formatter(FuncFormatter(lambda v, _: plain(v)))
        axis.set_minor_formatter(NullFormatter())
    else:
        pad = (hi - lo) * 0.08 or abs(hi) * 0.05 or 1.0
        setlim(max(lo - pad, 0.0) if lo >= 0 else lo - pad, hi + pad)
        axis.set_major_locator(MaxNLocator(nbins=max(2, min(7, int(room_lin(ax, which)))),
                                           steps=[1, 2, 2.5, 5, 10]))
        axis.set_major_formatter(FuncFormatter(lambda v, _: plain(v)))


def _label_room(ax: Axes, which: str) -> float:
    """How many tick labels fit along the axis: x labels need ~0.65 in, y ones ~0.28 in."""
    size = getattr(ax.get_figure(), "get_size_inches", None)
    w, h = size() if size is not None else (12.0, 4.0)
    pos = ax.get_position()
    return (pos.width * w / 0.65) if which == "x" else (pos.height * h / 0.28)


def room_lin(ax: Axes, which: str) -> float:
    return _label_room(ax, which) * (1.3 if which == "x" else 0.8)


def plain(v: float) -> str:
    """A tick label: 0.002, 0.5, 12, 1,500 (no exponent notation)."""
    if v == 0 or not math.isfinite(v):
        return "0"
    a = abs(v)
    if a >= 1000:
        return f"{v:,.0f}"
    if a >= 1:
        return f"{v:.4g}"
    digits = max(0, -int(math.floor(math.log10(a))) + 2)
    s = f"{v:.{digits}f}".rstrip("0").rstrip(".")
    return s


def percent_axis(ax: Axes, which: str, values: Sequence[float]) -> None:
    """A logarithmic error axis in percent, from below the smallest to above the largest
    value: a 2% error and an 8,000% one both stay readable."""
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullFormatter, NullLocator

    v = np.asarray([x for x in values if x is not None and math.isfinite(x) and x > 0])
    lo = float(v.min()) if v.size else 1.0
    hi = float(v.max()) if v.size else 100.0
    lo_e = math.floor(math.log10(max(lo, 1e-3)))
    hi_e = math.ceil(math.log10(max(hi * 1.8, lo * 10)))
    ticks = [m * 10.0**e for e in range(lo_e, hi_e + 1) for m in (1, 2, 5)]
    ticks = [t for t in ticks if 10.0**lo_e <= t <= 10.0**hi_e]
    if hi_e - lo_e > 3:
        ticks = [10.0**e for e in range(lo_e, hi_e + 1)]
    (ax.set_xscale if which == "x" else ax.set_yscale)("log")
    (ax.set_xlim if which == "x" else ax.set_ylim)(10.0**lo_e, 10.0**hi_e)
    axis = ax.xaxis if which == "x" else ax.yaxis
    axis.set_major_locator(FixedLocator(ticks))
    axis.set_major_formatter(FuncFormatter(lambda t, _: pct_label(t)))
    axis.set_minor_locator(NullLocator())
    axis.set_minor_formatter(NullFormatter())


def pct_label(p: float) -> str:
    """A percentage (already x100) for a tick or a bar: 0.05%, 2.3%, 45%, 8,065%."""
    if p >= 1000:
        return f"{p:,.0f}%"
    if p >= 10:
        return f"{p:.0f}%"
    if p >= 1:
        return f"{p:.1f}%".replace(".0%", "%")
    return plain(p) + "%"


def legend_above(ax: Axes, ncol: int | None = None, **kw: Any) -> None:
    """The legend in a row above the axes: it never covers data."""
    handles, labels = ax.get_legend_handles_labels()
    if not handles:
        return
    ax.legend(handles, labels, loc="lower left", bbox_to_anchor=(0.0, 1.01),
              ncol=ncol or len(handles), borderaxespad=0.0, handlelength=1.6,
              columnspacing=1.2, **kw)


# ------------------------------------------------------------------ the page


@dataclass
class Page:
    """One report page: a title, a header (what, when, from what), then sections."""

    title: str
    header: list[tuple[str, str]] = field(default_factory=list)  # (name, HTML value)
    warnings: list[str] = field(default_factory=list)  # HTML, shown under the header
    sections: list[str] = field(default_factory=list)  # HTML
    generated: float = field(default_factory=time.time)

    def render(self) -> str:
        rows = [("Generated", esc(fmt_time(self.generated))),
                ("gemmd version", esc(gemmd.__version__)), *self.header]
        head = "".join(f"<tr><th>{k}</th><td>{v}</td></tr>" for k, v in rows)
        warn = "".join(f'<p class="warn">⚠ {w}</p>' for w in self.warnings)
        return (
            "<!doctype html>\n<html lang='en'><head><meta charset='utf-8'>"
            "<meta name='viewport' content='width=device-width, initial-scale=1'>"
            f"<title>{esc(self.title)}</title><style>{CSS}</style></head><body>"
            f"<h1>{esc(self.title)}</h1><table class='header'>{head}</table>{warn}"
            + "".join(self.sections) + "</body></html>\n")


CSS = """
body{font-family:system-ui,-apple-system,"Segoe UI",Roboto,"DejaVu Sans",sans-serif;
 max-width:1200px;margin:16px auto;padding:0 16px;color:#222;font-size:14px;line-height:1.4}
h1{font-size:22px;margin:4px 0 10px}h2{font-size:18px;margin:26px 0 6px;
 border-bottom:1px solid #ddd;padding-bottom:3px}h3{font-size:15px;margin:16px 0 4px}
table{border-collapse:collapse;margin:6px 0}td,th{border:1px solid #d6d6d6;
 padding:3px 8px;text-align:right;vertical-align:top}th{background:#f4f4f4}
td.l,th.l{text-align:left}td.l:first-child,.nw{white-space:nowrap}
table.header th{text-align:left;width:150px}table.header td{text-align:left}
.warn{background:#fff4ce;border:1px solid #e0c060;padding:5px 9px;margin:6px 0}
.note{color:#555;font-size:13px;margin:4px 0}
.bad{color:#b00020;font-weight:600}.ok{color:#1a7f37}
svg.fig{max-width:100%;height:auto;display:block;margin:6px 0 10px}
code{font-size:13px}
"""


def table(head: Sequence[str], rows: Sequence[Sequence[str]], left: int | set[int] = 1,
          groups: Sequence[tuple[str, int]] = ()) -> str:
    """An HTML table of already-escaped cells; the first ``left`` columns (or those in a
    set) left-aligned; ``groups``: an upper header row of (label, columns spanned)."""
    lefts = set(range(left)) if isinstance(left, int) else left

    def cells(tag: str, row: Sequence[str]) -> str:
        return "".join(f"<{tag}{' class=l' if i in lefts else ''}>{c}</{tag}>"
                       for i, c in enumerate(row))
    top = "".join(f"<th colspan={n}>{g}</th>" if n > 1 else f"<th>{g}</th>"
                  for g, n in groups)
    body = "".join(f"<tr>{cells('td', r)}</tr>" for r in rows)
    return (f"<table>{f'<tr>{top}</tr>' if top else ''}<tr>{cells('th', head)}</tr>{body}"
            "</table>")
