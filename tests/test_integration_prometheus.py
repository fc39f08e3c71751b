"""A real Prometheus scraping a real gemmd with the shipped rules and dashboards.

gemmd runs on the fake backend with two GPUs; GPU 1 slows down once the model is fitted
and every drift reference is taken. Prometheus scrapes it every second and evaluates
deploy/prometheus/gemmd.rules.yml unmodified. Through Prometheus's HTTP API the test
checks that every rule and every dashboard query evaluates without error and returns data,
and that the slowdown alert is raised for GPU 1 only.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from datetime import datetime, timezone
from pathlib import Path

import pytest
import yaml
from conftest import (
    FAST_FAKE,
    ROOT,
    LoggedProc,
    free_port,
    merge,
    scrape,
    wait_for,
    write_config,
)

RULES = ROOT / "deploy" / "prometheus" / "gemmd.rules.yml"
DASHBOARDS = sorted((ROOT / "grafana" / "dashboards").glob("*.json"))
# The whole test, Prometheus and daemon start included: a bound against a hang, not a speed
# target (~35 s on an idle machine; each step waits for what it checks).
BUDGET_S = 300
# On the fake GPU's own clock, which runs ahead of wall time by the simulated probe time
# (about 0.75 s per wall second with FAST_FAKE). Measured: the first model is fitted after
# ~5 s and the 5-result drift references are all taken by ~27 s of device time (~15 s of
# wall time); 50 s leaves a margin for a loaded machine and slows GPU 1 at ~28 s of wall.
SLOWDOWN = 1.5
RUNTIME_ALERT = "GemmdGpuSlowerThanPredicted"

# Rules (alerts, recording rules) that may legitimately return nothing here, and why. Every
# other rule and every dashboard query must return data, but for the queries of what
# dcgm-exporter or nvidia_gpu_exporter export (EXPORTER_QUERY; the per-GPU alert test at the
# end of this file serves a fake dcgm-exporter and checks those).
EXPORTER_QUERY = re.compile(r"gemmd:(dcgm|nvidia_smi)_")
MAY_BE_EMPTY = {
    "GemmdGpuSlowdownPersistent": "needs an hour of runtime drift alarm",
    "gemmd:device_runtime_drifting:min_over_1h": "needs an hour of history",
    "gemmd:dcgm_power_usage_watts:join": "no dcgm-exporter in this test",
    "gemmd:dcgm_xid_errors:join": "no dcgm-exporter in this test",
    "gemmd:dcgm_clock_event_reasons:join": "no dcgm-exporter in this test",
    "gemmd:nvidia_smi_power_draw_watts:join": "no nvidia_gpu_exporter in this test",
    "GemmdGpuPowerAbovePredicted": "a throttled fake GPU draws less power, not more",
    "GemmdGpuEnergyAbovePredicted": "GPU 1's energy alarm may or may not be raised yet",
    "GemmdGpuSlowerThanSiblings": "needs at least 3 GPUs of one model; there are 2",
    "GemmdResultMismatch": "fake GPUs compute correctly",
    "GemmdDeviceDown": "no failure injected",
    "GemmdProbesFailing": "no failure injected",
    "GemmdProbesStale": "rounds run every 2 s",
    "GemmdModelStale": "the model is seconds old",
    "GemmdModelWorseThanBaseline": "depends on how well the first small model fits",
    "GemmdDown": "gemmd is up",
    "GemmdStoreErrors": "the store works",
    "GemmdCollectorFailing": "the collector works",
}


class Prometheus(LoggedProc):
    """`prometheus` as a subprocess on a free port, with its log in a file."""

    def __init__(self, binary: str, config: Path, data: Path, log: Path):
        self.port = free_port()
        super().__init__(
            [binary, f"--config.file={config}", f"--storage.tsdb.path={data}",
             f"--web.listen-address=127.0.0.1:{self.port}",
             "--storage.tsdb.retention.time=1h", "--log.level=warn"], log, mode="wb")

    def get(self, path: str, **params) -> dict:
        url = f"http://127.0.0.1:{self.port}{path}"
        if params:
            url += "?" + urllib.parse.urlencode(params)
        try:
            with urllib.request.urlopen(url, timeout=10) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:  # 400/422: a bad query; the body says why
            return json.loads(e.read() or b"{}") | {"http_status": e.code}

    def query(self, expr: str) -> dict:
        return self.get("/api/v1/query", query=expr)

    def stop(self) -> None:
        if self.p.poll() is None:
            self.p.terminate()
            try:
                self.p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait(timeout=10)
        self._f.close()


@pytest.fixture
def prometheus_factory(tmp_path):
    started: list[Prometheus] = []

    def start(config: Path) -> Prometheus:
        binary = shutil.which("prometheus")
        if binary is None:
            pytest.fail("prometheus not on PATH: run `bash scripts/install-test-deps.sh` as "
                        "root (installs the Debian package prometheus; `make test` runs it)")
        p = Prometheus(binary, config, tmp_path / "prometheus-data",
                       tmp_path / "prometheus.log")
        started.append(p)
        return p

    yield start
    for p in started:
        p.stop()


def grafana_to_promql(expr: str, values: dict[str, str]) -> str:
    """Substitute Grafana's variables ($var, ${var}, ${var:format}) as Grafana would."""
    def sub(m: re.Match) -> str:
        name = m.group(1) or m.group(2)
        if name not in values:
            raise AssertionError(f"unknown Grafana variable ${name} in {expr!r}")
        return values[name]

    out = re.sub(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)", sub, expr)
    assert "$" not in out, out
    return out


