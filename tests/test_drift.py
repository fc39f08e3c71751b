"""Drift: CUSUM arithmetic, the monitor, flagging of stored results, rebaseline."""

from __future__ import annotations

import dataclasses
import json
import math
import re
import subprocess
import sys

import numpy as np
import pytest

from gemmd.config import (
    Config,
    DriftConfig,
    FakeConfig,
    FakeDeviceConfig,
    MeasureConfig,
    ProbeGroup,
)
from gemmd.drift import (
    LEVEL_N,
    Z_CAP,
    Alarm,
    DriftMonitor,
    Track,
    long_run_scale,
    pool,
    update,
)
from gemmd.gemm import ProbeSpec

P = {"shift": 0.05, "arl0": 5e6, "baseline_probes": 5, "min_scale": 0.01}
SPEC = ProbeSpec(4096, 4096, 4096, "bf16")
SPECS = [ProbeSpec(4096, 4096, 4096, "bf16"), ProbeSpec(4096, 4096, 4096, "fp32"),
         ProbeSpec(8192, 8192, 8192, "bf16"), ProbeSpec(8192, 8192, 8192, "fp32"),
         ProbeSpec(1024, 1024, 1024, "fp32", "tiled", 16),
         ProbeSpec(1024, 1024, 1024, "fp32", "tiled", 32)]


def _feed(track, residuals, sigma=0.02, now=0.0):
    return [update(track, r, sigma, now=now, **P) for r in residuals]


def _ar1(rng, n, sigma, phi):
    x = np.empty(n)
    x[0] = rng.normal(0, sigma)
    e = rng.normal(0, sigma * math.sqrt(1 - phi * phi), n)
    for t in range(1, n):
        x[t] = phi * x[t - 1] + e[t]
    return x


# ---------------------------------------------------------------- one track


def test_reference_absorbs_a_steady_offset_and_noise_raises_no_alarm():
    rng = np.random.default_rng(1)
    tr = Track()
    # A card 3% slower than the model, with 0.5% probe noise, for 20,000 rounds.
    raised = _feed(tr, math.log(1.03) + rng.normal(0, 0.005, 20_000))
    assert not any(raised) and not tr.drifting
    assert math.exp(tr.reference) == pytest.approx(1.03, abs=0.002)
    assert tr.level_n == LEVEL_N  # learnt, then frozen: a slow drift is not absorbed
    # 0.5% noise is below min_scale: the long-run scale is the floor.
    assert tr.scale == pytest.approx(0.01, rel=0.02)


def test_a_5_percent_slowdown_alarms_within_3_rounds_and_clears_after():
    rng = np.random.default_rng(2)
    tr = Track()
    _feed(tr, rng.normal(0, 0.003, 200))
    raised = _feed(tr, math.log(1.05) + rng.normal(0, 0.003, 3))
    assert True in raised and tr.drifting and tr.alarms == 1
    _feed(tr, rng.normal(0, 0.003, 30))  # back to normal: the CUSUM drains, the alarm clears
    assert not tr.drifting and tr.cusum == 0.0


def test_noise_and_autocorrelation_are_learnt_and_widened_while_few():
    from gemmd.drift import long_run_scale, upper_bound_factor

    assert 3.6 < upper_bound_factor(5) < 4.1 and 2.0 < upper_bound_factor(10) < 2.2
    rng = np.random.default_rng(3)
    tr = Track()
    _feed(tr, _ar1(rng, 12, 0.02, 0.7))
    early = tr.scale
    _feed(tr, _ar1(rng, 3000, 0.02, 0.7))
    assert tr.phi == pytest.approx(0.7, abs=0.08)
    # The long-run scale of AR(1) noise: sigma sqrt((1 + phi) / (1 - phi)) = 4.8% here;
    # the estimate at its point value, and the safe one a little above it once learnt.
    assert long_run_scale(tr) == pytest.approx(0.02 * math.sqrt(1.7 / 0.3), rel=0.2)
    assert long_run_scale(tr) < tr.scale < 1.4 * long_run_scale(tr) < early


def test_prewhitening_keeps_autocorrelated_noise_quiet_and_still_sees_a_shift():
    """AR(1) noise, phi 0.7 at 2%: a CUSUM on the raw residuals alarmed ~1,300 times per
    GPU-year (bench/RESULTS.md); on the innovations it stays quiet, and a 5% shift is
    still found."""
    rng = np.random.default_rng(4)
    alarms = 0
    for _ in range(5):
        tr = Track()
        alarms += sum(_feed(tr, _ar1(rng, 4000, 0.02, 0.7)))
    assert alarms == 0
    noise = _ar1(rng, 60, 0.02, 0.7)
    raised = _feed(tr, math.log(1.05) + noise)
    assert True in raised and raised.index(True) < 40


