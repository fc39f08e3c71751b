"""The model report: gemmd's model, GPPerf's pipeline and the deployed model on held-out rows.

gemmd and GPPerf's published pipeline are fitted on the same training split (by shape
by default: no (M, N, K) in both train and test, which is what predicting a new GEMM
means) and judged on the test rows. Where the state directory holds a deployed model, it
is judged as it is, on the same test rows (it was not refitted; whether it was trained
on some of those shapes is said). Per target: the figures after the GPPerf paper's
(predicted vs measured, the mean per shape sorted by M x N), and the error by size and
by configuration on a logarithmic scale.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from gemmd import evaluate
from gemmd.config import ModelConfig
from gemmd.datasets import Dataset
from gemmd.errors import InputError
from gemmd.features import Table, flops
from gemmd.gemm import COLUMN, TARGETS
from gemmd.report.page import (
    COLORS,
    MIN_ROWS,
    TARGET_TITLE,
    Page,
    check_out,
    esc,
    fmt_count,
    fmt_num,
    fmt_pct,
    fmt_time,
    legend_above,
    pct_label,
    percent_axis,
    plt_setup,
    shape_name,
    table,
    to_svg,
    unit_for,
    value_axis,
    write_atomic,
)
from gemmd.report.readonly import Deployed, deployed_model

MAX_CONFIGS = 16  # configurations in the error-by-configuration figure (the most frequent)
MAX_SHAPE_LABELS = 40  # shapes named on the per-shape figure's axis (evenly spaced beyond)
RASTER_POINTS = 2000  # scatter panels with more points are embedded as an image


def work_units() -> int:
    """Forests fitted (progress ticks): gemmd's and GPPerf's, one per target each."""
    return 2 * len(TARGETS)


@dataclass
class Run:
    """One model's predictions on the test rows."""

    key: str  # colour key: gemmd | gpperf | deployed
    label: str
    preds: dict[str, dict[str, np.ndarray]]
    about: str  # HTML: what it is, how it was obtained
    scores: dict[str, dict[str, float]] = field(default_factory=dict)


def write(ds: Dataset, out: str | Path, *, cfg: ModelConfig | None = None,
          split: str = "shape", n_jobs: int = 1,
          progress: Callable[[int], None] | None = None,
          state_dir: Path | None = None, baseline: bool = True,
          deployed: Deployed | None = None) -> Path:
    """Write the model report for ``ds`` to the HTML file ``out``; returns its path.

    ``state_dir``: where to look for the deployed model (its store's active model), judged
    on the same test rows as the refitted ones; ``deployed`` gives one directly instead.
    Raises InputError (one line) for a bad ``out`` (checked before any fit) or split."""
    path = check_out(out)
    t = ds.table
    if len(t) < 2:
        raise InputError(f"{ds.name}: {len(t)} row(s): a report needs at least two shapes")
    train, test = evaluate.split(t, split)
    tr, te = t.take(train), t.take(test)
    note = ""
    if deployed is None and state_dir is not None:
        deployed, note = deployed_model(Path(state_dir))
    runs: list[Run] = []
    models: list[Any] = [evaluate.GemmdModel(cfg, n_jobs)]
    if baseline:
        models.append(evaluate.GPPerfBaseline())
    for m in models:
        t0 = time.perf_counter()
        m.fit(tr, progress)
        fit_s = time.perf_counter() - t0
        if m.name == "gemmd":
            runs.append(Run("gemmd", "gemmd (refit)", m.predict_table(te),
                            f"gemmd's model (a Random Forest per target on roofline-relative "
                            f"features) fitted on the training split in {fit_s:.1f} s"))
        else:
            runs.append(Run("gpperf", "GPPerf (refit)", m.predict_table(te),
                            f"GPPerf's published pipeline (Random Forest, depth 6, on raw "
                            f"sizes) fitted on the training split in {fit_s:.1f} s"))
    extra_rows: dict[str, dict[str, float]] = {}
    if deployed is not None:
        runs.append(Run("deployed", f"deployed {deployed.version}",
                        deployed.model.predict_table(te), _deployed_about(deployed, t, te)))
        if _seen_share(deployed, t) == 0:  # it never saw this data: judge it on every row
            extra_rows = evaluate.score(t, deployed.model.predict_table(t))
    for r in runs:
        r.scores = evaluate.score(te, r.preds)

    page = Page(f"gemmd model report: {ds.name}")
    page.header += _header(ds, t, tr, te, split, runs, note)
    for target in TARGETS:
        n = int(np.isfinite(te[COLUMN[target]]).sum())
        if 0 < n < MIN_ROWS:
            page.warnings.append(
                f"{esc(TARGET_TITLE[target])}: only {n} test row(s) measure it (fewer than "
                f"{MIN_ROWS}): its R², errors and figures below rest on too few rows to "
                "trust.")
    plt = plt_setup()
    for target in TARGETS:
        meas = te[COLUMN[target]]
        ok = np.isfinite(meas)
        have = [r for r in runs if target in r.preds]
        if not ok.any() or not have:
            continue
        page.sections.append(_section(plt, target, te, meas, have, extra_rows.get(target),
                                      deployed))
    write_atomic(path, page.render())
    return path


