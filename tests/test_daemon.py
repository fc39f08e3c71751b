"""The daemon's scheduling, in process."""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path

from conftest import HANG_S

from gemmd.config import Config, FakeConfig, FakeDeviceConfig, MeasureConfig, ProbeGroup
from gemmd.daemon import Daemon
from gemmd.store import Store


def test_a_hung_device_in_thread_isolation_does_not_log_every_interval(tmp_path, caplog):
    """A hung round kept its job instance busy, and APScheduler warned 'maximum number of
    running instances reached' at every interval, forever."""
    base = Config()
    probes = dataclasses.replace(
        base.probes, exploration=(),
        sentinels=(ProbeGroup(shapes=((1024, 1024, 1024),), dtypes=("fp32",)),),
        measure=MeasureConfig(window_s=0.2, warmup_s=0.0, timeout_s=60))
    cfg = dataclasses.replace(
        base, backend="fake", isolation="thread", state_dir=str(tmp_path), probes=probes,
        listen=dataclasses.replace(base.listen, address="127.0.0.1", port=0),
        schedule=dataclasses.replace(base.schedule, probe_interval_s=1),
        budget=dataclasses.replace(base.budget, duty_cycle=1.0),
        fake=FakeConfig(devices=(FakeDeviceConfig(hang_on_call=1), FakeDeviceConfig())))
    d = Daemon(cfg)
    with caplog.at_level(logging.WARNING):
        d.start()
        try:
            # Three rounds of the other GPU: two intervals at least in which the hung round
            # still held its job (counted, not timed: a loaded machine runs fewer a second).
            healthy = d.state.devices[d.devices[1].info.uuid]
            _wait(lambda: healthy.probes_total[("sentinel", "ok")] >= 3,
                  "3 probes of the other GPU")
        finally:
            d.stop()
    assert "maximum number of running instances" not in caplog.text


def _busy_daemon(tmp_path, retry):
    base = Config()
    probes = dataclasses.replace(
        base.probes, exploration=(),
        sentinels=(ProbeGroup(shapes=((1024, 1024, 1024),), dtypes=("fp32",)),),
        measure=MeasureConfig(window_s=0.2, warmup_s=0.0))
    cfg = dataclasses.replace(
        base, backend="fake", isolation="thread", state_dir=str(tmp_path), probes=probes,
        listen=dataclasses.replace(base.listen, address="127.0.0.1", port=0),
        schedule=dataclasses.replace(base.schedule, probe_interval_s=60, busy_retry_s=retry),
        fake=FakeConfig(devices=(FakeDeviceConfig(other_utilization=0.5),)))
    return Daemon(cfg)


def _wait(pred, what: str, timeout: float = HANG_S) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"no {what} within {timeout:g} s"
        time.sleep(0.05)


def _run_until(d: Daemon, pred, what: str, timeout: float = HANG_S) -> Daemon:
    d.start()
    try:
        _wait(lambda: pred(d), what, timeout)
    finally:
        d.stop()
    return d


def _rounds(d: Daemon) -> int:
    return d.state.devices[d.devices[0].info.uuid].rounds_total


def test_a_round_skipped_as_busy_is_retried_soon_not_a_whole_interval_later(tmp_path):
    # Three rounds within half the 60 s probe interval can only be busy retries (0.5 s).
    d = _run_until(_busy_daemon(tmp_path / "a", retry=0.5), lambda d: _rounds(d) >= 3,
                   "3 rounds (busy retries)", timeout=30)
    ds = d.state.devices[d.devices[0].info.uuid]
    assert ds.skipped_total["utilization"] >= 3
    # Without busy retries, the first round is the only one (the next is 60 s later).
    d = _busy_daemon(tmp_path / "b", retry=0)
    d.start()
    try:
        _wait(lambda: _rounds(d) >= 1, "the first round")
        time.sleep(1.0)  # where retries every 0.5 s would have run twice more
    finally:
        d.stop()
    assert _rounds(d) == 1


def test_busy_retries_back_off_from_5_s_to_busy_retry_s():
    from gemmd.daemon import busy_backoff_s

    assert [busy_backoff_s(n, 30.0) for n in range(1, 6)] == [5.0, 10.0, 20.0, 30.0, 30.0]
    assert busy_backoff_s(3, 0.0) == 0.0 and busy_backoff_s(0, 30.0) == 0.0
    assert busy_backoff_s(10_000, 86400.0) == 86400.0  # no overflow


