"""Shapes aligned below anything trained on: outside the domain, their runtime interval
widened upward only (gemmd.model.domain: ALIGN_BYTES, align_widening)."""

from __future__ import annotations

import copy
import dataclasses

import numpy as np
import pytest

from gemmd import datasets, features
from gemmd.config import ModelConfig
from gemmd.features import Table
from gemmd.gemm import ProbeSpec
from gemmd.model import ForestModel, TransferModel
from gemmd.model.calibration import (
    WORK_IDENTIFIED,
    _align_on_work,
    _calibrated_logs,
    _unknown_priors,
    calibrate,
)
from gemmd.model.domain import (
    ALIGN_MIN_ROWS,
    OOD_SD,
    align_log2,
    align_share,
    domain_flags,
    domain_record,
    served_flags,
    work_share,
)
from gemmd.model.offsets import (
    _robust_offsets,
    launch_share,
    loss_slope,
    unaligned,
    unaligned_work,
)
from gemmd.model.transfer import _fit_trees

A100 = datasets.KNOWN_GPUS["a100-sxm-80gb"]
H100 = datasets.KNOWN_GPUS["h100-sxm"]
CFG = ModelConfig(min_samples=2, n_estimators=30)
SLOWER = 3.0  # an unaligned GEMM's compute, as on the H200 (bench/RESULTS.md, 2026-11-27)


def efficiency(t: Table) -> np.ndarray:
    """The synthetic GPUs' share of the roofline's speed for each GEMM of ``t``, aligned:
    it grows with size (0.04 to 0.76 of peak)."""
    return 0.8 * (0.9 * (1 - np.exp(-features.flops(t) / 2**32)) + 0.05)


def compute_s(t: Table) -> np.ndarray:
    """The synthetic GPUs' compute time of each GEMM of ``t``, aligned: its roofline
    time at its efficiency."""
    return features.roofline(t) / efficiency(t)


def gemms(info, n: int, seed: int, dtype: str = "bf16", odd: bool = False,
          slower: float = SLOWER, grows: bool = True) -> Table:
    """GEMMs at an efficiency that grows with size plus a launch cost; ``odd``: each of
    M, N, K nudged off its power of two by an odd amount, the compute ``slower`` times
    slower at the top efficiency and less below (the log of the loss times the square
    root of the efficiency's share of the top: 1.7x at a quarter of it, as the B200's and
    the H200's unaligned GEMMs lost most near their peak; a launch-bound GEMM loses
    little); ``grows`` False: ``slower`` at every size (what one offset per unit of work
    reads exactly)."""
    rng = np.random.default_rng(seed)
    dims = 2 ** rng.integers(8, 13 if odd else 14, size=(n, 3))  # odd: inside the sizes
    if odd:
        dims = dims + 2 * rng.integers(0, 20, size=(n, 3)) + 1
    t = Table.from_rows([{"m": int(m), "n": int(nn), "k": int(k), "dtype": dtype}
                         for m, nn, k in dims], [info] * n)
    loss = (slower ** np.sqrt(efficiency(t) / 0.76) if grows else slower) if odd else 1.0
    t.cols["runtime_s"] = (compute_s(t) * loss + 4e-6) * np.exp(rng.normal(0, 0.03, n))
    return t


def tiny(n: int, seed: int, odd: bool = False, kernel: str = "blas", lo: int = 5,
         hi: int = 9) -> Table:
    """bf16 GEMMs on an A100 whose launch is 1 us (below the 3 us a work share is read
    against), sizes 2^lo..2^(hi-1); ``odd``: nudged off by an odd amount, the whole
    runtime, launch included, SLOWER times slower."""
    rng = np.random.default_rng(seed)
    dims = 2 ** rng.integers(lo, hi, size=(n, 3))
    if odd:
        dims = dims + 2 * rng.integers(0, 4, size=(n, 3)) + 1
    t = Table.from_rows([{"m": int(a), "n": int(b), "k": int(c), "dtype": "bf16",
                          "kernel": kernel} for a, b, c in dims], [A100] * n)
    t.cols["runtime_s"] = (compute_s(t) + 1e-6) * (SLOWER if odd else 1.0) * np.exp(
        rng.normal(0, 0.03, n))
    return t


@pytest.fixture(scope="module")
def aligned_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("align") / "m.skops"
    ForestModel.fit_table(gemms(A100, 400, 0), CFG).save(path)
    return ForestModel.load(path)  # the record as a saved model keeps it


def test_alignment_counts_bytes_up_to_a_16_byte_vector():
    """The least of M, N, K's alignment in bytes, up to 16; a GEMM with a dimension
    shorter than a 16-byte vector counts as aligned (the B200's lost nothing for it)."""
    t = Table.from_rows([{"m": 4096, "n": 4096, "k": 4096, "dtype": "bf16"},
                         {"m": 4104, "n": 4096, "k": 4096, "dtype": "bf16"},  # 8 x 2 B
                         {"m": 4100, "n": 4096, "k": 4096, "dtype": "bf16"},  # 4 x 2 B
                         {"m": 4096, "n": 4096, "k": 4097, "dtype": "bf16"},
                         {"m": 4100, "n": 4096, "k": 4096, "dtype": "fp32"},  # 4 x 4 B
                         {"m": 4097, "n": 4096, "k": 4096, "dtype": "fp32"},
                         {"m": 4104, "n": 4096, "k": 4096, "dtype": "fp8"},  # 8 x 1 B
                         # shorter than a 16-byte vector: a matrix-vector product
                         {"m": 2, "n": 4096, "k": 4096, "dtype": "bf16"},
                         {"m": 7, "n": 4096, "k": 4097, "dtype": "bf16"},
                         {"m": 8, "n": 4096, "k": 4096, "dtype": "fp8"},  # 8 B: half a vector
                         {"m": 4100, "n": 3, "k": 4096, "dtype": "fp32"}],
                        [A100] * 11)
    assert (2 ** align_log2(t)).tolist() == [16, 16, 8, 2, 16, 4, 8, 16, 16, 16, 16]


@pytest.mark.parametrize(("layout", "counts"), [("nn", "mk"), ("nt", "mn"), ("tn", "mk"),
                                               ("tt", "mnk")])
def test_gemmds_own_cublas_probes_count_their_leading_dimensions(layout, counts):
    """gemmd's cuBLAS probes are column-major (lda M or K, ldb K or N, ldc M): only a
    dimension that is some operand's leading one counts (on the H200 an odd N of an nn
    GEMM cost little, an odd M or K 5x). An imported row (its storage not known), the
    tiled kernel's or one of no source counts all three."""
    rows = [{"m": 4096 + (c == "m"), "n": 4096 + (c == "n"), "k": 4096 + (c == "k"),
             "dtype": "fp16", "layout": layout, "kernel": kernel, "source": source}
            for source, kernel in (("daemon", "blas"), ("apex_plus", "blas"), ("", "blas"),
                                   ("daemon", "tiled")) for c in "mnk"]
    got = (2 ** align_log2(Table.from_rows(rows, [A100] * len(rows)))).tolist()
    assert got[:3] == [2.0 if c in counts else 16.0 for c in "mnk"]
    assert got[3:] == [2.0] * 9


