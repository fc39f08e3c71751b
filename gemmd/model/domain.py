"""The training domain: what a model was trained on (domain_record), how a row lies
outside it (domain_flags) and the interval widening that costs (widen, OOD_SD); the
settings of an unknown GPU's runtime transfer; predict_table's answer (result,
to_predictions)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from gemmd import features
from gemmd.features import Table
from gemmd.gemm import COLUMN, DAEMON_SOURCE, DTYPE_BYTES, roofline_s
from gemmd.hardware import gpu_model_key
from gemmd.model.space import LAUNCH_S
from gemmd.records import Prediction

# Sizes within this many factors of 2 of the trained range count as in the domain: none.
# A forest extrapolates flat beyond the sizes it saw; trained on M <= 2048 and asked
# about M = 4096 (within the 2x margin this once had) its 90% intervals covered 69-77%
# without a flag (issue 25). Beyond the range in M, N, K or FLOPs a row is flagged and
# its interval widened per factor of 2, by what extrapolation at fit time measured.
SIZE_MARGIN_LOG2 = 0.0
_SIZES = ("m", "n", "k", "flops")
SIZE_MIN_D = 0.5  # a row beyond the trained sizes is widened as if at least this far out

# Alignment in bytes of M, N and K (the least of the three, or of the operands' leading
# dimensions where known: leading_dims; each its largest power-of-two factor times the
# element size), counted up to this: tensor-core kernels load 16-byte
# vectors and need leading dimensions that are multiples of them. A forest trained only
# on aligned shapes extrapolates flat to unaligned ones: fitted on the H200's
# 256..8192 grid, gemmd's own bf16 probes at shapes with a dimension not a multiple of 8
# took 3-4x its prediction (fp16 the same, tf32 2.3x, fp32 1.2x), the rows called in its
# domain, its 90% intervals holding 20% of them (bench/RESULTS.md, 2026-11-27). A row
# aligned to fewer bytes than ALIGN_MIN_ROWS training rows of its GPU and dtype reached is
# outside the domain.
ALIGN_BYTES = 16
# Rows at an alignment (or below) before it counts as trained on: a forest does not learn
# what unaligned shapes cost from one or three of them (fitted with 1 or 3 of them beside
# aligned ones, its intervals held none of a 3x slower unaligned set; 10: 83%).
ALIGN_MIN_ROWS = 10
ALIGN_LOG2 = math.log2(ALIGN_BYTES)
ALIGN_UPWARD = ("runtime", "energy")  # targets an unaligned GEMM only raises (align_widening)
LOSS_MIN_SHARE = 0.25  # the least align_share a row's loss is read at (median_losses)

# No interval narrower than this (log space, about +-0.8% at 90%): repeated GEMMs on a
# GPU never agree better, whatever a noiseless training set suggests.
MIN_SD = 0.005

# Log-space sd added to a prediction's for each way its GEMM lies outside the training
# data, per target: "gpu", a GPU model never trained on; "dtype", a dtype never trained
# on that GPU; "kernel", a kernel never trained on (runtime then comes from the roofline);
# "size", per factor of 2 beyond the trained range; "align", aligned below the training
# of its GPU and dtype (domain_flags). Measured by leaving out whole GPUs,
# dtypes and kernels on the shared data (bench/transfer.py --coverage, docs/model.md):
# these make the nominal interval cover about its share of such predictions there.
# "align" (align_widening: upward, times align_share; validated at fit time where the
# data hold unaligned rows, _validate_align) from the B200's 665 fp16 rows aligned below
# 16 bytes (align_log2; the shared data's only such rows), left out of a prior of the
# four shared GPUs (bench/transfer.py --align): 1.52 held 90% of them (1.55 of the 177
# above 1 GFLOP). Their power needed none (0.1 kept, as for sizes). "align_work": the
# same per unit of work_share, 0.84 there: how far a calibration's unaligned offset may
# go before its probes say so (calibration, _robust_offsets' tau_a), in the unit that
# offset is read in. docs/model.md, "Alignment".
OOD_SD: dict[str, dict[str, float]] = {
    "runtime": {"gpu": 0.5, "dtype": 0.35, "kernel": 1.5, "size": 0.25, "align": 1.52,
                "align_work": 0.84},
    "power": {"gpu": 0.45, "dtype": 0.4, "kernel": 0.4, "size": 0.1, "align": 0.1},
    "energy": {"gpu": 0.5, "dtype": 0.4, "kernel": 1.5, "size": 0.25, "align": 1.52,
               "align_work": 0.84},
}


# An unknown GPU's runtime (ForestModel.transfer_runtime): candidate (w, a), the weights
# of the forest's efficiency level (against the roofline estimate's) and of its shape
# dependence (against none), judged by leave-one-GPU-out validation at fit time
# (_validate_transfer) where the training data hold two GPU models or more. Without that
# evidence: the roofline estimate's level and no shape (the roofline estimate plus a
# launch), which is what the model would otherwise use. On the shared data's 12
# one-GPU-to-another pairs that beat the forest's level on 7 and its shape on 9
# (bench/RESULTS.md, "Model across GPUs"); another evaluation found the opposite within
# one GPU family (A100 -> A100 80 GB, H100: issue 25): only the training data can say.
TRANSFER_GRID = tuple((w, a) for w in (0.0, 0.5, 1.0) for a in (0.0, 0.5, 1.0))
DEFAULT_TRANSFER = (0.0, 0.0)
ANCHOR_CONFIG = ("dtype", "kernel", "tile", "layout", "cta_m", "cta_n", "cta_k", "stages",
                 "alpha", "beta", "out_dtype", "variant")


def _reference_shapes(t: Table, limit: int = 128) -> list[list[float]]:
    """Up to ``limit`` distinct (m, n, k, batch) of the rows with a runtime, drawn with a
    fixed seed: the shapes an unknown GPU's efficiency level is read over."""
    ok = np.isfinite(t["runtime_s"])
    if not ok.any():
        return []
    shapes = np.unique(np.column_stack([t["m"][ok], t["n"][ok], t["k"][ok], t["batch"][ok]]),
                       axis=0)
    if len(shapes) > limit:
        shapes = shapes[np.sort(np.random.default_rng(0).choice(len(shapes), limit,
                                                                replace=False))]
    return shapes.tolist()


