"""End to end: `gemmd run` as a real process, scraped over real HTTP, stopped by signals."""

from __future__ import annotations

import signal
import sqlite3

import yaml
from conftest import (
    FAST_FAKE,
    HANG_S,
    ROOT,
    STOP_GRACE_S,
    free_port,
    merge,
    scrape,
    wait_for,
    write_config,
)


def _labels_of(samples, **want):
    return [s for s in samples if all(s.labels.get(k) == v for k, v in want.items())]


def _db_rows(db) -> int:
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=10)
    try:
        return con.execute("SELECT COUNT(*) FROM probes").fetchone()[0]
    except sqlite3.OperationalError:  # created, not yet migrated
        return 0
    finally:
        con.close()


def test_run_scrape_sigterm_restart_keeps_history_and_model(tmp_path, daemon_factory):
    port, state = free_port(), tmp_path / "state"
    cfg = write_config(tmp_path / "gemmd.yaml", **merge(FAST_FAKE, {
        "listen": {"port": port}, "state_dir": str(state)}))
    d = daemon_factory(cfg)

    def series_and_model():
        m = scrape(port)
        meas = m.get("gemmd_probe_runtime_seconds", [])
        pred = m.get("gemmd_probe_runtime_predicted_seconds", [])
        info = m.get("gemmd_model_info", [])
        predicted = {tuple(sorted(s.labels.items())): s.value for s in pred}
        ratios = [s.value / predicted[key] for s in meas
                  if (key := tuple(sorted(s.labels.items()))) in predicted]
        # The first fits see a handful of probes; accuracy must come with data.
        if len(meas) == 10 and len(pred) == 10 and info and \
                info[0].labels["kind"] == "random_forest" and \
                len(ratios) == 10 and all(0.8 < r < 1.25 for r in ratios):
            return m
        return None

    m = wait_for(series_and_model, 90, "measured/predicted series from an accurate model", d)
    # Both fake GPUs, every sentinel (5 each), measured and predicted with identical labels.
    meas = {tuple(sorted(s.labels.items())) for s in m["gemmd_probe_runtime_seconds"]}
    pred = {tuple(sorted(s.labels.items())) for s in m["gemmd_probe_runtime_predicted_seconds"]}
    assert meas == pred
    assert {s.labels["gpu"] for s in m["gemmd_probe_runtime_seconds"]} == {"0", "1"}
    assert len(meas) == 10
    assert m["gemmd_probe_energy_joules"] and m["gemmd_probe_power_watts"]
    ok = _labels_of(m["gemmd_probes_total"], kind="sentinel", outcome="ok")
    assert sum(s.value for s in ok) >= 10
    # Exploration shapes are counted but never exported as labelled series.
    assert sum(s.value for s in _labels_of(m["gemmd_probes_total"], kind="exploration",
                                           outcome="ok")) >= 2
    assert all(s.value == 1 for s in m["gemmd_device_up"])
    version = m["gemmd_model_info"][0].labels["version"]
    assert version.startswith("rf-")

    rc, took = d.terminate()
    assert rc == 0 and took < STOP_GRACE_S, (rc, took, d.read_log())
    assert "Traceback" not in d.read_log()
    rows = _db_rows(state / "gemmd.db")
    assert rows >= 15

    # Restart: history and model are kept, and the last results are shown straight away.
    port2 = free_port()
    cfg2 = write_config(tmp_path / "gemmd2.yaml", **merge(FAST_FAKE, {
        "listen": {"port": port2}, "state_dir": str(state),
        "schedule": {"probe_interval_s": 3600}}))
    d2 = daemon_factory(cfg2)
    m2 = wait_for(lambda: scrape(port2), HANG_S, "restarted daemon", d2)
    assert m2["gemmd_model_info"][0].labels["version"] == version
    assert m2["gemmd_model_training_samples"][0].value >= 15
    assert m2.get("gemmd_probe_runtime_seconds"), "stored results were not restored"
    assert _db_rows(state / "gemmd.db") >= rows
    rc, took = d2.terminate()
    assert rc == 0 and took < STOP_GRACE_S


def test_sigkill_during_probing_loses_no_committed_result(tmp_path, daemon_factory):
    port, state = free_port(), tmp_path / "state"
    # Real time: each probe takes ~0.3 s, so the kill lands in the middle of one.
    cfg = write_config(tmp_path / "gemmd.yaml", **merge(FAST_FAKE, {
        "listen": {"port": port}, "state_dir": str(state),
        "fake": {"realtime": True},
        "probes": {"measure": {"window_s": 0.3}}}))
    d = daemon_factory(cfg)
    db = state / "gemmd.db"
    committed = wait_for(lambda: db.exists() and _db_rows(db) >= 3, 60, "3 committed rows", d)
    assert committed
    before = _db_rows(db)
    d.p.send_signal(signal.SIGKILL)
    d.p.wait(timeout=10)
    con = sqlite3.connect(str(db))
    try:
        assert con.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        assert con.execute("SELECT COUNT(*) FROM probes").fetchone()[0] >= before
    finally:
        con.close()


