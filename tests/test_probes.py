"""Probe specs, plans and the measurement protocol (gemmd/probes.py); no real device."""

import dataclasses
import math
import threading

import numpy as np
import pytest

from gemmd.config import ExplorationConfig, FakeDeviceConfig, MeasureConfig, ProbeGroup
from gemmd.devices.base import energy_figures, iteration_stats, iterations_for_window, measure
from gemmd.devices.check import check_result, check_tolerance
from gemmd.devices.fake import MODELS, FakeDevice
from gemmd.errors import DeviceError, ProbeCancelled, UnsupportedProbe
from gemmd.gemm import ProbeSpec
from gemmd.probes import build_plan, exploration_specs

# ------------------------------------------------------------------ ProbeSpec


def test_spec_fp32_figures():
    s = ProbeSpec(1024, 2048, 512, "fp32")
    assert s.flops == 2 * 1024 * 2048 * 512
    assert s.bytes == 4 * (1024 * 512 + 512 * 2048) + 4 * 1024 * 2048
    assert s.intensity == pytest.approx(s.flops / s.bytes)
    assert s.name == "blas-fp32-nn-1024x2048x512"


def test_spec_fp8_output_counts_two_bytes():
    s = ProbeSpec(64, 32, 16, "fp8")
    assert s.bytes == 1 * (64 * 16 + 16 * 32) + 2 * 64 * 32


@pytest.mark.parametrize("dtype, width", [("fp64", 8), ("bf16", 2), ("fp16", 2), ("tf32", 4)])
def test_spec_bytes_per_dtype(dtype, width):
    s = ProbeSpec(10, 20, 30, dtype)
    assert s.bytes == width * (10 * 30 + 30 * 20 + 10 * 20)


def test_spec_intensity_grows_with_size():
    assert ProbeSpec(4096, 4096, 4096).intensity > ProbeSpec(256, 256, 256).intensity


def test_spec_name_and_labels_tiled():
    s = ProbeSpec(1024, 1024, 1024, "fp32", "tiled", 16, "nn")
    assert s.name == "tiled16-fp32-nn-1024x1024x1024"
    assert s.labels() == {"probe": s.name, "m": "1024", "n": "1024", "k": "1024",
                          "dtype": "fp32", "kernel": "tiled", "tile": "16", "layout": "nn"}


# ------------------------------------------------------------------ pure helpers


def test_iterations_for_window_bounds():
    assert iterations_for_window(0.01, 1.0, 3, 1000) == 100
    assert iterations_for_window(0.003, 1.0, 3, 1000) == 334  # ceil
    assert iterations_for_window(2.0, 1.0, 3, 1000) == 3  # slow: min_iters
    assert iterations_for_window(1e-9, 1.0, 3, 1000) == 1000  # fast: max_iters
    assert iterations_for_window(0.0, 1.0, 3, 1000) == 1000  # zero: max_iters


def test_iterations_for_window_infinitely_slow_is_min_iters():
    assert iterations_for_window(math.inf, 1.0, 3, 1000) == 3


def test_iteration_stats_known_values():
    st = iteration_stats([1.0, 2.0, 3.0, 4.0, 10.0])
    assert st["runtime_s"] == 3.0
    assert st["runtime_mean_s"] == 4.0
    assert st["runtime_min_s"] == 1.0
    assert st["runtime_p90_s"] == pytest.approx(7.6)  # linear interpolation 4 + 0.6 * 6
    assert st["runtime_cv"] == pytest.approx(math.sqrt(10.0) / 4.0)
    assert iteration_stats([2.0, 2.0])["runtime_cv"] == 0.0


def test_energy_figures():
    assert energy_figures(None, 5.0, 1.0, 10) == (None, None)
    assert energy_figures(5.0, None, 1.0, 10) == (None, None)
    assert energy_figures(5.0, 5.0, 1.0, 10) == (None, None)  # counter did not move
    assert energy_figures(9.0, 5.0, 1.0, 10) == (None, None)  # went backwards
    assert energy_figures(0.0, 5.0, 0.0, 10) == (None, None)
    assert energy_figures(0.0, 5.0, 1.0, 0) == (None, None)
    e, p = energy_figures(100.0, 400.0, 2.0, 50)
    assert e == pytest.approx(6.0) and p == pytest.approx(150.0)


