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
from gemmd.drift import Alarm, DriftMonitor, Track
from gemmd.drift.device import pool
from gemmd.drift.params import LEVEL_N, Z_CAP
from gemmd.drift.series import long_run_scale, update
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


def test_a_5_percent_slowdown_alarms_a_probes_own_track_within_3_rounds_and_clears_after():
    # One result adds at most 0.35 h to a probe's CUSUM: three rounds at the least, however
    # far off, as the device's pooled statistic (0.49 h). Before: 0.3 h, four rounds, and
    # the H200's real clock cap (one quiet probe of two 5.3% slower) took four (issue 22).
    rng = np.random.default_rng(2)
    tr = Track()
    _feed(tr, rng.normal(0, 0.003, 200))
    raised = _feed(tr, math.log(1.05) + rng.normal(0, 0.003, 3))
    assert raised == [False, False, True] and tr.drifting and tr.alarms == 1
    _feed(tr, rng.normal(0, 0.003, 30))  # back to normal: the CUSUM drains, the alarm clears
    assert not tr.drifting and tr.cusum == 0.0


def test_noise_and_autocorrelation_are_learnt_and_widened_while_few():
    from gemmd.drift.series import long_run_scale, upper_bound_factor

    assert 3.6 < upper_bound_factor(5) < 4.1 and 2.0 < upper_bound_factor(10) < 2.2
    rng = np.random.default_rng(3)
    tr = Track()
    _feed(tr, _ar1(rng, 12, 0.02, 0.7))
    early = tr.scale
    _feed(tr, _ar1(rng, 3000, 0.02, 0.7))
    assert tr.phi == pytest.approx(0.7, abs=0.08)
    # The long-run scale of AR(1) noise: sigma sqrt((1 + phi) / (1 - phi)) = 4.8% here;
    # the estimate at its point value, and the safe one a little above it once learnt
    # (and wider by its misfit, where that shows beyond its error).
    from gemmd.drift.params import MISFIT_Z
    from gemmd.drift.series import misfit
    from gemmd.drift.tracks import _to_arrays

    assert long_run_scale(tr) == pytest.approx(0.02 * math.sqrt(1.7 / 0.3), rel=0.2)
    widen = float(misfit(_to_arrays(tr), MISFIT_Z)[0])
    assert long_run_scale(tr) < tr.scale / widen < 1.5 * long_run_scale(tr) < early
    assert 1.0 <= widen < 1.25


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
    # A lone track in persistent noise: the steady response to 5% is (1 - phi) 5%, one
    # noise unit a round, and a result adds at most 0.35 h (the device's pooled statistic
    # sees such a slowdown of every probe sooner).
    noise = _ar1(rng, 80, 0.02, 0.7)
    raised = _feed(tr, math.log(1.05) + noise)
    assert True in raised and raised.index(True) < 60


def test_threshold_follows_the_wanted_false_alarm_rate():
    from gemmd.drift.series import threshold

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


def test_outliers_apart_cannot_raise_a_probes_alarm_three_in_a_row_do():
    """A neighbour's burst: +30% on one probe, two results running, or three with normal
    results between them. Before issue 23, a result added up to max(4, k + 0.6 h) to the
    CUSUM: two outliers close together raised an alarm (54 false alarms per GPU-year at 1
    in 200). Three in a row do now: a probe's track catches a step of its own in three
    rounds (the H200's clock cap, issue 22), and three results alike are a step."""
    rng = np.random.default_rng(30)
    tr = Track()
    _feed(tr, rng.normal(0, 0.01, 300))
    out = math.log(1.3)
    for seq in ([out, out], [out, 0.0, out, 0.0, out], [out, 0.0, 0.0, out, 0.0, 0.0, out]):
        assert not any(_feed(tr, seq + [0.0] * 30)), seq
    assert tr.alarms == 0
    assert _feed(tr, [out] * 3) == [False, False, True]


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
    """2% noise on each of 6 probes: a 5% slowdown of all of them is 2.5 noise units per
    probe (their own tracks take long) but 6 pooled: the device alarm comes first."""
    rng = np.random.default_rng(5)
    mon = DriftMonitor(DriftConfig(targets=("runtime",)))
    for t in range(300):
        assert _round(mon, "g", rng.normal(0, 0.02, 6), t) == []
    dev = mon.devices["g"].targets["runtime"]
    assert dev.ready() and dev.armed() and dev.members == 6 and dev.n > 250
    # Independent probes: the pooled statistic's scale is about 1 (learnt, not assumed).
    assert 0.8 < long_run_scale(dev) < 1.25
    alarms = []
    for t in range(300, 320):
        alarms += [(t, a) for a in _round(mon, "g", math.log(1.05) + rng.normal(0, 0.02, 6),
                                          t)]
        if alarms:
            break
    (t, alarm), = alarms
    assert alarm == Alarm("runtime", None) and t < 305  # pooled, within 5 rounds
    assert mon.target_drifting("g", "runtime") and mon.device_drifting("g")
    assert not any(tr.drifting for tr in mon.tracks.values())  # no probe on its own yet
    assert dev.ratio == pytest.approx(1.05, abs=0.02) and dev.reason == "step"