def test_threshold_follows_the_wanted_false_alarm_rate():
    from gemmd.drift import threshold

    k1, k3 = math.log(1.05) / 0.02, math.log(1.05) / 0.06
    assert threshold(k1, 5e6) < threshold(k3, 5e6)  # noisier probe: higher bar
    assert threshold(k1, 5e6) < threshold(k1, 5e9)
    # Siegmund: ARL0 = (exp(2kb) - 2kb - 1) / 2k^2 with b = h + 1.166.
    b = threshold(k3, 5e6) + 1.166
    assert (math.exp(2 * k3 * b) - 2 * k3 * b - 1) / (2 * k3**2) == pytest.approx(5e6, rel=1e-6)
    # Vectorized: the same values.
    ks = np.array([k1, k3])
    assert threshold(ks, 5e6) == pytest.approx([threshold(k1, 5e6), threshold(k3, 5e6)])


def test_faster_than_predicted_never_alarms():
    tr = Track()
    _feed(tr, [0.0] * 5)
    assert not any(_feed(tr, [math.log(0.8)] * 50)) and tr.cusum == 0.0


def test_one_outlier_cannot_raise_an_alarm_alone():
    tr = Track()
    _feed(tr, [0.0] * 5)
    assert _feed(tr, [math.log(3.0)]) == [False]  # z ~ 110: capped, S stays below h
    assert not any(_feed(tr, [0.0] * 20)) and tr.cusum == 0.0


# ---------------------------------------------------------------- pooling


def test_pool_weights_probes_by_how_much_they_respond():
    # Equal probes: Z = sum u / sqrt(n), the response sqrt(n) times one probe's.
    z, g = pool(np.array([1.0, 1.0, 1.0, 1.0]), np.array([50.0, 50.0, 50.0, 50.0]))
    assert z == pytest.approx(2.0) and g == pytest.approx(100.0)
    # A noisy probe (small g) counts less; one that did not report counts nothing.
    z, g = pool(np.array([2.0, -2.0]), np.array([100.0, 10.0]))
    assert z == pytest.approx((200 - 20) / math.sqrt(100**2 + 10**2))
    z, _ = pool(np.array([2.0, 9.0]), np.array([100.0, 100.0]), np.array([True, False]))
    assert z == pytest.approx(2.0)
    # A single probe's outlier is capped before pooling.
    z, _ = pool(np.array([100.0, 0.0]), np.array([1.0, 1.0]))
    assert z == pytest.approx(Z_CAP / math.sqrt(2))
    # Batched over devices (leading axes).
    z, _ = pool(np.ones((3, 4)), np.ones((3, 4)))
    assert z.shape == (3,) and z == pytest.approx([2.0] * 3)


def _round(mon, uuid, values, now, model="H100", specs=SPECS, target="runtime"):
    """One round of ``values`` (log residuals, one per probe) for ``uuid``."""
    out = []
    for spec, v in zip(specs, values):
        out += mon.observe(uuid, spec, {target: math.exp(v)}, {target: 1.0}, {}, now=now,
                           gpu_model=model, plan=specs)
    return out


def test_a_slowdown_of_every_probe_is_caught_by_the_pooled_statistic_first():
    """2% noise on each of 6 probes: a 3% slowdown of all of them is 1.5 noise units per
    probe (their own tracks take long) but 3.7 pooled: the device alarm comes first."""
    rng = np.random.default_rng(5)
    mon = DriftMonitor(DriftConfig(targets=("runtime",)))
    for t in range(300):
        assert _round(mon, "g", rng.normal(0, 0.02, 6), t) == []
    dev = mon.devices["g"].targets["runtime"]
    assert dev.ready() and dev.members == 6 and dev.n > 250
    # Independent probes: the pooled statistic's scale is about 1 (learnt, not assumed).
    assert 0.8 < long_run_scale(dev) < 1.25
    alarms = []
    for t in range(300, 320):
        alarms += [(t, a) for a in _round(mon, "g", math.log(1.03) + rng.normal(0, 0.02, 6),
                                          t)]
        if alarms:
            break
    (t, alarm), = alarms
    assert alarm == Alarm("runtime", None) and t < 310  # pooled, within 10 rounds
    assert mon.target_drifting("g", "runtime") and mon.device_drifting("g")
    assert not any(tr.drifting for tr in mon.tracks.values())  # no probe on its own yet
    assert dev.ratio == pytest.approx(1.03, abs=0.02)