def _log2_sizes(t: Table) -> np.ndarray:
    with np.errstate(divide="ignore"):
        return np.column_stack([np.log2(t["m"]), np.log2(t["n"]), np.log2(t["k"]),
                                np.log2(features.flops(t))])


def leading_dims(t: Table) -> np.ndarray:
    """Per row, which of M, N and K (a rows x 3 mask) are an operand's leading dimension,
    the stride its 16-byte loads need aligned. Known for gemmd's own cuBLAS probes (source
    DAEMON_SOURCE, kernel "blas"), column-major (devices.nvidia.blas_args): lda is M (op
    N) or K (op T), ldb K or N, ldc M. On the H200, layout nn, above 2 GFLOP, the 5 bf16
    and fp16 GEMMs with only N odd ran at 0.48 of the roofline (aligned 0.56), those with
    M or K odd, whatever N, at 0.09-0.12 (bench/RESULTS.md, 2026-11-28). Elsewhere all
    three: an imported file does not say how its operands were stored (the B200's lost
    with only N odd)."""
    mask = np.ones((len(t), 3), dtype=bool)
    own = (features.row_sources(t) == DAEMON_SOURCE) & (t["kernel"] == "blas")
    if own.any():
        lay = t["layout"][own].astype(str)
        ta, tb = np.char.startswith(lay, "t"), np.char.endswith(lay, "t")
        mask[own, 1] = tb  # N: ldb where B is transposed
        mask[own, 2] = ta | ~tb  # K: lda where A is transposed, ldb where B is not
    return mask


def align_log2(t: Table) -> np.ndarray:
    """Per row, log2 of the bytes its leading dimensions (leading_dims; M, N and K where
    not known) are all aligned to (ALIGN_BYTES at most). A GEMM with a dimension shorter
    than one ALIGN_BYTES vector counts as aligned: it is a matrix-vector product, run by
    other kernels (the B200's 2,338 unaligned fp16 and fp8 GEMMs with a dimension of 1-7
    lost a median 5% to a prior of aligned ones; the 791 others 21%, 3.3x above 1
    GFLOP)."""
    if not len(t):
        return np.zeros(0)
    dims = np.column_stack([t[c] for c in ("m", "n", "k")])
    dims = np.where(np.isfinite(dims) & (dims > 0), dims, 1).astype(np.int64)
    size = np.array([DTYPE_BYTES.get(str(d), 4) for d in t["dtype"]], dtype=np.int64)
    low = np.where(leading_dims(t), (dims & -dims) * size[:, None], ALIGN_BYTES).min(axis=1)
    short = (dims * size[:, None] < ALIGN_BYTES).any(axis=1)
    return np.log2(np.where(short, ALIGN_BYTES, np.minimum(low, ALIGN_BYTES)).astype(
        np.float64))