def test_sigterm_abandons_a_hung_probe_within_the_stop_grace(tmp_path, daemon_factory):
    port, state = free_port(), tmp_path / "state"
    cfg = write_config(tmp_path / "gemmd.yaml", **merge(FAST_FAKE, {
        "listen": {"port": port}, "state_dir": str(state),
        "fake": {"devices": [{"hang_on_call": 5}, {}]}}))
    d = daemon_factory(cfg)

    def hung():
        m = scrape(port)
        return _labels_of(m.get("gemmd_device_probe_in_flight_seconds", []), gpu="0")

    wait_for(hung, HANG_S, "GPU 0's probe to hang", d)
    # The other GPU keeps probing while GPU 0 hangs.
    n1 = sum(s.value for s in _labels_of(scrape(port)["gemmd_probes_total"], gpu="1"))
    wait_for(lambda: sum(s.value for s in _labels_of(scrape(port)["gemmd_probes_total"],
                                                     gpu="1")) > n1, HANG_S, "GPU 1 to go on",
             d)
    rc, took = d.terminate()
    assert rc == 0 and took < STOP_GRACE_S, (rc, took)
    assert "abandoned" in d.read_log()


def test_process_isolation_kills_a_hung_probe_and_keeps_probing(tmp_path, daemon_factory):
    port, state = free_port(), tmp_path / "state"
    cfg = write_config(tmp_path / "gemmd.yaml", **merge(FAST_FAKE, {
        "listen": {"port": port}, "state_dir": str(state), "isolation": "process",
        "probes": {"measure": {"timeout_s": 2}},
        "fake": {"devices": [{"hang_on_call": 3}, {}]}}))
    d = daemon_factory(cfg)

    def failed_on_gpu0():
        m = scrape(port)
        return sum(s.value for s in _labels_of(m["gemmd_probes_total"], gpu="0",
                                               outcome="failed"))

    wait_for(failed_on_gpu0, HANG_S, "the hung probe on GPU 0 to be killed and counted", d)
    m = scrape(port)
    assert sum(s.value for s in _labels_of(m["gemmd_probes_total"], gpu="1", outcome="ok")) >= 5
    log = d.read_log()
    assert "did not return within 2 s; worker killed" in log
    rc, took = d.terminate()
    assert rc == 0 and took < STOP_GRACE_S, (rc, took)


def test_default_config_on_cpu_serves_measured_and_predicted(tmp_path, daemon_factory):
    """The README's run command: repo defaults, no GPU -> CPU backend, series within 60 s.

    One change to the defaults: the do-no-harm check skips a CPU round while other
    processes use over half the cores, which a shared test machine often does (that check
    has its own tests); everything else is gemmd.yaml as shipped.
    """
    port = free_port()
    cfg = yaml.safe_load((ROOT / "gemmd.yaml").read_text())
    cfg["schedule"]["skip_when_busy"] = False
    d = daemon_factory(write_config(tmp_path / "gemmd.yaml", **cfg), "--state-dir",
                       str(tmp_path / "state"), "--port", str(port))

    def both():
        m = scrape(port)
        return m.get("gemmd_probe_runtime_seconds") and \
            m.get("gemmd_probe_runtime_predicted_seconds") and m

    m = wait_for(both, HANG_S, "CPU measured and predicted series", d)
    backends = {s.labels["backend"] for s in m["gemmd_device_info"]}
    assert backends == {"cpu"}
    assert m["gemmd_model_info"][0].labels["kind"] == "roofline"
    rc, took = d.terminate()
    assert rc == 0 and took < STOP_GRACE_S
    assert "using the CPU backend" in d.read_log() or "cpu" in d.read_log().lower()


def test_a_default_scrape_has_at_most_60_series_per_gpu(tmp_path, daemon_factory):
    """The default metrics profile (lean) on the default probe plan, everything there is to
    export (a fitted model, every drift reference, peers to compare with): at most 60 series
    per GPU; the full profile has everything (~150)."""
    counts = {}
    for profile in ("lean", "full"):
        port = free_port()
        cfg = write_config(tmp_path / f"{profile}.yaml", **{
            "backend": "fake", "listen": {"address": "127.0.0.1", "port": port},
            "state_dir": str(tmp_path / profile), "metrics": {"profile": profile},
            # The default plan and drift targets; rounds, fits and references fast.
            "schedule": {"probe_interval_s": 2, "refit_interval_s": 3600},
            "budget": {"duty_cycle": 1.0}, "model": {"min_samples": 12, "n_estimators": 10},
            "drift": {"baseline_probes": 5},
            "fake": {"devices": [{}, {}, {}]}})  # 3 of a model: peers to compare with
        d = daemon_factory(cfg)

        def complete(port=port):
            m = scrape(port)
            refs = m.get("gemmd_probe_drift_reference_ratio", [])
            peers = m.get("gemmd_device_peer_ratio", [])
            fitted = m.get("gemmd_model_info") and \
                m["gemmd_model_info"][0].labels["kind"] == "random_forest"
            power = m.get("gemmd_probe_power_predicted_watts", [])
            # 3 GPUs x 2 sentinels x 3 targets
            return m if fitted and len(refs) == 18 and len(power) == 6 and peers else None

        m = wait_for(complete, 120, "a fitted model, every drift reference and the peers", d)
        per_gpu: dict[str, int] = {}
        for samples in m.values():
            for s in samples:
                if "gpu" in s.labels:
                    per_gpu[s.labels["gpu"]] = per_gpu.get(s.labels["gpu"], 0) + 1
        assert set(per_gpu) == {"0", "1", "2"}
        counts[profile] = max(per_gpu.values())
        d.terminate()
    assert counts["lean"] <= 60, counts
    assert counts["full"] > 2 * counts["lean"], counts