def test_a_slowdown_of_one_probe_is_caught_by_its_own_track():
    rng = np.random.default_rng(6)
    mon = DriftMonitor(DriftConfig(targets=("runtime",)))
    for t in range(300):
        _round(mon, "g", rng.normal(0, 0.01, 6), t)
    alarms = []
    for t in range(300, 330):
        v = rng.normal(0, 0.01, 6)
        v[2] += math.log(1.05)
        alarms += _round(mon, "g", v, t)
        if alarms:
            break
    assert Alarm("runtime", SPECS[2]) in alarms
    assert mon.target_drifting("g", "runtime")


def test_correlated_probes_carry_less_evidence_and_raise_no_false_alarm():
    """Noise common to all probes (clocks, temperature): pooling 6 probes gains nothing,
    and the pooled statistic's learnt scale says so (sqrt(6)) instead of alarming."""
    rng = np.random.default_rng(7)
    mon = DriftMonitor(DriftConfig(targets=("runtime",)))
    for t in range(2000):
        common = rng.normal(0, 0.02)
        assert _round(mon, "g", common + rng.normal(0, 0.002, 6), t) == []
    dev = mon.devices["g"].targets["runtime"]
    assert long_run_scale(dev) == pytest.approx(math.sqrt(6), rel=0.15)


def test_a_partial_round_is_pooled_when_the_next_round_starts():
    mon = DriftMonitor(DriftConfig(targets=("runtime",)))
    rng = np.random.default_rng(8)
    for t in range(20):
        _round(mon, "g", rng.normal(0, 0.01, 6), t)
    dev = mon.devices["g"].targets["runtime"]
    n = dev.n
    _round(mon, "g", rng.normal(0, 0.01, 4), 20)  # two probes failed this round
    assert dev.n == n  # not judged yet: the round may still complete
    _round(mon, "g", rng.normal(0, 0.01, 6), 21)
    assert dev.members == 6 and dev.n == n + 2  # the partial round, then this one


# ---------------------------------------------------------------- peers


def test_a_gpu_slow_from_day_one_is_flagged_against_its_siblings_within_10_rounds():
    rng = np.random.default_rng(9)
    mon = DriftMonitor(DriftConfig(targets=("runtime",)))
    flagged: dict[int, int] = {}
    for t in range(20):
        for g in range(8):
            slow = math.log(1.05) if g == 3 else 0.0
            _round(mon, f"GPU-{g}", slow + rng.normal(0, 0.02, 6), t)
            if mon.devices[f"GPU-{g}"].targets["runtime"].slower:
                flagged.setdefault(g, t + 1)
    assert list(flagged) == [3] and flagged[3] <= 10
    dev = mon.devices["GPU-3"].targets["runtime"]
    assert dev.peer_ratio == pytest.approx(1.05, abs=0.015) and dev.peers == 7
    # Its own CUSUMs never see it: it is its own normal.
    assert not mon.device_drifting("GPU-3")
    healthy = mon.devices["GPU-0"].targets["runtime"]
    assert healthy.peer_ratio == pytest.approx(1.0, abs=0.02) and not healthy.slower


def test_peers_are_the_same_model_and_enough_of_them():
    rng = np.random.default_rng(10)
    mon = DriftMonitor(DriftConfig(targets=("runtime",), peer_min_siblings=2))
    for t in range(12):
        # One H100 10% slower than one other H100 (too few to compare), and two A100s
        # that are faster than both: no comparison across models.
        _round(mon, "h0", 0.1 + rng.normal(0, 0.01, 6), t, model="H100")
        _round(mon, "h1", rng.normal(0, 0.01, 6), t, model="H100")
        _round(mon, "a0", -0.3 + rng.normal(0, 0.01, 6), t, model="A100")
        _round(mon, "a1", -0.3 + rng.normal(0, 0.01, 6), t, model="A100")
    for u in ("h0", "h1", "a0", "a1"):
        dev = mon.devices[u].targets["runtime"]
        assert dev.peer_ratio is None and not dev.slower and dev.peers == 0


def test_a_gpu_within_the_margin_is_not_flagged():
    rng = np.random.default_rng(11)
    mon = DriftMonitor(DriftConfig(targets=("runtime",), peer_margin=0.03))
    for t in range(60):
        for g in range(4):
            _round(mon, f"g{g}", (0.015 if g == 0 else 0.0) + rng.normal(0, 0.02, 6), t)
            assert not mon.devices[f"g{g}"].targets["runtime"].slower