def _least_align(aligns: np.ndarray, dtypes: np.ndarray, sel: np.ndarray
                 ) -> dict[str, float]:
    """Per dtype among the rows ``sel`` (a mask or indices of ``aligns``, align_log2, and
    ``dtypes``): the least alignment trained on by ALIGN_MIN_ROWS rows (all of them,
    where fewer), those or less aligned."""
    a, d = aligns[sel], dtypes[sel].astype(str)
    return {str(x): float(np.sort(a[d == x])[min(ALIGN_MIN_ROWS, int((d == x).sum())) - 1])
            for x in np.unique(d)}


def size_range(x: np.ndarray) -> list[list[float]]:
    """Per column of ``x`` (log2 sizes, _log2_sizes, of some rows): [least, most]."""
    return [[float(x[:, j].min()), float(x[:, j].max())] for j in range(x.shape[1])]


def domain_record(t: Table) -> dict[str, Any]:
    """What the model was trained on: per GPU model (hardware.gpu_model_key: eight H100s
    are one), its dtypes, kernels, (dtype, kernel) pairs, size ranges (log2 of M, N, K
    and FLOPs), least alignment per dtype (align_log2) and the sources its rows came from
    (features.row_sources, where known); and the same over all GPUs."""
    keys = np.array([gpu_model_key(d) for d in t.devices], dtype=object)
    rowkey = keys[t.device] if len(t) else np.zeros(0, dtype=object)
    sizes = _log2_sizes(t)
    aligns = align_log2(t)
    src = features.row_sources(t)
    gpus = {}
    for key in sorted(set(rowkey.tolist())):
        sel = rowkey == key
        name = next(d.name for d, k in zip(t.devices, keys) if k == key)
        gpus[key] = {"name": name, "dtypes": sorted(set(t["dtype"][sel].tolist())),
                     "kernels": sorted(set(t["kernel"][sel].tolist())),
                     "pairs": sorted({f"{d}/{k}" for d, k in zip(t["dtype"][sel],
                                                                   t["kernel"][sel])}),
                     "size": size_range(sizes[sel]),
                     "align": _least_align(aligns, t["dtype"], sel)}
        # judged by source only where every row of the GPU model says whose it is: rows
        # of no known source may be any source's
        if len(src[sel]) and all(src[sel]):
            gpus[key]["sources"] = sorted(set(src[sel].tolist()))
    everything = np.ones(len(t), dtype=bool)
    return {"gpus": gpus, "dtypes": sorted(set(t["dtype"].tolist())),
            "kernels": sorted(set(t["kernel"].tolist())),
            "size": size_range(sizes) if len(t) else [],
            "align": _least_align(aligns, t["dtype"], everything)}


