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
from gemmd.drift import DriftMonitor, Track, update
from gemmd.gemm import ProbeSpec

P = {"shift": 0.05, "arl0": 5e6, "baseline_probes": 5, "min_scale": 0.01}
SPEC = ProbeSpec(4096, 4096, 4096, "bf16")


def _feed(track, residuals, sigma=0.02, now=0.0):
    return [update(track, r, sigma, now=now, **P) for r in residuals]


def test_reference_absorbs_a_steady_offset_and_noise_raises_no_alarm():
    rng = np.random.default_rng(1)
    tr = Track()
    # A card 3% slower than the model, with 0.5% probe noise, for 20,000 rounds.
    raised = _feed(tr, math.log(1.03) + rng.normal(0, 0.005, 20_000))
    assert not any(raised) and not tr.drifting
    assert math.exp(tr.reference) == pytest.approx(1.03, abs=0.005)
    assert tr.scale == pytest.approx(0.01)  # the floor: 0.5% noise is below min_scale


def test_a_5_percent_slowdown_alarms_within_3_rounds_and_clears_after():
    tr = Track()
    _feed(tr, [0.0] * 5)
    assert tr.scale == 0.01  # noise-free baseline: the floor, k = log(1.05) / 0.02 ~ 2.44
    raised = _feed(tr, [math.log(1.05)] * 3)
    assert True in raised[:3] and tr.drifting and tr.alarms == 1
    _feed(tr, [0.0] * 20)  # back to normal: CUSUM drains to 0 and the alarm clears
    assert not tr.drifting and tr.cusum == 0.0


def test_scale_is_the_probes_own_noise_or_the_floor():
    import statistics

    from gemmd.drift import long_run_scale, upper_bound_factor

    tr = Track()
    base = [0.0, 0.04, -0.04, 0.02, -0.02]
    _feed(tr, base, sigma=0.5)
    sd = statistics.stdev(base)
    # The 99% upper bound of a 5-sample estimate (chi-square, 4 degrees of freedom: 3.67
    # exactly, 4.0 by Wilson-Hilferty); the lag-1 autocorrelation here is negative: no boost.
    assert tr.scale == pytest.approx(sd * upper_bound_factor(5))
    assert 3.6 < upper_bound_factor(5) < 4.1 and 2.0 < upper_bound_factor(10) < 2.2
    # The widening shrinks as the estimate learns from in-control results.
    for _ in range(300):
        update(tr, 0.0 + 0.02 * (-1) ** _, 0.5, now=0, **P)
    assert tr.n > 90 and long_run_scale(tr.var, tr.cov, 0.0, tr.n) < \
        1.25 * long_run_scale(tr.var, tr.cov, 0.0)
    tr = Track()  # the model's sigma counts only when asked to
    for r in [0.0] * 5:
        update(tr, r, 0.3, now=0, use_model_sigma=True, **P)
    assert tr.scale == 0.3


def test_threshold_follows_the_wanted_false_alarm_rate():
    from gemmd.drift import threshold

    k1, k3 = math.log(1.05) / 0.02, math.log(1.05) / 0.06
    assert threshold(k1, 5e6) < threshold(k3, 5e6)  # noisier probe: higher bar
    assert threshold(k1, 5e6) < threshold(k1, 5e9)
    # Siegmund: ARL0 = (exp(2kb) - 2kb - 1) / 2k^2 with b = h + 1.166.
    b = threshold(k3, 5e6) + 1.166
    assert (math.exp(2 * k3 * b) - 2 * k3 * b - 1) / (2 * k3**2) == pytest.approx(5e6, rel=1e-6)


def test_faster_than_predicted_never_alarms():
    tr = Track()
    _feed(tr, [0.0] * 5)
    assert not any(_feed(tr, [math.log(0.8)] * 50)) and tr.cusum == 0.0


