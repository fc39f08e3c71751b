"""Probe rounds on fake devices: outcomes, skips, budget, failures, down/backoff, isolation."""

from __future__ import annotations

import dataclasses
import functools
import threading
import time

import numpy as np
import pytest
from conftest import HANG_S, ManualClock

from gemmd.config import (
    Config,
    ExplorationConfig,
    FakeDeviceConfig,
    MeasureConfig,
    ProbeGroup,
    ProbesConfig,
)
from gemmd.devices.fake import FakeDevice
from gemmd.registry import ModelRegistry
from gemmd.rounds import DeviceRunner
from gemmd.state import State
from gemmd.store import Store


def _cfg(**over) -> Config:
    probes = ProbesConfig(
        sentinels=(ProbeGroup(shapes=((1024, 1024, 1024), (2048, 2048, 2048)),
                              dtypes=("bf16", "fp32")),),
        exploration=(ExplorationConfig(per_round=2, m=(256, 1024), n=(256, 1024),
                                       k=(256, 1024)),),
        measure=MeasureConfig(window_s=0.1, warmup_s=0.0, check_every=2))
    cfg = Config(backend="fake", probes=probes)
    sched = dataclasses.replace(cfg.schedule, probe_interval_s=10, max_failures=2)
    budget = dataclasses.replace(cfg.budget, duty_cycle=1.0)
    return dataclasses.replace(cfg, schedule=sched, budget=budget, **over)


@pytest.fixture
def env(tmp_path, simulated_fake_clock):
    """Runners on fake GPUs whose probes take simulated device time only, on a host clock
    that stands still unless a test moves it: the duty-cycle budget counts the same probes
    on an idle and on a loaded machine."""
    store = Store(tmp_path / "gemmd.db")
    state = State()

    def make(dev_cfg=None, cfg=None, index=0, clock=None):
        cfg = cfg or _cfg()
        dev = FakeDevice(index, dev_cfg or FakeDeviceConfig())
        store.upsert_device(dev.info.uuid, index, dev.info.name, "fake",
                            dataclasses.asdict(dev.info))
        reg = ModelRegistry(store, tmp_path / "models", cfg.model, state)
        return DeviceRunner(dev, cfg, store, state, reg, clock=clock or ManualClock(),
                            rng=np.random.default_rng(index)), dev

    yield make, store, state
    store.close()


def test_round_runs_sentinels_then_exploration_and_stores_all(env):
    make, store, state = env
    runner, dev = make()
    results = runner.run_round()
    assert [r.kind for r in results] == ["sentinel"] * 4 + ["exploration"] * 2
    assert all(r.outcome == "ok" for r in results)
    rows = store.probes()
    assert len(rows) == 6 and {r["kind"] for r in rows} == {"sentinel", "exploration"}
    assert all(r["pred_runtime_s"] and r["model_version"] == "roofline" for r in rows)
    ds = state.devices[dev.info.uuid]
    assert ds.probes_total[("sentinel", "ok")] == 4
    assert ds.probes_total[("exploration", "ok")] == 2
    # Only sentinels reach the exporter's state (bounded label cardinality).
    assert len(state.probes) == 4
    assert ds.context["sm_clock_hz"] > 0 and ds.up


def test_exploration_runs_in_one_round_of_every_n(env):
    """An exploration probe costs a GPU what a sentinel does (~0.7 s of an H200): with
    every_rounds 3 it runs in rounds 1, 4, 7 of those that probe (a busy round, skipped,
    does not count), so its cost is a third of a probe a round."""
    make, store, _ = env
    base = _cfg()
    cfg = dataclasses.replace(base, probes=dataclasses.replace(
        base.probes, exploration=(dataclasses.replace(base.probes.exploration[0],
                                                      every_rounds=3),)))
    runner, dev = make(cfg=cfg)
    kinds = []
    for i in range(7):
        if i == 2:
            dev.cfg = dataclasses.replace(dev.cfg, busy=True)
            assert runner.run_round() == []
            dev.cfg = dataclasses.replace(dev.cfg, busy=False)
        kinds.append(sum(r.kind == "exploration" for r in runner.run_round()))
    assert kinds == [2, 0, 0, 2, 0, 0, 2]
    assert sum(r["kind"] == "exploration" for r in store.probes()) == 6


