"""The shipped monitoring: alert/recording rules (promtool), runbook links, dashboards, and
the example Alertmanager configuration (amtool, and a real Alertmanager's inhibition).

Every metric name that a rule, an alert template or a dashboard query uses must exist in
the exposition of a real `gemmd run` (or be a recording rule of the rule file), so that a
renamed metric breaks a test instead of a dashboard.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest
import yaml
from conftest import (
    FAST_FAKE,
    HANG_S,
    ROOT,
    LoggedProc,
    free_port,
    merge,
    wait_for,
    write_config,
)

PROM_DIR = ROOT / "deploy" / "prometheus"
RULES = PROM_DIR / "gemmd.rules.yml"
RULE_TESTS = sorted((PROM_DIR / "tests").glob("*.yml"))
RUNBOOK = ROOT / "docs" / "runbook.md"
DASHBOARDS = sorted((ROOT / "grafana" / "dashboards").glob("*.json"))
ALERTMANAGER = ROOT / "deploy" / "alertmanager" / "alertmanager.yml"
GEN = ROOT / "deploy" / "kubernetes" / "gen_prometheusrule.py"
SEVERITIES = {"critical", "warning"}
# Critical only for wrong results, a lost GPU and a slowdown that lasts.
CRITICAL = {"GemmdResultMismatch", "GemmdDeviceDown", "GemmdGpuSlowdownPersistent"}
# The labels a probe's name encodes: on gemmd_probe_info only, never on alerts.
PROBE_CONFIG_LABELS = {"m", "n", "k", "dtype", "kernel", "tile", "layout"}
# A metric name of gemmd's (gemmd_...) or a recording rule of ours (gemmd:...).
METRIC_RE = re.compile(r"(?<![A-Za-z0-9_:])(gemmd[_:][A-Za-z0-9_:]*[A-Za-z0-9_])")


def promtool() -> str:
    path = shutil.which("promtool")
    if not path:
        pytest.fail("promtool not on PATH: run `bash scripts/install-test-deps.sh` as root "
                    "(installs the Debian package prometheus; `make test` runs it)")
    return path


def amtool() -> str:
    path = shutil.which("amtool")
    if not path:
        pytest.fail("amtool not on PATH: run `bash scripts/install-test-deps.sh` as root "
                    "(installs the Debian package prometheus-alertmanager; `make test` runs it)")
    return path


def generator():
    spec = importlib.util.spec_from_file_location("gen_prometheusrule", GEN)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def rule_groups() -> list[dict]:
    return yaml.safe_load(RULES.read_text())["groups"]


def alerts() -> list[dict]:
    return [r for g in rule_groups() for r in g["rules"] if "alert" in r]


def recording_rules() -> list[dict]:
    return [r for g in rule_groups() for r in g["rules"] if "record" in r]


def load_dashboards() -> dict[str, dict]:
    return {p.name: json.loads(p.read_text()) for p in DASHBOARDS}


def all_panels(panels: list[dict]) -> Iterator[dict]:
    for p in panels:
        yield p
        yield from all_panels(p.get("panels", []))  # collapsed rows keep theirs inside


def dashboard_exprs(dash: dict) -> list[str]:
    """Every PromQL expression of a dashboard: panel targets and query variables."""
    out = [t["expr"] for p in all_panels(dash["panels"]) for t in p.get("targets", [])]
    for v in dash["templating"]["list"]:
        if v["type"] == "query":
            q = v["query"]["query"] if isinstance(v["query"], dict) else v["query"]
            out.append(q)
    return out


def github_anchor(heading: str) -> str:
    return re.sub(r"[^a-z0-9 _-]", "", heading.strip().lower()).replace(" ", "-")


def runbook_anchors() -> set[str]:
    return {github_anchor(line[3:]) for line in RUNBOOK.read_text().splitlines()
            if line.startswith("## ")}


# ------------------------------------------------------------------------- promtool


def test_promtool_check_rules_passes():
    r = subprocess.run([promtool(), "check", "rules", str(RULES)], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


def test_promtool_unit_tests_pass():
    assert RULE_TESTS, "no promtool unit tests in deploy/prometheus/tests/"
    r = subprocess.run([promtool(), "test", "rules", *map(str, RULE_TESTS)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


def test_example_prometheus_config_is_valid():
    r = subprocess.run([promtool(), "check", "config", str(PROM_DIR / "prometheus.yml")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


def test_every_alert_is_unit_tested_firing_and_not_firing():
    firing: set[str] = set()
    silent: set[str] = set()
    for path in RULE_TESTS:
        doc = yaml.safe_load(path.read_text())
        for case in doc["tests"]:
            for t in case.get("alert_rule_test", []):
                (firing if t.get("exp_alerts") else silent).add(t["alertname"])
    names = {a["alert"] for a in alerts()}
    assert not names - firing, f"alerts never shown firing: {sorted(names - firing)}"
    assert not names - silent, f"alerts never shown not firing: {sorted(names - silent)}"
    assert not (firing | silent) - names, "tests name alerts the rule file lacks"


# ------------------------------------------------------------------------- rule hygiene


def test_every_alert_has_severity_summary_description_and_runbook_section():
    anchors = runbook_anchors()
    gen = generator()
    # The runbook every gemmd serves (gemmd/exporter/runbook.py): no placeholder ships.
    assert gen.RUNBOOK_BASE == "http://{{ $labels.instance }}/runbook"
    assert "OWNER" not in RULES.read_text()
    seen = set()
    for a in alerts():
        name = a["alert"]
        assert name not in seen, f"duplicate alert {name}"
        seen.add(name)
        severity = a.get("labels", {}).get("severity")
        assert severity in SEVERITIES, name
        assert (severity == "critical") == (name in CRITICAL), (name, severity)
        ann = a.get("annotations", {})
        assert ann.get("summary"), f"{name}: no summary"
        desc = ann.get("description", "")
        assert "$labels." in desc and "$value" in desc, \
            f"{name}: the description must show labels and the value"
        anchor = github_anchor(name)
        # Under one of the bases the generator rewrites (--runbook-base): the gemmd that
        # raised the alert, or for GemmdDown one that is up.
        base = gen.RUNBOOK_BASE_UP if name == "GemmdDown" else gen.RUNBOOK_BASE
        assert ann.get("runbook_url") == f"{base}#{anchor}", name
        assert anchor in anchors, f"docs/runbook.md has no '## {name}' section"


def test_alerts_are_per_gpu_never_per_probe():
    """No alert of the unit tests carries `probe` or a probe's configuration: a GPU that is
    slow on every probe raises one alert, which names its worst probe in the description."""
    for path in RULE_TESTS:
        for case in yaml.safe_load(path.read_text())["tests"]:
            for t in case.get("alert_rule_test", []):
                for exp in t.get("exp_alerts") or []:
                    labels = set(exp.get("exp_labels", {}))
                    assert not labels & ({"probe"} | PROBE_CONFIG_LABELS), (path.name, t)
    # Per-probe series: gemmd_probe_*, but the probe interval and the per-daemon error.
    for a in alerts():
        if re.search(r"gemmd[_:]probe_(?!interval_seconds|prediction_error)", a["expr"]):
            assert "max without (probe)" in a["expr"], a["alert"]
            assert "worst probe" in a["annotations"]["description"], a["alert"]


def test_runbook_base_is_set_in_one_place(tmp_path):
    """The generator points every runbook_url at another base, in a plain rule file that
    promtool accepts and in a PrometheusRule, and changes nothing else."""
    base = "https://wiki.example.com/ops/gemmd-runbook.md"
    shipped = rule_groups()
    for fmt, out in (("rules", tmp_path / "gemmd.rules.yml"),
                     ("prometheusrule", tmp_path / "prometheusrule.yaml")):
        r = subprocess.run([sys.executable, str(GEN), "--format", fmt, "--runbook-base", base,
                            "--out", str(out)], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        doc = yaml.safe_load(out.read_text())
        groups = doc["groups"] if fmt == "rules" else doc["spec"]["groups"]
        urls = [r["annotations"]["runbook_url"] for g in groups for r in g["rules"]
                if "alert" in r]
        assert urls and all(u.startswith(base + "#") for u in urls), urls
        for g, orig in zip(groups, shipped):
            for rule, was in zip(g["rules"], orig["rules"]):
                if "alert" in rule:
                    anchor = generator().anchor_of(was["annotations"]["runbook_url"])
                    assert rule["annotations"]["runbook_url"] == f"{base}#{anchor}"
                    rule["annotations"]["runbook_url"] = was["annotations"]["runbook_url"]
        assert groups == shipped, fmt
    r = subprocess.run([promtool(), "check", "rules", str(tmp_path / "gemmd.rules.yml")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    # A runbook_url under another base in the rule file is refused, not half-rewritten.
    stray = yaml.safe_load(RULES.read_text())
    stray["groups"][0]["rules"][-1]["annotations"]["runbook_url"] = "docs/runbook.md#x"
    (tmp_path / "stray.yml").write_text(yaml.safe_dump(stray))
    r = subprocess.run([sys.executable, str(GEN), "--rules", str(tmp_path / "stray.yml"),
                        "--format", "rules", "--out", "-"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "is not under" in r.stderr, r.stderr


def family(sample_name: str) -> str:
    """The metric family a sample name belongs to (counters: without _total)."""
    return sample_name.removesuffix("_total")


def test_rules_read_only_what_the_lean_profile_exports():
    """Every gemmd series a rule, an alert or an alert's description reads is in the lean
    metrics profile (the default): the rules work as shipped with either profile."""
    from gemmd.exporter.series import LEAN

    recorded = {r["record"] for r in recording_rules()}
    read: dict[str, set[str]] = {}
    for g in rule_groups():
        for r in g["rules"]:
            texts = [r["expr"]]
            if "alert" in r:
                texts += [v for k, v in r["annotations"].items() if k != "runbook_url"]
            for t in texts:
                for name in METRIC_RE.findall(t):
                    read.setdefault(name, set()).add(r.get("alert") or r["record"])
    full_only = {n: sorted(w) for n, w in read.items()
                 if n not in recorded and family(n) not in LEAN
                 and n != "gemmd_probe_drifting"}  # only counted in descriptions, if there
    assert not full_only, f"rules read series of the full profile only: {full_only}"
    # The per-probe alarm count in the drift descriptions is said only where exported.
    for a in alerts():
        desc = a["annotations"]["description"]
        if "gemmd_probe_drifting" in desc:
            assert re.search(r"\{\{ with printf `count\(gemmd_probe_drifting\{%s,"
                             r"target=\"\w+\"\}\)` \$sel \| query \}\}", desc), a["alert"]


def test_hosts_are_named_by_hostname_then_node_then_instance():
    """Alerts say which host as operators name it; the hour of a persistent slowdown is kept
    per host and GPU (a rollout changes instance and pod)."""
    for a in alerts():
        for key in ("summary", "description"):
            text = a["annotations"][key]
            assert "{{ $labels.instance }}" not in text, (a["alert"], key)
    (rule,) = [r for r in recording_rules() if r["record"] == "gemmd:device_runtime_drifting:max"]
    assert "without (target, instance, pod)" in rule["expr"]
    for a in alerts():
        if "gemmd:device_runtime_drifting" in a["expr"]:
            assert "on(instance, uuid) (gemmd:device_runtime_drifting" not in a["expr"], a["alert"]


def test_recording_rules_are_named_gemmd_level_metric_operations():
    for r in recording_rules():
        parts = r["record"].split(":")
        assert len(parts) == 3 and parts[0] == "gemmd" and all(parts), r["record"]


def test_runbook_documents_scrape_config_and_dashboard_import():
    text = RUNBOOK.read_text()
    assert "## Prometheus scrape config" in text
    assert "## Import the dashboards" in text
    assert "## Alertmanager" in text and "--runbook-base" in text


# ------------------------------------------------------------------------- Alertmanager


def alertmanager_config() -> dict:
    return yaml.safe_load(ALERTMANAGER.read_text())


def test_alertmanager_example_passes_amtool_check_config():
    r = subprocess.run([amtool(), "check-config", str(ALERTMANAGER)], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


def test_alertmanager_example_groups_by_gpu_and_routes_on_severity():
    cfg = alertmanager_config()
    (gemmd,) = [r for r in cfg["route"]["routes"] if "Gemmd" in " ".join(r["matchers"])]
    assert "uuid" in gemmd["group_by"]
    names = {a["alert"] for a in alerts()}
    text = json.dumps(cfg["inhibit_rules"])
    for name in re.findall(r"Gemmd[A-Za-z]+", text):
        assert name in names, f"the inhibit rules name an alert the rules lack: {name}"

    def route(**labels: str) -> str:
        r = subprocess.run([amtool(), "config", "routes", "test",
                            f"--config.file={ALERTMANAGER}",
                            *(f"{k}={v}" for k, v in labels.items())],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stdout + r.stderr
        return r.stdout.strip()

    for a in alerts():
        severity = a["labels"]["severity"]
        got = route(alertname=a["alert"], severity=severity, uuid="GPU-1")
        assert got == f"gemmd-{severity}", (a["alert"], got)
    assert route(alertname="NodeDown", severity="critical") == "default"


def test_a_slowdown_inhibits_the_same_gpus_power_energy_and_sibling_alerts(tmp_path):
    """A real Alertmanager with the example configuration: of a slow GPU's alerts only the
    slowdown notifies; another GPU's energy alert is not inhibited."""
    binary = shutil.which("prometheus-alertmanager") or shutil.which("alertmanager")
    if binary is None:
        pytest.fail("alertmanager not on PATH: run `bash scripts/install-test-deps.sh` as root "
                    "(installs the Debian package prometheus-alertmanager)")
    port = free_port()
    am = LoggedProc([binary, f"--config.file={ALERTMANAGER}",
                     f"--storage.path={tmp_path / 'am'}",
                     f"--web.listen-address=127.0.0.1:{port}", "--cluster.listen-address=",
                     "--log.level=warn"], tmp_path / "alertmanager.log", mode="wb")
    url = f"http://127.0.0.1:{port}/api/v2/alerts"
    try:
        def ready():
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/-/ready", timeout=2) as r:
                    return r.status == 200
            except (urllib.error.URLError, OSError):
                return False

        wait_for(ready, HANG_S, "Alertmanager to be ready", am)

        def alert(name: str, severity: str, gpu: str, **extra: str) -> dict:
            return {"labels": {"alertname": name, "severity": severity, "job": "gemmd",
                               "instance": "gpu-node-07:9477", "gpu": gpu,
                               "uuid": f"GPU-{gpu}", "gpu_model": "NVIDIA H100", **extra}}

        sent = [alert("GemmdGpuSlowerThanPredicted", "warning", "1", target="runtime"),
                alert("GemmdGpuEnergyAbovePredicted", "warning", "1", target="energy"),
                alert("GemmdGpuPowerAbovePredicted", "warning", "1", target="power"),
                alert("GemmdGpuSlowerThanSiblings", "warning", "1"),
                alert("GemmdDeviceDown", "critical", "2"),
                alert("GemmdProbesStale", "warning", "2"),
                alert("GemmdGpuEnergyAbovePredicted", "warning", "3", target="energy")]
        req = urllib.request.Request(url, data=json.dumps(sent).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
        urllib.request.urlopen(req, timeout=5).read()

        def states():
            with urllib.request.urlopen(url, timeout=5) as r:
                got = json.loads(r.read())
            if len(got) < len(sent):
                return None
            return {(a["labels"]["alertname"], a["labels"]["gpu"]): a["status"]["state"]
                    for a in got}

        deadline = time.monotonic() + HANG_S
        while True:  # inhibition is computed as alerts arrive: allow it a moment
            got = wait_for(states, HANG_S, "the alerts in Alertmanager", am)
            want = {("GemmdGpuSlowerThanPredicted", "1"): "active",
                    ("GemmdGpuEnergyAbovePredicted", "1"): "suppressed",
                    ("GemmdGpuPowerAbovePredicted", "1"): "suppressed",
                    ("GemmdGpuSlowerThanSiblings", "1"): "suppressed",
                    ("GemmdDeviceDown", "2"): "active",
                    ("GemmdProbesStale", "2"): "suppressed",
                    ("GemmdGpuEnergyAbovePredicted", "3"): "active"}
            if got == want or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert got == want
    finally:
        am.kill()


# ------------------------------------------------------------------------- dashboards


def test_dashboards_are_importable_with_a_datasource_variable():
    dashes = load_dashboards()
    assert {"gemmd-fleet.json", "gemmd-gpu.json"} <= set(dashes)
    uids = [d["uid"] for d in dashes.values()]
    assert len(set(uids)) == len(uids), f"dashboard uid collision: {uids}"
    for name, d in dashes.items():
        assert d["id"] is None, name  # an id would clash with the importing Grafana's
        assert d["schemaVersion"] >= 36, name
        variables = {v["name"]: v for v in d["templating"]["list"]}
        ds = variables.get("datasource")
        assert ds and ds["type"] == "datasource" and ds["query"] == "prometheus", name
        for var in ("hostname", "gpu"):
            assert variables.get(var, {}).get("type") == "query", f"{name}: no ${var}"
        assert "$instance" not in json.dumps(d), f"{name}: hosts are named by hostname"
        # Grafana's import asks for the data source (and a provisioned copy picks its
        # default): the one input, the data source variable's first value.
        assert [i["name"] for i in d["__inputs"]] == ["DS_PROMETHEUS"], name
        assert ds["current"]["value"] == "${DS_PROMETHEUS}", name
        assert json.dumps(d).count("${DS_PROMETHEUS}") == 2, name  # current: text and value
        assert {r["id"] for r in d["__requires"]} >= {"grafana", "prometheus"} | {
            p["type"] for p in all_panels(d["panels"]) if p["type"] != "row"}, name
        for v in variables.values():
            if v["type"] == "query":
                assert v["datasource"]["uid"] == "${datasource}", f"{name}: ${v['name']}"
        panels = [p for p in all_panels(d["panels"]) if p["type"] != "row"]
        assert panels, name
        ids = [p["id"] for p in all_panels(d["panels"])]
        assert len(set(ids)) == len(ids), f"{name}: duplicate panel ids"
        for p in panels:
            assert p["datasource"]["uid"] == "${datasource}", f"{name}: {p['title']}"
            assert p["targets"], f"{name}: {p['title']} has no query"
            for t in p["targets"]:
                assert t["datasource"]["uid"] == "${datasource}", f"{name}: {p['title']}"
                assert t["expr"].strip(), f"{name}: {p['title']}"


def test_gpu_dashboard_draws_prediction_interval_bands():
    d = load_dashboards()["gemmd-gpu.json"]
    bands = 0
    for p in all_panels(d["panels"]):
        exprs = " ".join(t["expr"] for t in p.get("targets", []))
        if "_predicted_lower_" not in exprs:
            continue
        legends = {t["legendFormat"] for t in p["targets"]}
        fills = [prop["value"] for o in p["fieldConfig"]["overrides"]
                 for prop in o["properties"] if prop["id"] == "custom.fillBelowTo"]
        assert fills and set(fills) <= legends, p["title"]
        assert "_predicted_upper_" in exprs and "measured" in legends, p["title"]
        bands += 1
    assert bands == 3, "one band panel each for runtime, power and energy"


FULL_ROW = "metrics.profile: full"


def full_only_families() -> set[str]:
    from gemmd.exporter.series import LEAN

    return {m for m in referenced_metrics() if ":" not in m and family(m) not in LEAN}


def test_dashboard_panels_of_the_full_profile_only_are_in_their_own_collapsed_row():
    """With the default lean profile no panel is empty on the main rows: a panel whose every
    query reads series of the full profile only lies in the collapsed row that says so."""
    full = full_only_families()
    # Reference lines (a configured margin or tolerance) are no data of their own.
    references = {"gemmd_drift_tolerance_ratio", "gemmd_drift_peer_margin_ratio",
                  "gemmd_probe_interval_seconds"}
    for name, d in load_dashboards().items():
        (row,) = [p for p in d["panels"] if p["type"] == "row" and FULL_ROW in p["title"]]
        assert row["collapsed"] is True and row["panels"], name
        assert row is d["panels"][-1], name
        in_row = {p["id"] for p in row["panels"]}
        for p in all_panels(d["panels"]):
            if p["type"] == "row":
                continue
            reads = [set(METRIC_RE.findall(t["expr"])) for t in p["targets"]]
            reads = [r for r in reads if not (r and r <= references)]
            if all(r & full for r in reads):
                assert p["id"] in in_row, f"{name}: {p['title']} reads the full profile only"
            else:
                assert p["id"] not in in_row, f"{name}: {p['title']} works on lean"


# ------------------------------------------------------------------------- metric names


def referenced_metrics() -> dict[str, set[str]]:
    """Metric name -> where it is used (rules, alert templates, dashboards)."""
    where: dict[str, set[str]] = {}

    def note(text: str, origin: str) -> None:
        for name in METRIC_RE.findall(text):
            where.setdefault(name, set()).add(origin)

    for g in rule_groups():
        for r in g["rules"]:
            origin = f"rule {r.get('alert') or r.get('record')}"
            note(r["expr"], origin)
            for v in r.get("annotations", {}).values():
                note(v, origin)  # query templates in descriptions
    for name, d in load_dashboards().items():
        for e in dashboard_exprs(d):
            note(e, name)
    return where


def exposition_names(text: str) -> set[str]:
    names = set(re.findall(r"^# TYPE (\S+) ", text, re.M))
    names |= set(re.findall(r"^([A-Za-z_:][A-Za-z0-9_:]*)[{ ]", text, re.M))
    return names


@pytest.mark.parametrize("profile", ["lean", "full"])
def test_every_referenced_metric_exists_in_a_live_exposition(tmp_path, daemon_factory, profile):
    """With the full profile every metric a rule or a dashboard reads is exposed; with the
    lean one (the default) all of them but the dashboards' full-only panels and targets."""
    port = free_port()
    # Small baselines so that model, prediction and drift series all appear within seconds.
    cfg = write_config(tmp_path / "gemmd.yaml", **merge(FAST_FAKE, {
        "listen": {"port": port}, "state_dir": str(tmp_path / "state"),
        "drift": {"baseline_probes": 5}, "metrics": {"profile": profile}}))
    d = daemon_factory(cfg)

    recorded = {r["record"] for r in recording_rules()}
    used = referenced_metrics()
    if profile == "lean":
        used = {n: w for n, w in used.items() if n not in full_only_families()}
    assert used, "no metric names found in rules and dashboards"
    missing: dict[str, list[str]] = {}

    def all_exposed():
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            exposed = exposition_names(r.read().decode())
        missing.clear()
        missing.update({n: sorted(w) for n, w in used.items() if n not in exposed | recorded})
        return not missing

    # Model, prediction and drift families appear as the daemon gets going: wait for them.
    try:
        wait_for(all_exposed, 60, "every referenced metric in the exposition", d)
    except AssertionError:
        pytest.fail(f"metrics used but neither exposed by gemmd nor recorded: {missing}")
    d.terminate()
