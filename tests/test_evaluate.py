"""Splits, metrics, the noise floor and GPPerf's baseline, on small synthetic tables."""

from __future__ import annotations

import numpy as np
import pytest

from gemmd import datasets, evaluate
from gemmd.config import ModelConfig
from gemmd.errors import InputError
from gemmd.features import Table

RTX = datasets.KNOWN_GPUS["rtx4070"]
DATA = datasets.shared_data_dir()


def synthetic(n_shapes: int = 24, repeats: int = 3, noise: float = 0.02, seed: int = 0) -> Table:
    """fp32 GEMMs at 60% of the RTX 4070's roofline, lognormal noise, repeats per shape."""
    rng = np.random.default_rng(seed)
    sizes = (256, 384, 512, 768, 1024, 1536, 2048, 3072)
    shapes = {tuple(int(x) for x in rng.choice(sizes, 3)) for _ in range(n_shapes * 3)}
    rows = []
    for m, n, k in sorted(shapes)[:n_shapes]:
        for _ in range(repeats):
            t = max(2 * m * n * k / 29.1e12, 4 * (m * k + k * n + m * n) / 504e9) / 0.6
            rows.append({"m": m, "n": n, "k": k, "dtype": "fp32",
                         "runtime_s": t * float(np.exp(rng.normal(0, noise))),
                         "power_w": 120.0 * float(np.exp(rng.normal(0, noise)))})
    return Table.from_rows(rows, [RTX] * len(rows))


def test_random_split_is_gpperfs():
    train, test = evaluate.random_split(1000)
    assert len(test) == 200 and len(train) == 800
    assert not set(train) & set(test)
    again = evaluate.random_split(1000)
    assert (again[1] == test).all()  # seed 42: the same split every run


def test_shape_split_keeps_shapes_apart():
    t = synthetic()
    train, test = evaluate.shape_split(t)
    key = lambda i: (t["m"][i], t["n"][i], t["k"][i])  # noqa: E731
    assert {key(i) for i in train}.isdisjoint({key(i) for i in test})
    assert 0.1 < len(test) / len(t) < 0.35


def test_metrics():
    m = evaluate.metrics(np.array([1.0, 2.0, 4.0, np.nan]), np.array([1.1, 2.0, 3.0, 5.0]))
    assert m["n"] == 3
    assert m["mape"] == pytest.approx((0.1 + 0 + 0.25) / 3)
    assert m["median_ape"] == pytest.approx(0.1)
    assert m["r2"] == pytest.approx(1 - (0.01 + 0 + 1) / np.var([1, 2, 4]) / 3)


def test_noise_floor_from_repeats():
    t = synthetic(n_shapes=40, repeats=4, noise=0.05)
    nf = evaluate.noise_floor(t)
    assert nf["runtime"]["configs"] == 40 and nf["runtime"]["rows"] == 160
    assert 0.03 < nf["runtime"]["median_cv"] < 0.07
    assert nf["energy"] is None  # never measured
    single = evaluate.noise_floor(synthetic(repeats=1))
    assert single["runtime"] is None


def test_gpperf_features_are_the_published_ones():
    t = Table.from_rows([{"m": 512, "n": 1024, "k": 256, "dtype": "fp32", "kernel": "cutlass",
                          "cta_m": 128, "cta_n": 64, "cta_k": 32, "runtime_s": 1.0}], [RTX])
    x = evaluate.GPPerfBaseline.features(t)[0]
    by = 4 * (512 * 256 + 256 * 1024 + 512 * 1024)
    assert x.tolist() == [512, 1024, 256, 128, 64, 32, 2 * 512 * 1024 * 256 / by, by,
                          2 * 512 * 1024 * 256]


def test_evaluate_side_by_side_on_the_same_splits():
    t = synthetic(n_shapes=30, repeats=2)
    res = evaluate.evaluate(t, cfg=ModelConfig(min_samples=2, n_estimators=20))
    assert set(res["splits"]) == {"random", "shape"}
    for sp in res["splits"].values():
        g, b = sp["gemmd"]["targets"]["runtime"], sp["gpperf"]["targets"]["runtime"]
        assert g["n"] == b["n"] == sp["test_rows"]
        assert "coverage" in g and "coverage" not in b
    shape = res["splits"]["shape"]
    # Efficiency relative to the roofline carries to unseen shapes; raw seconds do not.
    assert shape["gemmd"]["targets"]["runtime"]["mape"] < \
        shape["gpperf"]["targets"]["runtime"]["mape"]
    assert res["noise_floor"]["runtime"]["configs"] == 30