def test_a_3_percent_slowdown_below_the_allowance_is_caught_by_the_slow_level_within_hours():
    """3% is below the CUSUMs' allowance (half way between drift.tolerance and
    drift.shift), so it takes the slow level: confidently beyond the tolerance, a
    "gradual" alarm, within a day (before: the pooled CUSUM, with no tolerance)."""
    rng = np.random.default_rng(31)
    mon = DriftMonitor(DriftConfig(targets=("runtime",)))
    for t in range(720):
        assert _round(mon, "g", rng.normal(0, 0.02, 2), t, specs=SPECS[:2]) == []
    for t in range(720, 1440):
        if _round(mon, "g", math.log(1.03) + rng.normal(0, 0.02, 2), t, specs=SPECS[:2]):
            break
    dev = mon.devices["g"].targets["runtime"]
    assert dev.drifting and dev.reason == "gradual" and t < 720 + 360
    assert math.exp(dev.level) == pytest.approx(1.03, abs=0.01)


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
    assert json.loads(path.read_text())["version"] == 3
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


def test_a_rebaseline_takes_a_new_level_and_keeps_the_noise_it_learnt(tmp_path):
    """Before, a rebaseline forgot the noise model too, and a GPU was as blind as a new
    one for hours: at 1% noise a 5% step 10 rounds after the new baseline went unseen on
    most GPUs (the young bounds of a 10-result noise estimate). A new level is no new
    noise."""
    from gemmd.drift.params import REBASE_N

    delays = []
    for seed in range(4):
        rng = np.random.default_rng(60 + seed)
        path = tmp_path / f"drift{seed}.json"
        mon = DriftMonitor(DriftConfig(targets=("runtime",)), path)
        for t in range(400):
            _round(mon, "g", rng.normal(0, 0.01, 2), t, specs=SPECS[:2])
        before = mon.tracks[("g", SPECS[0], "runtime")]
        learnt = (before.cxx, before.cxy, before.cyy)
        mon.rebaseline("g", now=400)
        for t in range(400, 405):
            _round(mon, "g", rng.normal(0.03, 0.01, 2), t, specs=SPECS[:2])
        mon.save()  # a restart in the middle of the new baseline keeps what it carries
        mon = DriftMonitor(DriftConfig(targets=("runtime",)), path)
        for t in range(405, 420):
            _round(mon, "g", rng.normal(0.03, 0.01, 2), t, specs=SPECS[:2])
        tr = mon.tracks[("g", SPECS[0], "runtime")]
        assert tr.ready() and tr.noise is None and tr.n <= REBASE_N + 10
        assert tr.reference == pytest.approx(0.03, abs=0.01)  # the new level ...
        assert tr.cxx == pytest.approx(learnt[0], rel=0.2)  # ... the noise it knew
        assert mon.devices["g"].targets["runtime"].ready()
        raised = _run(mon, "g", rng.normal(0.03, 0.01, (60, 2)) + math.log(1.05), 420,
                      specs=SPECS[:2])
        delays.append(raised[0][0] - 420 + 1 if raised else math.inf)
    assert max(delays) <= 12, delays  # 4-9 here; before, 40% of GPUs within a day


def test_a_damaged_kept_noise_model_in_the_state_file_starts_drift_over(tmp_path, caplog):
    import json

    mon = DriftMonitor(DriftConfig(targets=("runtime",)), tmp_path / "drift.json")
    rng = np.random.default_rng(71)
    for t in range(60):
        _round(mon, "g", rng.normal(0, 0.01, 2), t, specs=SPECS[:2])
    mon.rebaseline("g", now=60)
    mon.save()
    data = json.loads((tmp_path / "drift.json").read_text())
    assert data["tracks"][0]["noise"]["n"] > 0  # saved with the track
    data["tracks"][0]["noise"] = ["not", "a", "model"]
    (tmp_path / "drift.json").write_text(json.dumps(data))
    with caplog.at_level("ERROR"):
        mon = DriftMonitor(DriftConfig(targets=("runtime",)), tmp_path / "drift.json")
    assert mon.tracks == {} and "unreadable" in caplog.text
    for t in range(61, 80):  # and it runs on, from a new baseline
        _round(mon, "g", rng.normal(0, 0.01, 2), t, specs=SPECS[:2])
    assert mon.tracks[("g", SPECS[0], "runtime")].ready()