def test_an_odd_dimension_no_operand_leads_is_no_unaligned_probe(aligned_model):
    """The daemon's nn probe with only N odd is in the domain and served as aligned; with
    M odd it is not (the same shape from a file of unknown storage is not either)."""
    specs = [ProbeSpec(4096, 4097, 4096, "bf16"), ProbeSpec(4097, 4096, 4096, "bf16")]
    own = aligned_model.predict(specs, [A100] * 2, source="daemon")
    other = aligned_model.predict(specs, [A100] * 2, source="apex_plus")
    assert own[0].in_domain and not own[1].in_domain and not other[0].in_domain
    assert "aligned to 2 B" in own[1].domain and "aligned to 2 B" in other[0].domain
    assert own[0].runtime_hi / own[0].runtime_s < other[0].runtime_hi / other[0].runtime_s
    cal = gemms(A100, 40, 5)
    cal.cols["n"] = cal["n"] + 1  # N odd alone: aligned loads, no unaligned offset
    cal.cols["source"] = np.full(len(cal), "daemon", dtype=object)
    assert not unaligned(cal).any()


def test_an_unaligned_shape_is_flagged_and_its_runtime_covered_upward(aligned_model):
    """Trained on powers of two, asked about odd sizes three times slower to compute:
    outside the domain with the reason, the interval's upper end widened by the
    roofline's share of the runtime and its lower end left where the trained sizes put
    it; shapes aligned to 16 bytes stay in the domain."""
    odd = gemms(A100, 300, 1, odd=True)
    res = aligned_model.predict_table(odd)["runtime"]
    assert not res["in_domain"].any()
    assert all("M, N, K aligned to 2 B, trained on >= 16 B" in r for r in res["domain"])
    y = odd["runtime_s"]
    assert np.mean((res["lo"] <= y) & (y <= res["hi"])) >= 0.85
    up, down = np.log(res["hi"] / res["point"]), np.log(res["point"] / res["lo"])
    big = features.flops(odd) > 2**34
    assert np.all(up[big] > 2 * down[big])
    # the lower end is the in-domain one: the same sizes rounded to 16 bytes
    inside = aligned_model.predict_table(rounded(odd))["runtime"]
    assert inside["in_domain"].all()
    ratio = (res["point"] / res["lo"]) / (inside["point"] / inside["lo"])
    assert np.allclose(ratio, 1.0, rtol=1e-6)
    # a launch-bound GEMM gets little of the widening
    tiny = gemms(A100, 50, 2, odd=True)
    for c in ("m", "n", "k"):
        tiny.cols[c] = np.full(len(tiny), 17.0)
    small = aligned_model.predict_table(tiny)["runtime"]
    assert np.all(np.log(small["hi"] / small["point"]) < np.median(up[big]))


def test_a_fleet_that_probed_unaligned_shapes_measures_what_they_cost():
    """Training data with a GPU's unaligned shapes beside its aligned ones: fit-time
    validation holds them out and measures the upward spread they need (here 16x slower
    near the peak: more than the default allows), which then widens another GPU's
    unaligned shapes that its own data never had; without such data the default stays."""
    slow = 16.0
    fleet = features.concat([gemms(A100, 300, 11), gemms(A100, 150, 12, odd=True, slower=slow),
                             gemms(H100, 300, 13)])
    model = ForestModel.fit_table(fleet, CFG)
    measured = model.meta["ood_sd"]["runtime"]["align"]
    assert model.meta["ood_sd"]["energy"]["align"] == measured
    # per unit of align_share, the square root of the speed's share (0.76 at the top)
    assert OOD_SD["runtime"]["align"] < np.log(slow) / 1.645 / np.sqrt(0.76) * 0.9 < \
        measured < 3.0
    work = model.meta["ood_sd"]["runtime"]["align_work"]  # the offset's, per unit of work
    assert model.meta["ood_sd"]["energy"]["align_work"] == work and 0.5 < work < 3.0
    odd = gemms(H100, 200, 14, odd=True, slower=slow)
    res = model.predict_table(odd)["runtime"]
    y = odd["runtime_s"]
    assert all("aligned to 2 B" in r for r in res["domain"])
    assert np.mean((res["lo"] <= y) & (y <= res["hi"])) >= 0.85
    default = ForestModel.fit_table(gemms(A100, 300, 11), CFG)
    assert "align" not in default.meta.get("ood_sd", {}).get("runtime", {})


def without_losses(model: ForestModel) -> ForestModel:
    """``model`` with no "align_loss:DTYPE" measured (as one fitted before they were):
    its unaligned points the aligned prediction."""
    out = copy.copy(model)
    out.meta = copy.deepcopy(model.meta)
    for tau in out.meta["ood_sd"].values():
        for k in [k for k in tau if k.startswith("align_loss:")]:
            del tau[k]
    return out


def test_a_gpu_never_trained_on_is_widened_upward_whoever_ran_unaligned_shapes(tmp_path):
    """A GPU model the prior never saw is predicted by the transfer estimate, which
    carries no alignment even where another GPU model's unaligned rows of the dtype taught
    the forest their cost: its unaligned shapes are out of the domain, their interval is
    the aligned prediction's widened upward (before: taken as trained on; the H200's
    unaligned fp16 under the B200's rows were 4.6x slower than predicted and 8% covered),
    and their point takes the loss the other GPU model's unaligned rows of the dtype
    took, held out at fit time, per unit of align_share (domain.align_loss). A GPU model
    trained aligned beside that other one keeps both ends widened and its point (the
    forest may carry the cost there); a dtype nobody ran unaligned takes no loss."""
    fleet = features.concat([gemms(A100, 300, 11), gemms(A100, 150, 12, odd=True),
                             gemms(H100, 300, 13)])
    model = ForestModel.fit_table(fleet, CFG)
    loss = model.ood_sd("runtime")["align_loss:bf16"]
    assert 0.5 < loss < np.log(SLOWER) / np.sqrt(0.76) * 1.5
    assert model.ood_sd("energy")["align_loss:bf16"] == loss
    new = datasets.KNOWN_GPUS["b200"]
    odd = gemms(new, 200, 15, odd=True)
    res = model.predict_table(odd)["runtime"]
    res0 = without_losses(model).predict_table(odd)["runtime"]
    assert all(r.endswith("M, N, K aligned to 2 B, trained on >= 16 B") for r in res["domain"])
    for key in ("lo", "hi"):
        assert np.array_equal(res[key], res0[key])
    up, down = np.log(res0["hi"] / res0["point"]), np.log(res0["point"] / res0["lo"])
    assert np.all(up > down)
    fast = efficiency(odd) > np.median(efficiency(odd))  # nearer its peak: widened most
    assert np.median((up - down)[fast]) > 2 * np.median((up - down)[~fast])
    y = odd["runtime_s"]
    assert np.mean((res["lo"] <= y) & (y <= res["hi"])) >= 0.85
    # the point: slowed by the loss per unit of share, less what the transfer setting's
    # share of the forest's shape (which learnt the A100's loss) already carries
    slowed = np.log(res["point"] / res0["point"])
    a = model.transfer_setting()[1]
    share = align_share(odd, np.log(res0["point"]))
    assert a < 1.0 and np.allclose(slowed, loss * share * (1.0 - a), atol=1e-9)
    assert np.all(slowed > 0) and np.median(slowed[fast]) > np.median(slowed[~fast])
    # so does the calibrated prior of 20 probes of the new GPU, all aligned; the point
    # stays inside the interval
    probes = gemms(new, 20, 17)
    cal, cal0 = (TransferModel.fit(prior, probes, CFG, select=False).predict_table(odd)[
        "runtime"] for prior in (model, without_losses(model)))
    assert np.all((cal["lo"] <= cal["point"]) & (cal["point"] <= cal["hi"]))
    assert np.median(np.log(cal["point"] / cal0["point"])) > 0.05
    # trees on those aligned probes carry none of the loss: all of it on their point
    trees = copy.copy(TransferModel.fit(model, probes, CFG, select=False))
    trees.few, trees.probe_domain, trees._flat = _fit_trees(probes, CFG, ["runtime"]), \
        domain_record(probes), {}
    trees.choice = dict(trees.choice, runtime="few")
    trees0 = copy.copy(trees)
    trees0.prior = without_losses(model)
    r, r0 = trees.predict_table(odd)["runtime"], trees0.predict_table(odd)["runtime"]
    assert np.allclose(np.log(r["point"] / r0["point"]),
                       loss * align_share(odd, np.log(r0["point"])), atol=1e-9)
    # probes that measured the dtype's loss, at 8 bytes: their offset is the loss, also
    # for the rows at 2 bytes they do not vouch for (widened upward still), not added
    probes = features.concat([probes, at_8_bytes(gemms(new, 6, 18, odd=True), 2.0)])
    cal, cal0 = (TransferModel.fit(prior, probes, CFG, select=False).predict_table(odd)[
        "runtime"] for prior in (model, without_losses(model)))
    assert np.array_equal(cal["point"], cal0["point"])
    model.save(tmp_path / "m.skops")  # the loss is kept in the file
    assert np.array_equal(ForestModel.load(tmp_path / "m.skops").predict_table(odd)[
        "runtime"]["point"], res["point"])
    fp16 = gemms(new, 20, 16, dtype="fp16", odd=True)  # no unaligned fp16 trained on
    assert np.array_equal(model.predict_table(fp16)["runtime"]["point"],
                          without_losses(model).predict_table(fp16)["runtime"]["point"])
    known = model.predict_table(gemms(H100, 50, 14, odd=True))["runtime"]
    assert np.allclose(np.log(known["hi"] / known["point"]),
                       np.log(known["point"] / known["lo"]), rtol=1e-6)