def domain_flags(rec: Mapping[str, Any] | None, t: Table,
                 extra: Mapping[str, Mapping[str, Any]] | None = None) -> dict[str, Any]:
    """Per row, how it lies outside the domain ``rec``: "gpu", "dtype", "kernel" (bool
    arrays), "size" (factors of 2 beyond the trained range, >= 0, in the dimension of
    _SIZES it lies farthest beyond; "size_by": per dimension, n x 4), "align" (aligned to
    fewer bytes than the GPU model's rows of that dtype, or with none, any GPU's;
    "align_seen": such rows of which other GPU models' rows of the dtype were trained on
    as unaligned; "align_probed": such rows whose loss a calibration's probes measured,
    all False here: calibration.probed_losses), "in_domain" and
    "reason" (a short text, '' in domain). ``extra`` (by GPU model key) adds data a
    calibration has seen on a device. A model without a record (older files) is taken
    to know everything.

    A row of a known GPU model from a source (features.row_sources) none of its training
    rows came from is taken as of a GPU model the model never saw ("gpu"): sources time
    GEMMs their own way. gemmd's own bf16 probes of an H100 took 0.51x XLA's table's
    times below 1 GFLOP (2.5 us where the table has 5 us) and 1.08x above 17 GFLOP
    (up to 1.17x: its 0.5 s windows run at the power cap, which a GEMM alone after
    idle does not reach); a prior that trusted the table's level there covered 41% of
    the rows it called in its domain at the nominal 90% (bench/RESULTS.md, 2026-11-27).
    A row or a training set with no source known is not judged so."""
    n = len(t)
    out: dict[str, Any] = {"gpu": np.zeros(n, bool), "dtype": np.zeros(n, bool),
                           "kernel": np.zeros(n, bool), "size": np.zeros(n),
                           "size_by": np.zeros((n, len(_SIZES))), "align": np.zeros(n, bool),
                           "align_seen": np.zeros(n, bool), "align_probed": np.zeros(n, bool),
                           "in_domain": np.ones(n, bool), "reason": np.full(n, "", object)}
    if not rec or not n:
        return out
    gpus = rec.get("gpus", {})
    keys = [gpu_model_key(d) for d in t.devices]
    sizes = _log2_sizes(t)
    aligns = align_log2(t)
    dts, dti = np.unique(t["dtype"].astype(str), return_inverse=True)
    kns, kni = np.unique(t["kernel"].astype(str), return_inverse=True)
    srcs, sri = np.unique(features.row_sources(t).astype(str), return_inverse=True)
    code = ((t.device * len(dts) + dti.ravel()) * len(kns) + kni.ravel()) * len(srcs) + \
        sri.ravel()
    for c in np.unique(code):
        sel = code == c
        i0 = int(np.flatnonzero(sel)[0])
        dev, dtype, kernel = int(t.device[i0]), str(t["dtype"][i0]), str(t["kernel"][i0])
        key = keys[int(dev)]
        known = gpus.get(key)
        more = (extra or {}).get(key, {})
        parts = []
        source, trained = srcs[sri.ravel()[i0]], (known or {}).get("sources") or []
        if known is not None and source and trained and source not in trained:
            # another way of measuring: as a GPU model never trained on (with a
            # calibration, what its probes cover; not the other source's dtypes or sizes)
            known = None
            if not more:
                parts.append(f"no {source} data on {t.devices[int(dev)].name} (only "
                             f"{', '.join(trained)})")
        elif known is None and not more:
            parts.append(f"no data on {t.devices[int(dev)].name}")
        if known is None and not more:
            out["gpu"][sel] = True
        kernels = set(rec.get("kernels", [])) | set(more.get("kernels", []))
        # probed, but unaligned only (the calibrated prior's domain: prior_domain)
        few = f"too few aligned {dtype} {kernel} probes on this GPU" \
            if f"{dtype}/{kernel}" in more.get("unaligned_pairs", ()) else ""
        if kernel not in kernels:
            out["kernel"][sel] = True
            parts.append(few or f"no {kernel} kernel data")
        pairs = set((known or {}).get("pairs", [])) | set(more.get("pairs", []))
        if (known is not None or more) and f"{dtype}/{kernel}" not in pairs \
                and kernel in kernels:
            out["dtype"][sel] = True
            parts.append(few or f"no {dtype} {kernel} data on this GPU")
        elif known is None and not more and dtype not in rec.get("dtypes", []):
            out["dtype"][sel] = True
            parts.append(f"no {dtype} data")
        lim = np.asarray((known or {}).get("size") or rec.get("size") or [], dtype=float)
        if more.get("size"):
            m = np.asarray(more["size"], dtype=float)
            lim = m if not lim.size else np.column_stack([np.minimum(lim[:, 0], m[:, 0]),
                                                          np.maximum(lim[:, 1], m[:, 1])])
        if lim.size:
            x = sizes[sel]
            beyond = np.maximum(lim[:, 0] - SIZE_MARGIN_LOG2 - x, x - lim[:, 1] -
                                SIZE_MARGIN_LOG2)
            dist = np.maximum(beyond.max(axis=1), 0.0)
            out["size"][sel] = dist
            out["size_by"][sel] = np.maximum(beyond, 0.0)
        anywhere = rec.get("align", {}).get(dtype)  # over all GPU models
        # a GPU model never trained on is predicted by the transfer estimate (the
        # roofline estimate and a level, the forest's shape only as far as "a" chose),
        # which carries little or none of what other GPU models' unaligned rows taught the
        # forest: below 16 bytes it is out of the domain (the H200's unaligned fp16 under
        # the B200's: 4.6x slower than predicted, 8% covered)
        fallback = (ALIGN_LOG2 if "align" in rec else None) if known is None else anywhere
        least = [x[dtype] for x in ((known or {}).get("align"), more.get("align"))
                 if x and dtype in x] or ([fallback] if fallback is not None else [])
        if least:  # an older record (no "align") knows every alignment
            low = sel & (aligns < min(least))
            out["align"][low] = True
            # trained on such alignment on another GPU model: the forest may carry its
            # cost here (more or less than this GPU's), not the aligned shapes' level
            if anywhere is not None and known is not None:
                out["align_seen"][low & (aligns >= anywhere)] = True
            for i in np.flatnonzero(low):
                out["reason"][i] = (f"M, N, K aligned to {2 ** aligns[i]:.0f} B, trained "
                                    f"on >= {2 ** min(least):.0f} B")
        out["reason"][sel] = ["; ".join(parts + ([r] if r else []))
                              for r in out["reason"][sel]]
    far = out["size"] > 0
    for i in np.flatnonzero(far):
        dim = ("M", "N", "K", "FLOPs")[int(np.argmax(out["size_by"][i]))]
        note = f"{dim} {2 ** (out['size'][i] + SIZE_MARGIN_LOG2):.3g}x beyond the trained range"
        out["reason"][i] = f"{out['reason'][i]}; {note}" if out["reason"][i] else note
    out["in_domain"] = ~(out["gpu"] | out["dtype"] | out["kernel"] | out["align"] | far)
    return out