def test_the_refit_job_records_each_outcome_in_the_state_once(tmp_path):
    """The registry returns what a refit did; the daemon's refit job alone records it, and
    the exporter shows it."""
    from gemmd.exporter import assemble

    base = Config()
    probes = dataclasses.replace(
        base.probes,
        sentinels=(ProbeGroup(shapes=((1024, 1024, 1024), (4096, 4096, 4096)),
                              dtypes=("bf16", "fp32")),),
        measure=MeasureConfig(window_s=0.1, warmup_s=0.0))
    cfg = dataclasses.replace(
        base, backend="fake", isolation="thread", state_dir=str(tmp_path), probes=probes,
        listen=dataclasses.replace(base.listen, address="127.0.0.1", port=0),
        budget=dataclasses.replace(base.budget, duty_cycle=1.0),
        model=dataclasses.replace(base.model, min_samples=10, n_estimators=10),
        fake=FakeConfig(devices=(FakeDeviceConfig(),)))
    d = Daemon(cfg)
    try:
        d.refit()  # nothing stored yet
        assert d.state.model.refits_total == {"insufficient_data": 1}
        for _ in range(3):
            d.runners[0].run_round()
        d.refit()
        d.refit()  # no probes since the last fit: the model stays
        model = d.state.model
        assert model.refits_total == {"insufficient_data": 1, "accepted": 1, "rejected": 1}
        assert model.version == d.registry.current.version != "roofline"
        g = assemble(d.state, process=False).get_sample_value
        for outcome, n in (("insufficient_data", 1), ("accepted", 1), ("rejected", 1),
                           ("failed", 0)):
            assert g("gemmd_model_refits_total", {"outcome": outcome}) == n
        assert g("gemmd_model_last_refit_timestamp_seconds") == model.last_refit_ts > 0
        # For the record, in the store's events: the model activated, the refit rejected.
        (activated,) = d.store.events(kinds=("model",))
        assert activated["device_uuid"] is None
        det = activated["detail"]
        assert (det["version"], det["kind"]) == (model.version, "random_forest")
        assert det["rows"] == model.n_samples > 0 and det["reason"].startswith("refit accepted")
        (rejected,) = d.store.events(kinds=("refit_rejected",))
        assert rejected["detail"]["version"] == model.version
        assert "no probes since" in rejected["detail"]["reason"]
    finally:
        d.stop()
    # A restart loads the same model: no second model event.
    d = Daemon(cfg)
    d.start()  # loads the active model before it returns
    d.stop()
    assert d.state.model.version == model.version
    store = Store(tmp_path / "gemmd.db")
    try:
        assert [e["detail"]["version"] for e in store.events(kinds=("model",))] == \
            [model.version]
    finally:
        store.close()


def _refit_cfg(tmp_path, trees: int = 10):
    base = Config()
    probes = dataclasses.replace(
        base.probes,
        sentinels=(ProbeGroup(shapes=((1024, 1024, 1024), (4096, 4096, 4096)),
                              dtypes=("bf16", "fp32")),),
        measure=MeasureConfig(window_s=0.1, warmup_s=0.0))
    return dataclasses.replace(
        base, backend="fake", isolation="thread", state_dir=str(tmp_path), probes=probes,
        listen=dataclasses.replace(base.listen, address="127.0.0.1", port=0),
        budget=dataclasses.replace(base.budget, duty_cycle=1.0),
        model=dataclasses.replace(base.model, min_samples=10, n_estimators=trees),
        fake=FakeConfig(devices=(FakeDeviceConfig(),)))


def test_a_refit_in_a_child_process_registers_the_model_the_daemon_then_loads(tmp_path):
    """`gemmd run` refits in a child process (its working set leaves with it): the child
    fits and registers; the daemon loads the model from the store and records the outcome,
    as after a refit in its own process."""
    d = Daemon(_refit_cfg(tmp_path), refit_process=True)
    try:
        d.refit()  # nothing stored yet
        for _ in range(3):
            d.runners[0].run_round()
        d.refit()
        d.refit()  # no probes since: rejected, the model stays
        model = d.state.model
        assert model.refits_total == {"insufficient_data": 1, "accepted": 1, "rejected": 1}
        assert model.version == d.registry.current.version == "rf-1"
        assert d.registry.current.kind == "random_forest"
        assert d._refits is not None and d._refits.peak_mib and d._refits.peak_mib > 0
        (activated,) = d.store.events(kinds=("model",))
        assert activated["detail"]["version"] == "rf-1"
        assert d._refits._child is None  # gone, and reaped
    finally:
        d.stop()