@pytest.mark.skipif(DATA is None, reason="shared datasets (../shared/data) absent")
def test_gemmd_beats_gpperf_on_its_own_cutlass_data():
    t = datasets.load_shared("gpperf-cutlass", DATA).table
    res = evaluate.evaluate(t, splits=("random",), cfg=ModelConfig(min_samples=2,
                                                                   n_estimators=30))
    r = res["splits"]["random"]
    assert r["gemmd"]["targets"]["runtime"]["mape"] < 0.5 * \
        r["gpperf"]["targets"]["runtime"]["mape"]


# ------------------------------------------------------------------ a fitted model (issue 25)


def test_calibration_split_keeps_shapes_apart_and_draws_one_row_per_shape():
    t = synthetic(n_shapes=24, repeats=3)
    key = lambda i: (t["m"][i], t["n"][i], t["k"][i])  # noqa: E731
    for rows in (0, 1, 5, 18, 30):
        cal, test = evaluate.calibration_split(t, rows, seed=3)
        assert len(cal) == rows and len(test) > 0
        assert {key(i) for i in cal}.isdisjoint({key(i) for i in test})
        shapes = [key(i) for i in cal]
        if rows <= 18:  # one row per shape while at most 75% of the shapes are drawn
            assert len(set(shapes)) == rows
        else:  # then a second row of each
            assert len(set(shapes)) == 18
    again = evaluate.calibration_split(t, 5, seed=3)
    assert (again[0] == evaluate.calibration_split(t, 5, seed=3)[0]).all()
    assert not (again[0] == evaluate.calibration_split(t, 5, seed=4)[0]).all()
    with pytest.raises(InputError, match="too many for the data"):
        evaluate.calibration_split(t, 60, seed=0)


def test_evaluate_model_judges_without_refitting():
    from gemmd.model import ForestModel

    t = synthetic(n_shapes=30, repeats=2)
    model = ForestModel.fit_table(t, ModelConfig(min_samples=2, n_estimators=20))
    l4 = datasets.KNOWN_GPUS["l4"]
    other = synthetic(n_shapes=30, repeats=2, seed=5)
    other = Table(other.cols, [l4], other.device)
    res = evaluate.evaluate_model(model, other, cfg=ModelConfig(min_samples=2,
                                                                n_estimators=20),
                                  calibrate_rows=[0, 5], seeds=2, calibrate=other.take(
                                      np.arange(6)))
    assert list(res["splits"]) == ["model", "calibrated on 6 rows", "0 rows", "5 rows"]
    model_fig = res["splits"]["model"]["gemmd"]["targets"]["runtime"]
    assert model_fig["in_domain"] == 0.0 and {"mape", "median_ape", "p90_ape",
                                               "coverage"} <= set(model_fig)
    assert res["splits"]["0 rows"]["gemmd"]["targets"]["runtime"]["mape"] == \
        pytest.approx(model_fig["mape"])
    five = res["splits"]["5 rows"]
    assert five["calibration_rows"] == 5 and five["test_rows"] < len(other)
    assert five["gemmd"]["targets"]["runtime"]["in_domain"] > 0  # fp32/blas: 5 probes
    assert set(five["gemmd"]["spread"]["runtime"]) == {"mape", "coverage"}
    assert "spread" not in res["splits"]["0 rows"]["gemmd"]  # the same model, rows, twice


def test_the_spread_over_draws_is_their_standard_deviation():
    """evaluate_model's "spread": per target, the sample sd over the draws of MAPE and
    coverage; none from one draw, nor for a target a draw could not judge (n 0)."""
    runs = [{"runtime": {"n": 10, "mape": 0.1, "coverage": 0.8}, "power": {"n": 0}},
            {"runtime": {"n": 12, "mape": 0.3, "coverage": 1.0}, "power": {"n": 0}},
            {"runtime": {"n": 11, "mape": 0.2}}]
    sd = evaluate._spread_scores(runs)
    assert sd == {"runtime": {"mape": pytest.approx(0.1), "coverage": pytest.approx(
        np.std([0.8, 1.0], ddof=1))}}
    assert evaluate._spread_scores(runs[:1]) == {}