def test_check_tolerance_orders():
    assert check_tolerance("fp32", 4096) > check_tolerance("fp32", 256)
    assert check_tolerance("bf16", 256) > check_tolerance("fp16", 256) > \
        check_tolerance("fp32", 256) > check_tolerance("fp64", 256)
    assert check_tolerance("tf32", 256) > check_tolerance("fp32", 256)


def _gemm(seed=0, m=64, n=48, k=256):
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((m, k)).astype(np.float32)
    b = rng.standard_normal((k, n)).astype(np.float32)
    c = a @ b
    rows = rng.choice(m, size=8, replace=False)
    a64, b64 = a[rows].astype(np.float64), b.astype(np.float64)
    return c[rows].copy(), a64 @ b64, np.abs(a64) @ np.abs(b64), k


def test_check_result_correct_fp32_gemm_passes():
    c, ref, abs_ref, k = _gemm()
    ok, err = check_result(c, ref, abs_ref, "fp32", k)
    assert ok and 0 <= err <= check_tolerance("fp32", k)


def test_check_result_one_corrupted_entry_fails():
    c, ref, abs_ref, k = _gemm()
    i, j = np.unravel_index(np.argmax(np.abs(c)), c.shape)
    c[i, j] *= 1.01
    ok, err = check_result(c, ref, abs_ref, "fp32", k)
    assert not ok and err > check_tolerance("fp32", k)


def test_check_result_nan_fails():
    c, ref, abs_ref, k = _gemm()
    c[2, 3] = np.nan
    assert check_result(c, ref, abs_ref, "fp32", k) == (False, math.inf)


# ------------------------------------------------------------------ plans


def fake(model="H100-SXM", **kw):
    return FakeDevice(0, FakeDeviceConfig(model=model), **kw)


def test_build_plan_skips_other_backends_and_drops_unsupported():
    groups = [
        ProbeGroup(shapes=((512, 512, 512),), dtypes=("fp64",), backends=("cpu",)),
        ProbeGroup(shapes=((1024, 1024, 1024),), dtypes=("fp32", "fp8"), backends=("fake",)),
        ProbeGroup(shapes=((1024, 1024, 1024),), dtypes=("fp32",)),  # duplicate, all backends
        ProbeGroup(shapes=((256, 256, 256),), dtypes=("bf16",), kernels=("tiled",)),
    ]
    plan, dropped = build_plan(groups, fake("A100-SXM"))
    assert plan == [ProbeSpec(1024, 1024, 1024, "fp32")]
    assert set(dropped) == {ProbeSpec(1024, 1024, 1024, "fp8"),
                            ProbeSpec(256, 256, 256, "bf16", "tiled", 16)}
    assert "no fp8 support" in dropped[ProbeSpec(1024, 1024, 1024, "fp8")]
    assert "fp32 only" in dropped[ProbeSpec(256, 256, 256, "bf16", "tiled", 16)]


def test_build_plan_expansion_rules():
    g = ProbeGroup(shapes=((1024, 1024, 1024),), dtypes=("fp32",), kernels=("blas", "tiled"),
                   tiles=(16, 32), layouts=("nn", "tt"))
    plan, dropped = build_plan([g, g], fake())
    assert dropped == {}
    assert plan == [
        ProbeSpec(1024, 1024, 1024, "fp32", "blas", 0, "nn"),
        ProbeSpec(1024, 1024, 1024, "fp32", "blas", 0, "tt"),
        ProbeSpec(1024, 1024, 1024, "fp32", "tiled", 16, "nn"),
        ProbeSpec(1024, 1024, 1024, "fp32", "tiled", 32, "nn"),
    ]


def test_build_plan_memory_budget_drop():
    g = ProbeGroup(shapes=((8192, 8192, 8192),), dtypes=("fp32",))
    plan, dropped = build_plan([g], fake(memory_budget=64 << 20))
    assert plan == [] and "memory budget" in next(iter(dropped.values()))


