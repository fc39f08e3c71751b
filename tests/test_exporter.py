"""The collector: names, units, labels, pairing of measured and predicted, self-metrics."""

from __future__ import annotations

import dataclasses
import threading

from gemmd.config import FakeDeviceConfig, MeasureConfig
from gemmd.devices.base import measure
from gemmd.devices.fake import FakeDevice
from gemmd.exporter import Exposition, assemble
from gemmd.gemm import ProbeSpec
from gemmd.model import RooflinePredictor
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
    labels = {"gpu": "0", "uuid": dev.info.uuid, "gpu_model": dev.info.name, "probe": spec.name}
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
    from gemmd.exporter.series import build_revision

    assert g("gemmd_build_info", {"version": __import__("gemmd").__version__,
                                  "revision": build_revision(),
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


def _samples(reg, name: str) -> list:
    return [s for r in (reg.cached, reg.live) for m in r.collect() for s in m.samples
            if s.name == name]


def test_probe_series_carry_device_labels_and_probe_only_and_probe_info_the_rest():
    state, dev, spec, m, p = _state_with_probe()
    reg = assemble(state, process=False)
    device = {"gpu", "uuid", "gpu_model"}
    for name in ("gemmd_probe_runtime_seconds", "gemmd_probe_runtime_ratio",
                 "gemmd_probe_flops_per_second", "gemmd_probe_last_timestamp_seconds"):
        (s,) = _samples(reg, name)
        assert set(s.labels) == device | {"probe"}, (name, s.labels)
    (info,) = _samples(reg, "gemmd_probe_info")
    assert info.labels == spec.labels() and info.value == 1
    assert info.labels == {"probe": "blas-bf16-nn-4096x4096x4096", "m": "4096", "n": "4096",
                           "k": "4096", "dtype": "bf16", "kernel": "blas", "tile": "0",
                           "layout": "nn"}


def test_device_info_has_driver_pci_vbios_and_sizes_are_gauges():
    from gemmd.records import DeviceInfo

    extra = {"driver_version": "550.90.07", "cuda_driver_version": "12.4",
             "pci_bus_id": "00000000:18:00.0", "vbios_version": "96.00.89.00.01",
             "record": {"unrelated": 1}}
    gpu = DeviceInfo(0, "GPU-1", "NVIDIA H100 80GB HBM3", "nvidia", {"bf16": 1e15}, 3e12,
                     sm_count=132, memory_bytes=85 << 30, extra=extra)
    cpu = DeviceInfo(0, "CPU-x", "AMD EPYC", "cpu", {"fp32": 1e12}, 1e11,
                     extra={"cores": 64})
    state = State()
    for info in (gpu, cpu):
        state.add_device(info)
    reg = assemble(state, process=False)
    infos = {s.labels["uuid"]: s.labels for s in _samples(reg, "gemmd_device_info")}
    assert infos["GPU-1"] == {"gpu": "0", "uuid": "GPU-1", "gpu_model": "NVIDIA H100 80GB HBM3",
                              "backend": "nvidia", "driver_version": "550.90.07",
                              "cuda_driver_version": "12.4", "pci_bus_id": "00000000:18:00.0",
                              "vbios_version": "96.00.89.00.01"}
    assert infos["CPU-x"] == {"gpu": "0", "uuid": "CPU-x", "gpu_model": "AMD EPYC",
                              "backend": "cpu", "driver_version": "", "cuda_driver_version": "",
                              "pci_bus_id": "", "vbios_version": ""}
    g = reg.get_sample_value
    d = {"gpu": "0", "uuid": "GPU-1", "gpu_model": "NVIDIA H100 80GB HBM3"}
    assert g("gemmd_device_streaming_multiprocessors", d) == 132
    assert g("gemmd_device_memory_bytes", d) == 85 << 30
    # Unknown on the CPU: absent, not an empty label or a zero.
    c = {"gpu": "0", "uuid": "CPU-x", "gpu_model": "AMD EPYC"}
    assert g("gemmd_device_streaming_multiprocessors", c) is None
    assert g("gemmd_device_memory_bytes", c) is None


def test_every_clock_event_reason_and_skip_reason_exists_from_the_start():
    from gemmd.exporter.series import BUSY_REASONS, ROUND_SKIPS
    from gemmd.records import CLOCK_EVENT_REASONS

    state, dev, *_ = _state_with_probe(slow=1.25)  # throttled: hw_thermal_slowdown active
    dev.armed = False
    quiet = FakeDevice(1, FakeDeviceConfig())
    state.add_device(quiet.info)  # no probe yet: no context at all
    reg = assemble(state, process=False)
    reasons: dict[str, dict[str, float]] = {}
    for s in _samples(reg, "gemmd_device_clock_event_active"):
        reasons.setdefault(s.labels["gpu"], {})[s.labels["reason"]] = s.value
    known = set(CLOCK_EVENT_REASONS.values())
    assert set(reasons["0"]) == set(reasons["1"]) == known
    assert {r for r, v in reasons["0"].items() if v} == {"hw_thermal_slowdown"}
    assert not any(reasons["1"].values())
    # An unknown bit the backend reports is exported too, as active.
    with state.lock:
        state.devices[quiet.info.uuid].context = {"clock_event_reasons": ["unknown_0x800"]}
    reg = assemble(state, process=False)
    active = {s.labels["reason"]: s.value for s in _samples(reg, "gemmd_device_clock_event_active")
              if s.labels["gpu"] == "1"}
    assert set(active) == known | {"unknown_0x800"} and active["unknown_0x800"] == 1
    # The same as NVML's (and DCGM's) bitmask, one series per device, unknown bits kept.
    mask = {s.labels["gpu"]: s.value for s in _samples(reg, "gemmd_device_clock_event_reasons")}
    assert mask == {"0": 0x40, "1": 0x800}

    # The rounds' own skip reasons and the busy reasons the device's backend can give.
    skipped = {(s.labels["gpu"], s.labels["reason"]): s.value
               for s in _samples(reg, "gemmd_probes_skipped_total")}
    for gpu in ("0", "1"):
        assert {r for g_, r in skipped if g_ == gpu} == set(ROUND_SKIPS) | set(
            BUSY_REASONS["fake"])
    assert skipped[("0", "other_processes")] == 3 and skipped[("1", "other_processes")] == 0


def test_skip_reasons_cover_every_reason_gemmd_records():
    """Every literal reason passed to _skip_all() or returned by a busy_reason() is in
    SKIP_REASONS, so that none of them appears only once it happens."""
    import ast
    import pathlib

    from gemmd.exporter.series import BUSY_REASONS, SKIP_REASONS

    root = pathlib.Path(__file__).resolve().parent.parent / "gemmd"
    found: set[str] = set()
    for path in root.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "_skip_all" \
                    and node.args and isinstance(node.args[0], ast.Constant):
                found.add(node.args[0].value)
            if isinstance(node, ast.FunctionDef) and node.name == "busy_reason":
                for ret in ast.walk(node):
                    if isinstance(ret, ast.Return) and isinstance(ret.value, ast.Constant) \
                            and isinstance(ret.value.value, str):
                        found.add(ret.value.value)
                    if isinstance(ret, ast.IfExp):
                        for v in (ret.body, ret.orelse):
                            if isinstance(v, ast.Constant) and isinstance(v.value, str):
                                found.add(v.value)
    assert {"device_down", "duty_cycle", "other_processes", "host_busy"} <= found
    assert found <= set(SKIP_REASONS), sorted(found - set(SKIP_REASONS))
    # And each backend's busy_reason() gives only the reasons exported for its devices.
    for backend, reasons in BUSY_REASONS.items():
        tree = ast.parse((root / "devices" / f"{backend}.py").read_text())
        (fn,) = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)
                 and n.name == "busy_reason"]
        given = {c.value for c in ast.walk(fn) if isinstance(c, ast.Constant)
                 and isinstance(c.value, str) and c.value in SKIP_REASONS}
        assert given == set(reasons), backend