def _size_d(d: np.ndarray) -> np.ndarray:
    """Factors of 2 beyond the trained sizes as widened: at least SIZE_MIN_D once beyond."""
    return np.where(d > 0, np.maximum(d, SIZE_MIN_D), 0.0)


def size_widening(tau: Mapping[str, float], flags: Mapping[str, Any], least: bool = True
                  ) -> np.ndarray:
    """Per row, the log-space sd its sizes beyond the trained range add: per dimension of
    _SIZES, that dimension's spread per factor of 2 (``tau``'s "size_m", "size_n",
    "size_k", validated at fit time: extrapolating in K is not extrapolating in M; else
    ``tau``'s "size", as for FLOPs and a model saved without them) times how far beyond
    it the row lies (``least``: at least SIZE_MIN_D factors once beyond), the largest of
    them; with one spread for all, that spread times the farthest distance, as before."""
    by = flags.get("size_by")
    if by is None:
        d = flags["size"]
        return tau["size"] * (_size_d(d) if least else d)
    per = np.array([tau.get(f"size_{c}", tau["size"]) for c in _SIZES])
    return (per * (_size_d(by) if least else by)).max(axis=1)


def align_widening(target: str, tau: Mapping[str, float], flags: Mapping[str, Any],
                   share: np.ndarray | None) -> np.ndarray:
    """Per row, the log-space sd its alignment below the trained adds to the upper end of
    a runtime's (and energy's) interval alone: a GEMM loses speed unaligned, never gains
    it (a kernel for unaligned data runs aligned data too), so the trained prediction is
    its lower end. What slows is the work at the kernel's speed: ``tau``'s "align" times
    ``share`` (align_share, per row). Not where other GPU
    models were trained at that alignment ("align_seen": the forest may have carried
    their loss, too much or too little) nor for other targets: widen widens both ends."""
    up = unprobed_loss(flags)
    if target not in ALIGN_UPWARD or share is None or not up.any():
        return np.zeros(len(up))
    return np.where(up, _align_spread(target, tau, share), 0.0)


def unprobed_loss(flags: Mapping[str, Any]) -> np.ndarray:
    """Per row (``flags``, one target's): aligned below the trained, at an alignment no
    GPU model was trained at, its loss not probed: what align_widening widens upward and
    align_loss slows."""
    return flags["align"] & ~flags["align_seen"] & ~flags["align_probed"]


def beyond_widening(target: str, tau: Mapping[str, float], flags: Mapping[str, Any],
                    share: np.ndarray | None) -> np.ndarray:
    """size_widening and align_both_ways together: the log sd a calibrated row's shape
    adds for lying outside the shapes trained on (and probed)."""
    return np.hypot(size_widening(tau, flags), align_both_ways(target, tau, flags, share))