# ---------------------------------------------------------------- the monitor


def test_monitor_targets_device_flag_rebaseline_and_persistence(tmp_path):
    path = tmp_path / "drift.json"
    mon = DriftMonitor(DriftConfig(**P), path)
    meas = {"runtime": 1.0, "power": 500.0, "energy": 0.5}
    sig = {"runtime": 0.02, "power": 0.02, "energy": 0.02}
    rng = np.random.default_rng(12)
    for t in range(30):
        noisy = {k: v * math.exp(rng.normal(0, 0.003)) for k, v in meas.items()}
        assert mon.observe("GPU-a", SPEC, noisy, meas, sig, now=t, gpu_model="H100",
                           plan=[SPEC]) == []
    slow = {"runtime": 1.06, "power": 500.0, "energy": 0.53}
    raised = [a for t in range(30, 34)
              for a in mon.observe("GPU-a", SPEC, slow, meas, sig, now=t, plan=[SPEC])]
    targets = {a.target for a in raised}
    assert {"runtime", "energy"} <= targets and "power" not in targets  # power unchanged
    assert mon.device_drifting("GPU-a") and not mon.device_drifting("GPU-b")
    assert mon.target_drifting("GPU-a", "runtime") and not mon.target_drifting("GPU-a",
                                                                                 "power")
    mon.model_version = "rf-3"
    mon.save()
    again = DriftMonitor(DriftConfig(**P), path)
    assert again.device_drifting("GPU-a") and again.model_version == "rf-3"
    # The device's pooled state and its model name survive the restart.
    dev = again.devices["GPU-a"]
    assert dev.gpu_model == "H100"
    assert vars(dev.targets["runtime"]) == vars(mon.devices["GPU-a"].targets["runtime"])
    assert again.rebaseline("GPU-a") == 3
    assert not again.device_drifting("GPU-a")
    assert again.tracks[("GPU-a", SPEC, "runtime")].alarms >= 1  # history kept


def test_a_drift_json_of_the_previous_version_loads_with_its_alarms(tmp_path):
    """drift.json as gemmd wrote it before device-level drift (version 1): references,
    noise and alarms carry over; the device's pooled statistic starts afresh."""
    path = tmp_path / "drift.json"
    spec = dataclasses.asdict(SPEC)
    path.write_text(json.dumps({"version": 1, "model_version": "rf-7", "tracks": [
        {"uuid": "GPU-a", "spec": spec, "target": "runtime", "baseline": [],
         "reference": 0.03, "scale": 0.012, "cusum": 7.5, "last_z": 3.1, "drifting": True,
         "since": 1000.0, "alarms": 2, "h": 2.5, "var": 1e-4, "cov": 2e-5, "prev": 0.05,
         "n": 80.0},
        {"uuid": "GPU-b", "spec": spec, "target": "runtime", "baseline": [0.01, 0.02],
         "reference": None, "scale": None, "cusum": 0.0, "last_z": None, "drifting": False,
         "since": None, "alarms": 0, "h": None, "var": 0.0, "cov": 0.0, "prev": 0.0,
         "n": 0.0}]}))
    mon = DriftMonitor(DriftConfig(**P, targets=("runtime",)), path)
    a = mon.tracks[("GPU-a", SPEC, "runtime")]
    assert a.drifting and a.since == 1000.0 and a.alarms == 2 and a.cusum == 7.5
    assert a.reference == 0.03 and a.phi == pytest.approx(0.2)
    assert mon.device_drifting("GPU-a") and mon.devices == {}
    b = mon.tracks[("GPU-b", SPEC, "runtime")]
    assert not b.ready() and b.baseline == [0.01, 0.02]
    # It keeps working, and saves as the new version.
    mon.observe("GPU-a", SPEC, {"runtime": math.exp(0.08)}, {"runtime": 1.0}, {}, now=2000,
                gpu_model="H100", plan=[SPEC])
    mon.save()
    assert json.loads(path.read_text())["version"] == 2
    assert DriftMonitor(DriftConfig(**P), path).device_drifting("GPU-a")


def test_accept_after_s_takes_the_new_behaviour_as_normal():
    mon = DriftMonitor(DriftConfig(**P, accept_after_s=3600, targets=("runtime",)))
    base, slow, sig = {"runtime": 1.0}, {"runtime": 1.1}, {"runtime": 0.02}
    for t in range(5):
        mon.observe("g", SPEC, base, base, sig, now=t)
    for t in range(5, 10):
        mon.observe("g", SPEC, slow, base, sig, now=t)
    assert mon.device_drifting("g")
    mon.observe("g", SPEC, slow, base, sig, now=4000)
    assert not mon.device_drifting("g")