def test_each_probe_says_whether_its_prediction_is_in_the_models_domain():
    state, dev, spec, m, p = _state_with_probe()
    reg = assemble(state, process=False)
    labels = {"gpu": "0", "uuid": dev.info.uuid, "gpu_model": dev.info.name,
              "probe": spec.name}
    # The roofline (no model yet) is outside any training domain.
    assert p.in_domain is False
    assert reg.get_sample_value("gemmd_probe_prediction_in_domain", labels) == 0


# ------------------------------------------------------------------ profiles and hostname


def _families(reg) -> set[str]:
    return {m.name for r in (reg.cached, reg.live) for m in r.collect() if m.samples}


def test_the_lean_profile_keeps_what_rules_and_dashboards_read_and_the_full_one_all():
    from gemmd.exporter.series import LEAN, LEAN_LABELS

    state, dev, spec, m, p = _state_with_probe()
    full = assemble(state, process=False)
    lean = assemble(state, process=False, profile="lean")
    full_names, lean_names = _families(full), _families(lean)
    assert lean_names == full_names & LEAN
    assert lean_names < full_names
    # What only the full profile has: the detector's and the probe's details.
    assert {"gemmd_probe_runtime_ratio", "gemmd_probe_flops_per_second",
            "gemmd_device_clock_event_active"} <= full_names - lean_names
    # The lean profile's per-GPU families are what the rules read (tests/test_rules.py)
    # and the series the dashboards plot on their main rows.
    assert {"gemmd_probe_runtime_seconds", "gemmd_probe_runtime_predicted_seconds",
            "gemmd_probe_runtime_predicted_lower_seconds", "gemmd_device_drifting",
            "gemmd_device_clock_event_reasons"} <= lean_names
    assert set(LEAN_LABELS) <= LEAN
    for name, (label, value) in LEAN_LABELS.items():
        assert all(s.labels[label] == value for s in _samples(lean, name))
    try:
        assemble(state, profile="medium")
        raise AssertionError("expected ValueError")
    except ValueError as e:
        assert "lean, full" in str(e)