def label_values_selector(query: str) -> tuple[str, str]:
    m = re.fullmatch(r"\s*label_values\((.+),\s*(\w+)\s*\)\s*", query)
    assert m, f"variable query is not label_values(selector, label): {query!r}"
    return m.group(1), m.group(2)


def dashboard_queries(dash: dict, values: dict[str, str]) -> list[tuple[str, str]]:
    """(where, PromQL) for every panel target and query variable of a dashboard."""
    out = []

    def walk(panels):
        for p in panels:
            for t in p.get("targets", []):
                out.append((f"{dash['uid']}: {p['title']} [{t['refId']}]",
                            grafana_to_promql(t["expr"], values)))
            walk(p.get("panels", []))

    walk(dash["panels"])
    for v in dash["templating"]["list"]:
        if v["type"] == "query":
            q = v["query"]["query"] if isinstance(v["query"], dict) else v["query"]
            selector, label = label_values_selector(q)
            # label_values(sel, label) lists the label's values on sel: sel must carry it.
            out.append((f"{dash['uid']}: variable ${v['name']}",
                        f"count by ({label}) ({grafana_to_promql(selector, values)})"))
    return out



def _slow_file(tmp_path) -> Path:
    """While this file exists, the second fake GPU is slow: the test creates it once drift
    is armed, so the order does not depend on how fast this machine is."""
    return tmp_path / "gpu1-slow"


def _one_slow_gpu_config(tmp_path, port: int, slowdown: float, profile: str = "lean"):
    """Two fake GPUs, the second slowed by ``slowdown`` while _slow_file exists. One fit
    (the first, as soon as min_samples exist), then none that could take the slow GPU's
    results into a new reference."""
    return write_config(tmp_path / "gemmd.yaml", **merge(FAST_FAKE, {
        "listen": {"port": port}, "state_dir": str(tmp_path / "state"),
        "schedule": {"refit_interval_s": 3600},
        "drift": {"baseline_probes": 5}, "metrics": {"profile": profile},
        "fake": {"devices": [{}, {"slowdown_factor": slowdown,
                                  "slowdown_when_file": str(_slow_file(tmp_path))}]}}))