def test_exploration_is_not_starved_when_the_budget_cuts_rounds(env):
    """Rounds cut short by the duty-cycle budget start where the last one stopped; a group
    that explores every 10th round stays due until its draw has run. Before, the cycle's
    offset left the draw out of every round it was due in (6 sentinels, room for 3 a
    round: none of the 10 due draws ran in 100 rounds)."""
    make, store, _ = env
    base = _cfg()
    probes = dataclasses.replace(
        base.probes, sentinels=(ProbeGroup(shapes=((1024,) * 3, (2048,) * 3, (512,) * 3),
                                           dtypes=("bf16", "fp32")),),
        exploration=(dataclasses.replace(base.probes.exploration[0], per_round=1,
                                         every_rounds=10),))
    runner, _ = make(cfg=dataclasses.replace(base, probes=probes))
    runner.budget_s = 0.35  # 0.1 s windows: 3 probes a round
    ran = [sum(r.kind == "exploration" and r.outcome == "ok" for r in runner.run_round())
           for _ in range(100)]
    assert sum(ran) >= 8, ran
    # and the sentinels still take turns: each ran about as often as the others
    counts: dict[str, int] = {}
    for r in store.probes():
        if r["kind"] == "sentinel":
            counts[r["dtype"] + str(r["m"])] = counts.get(r["dtype"] + str(r["m"]), 0) + 1
    assert len(counts) == 6 and max(counts.values()) - min(counts.values()) <= 3, counts


def test_each_result_is_stored_with_its_prediction_interval(env):
    """The interval the predictor gave, per target, stored with the point: the roofline's
    (runtime only) before a fit, the forest's (every target) after."""
    from gemmd.features import spec_of

    make, store, _ = env
    cfg = _cfg()
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, min_samples=10,
                                                             n_estimators=10))
    runner, dev = make(cfg=cfg)
    runner.run_round()
    rows = store.probes()
    assert rows and all(r["model_version"] == "roofline" for r in rows)
    for r in rows:
        assert r["pred_runtime_lo"] < r["pred_runtime_s"] < r["pred_runtime_hi"]
        assert r["pred_power_lo"] is r["pred_power_hi"] is r["pred_energy_lo"] is None
    for _ in range(2):
        runner.run_round()
    assert runner.registry.refit().outcome == "accepted"
    runner.run_round()
    version = runner.registry.current.version
    fitted = [r for r in store.probes() if r["model_version"] == version]
    assert len(fitted) == 6
    for r in fitted:
        (p,), _ = runner.registry.predict([spec_of(r)], [dev.info])
        for t, point in (("runtime", "pred_runtime_s"), ("power", "pred_power_w"),
                         ("energy", "pred_energy_j")):
            lo, hi = r[f"pred_{t}_lo"], r[f"pred_{t}_hi"]
            assert lo < r[point] < hi
            assert (lo, hi) == pytest.approx((getattr(p, f"{t}_lo"), getattr(p, f"{t}_hi")))


def test_correctness_checked_every_nth_probe_of_a_spec(env):
    make, store, _ = env
    runner, _ = make()
    for _ in range(3):
        runner.run_round()
    checked = [r for r in store.probes() if r["kind"] == "sentinel" and r["check_ok"]]
    assert len(checked) == 8  # rounds 1 and 3 of 3, 4 sentinels each (check_every=2)


def test_busy_device_is_skipped_and_counted(env):
    make, store, state = env
    runner, dev = make(FakeDeviceConfig(busy=True))
    assert runner.run_round() == []
    assert state.devices[dev.info.uuid].skipped_total["other_processes"] == 4
    assert store.probes() == []


def test_duty_cycle_budget_skips_the_rest_of_the_round(env):
    make, _, state = env
    cfg = _cfg()
    cfg = dataclasses.replace(cfg, budget=dataclasses.replace(cfg.budget, duty_cycle=0.025))
    runner, dev = make(cfg=cfg)  # 0.25 s per round; each probe ~0.1 s of device time
    results = runner.run_round()
    ran = [r for r in results if r.outcome == "ok"]
    skipped = [r for r in results if r.outcome == "skipped"]
    assert 1 <= len(ran) <= 3 and len(ran) + len(skipped) == 6
    assert state.devices[dev.info.uuid].skipped_total["duty_cycle"] == len(skipped)