def prior_domain(extra: Mapping[str, Mapping[str, Mapping[str, Any]]]
                 ) -> dict[str, dict[str, dict[str, Any]]]:
    """domain_flags' ``extra`` per target (calibrations' domains) as the calibrated prior
    covers it: no probed alignment (an offset per dtype cannot follow unaligned shapes
    one by one), and only the dtype/kernel pairs whose offsets aligned probes set and
    those probes' sizes ("offset_pairs", "offset_size", where recorded; none without
    aligned probes: unaligned probes say nothing of the aligned rows; such pairs are
    kept as "unaligned_pairs", for the reason's text)."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for tg, e in extra.items():
        for g, d in e.items():
            d = {k: v for k, v in d.items() if k not in ("align", "offset_pairs",
                                                         "offset_size")} | (
                {"pairs": d["offset_pairs"], "kernels": sorted(
                    {p.split("/")[1] for p in d["offset_pairs"]}),
                 "unaligned_pairs": [p for p in d.get("pairs", [])
                                     if p not in d["offset_pairs"]]}
                if "offset_pairs" in d else {}) | (
                {"size": d["offset_size"]} if "offset_size" in d else {})
            out.setdefault(tg, {})[g] = {k: v for k, v in d.items() if v is not None}
    return out


def upward(logs: Mapping[str, tuple[np.ndarray, np.ndarray]],
           flags: Mapping[str, Mapping[str, Any]], tau_of: Any, meta: Mapping[str, Any],
           share: np.ndarray | None) -> dict[str, np.ndarray]:
    """result's ``up`` per target of ``logs`` (align_widening, ``tau_of(target)`` its
    spreads, ``flags`` per target, ``share`` the rows' align_share at ``logs``' runtime):
    energy derived as power x runtime (``meta`` "derived") is slowed as the runtime is,
    whatever power's domain."""
    derived = (meta.get("derived") or {}).get("energy")
    return {tg: align_widening(tg, tau_of(tg), flags["runtime" if tg == "energy" and
                                                     derived else tg], share) for tg in logs}


def align_loss(t: Table, flags: Mapping[str, Mapping[str, Any]], tau_of: Any,
               meta: Mapping[str, Any], share: np.ndarray | None, carried: Any
               ) -> dict[str, np.ndarray]:
    """result's ``loss`` for the runtime (and energy derived from it, ``meta``
    "derived"): on the rows widened upward for a loss nobody probed (align_widening's),
    the median loss the training data's held-out unaligned rows of the row's dtype took
    per unit of align_share (``tau_of``'s "align_loss:DTYPE", _validate_align) times the
    row's ``share``, less the part its point carries of the forest's shape (``carried``,
    ForestModel.shape_carried; 0 where served by trees on aligned probes); none for a
    dtype no GPU model was trained on unaligned. Only the point moves: the interval stays
    the aligned prediction's, widened upward. The B200's unaligned fp16 rows, left out,
    lost 1.8 in log per unit of share; the H200's fp16 points at 0 probes, with none of
    it, were 46% off, with it 22% (bench/RESULTS.md, the twenty-first session)."""
    if "runtime" not in flags:
        return {}
    tau = tau_of("runtime")
    per = np.array([tau.get(f"align_loss:{d}", 0.0) for d in t["dtype"].astype(str)])
    up = unprobed_loss(flags["runtime"])
    if share is None or not (up & (per > 0)).any():
        return {}
    loss = np.where(up, per * share * (1.0 - np.asarray(carried)), 0.0)
    derived = (meta.get("derived") or {}).get("energy") and "energy" in flags
    return {"runtime": loss, **({"energy": loss} if derived else {})}


def median_losses(t: Table, r: np.ndarray, share: np.ndarray, min_rows: int
                  ) -> dict[str, float]:
    """Per dtype of ``t`` with ``min_rows`` rows at an align_share of LOSS_MIN_SHARE or
    more: "align_loss:DTYPE", the median of their log slowdown over the aligned
    prediction (``r``) per unit of ``share``, at least 0 (unaligned data never speed a
    GEMM up), at most 3. Rows nearer their launch are left out: they lose little, and
    over a small share their error reads as a large loss."""
    out: dict[str, float] = {}
    dts = t["dtype"].astype(str)
    for d in np.unique(dts):
        s = (dts == d) & (share >= LOSS_MIN_SHARE) & np.isfinite(r)
        if s.sum() >= min_rows:
            out[f"align_loss:{d}"] = float(np.clip(np.median(r[s] / share[s]), 0.0, 3.0))
    return out