def test_a_rebaseline_on_noisier_results_learns_the_noise_anew():
    """A driver update or a busier host may change the noise with the level: a new
    baseline that scatters beyond the kept model's 99% bound discards it (kept, noise
    grown 3x gave 45 false alarms in 60 GPU-days after the rebaseline)."""
    rng = np.random.default_rng(70)
    mon = DriftMonitor(DriftConfig(targets=("runtime",)))
    for t in range(300):
        _round(mon, "g", rng.normal(0, 0.01, 2), t, specs=SPECS[:2])
    kept = mon.tracks[("g", SPECS[0], "runtime")].cyy
    mon.rebaseline("g", now=300)
    for t in range(300, 310):
        _round(mon, "g", rng.normal(0, 0.03, 2), t, specs=SPECS[:2])
    tr = mon.tracks[("g", SPECS[0], "runtime")]
    assert tr.ready() and tr.n < 30 and tr.cyy > 4 * kept  # learnt from the new baseline


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


# ---------------------------------------------------------------- issue 23


def _run(mon, uuid, values, t0, specs=SPECS[:2], target="runtime", contexts=None):
    """Rounds of ``values`` (rounds x probes, log residuals) from round ``t0``; the device
    alarms raised, as (round, alarm)."""
    out = []
    for i, row in enumerate(values):
        for a in _round(mon, uuid, row, t0 + i, specs=specs, target=target):
            if a.spec is None:
                out.append((t0 + i, a))
    return out


def test_a_sentinel_removed_from_the_plan_leaves_no_track_behind(tmp_path):
    """A sentinel removed from the configuration kept its tracks (saved, restored). After
    a rebaseline they never had a result to be ready with, and the device's pooled
    statistic, which starts once all its probes' tracks are, never re-armed: a 5%
    slowdown went unseen (found by a campaign through DriftMonitor, issue 23)."""
    rng = np.random.default_rng(49)
    three, two = SPECS[:3], SPECS[:2]
    mon = DriftMonitor(DriftConfig(targets=("runtime",)), tmp_path / "drift.json")
    for t in range(40):
        _round(mon, "g", rng.normal(0, 0.005, 3), t, specs=three)
    mon.save()
    mon = DriftMonitor(DriftConfig(targets=("runtime",)), tmp_path / "drift.json")
    assert ("g", SPECS[2], "runtime") in mon.tracks  # restored as saved
    mon.rebaseline("g", now=40)
    for t in range(41, 80):
        _round(mon, "g", rng.normal(0, 0.005, 2), t, specs=two)
    assert set(mon.tracks) == {("g", s, "runtime") for s in two}
    assert mon.devices["g"].targets["runtime"].ready()  # armed again
    assert not any(SPECS[2] in per for per in mon._warm.get("g", {}).values())
    raised = _run(mon, "g", rng.normal(0, 0.005, (10, 2)) + math.log(1.05), 80, specs=two)
    assert raised and raised[0][0] - 80 + 1 <= 3, raised


def test_a_probe_in_alarm_that_leaves_the_plan_clears_with_its_reason():
    rng = np.random.default_rng(50)
    three, two = SPECS[:3], SPECS[:2]
    mon = DriftMonitor(DriftConfig(targets=("runtime",)))
    for t in range(40):
        _round(mon, "g", rng.normal(0, 0.005, 3), t, specs=three)
    for t in range(40, 46):
        _round(mon, "g", [*rng.normal(0, 0.005, 2), math.log(1.3)], t, specs=three)
    assert mon.tracks[("g", SPECS[2], "runtime")].drifting
    mon.drain()
    _round(mon, "g", rng.normal(0, 0.005, 2), 46, specs=two)
    cleared = [x for x in mon.drain() if x.kind == "clear" and x.spec == SPECS[2]]
    assert cleared and cleared[0].detail["reason"] == "left the plan"
    assert not any(tr.drifting for (u, s, t), tr in mon.tracks.items())