def test_failing_device_goes_down_backs_off_and_comes_back(env, monkeypatch):
    make, store, state = env
    runner, dev = make(FakeDeviceConfig(fail_on_call=1))
    ds = state.devices[dev.info.uuid]
    r1 = runner.run_round()
    assert [r.outcome for r in r1] == ["failed"] and ds.up  # one failure: still up
    runner.run_round()
    assert not ds.up and ds.down_reason == "failed" and ds.consecutive_failures == 2
    assert ds.next_retry > runner._clock()
    # While backing off, rounds are skipped without touching the device.
    calls = dev._calls
    assert runner.run_round() == []
    assert dev._calls == calls and ds.skipped_total["device_down"] == 4
    failed = store.probes(outcome="failed")
    assert len(failed) == 2 and "injected failure" in failed[0]["error"]
    # The device recovers: the retry succeeds and it is up again.
    dev.cfg = FakeDeviceConfig()
    ds.next_retry = 0
    assert all(r.outcome == "ok" for r in runner.run_round())
    assert ds.up and ds.consecutive_failures == 0


def test_backoff_doubles_up_to_the_cap(env):
    make, _, state = env
    runner, dev = make(FakeDeviceConfig(fail_on_call=1))
    ds = state.devices[dev.info.uuid]
    waits = []  # the backoff, on the runner's (manual, monotonic) clock
    for _ in range(6):
        ds.next_retry = 0
        runner.run_round()
        waits.append(ds.next_retry - runner._clock() if not ds.up else 0)
    assert waits[1:4] == [10, 20, 40]


def test_backoff_is_not_stretched_by_a_wall_clock_jump(env, monkeypatch):
    """The retry time is on the monotonic clock: the wall clock set back a day (NTP, a
    bad RTC) must not keep a recovered device down for a day (it did: time.time())."""
    make, _, state = env
    clock = ManualClock()
    runner, dev = make(FakeDeviceConfig(fail_on_call=1), clock=clock)
    ds = state.devices[dev.info.uuid]
    runner.run_round()
    runner.run_round()
    assert not ds.up and ds.next_retry - clock() == 10
    dev.cfg = FakeDeviceConfig()
    wall = time.time()
    monkeypatch.setattr(time, "time", lambda: wall - 86400)  # the wall clock goes back a day
    clock.advance(11)
    assert all(r.outcome == "ok" for r in runner.run_round())
    assert ds.up


def test_one_hung_device_does_not_stop_another(env):
    make, _, state = env
    hung, hdev = make(FakeDeviceConfig(hang_on_call=1), index=0)
    good, gdev = make(index=1)
    t = threading.Thread(target=hung.run_round, daemon=True)
    t.start()
    deadline = time.monotonic() + HANG_S  # until the hung probe is in flight, not 0.2 s
    while state.devices[hdev.info.uuid].in_flight_since is None:
        assert time.monotonic() < deadline, "the probe never started"
        time.sleep(0.01)
    assert all(r.outcome == "ok" for r in good.run_round())
    hung.mark_hung(state.devices[hdev.info.uuid].in_flight_since)
    assert not state.devices[hdev.info.uuid].up
    assert state.devices[hdev.info.uuid].down_reason == "hung"
    assert hung.run_round() == []  # the hung round still holds the device
    hdev.close()
    t.join(5)
    assert not t.is_alive()


def test_mismatch_is_recorded_and_counted(env, monkeypatch):
    make, store, state = env
    runner, dev = make()
    monkeypatch.setattr(dev, "check", lambda spec: (False, 0.5))
    results = runner.run_round()
    assert {r.outcome for r in results if r.kind == "sentinel"} == {"mismatch"}
    assert state.devices[dev.info.uuid].probes_total[("sentinel", "mismatch")] == 4
    # Exploration probes are checked on first sight too; none of them is used for training.
    assert len(store.probes(outcome="mismatch")) == 6 and store.probes() == []


def test_store_failure_keeps_measurement_and_counts_error(env, monkeypatch):
    make, store, state = env
    runner, _ = make()

    def broken(row):
        raise __import__("sqlite3").OperationalError("database or disk is full")

    monkeypatch.setattr(store, "insert_probe", broken)
    results = runner.run_round()
    assert all(r.outcome == "ok" for r in results)
    assert state.store_errors_total == 6 and len(state.probes) == 4