def test_each_alarm_raised_and_cleared_is_kept_for_the_record_with_its_shift():
    """The monitor's transitions (which the daemon stores as events): one per alarm raised,
    of the probes' own tracks and the pooled one, as observe returned them, with how far
    off; one per alarm cleared, with since when."""
    rng = np.random.default_rng(21)
    mon = DriftMonitor(DriftConfig(**P, targets=("runtime",)))
    for t in range(40):
        _round(mon, "g", rng.normal(0, 0.003, 2), t, specs=SPECS[:2])
    assert mon.drain() == []
    raised = []
    for t in range(40, 45):
        raised += _round(mon, "g", math.log(1.06) + rng.normal(0, 0.003, 2), t,
                         specs=SPECS[:2])
    assert mon.device_drifting("g") and {a.spec for a in raised} >= {None}
    got = mon.drain()
    assert [(x.kind, x.target, x.spec) for x in got] == \
        [("alarm", a.target, a.spec) for a in raised]
    assert mon.drain() == []  # drained: each transition given once
    for x in got:
        assert x.uuid == "g" and 40 <= x.ts < 45
        assert x.detail["scope"] == ("pooled" if x.spec is None else "probe")
        assert x.detail["ratio"] == pytest.approx(1.06, abs=0.01)
        assert x.detail["shift"] == pytest.approx(0.06, abs=0.01)
        assert x.detail["cusum"] > x.detail["threshold"] > 0
    assert [x.detail["probes"] for x in got if x.spec is None] == [2]
    for t in range(45, 200):  # back to normal until every alarm cleared
        _round(mon, "g", rng.normal(0, 0.003, 2), t, specs=SPECS[:2])
        if not mon.device_drifting("g"):
            break
    assert not mon.device_drifting("g")
    cleared = mon.drain()
    assert sorted((x.kind, str(x.spec)) for x in cleared) == \
        sorted(("clear", str(a.spec)) for a in raised)
    for x in cleared:
        start = next(y.ts for y in got if y.spec == x.spec)
        assert x.detail["since"] == start < x.ts and "reason" not in x.detail


def test_a_rebaseline_ends_the_alarms_in_progress_for_the_record():
    mon = DriftMonitor(DriftConfig(**P, accept_after_s=3600, targets=("runtime",)))
    base, slow, sig = {"runtime": 1.0}, {"runtime": 1.1}, {"runtime": 0.02}
    for t in range(5):
        mon.observe("g", SPEC, base, base, sig, now=t)
    for t in range(5, 10):
        mon.observe("g", SPEC, slow, base, sig, now=t)
    drifting = {s for (_, s, _), tr in mon.tracks.items() if tr.drifting} | \
        ({None} if mon.devices["g"].targets["runtime"].drifting else set())
    assert drifting and [x.kind for x in mon.drain()] == ["alarm"] * len(drifting)
    # drift.accept_after_s: an automatic rebaseline, then each alarm ended by it.
    mon.observe("g", SPEC, slow, base, sig, now=4000)
    got = mon.drain()
    assert got[0].kind == "rebaseline" and got[0].detail["phase"] == "automatic"
    assert got[0].detail["drifting_s"] >= 3600 and got[0].uuid == "g"
    assert {x.spec for x in got[1:]} == drifting
    assert all(x.kind == "clear" and x.detail["reason"] == "rebaseline" and x.ts == 4000
               for x in got[1:])
    # An operator's rebaseline of a device in control ends nothing.
    mon.rebaseline("g")
    assert mon.drain() == []


def test_damaged_state_file_starts_over(tmp_path, caplog):
    path = tmp_path / "drift.json"
    path.write_text("{not json")
    mon = DriftMonitor(DriftConfig(**P), path)
    assert mon.tracks == {} and mon.devices == {} and "unreadable" in caplog.text


def test_rereference_keeps_an_alarm_under_a_new_model():
    mon = DriftMonitor(DriftConfig(**P, targets=("runtime",)))
    base, sig = {"runtime": 1.0}, {"runtime": 0.02}
    for _ in range(5):
        mon.observe("g", SPEC, base, base, sig)
    for _ in range(4):
        mon.observe("g", SPEC, {"runtime": 1.1}, base, sig)
    assert mon.device_drifting("g")
    tr = mon.tracks[("g", SPEC, "runtime")]
    noise = (tr.cxx, tr.cxy, tr.cyy, tr.n)
    mon.rereference("g", SPEC, "runtime", [0.01] * 8, 0.02)
    assert mon.device_drifting("g")
    assert tr.reference == pytest.approx(0.01) and (tr.cxx, tr.cxy, tr.cyy, tr.n) == noise