def test_a_sentinel_added_to_a_running_plan_leaves_no_stale_warm_start():
    rng = np.random.default_rng(51)
    mon = DriftMonitor(DriftConfig(targets=("runtime",)))
    for t in range(30):
        _round(mon, "g", rng.normal(0, 0.005, 2), t, specs=SPECS[:2])
    for t in range(30, 60):
        _round(mon, "g", rng.normal(0, 0.005, 3), t, specs=SPECS[:3])
    assert mon.tracks[("g", SPECS[2], "runtime")].ready()
    assert not mon._warm.get("g", {}).get("runtime")


@pytest.mark.parametrize("start", [4, 6, 9, 10, 11, 13])
def test_a_step_at_the_end_of_the_baseline_is_not_absorbed(start):
    """20% slower from round ``start`` (1 = the first): caught within 4 rounds wherever the
    baseline stands. Before, a step from round 9 or 10 became the card's normal (no alarm
    in 720 rounds), and one just after the baseline took tens of rounds (issue 23)."""
    rng = np.random.default_rng(40 + start)
    mon = DriftMonitor(DriftConfig(targets=("runtime",)))
    noise = rng.normal(0, 0.01, (start + 40, 2))
    noise[start - 1:] += math.log(1.2)
    raised = _run(mon, "g", noise, 1)
    assert raised and raised[0][0] - start + 1 <= 4, raised[:1]
    dev = mon.devices["g"].targets["runtime"]
    assert dev.drifting and dev.ready() and math.exp(dev.level) > 1.1
    tr = mon.tracks[("g", SPECS[0], "runtime")]
    assert tr.reference == pytest.approx(0.0, abs=0.02)  # the normal is from before the step


def test_a_daily_cycle_within_the_tolerance_raises_no_alarm():
    """+-2% a day (temperature) on 1% noise, common to the probes: the healthy GPU was in
    alarm 17% of the time before (issue 23); drift.tolerance is 2%."""
    rng = np.random.default_rng(41)
    mon = DriftMonitor(DriftConfig(targets=("runtime",)))
    t = np.arange(3 * 720)
    cycle = 0.02 * np.sin(2 * math.pi * t / 720 + 1.0)
    values = cycle[:, None] + rng.normal(0, 0.01, (len(t), 2))
    assert _run(mon, "g", values, 0) == []
    assert not mon.device_drifting("g")


def test_a_speed_up_is_reported_becomes_the_normal_and_a_later_slowdown_is_caught():
    """8% faster without a rebaseline, then 5% slower than that: before, the slowdown was
    hidden under the old normal (caught on 0 of 200 GPUs in a day, issue 23)."""
    rng = np.random.default_rng(42)
    mon = DriftMonitor(DriftConfig(targets=("runtime",)))
    assert _run(mon, "g", rng.normal(0, 0.02, (720, 2)), 0) == []
    dev = mon.devices["g"].targets["runtime"]
    faster_seen = False
    mon.drain()
    for i in range(200):
        assert _run(mon, "g", math.log(0.92) + rng.normal(0, 0.02, (1, 2)), 720 + i) == []
        faster_seen |= getattr(dev, "faster", 0) > 0
    events = mon.drain()
    raised = _run(mon, "g", math.log(0.92 * 1.05) + rng.normal(0, 0.02, (10, 2)), 920)
    assert raised and raised[0][0] - 920 < 8
    assert faster_seen and dev.speedups == 1
    (event,) = [x for x in events if x.kind == "rebaseline"]
    assert event.detail["phase"] == "speedup" and event.target == "runtime"
    assert event.detail["ratio"] == pytest.approx(0.93, abs=0.02)
    assert math.exp(mon.tracks[("g", SPECS[0], "runtime")].reference) == \
        pytest.approx(0.92, abs=0.015)


def test_an_intermittent_fault_keeps_one_alarm_with_its_own_reason():
    """10% slower in 30% of rounds: one alarm that stays, reason "intermittent" (before:
    1.5-11 new alarms a GPU-day, the alarm flapping)."""
    rng = np.random.default_rng(43)
    mon = DriftMonitor(DriftConfig(targets=("runtime",)))
    assert _run(mon, "g", rng.normal(0, 0.02, (720, 2)), 0) == []
    slow = (rng.random(720) < 0.3)[:, None] * math.log(1.1)
    raised = _run(mon, "g", slow + rng.normal(0, 0.02, (720, 2)), 720)
    dev = mon.devices["g"].targets["runtime"]
    assert len(raised) == 1 and dev.drifting and dev.reason == "intermittent"
    clears = [x for x in mon.drain() if x.kind == "clear" and x.spec is None]
    assert clears == []