def test_monitor_targets_device_flag_rebaseline_and_persistence(tmp_path):
    path = tmp_path / "drift.json"
    mon = DriftMonitor(DriftConfig(**P), path)
    meas = {"runtime": 1.0, "power": 500.0, "energy": 0.5}
    sig = {"runtime": 0.02, "power": 0.02, "energy": 0.02}
    for _ in range(5):
        assert mon.observe("GPU-a", SPEC, meas, meas, sig) == []
    slow = {"runtime": 1.06, "power": 500.0, "energy": 0.53}
    raised = [mon.observe("GPU-a", SPEC, slow, meas, sig) for _ in range(3)]
    assert ["runtime", "energy"] in raised  # power unchanged: no alarm for it
    assert mon.device_drifting("GPU-a") and not mon.device_drifting("GPU-b")
    mon.model_version = "rf-3"
    mon.save()
    again = DriftMonitor(DriftConfig(**P), path)
    assert again.device_drifting("GPU-a") and again.model_version == "rf-3"
    assert again.rebaseline("GPU-a") == 3
    assert not again.device_drifting("GPU-a")
    assert again.tracks[("GPU-a", SPEC, "runtime")].alarms == 1  # history kept


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


def test_damaged_state_file_starts_over(tmp_path, caplog):
    path = tmp_path / "drift.json"
    path.write_text("{not json")
    mon = DriftMonitor(DriftConfig(**P), path)
    assert mon.tracks == {} and "unreadable" in caplog.text


def test_rereference_keeps_an_alarm_under_a_new_model():
    mon = DriftMonitor(DriftConfig(**P, targets=("runtime",)))
    base, sig = {"runtime": 1.0}, {"runtime": 0.02}
    for _ in range(5):
        mon.observe("g", SPEC, base, base, sig)
    for _ in range(4):
        mon.observe("g", SPEC, {"runtime": 1.1}, base, sig)
    assert mon.device_drifting("g")
    mon.rereference("g", SPEC, "runtime", [0.01] * 8, 0.02)
    assert mon.device_drifting("g")
    assert mon.tracks[("g", SPEC, "runtime")].reference == pytest.approx(0.01)


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


def test_daemon_flags_a_slowed_device_only_and_rebaseline_unflags(tmp_path):
    from gemmd.daemon import Daemon
    from gemmd.exporter import assemble
    from gemmd.rebaseline import REQUEST as REBASELINE_REQUEST

    d = Daemon(_cfg(tmp_path))
    try:
        for _ in range(8):
            for r in d.runners:
                r.run_round()
        # Drift needs a fitted model: the roofline's interval spans 2x, a 5% step is noise.
        assert d.registry.refit() == "accepted"
        d.rereference()
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
        assert reg.get_sample_value("gemmd_device_drifting", lab) == 1
        assert reg.get_sample_value("gemmd_drift_alarms_total", {**lab, "target": "runtime"}
                                    ) == 2  # both sentinels
        assert reg.get_sample_value("gemmd_device_drifting", {
            "gpu": "0", "uuid": uuid0, "gpu_model": slowed.device.info.name}) == 0
        # gemmd status says which GPU drifts, on what, by how much (drift.json saved).
        d._save_drift()
        r = subprocess.run([sys.executable, "-m", "gemmd", "status", "--state-dir",
                            str(tmp_path)], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        gpu1 = r.stdout[r.stdout.index("\nGPU 1"):]
        assert re.search(r"drift: 2 of \d+ tracks in alarm: blas-\w+-nn-4096x4096x4096 "
                         r"runtime x1\.0\d\d of normal", gpu1), gpu1
        assert "last probe 0m ago" not in gpu1 and re.search(r"last probe \d+s ago", gpu1)
        # The CLI's rebaseline: a request file and unflagged rows; the daemon applies it.
        r = subprocess.run([sys.executable, "-m", "gemmd", "rebaseline", "--state-dir",
                            str(tmp_path), "--device", "1"], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        assert json.loads((tmp_path / REBASELINE_REQUEST).read_text())["devices"] == [uuid1]
        assert not [r for r in d.store.probes(include_flagged=True) if r["flagged"]]
        d.apply_rebaseline_request()
        assert not d.state.drift.device_drifting(uuid1)
        assert not (tmp_path / REBASELINE_REQUEST).exists()
    finally:
        d.stop()


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


def test_one_outlier_cannot_raise_an_alarm_alone():
    tr = Track()
    _feed(tr, [0.0] * 5)
    assert _feed(tr, [math.log(3.0)]) == [False]  # z ~ 110, capped at 4: S = 1.56 < h 2.5
    assert _feed(tr, [0.0] * 3) == [False] * 3 and tr.cusum == 0.0


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