# ------------------------------------------------------------------ header


def _header(ds: Dataset, t: Table, tr: Table, te: Table, split: str, runs: list[Run],
            note: str) -> list[tuple[str, str]]:
    gpus: dict[str, int] = {}
    for i, info in enumerate(t.devices):
        gpus[info.name] = gpus.get(info.name, 0) + int((t.device == i).sum())
    gpu_text = "; ".join(f"{esc(name)} ({fmt_count(n)} rows)" for name, n in gpus.items())
    shapes = len(np.unique(np.column_stack([t["m"], t["n"], t["k"]]), axis=0))
    dtypes = ", ".join(sorted(set(map(str, t["dtype"]))))
    kernels = ", ".join(sorted(set(map(str, t["kernel"]))))
    split_text = ("by shape: no (M, N, K) in both train and test" if split == "shape"
                  else "random 80/20 split of rows (repeats of a configuration can sit on "
                       "both sides)")
    measured = " · ".join(
        f"{tg} {fmt_count(int(np.isfinite(te[COLUMN[tg]]).sum()))}" for tg in TARGETS
        if np.isfinite(t[COLUMN[tg]]).any())
    rows = [
        ("Data", f"{esc(ds.name)}: {fmt_count(len(t))} rows, {shapes:,} shapes, dtypes "
                 f"{esc(dtypes)}, kernels {esc(kernels)}<br><span class=note>"
                 f"{esc(', '.join(ds.paths))}</span>"),
        ("GPU(s)", gpu_text),
        ("Split", f"{esc(split_text)}, seed {evaluate.SEED}: {fmt_count(len(tr))} train / "
                  f"{fmt_count(len(te))} test rows (test rows measuring {esc(measured)})"),
        ("Models", "<br>".join(f"<b>{esc(r.label)}</b>: {r.about}" for r in runs)
         + (f"<br><span class=note>{esc(note)}</span>" if note else "")),
    ]
    if ds.notes:
        rows.append(("Notes", "<br>".join(esc(n) for n in ds.notes)))
    return rows


def _seen_share(dep: Deployed, t: Table, rows: Table | None = None) -> float | None:
    """Share of ``rows`` (default all of ``t``) whose shape (GPU model, M, N, K, batch) the
    model was trained on; None where that cannot be known (the model kept no shape set
    and was not fitted on exactly ``t``)."""
    import base64

    from gemmd.model import shape_hashes, table_hash

    rows = t if rows is None else rows
    trained_on = {d.get("name") for d in dep.model.meta.get("devices", [])}
    if trained_on and not trained_on & {d.name for d in rows.devices}:
        return 0.0  # another GPU model: a shape is (GPU model, M, N, K, batch)
    raw = dep.model.meta.get("shapes")
    if raw and len(rows):
        seen = np.frombuffer(base64.b64decode(raw), dtype=np.uint64)
        return float(np.mean(np.isin(shape_hashes(rows), seen)))
    if dep.model.meta.get("data_hash") == table_hash(t):
        return 1.0  # fitted on this very data
    return None