def test_the_pooled_statistics_warm_start_survives_a_restart(tmp_path):
    """The pooled statistic starts from its probes' baselines the round they complete, and
    a restart in between keeps them. Before, it started a round later, and a restart
    there made it take a baseline of its own: ready at round 20, not 11 (issue 23)."""
    path = tmp_path / "drift.json"
    cfg = DriftConfig(targets=("runtime",))
    rng = np.random.default_rng(44)
    mon = DriftMonitor(cfg, path)
    _run(mon, "g", rng.normal(0, 0.01, (9, 2)), 0)
    # The tenth round: the first probe, a restart, the second probe.
    mon.observe("g", SPECS[0], {"runtime": 1.0}, {"runtime": 1.0}, {}, now=9,
                gpu_model="H100", plan=SPECS[:2])
    mon.save()
    again = DriftMonitor(cfg, path)
    again.observe("g", SPECS[1], {"runtime": 1.0}, {"runtime": 1.0}, {}, now=9,
                  gpu_model="H100", plan=SPECS[:2])
    _run(again, "g", rng.normal(0, 0.01, (1, 2)), 10)  # closes the round cut by the restart
    dev = again.devices["g"].targets["runtime"]
    assert dev.ready() and dev.armed() and not dev.baseline
    _run(again, "g", rng.normal(0, 0.01, (2, 2)), 11)
    assert dev.members == 2 and dev.young >= 1  # judging rounds already


def test_misfit_widens_a_track_whose_noise_an_ar1_does_not_describe():
    """A slow wander plus white noise (energy = an AR(1) runtime x iid power) is no AR(1):
    its innovations wander together, and a CUSUM on them alarmed several times a GPU-year
    (AR(1) 0.95, issue 23). Their EWMA's mean square says so, and widens the scale."""
    from gemmd.drift.series import misfit, start, step

    rng = np.random.default_rng(45)
    n, cols = 3000, 200
    a = np.zeros(cols)
    arma, white = np.zeros((n, cols)), rng.normal(0, 0.02, (n, cols))
    for t in range(n):
        a = 0.95 * a + 0.02 * math.sqrt(1 - 0.95**2) * rng.normal(0, 1, cols)
        arma[t] = a + 0.01 * rng.normal(0, 1, cols)
    out = {}
    for name, x in (("arma", arma), ("white", white)):
        s = start(x[:10])
        alarms = 0
        for t in range(10, n):
            alarms += int(step(s, x[t], gain=1.0, floor=0.01, learn=True, shift=0.05,
                               arl0=2e6, kappa=math.log(1.035)).sum())
        out[name] = (float(np.median(misfit(s))), alarms)
    assert out["arma"][0] > 1.4 and out["white"][0] < 1.25
    assert out["arma"][1] <= 1 and out["white"][1] == 0


def test_name_cause_from_the_probes_context():
    """The H200's own cases (bench/results/2026-11-26-h200): bf16 at the power cap
    (sw_power_cap, ~1,500 MHz), fp32 at full clock. A clock cap moves fp32 only, with no
    reason reported; a lowered power limit moves the probes at the cap."""
    from gemmd.drift.causes import name_cause

    def row(sm, reasons="", temp=60.0, limit=700.0, mem=3201.0):
        return [sm, mem, temp, limit, reasons]

    normal = {"bf16": {"normal": [row(1500, "sw_power_cap")] * 10},
              "fp32": {"normal": [row(1980)] * 10}}

    def ctx(bf16, fp32):
        return {p: {**normal[p], "recent": [r] * 3} for p, r in (("bf16", bf16),
                                                                   ("fp32", fp32))}

    capped = ctx(row(1515, "sw_power_cap"), row(1875))
    assert name_cause("runtime", capped, {"fp32"})[0] == "clocks_other"
    assert "-5.3%" in name_cause("runtime", capped, {"fp32"})[1]
    limit = ctx(row(1300, "sw_power_cap", limit=600), row(1800, "sw_power_cap", limit=600))
    assert name_cause("runtime", limit, {"bf16", "fp32"}) == ("power_limit",
                                                             "power limit 700 -> 600 W")
    hot = ctx(row(1400, "sw_power_cap|hw_thermal_slowdown", 85), row(1800,
                                                                     "hw_thermal_slowdown", 85))
    assert name_cause("runtime", hot, {"bf16", "fp32"})[0] == "clocks_thermal"
    leaky = ctx(row(1440, "sw_power_cap"), row(1980))
    assert name_cause("runtime", leaky, {"bf16"})[0] == "clocks_power_cap"
    same = ctx(row(1500, "sw_power_cap"), row(1980))
    assert name_cause("runtime", same, {"bf16", "fp32"})[0] == "same_clocks"
    assert name_cause("power", same, {"bf16"})[0] == "same_clocks_power"
    assert name_cause("power", ctx(row(1500, "sw_power_cap", 72), row(1980, temp=72)),
                      {"fp32"})[0] == "temperature"
    assert name_cause("runtime", {}, {"fp32"})[0] == "unknown"
    # Energy follows the runtime's cause when the runtime is in alarm too.
    assert name_cause("energy", same, {"fp32"}, ("clocks_thermal", "x")) == \
        ("clocks_thermal", "x")