def rounded(t: Table) -> Table:
    """The same GEMMs with M, N, K rounded down to a multiple of 8 (16 bytes in bf16)."""
    out = copy.deepcopy(t)
    for c in ("m", "n", "k"):
        out.cols[c] = (t[c] // 8) * 8
    return out


def test_the_alignment_spread_grows_with_the_speed_a_gemm_reaches():
    """align_share: the square root of the roofline's share of the aligned prediction
    (a GEMM at its speed limit 1, one at a quarter of it 0.5, none above 1), the work
    beyond a launch where the device's peaks are not known."""
    t = gemms(A100, 3, 0)
    roof = features.roofline(t)
    share = align_share(t, np.log(roof * np.array([1.0, 4.0, 0.5])))
    assert np.allclose(share, [1.0, 0.5, 1.0])
    blind = dataclasses.replace(A100, uuid="GPU-no-peaks", peak_flops={}, mem_bandwidth=0.0)
    u = Table.from_rows([t.row(0)], [blind])
    assert align_share(u, np.log([2e-5])) == pytest.approx(work_share(np.log([2e-5])))


def test_a_model_fitted_before_align_work_keeps_its_spread_for_the_offset():
    """A model whose "align" was measured per unit of work (before align_share) serves it
    as its offset's "align_work", and widens by OOD_SD's "align"."""
    fleet = features.concat([gemms(A100, 300, 11), gemms(A100, 150, 12, odd=True),
                             gemms(H100, 300, 13)])
    model = ForestModel.fit_table(fleet, CFG)
    old = copy.deepcopy(model.meta["ood_sd"])
    for tg in ("runtime", "energy"):
        if tg in old:
            old[tg]["align"] = old[tg].pop("align_work")
    model.meta["ood_sd"] = old
    tau = model.ood_sd("runtime")
    assert tau["align_work"] == old["runtime"]["align"]
    assert tau["align"] == OOD_SD["runtime"]["align"]


def test_power_outside_the_alignment_is_widened_both_ways():
    t = gemms(A100, 200, 3)
    t.cols["power_w"] = 300.0 * np.exp(np.random.default_rng(3).normal(0, 0.02, len(t)))
    model = ForestModel.fit_table(t, CFG)
    odd = gemms(A100, 50, 4, odd=True)
    p, inside = (model.predict_table(x)["power"] for x in (odd, rounded(odd)))
    assert not p["in_domain"].any() and inside["in_domain"].all()
    up, down = np.log(p["hi"] / p["point"]), np.log(p["point"] / p["lo"])
    assert np.allclose(up, down, rtol=1e-6)
    half = np.log(inside["hi"] / inside["point"])
    want = np.hypot(half, model.z * OOD_SD["power"]["align"])
    assert np.allclose(up, want, rtol=0.02) and np.all(up > half * 1.2)


def test_a_few_unaligned_rows_do_not_make_a_domain():
    """Below ALIGN_MIN_ROWS rows at an alignment a model has not learnt what it costs:
    one or three unaligned rows beside aligned ones leave the rest flagged and covered;
    ten count as trained on."""
    odd = gemms(A100, 200, 15, odd=True)
    for few, flagged in ((1, True), (3, True), (ALIGN_MIN_ROWS, False)):
        t = features.concat([gemms(A100, 300, 0), odd.take(np.arange(few))])
        res = ForestModel.fit_table(t, CFG).predict_table(odd.take(np.arange(50, 200)))
        r = res["runtime"]
        assert bool((~r["in_domain"]).all()) == flagged, few
        if flagged:
            y = odd["runtime_s"][50:]
            assert np.mean((r["lo"] <= y) & (y <= r["hi"])) >= 0.85


def test_the_calibrated_prior_keeps_the_priors_alignment_flags(aligned_model):
    """The calibrated prior (an offset per dtype) cannot follow what unaligned shapes
    cost, whatever its probes' alignment: its rows stay flagged and widened upward
    (where trees on the probes predict them, the probes' alignment counts: above)."""
    probes = features.concat([gemms(H100, 6, 16), gemms(H100, 12, 17, odd=True)])
    tm = TransferModel.fit(aligned_model, probes, CFG, select=False)
    assert tm.choice["runtime"] == "calibrated"
    assert tm.calibrations[next(iter(tm.calibrations))].domain["runtime"]["align"]["bf16"] == 1
    odd = gemms(H100, 150, 18, odd=True)
    r = tm.predict_table(odd)["runtime"]
    assert all("aligned to 2 B" in x for x in r["domain"])
    y = odd["runtime_s"]
    assert np.mean((r["lo"] <= y) & (y <= r["hi"])) >= 0.85


def test_unaligned_probes_get_their_own_offset_not_the_devices_level(aligned_model):
    """A new GPU's probes at unaligned shapes (3x slower) beside aligned ones: their loss
    is their dtype's own offset, applied to unaligned rows only; the level and the
    aligned rows are what the aligned probes alone give (before, four unaligned probes
    of five raised the H200's fp16 level and its aligned rows went 15% -> 82.5% off)."""
    al, odd = gemms(H100, 4, 30), gemms(H100, 8, 31, odd=True, grows=False)
    both = calibrate(aligned_model, features.concat([al, odd]))[H100.uuid]
    alone = calibrate(aligned_model, al)[H100.uuid]
    assert both.level["runtime"] == pytest.approx(alone.level["runtime"], abs=0.02)
    # (its loss on the work, and what the shrunk level leaves of the prior's error there:
    # a prior of another GPU model predicts these small GEMMs up to 2x too fast)
    assert 0.6 < both.align_offset["runtime"]["bf16"] < np.log(SLOWER) + 0.25
    assert "runtime" not in alone.align_offset or not alone.align_offset["runtime"]
    # probes all unaligned say nothing of the level: the loss is the offset's alone (the
    # level and the offset fitted together traded it between them, by the probe count)
    # (at 5 probes this draw fits the loss-on-the-work model better, and that model reads
    # the prior's miss on small GEMMs, a GPU model it never saw, as loss: 1.8, a known
    # weakness of _align_on_work's choice on few probes; one loss for all gave 1.3)
    for n, most in ((5, 0.75), (50, 0.25)):
        only = calibrate(aligned_model, gemms(H100, n, 34, odd=True, grows=False))[H100.uuid]
        assert only.level["runtime"] == 0.0
        assert 0.6 < only.align_offset["runtime"]["bf16"] < np.log(SLOWER) + most
    assert not only.align_on_work["runtime"]["bf16"]  # 50 probes: the whole runtime's fits
    assert both.offset("runtime", "bf16/blas", 1.0) - both.offset("runtime", "bf16/blas") \
        == pytest.approx(both.align_offset["runtime"]["bf16"])
    tm = TransferModel.fit(aligned_model, features.concat([al, odd]), CFG, select=False)
    test_al, test_odd = gemms(H100, 100, 32), gemms(H100, 100, 33, odd=True, grows=False)
    # the residual trees' base (the calibrated prior's logs) carries it too
    base = _calibrated_logs(aligned_model, {H100.uuid: both}, test_odd)["runtime"]
    logs = aligned_model.prior_logs(test_odd)[0]
    assert np.allclose(base, logs["runtime"][0] + [
        both.offset("runtime", "bf16/blas", w, h)
        for w, h in zip(unaligned_work(test_odd, logs), launch_share(test_odd, logs))])
    ref = TransferModel.fit(aligned_model, al, CFG, select=False).predict_table(test_al)
    got = tm.predict_table(test_al)["runtime"]["point"]
    assert np.allclose(got, ref["runtime"]["point"], rtol=0.03)
    r = tm.predict_table(test_odd)["runtime"]
    y = test_odd["runtime_s"]
    assert abs(np.median(np.log(r["point"] / y))) < 0.3
    assert np.mean((r["lo"] <= y) & (y <= r["hi"])) >= 0.85


def test_an_unaligned_offset_slows_the_work_not_the_launch():
    """Unaligned data slow a GEMM's compute, not its launch: probes of a GPU the prior
    knows, at unaligned shapes from launch-bound to compute-bound, give their dtype the
    loss of the compute (3x), and a launch-bound unaligned GEMM is predicted little
    slower than aligned while a compute-bound one takes all of it. (One loss in log for
    every row, before, gave the H200's launch-bound random GEMMs the compute-bound
    ones' 4-5x: 61-71% off at 5 probes; bench/RESULTS.md, the thirteenth session.)"""
    known = ForestModel.fit_table(gemms(H100, 400, 40), CFG)
    probes = features.concat([gemms(H100, 20, 41), gemms(H100, 20, 42, odd=True, grows=False)])
    cal = calibrate(known, probes)[H100.uuid]
    assert cal.align_offset["runtime"]["bf16"] == pytest.approx(np.log(SLOWER), abs=0.15)
    assert cal.align_on_work["runtime"]["bf16"]
    tm = TransferModel.fit(known, probes, CFG, select=False)
    # the smallest and largest trained sizes, each once aligned and once not: the small
    # one is much launch (its compute 2.6 us beside 4 us: 1.8x slower unaligned, not 3x)
    odd, even = (Table.from_rows([{"m": n + extra, "n": n + extra, "k": n + extra,
                                   "dtype": "bf16"} for n in (256, 8192)], [H100] * 2)
                 for extra in (1, 0))
    compute = compute_s(even)
    truth = np.log((SLOWER * compute + 4e-6) / (compute + 4e-6))
    assert truth[0] < 0.6 * truth[1]
    slow = np.log(tm.predict_table(odd)["runtime"]["point"] /
                  tm.predict_table(even)["runtime"]["point"])
    assert np.allclose(slow, truth, atol=0.2)
    test = gemms(H100, 200, 43, odd=True, grows=False)
    y = test["runtime_s"]
    r = tm.predict_table(test)["runtime"]
    assert np.mean(np.abs(r["point"] / y - 1)) < 0.06  # one loss for all: 8%
    # (this draw's rows are covered 78-80%, in a 1.2x interval; widened upward before
    # the fourteenth session, 84-86% in 4x; eight draws 90% and 93%: the coverage over
    # draws is test_a_probed_loss_is_served_with_its_uncertainty_not_widened_upward's)
    assert np.mean((r["lo"] <= y) & (y <= r["hi"])) >= 0.75


def test_a_loss_of_the_whole_runtime_is_served_whatever_the_work_share():
    """Unaligned GEMMs 3x slower as a whole, launch included, on a GPU whose launch is
    1 us (below the 3 us a work share is read against: every unaligned probe's share is
    0): the dtype's probes fit one loss for the whole runtime better, and every unaligned
    row, probes and others, is served all of it (a review found such rows served none:
    their share of 0 was taken for aligned)."""
    prior = ForestModel.fit_table(tiny(300, 50), CFG)
    probes = features.concat([tiny(10, 51), tiny(8, 52, odd=True)])
    cal = calibrate(prior, probes)[A100.uuid]
    assert not cal.align_on_work["runtime"]["bf16"]
    assert cal.align_offset["runtime"]["bf16"] == pytest.approx(np.log(SLOWER), abs=0.15)
    assert cal.offset("runtime", "bf16/blas", 0.3) == cal.offset("runtime", "bf16/blas", 1.0)
    # so does its uncertainty; each of the 8 probes is one probe's worth of it (slope 1)
    assert cal.loss_variance("runtime", "bf16", 0.3) == cal.loss_variance("runtime", "bf16", 1)
    assert 8.0 < cal.align_precision["runtime"]["bf16"] < 9.0
    test = tiny(100, 53, odd=True)
    for t in (probes.take(np.arange(10, 18)), test):
        served = _calibrated_logs(prior, {A100.uuid: cal}, t)["runtime"]
        assert np.all(np.abs(np.log(t["runtime_s"]) - served) < 0.2)
    tm = TransferModel.fit(prior, probes, CFG, select=False)
    y = test["runtime_s"]
    assert np.median(np.abs(np.log(tm.predict_table(test)["runtime"]["point"] / y))) < 0.1


def test_a_probed_loss_is_served_with_its_uncertainty_not_widened_upward(aligned_model):
    """Where a new GPU's unaligned probes measured their dtype's loss, the calibrated
    prior's unaligned rows carry that loss's uncertainty and the unaligned probes' own
    scatter, on both ends; the upward widening for a loss nobody measured stays where
    the probes were all aligned. (On the H200's random shapes at 5 probes the upper ends
    sat 1.4-1.7 in log above the point and held every row, the lower ends missed up to
    37%; bench/RESULTS.md, the fourteenth session.) Judged over draws of probes: one
    draw of 7 held 77% of a GPU model's unaligned rows, eight 97% (the widened: 100%)."""
    known = ForestModel.fit_table(gemms(H100, 400, 40), CFG)
    for prior, n_al, n_odd in ((aligned_model, 4, 3), (known, 10, 10)):
        cover, width, width0 = [], [], []
        for seed in range(4):
            al, odd = gemms(H100, n_al, 70 + seed), gemms(H100, n_odd, 80 + seed, odd=True)
            test = gemms(H100, 60, 90 + seed, odd=True)
            y = test["runtime_s"]
            tm = TransferModel.fit(prior, features.concat([al, odd]), CFG, select=False)
            assert tm.choice["runtime"] == "calibrated"
            cal = tm.calibrations[H100.uuid]
            w = unaligned_work(test, prior.prior_logs(test)[0])
            added = np.array([cal.loss_variance("runtime", "bf16", x) for x in w])
            assert np.all(added > 0) and cal.loss_variance("runtime", "bf16", 0.0) == 0.0
            s2, su2 = cal.sd["runtime"] ** 2, cal.align_scatter["runtime"]["bf16"] ** 2
            served = w if cal.align_on_work["runtime"]["bf16"] else np.ones(len(w))
            assert np.allclose(added, max(su2 - s2, 0.0) + su2 * loss_slope(
                cal.align_offset["runtime"]["bf16"], served) ** 2 /
                cal.align_precision["runtime"]["bf16"])
            assert cal.variance("runtime", "bf16/blas", None, w[0]) == pytest.approx(
                cal.variance("runtime", "bf16/blas") + added[0] * cal.scale.get("runtime", 1.0)
                ** 2)
            # the leave-one-GPU-out factor scales the loss's variance with the rest (it
            # corrects the device's scatter, which the loss's variance is made of)
            scaled = copy.deepcopy(cal)
            scaled.scale["runtime"] = 2.0 * cal.scale.get("runtime", 1.0)
            assert scaled.variance("runtime", "bf16/blas", None, w[0]) == pytest.approx(
                4.0 * cal.variance("runtime", "bf16/blas", None, w[0]))
            r = tm.predict_table(test)["runtime"]
            up, down = np.log(r["hi"] / r["point"]), np.log(r["point"] / r["lo"])
            assert np.allclose(up, down, rtol=1e-6)
            assert not r["in_domain"].any()  # one loss per dtype: not its shapes one by one
            cover.append(np.mean((r["lo"] <= y) & (y <= r["hi"])))
            width.append(np.median(up + down))
            r0 = TransferModel.fit(prior, al, CFG, select=False).predict_table(test)["runtime"]
            up0, down0 = np.log(r0["hi"] / r0["point"]), np.log(r0["point"] / r0["lo"])
            assert np.all(up0 > down0) and np.median(up0 - down0) > 0.3  # widened upward
            width0.append(np.median(up0 + down0))
        assert 0.85 <= np.mean(cover) and np.mean(width) < 0.9 * np.mean(width0)


def at_8_bytes(t: Table, slower: float) -> Table:
    """``t``'s bf16 shapes moved to the power of two nearest each dimension plus 4
    elements (aligned to 8 bytes), their compute ``slower`` times slower."""
    for c in ("m", "n", "k"):
        t.cols[c] = 2 ** np.round(np.log2(t[c])) + 4
    t.cols["runtime_s"] = compute_s(t) * slower + 4e-6
    return t


def test_a_loss_probed_at_8_bytes_does_not_vouch_for_rows_at_2(aligned_model):
    """Unaligned probes at 8 bytes that lose 1.2x measure nothing of rows at 2 bytes
    that lose 3x: those keep the upward widening for a loss nobody measured (a review
    found them covered 45% over four draws, one draw none, where it had been 91%)."""
    for extra in (0, 1):  # one probe at 2 bytes among them: the fit keeps the 8 bytes'
        cover = []        # loss, and it does not vouch for all 2-byte rows (62% covered)
        for seed in range(4):
            probes = features.concat([gemms(H100, 6, 70 + seed),
                                      at_8_bytes(gemms(H100, 4, 80 + seed, odd=True), 1.2),
                                      gemms(H100, extra, 60 + seed, odd=True)])
            tm = TransferModel.fit(aligned_model, probes, CFG, select=False)
            assert tm.calibrations[H100.uuid].align_least["runtime"]["bf16"] == 3.0
            test = gemms(H100, 60, 90 + seed, odd=True)
            y = test["runtime_s"]
            r = tm.predict_table(test)["runtime"]
            assert np.all(np.log(r["hi"] / r["point"]) > np.log(r["point"] / r["lo"]))
            cover.append(np.mean((r["lo"] <= y) & (y <= r["hi"])))
        assert np.mean(cover) >= 0.85


def test_a_probed_loss_is_served_alike_below_three_probes_of_a_pair(aligned_model):
    """One aligned and one unaligned probe: no dtype/kernel has the 3 probes that make a
    calibration's domain, yet the loss is measured and served with its uncertainty:
    not also widened upward (a review found the upper end 1.78 in log above the point,
    the lower 0.97 below; with a second aligned probe, 0.83 each way)."""
    test = gemms(H100, 60, 90, odd=True)
    probes = features.concat([gemms(H100, 1, 70), gemms(H100, 1, 80, odd=True)])
    tm = TransferModel.fit(aligned_model, probes, CFG, select=False)
    assert "bf16" in tm.calibrations[H100.uuid].align_precision["runtime"]
    r = tm.predict_table(test)["runtime"]
    up, down = np.log(r["hi"] / r["point"]), np.log(r["point"] / r["lo"])
    free = r["lo"] > 1.01 * features.roofline(test)  # lower ends the roofline did not clip
    assert free.sum() > 30 and np.allclose(up[free], down[free], rtol=1e-6)


def test_each_target_keeps_its_own_recipes_flags_and_quantile():
    """The runtime served by trees on the probes, power by the calibrated prior: the
    runtime's rows keep the flags of the trees' domain and their own quantile (before,
    one mask for all targets: power's recipe gave the runtime the calibrated prior's
    flags, and with them no upward widening: 0% covered where 77% had been)."""
    t = gemms(A100, 300, 19)
    t.cols["power_w"] = 300.0 * np.exp(np.random.default_rng(4).normal(0, 0.02, len(t)))
    prior = ForestModel.fit_table(t, CFG)
    probes = features.concat([gemms(H100, 8, 5), at_8_bytes(gemms(H100, 6, 6, odd=True), 3.0)])
    probes.cols["power_w"] = np.full(len(probes), 500.0)
    test = gemms(H100, 30, 7, odd=True)  # 2 bytes: below every probe
    base = TransferModel.fit(prior, probes, CFG, select=False)
    few = _fit_trees(probes, CFG, ["runtime", "power"])
    res = {}
    for power in ("few", "calibrated"):
        m = copy.copy(base)
        m.few, m.probe_domain, m._flat = few, domain_record(probes), {}
        m.choice = dict(base.choice, runtime="few", power=power)
        res[power] = m.predict_table(test)
    for key in ("lo", "hi", "point"):
        assert np.allclose(res["few"]["runtime"][key], res["calibrated"]["runtime"][key])
    e = res["calibrated"]["energy"]  # power's flags and the runtime's, joined
    assert not e["in_domain"].any()
    # and power served by the calibrated prior keeps its flags whatever the runtime's
    m = copy.copy(base)
    m.few, m.probe_domain, m._flat = few, domain_record(probes), {}
    m.choice = dict(base.choice, runtime="calibrated", power="calibrated")
    alone = m.predict_table(test)["power"]
    for key in ("lo", "hi", "point", "in_domain"):
        assert np.array_equal(alone[key], res["calibrated"]["power"][key])


def test_trees_on_unaligned_probes_serve_their_loss_without_the_upward_widening():
    """Trees on the probes learn an unaligned loss their probes measured (align_m/n/k
    are features), as the calibrated prior's offset holds it: their rows at that
    alignment or above keep no upward widening for a loss nobody measured, and stay
    out of the domain (two such probes are no domain of theirs). (The H200's fp32 at
    10 probes, served by trees, kept a 10x upper end on rows 1.1x off.) Probes all
    aligned leave the widening on."""
    prior = ForestModel.fit_table(gemms(A100, 300, 19), CFG)
    test = gemms(H100, 30, 7, odd=True)  # 2 bytes, as the odd probes
    up_by = {}
    for name, probes in (("odd", features.concat([gemms(H100, 8, 5),
                                                  gemms(H100, 2, 6, odd=True)])),
                         ("aligned", gemms(H100, 10, 5))):
        base = TransferModel.fit(prior, probes, CFG, select=False)
        m = copy.copy(base)
        m.few, m.probe_domain, m._flat = _fit_trees(probes, CFG, ["runtime"]), domain_record(
            probes), {}
        m.choice = dict(base.choice, runtime="few")
        r = m.predict_table(test)["runtime"]
        up_by[name] = np.log(r["hi"] / r["point"]) - np.log(r["point"] / r["lo"])
        assert all("aligned to 2 B" in d for d in r["domain"]) and not r["in_domain"].any()
    assert np.allclose(up_by["odd"], 0.0, atol=1e-6)
    assert np.all(up_by["aligned"] > 0.1) and np.median(up_by["aligned"]) > 0.5


def test_served_flags_are_each_targets_own_and_energy_joins_power_and_runtime():
    """served_flags: per target, the calibrated prior's flags where that target's recipe
    is the calibrated prior, the others elsewhere, and that target's quantile; energy
    derived as power x runtime is out of the domain wherever either is, with the larger
    of their quantiles."""
    def flags(inside: list[bool], why: str) -> dict:
        return {"in_domain": np.array(inside), "align": ~np.array(inside),
                "reason": np.array(["" if x else why for x in inside], dtype=object)}

    prior = {"runtime": flags([False, True, True], "r"), "power": flags([True, True, False], "p")}
    other = {"runtime": flags([True, True, True], ""), "power": flags([True, False, True], "q")}
    on_prior = {"runtime": np.array([True, False, False]), "power": np.array([False, True, True])}
    zrows = {"runtime": np.array([2.0, 1.6, 1.6]), "power": np.array([1.7, 1.9, 1.7])}
    out = dict.fromkeys(("runtime", "power", "energy"), (np.zeros(3), np.ones(3)))
    per, z = served_flags(out, on_prior, zrows, prior, other)
    assert per["runtime"]["in_domain"].tolist() == [False, True, True]
    assert per["power"]["in_domain"].tolist() == [True, True, False]
    assert per["energy"]["in_domain"].tolist() == [False, True, False]
    assert per["energy"]["reason"].tolist() == ["r", "", "p"]
    assert z["runtime"].tolist() == [2.0, 1.6, 1.6] and z["power"].tolist() == [1.7, 1.9, 1.7]
    assert z["energy"].tolist() == [2.0, 1.9, 1.7]


def cutlass(odd: int, seed: int = 7, n: int = 6, lo: int = 9, hi: int = 13,
            kernel: str = "cutlass") -> Table:
    """``n`` bf16 GEMMs of ``kernel`` (CUTLASS: one aligned_model never ran) on an H100,
    sizes 2^lo..2^(hi-1), plus ``odd`` (unaligned, SLOWER times slower, the launch aside)."""
    dims = 2 ** np.random.default_rng(seed).integers(lo, hi, size=(n, 3)) + odd
    t = Table.from_rows([{"m": int(a), "n": int(b), "k": int(c), "dtype": "bf16",
                         "kernel": kernel} for a, b, c in dims], [H100] * n)
    t.cols["runtime_s"] = compute_s(t) * (SLOWER if odd else 1.0) + 4e-6
    return t


def test_a_new_kernels_unaligned_probes_leave_their_dtypes_loss_out_of_its_offset(
        aligned_model):
    """Probes of a kernel the prior never ran (CUTLASS here) keep its own offset, as wide
    as such a kernel's; where they are unaligned and the known kernel's unaligned probes
    measured the dtype's loss, that loss is taken off them first: six CUTLASS probes one
    element off the same shapes give about the offset the aligned ones give (before, 1.12
    against 0.31 in log: the loss in the group's offset, so counted twice on its
    unaligned rows and once on its aligned ones). They do not put its aligned rows in
    the calibrated prior's domain (they did: three of them sufficed)."""
    blas = features.concat([gemms(H100, 6, 1), gemms(H100, 6, 2, odd=True)])
    cal = {odd: calibrate(aligned_model, features.concat([blas, cutlass(odd)]))[H100.uuid]
           for odd in (0, 1)}
    offs = {odd: c.groups["runtime"]["bf16/cutlass"] for odd, c in cal.items()}
    assert abs(offs[1] - offs[0]) < 0.3
    assert cal[1].align_offset["runtime"]["bf16"] == pytest.approx(
        cal[0].align_offset["runtime"]["bf16"], abs=0.05)  # the known kernel's alone
    # served: an unaligned CUTLASS row takes its group's offset and the dtype's loss once
    test = cutlass(1)
    base = aligned_model.prior_logs(test)[0]["runtime"][0]
    served = _calibrated_logs(aligned_model, {H100.uuid: cal[1]}, test)["runtime"]
    ref = _calibrated_logs(aligned_model, {H100.uuid: cal[0]}, test)["runtime"]
    assert np.all(np.abs(served - ref) < 0.3) and np.all(served > base)
    assert [c.offset_counts["runtime"]["bf16/cutlass"] for c in cal.values()] == [6, 0]
    # nor where no known kernel's probe measured the loss (their offset holds it then)
    alone = calibrate(aligned_model, features.concat([gemms(H100, 6, 1), cutlass(1)]))
    assert alone[H100.uuid].offset_counts["runtime"] == {"bf16/blas": 6, "bf16/cutlass": 0}
    assert "bf16/cutlass" in cal[1].domain["runtime"]["pairs"]
    assert "bf16/cutlass" not in cal[1].domain["runtime"]["offset_pairs"]
    for odd, c in cal.items():
        r = TransferModel(aligned_model, {H100.uuid: c}).predict_table(cutlass(0))["runtime"]
        assert r["in_domain"].all() == (not odd)
        if odd:
            assert all("too few aligned bf16 cutlass probes" in x for x in r["domain"])


def test_a_new_kernel_probed_unaligned_only_is_served_as_wide_as_an_unseen_one(
        aligned_model):
    """Six unaligned CUTLASS probes and no known kernel's to measure the loss: the
    kernel's offset holds the loss, so its aligned rows came out 2.3x too slow (median),
    in the domain and 63% covered. Now outside it, as uncertain as an unseen kernel's
    offset (1.5 in log), and covered; so are its unaligned rows (83% before), wider than
    they need. Nor do the unaligned probes' sizes count as the aligned probes': blas rows
    32x beyond those in FLOPs are outside the domain."""
    cal = calibrate(aligned_model, features.concat([gemms(H100, 6, 1), cutlass(1)]))
    tm = TransferModel(aligned_model, cal)
    for odd in (0, 1):
        test = cutlass(odd, seed=8, n=60)
        r = tm.predict_table(test)["runtime"]
        y = test["runtime_s"]
        assert not r["in_domain"].any()
        assert np.mean((r["lo"] <= y) & (y <= r["hi"])) >= 0.95
    big = features.concat([gemms(H100, 6, 1), gemms(H100, 6, 2, odd=True),
                           cutlass(1, seed=3, lo=14, hi=16)])
    blas = cutlass(0, seed=5, n=3, lo=14, hi=16, kernel="blas")
    r = TransferModel(aligned_model, calibrate(aligned_model, big)).predict_table(blas)
    assert all("FLOPs 32x beyond the trained range" in x for x in r["runtime"]["domain"])


def test_a_new_kernel_beside_a_loss_of_the_whole_runtime():
    """The known kernel's unaligned probes fit a loss of the whole runtime (a 1 us
    launch: 3x, launch included); a new kernel's compute-bound unaligned probes lose the
    same. The level and its offset are those beside the loss served, not beside the
    work's reading that _align_on_work set aside (a review found the level at -0.70, the
    new kernel's rows 3x too fast)."""
    prior = ForestModel.fit_table(tiny(300, 50), CFG)
    new_odd = tiny(6, 53, odd=True, kernel="cutlass", lo=10, hi=12)
    new_even = tiny(6, 54, kernel="cutlass", lo=10, hi=12)
    cal = calibrate(prior, features.concat([tiny(10, 51), tiny(8, 52, odd=True), new_odd])
                    )[A100.uuid]
    assert not cal.align_on_work["runtime"]["bf16"]
    assert abs(cal.level["runtime"]) < 0.3
    for test in (new_odd, new_even):
        served = _calibrated_logs(prior, {A100.uuid: cal}, test)["runtime"]
        assert abs(np.median(served - np.log(test["runtime_s"]))) < 0.3


def test_launch_bound_unaligned_probes_slow_the_whole_runtime_not_the_work():
    """Two unaligned probes at a work share of 0.03 and 0.05, each twice as slow: read as
    a loss of the work, the dtype's offset were about exp(3) = 20x on a compute-bound
    unaligned row (a fixed cost as much as a loss; nothing tells them apart). With no
    probe at a work share of WORK_IDENTIFIED or more, the loss is the whole runtime's;
    probes doing more work keep the work's."""
    e = np.r_[np.random.default_rng(0).normal(0, 0.05, 4), np.log(2), np.log(2)]
    gi, ai = np.zeros(6, int), np.r_[-1, -1, -1, -1, 0, 0]
    args = (e, gi, 1, 0.1, 0.5, np.array([0.35]))
    whole = _robust_offsets(*args, ai=ai, tau_a=1.0)[2]
    assert 0.5 < whole[0] < np.log(2)
    for shares, on_work in (([0.03, 0.05], False), ([0.3, 0.5], True), ([0.05, 0.3], True)):
        work = np.r_[0.0, 0.0, 0.0, 0.0, shares]
        b, cg, ca, _ = _robust_offsets(*args, ai=ai, tau_a=1.0, work=work)
        assert (ca[0] > 2.5) == (max(shares) < 0.1)  # the launch-bound reading: ~exp(3)
        chose, served, w = _align_on_work(e - b - cg[gi], ai, work, ca, whole)
        assert chose == [on_work]
        assert served[0] == pytest.approx(ca[0] if on_work else whole[0])
        assert w[4:].tolist() == (shares if on_work else [1.0, 1.0])
        assert (max(shares) >= WORK_IDENTIFIED) == on_work


def test_unaligned_probes_do_not_vouch_for_the_aligned_rows(aligned_model):
    """The calibrated prior's level and dtype/kernel offsets come from the aligned probes
    alone: a group is in its domain from MIN_PROBES_IN_DOMAIN aligned probes, whatever
    unaligned ones beside them (before, two aligned and six unaligned marked the group's
    aligned rows in the domain, and its offset's spread took eight probes' evidence)."""
    test = gemms(H100, 50, 62)
    for aligned, inside in ((2, False), (3, True)):
        probes = features.concat([gemms(H100, aligned, 60), gemms(H100, 6, 61, odd=True)])
        tm = TransferModel.fit(aligned_model, probes, CFG, select=False)
        cal = tm.calibrations[H100.uuid]
        assert cal.counts["runtime"]["bf16/blas"] == aligned + 6
        assert cal.offset_counts["runtime"]["bf16/blas"] == aligned
        r = tm.predict_table(test)["runtime"]
        assert bool(r["in_domain"].all()) == inside
        assert inside or all(x == "too few aligned bf16 blas probes on this GPU"
                             for x in r["domain"])
        # the trees on the probes, which learn from all of them, cover the group
        assert "bf16/blas" in cal.domain["runtime"]["pairs"]
        # the level's precision is its aligned shapes' (here distinct); its pseudo-count
        # is chosen for all the probes' shapes (_unknown_priors)
        tau_b, s0 = _unknown_priors(aligned_model, "runtime", aligned + 6)
        assert cal.precision["runtime"] == pytest.approx(aligned + s0**2 / tau_b**2)
        # the group's offset has no aligned probe's evidence where it has none
        if aligned == 2:
            s2, tau = cal.sd["runtime"] ** 2, cal.group_sd["runtime"]["bf16/blas"]
            assert cal.variance("runtime", "bf16/blas") == pytest.approx(
                (s2 * (1 + 1 / cal.precision["runtime"]) + s2 / (2 + s2 / tau**2)) *
                cal.scale["runtime"] ** 2)
    # nor do their sizes: aligned rows as large as the unaligned probes alone are beyond
    # what the calibrated prior's offsets were measured on
    def at(m: int, odd: bool, dtype: str = "bf16") -> Table:
        t = Table.from_rows([{"m": m, "n": m, "k": m, "dtype": dtype}], [H100])
        t.cols["runtime_s"] = compute_s(t) * (SLOWER if odd else 1.0) + 4e-6
        return t

    small = [at(m, False) for m in (256, 512, 1024)]
    big = features.concat([at(2**15 + 1, True) for _ in range(6)])
    for probes in (small + [big], [big]):  # (with no aligned probe: the prior's sizes)
        tm = TransferModel.fit(aligned_model, features.concat(probes), CFG, select=False)
        r = tm.predict_table(at(2**15, False))["runtime"]
        assert not r["in_domain"][0] and "beyond the trained range" in r["domain"][0]


def test_the_level_counts_the_aligned_probes_alone(aligned_model):
    """An fp32 probe and a bf16 one of the same shape, 4 bytes off a multiple of 8
    elements: aligned to 16 bytes in fp32, to 8 in bf16. The level is the fp32 probes':
    as if the bf16 ones were not there, each of the three shapes one whole piece of
    evidence (before, the unaligned bf16 probe halved its aligned twin's weight)."""
    rows = [{"m": m, "n": m, "k": m, "dtype": dt} for m in (1028, 2052, 4100)
            for dt in ("fp32", "bf16")]
    t = Table.from_rows(rows, [H100] * len(rows))
    t.cols["runtime_s"] = features.roofline(t) / 0.3 * np.where(t["dtype"] == "bf16", SLOWER,
                                                                1.0)
    both = calibrate(aligned_model, t)[H100.uuid]
    alone = calibrate(aligned_model, t.take(np.flatnonzero(t["dtype"] == "fp32")))[H100.uuid]
    assert both.align_offset["runtime"]["bf16"] > 0.5
    assert both.level["runtime"] == pytest.approx(alone.level["runtime"], abs=1e-3)
    assert both.precision["runtime"] == pytest.approx(alone.precision["runtime"])
    tau_b, s0 = _unknown_priors(aligned_model, "runtime", 3)
    assert alone.precision["runtime"] == pytest.approx(3 + s0**2 / tau_b**2)


def test_derived_energy_is_slowed_as_the_runtime_is():
    """Energy as power x runtime: its upward widening follows the runtime's domain (here
    trained unaligned), not power's (aligned only): no more than power's own."""
    t = features.concat([gemms(A100, 300, 19), gemms(A100, 60, 20, odd=True)])
    aligned = align_log2(t) >= 4
    t.cols["power_w"] = np.where(aligned, 300.0, np.nan) * np.exp(
        np.random.default_rng(4).normal(0, 0.02, len(t)))
    model = ForestModel.fit_table(t, CFG)
    assert model.meta.get("derived", {}).get("energy")
    res = model.predict_table(gemms(A100, 50, 21, odd=True))
    assert res["runtime"]["in_domain"].all() and not res["power"]["in_domain"].any()
    e = res["energy"]
    assert not e["in_domain"].any() and list(e["domain"]) == list(res["power"]["domain"])
    up, down = np.log(e["hi"] / e["point"]), np.log(e["point"] / e["lo"])
    assert np.allclose(up, down, rtol=1e-6)


def test_energy_is_in_the_domain_only_where_power_and_runtime_both_are():
    """Energy as power x runtime: a new GPU's 2 aligned and 6 unaligned probes, all with
    power, put its aligned rows' power in the calibrated prior's domain but not their
    runtime (too few aligned probes): their energy is out of it, with the runtime's
    reason (before, energy took power's flags alone and claimed the domain)."""
    t = gemms(A100, 300, 19)
    t.cols["power_w"] = 300.0 * np.exp(np.random.default_rng(4).normal(0, 0.02, len(t)))
    prior = ForestModel.fit_table(t, CFG)
    probes = features.concat([gemms(H100, 2, 5), gemms(H100, 6, 6, odd=True)])
    probes.cols["power_w"] = np.full(len(probes), 500.0)
    res = TransferModel.fit(prior, probes, CFG, select=False).predict_table(gemms(H100, 5, 7))
    assert res["power"]["in_domain"].all() and not res["runtime"]["in_domain"].any()
    assert not res["energy"]["in_domain"].any()
    assert set(res["energy"]["domain"]) == {"too few aligned bf16 blas probes on this GPU"}


def test_probes_of_unaligned_shapes_bring_them_into_the_domain(aligned_model):
    """A new GPU's probes at odd sizes: those sizes are in its domain after calibration;
    with probes at aligned sizes alone they are not."""
    odd = gemms(H100, 120, 5, odd=True)
    aligned = gemms(H100, 40, 6)
    with_odd = TransferModel.fit(aligned_model, odd.take(np.arange(40)), CFG)
    assert with_odd.choice["runtime"] != "calibrated"  # trees on the probes
    res = with_odd.predict_table(odd.take(np.arange(40, 120)))["runtime"]
    assert not any("aligned to" in r for r in res["domain"])
    up, down = np.log(res["hi"] / res["point"]), np.log(res["point"] / res["lo"])
    assert np.allclose(up, down, rtol=1e-6)  # no upward widening left
    # uncalibrated, a GPU model never trained on: any GPU's rows of the dtype decide
    alone = aligned_model.predict_table(odd)["runtime"]["domain"]
    assert all(r.startswith("no data on") and r.endswith(
        "; M, N, K aligned to 2 B, trained on >= 16 B") for r in alone)
    without = TransferModel.fit(aligned_model, aligned, CFG)
    res = without.predict_table(odd.take(np.arange(40, 120)))["runtime"]
    assert all("M, N, K aligned to 2 B, trained on >= 16 B" in r for r in res["domain"])
    y = odd["runtime_s"][40:]
    assert np.mean((res["lo"] <= y) & (y <= res["hi"])) >= 0.85


def test_a_record_saved_without_alignment_knows_every_alignment(aligned_model):
    rec = copy.deepcopy(aligned_model.meta["domain"])
    assert rec["align"] == {"bf16": 4.0} and rec["gpus"]["a100-sxm-80gb"]["align"]
    odd = gemms(A100, 20, 7, odd=True)
    assert domain_flags(rec, odd)["align"].all()
    rec.pop("align")
    for g in rec["gpus"].values():
        g.pop("align")
    flags = domain_flags(rec, odd)
    assert not flags["align"].any() and not any("aligned" in r for r in flags["reason"])


def test_the_bench_measures_the_upward_spread_unaligned_shapes_need():
    """bench/transfer.py --align: a GPU's unaligned rows left out of a prior of all,
    judged on them, with the spread their intervals' upper ends need: for GEMMs SLOWER
    times slower to compute, about log(SLOWER) over the interval's z, inside the
    default; a GPU with no unaligned rows is not judged."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    import transfer

    a100 = features.concat([gemms(A100, 300, 8), gemms(A100, 120, 9, odd=True)])
    res = transfer.unaligned({"a100": a100, "h100": gemms(H100, 300, 10)}, CFG)
    assert [r["gpu"] for r in res] == ["a100"] and res[0]["n"] == 120
    assert res[0]["after"] >= 0.85 and res[0]["in_domain"] == 0.0
    rows, need = res[0]["need"]["1e+08"]
    assert rows >= 20 and 0.4 < need < OOD_SD["runtime"]["align"]