def _deployed_about(dep: Deployed, t: Table, te: Table) -> str:
    meta = dep.model.meta
    gpus = sorted({d.get("name", "?") for d in meta.get("devices", [])})
    created = meta.get("created") or dep.record.get("created")
    seen = _seen_share(dep, t, te)
    text = (f"the state directory's active model, judged as it is (not refitted): fitted "
            f"{esc(fmt_time(created))} on {fmt_count(int(meta.get('n_samples', 0)))} "
            f"samples of {esc(', '.join(gpus) or 'unknown GPUs')}")
    others = sorted({d.name for d in t.devices} - set(gpus))
    if others:
        text += (f". <span class=bad>It never saw {esc(', '.join(others))}: it predicts "
                 "those rows from another GPU's data, out of its domain</span>")
    if seen is None:
        text += (". Whether it was trained on these shapes is not known (it keeps no set of "
                 "its shapes): its errors may be partly in-sample")
    elif seen > 0:
        text += (f". <span class=bad>{fmt_pct(seen, 0)} of the test rows have shapes it was "
                 "trained on: its errors there are partly in-sample</span>")
    else:
        text += ". It was trained on none of these shapes"
        if _seen_share(dep, t) == 0:
            text += " (its error on all rows is given too)"
    return text


# ------------------------------------------------------------------ one target


def _section(plt: Any, target: str, te: Table, meas: np.ndarray, runs: list[Run],
             all_rows: dict[str, float] | None, deployed: Deployed | None) -> str:
    unit, f = unit_for(target, meas)
    n_meas = int(np.isfinite(meas).sum())
    rows = []
    for r in runs:
        s = r.scores.get(target, {})
        rows.append(_score_row(r.label, s))
    if all_rows and all_rows.get("n") and deployed is not None:
        rows.append(_score_row(f"deployed {deployed.version}, all rows", all_rows))
    head = ["model", "rows", "R²", "MAPE", "median APE", "p90 APE", "in interval",
            "in domain"]
    parts = [f"<h2>{esc(TARGET_TITLE[target])} ({esc(unit)})</h2>", table(head, rows)]
    if n_meas < MIN_ROWS:
        parts.append(f'<p class="warn">⚠ Only {n_meas} test row(s) measure '
                     f'{esc(target)}: R² and the errors below rest on too few rows '
                     f"(fewer than {MIN_ROWS}) to trust.</p>")
    parts.append('<p class="note">APE: absolute percentage error |predicted − measured| / '
                 "measured, per test row. In interval: share of rows inside the model's "
                 "prediction interval. In domain: share of rows like its training data.</p>")
    parts.append(to_svg(_fig_scatter(plt, target, meas, runs, unit, f),
                        f"{target}: predicted vs measured"))
    parts.append(to_svg(_fig_by_shape(plt, target, te, meas, runs, unit, f),
                        f"{target}: mean per shape"))
    parts.append(to_svg(_fig_errors(plt, target, te, meas, runs),
                        f"{target}: error by size and by configuration"))
    return "".join(parts)


def _score_row(label: str, s: dict[str, float]) -> list[str]:
    n = int(s.get("n", 0))
    few = n < MIN_ROWS
    r2 = fmt_num(s.get("r2"))
    if few and n:
        r2 += ' <span class="bad" title="too few rows">⚠</span>'
    return [esc(label), fmt_count(n) + (" ⚠" if few else ""), r2,
            fmt_pct(s.get("mape")), fmt_pct(s.get("median_ape")), fmt_pct(s.get("p90_ape")),
            fmt_pct(s.get("coverage"), 0), fmt_pct(s.get("in_domain"), 0)]


def _ape(pred: np.ndarray, meas: np.ndarray) -> np.ndarray:
    return np.abs(pred - meas) / np.abs(meas)