@pytest.mark.parametrize("kind, factor, target, cause", [
    ("thermal", 1.05, "runtime", "clocks_thermal"),
    ("power_cap", 0.85, "runtime", "power_limit"),
    ("clock_cap", 1.05, "runtime", "clocks_other"),
    ("less_work", 1.05, "runtime", "same_clocks"),
    ("power", 1.06, "power", "same_clocks_power"),
])
def test_the_alarm_names_its_cause_on_the_fake_scenarios(kind, factor, target, cause):
    """Each fault of the fake backend, measured by gemmd's protocol, judged with the
    probes' context: the device alarm names what changed."""
    from gemmd.devices.base import measure
    from gemmd.devices.fake import FakeDevice, Scenario
    from gemmd.drift import measured_of, stand_in

    plan = [ProbeSpec(8192, 8192, 8192, "bf16"), ProbeSpec(8192, 8192, 8192, "fp32")]
    dev = FakeDevice(0, FakeConfig().devices[0], seed=1, jitter=0.003)
    cfg = MeasureConfig(window_s=0.5, warmup_s=0.02)
    pred = {s: stand_in({"runtime": measure(dev, s, cfg).runtime_s}, dev.info.power_limit_w)
            for s in plan}
    mon = DriftMonitor(DriftConfig())
    for i in range(60):
        if i == 30:
            dev.scenario = Scenario(kind, factor)
        for s in plan:
            m = measure(dev, s, cfg)
            mon.observe(dev.info.uuid, s, measured_of(m), pred[s], {}, now=i * 120.0,
                        gpu_model=dev.info.name, plan=plan, context=m.context.get("after"))
        ds = mon.devices[dev.info.uuid].targets[target]
        if ds.drifting:
            break
    assert 30 <= i <= 36, i
    assert ds.cause == cause, (ds.cause, ds.cause_text)
    alarm = [x for x in mon.drain() if x.kind == "alarm" and x.spec is None]
    assert alarm and alarm[-1].detail["cause"] == cause and alarm[-1].detail["cause_text"]


# ---------------------------------------------------------------- issues 22 and 23, again