def shares(t: Table, logs: Mapping[str, tuple[np.ndarray, Any]]) -> np.ndarray | None:
    """align_share of ``t``'s rows at ``logs``' runtime (None without one)."""
    run = logs.get("runtime", (None,))[0]
    return None if run is None else align_share(t, run)


def flags_both(a: Mapping[str, Any], b: Mapping[str, Any]) -> dict[str, Any]:
    """Domain flags of a product of two targets (energy as power x runtime): ``a``'s,
    in the domain only where ``b`` is too, each row's reasons from both (once each). The
    widening stays ``a``'s (the product's sd already holds ``b``'s)."""
    reason = np.array(["; ".join(dict.fromkeys(p for r in (ra, rb) for p in str(r).split(
        "; ") if p)) for ra, rb in zip(a["reason"], b["reason"])], dtype=object)
    return dict(a, in_domain=np.asarray(a["in_domain"]) & np.asarray(b["in_domain"]),
                reason=reason)


def served_flags(out: Mapping[str, Any], on_prior: Mapping[str, np.ndarray],
                 zrows: Mapping[str, np.ndarray], prior: Mapping[str, Mapping[str, Any]],
                 other: Mapping[str, Mapping[str, Any]]
                 ) -> tuple[dict[str, dict[str, Any]], dict[str, np.ndarray]]:
    """Per target of ``out``: the domain flags of the rows it was served, ``prior``'s
    where ``on_prior[target]`` (the calibrated prior), ``other``'s elsewhere, and each
    row's interval quantile (``zrows[target]``). Energy derived as power x runtime (in
    ``out``, not in ``on_prior``) takes flags_both of theirs and the larger quantile:
    each target its own recipe's (before, one mask and one quantile for all: a runtime
    served by trees lost its upward widening where power was served by the calibrated
    prior, and took power's quantile)."""
    per = {tg: flags_where(on_prior[tg], prior.get(tg, prior["runtime"]),
                           other.get(tg, other["runtime"])) for tg in out if tg in on_prior}
    z = {tg: zrows[tg] for tg in per}
    if "energy" in out and "energy" not in per and {"power", "runtime"} <= set(per):
        per["energy"] = flags_both(per["power"], per["runtime"])
        z["energy"] = np.maximum(z["power"], z["runtime"])
    return per, z


def flags_where(mask: np.ndarray, a: Mapping[str, Any], b: Mapping[str, Any]
                ) -> dict[str, Any]:
    """Domain flags (domain_flags' arrays) of ``a`` where ``mask``, of ``b`` elsewhere."""
    if not mask.any():
        return dict(b)
    return {k: np.where(mask.reshape(-1, *([1] * (np.ndim(v) - 1))), a[k], v)
            for k, v in b.items()}


def work_share(runtime_log: np.ndarray) -> np.ndarray:
    """The share of a predicted runtime beyond a launch (LAUNCH_S): what a calibration's
    unaligned offset slows (offsets.unaligned_work)."""
    return np.clip(1.0 - LAUNCH_S / np.exp(runtime_log), 0.0, 1.0)


def align_share(t: Table, runtime_log: np.ndarray) -> np.ndarray:
    """Per row, what the loss of an unaligned GEMM grows with, in its upward spread
    (align_widening; what _validate_align and bench/transfer.py --align measure per unit
    of): the square root of the roofline's share of its predicted runtime (``runtime_log``,
    aligned), how near its speed limit the aligned kernel runs; work_share where the
    device's peaks are not known. Unaligned loads cap a kernel's speed, so a GEMM that
    runs near its peak aligned loses most, a launch- or memory-bound one little: the
    B200's 665 unaligned fp16 GEMMs, left out of a four-GPU prior, lost a median log 1.2-1.3
    above 1 GFLOP, 0.5 at 0.1-1 GFLOP, none below. Per unit of work_share the spread that
    held 90% of them held 61-79% of those above 1 GFLOP and 93-99% below; per unit of the
    square root 80-100% in each size band, the flattest of the shares tried
    (bench/RESULTS.md, 2026-11-28)."""
    peak, bw = features.peak_vector(t)
    eff = roofline_s(features.flops(t), features.traffic_bytes(t), peak, bw) / np.exp(
        runtime_log)
    known = (peak > 0) & (bw > 0) & np.isfinite(eff)  # (NaN peaks compare False)
    return np.where(known, np.sqrt(np.clip(np.nan_to_num(eff), 0.0, 1.0)),
                    work_share(runtime_log))