def test_every_series_carries_the_hostname_when_one_is_given(monkeypatch):
    from gemmd.exporter.series import host_name

    state, *_ = _state_with_probe()
    text = Exposition(state, hostname="gpu-node-07", profile="lean").body().decode()
    samples = [ln for ln in text.splitlines() if ln and not ln.startswith("#")]
    assert samples and all('hostname="gpu-node-07"' in ln for ln in samples)
    assert any(ln.startswith("process_resident_memory_bytes{") for ln in samples)
    # Without one (the tests' default), no such label.
    assert "hostname=" not in Exposition(state, process=False).body().decode()
    # "auto": the Kubernetes node the pod runs on ($NODE_NAME), else the host's name.
    monkeypatch.setenv("NODE_NAME", "gpu-node-09")
    assert host_name("auto") == "gpu-node-09" and host_name("rack3-07") == "rack3-07"
    monkeypatch.delenv("NODE_NAME")
    import socket

    assert host_name("auto") == host_name("") == socket.gethostname()


def test_build_info_names_the_source_revision(tmp_path, monkeypatch):
    from gemmd.exporter import series

    monkeypatch.setenv("GEMMD_REVISION", "abc123def456")
    series.build_revision.cache_clear()
    try:
        assert series.build_revision() == "abc123def456"
    finally:
        monkeypatch.delenv("GEMMD_REVISION")
        series.build_revision.cache_clear()
    # A checkout: HEAD's commit, read from .git (a branch, a packed ref, a detached HEAD).
    git = tmp_path / ".git"
    (git / "refs" / "heads").mkdir(parents=True)
    (git / "HEAD").write_text("ref: refs/heads/main\n")
    (git / "refs" / "heads" / "main").write_text("0123456789abcdef0123\n")
    assert series._git_head(git) == "0123456789ab"
    (git / "refs" / "heads" / "main").unlink()
    (git / "packed-refs").write_text("# pack-refs\nfedcba9876543210aaaa refs/heads/main\n")
    assert series._git_head(git) == "fedcba987654"
    (git / "HEAD").write_text("1111222233334444\n")
    assert series._git_head(git) == "111122223333"
    revision = series.build_revision()
    assert revision == "unknown" or len(revision) == 12, revision