def _bench_drift():
    """bench/drift.py (its vectorized fleet runs gemmd.drift's functions as the monitor
    does, checked alarm for alarm in the benchmark)."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "bench_drift", Path(__file__).resolve().parent.parent / "bench" / "drift.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_drift"] = mod  # (its dataclasses look their module up)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("probes", [["blas-bf16-nn-8192x8192x8192",
                                     "blas-fp32-nn-8192x8192x8192"], []])
def test_the_h200s_real_clock_cap_raises_the_device_alarm_within_3_rounds(probes, capsys):
    """The real slowdown of issue 22, replayed (bench/gpu_accept.py --replay): SM clocks
    locked 5.3% lower on an H200 slow only its clock-bound probes, fp32 by 5.2% at a
    runtime CV of 0.03%; bf16 runs at the power cap and does not move. On the default plan
    that is one quiet probe of two: diluted in the pooled statistic (2.6% on the device,
    within the allowance), its own track needed four results, however far off, and the
    alarm came only at the 10% cap. Now three, and the cause is named; so with all six
    probes of that run."""
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    sys.path.insert(0, str(root / "bench"))
    import gpu_accept

    gpu_accept.replay_archive(root / "bench/results/2026-11-26-h200/results.tar.gz", probes)
    out = capsys.readouterr().out
    assert "| rounds until the device alarm at clocks -5% (1875 MHz) | 3 | <= 3 | yes |" in out
    assert "| the cause the alarm names | runtime: SM clocks -5.3%" in out
    assert "no throttle reason" in out
    assert "| false alarms over the stock rounds (after the baseline) | 0 |" in out


def test_a_second_h200s_clock_cap_below_the_design_shift_is_alarmed_in_round_4(capsys):
    """The same cap measured again (2026-11-26 23:52 UTC, bench/results/2026-11-26-h200-late):
    fp32 8192^3 went 21.58 -> 22.55 ms, +4.5%, below the 5% shift the detector is sized
    for (the first run's +5.1% was alarmed in round 3); bf16 again did not move. Alarmed
    in the fourth lowered round, the cause named, no false alarm before."""
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    sys.path.insert(0, str(root / "bench"))
    import gpu_accept

    gpu_accept.replay_archive(root / "bench/results/2026-11-26-h200-late/results.tar.gz", [])
    out = capsys.readouterr().out
    rows = [r for r in out.splitlines() if r.startswith("| 2") and "clocks -" in r]
    assert [("| yes |" in r) for r in rows[:4]] == [False, False, False, True]
    assert "runtime: SM clocks -5.3%" in rows[3] and "no throttle reason" in rows[3]
    assert "| false alarms over the stock rounds (after the baseline) | 0 |" in out


def test_a_5_percent_slowdown_of_both_sentinels_at_2_percent_noise_within_3_rounds():
    """Issue 23's hardest detection target: two probes at 2% noise carry 3.5 noise units
    of a 5% shift a round. Against an allowance half way between the tolerance and the
    shift (3.4%) and the pooled statistic's safe bounds, p50 5 and p90 8 rounds; against
    the band with half the shift, p50 3."""
    bd = _bench_drift()
    for noise in (bd.Noise(0.02), bd.Noise(0.02, "t3")):
        f = bd.warm(noise, 200, 2, 1.0, seed=300)
        d = bd.delays(f, 30, lambda f, i: bd.slow_all(f, math.log(1.05)) if i == 0 else None)
        assert np.percentile(d, 50, method="inverted_cdf") <= 3, noise.label()
        assert np.percentile(d, 90, method="inverted_cdf") <= 6, noise.label()


def test_energy_of_an_ar1_runtime_raises_no_false_alarm_of_the_pooled_statistic():
    """AR(1) 0.95 runtime at 2%, power 1% iid: energy is no AR(1), its innovations wander
    together. The pooled statistic was not widened for that (only the probes' own
    CUSUMs), and neither were the long-run scales the slow level's error comes from: 3.4
    false alarms per GPU-year, energy, all through a GPU's life (issue 23 said "first
    day")."""
    bd = _bench_drift()
    alarms = np.zeros(3)
    for seed in (1, 3):  # 150 GPUs x 3 days each: 7 alarms before (5 of them energy)
        f = bd.Fleet(150, 2, bd.Noise(0.02, phi=0.95), np.random.default_rng(seed))
        for _ in range(3 * bd.DAY):
            alarms += f.step().sum(axis=0)
    assert alarms.sum() <= 1, alarms


def test_a_step_at_the_trough_of_a_daily_cycle_is_judged_against_where_the_gpu_was():
    """A +-2% daily cycle (temperature) is tolerated; a 5% slowdown at its trough shows as
    3% against the card's normal, within the allowance (3.4%) that made the cycle
    harmless: before, only the slow level caught it, hours later. The pooled CUSUM's
    reference now follows the cycle (the band, within the tolerance), and judges the step
    against where the GPU was."""
    rng = np.random.default_rng(46)
    mon = DriftMonitor(DriftConfig(targets=("runtime",)))
    trough = 720 + 540  # sin = -1 a day and three quarters in
    t = np.arange(trough + 20)
    values = 0.02 * np.sin(2 * math.pi * t / 720)[:, None] + rng.normal(0, 0.01, (len(t), 2))
    values[trough:] += math.log(1.05)
    raised = _run(mon, "g", values, 0)
    assert raised and raised[0][0] >= trough and raised[0][0] - trough + 1 <= 8, raised
    dev = mon.devices["g"].targets["runtime"]
    assert dev.reason == "step" and dev.band < -0.01


def test_heavy_tails_widen_a_scale_and_gaussian_noise_or_a_slowdown_do_not():
    """A Student-t with 3 degrees of freedom hides a third of its variance beyond the 4
    scales a track learns within: its CUSUM, built for Gaussian noise, saw two or three
    heavy results close together as a shift (t3 at 3%: 1.7 false alarms per GPU-year once
    a probe's track needs three results, not four). Its lower tail says so."""
    from gemmd.drift.series import start, step, tail_factor

    rng = np.random.default_rng(47)
    n, cols = 1500, 100
    t3 = 0.02 * rng.standard_t(3, (n, cols)) / math.sqrt(3)
    gauss = rng.normal(0, 0.02, (n, cols))
    got = {}
    for name, x in (("t3", t3), ("gauss", gauss)):
        s = start(x[:10])
        for t in range(10, n):
            step(s, x[t], gain=1.0, floor=0.01, learn=True, shift=0.05, arl0=2e6,
                 kappa=math.log(1.035), tails=True)
        got[name] = tail_factor(s)
    assert np.median(got["t3"]) > 1.08 and np.mean(got["gauss"] > 1.0) < 0.2
    assert np.median(got["gauss"]) == 1.0
    # A slowdown is no tail: its first results are in control, above, never below.
    s = start(gauss[:10])
    for t in range(10, n):
        step(s, gauss[t] + (0.2 if t > n - 3 else 0.0), gain=1.0, floor=0.01, learn=True,
             shift=0.05, arl0=2e6, kappa=math.log(1.035), tails=True)
    assert np.median(tail_factor(s)) == 1.0


def test_the_plan_cost_counts_a_checks_own_time_not_its_dtypes_first_use():
    """On the H200 the first check of bf16 and of fp32 (the 8192^3 probes, checked first)
    cost +0.22 s, the later ones of the same dtypes at most +0.03 s; the cost model
    charged every tenth probe the 0.22 s (0.044 s a round)."""
    bd = _bench_drift()
    import csv

    steady, first = bd.check_costs(list(csv.DictReader(open(bd.PLAN_CSV))))
    assert first["bf16"] > 0.2 and first["fp32"] > 0.2
    assert 0.0 <= steady < 0.05
    costs = bd.plan_costs()
    assert all(c["check"] == steady for c in costs.values())
    plain = sum(costs[(s.name, 0.5, 0.02)]["elapsed"] for s in bd.default_plan())
    assert bd.plan_cost(bd.default_plan(), 0.5, costs) < plain + 0.01


def test_one_sided_noise_widens_a_scale_by_its_upper_tail():
    """Real noise is often one-sided: a neighbour's burst or a busy host slows a GPU,
    nothing speeds it up. A shifted exponential has no lower tail at all, so the tail
    factor, measured below only, stayed 1 and the CUSUM took its frequent slow results
    for a shift: 8.5 false alarms per GPU-year at 2%, 17 at 3% (bench/drift.py)."""
    from gemmd.drift.series import start, step, tail_factor

    rng = np.random.default_rng(48)
    n, cols = 1500, 100
    x = 0.03 * (rng.exponential(1.0, (n, cols)) - 1.0)
    s = start(x[:10])
    for t in range(10, n):
        step(s, x[t], gain=1.0, floor=0.01, learn=True, shift=0.05, arl0=2e6,
             kappa=math.log(1.035), tails=True)
    assert np.median(tail_factor(s)) > 1.2
    assert np.median(s["tail"]) == 0.0  # nothing below: the upper side decides


def test_one_sided_noise_raises_no_false_alarm():
    bd = _bench_drift()
    alarms = np.zeros(3)
    # 150 GPUs x 3 days at 3%: 21 alarms before (runtime and energy probe tracks)
    f = bd.Fleet(150, 2, bd.Noise(0.03, "exp"), np.random.default_rng(5))
    for _ in range(3 * bd.DAY):
        alarms += f.step().sum(axis=0)
    assert alarms.sum() <= 2, alarms


def test_the_pooled_statistic_is_judged_as_a_probe_while_young_then_with_half_the_shift():
    from gemmd.drift.device import fast_allowance, pooled_settings
    from gemmd.drift.params import DEVICE_YOUNG_N
    from gemmd.drift.series import allowance

    young = pooled_settings(10.0, 0.03, 100.0, 0.05, 0.02)
    old = pooled_settings(float(DEVICE_YOUNG_N), 0.03, 100.0, 0.05, 0.02)
    # While young, as a probe's track: the allowance half way between the tolerance and
    # the shift, the autocorrelation's and the noise's bounds as wide; then half the shift.
    assert float(young["kappa"]) == pytest.approx(allowance(0.05, 0.02))
    assert float(old["kappa"]) == pytest.approx(fast_allowance(0.05))
    assert fast_allowance(0.05) < allowance(0.05, 0.02)
    assert young["phi_z"] > old["phi_z"] and young["chi_z"] > old["chi_z"]
    # Both judged against the band, used within the tolerance.
    for how in (young, old):
        assert float(how["offset"]) == pytest.approx(100.0 * math.log(1.02))
    assert pooled_settings(1e4, 0.03, 100.0, 0.05, 0.0)["offset"] == 0  # no tolerance


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
        for _ in range(150):  # an alarm clears after an hour (30 rounds) without evidence
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
                                                             baseline_probes=5))
    rt = runtime.build(cfg)
    try:
        assert rt.state.drift.p is cfg.drift
        assert rt.state.drift.path == tmp_path / "drift.json"
    finally:
        rt.close_devices()
        rt.store.close()
