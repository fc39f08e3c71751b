"""Shapes aligned below anything trained on: outside the domain, their runtime interval
widened upward only (gemmd.model.domain: ALIGN_BYTES, align_widening)."""

from __future__ import annotations

import copy

import numpy as np
import pytest

from gemmd import datasets, features
from gemmd.config import ModelConfig
from gemmd.features import Table
from gemmd.model import ForestModel, TransferModel
from gemmd.model.domain import OOD_SD, align_log2, domain_flags

A100 = datasets.KNOWN_GPUS["a100-sxm-80gb"]
H100 = datasets.KNOWN_GPUS["h100-sxm"]
CFG = ModelConfig(min_samples=2, n_estimators=30)
SLOWER = 3.0  # an unaligned GEMM's compute, as on the H200 (bench/RESULTS.md, 2026-11-27)


def gemms(info, n: int, seed: int, dtype: str = "bf16", odd: bool = False,
          slower: float = SLOWER) -> Table:
    """GEMMs at an efficiency that grows with size plus a launch cost; ``odd``: each of
    M, N, K nudged off its power of two by an odd amount, the compute ``slower`` times
    slower (a launch-bound GEMM loses little)."""
    rng = np.random.default_rng(seed)
    dims = 2 ** rng.integers(8, 13 if odd else 14, size=(n, 3))  # odd: inside the sizes
    if odd:
        dims = dims + 2 * rng.integers(0, 20, size=(n, 3)) + 1
    t = Table.from_rows([{"m": int(m), "n": int(nn), "k": int(k), "dtype": dtype}
                         for m, nn, k in dims], [info] * n)
    eff = 0.8 * (0.9 * (1 - np.exp(-features.flops(t) / 2**32)) + 0.05)
    compute = features.roofline(t) / eff * (slower if odd else 1.0)
    t.cols["runtime_s"] = (compute + 4e-6) * np.exp(rng.normal(0, 0.03, n))
    return t


@pytest.fixture(scope="module")
def aligned_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("align") / "m.skops"
    ForestModel.fit_table(gemms(A100, 400, 0), CFG).save(path)
    return ForestModel.load(path)  # the record as a saved model keeps it


def test_alignment_counts_bytes_up_to_a_16_byte_vector():
    t = Table.from_rows([{"m": 4096, "n": 4096, "k": 4096, "dtype": "bf16"},
                         {"m": 4104, "n": 4096, "k": 4096, "dtype": "bf16"},  # 8 x 2 B
                         {"m": 4100, "n": 4096, "k": 4096, "dtype": "bf16"},  # 4 x 2 B
                         {"m": 4096, "n": 4096, "k": 4097, "dtype": "bf16"},
                         {"m": 4100, "n": 4096, "k": 4096, "dtype": "fp32"},  # 4 x 4 B
                         {"m": 4097, "n": 4096, "k": 4096, "dtype": "fp32"},
                         {"m": 4104, "n": 4096, "k": 4096, "dtype": "fp8"}],  # 8 x 1 B
                        [A100] * 7)
    assert (2 ** align_log2(t)).tolist() == [16, 16, 8, 2, 16, 4, 8]


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
    rounded = copy.deepcopy(odd)
    for c in ("m", "n", "k"):
        rounded.cols[c] = (odd[c] // 8) * 8
    inside = aligned_model.predict_table(rounded)["runtime"]
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
    validation holds them out and measures the upward spread they need (here 8x slower:
    more than the default allows), which then widens another GPU's unaligned shapes that
    its own data never had; without such data the default stays."""
    slow = 8.0
    fleet = features.concat([gemms(A100, 300, 11), gemms(A100, 150, 12, odd=True, slower=slow),
                             gemms(H100, 300, 13)])
    model = ForestModel.fit_table(fleet, CFG)
    measured = model.meta["ood_sd"]["runtime"]["align"]
    assert model.meta["ood_sd"]["energy"]["align"] == measured
    assert OOD_SD["runtime"]["align"] < np.log(slow) / 1.645 * 0.9 < measured < 2.0
    odd = gemms(H100, 200, 14, odd=True, slower=slow)
    res = model.predict_table(odd)["runtime"]
    y = odd["runtime_s"]
    assert all("aligned to 2 B" in r for r in res["domain"])
    assert np.mean((res["lo"] <= y) & (y <= res["hi"])) >= 0.85
    default = ForestModel.fit_table(gemms(A100, 300, 11), CFG)
    assert "align" not in default.meta.get("ood_sd", {}).get("runtime", {})


def test_power_outside_the_alignment_is_widened_both_ways(aligned_model):
    t = gemms(A100, 200, 3)
    t.cols["power_w"] = np.full(len(t), 300.0)
    model = ForestModel.fit_table(t, CFG)
    odd = gemms(A100, 50, 4, odd=True)
    p = model.predict_table(odd)["power"]
    assert not p["in_domain"].any()
    up, down = np.log(p["hi"] / p["point"]), np.log(p["point"] / p["lo"])
    assert np.allclose(up, down, rtol=1e-6) and OOD_SD["power"]["align"] > 0


def test_probes_of_unaligned_shapes_bring_them_into_the_domain(aligned_model):
    """A new GPU's probes at odd sizes: those sizes are in its domain after calibration;
    with probes at aligned sizes alone they are not."""
    odd = gemms(H100, 120, 5, odd=True)
    aligned = gemms(H100, 40, 6)
    with_odd = TransferModel.fit(aligned_model, odd.take(np.arange(40)), CFG)
    res = with_odd.predict_table(odd.take(np.arange(40, 120)))["runtime"]
    assert not any("aligned to" in r for r in res["domain"])
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