def test_exploration_specs_ranges_align_and_groups():
    groups = [
        ExplorationConfig(per_round=3, m=(256, 8192), n=(128, 1024), k=(64, 640), align=64,
                          dtypes=("fp32", "bf16"), kernels=("blas", "tiled"), tiles=(8, 16),
                          layouts=("nn", "tn"), backends=("fake",)),
        ExplorationConfig(per_round=50, dtypes=("fp64",), backends=("cpu",)),  # not for fake
    ]
    dev, rng = fake(), np.random.default_rng(1234)
    seen = []
    for _ in range(40):
        specs = exploration_specs(groups, dev, rng)
        assert len(specs) == 3
        seen.extend(specs)
    for s in seen:
        assert 256 <= s.m <= 8192 and 128 <= s.n <= 1024 and 64 <= s.k <= 640
        assert s.m % 64 == 0 and s.n % 64 == 0 and s.k % 64 == 0
        assert s.dtype in ("fp32", "bf16")  # never the cpu group's fp64
        assert dev.unsupported_reason(s) is None  # tiled+bf16 draws were redrawn
        if s.kernel == "tiled":
            assert s.tile in (8, 16) and s.layout == "nn"
        else:
            assert s.tile == 0 and s.layout in ("nn", "tn")
    assert len({s.m for s in seen}) > 10  # really random, not one value
    assert {s.kernel for s in seen} == {"blas", "tiled"}
    # Seeded: the same seed draws the same first round.
    assert exploration_specs(groups, fake(), np.random.default_rng(1234)) == seen[:3]


def test_an_unaligned_share_of_exploration_leaves_sizes_as_drawn():
    """``unaligned``: that share of the draws is not rounded to ``align`` (sizes that are
    not multiples of 8 run on other kernels, and a model learns them only from probes);
    0 draws exactly what it drew before the option existed."""
    g = ExplorationConfig(per_round=400, m=(256, 8192), n=(256, 8192), k=(256, 8192),
                          align=64, unaligned=0.25, backends=("fake",))
    specs = exploration_specs([g], fake(), np.random.default_rng(7))
    rounded = [s for s in specs if s.m % 64 == 0 and s.n % 64 == 0 and s.k % 64 == 0]
    odd = [s for s in specs if (s.m % 8, s.n % 8, s.k % 8) != (0, 0, 0)]
    assert len(specs) == 400 and 0.6 <= len(rounded) / 400 <= 0.9
    assert 0.15 <= len(odd) / 400 <= 0.4
    assert all(256 <= d <= 8192 for s in specs for d in (s.m, s.n, s.k))
    none = dataclasses.replace(g, unaligned=0.0)
    assert exploration_specs([none], fake(), np.random.default_rng(7)) == exploration_specs(
        [ExplorationConfig(per_round=400, m=(256, 8192), n=(256, 8192), k=(256, 8192),
                           align=64, backends=("fake",))], fake(), np.random.default_rng(7))
    assert all(s.m % 64 == 0 for s in exploration_specs([none], fake(),
                                                          np.random.default_rng(7)))


def test_exploration_narrow_range_stays_in_range():
    g = ExplorationConfig(per_round=20, m=(100, 120), n=(100, 120), k=(100, 120), align=64)
    for s in exploration_specs([g], fake(), np.random.default_rng(0)):
        assert all(100 <= d <= 120 for d in (s.m, s.n, s.k))


def test_exploration_gives_up_when_nothing_is_supported():
    g = ExplorationConfig(per_round=4, dtypes=("fp8",))
    assert exploration_specs([g], fake("A100-SXM"), np.random.default_rng(0)) == []


# ------------------------------------------------------------------ measure