def test_a_round_does_not_restart_a_worker_it_saw_killed(tmp_path):
    """Timing a probe must not call into the device: after a hung probe's worker is killed,
    nothing in the round may start a new CUDA process (on a wedged GPU that would hang)."""
    from gemmd.devices.worker import WorkerDevice

    cfg = _cfg()
    cfg = dataclasses.replace(cfg, probes=dataclasses.replace(
        cfg.probes, measure=dataclasses.replace(cfg.probes.measure, timeout_s=2.0)))
    dev = WorkerDevice(functools.partial(FakeDevice, index=0,
                                         cfg=FakeDeviceConfig(hang_on_call=1), seed=0,
                                         noise=0.01, realtime=False, memory_budget=1 << 30),
                       "GPU 0")
    store, state = Store(tmp_path / "gemmd.db"), State()
    try:
        runner = DeviceRunner(dev, cfg, store, state,
                              ModelRegistry(store, tmp_path / "models", cfg.model, state))
        results = runner.run_round()
        assert [r.outcome for r in results] == ["failed"]
        assert "did not return within 2 s" in results[0].error
        assert dev.pid is None and dev.restarts == 0
        assert state.devices[dev.info.uuid].probe_seconds_total >= 2.0
    finally:
        dev.close()
        store.close()
    assert dev.restarts == 0  # nor does shutting down


@pytest.mark.parametrize("fake, sched, reason", [
    ({"other_utilization": 0.5}, {}, "utilization"),
    ({"other_utilization": 0.5}, {"busy_utilization": 0.6}, None),
    ({"other_memory_mb": 1024}, {}, "other_memory"),
    ({"other_memory_mb": 1024}, {"busy_memory_mb": 0}, None),
    ({"other_memory_mb": 1024}, {"busy_memory_mb": 2048}, None),
])
def test_each_busy_signal_skips_the_round_at_its_configured_threshold(env, fake, sched, reason):
    make, _, state = env
    cfg = _cfg()
    cfg = dataclasses.replace(cfg, schedule=dataclasses.replace(cfg.schedule, **sched))
    runner, dev = make(FakeDeviceConfig(**fake), cfg=cfg)
    results = runner.run_round()
    skipped = state.devices[dev.info.uuid].skipped_total
    if reason:
        assert results == [] and skipped[reason] == 4
    else:
        assert len(results) == 6 and not any(skipped.values())


def test_a_tight_budget_rotates_so_every_probe_runs_within_a_few_rounds(env):
    """Skipping by position always skipped the same probes (exploration last): with room
    for ~2 of 6 probes a round, 2 sentinels ran forever and the rest never."""
    make, _, state = env
    cfg = _cfg()
    cfg = dataclasses.replace(cfg, budget=dataclasses.replace(cfg.budget, duty_cycle=0.025))
    runner, dev = make(cfg=cfg)
    ran: list = []
    for _ in range(6):
        ran += [(r.kind, r.spec) for r in runner.run_round() if r.outcome == "ok"]
    assert {s for k, s in ran if k == "sentinel"} == set(runner.plan)
    assert sum(k == "exploration" for k, _ in ran) >= 2
    # While everything fits, the order stays put (no rotation, no extra thermal noise).
    full, _ = make(index=1)
    first = [r.spec for r in full.run_round() if r.kind == "sentinel"]
    assert [r.spec for r in full.run_round() if r.kind == "sentinel"] == first


def test_a_cpu_trial_busy_longer_than_busy_max_wait_probes_anyway_a_gpu_never(env):
    """The first minute of `make run` on a busy machine: the CPU backend (a trial, no GPU
    job to protect) waits for a quiet host at most schedule.busy_max_wait_s."""
    make, store, state = env
    base = _cfg()
    cfg = dataclasses.replace(base, schedule=dataclasses.replace(base.schedule,
                                                                 busy_max_wait_s=0.25))
    for index, backend, probes_anyway in ((0, "cpu", True), (1, "fake", False)):
        clock = ManualClock()
        runner, dev = make(FakeDeviceConfig(busy=True), cfg=cfg, index=index, clock=clock)
        dev.info = dataclasses.replace(dev.info, backend=backend)
        assert runner.run_round() == [] and runner.busy_skips == 1
        clock.advance(0.125)  # not yet busy_max_wait_s since the first skip
        assert runner.run_round() == [] and runner.busy_skips == 2
        clock.advance(0.125)  # now it is
        assert bool(runner.run_round()) is probes_anyway, backend
        assert runner.busy_skips == (0 if probes_anyway else 3)