def _fig_scatter(plt: Any, target: str, meas: np.ndarray, runs: list[Run], unit: str,
                 f: float) -> Any:
    ok = np.isfinite(meas) & (meas > 0)
    allv = [meas[ok]] + [r.preds[target]["point"][ok] for r in runs]
    v = np.concatenate(allv) / f
    v = v[np.isfinite(v) & (v > 0)]
    lo, hi = float(v.min()), float(v.max())
    log = hi / lo > 20
    fig, axes = plt.subplots(1, len(runs), figsize=(3.9 * len(runs) + 0.4, 3.7),
                             squeeze=False, sharex=True, sharey=True)
    for ax, r in zip(axes[0], runs):
        p = r.preds[target]["point"]
        sel = ok & np.isfinite(p)
        x, y = meas[sel] / f, p[sel] / f
        ax.plot([lo / 2, hi * 2], [lo / 2, hi * 2], color="#888", lw=1, ls="--",
                label="predicted = measured", zorder=1)
        for q in (1.1, 1 / 1.1):
            ax.plot([lo / 2, hi * 2], [lo / 2 * q, hi * 2 * q], color="#bbb", lw=0.8,
                    ls=":", zorder=1, label="±10%" if q > 1 else None)
        ax.scatter(x, y, s=7 if len(x) < 500 else 3, color=COLORS[r.key], alpha=0.45,
                   linewidths=0, rasterized=len(x) > RASTER_POINTS, zorder=2)
        s = r.scores.get(target, {})
        ax.set_title(f"{r.label}\nMAPE {fmt_pct(s.get('mape'))}, median APE "
                     f"{fmt_pct(s.get('median_ape'))} ({fmt_count(int(s.get('n', 0)))} rows)",
                     fontsize=9, color=COLORS[r.key])
        value_axis(ax, "x", lo, hi, force_log=log)
        value_axis(ax, "y", lo, hi, force_log=log)
        ax.set_xlabel(f"measured ({unit})")
    axes[0][0].set_ylabel(f"predicted ({unit})")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower right", bbox_to_anchor=(1.0, 1.0), ncol=2,
               frameon=False)
    fig.suptitle(f"{TARGET_TITLE[target]}: predicted vs measured, every test row",
                 x=0.01, ha="left", y=1.02, fontsize=10, fontweight="bold")
    fig.tight_layout()
    return fig


def _gpu_label(name: str) -> str:
    """A GPU's name, short enough for a figure: 'H100 80GB HBM3', 'MI355X'."""
    for prefix in ("NVIDIA GeForce ", "NVIDIA ", "AMD Instinct ", "AMD "):
        if name.startswith(prefix):
            return name[len(prefix):]
    return name


def _shape_keys(te: Table) -> tuple[np.ndarray, np.ndarray, list[str], list[str]]:
    """Per row its shape group (GPU, M, N, K, dtype), groups sorted by GPU, then M x N,
    then K (GPPerf's order, per GPU); the groups' names and GPUs."""
    dt = np.asarray(te["dtype"]).astype(str)
    dtypes, dt_id = np.unique(dt, return_inverse=True)
    keys = np.column_stack([te.device, te["m"] * te["n"], te["k"], te["m"], te["n"],
                            dt_id.ravel()])
    uniq, inv = np.unique(keys, axis=0, return_inverse=True)
    names = [shape_name(u[3], u[4], u[2], str(dtypes[int(u[5])])) for u in uniq]
    gpus = [_gpu_label(te.devices[int(u[0])].name) for u in uniq]
    return uniq, inv.ravel(), names, gpus