def test_measure_on_fake_device(simulated_fake_clock):
    # The fake's clock is the host's plus simulated device time; with the host's part
    # standing still, the window is the simulated device time alone, on any machine (a busy
    # host's time between the clock reads once made a 1 s window look longer).
    dev = fake()
    spec = ProbeSpec(1024, 1024, 1024, "fp32")
    cfg = MeasureConfig(window_s=1.0)
    m = measure(dev, spec, cfg, check=True)
    assert m.window_s == pytest.approx(1.0, rel=0.03)
    assert m.iterations >= cfg.min_iters
    assert m.iterations * m.runtime_mean_s == pytest.approx(m.window_s, rel=1e-9)
    assert m.energy_j is not None and m.power_w is not None
    model = MODELS["H100-SXM"]
    assert model.idle_w < m.power_w <= model.tdp_w
    # energy per GEMM and average power come from the same counter, so energy_j is
    # power_w * runtime_mean_s up to the counter's ~1 ms polling latency between its
    # observed steps (energy_method "steps"); 10% is far tighter than any unit mix-up
    # (ms vs s, per-window vs per-GEMM).
    assert m.energy_j == pytest.approx(m.power_w * m.runtime_mean_s, rel=0.10)
    # The counter only moves in 100 ms steps, so over a 1 s window the average power can be
    # off the instantaneous draw by up to ~10%; it must still be in the same ballpark.
    assert m.power_w == pytest.approx(m.power_sample_w, rel=0.15)
    assert m.check_ok is True
    assert m.tflops == pytest.approx(spec.flops / m.runtime_s / 1e12)
    assert m.context["before"]["sm_clock_hz"] > 0 and "after" in m.context
    # Where the device time went: the window is the measured one, and the warm-up took
    # its configured device time and at most a GEMM or two beyond it.
    ph = m.context["phases"]
    assert set(ph) == {"prepare_s", "warmup_s", "before_window_s", "window_s",
                       "after_window_s", "check_s"}
    assert ph["window_s"] == m.window_s
    assert cfg.warmup_s <= ph["warmup_s"] <= 1.1 * cfg.warmup_s + 2 * m.runtime_s
    assert all(v >= 0 for v in ph.values())


def test_measure_min_iters_for_slow_probe():
    m = measure(fake(), ProbeSpec(8192, 8192, 8192, "fp32", "tiled", 16),
                MeasureConfig(window_s=0.01, min_iters=5))
    assert m.iterations == 5


def test_measure_cancelled():
    cancel = threading.Event()
    cancel.set()
    with pytest.raises(ProbeCancelled):
        measure(fake(), ProbeSpec(1024, 1024, 1024), MeasureConfig(), cancel=cancel)


def test_measure_unsupported_raises():
    with pytest.raises(UnsupportedProbe):
        measure(fake("A100-SXM"), ProbeSpec(1024, 1024, 1024, "fp8"), MeasureConfig())


def test_the_warm_up_runs_no_more_gemms_than_it_needs(simulated_fake_clock):
    """No warm-up call runs more GEMMs than are still needed: a 21 ms GEMM ran 3 for a
    warm-up of 2 GEMMs and 20 ms (64 ms of device time, issue 23's plan cost), a 25 us one
    up to twice the 20 ms asked for."""
    dev = fake()
    cfg = MeasureConfig(window_s=0.5, warmup_s=0.02, warmup_iters=2)
    slow = measure(dev, ProbeSpec(8192, 8192, 8192, "fp32"), cfg)
    assert slow.runtime_s > cfg.warmup_s
    assert slow.context["phases"]["warmup_s"] == pytest.approx(2 * slow.runtime_s, rel=0.05)
    quick = measure(dev, ProbeSpec(256, 256, 256, "fp32"), cfg)
    # (the last call aims 10% over what the median says: noisy times must not leave a
    # third call of a few GEMMs, ~26 ms of host time on the H200)
    assert cfg.warmup_s <= quick.context["phases"]["warmup_s"] <= \
        1.1 * cfg.warmup_s + 3 * quick.runtime_s


def _timed_as(monkeypatch, alter):
    """A fake GPU whose call number i (1, 2, ...) of run() returns alter(i, its times), and
    the GEMMs each call was asked for."""
    dev = fake()
    real = dev.run
    calls: list[int] = []

    def run(spec, n, cancel):
        calls.append(n)
        return alter(len(calls), real(spec, n, cancel))

    monkeypatch.setattr(dev, "run", run)
    return dev, calls