def test_drift_arms_on_every_target_before_any_model_and_says_so(env):
    """Before the first fit the roofline predicts runtime only, and power and energy were
    not watched until a model existed (about 30 minutes on a 1-GPU host, issue 23). The
    rounds compare them with a stand-in (the power limit): every target arms after its
    baseline rounds, and gemmd_device_drift_armed says when."""
    from gemmd.exporter import assemble

    make, store, state = env
    base = _cfg()
    # Windows of the default 0.5 s: at least 4 of the energy counter's 100 ms steps fall
    # in each, spanning more than half of it, so power and energy are trusted in every
    # round. (0.3 s windows came out a little short now and then: 2 steps, 0.1 s apart,
    # too few; which probe it hit moved with the exploration shapes drawn, from the OS's
    # entropy until the runner took a seeded generator: 1 run in ~3 failed, issue 20.)
    cfg = dataclasses.replace(base, probes=dataclasses.replace(
        base.probes, measure=dataclasses.replace(base.probes.measure, window_s=0.5)))
    runner, dev = make(cfg=cfg)
    lab = {"gpu": "0", "uuid": dev.info.uuid, "gpu_model": dev.info.name}
    runner.run_round()
    reg = assemble(state, process=False)
    assert reg.get_sample_value("gemmd_device_drift_armed", {**lab, "target": "power"}) == 0
    for _ in range(state.drift.p.baseline_probes):
        runner.run_round()
    assert runner.registry.current.kind == "roofline"
    targets = state.drift.devices[dev.info.uuid].targets
    # Said in full when it fails (it failed once in a loaded run, issue 20): per target
    # whether the pooled statistic is armed and how many results each probe's track
    # learnt; per stored sentinel its energy method (only "steps" feeds power/energy).
    seen = {t: (targets[t].armed() if t in targets else None,
                sorted(len(tr.baseline) for (u, _, tt), tr in state.drift.tracks.items()
                       if u == dev.info.uuid and tt == t))
            for t in ("runtime", "power", "energy")}
    methods = [(r["dtype"], r["m"], r["outcome"], r["model_version"],
                (r["context"] or {}).get("after", {}).get("energy_method"))
               for r in store.probes(outcome=None) if r["kind"] == "sentinel"]
    assert all(armed for armed, _ in seen.values()), (seen, methods)
    reg = assemble(state, process=False)
    for t in ("runtime", "power", "energy"):
        assert reg.get_sample_value("gemmd_device_drift_armed", {**lab, "target": t}) == 1
    # Each result's context went with it (what names an alarm's cause).
    ctx = state.drift.devices[dev.info.uuid].contexts
    assert len(ctx) == len(runner.plan) and all(c["normal"] for c in ctx.values())


def test_a_slowed_device_alarms_with_its_cause_in_the_log_and_the_metrics(env, caplog):
    from gemmd.devices.fake import Scenario
    from gemmd.exporter import assemble

    make, store, state = env
    runner, dev = make()
    for _ in range(30):
        runner.run_round()
    dev.scenario = Scenario("thermal", 1.06)
    for _ in range(6):
        runner.run_round()
        if state.drift.target_drifting(dev.info.uuid, "runtime"):
            break
    ds = state.drift.devices[dev.info.uuid].targets["runtime"]
    assert ds.drifting and ds.cause == "clocks_thermal"
    assert "cause: SM clocks" in caplog.text and "hw_thermal_slowdown" in caplog.text
    reg = assemble(state, process=False)
    lab = {"gpu": "0", "uuid": dev.info.uuid, "gpu_model": dev.info.name,
           "target": "runtime", "reason": ds.reason, "cause": "clocks_thermal",
           "description": "SM clocks down: thermal slowdown"}
    assert reg.get_sample_value("gemmd_device_drift_cause", lab) == 1
    (event,) = [e for e in store.events(kinds=("alarm",)) if e["probe"] is None
                and e["target"] == "runtime"]
    assert event["detail"]["cause"] == "clocks_thermal"