def _align_spread(target: str, tau: Mapping[str, float], share: np.ndarray
                  ) -> np.ndarray:
    """An ALIGN_UPWARD target's alignment spread per row: ``tau``'s "align" per unit of
    ``share`` (align_share)."""
    return tau.get("align", OOD_SD[target]["align"]) * share


def widen(target: str, sd: np.ndarray, flags: Mapping[str, Any],
          skip: Sequence[str] = (), tau: Mapping[str, float] | None = None,
          share: np.ndarray | None = None) -> np.ndarray:
    """sd combined with the spread (``tau``, else OOD_SD) of every way a row lies
    outside the domain (beyond the trained sizes: size_widening; below the trained
    alignment: for ALIGN_UPWARD's targets only where "align_seen", scaled as
    align_widening by ``share``, which widens the others upward)."""
    tau = tau or OOD_SD.get(target, OOD_SD["runtime"])
    var = sd**2
    for kind in ("gpu", "dtype", "kernel"):
        if kind not in skip:
            var = var + np.where(flags[kind], tau[kind] ** 2, 0.0)
    if "size" not in skip:
        var = var + size_widening(tau, flags) ** 2
    if "align" not in skip:
        var = var + align_both_ways(target, tau, flags, share) ** 2
    return np.sqrt(var)


def align_both_ways(target: str, tau: Mapping[str, float], flags: Mapping[str, Any],
                    share: np.ndarray | None) -> np.ndarray:
    """Per row, the log-space sd its alignment below the trained adds to both ends of
    its interval: for targets other than ALIGN_UPWARD's, ``tau``'s "align"; for those,
    where "align_seen", as align_widening scales it (``share``)."""
    if target not in ALIGN_UPWARD:
        return np.where(flags["align"], tau.get("align", OOD_SD["power"]["align"]), 0.0)
    if share is None:
        return np.zeros(len(flags["align"]))
    return np.where(flags["align"] & flags["align_seen"] & ~flags["align_probed"],
                    _align_spread(target, tau, share), 0.0)


def result(logs: Mapping[str, tuple[np.ndarray, np.ndarray]],
           flags: Mapping[str, Mapping[str, Any]],
           z: float | np.ndarray | Mapping[str, np.ndarray],
           up: Mapping[str, np.ndarray] | None = None,
           loss: Mapping[str, np.ndarray] | None = None) -> dict[str, dict[str, np.ndarray]]:
    """predict_table's answer from log points and sds and each target's domain flags
    (``flags[target]``): z may be one value, per row, or per target and row; ``up``, per
    target, a log sd added to the upper end alone (align_widening); ``loss``, per target,
    a log slowdown of the point alone (align_loss), inside the interval."""
    up, loss = up or {}, loss or {}
    out = {}
    for target, (mu, sd) in logs.items():
        zt = z[target] if isinstance(z, Mapping) else z
        top = zt * np.hypot(sd, up.get(target, 0.0))
        out[target] = {"point": np.exp(mu + np.minimum(loss.get(target, 0.0), top)),
                       "lo": np.exp(mu - zt * sd), "hi": np.exp(mu + top), "sigma": sd,
                       "in_domain": flags[target]["in_domain"],
                       "domain": flags[target]["reason"]}
    return out


def to_predictions(out: Mapping[str, Mapping[str, np.ndarray]], n: int) -> list[Prediction]:
    """Prediction objects from predict_table's answer."""
    preds = [Prediction() for _ in range(n)]
    for target, res in out.items():
        for i, p in enumerate(preds):
            setattr(p, COLUMN[target], float(res["point"][i]))
            setattr(p, f"{target}_lo", float(res["lo"][i]))
            setattr(p, f"{target}_hi", float(res["hi"][i]))
            p.sigma[target] = float(res["sigma"][i])
            p.domains[target] = "" if res["in_domain"][i] else str(res["domain"][i])
    for p in preds:  # in_domain and domain: the runtime's (the headline of a probe)
        head = "runtime" if "runtime" in p.domains else next(iter(p.domains), "")
        p.domain = p.domains.get(head, "")
        p.in_domain = not p.domain
    return preds
