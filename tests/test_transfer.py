"""Honest intervals in and off the training domain, and carrying a model to a new GPU
(issue 14), on synthetic GPUs whose efficiency depends on size and differs per GPU."""

from __future__ import annotations

import numpy as np
import pytest

from gemmd import datasets, features
from gemmd.config import ModelConfig
from gemmd.features import Table
from gemmd.gemm import ProbeSpec
from gemmd.model import (
    CHOICES,
    LAUNCH_S,
    MODEL_FORMAT,
    ForestModel,
    RooflinePredictor,
    TransferModel,
    _select,
    calibrate,
)

A100 = datasets.KNOWN_GPUS["a100-sxm-80gb"]
H100 = datasets.KNOWN_GPUS["h100-sxm"]
CFG = ModelConfig(min_samples=2, n_estimators=30)


def rows(info, n: int, seed: int, level: float, dtypes=("bf16",), noise: float = 0.03,
         kernel: str = "blas") -> Table:
    """GEMMs at an efficiency that grows with size (the same shape on every GPU) times a
    per-GPU level, plus a launch cost and lognormal noise."""
    rng = np.random.default_rng(seed)
    recs = [{"m": int(2 ** rng.integers(8, 14)), "n": int(2 ** rng.integers(8, 14)),
             "k": int(2 ** rng.integers(8, 14)), "dtype": str(rng.choice(dtypes)),
             "kernel": kernel, "tile": 16 if kernel == "tiled" else 0} for _ in range(n)]
    t = Table.from_rows(recs, [info] * n)
    f = features.flops(t)
    eff = level * (0.9 * (1 - np.exp(-f / 2**32)) + 0.05)
    t.cols["runtime_s"] = (features.roofline(t) / eff + 4e-6) * np.exp(
        rng.normal(0, noise, n))
    return t


def coverage(res: dict, t: Table) -> float:
    y = t["runtime_s"]
    return float(np.mean((res["runtime"]["lo"] <= y) & (y <= res["runtime"]["hi"])))


def mape(res: dict, t: Table) -> float:
    return float(np.mean(np.abs(res["runtime"]["point"] - t["runtime_s"]) / t["runtime_s"]))


@pytest.fixture(scope="module")
def prior():
    return ForestModel.fit_table(rows(A100, 400, 0, 0.8, ("bf16", "fp16")), CFG)


def test_in_domain_intervals_hold_their_nominal_coverage(prior):
    assert MODEL_FORMAT >= 3 and prior.meta["interval_scale"]["runtime"] > 0
    test = rows(A100, 400, 1, 0.8, ("bf16", "fp16"))
    res = prior.predict_table(test)
    assert res["runtime"]["in_domain"].all() and not any(res["runtime"]["domain"])
    assert 0.8 <= coverage(res, test) <= 0.98


def test_an_unknown_gpu_is_marked_and_its_interval_widened(prior):
    test = rows(H100, 300, 2, 0.45, ("bf16", "fp16"))
    res = prior.predict_table(test)["runtime"]
    assert not res["in_domain"].any()
    assert set(res["domain"]) == {"no data on NVIDIA H100 80GB HBM3"}
    own = prior.predict_table(rows(A100, 300, 2, 0.8, ("bf16", "fp16")))["runtime"]
    assert np.median(res["sigma"]) > 3 * np.median(own["sigma"])
    assert coverage({"runtime": res}, test) >= 0.7  # 0.74 here; 87-100% on the shared data
    # the level of an unknown GPU is the roofline estimate's, not the A100's
    roof = RooflinePredictor(CFG.roofline_efficiency)
    r = np.array([p.runtime_s for p in roof.predict(
        [ProbeSpec(int(a), int(b), int(c), str(d)) for a, b, c, d in
         zip(test["m"], test["n"], test["k"], test["dtype"])], [H100] * len(test))])
    assert mape({"runtime": res}, test) < np.mean(np.abs(r - test["runtime_s"]) /
                                                  test["runtime_s"])
    (p,) = prior.predict([ProbeSpec(4096, 4096, 4096, "bf16")], [H100])
    assert p.in_domain is False and "H100" in p.domain
    (q,) = prior.predict([ProbeSpec(4096, 4096, 4096, "bf16")], [A100])
    assert q.in_domain is True and q.domain == ""