def test_a_refit_process_failure_is_one_line_and_counted(tmp_path, caplog):
    """The child's error (here: the model directory is a file, so the model cannot be
    written) is logged once by the daemon, counted as a failed refit, not raised."""
    d = Daemon(_refit_cfg(tmp_path), refit_process=True)
    try:
        for _ in range(3):
            d.runners[0].run_round()
        (tmp_path / "models").write_text("not a directory")
        caplog.set_level(logging.INFO)
        d.refit()
        d.refit()
        assert d.state.model.refits_total["failed"] == 2
        errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR
                  and r.name == "gemmd.daemon"]
        assert len(errors) == 1 and errors[0].startswith("refit failed: "), errors
        assert d.registry.current.kind == "roofline"
    finally:
        d.stop()


def test_stopping_ends_a_refit_in_its_child_process_at_once(tmp_path):
    """A refit in a child ends with the stop (SIGTERM: a model being registered is finished
    first), not at the stop deadline; nothing half-written stays."""
    import threading

    from gemmd.daemon import STOP_TIMEOUT_S

    d = Daemon(_refit_cfg(tmp_path, trees=5000), refit_process=True)
    for _ in range(3):
        d.runners[0].run_round()
    t = threading.Thread(target=d.refit)
    t.start()
    _wait(lambda: d._refits is not None and d._refits._child is not None, "the refit child")
    child = d._refits._child
    t0 = time.monotonic()
    clean = d.stop()
    took = time.monotonic() - t0
    t.join(timeout=HANG_S)
    assert not t.is_alive() and clean
    assert child.poll() is not None  # reaped
    assert took < STOP_TIMEOUT_S
    assert not list((tmp_path / "models").glob(".tmp-*"))
    store = Store(tmp_path / "gemmd.db")
    try:  # either stopped before registering (usually) or registered whole
        for rec in store.models():
            assert Path(rec["path"]).is_file(), rec
    finally:
        store.close()


def test_a_stop_that_interrupts_an_import_in_the_refit_child_is_a_stop(tmp_path, monkeypatch,
                                                                       caplog, capsys):
    """The SIGTERM's SystemExit raised inside an extension's module init comes out as
    that extension's ImportError ("initialization failed": scipy's HiGHS, in CI's fuzz
    of `gemmd run`): the child answers "stopped", with no traceback in the log."""
    import io
    import json
    import os
    import signal

    from gemmd import refit
    from gemmd.config import ModelConfig

    def interrupted(self, *args, **kwargs):
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(HANG_S)  # the handler raises SystemExit here
        except SystemExit:
            raise ImportError("initialization failed") from None  # as pybind11's init does
        raise AssertionError("no SIGTERM")

    monkeypatch.setattr(refit._ChildRegistry, "refit", interrupted)
    job = {"state_dir": str(tmp_path), "model": dataclasses.asdict(ModelConfig()),
           "sources": ["daemon"], "force": False, "log_level": "info"}
    out = io.StringIO()
    before = signal.getsignal(signal.SIGTERM)
    try:
        assert refit.child_main(io.StringIO(json.dumps(job)), out) == 0
    finally:
        signal.signal(signal.SIGTERM, before)
    assert json.loads(out.getvalue())["error"] == "stopped"
    assert not [r for r in caplog.records if r.exc_info or "refit failed" in r.getMessage()]
    assert "Traceback" not in capsys.readouterr().err


def test_a_new_state_directory_logs_one_store_line_not_one_per_migration(tmp_path, caplog):
    from gemmd.store import SCHEMA_VERSION

    caplog.set_level(logging.INFO, logger="gemmd.store")
    Store(tmp_path / "gemmd.db").close()
    lines = [r.getMessage() for r in caplog.records if r.name == "gemmd.store"]
    assert [ln for ln in lines if "schema" in ln] == \
        [f"store {tmp_path / 'gemmd.db'}: created (schema {SCHEMA_VERSION})"], lines
    caplog.clear()
    Store(tmp_path / "gemmd.db").close()  # nothing to migrate: nothing said about it
    assert not [r for r in caplog.records if "schema" in r.getMessage()]