def _fig_by_shape(plt: Any, target: str, te: Table, meas: np.ndarray, runs: list[Run],
                  unit: str, f: float) -> Any:
    uniq, inv, names, gpus = _shape_keys(te)
    ok = np.isfinite(meas)
    used = np.unique(inv[ok])

    def mean(v: np.ndarray) -> np.ndarray:
        good = ok & np.isfinite(v)
        s = np.bincount(inv[good], weights=v[good], minlength=len(uniq))
        c = np.bincount(inv[good], minlength=len(uniq))
        return (np.where(c > 0, s / np.maximum(c, 1), np.nan) / f)[used]

    x = np.arange(len(used), dtype=float)
    m = mean(meas)
    series = [(r, mean(r.preds[target]["point"])) for r in runs]
    allv = np.concatenate([m] + [s for _, s in series])
    allv = allv[np.isfinite(allv) & (allv > 0)]
    # One line per GPU (a break between GPUs: a line does not join two GPUs' shapes).
    gpu_of = [gpus[i] for i in used]
    blocks = [0] + [k for k in range(1, len(used)) if gpu_of[k] != gpu_of[k - 1]]
    ends = blocks[1:] + [len(used)]

    def broken(v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        xs = np.concatenate([np.r_[x[a:b], np.nan] for a, b in zip(blocks, ends)])
        vs = np.concatenate([np.r_[v[a:b], np.nan] for a, b in zip(blocks, ends)])
        return xs, vs

    fig, ax = plt.subplots(figsize=(12.0, 3.9))
    marker = "o" if len(used) <= 80 else None
    ax.plot(*broken(m), color=COLORS["measured"], ls="--", marker=marker, ms=3.5, lw=1.4,
            label="measured", zorder=3)
    for r, s in series:
        ax.plot(*broken(s), color=COLORS[r.key], marker=marker, ms=3, lw=1.2, label=r.label,
                alpha=0.9, zorder=2)
    value_axis(ax, "y", float(allv.min()), float(allv.max()))
    ax.set_ylabel(f"{target} ({unit})")
    if len(blocks) > 1:
        for a, b in zip(blocks, ends):
            if a:
                ax.axvline(a - 0.5, color="#999", lw=0.8)
            ax.annotate(gpu_of[a], ((a + b - 1) / 2, 1.0), xycoords=("data", "axes fraction"),
                        xytext=(0, -3), textcoords="offset points", ha="center", va="top",
                        fontsize=8, fontweight="bold", color="#444")
    labels = [names[i] for i in used]
    step = 1 if len(used) <= MAX_SHAPE_LABELS else math.ceil(len(used) / MAX_SHAPE_LABELS)
    ticks = np.arange(0, len(used), step)
    ax.set_xticks(ticks)
    ax.set_xticklabels([labels[i] for i in ticks], rotation=60, ha="right",
                       rotation_mode="anchor", fontsize=7.5)
    ax.set_xlim(-0.6, len(used) - 0.4)
    ax.grid(axis="x", visible=False)
    ax.set_xlabel("shape M×N×K dtype, sorted by M×N then K"
                  + (" on each GPU" if len(blocks) > 1 else "")
                  + f" ({len(used)} shapes" + ("" if step == 1 else f"; one in {step} named")
                  + ")")
    legend_above(ax)
    ax.set_title(f"{TARGET_TITLE[target]}: mean per shape over the test rows", loc="left",
                 pad=22, fontsize=10, fontweight="bold")
    fig.tight_layout()
    return fig


def _size_groups(te: Table, ok: np.ndarray) -> tuple[list[str], list[np.ndarray]]:
    f = flops(te)
    good = ok & (f > 0)
    dec = np.floor(np.log10(np.where(good, f, 1.0)))
    names, sels = [], []
    for e in np.unique(dec[good]):
        sel = good & (dec == e)
        names.append(f"{_flop_range(10.0 ** e)}\nn={int(sel.sum()):,}")
        sels.append(sel)
    return names, sels


def _flop_range(lo: float) -> str:
    """A FLOP decade in the unit of its upper end: '1–10 GFLOP', '0.1–1 TFLOP'."""
    hi = lo * 10
    for unit, s in (("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6),
                    ("kFLOP", 1e3), ("FLOP", 1.0)):
        if hi >= s:
            return f"{lo / s:g}–{hi / s:g} {unit}"
    return f"{lo:g}–{hi:g} FLOP"


def config_labels(t: Table) -> np.ndarray:
    """A readable configuration per row: dtype, kernel (tile edge), CTA tile, layout."""
    out = []
    for i in range(len(t)):
        s = f"{t['dtype'][i]} {t['kernel'][i]}"
        if t["kernel"][i] == "tiled":
            s += f" tile {int(t['tile'][i])}"
        if t["cta_m"][i] > 0:
            s += f" CTA {int(t['cta_m'][i])}×{int(t['cta_n'][i])}×{int(t['cta_k'][i])}"
        s += f" {t['layout'][i]}"
        out.append(s)
    return np.array(out, dtype=object)


def _fig_errors(plt: Any, target: str, te: Table, meas: np.ndarray, runs: list[Run]) -> Any:
    """Median APE by size (FLOP decade) and by configuration, on a log scale."""
    ok = np.isfinite(meas) & (meas != 0)
    size_names, size_sels = _size_groups(te, ok)
    label = config_labels(te)
    names, counts = np.unique(label[ok].astype(str), return_counts=True)
    order = np.lexsort((names, -counts))[:MAX_CONFIGS]
    conf_names = [str(names[i]) for i in order]
    conf_sels = [ok & (label == g) for g in conf_names]
    shown_conf = len(conf_names)

    def med(r: Run, sel: np.ndarray) -> float:
        p = r.preds[target]["point"]
        good = sel & np.isfinite(p)
        return 100 * float(np.median(_ape(p[good], meas[good]))) if good.any() else math.nan

    size_v = {r.label: [med(r, s) for s in size_sels] for r in runs}
    conf_v = {r.label: [med(r, s) for s in conf_sels] for r in runs}
    vals = [v for d in (size_v, conf_v) for vs in d.values() for v in vs]
    vals = [max(v, 0.01) for v in vals if math.isfinite(v)]
    nr = len(runs)
    h = max(3.6, 1.0 + 0.12 * shown_conf * max(nr, 2))
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, h),
                                 gridspec_kw={"width_ratios": [1.0, 1.25]})
    w = 0.8 / nr
    for j, r in enumerate(runs):
        xs = np.arange(len(size_sels)) - 0.4 + w * (j + 0.5)
        ys = [max(v, 0.01) if math.isfinite(v) else np.nan for v in size_v[r.label]]
        a1.bar(xs, ys, width=w * 0.95, color=COLORS[r.key], label=r.label)
        for x, y in zip(xs, ys):
            if math.isfinite(y):
                a1.annotate(pct_label(y), (x, y), xytext=(0, 2), textcoords="offset points",
                            ha="center", va="bottom", fontsize=6.5,
                            rotation=90 if nr * len(size_sels) > 12 else 0)
        ys2 = [max(v, 0.01) if math.isfinite(v) else np.nan for v in conf_v[r.label]]
        yy = np.arange(shown_conf) - 0.4 + w * (j + 0.5)
        a2.barh(yy, ys2, height=w * 0.95, color=COLORS[r.key], label=r.label)
        for y, v in zip(yy, ys2):
            if math.isfinite(v):
                a2.annotate(pct_label(v), (v, y), xytext=(2, 0), textcoords="offset points",
                            ha="left", va="center", fontsize=6.5)
    percent_axis(a1, "y", vals)
    a1.set_xticks(np.arange(len(size_sels)))
    a1.set_xticklabels(size_names, fontsize=7.5)
    a1.grid(axis="x", visible=False)
    a1.set_xlabel("FLOPs per GEMM (test rows per group)")
    a1.set_ylabel("median absolute error (log scale)")
    a1.set_title("by size", loc="left", fontsize=9.5)
    percent_axis(a2, "x", vals)
    counts_by = {str(n): int(c) for n, c in zip(names, counts)}
    a2.set_yticks(np.arange(shown_conf))
    a2.set_yticklabels([f"{g} (n={counts_by[g]:,})" for g in conf_names], fontsize=7.5)
    a2.invert_yaxis()
    a2.grid(axis="y", visible=False)
    a2.set_xlabel("median absolute error (log scale)")
    more = len(names) - shown_conf
    a2.set_title("by configuration" + (f" ({shown_conf} most frequent of {len(names)})"
                                       if more > 0 else ""), loc="left", fontsize=9.5)
    handles, labels = a1.get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower right", bbox_to_anchor=(1.0, 1.0),
               ncol=len(runs), frameon=False)
    fig.suptitle(f"{TARGET_TITLE[target]}: median absolute percentage error", x=0.01,
                 ha="left", y=1.0, fontsize=10, fontweight="bold", va="bottom")
    fig.tight_layout()
    return fig