def test_dtype_kernel_and_size_outside_the_domain(prior):
    t = Table.from_rows([
        {"m": 1024, "n": 1024, "k": 1024, "dtype": "tf32"},
        {"m": 1024, "n": 1024, "k": 1024, "dtype": "bf16", "kernel": "tiled", "tile": 16},
        {"m": 1 << 20, "n": 1 << 20, "k": 1 << 16, "dtype": "bf16"},
        {"m": 2048, "n": 2048, "k": 2048, "dtype": "bf16"}], [A100] * 4)
    res = prior.predict_table(t)["runtime"]
    assert res["in_domain"].tolist() == [False, False, False, True]
    assert "no tf32 blas data on this GPU" in res["domain"][0]
    assert "no tiled kernel data" in res["domain"][1]
    assert "beyond the trained range" in res["domain"][2]
    # a kernel the forest never saw: the roofline estimate, not an extrapolation
    roof = features.roofline(t.take([1]))[0] / CFG.roofline_efficiency + LAUNCH_S  # tiled
    assert res["point"][1] == pytest.approx(roof)
    width = np.log(res["hi"] / res["lo"])
    assert width[1] > width[0] > width[3] and width[2] > width[3]


def test_a_few_probes_calibrate_a_new_gpu(prior):
    test = rows(H100, 300, 3, 0.45)
    probes = rows(H100, 5, 4, 0.45)
    before = mape(prior.predict_table(test), test)
    tm = TransferModel.fit(prior, probes, CFG)
    res = tm.predict_table(test)
    assert mape(res, test) < 0.5 * before
    assert mape(res, test) < 0.25
    assert res["runtime"]["in_domain"].all()  # 5 bf16 probes: bf16 on this GPU is known
    assert coverage(res, test) >= 0.8
    other = tm.predict_table(rows(H100, 50, 5, 0.45, ("fp16",)))["runtime"]
    assert not other["in_domain"].any()
    assert set(other["domain"]) == {"no fp16 blas data on this GPU"}
    (p,) = tm.predict([ProbeSpec(4096, 4096, 4096, "bf16")], [H100])
    assert p.in_domain and p.runtime_lo < p.runtime_s < p.runtime_hi
    # other cards of the same GPU model share the calibration
    twin = type(H100)(**{**H100.__dict__, "uuid": "GPU-twin"})
    assert tm.predict_table(Table.from_rows([{"m": 512, "n": 512, "k": 512, "dtype": "bf16"}],
                                            [twin]))["runtime"]["in_domain"][0]


def test_one_wild_probe_does_not_move_a_calibration(prior):
    probes = rows(H100, 6, 6, 0.45)
    base = calibrate(prior, probes)[H100.uuid].level["runtime"]
    probes.cols["runtime_s"][0] *= 30  # a throttled or launch-bound outlier
    wild = calibrate(prior, probes)[H100.uuid].level["runtime"]
    assert abs(wild - base) < 0.15


def test_with_many_probes_the_better_recipe_is_chosen(prior):
    probes = rows(H100, 80, 7, 0.45)
    test = rows(H100, 300, 8, 0.45)
    tm = TransferModel.fit(prior, probes, CFG)
    assert set(tm.choice) >= {"runtime"}
    assert tm.choice["runtime"] in CHOICES
    own = ForestModel.fit_table(probes, CFG)
    assert mape(tm.predict_table(test), test) <= 1.25 * mape(own.predict_table(test), test)
    cv = tm.meta["transfer"]["cv"]["runtime"]
    assert set(cv) == {"calibrated", "residual", "own", "few"} == set(CHOICES)
    assert coverage(tm.predict_table(test), test) >= 0.75


def test_no_probes_yet_and_a_saved_model_keeps_its_domain(prior, tmp_path):
    empty = rows(H100, 3, 9, 0.45).take(np.zeros(0, dtype=np.int64))
    tm = TransferModel.fit(prior, empty, CFG)
    (p,) = tm.predict([ProbeSpec(2048, 2048, 2048, "bf16")], [H100])
    (q,) = prior.predict([ProbeSpec(2048, 2048, 2048, "bf16")], [H100])
    assert p.runtime_s == pytest.approx(q.runtime_s) and not p.in_domain
    assert [d.uuid for d in tm.device_infos()] == [A100.uuid]
    prior.save(tmp_path / "m.skops")
    again = ForestModel.load(tmp_path / "m.skops")
    t = rows(A100, 20, 10, 0.8).take(np.arange(20))
    a, b = prior.predict_table(t)["runtime"], again.predict_table(t)["runtime"]
    assert (a["in_domain"] == b["in_domain"]).all() and np.allclose(a["hi"], b["hi"])