def test_rereference_with_the_models_shift_keeps_what_was_learnt():
    """A refit moves a probe's residuals by log(old / new prediction): where the daemon
    knows it, the track moves by it and keeps its level's and noise's learning (re-taking
    the level from a few results would cost hours of sensitivity after every refit)."""
    rng = np.random.default_rng(13)
    mon = DriftMonitor(DriftConfig(**P, targets=("runtime",)))
    for t in range(300):
        mon.observe("g", SPEC, {"runtime": math.exp(rng.normal(0, 0.01))}, {"runtime": 1.0},
                    {}, now=t, plan=[SPEC])
    tr = mon.tracks[("g", SPEC, "runtime")]
    before = dataclasses.asdict(tr)
    mon.rereference("g", SPEC, "runtime", [0.5] * 8, 0.0, shift=0.02)
    assert tr.reference == pytest.approx(before["reference"] + 0.02)
    for name in ("level_n", "n", "cxx", "cxy", "cyy", "cusum", "drifting"):
        assert getattr(tr, name) == before[name], name
    # Results under the new model, 2% higher residuals: still normal, no alarm.
    for t in range(300, 400):
        assert mon.observe("g", SPEC, {"runtime": math.exp(0.02 + rng.normal(0, 0.01))},
                           {"runtime": 1.0}, {}, now=t, plan=[SPEC]) == []


def test_the_pooled_statistic_does_not_learn_the_first_result_of_a_large_shift():
    rng = np.random.default_rng(14)
    mon = DriftMonitor(DriftConfig(targets=("runtime",)))
    for t in range(40):
        _round(mon, "g", rng.normal(0, 0.02, 6), t)
    dev = mon.devices["g"].targets["runtime"]
    n, cyy = dev.n, dev.cyy
    _round(mon, "g", math.log(1.05) + rng.normal(0, 0.02, 6), 40)  # pooled z ~ 6
    assert dev.n == n and dev.cyy == cyy and dev.cusum > 0


# ---------------------------------------------------------------- daemon wiring


def _cfg(tmp_path, **fake):
    base = Config()
    probes = dataclasses.replace(
        base.probes, exploration=(),
        sentinels=(ProbeGroup(shapes=((4096, 4096, 4096),), dtypes=("bf16", "fp32")),),
        measure=MeasureConfig(window_s=0.2, warmup_s=0.0))
    return dataclasses.replace(
        base, backend="fake", state_dir=str(tmp_path), probes=probes,
        listen=dataclasses.replace(base.listen, address="127.0.0.1", port=0),
        budget=dataclasses.replace(base.budget, duty_cycle=1.0),
        drift=dataclasses.replace(base.drift, baseline_probes=5),
        fake=FakeConfig(devices=(FakeDeviceConfig(), FakeDeviceConfig()), **fake))



def _fit_and_reference(d) -> None:
    """Eight rounds on every device, a fitted model, drift references under it. Drift
    needs a fitted model: the roofline's interval spans 2x, a 5% step is noise."""
    for _ in range(8):
        for r in d.runners:
            r.run_round()
    assert d.registry.refit().outcome == "accepted"
    d.rereference()

