"""The shipped monitoring: alert/recording rules (promtool), runbook links, dashboards.

Every metric name that a rule, an alert template or a dashboard query uses must exist in
the exposition of a real `gemmd run` (or be a recording rule of the rule file), so that a
renamed metric breaks a test instead of a dashboard.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import urllib.request
from collections.abc import Iterator

import pytest
import yaml
from conftest import FAST_FAKE, ROOT, free_port, merge, wait_for, write_config

PROM_DIR = ROOT / "deploy" / "prometheus"
RULES = PROM_DIR / "gemmd.rules.yml"
RULE_TESTS = sorted((PROM_DIR / "tests").glob("*.yml"))
RUNBOOK = ROOT / "docs" / "runbook.md"
DASHBOARDS = sorted((ROOT / "grafana" / "dashboards").glob("*.json"))
SEVERITIES = {"page", "ticket"}
# A metric name of gemmd's (gemmd_...) or a recording rule of ours (gemmd:...).
METRIC_RE = re.compile(r"(?<![A-Za-z0-9_:])(gemmd[_:][A-Za-z0-9_:]*[A-Za-z0-9_])")


def promtool() -> str:
    path = shutil.which("promtool")
    if not path:
        pytest.fail("promtool not on PATH: run `bash scripts/install-test-deps.sh` as root "
                    "(installs the Debian package prometheus; `make test` runs it)")
    return path


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
    seen = set()
    for a in alerts():
        name = a["alert"]
        assert name not in seen, f"duplicate alert {name}"
        seen.add(name)
        assert a.get("labels", {}).get("severity") in SEVERITIES, name
        ann = a.get("annotations", {})
        assert ann.get("summary"), f"{name}: no summary"
        desc = ann.get("description", "")
        assert "{{ $labels." in desc and "$value" in desc, \
            f"{name}: the description must show labels and the value"
        anchor = github_anchor(name)
        assert ann.get("runbook_url") == f"docs/runbook.md#{anchor}", name
        assert anchor in anchors, f"docs/runbook.md has no '## {name}' section"


def test_recording_rules_are_named_gemmd_level_metric_operations():
    for r in recording_rules():
        parts = r["record"].split(":")
        assert len(parts) == 3 and parts[0] == "gemmd" and all(parts), r["record"]


def test_runbook_documents_scrape_config_and_dashboard_import():
    text = RUNBOOK.read_text()
    assert "## Prometheus scrape config" in text
    assert "## Import the dashboards" in text


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
        for var in ("instance", "gpu"):
            assert variables.get(var, {}).get("type") == "query", f"{name}: no ${var}"
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


def test_every_referenced_metric_exists_in_a_live_exposition(tmp_path, daemon_factory):
    port = free_port()
    # Small baselines so that model, prediction and drift series all appear within seconds.
    cfg = write_config(tmp_path / "gemmd.yaml", **merge(FAST_FAKE, {
        "listen": {"port": port}, "state_dir": str(tmp_path / "state"),
        "drift": {"baseline_probes": 2}}))
    d = daemon_factory(cfg)

    recorded = {r["record"] for r in recording_rules()}
    used = referenced_metrics()
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