def _settled(port: int):
    """The scrape once the model is fitted, the 10 runtime drift references (5 probes, 2
    GPUs) are taken and no GPU is in runtime drift alarm (series of either profile)."""
    m = scrape(port)
    fitted = m["gemmd_model_info"][0].labels["kind"] == "random_forest"
    refs = [s for s in m.get("gemmd_probe_drift_reference_ratio", [])
            if s.labels["target"] == "runtime"]
    alarms = [s for s in m.get("gemmd_device_drifting", []) if s.labels["target"] == "runtime"]
    calm = len(refs) == 10 and len(alarms) == 2 and not any(s.value for s in alarms)
    return m if fitted and calm else None


METRIC_RE = re.compile(r"(?<![A-Za-z0-9_:])(gemmd_[A-Za-z0-9_]*[A-Za-z0-9])")


def reads_full_only(expr: str) -> bool:
    """Whether a query reads a series of the full metrics profile only (then it may be
    empty with the lean one, the default)."""
    from gemmd.exporter.series import LEAN

    return any(n.removesuffix("_total") not in LEAN for n in METRIC_RE.findall(expr))


@pytest.mark.parametrize("profile", ["lean", "full"])
def test_prometheus_evaluates_every_rule_and_dashboard_query_and_alerts_on_the_slow_gpu(
        tmp_path, daemon_factory, prometheus_factory, profile):
    """With either metrics profile; with the lean one (the default) the dashboards' queries
    of the full profile only (their collapsed row, the power and energy bands, the probes'
    own alarms) may be empty."""
    t_start = time.monotonic()

    def left() -> float:
        return max(1.0, BUDGET_S - (time.monotonic() - t_start))

    port = free_port()
    cfg = _one_slow_gpu_config(tmp_path, port, SLOWDOWN, profile)
    daemon = daemon_factory(cfg)
    prom_cfg = tmp_path / "prometheus.yml"
    prom_cfg.write_text(yaml.safe_dump({
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(RULES)],
        "scrape_configs": [{"job_name": "gemmd",
                            "static_configs": [{"targets": [f"127.0.0.1:{port}"]}]}],
    }))
    prom = prometheus_factory(prom_cfg)

    # 1. Prometheus is up, has loaded every rule, and scrapes gemmd.
    wait_for(lambda: _ready(prom), left(), "Prometheus to be ready", prom)
    groups = wait_for(lambda: prom.get("/api/v1/rules")["data"]["groups"], left(),
                      "rules to be loaded", prom)
    shipped = yaml.safe_load(RULES.read_text())["groups"]
    assert sum(len(g["rules"]) for g in groups) == sum(len(g["rules"]) for g in shipped)

    def target_up():
        targets = prom.get("/api/v1/targets")["data"]["activeTargets"]
        return targets and all(t["health"] == "up" for t in targets)

    wait_for(target_up, left(), "the gemmd target to be up", prom)

    # 2. The model is fitted and the drift references are all taken before GPU 1 slows
    # down (the test starts it, whatever this machine's speed): otherwise gemmd would
    # learn the slow card as its normal and nothing could alarm. No runtime alarm either:
    # a probe recorded while a refit has swapped the model but not yet re-taken the drift
    # references is judged against the old model's reference, which can raise a short
    # spurious alarm; let it clear first.
    m = wait_for(lambda: _settled(port), left(), "a fitted model, 10 runtime drift "
                 "references and no runtime drift alarm", daemon)
    settled_at = time.time()
    _slow_file(tmp_path).touch()  # now GPU 1 slows down

    # 3. The slowdown alert goes pending (then firing after `for`) for GPU 1 only, with
    # the slowdown as its value (GPU 1's runtime against its own normal).
    seen_gpu0: list[dict] = []

    def slow_gpu_alert():
        alerts = [a for a in prom.get("/api/v1/alerts")["data"]["alerts"]
                  if a["labels"]["alertname"] == RUNTIME_ALERT]
        seen_gpu0.extend(a for a in alerts if a["labels"]["gpu"] == "0"
                         and _unix(a["activeAt"]) >= settled_at)
        return [a for a in alerts if a["labels"]["gpu"] == "1"
                and a["state"] in ("pending", "firing") and 1.3 < float(a["value"]) < 1.7]

    slow = wait_for(slow_gpu_alert, left(), f"{RUNTIME_ALERT} for GPU 1 with value ~"
                    f"{SLOWDOWN}", prom)
    assert {a["labels"]["target"] for a in slow} == {"runtime"}
    assert all(a["annotations"]["description"] and a["annotations"]["summary"]
               for a in slow)
    description = slow[0]["annotations"]["description"]
    # The worst probe's measured/predicted ratio and its normal for this card, whose
    # quotient is the slowdown. Not the ratio alone: how well the model predicts the
    # worst probe depends on how much data the fit had when it ran (a loaded machine:
    # tiled16 at 2.008 against a normal of 1.338, for 1.50x).
    found = re.search(r"measured/predicted runtime ([0-9.]+), normal for this card "
                      r"([0-9.]+)", description)
    assert found, description
    assert 1.3 < float(found[1]) / float(found[2]) < 1.7, description

    # The recording rules have seen the slow GPU too.
    def recorded_slow():
        r = prom.query('gemmd:probe_runtime_ratio:relative_to_reference{gpu="1"} > 1.3')
        return len(r["data"]["result"]) == 5

    wait_for(recorded_slow, left(), "recording rules to see GPU 1's slowdown", prom)

    # 4. Every rule evaluates in Prometheus without error.
    groups = prom.get("/api/v1/rules")["data"]["groups"]
    bad = [(r["name"], r.get("lastError")) for g in groups for r in g["rules"]
           if r["health"] != "ok"]
    assert not bad, bad

    checks: list[tuple[str, str, bool]] = []  # (where, expression, must return data)

    def check(where: str, expr: str, need_data: bool) -> None:
        checks.append((where, expr, need_data))

    # 5. Every rule expression returns data, but for the alerts listed in MAY_BE_EMPTY.
    for g in shipped:
        for rule in g["rules"]:
            name = rule.get("record") or rule["alert"]
            check(f"rule {name}", rule["expr"], name not in MAY_BE_EMPTY)
            if "record" in rule:  # and what it recorded is queryable under its name
                check(f"recorded {name}", name, name not in MAY_BE_EMPTY)
    assert set(MAY_BE_EMPTY) <= {r.get("alert") or r["record"] for g in shipped
                                 for r in g["rules"]}

    # 6. Every dashboard query returns data, with Grafana's variables as Grafana would
    # substitute them: the fleet view on all hosts and GPUs, the GPU view on GPU 1.
    host = m["gemmd_build_info"][0].labels["hostname"]
    assert host and all(s.labels.get("hostname") == host for ss in m.values() for s in ss)
    common = {"__rate_interval": "30s", "__interval": "15s", "__range": "5m",
              "datasource": ""}
    for path in DASHBOARDS:
        dash = json.loads(path.read_text())
        one_gpu = {"hostname": host, "gpu": "1", "probe": ".+"}
        values = common | (one_gpu if dash["uid"] == "gemmd-gpu"
                           else {"hostname": ".+", "gpu": ".+", "probe": ".+"})
        for where, expr in dashboard_queries(dash, values):
            check(where, expr, not EXPORTER_QUERY.search(expr) and not (
                profile == "lean" and reads_full_only(expr)))

    # Some series exist only once the daemon has taken their drift references, and the
    # power and energy ones take longer than the runtime ones waited for above (~45 s of
    # wall time on an idle machine): wait for every answer rather than race them.
    failures: list[str] = []

    def every_query_answers() -> bool:
        failures.clear()
        for where, expr, need_data in checks:
            r = prom.query(expr)
            if r.get("status") != "success":
                failures.append(f"{where}: error {r.get('errorType')}: {r.get('error')}\n"
                                f"  {expr}")
            elif need_data and not r["data"]["result"]:
                failures.append(f"{where}: no data\n  {expr}")
        return not failures

    try:
        wait_for(every_query_answers, left(), "every rule and dashboard query to answer",
                 prom)
    except AssertionError:
        pytest.fail("\n".join(failures))

    # 7. Still nothing for the healthy GPU.
    slow_gpu_alert()
    assert not seen_gpu0, seen_gpu0
    rc, _ = daemon.terminate()
    assert rc == 0
    took = time.monotonic() - t_start
    assert took < BUDGET_S, took