def test_a_correct_prior_is_kept_and_beats_the_probes_alone(prior):
    """A card of the prior's GPU model running at 3/4 of its speed (a known scale): the
    prior's shape is right, cross-validation keeps it, and with a few probes it is never
    worse on held-out GEMMs than a forest on the probes alone (3-4% here against 7-28%)."""
    capped = type(A100)(**{**A100.__dict__, "uuid": "GPU-capped"})
    test = rows(capped, 300, 11, 0.6, ("bf16", "fp16"))
    for n, seed in ((5, 12), (12, 13), (20, 14)):
        probes = rows(capped, n, seed, 0.6, ("bf16", "fp16"))
        tm = TransferModel.fit(prior, probes, CFG)
        assert tm.choice["runtime"] in ("calibrated", "residual")
        own = ForestModel.fit_table(probes, CFG)
        assert mape(tm.predict_table(test), test) <= mape(own.predict_table(test), test)
        assert mape(tm.predict_table(test), test) < 0.06
        assert coverage(tm.predict_table(test), test) >= 0.85


def test_a_misleading_prior_gives_way_to_the_device_own_probes(prior):
    """A device whose efficiency falls with size where the prior's rises: the prior's
    shape is wrong whatever its level, and the device's own probes decide."""
    def inverted(n: int, seed: int) -> Table:
        t = rows(H100, n, seed, 0.45)
        f = features.flops(t)
        eff = 0.45 * (0.9 * np.exp(-f / 2**36) + 0.05)
        t.cols["runtime_s"] = features.roofline(t) / eff * np.exp(
            np.random.default_rng(seed).normal(0, 0.03, n))
        return t

    test, probes = inverted(300, 15), inverted(30, 16)
    tm = TransferModel.fit(prior, probes, CFG)
    assert tm.choice["runtime"] in ("few", "own")
    own = ForestModel.fit_table(probes, CFG)
    assert mape(tm.predict_table(test), test) <= mape(own.predict_table(test), test)
    cal = TransferModel.fit(prior, probes, CFG, select=False)
    assert mape(tm.predict_table(test), test) < mape(cal.predict_table(test), test)
    assert coverage(tm.predict_table(test), test) >= 0.75


def test_the_default_recipe_is_replaced_only_by_a_clear_win():
    rng = np.random.default_rng(0)
    few = np.abs(rng.normal(0.2, 0.05, 20))
    # better on average but within the noise of 20 probes: the default stays
    noisy = few + rng.normal(-0.01, 0.2, 20)
    assert _select({"few": few, "calibrated": np.abs(noisy)}) == "few"
    # better on every probe: replaced, by the best of the clear winners
    assert _select({"few": few, "calibrated": few * 0.5, "own": few * 0.8}) == "calibrated"
    # probes a recipe could not predict (NaN) are left out of the paired difference
    own = few * 0.5
    own[:3] = np.nan
    assert _select({"few": few, "own": own}) == "own"
    # on too few probes (override=False) the default stays whatever the errors say
    assert _select({"few": few, "calibrated": few * 0.5}, override=False) == "few"
    # a prior that knows the GPU model is the default
    assert _select({"few": np.abs(noisy), "calibrated": few}, "calibrated") == "calibrated"
    assert _select({"few": few * 0.5, "calibrated": few}, "calibrated") == "few"
    # without the default, the calibrated prior is the default
    assert _select({"calibrated": few, "residual": few * 1.1}) == "calibrated"
    assert _select({"own": few, "residual": few * 0.9}) == "residual"


def test_a_dtype_without_probes_is_predicted_by_the_calibrated_prior(prior):
    probes = rows(H100, 30, 17, 0.45, ("bf16",))
    tm = TransferModel.fit(prior, probes, CFG)
    cal = TransferModel.fit(prior, probes, CFG, select=False)
    fp16 = rows(H100, 40, 18, 0.45, ("fp16",))
    a, b = tm.predict_table(fp16)["runtime"], cal.predict_table(fp16)["runtime"]
    assert np.allclose(a["point"], b["point"])
    assert not a["in_domain"].any()
