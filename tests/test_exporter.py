"""The collector: names, units, labels, pairing of measured and predicted, self-metrics."""

from __future__ import annotations

import dataclasses
import threading

from gemmd.config import FakeDeviceConfig, MeasureConfig
from gemmd.devices.fake import FakeDevice
from gemmd.exporter import Exposition, assemble
from gemmd.gemm import ProbeSpec
from gemmd.model import RooflinePredictor
from gemmd.probes import measure
from gemmd.state import ProbeState, State


class _Exploding(FakeDevice):
    """A device that fails the test if anything touches it during a scrape."""

    armed = False

    def __getattribute__(self, name):
        if object.__getattribute__(self, "armed") and name not in ("info", "armed"):
            raise AssertionError(f"scrape touched the device: {name}")
        return object.__getattribute__(self, name)


def _state_with_probe(slow: float = 1.0):
    dev = _Exploding(0, FakeDeviceConfig(slowdown_factor=slow))
    state = State()
    state.add_device(dev.info)
    spec = ProbeSpec(4096, 4096, 4096, "bf16")
    m = measure(dev, spec, MeasureConfig(window_s=0.5, warmup_s=0.0))
    (p,) = RooflinePredictor(0.7).predict([spec], [dev.info])
    with state.lock:
        state.probes[(dev.info.uuid, spec)] = ProbeState(spec, m, p, 1234.0)
        ds = state.devices[dev.info.uuid]
        ds.context = dict(m.context["after"])
        ds.probes_total[("sentinel", "ok")] += 1
        ds.skipped_total["other_processes"] += 3
    dev.armed = True
    return state, dev, spec, m, p


def test_measured_predicted_ratio_share_labels_and_units():
    state, dev, spec, m, p = _state_with_probe()
    reg = assemble(state, process=False)
    labels = {"gpu": "0", "uuid": dev.info.uuid, "gpu_model": dev.info.name, **spec.labels()}
    g = reg.get_sample_value
    assert g("gemmd_probe_runtime_seconds", labels) == m.runtime_s
    assert g("gemmd_probe_runtime_predicted_seconds", labels) == p.runtime_s
    assert g("gemmd_probe_runtime_ratio", labels) == m.runtime_s / p.runtime_s
    assert g("gemmd_probe_runtime_predicted_lower_seconds", labels) < p.runtime_s < \
        g("gemmd_probe_runtime_predicted_upper_seconds", labels)
    assert g("gemmd_probe_energy_joules", labels) == m.energy_j
    assert g("gemmd_probe_power_watts", labels) == m.power_w
    # The roofline has no power estimate: the predicted series is absent, not zero.
    assert g("gemmd_probe_power_predicted_watts", labels) is None
    assert g("gemmd_probe_last_timestamp_seconds", labels) == 1234.0
    assert g("gemmd_probe_flops_per_second", labels) == spec.flops / m.runtime_s


def test_device_counters_context_and_model_info():
    state, dev, *_ = _state_with_probe(slow=1.25)
    dev.armed = False
    nominal = dev.model.sm_clock_hz
    dev.armed = True
    reg = assemble(state, process=False)
    d = {"gpu": "0", "uuid": dev.info.uuid, "gpu_model": dev.info.name}
    g = reg.get_sample_value
    assert g("gemmd_device_up", d) == 1
    assert g("gemmd_probes_total", {**d, "kind": "sentinel", "outcome": "ok"}) == 1
    # Known outcomes and skip reasons exist from the start, at zero.
    assert g("gemmd_probes_total", {**d, "kind": "sentinel", "outcome": "mismatch"}) == 0
    assert g("gemmd_probes_skipped_total", {**d, "reason": "duty_cycle"}) == 0
    assert g("gemmd_probes_skipped_total", {**d, "reason": "other_processes"}) == 3
    assert g("gemmd_device_sm_clock_hertz", d) == nominal / 1.25
    assert g("gemmd_device_clock_event_active", {**d, "reason": "hw_thermal_slowdown"}) == 1
    assert g("gemmd_device_power_limit_watts", d) == 700
    assert g("gemmd_model_info", {"version": "roofline", "kind": "roofline"}) == 1
    assert g("gemmd_model_refits_total", {"outcome": "accepted"}) == 0
    assert g("gemmd_build_info", {"version": __import__("gemmd").__version__,
                                  "python_version": __import__("platform").python_version()}) == 1
    assert g("gemmd_scrape_collector_success") == 1


def test_exposition_is_valid_text_and_names_follow_conventions():
    state, *_ = _state_with_probe()
    text = Exposition(state).body().decode()
    names = {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE")}
    assert all(n.startswith(("gemmd_", "process_")) for n in names)
    for line in text.splitlines():
        if line.startswith("# TYPE") and line.endswith(" counter"):
            assert line.split()[2].endswith("_total"), line
        if line.startswith("# TYPE") and line.endswith(" gauge") and "_total" in line:
            raise AssertionError(f"a gauge named like a counter: {line}")
    assert "gemmd_probes_total{" in text and "process_resident_memory_bytes" in text


def test_collect_failure_is_reported_not_raised(monkeypatch):
    state, *_ = _state_with_probe()
    exp = Exposition(state, process=False)
    monkeypatch.setattr(state, "snapshot", lambda: (_ for _ in ()).throw(RuntimeError("bug")))
    text = exp.body().decode()
    assert "gemmd_scrape_collector_success 0.0" in text


def test_concurrent_scrapes_and_updates_are_consistent():
    state, dev, spec, m, p = _state_with_probe()
    exp = Exposition(state, process=False)
    stop = threading.Event()

    def writer():
        i = 0
        while not stop.is_set():
            i += 1
            with state.lock:
                ps = state.probes[(dev.info.uuid, spec)]
                state.probes[(dev.info.uuid, spec)] = dataclasses.replace(ps, ts=float(i))
                state.devices[dev.info.uuid].probes_total[("sentinel", "ok")] += 1

    t = threading.Thread(target=writer)
    t.start()
    try:
        for _ in range(50):
            assert "gemmd_probe_runtime_seconds{" in exp.body().decode()
    finally:
        stop.set()
        t.join()


def test_exposition_renders_state_once_per_change_and_serves_http():
    import gzip
    import urllib.error
    import urllib.request

    from gemmd.exporter import serve

    state, dev, spec, m, p = _state_with_probe()
    exp = Exposition(state, process=False)
    first = exp.body()
    assert exp.renders == 1 and b"gemmd_probe_runtime_seconds{" in first
    exp.body()
    assert exp.renders == 1  # nothing changed: served from the cache
    with state.lock:
        state.devices[dev.info.uuid].in_flight_since = 0.0
    again = exp.body()
    assert exp.renders == 2 and b"gemmd_device_probe_in_flight_seconds{" in again
    assert gzip.decompress(exp.body(gzip_ok=True)).split(b"gemmd_device_probe_in_flight")[0] \
        == again.split(b"gemmd_device_probe_in_flight")[0]
    httpd = serve(exp, "127.0.0.1", 0)
    try:
        port = httpd.server_port
        req = urllib.request.Request(f"http://127.0.0.1:{port}/metrics",
                                     headers={"Accept-Encoding": "gzip"})
        with urllib.request.urlopen(req, timeout=5) as r:
            assert r.headers["Content-Encoding"] == "gzip"
            assert b"gemmd_build_info" in gzip.decompress(r.read())
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/nope", timeout=5)
            raise AssertionError("expected 404")
        except urllib.error.HTTPError as e:
            assert e.code == 404
    finally:
        httpd.shutdown()
        httpd.server_close()