def test_a_cold_first_gemm_does_not_size_the_window(simulated_fake_clock, monkeypatch):
    """The window is sized on the warm-up's later half: a first call 100x slower (a CPU's
    BLAS threads starting, a GPU's clocks ramping) made a 0.1 s window of two warm-up GEMMs
    2 ms long once the warm-up stopped at what it needed (a CPU probe's: 21 ms)."""
    dev, calls = _timed_as(monkeypatch, lambda i, t: [x * 100 for x in t] if i == 1 else t)
    m = measure(dev, ProbeSpec(1024, 1024, 1024, "fp32"),
                MeasureConfig(window_s=0.1, warmup_s=0.0, warmup_iters=2))
    assert calls[:2] == [1, 1]  # the warm-up: two GEMMs, no more
    assert m.window_s == pytest.approx(0.1, rel=0.1)


def test_the_fake_gpus_noise_does_not_follow_the_hosts_speed(simulated_fake_clock):
    """How many energy steps a window holds depends on the host's time (a loaded machine
    spends more of it between calls); the steps' polling latency drew from the GEMMs'
    random stream, so a slow host changed every later runtime of a seeded fake GPU (a
    daemon test saw 3 of 6 rounds pooled under CPU burners)."""
    spec = ProbeSpec(4096, 4096, 4096, "bf16")
    runs = []
    for host_s in (0.0, 0.05):
        dev = fake(seed=3, noise=0.02)
        simulated_fake_clock.advance(host_s)  # the host's own time before the window
        first = dev.run_observed(spec, 2000, threading.Event())
        runs.append((len(first.steps), dev.run(spec, 50, threading.Event())))
    (steps_a, a), (steps_b, b) = runs
    assert steps_a != steps_b  # the windows did hold different numbers of steps
    assert a == b


@pytest.mark.parametrize("dtype,size", [("bf16", 4096), ("bf16", 8192), ("fp32", 4096)])
def test_the_warm_up_takes_two_calls(simulated_fake_clock, monkeypatch, dtype, size):
    """Each call of a real GPU's warm-up costs host time beyond its GEMMs (~26 ms on the
    H200): batches that doubled made 4-7 calls of a 0.2-1.6 ms GEMM. One GEMM (it may run
    cold), then what the warm-up still needs. (The NVIDIA backend's first call runs a
    chunk of ~0.2 ms: smaller GEMMs take two calls there too, tests/test_gpu_contract.py.)"""
    dev, calls = _timed_as(monkeypatch, lambda i, t: t)
    cfg = MeasureConfig(window_s=0.5, warmup_s=0.02, warmup_iters=2)
    m = measure(dev, ProbeSpec(size, size, size, dtype), cfg)
    warm_up = calls[:-1]  # the fake's window runs through run() too
    assert warm_up[0] == 1 and len(warm_up) == 2, (calls, m.runtime_s)
    assert cfg.warmup_s <= m.context["phases"]["warmup_s"] <= \
        1.1 * cfg.warmup_s + 2 * m.runtime_s


@pytest.mark.parametrize("bad", ["inf_first", "inf_later", "zero"])
def test_a_warm_up_of_impossible_times_ends(simulated_fake_clock, monkeypatch, bad):
    """An infinite GEMM time (a timer that overflowed) or none at all (a timer too coarse)
    ends the warm-up: no ValueError from ceil(nan), no loop that never reaches warmup_s.
    A cold first call's is outlived; in the window such times are the device's failure,
    said in one line, not a runtime of inf or 0 stored."""
    def alter(i, times):
        if bad == "zero":
            return [0.0] * len(times)
        return [math.inf] + times[1:] if (i == 1) == (bad == "inf_first") else times

    dev, calls = _timed_as(monkeypatch, alter)
    spec, cfg = ProbeSpec(1024, 1024, 1024, "fp32"), MeasureConfig(window_s=0.1,
                                                                  warmup_s=0.02, max_iters=1000)
    if bad == "inf_first":
        m = measure(dev, spec, cfg)
        assert 0 < m.runtime_s < 1e-3 and 0.05 < m.window_s < 0.11  # (max_iters 1000)
    else:
        with pytest.raises(DeviceError, match="timed a GEMM of the window at (inf|0.0) s"):
            measure(dev, spec, cfg)
    assert sum(calls) <= 3 * 1000