def _unix(rfc3339: str) -> float:
    """Prometheus's activeAt (nanoseconds, Z) as a Unix time."""
    m = re.match(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(?:\.(\d{1,6})\d*)?", rfc3339)
    assert m, rfc3339
    dt = datetime.fromisoformat(m.group(1)).replace(tzinfo=timezone.utc)
    return dt.timestamp() + float(f"0.{m.group(2) or 0}")


def _ready(prom: Prometheus) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{prom.port}/-/ready", timeout=2) as r:
            return r.status == 200
    except urllib.error.HTTPError:  # 503 while starting
        return False


# ------------------------------------------------------- HTTPS and basic auth (web config)

@pytest.mark.parametrize("password, up", [("s3cret", True), ("wrong", False)],
                         ids=["right-password-up", "wrong-password-down-401"])
def test_prometheus_scrapes_over_https_with_basic_auth(tmp_path, prometheus_factory,
                                                       password, up):
    """A real Prometheus scrapes an Exposition served with an exporter-toolkit web config
    (TLS + basic auth), verifying the server certificate against the test CA: with the
    right password the target is up and its series are stored; with a wrong one the
    target is down and its last error is the 401."""
    import bcrypt
    from test_http import make_pki

    from gemmd.config import load_web_config
    from gemmd.exporter import Exposition
    from gemmd.exporter.http import serve
    from gemmd.state import State

    pki = make_pki(tmp_path / "pki")
    web = tmp_path / "web.yml"
    web.write_text(yaml.safe_dump({
        "tls_server_config": {"cert_file": str(pki / "server.pem"),
                              "key_file": str(pki / "server.key")},
        "basic_auth_users": {"prometheus": bcrypt.hashpw(b"s3cret", bcrypt.gensalt(10))
                             .decode()}}))
    httpd = serve(Exposition(State(), process=False), "127.0.0.1", 0,
                  web_config=load_web_config(web))
    try:
        prom_cfg = tmp_path / "prometheus.yml"
        prom_cfg.write_text(yaml.safe_dump({
            "global": {"scrape_interval": "1s", "scrape_timeout": "1s"},
            "scrape_configs": [{
                "job_name": "gemmd-tls", "scheme": "https",
                "tls_config": {"ca_file": str(pki / "ca.pem")},
                "basic_auth": {"username": "prometheus", "password": password},
                "static_configs": [{"targets": [f"127.0.0.1:{httpd.server_port}"]}]}],
        }))
        prom = prometheus_factory(prom_cfg)
        wait_for(lambda: _ready(prom), 60, "Prometheus to be ready", prom)

        def scraped():
            targets = prom.get("/api/v1/targets")["data"]["activeTargets"]
            return [t for t in targets if t["health"] != "unknown"]

        (target,) = wait_for(scraped, 60, "the first scrape of the HTTPS target", prom)
        if up:
            assert target["health"] == "up", target["lastError"]
            assert target["scrapeUrl"].startswith("https://")
            r = wait_for(lambda: prom.query('gemmd_build_info{job="gemmd-tls"}')["data"]
                         ["result"], 30, "gemmd_build_info to be stored", prom)
            assert r[0]["metric"]["instance"] == f"127.0.0.1:{httpd.server_port}"
        else:
            assert target["health"] == "down"
            assert "401" in target["lastError"], target["lastError"]
    finally:
        httpd.shutdown()
        httpd.server_close()


# ------------------------------------------------ one alert per slow GPU, beside dcgm-exporter

PER_GPU_SLOWDOWN = 1.15  # 15 %: the slowdown that used to raise one alert per probe and target
SLOWDOWN_ALERTS = {"GemmdGpuSlowerThanPredicted", "GemmdGpuSlowdownPersistent"}


class FakeGpuExporters:
    """dcgm-exporter's and nvidia_gpu_exporter's series for the given GPUs on a free port,
    labelled as they label them: `UUID` ("GPU-...") and `uuid` without the "GPU-" prefix.
    GPU 1 reports hw_thermal_slowdown (0x40) and an Xid 79."""

    def __init__(self, uuids: dict[str, str]):
        import http.server
        import threading

        lines = []
        for gpu, uuid in sorted(uuids.items()):
            dcgm = (f'gpu="{gpu}",UUID="{uuid}",device="nvidia{gpu}",'
                    f'modelName="NVIDIA H100 80GB HBM3",Hostname="gpu-node-07"')
            lines += [f"DCGM_FI_DEV_POWER_USAGE{{{dcgm}}} {300 + 10 * int(gpu)}",
                      f"DCGM_FI_DEV_XID_ERRORS{{{dcgm}}} {79 if gpu == '1' else 0}",
                      f"DCGM_FI_DEV_CLOCKS_EVENT_REASONS{{{dcgm}}} {64 if gpu == '1' else 0}",
                      f'nvidia_smi_power_draw_watts{{uuid="{uuid.removeprefix("GPU-")}"}} '
                      f"{290 + 10 * int(gpu)}"]
        body = ("\n".join(lines) + "\n").encode()

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 (http.server's name)
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.httpd.server_port
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def test_a_15_percent_slower_gpu_raises_one_alert_and_dcgm_series_join_it(
        tmp_path, daemon_factory, prometheus_factory):
    """Two fake GPUs, GPU 1 15 % slower once the drift references are taken: exactly one
    slowdown alert (pending or firing), for GPU 1, no alert for GPU 0 and none per probe;
    a fake dcgm-exporter's and nvidia_gpu_exporter's series join gemmd's GPUs, and the GPU
    dashboard's exporter panels show them."""
    t_start = time.monotonic()

    def left() -> float:
        return max(1.0, BUDGET_S - (time.monotonic() - t_start))

    port = free_port()
    cfg = _one_slow_gpu_config(tmp_path, port, PER_GPU_SLOWDOWN)
    daemon = daemon_factory(cfg)
    info = wait_for(lambda: scrape(port).get("gemmd_device_info"), left(),
                    "gemmd_device_info", daemon)
    uuids = {s.labels["gpu"]: s.labels["uuid"] for s in info}
    assert set(uuids) == {"0", "1"}
    exporters = FakeGpuExporters(uuids)
    try:
        prom_cfg = tmp_path / "prometheus.yml"
        prom_cfg.write_text(yaml.safe_dump({
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(RULES)],
            "scrape_configs": [
                {"job_name": "gemmd",
                 "static_configs": [{"targets": [f"127.0.0.1:{port}"]}]},
                {"job_name": "dcgm-exporter",
                 "static_configs": [{"targets": [f"127.0.0.1:{exporters.port}"]}]}],
        }))
        prom = prometheus_factory(prom_cfg)
        wait_for(lambda: _ready(prom), left(), "Prometheus to be ready", prom)

        def targets_up():
            targets = prom.get("/api/v1/targets")["data"]["activeTargets"]
            return len(targets) == 2 and all(t["health"] == "up" for t in targets)

        wait_for(targets_up, left(), "gemmd and the fake dcgm-exporter to be up", prom)

        # The model and every drift reference before GPU 1 slows down.
        m = wait_for(lambda: _settled(port), left(), "a fitted model and 10 calm runtime "
                     "drift references", daemon)
        settled_at = time.time()
        _slow_file(tmp_path).touch()  # now GPU 1 slows down

        seen_gpu0: list[dict] = []

        def gemmd_alerts() -> list[dict]:
            out = [a for a in prom.get("/api/v1/alerts")["data"]["alerts"]
                   if a["labels"]["alertname"].startswith("Gemmd")]
            seen_gpu0.extend(a for a in out if a["labels"].get("gpu") == "0"
                             and _unix(a["activeAt"]) >= settled_at)
            return out

        def slow_gpu_alert():
            return [a for a in gemmd_alerts() if a["labels"]["alertname"] in SLOWDOWN_ALERTS
                    and a["labels"].get("gpu") == "1"]

        (slow,) = wait_for(slow_gpu_alert, left(), "a slowdown alert for GPU 1", prom)
        assert slow["labels"]["alertname"] == RUNTIME_ALERT
        assert slow["labels"]["severity"] == "warning"
        assert slow["labels"]["target"] == "runtime"
        assert 1.08 < float(slow["value"]) < 1.3, slow["value"]
        assert "worst probe, " in slow["annotations"]["description"]
        # The runbook link works as shipped: the gemmd that raised the alert serves it.
        url, section = slow["annotations"]["runbook_url"].split("#")
        assert url == f"http://127.0.0.1:{port}/runbook" and \
            section == "gemmdgpuslowerthanpredicted"
        with urllib.request.urlopen(url, timeout=10) as r:
            assert f'id="{section}"' in r.read().decode()

        # A few evaluations on (the energy alarm, if raised, is the slowdown's: quiet), the
        # slow GPU has that one alert and no other; no alert is per probe.
        time.sleep(3)
        per_gpu = [a for a in gemmd_alerts() if "uuid" in a["labels"]]
        assert [(a["labels"]["alertname"], a["labels"]["gpu"]) for a in per_gpu] == \
            [(RUNTIME_ALERT, "1")], per_gpu
        assert not any("probe" in a["labels"] for a in gemmd_alerts())
        assert not seen_gpu0, seen_gpu0

        # dcgm-exporter's and nvidia_gpu_exporter's series carry gemmd's labels now.
        instance = f"127.0.0.1:{port}"

        def joined():
            r = prom.query(f'gemmd:dcgm_power_usage_watts:join{{instance="{instance}",'
                           f'gpu="1"}}')["data"]["result"]
            return r if r else None

        (power,) = wait_for(joined, left(), "DCGM power joined to GPU 1", prom)
        assert power["metric"]["job"] == "gemmd" and power["metric"]["uuid"] == uuids["1"]
        assert float(power["value"][1]) == 310
        r = prom.query(f'gemmd:nvidia_smi_power_draw_watts:join{{instance="{instance}",'
                       f'gpu="0"}}')["data"]["result"]
        assert [float(x["value"][1]) for x in r] == [290]

        # The GPU dashboard's exporter panels show GPU 1's DCGM data.
        dash = json.loads((ROOT / "grafana" / "dashboards" / "gemmd-gpu.json").read_text())
        values = {"__rate_interval": "30s", "__interval": "15s", "__range": "5m",
                  "datasource": "", "hostname": m["gemmd_build_info"][0].labels["hostname"],
                  "gpu": "1", "probe": ".+"}
        exporter_queries = [(w, e) for w, e in dashboard_queries(dash, values)
                            if EXPORTER_QUERY.search(e)]
        assert len(exporter_queries) >= 5
        results = {w: prom.query(e) for w, e in exporter_queries}
        empty = [w for w, r in results.items() if not r["data"]["result"]]
        assert not empty, empty
        # Its hw_thermal_slowdown bit (0x40, the panel's target D) is decoded as set.
        (thermal,) = results["gemmd-gpu: Throttle reasons (DCGM) [D]"]["data"]["result"]
        assert float(thermal["value"][1]) == 1
    finally:
        exporters.stop()
    rc, _ = daemon.terminate()
    assert rc == 0
    took = time.monotonic() - t_start
    assert took < BUDGET_S, took