def test_daemon_flags_a_slowed_device_only_and_rebaseline_unflags(tmp_path):
    from gemmd.daemon import Daemon
    from gemmd.exporter import assemble
    from gemmd.rebaseline import REQUEST as REBASELINE_REQUEST

    d = Daemon(_cfg(tmp_path))
    try:
        _fit_and_reference(d)
        slowed = d.runners[1]
        slowed.device.cfg = FakeDeviceConfig(slowdown_factor=1.05)
        for _ in range(4):
            for r in d.runners:
                r.run_round()
        uuid0, uuid1 = (r.device.info.uuid for r in d.runners)
        assert d.state.drift.device_drifting(uuid1)
        assert not d.state.drift.device_drifting(uuid0)
        flagged = [r for r in d.store.probes(include_flagged=True) if r["flagged"]]
        assert flagged and {r["device_uuid"] for r in flagged} == {uuid1}
        reg = assemble(d.state, process=False)
        lab = {"gpu": "1", "uuid": uuid1, "gpu_model": slowed.device.info.name}
        # The GPU's alarm is per target now (its pooled statistic or a probe's own); the
        # alarms of the probes' own tracks and of the pooled one are counted apart.
        rt = {**lab, "target": "runtime"}
        assert reg.get_sample_value("gemmd_device_drifting", rt) == 1
        assert reg.get_sample_value("gemmd_device_drifting", {**lab, "target": "power"}) == 0
        assert reg.get_sample_value("gemmd_drift_alarms_total", rt) + \
            reg.get_sample_value("gemmd_device_drift_alarms_total", rt) >= 1
        assert reg.get_sample_value("gemmd_device_drift_probes", rt) == 2
        assert reg.get_sample_value("gemmd_device_drift_ratio", rt) == pytest.approx(
            1.05, abs=0.01)
        assert reg.get_sample_value("gemmd_device_slower_than_peers", lab) == 0
        assert reg.get_sample_value("gemmd_device_drifting", {
            "gpu": "0", "uuid": uuid0, "gpu_model": slowed.device.info.name,
            "target": "runtime"}) == 0
        # gemmd status says which GPU drifts, on what, by how much (drift.json saved).
        d._save_drift()
        r = subprocess.run([sys.executable, "-m", "gemmd", "status", "--state-dir",
                            str(tmp_path)], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        gpu1 = r.stdout[r.stdout.index("\nGPU 1"):]
        assert re.search(r"drift: [12] of \d+ tracks in alarm: blas-\w+-nn-4096x4096x4096 "
                         r"runtime x1\.0\d\d of normal", gpu1) or re.search(
            r"drift: runtime in alarm over its 2 probes pooled, x1\.0\d\d of normal", gpu1
        ), gpu1
        assert "last probe 0m ago" not in gpu1 and re.search(r"last probe \d+s ago", gpu1)
        # ... and its last alarm, from the store's events.
        assert re.search(r"last drift alarm: runtime on (its probes pooled|blas-\w+-nn-"
                         r"4096x4096x4096), x1\.0\d\d of normal", gpu1), gpu1
        alarms = d.store.events(kinds=("alarm",))
        # The CLI's rebaseline: a request file and unflagged rows; the daemon applies it.
        r = subprocess.run([sys.executable, "-m", "gemmd", "rebaseline", "--state-dir",
                            str(tmp_path), "--device", "1"], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        assert json.loads((tmp_path / REBASELINE_REQUEST).read_text())["devices"] == [uuid1]
        assert not [r for r in d.store.probes(include_flagged=True) if r["flagged"]]
        # Recorded: the request with the results it unflagged; the alarms it accepted are
        # still in the store's events although their results are unflagged.
        (req,) = d.store.events(kinds=("rebaseline",))
        assert req["device_uuid"] == uuid1 and req["detail"]["phase"] == "requested"
        assert req["detail"]["unflagged"] == len(flagged)
        assert d.store.events(kinds=("alarm",)) == alarms and alarms
        drifting = {(t, s.name) for (u, s, t), tr in d.state.drift.tracks.items()
                    if u == uuid1 and tr.drifting} | \
            {(t, None) for t, x in d.state.drift.devices[uuid1].targets.items() if x.drifting}
        d.apply_rebaseline_request()
        assert not d.state.drift.device_drifting(uuid1)
        assert not (tmp_path / REBASELINE_REQUEST).exists()
        applied = d.store.events(kinds=("rebaseline",))[-1]
        assert applied["detail"] == {"phase": "applied", "devices": [uuid1], "unflagged": 0}
        ended = d.store.events(kinds=("clear",))
        assert {(e["target"], e["probe"]) for e in ended} == drifting
        assert all(e["device_uuid"] == uuid1 and e["detail"]["reason"] == "rebaseline"
                   for e in ended)
    finally:
        d.stop()


def test_the_rounds_store_each_alarm_and_its_clear_as_events(tmp_path):
    """A slowed GPU: each alarm raised is an event (which GPU, target, pooled or which
    probe, how far off), written by the round that raised it; back to normal speed, each
    clears, recorded too. The results flagged are those taken between."""
    from gemmd.daemon import Daemon

    d = Daemon(_cfg(tmp_path))
    try:
        _fit_and_reference(d)
        slowed = d.runners[1]
        uuid1 = slowed.device.info.uuid
        plan = {s.name for s in slowed.plan}
        slowed.device.cfg = FakeDeviceConfig(slowdown_factor=1.05)
        for _ in range(4):
            for r in d.runners:
                r.run_round()
        assert d.state.drift.device_drifting(uuid1)
        alarms = d.store.events(kinds=("alarm",))
        assert alarms and {e["device_uuid"] for e in alarms} == {uuid1}
        assert "runtime" in {e["target"] for e in alarms}
        for e in alarms:
            assert e["detail"]["scope"] == ("pooled" if e["probe"] is None else "probe")
            assert e["probe"] is None or e["probe"] in plan
            if e["target"] == "runtime":
                assert e["detail"]["ratio"] == pytest.approx(1.05, abs=0.02)
                assert e["detail"]["shift"] == pytest.approx(0.05, abs=0.02)
        flagged = [r for r in d.store.probes(include_flagged=True) if r["flagged"]]
        assert flagged and min(r["ts"] for r in flagged) >= alarms[0]["ts"]
        assert d.store.events(kinds=("clear",)) == []
        slowed.device.cfg = FakeDeviceConfig()
        for _ in range(40):
            for r in d.runners:
                r.run_round()
            if not d.state.drift.device_drifting(uuid1):
                break
        assert not d.state.drift.device_drifting(uuid1)
        clears = d.store.events(kinds=("clear",))
        for a in alarms:  # each alarm raised was cleared after it, by its own track
            assert any((c["target"], c["probe"]) == (a["target"], a["probe"]) and
                       c["detail"]["since"] == a["ts"] < c["ts"] for c in clears), a
        assert all("reason" not in c["detail"] for c in clears)
        last_clear = max(c["ts"] for c in clears)
        assert all(r["ts"] < last_clear for r in d.store.probes(include_flagged=True)
                   if r["flagged"])
    finally:
        d.stop()


def test_rounds_feed_the_pooled_statistic_once_per_round_and_a_restart_keeps_it(tmp_path):
    """Each round of a device is pooled once, when its last sentinel reports (the plan
    says when); drift.json keeps the pooled state and the peers' model across restarts."""
    from gemmd.daemon import Daemon

    cfg = _cfg(tmp_path)
    d = Daemon(cfg)
    try:
        _fit_and_reference(d)
        uuid = d.runners[0].device.info.uuid
        dev = d.state.drift.devices[uuid]
        assert dev.gpu_model == d.runners[0].device.info.name
        rt = dev.targets["runtime"]
        before = rt.n + len(rt.baseline)
        for _ in range(6):
            for r in d.runners:
                r.run_round()
        assert rt.n + len(rt.baseline) == before + 6 and rt.members == 2
        assert rt.ready() and not rt.drifting
        d._save_drift()
        saved = {u: dataclasses.asdict(x) for u, x in d.state.drift.devices.items()}
    finally:
        d.stop()
    again = Daemon(cfg)
    try:
        assert {u: dataclasses.asdict(x) for u, x in again.state.drift.devices.items()} \
            == saved
    finally:
        again.stop()


def test_rebaseline_unknown_device_is_a_clear_error(tmp_path):
    from gemmd.daemon import Daemon

    Daemon(_cfg(tmp_path)).stop()
    r = subprocess.run([sys.executable, "-m", "gemmd", "rebaseline", "--state-dir",
                        str(tmp_path), "--device", "7"], capture_output=True, text=True)
    assert r.returncode == 1 and len(r.stderr.splitlines()) == 1
    assert "--device 7: no such device" in r.stderr and "Traceback" not in r.stderr


def test_results_predicted_by_another_model_are_not_judged():
    """A refit swaps the model before references are re-taken: results in between would be
    judged against the old model's reference (a false alarm on a healthy GPU)."""
    mon = DriftMonitor(DriftConfig(**P, targets=("runtime",)))
    mon.model_version = "rf-1"
    base, sig = {"runtime": 1.0}, {"runtime": 0.02}
    for _ in range(5):
        mon.observe("g", SPEC, base, base, sig, model_version="rf-1")
    before = dict(vars(mon.tracks[("g", SPEC, "runtime")]))
    for _ in range(5):
        assert mon.observe("g", SPEC, {"runtime": 1.5}, base, sig, model_version="rf-2") == []
    assert vars(mon.tracks[("g", SPEC, "runtime")]) == before


def test_the_runtime_drifts_by_the_configured_drift_section(tmp_path):
    """State() used to build a DriftMonitor on built-in defaults that only the daemon
    replaced: gemmd probe judged drift by the defaults, not the configuration."""
    from gemmd import runtime

    cfg = _cfg(tmp_path)
    cfg = dataclasses.replace(cfg, drift=dataclasses.replace(cfg.drift, shift=0.2,
                                                             baseline_probes=3))
    rt = runtime.build(cfg)
    try:
        assert rt.state.drift.p is cfg.drift
        assert rt.state.drift.path == tmp_path / "drift.json"
    finally:
        rt.close_devices()
        rt.store.close()
