"""Kubernetes and image set-up beyond the base, offline (no cluster, no Docker, no hadolint):

- the NetworkPolicy of the base admits the plaintext ports (metrics, probes) to nobody but
  Prometheus and the node, and the mTLS port to the nodes' network and Spark;
- the per-node-certs overlay (composed here as kustomize would: base, resources, a strategic
  merge patch) validates against the Kubernetes schemas and cert-manager's CRD fields
  (tests/data/cert-manager-v1.schema.json), and its init step gives each node a certificate
  for its own advertised IP, the peer name, and the files the sidecar reads;
- the Spark Operator SparkApplication validates against the SparkApplication CRD fields
  (tests/data/sparkapplication-v1beta2.schema.json), its pod templates against the Kubernetes
  Pod schema, and carries exactly the pod templates beside it;
- the Dockerfiles are linted: base images pinned, a non-root USER last, no secrets, every COPY
  source in the build context; docs/DEPLOY.md tells how to build and push the image the
  DaemonSet names.
"""

from __future__ import annotations

import copy
import ipaddress
import json
import re
import shutil
import subprocess
import tomllib
from pathlib import Path, PurePosixPath

import grpc
import javaproperties
import jsonschema
import kubernetes_validate
import pytest
import yaml
from test_compose import dockerfile_instructions, dockerignore_rules, ignored, instruction_args
from test_kubernetes import BASE, K8S_VERSION, TEMPLATES, _load_all, build
from support import paths
from support.rpc import port_of

ROOT = paths.ROOT
DATA = ROOT / "tests" / "data"
OVERLAY = ROOT / "deploy" / "kubernetes-per-node-certs"
SPARK_APP = BASE / "spark" / "spark-application.yaml"
DEPLOY_DOC = ROOT / "docs" / "DEPLOY.md"
NODE = {"HOST_IP": "10.1.2.3", "NODE_NAME": "node-a"}


def _schema(name: str) -> jsonschema.Draft202012Validator:
    schema = json.loads((DATA / name).read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def _props(resources) -> dict[str, str]:
    [cm] = [d for d in resources if d["kind"] == "ConfigMap"
            and d["metadata"]["name"] == "spillway-sidecar-config"]
    return dict(javaproperties.loads(cm["data"]["sidecar.properties"]))


def _pod(resources) -> dict:
    [ds] = [d for d in resources if d["kind"] == "DaemonSet"]
    return ds["spec"]["template"]


# --- NetworkPolicy ---------------------------------------------------------------------------


def admitted_from(policy: dict, port: int) -> list[list[dict]] | None:
    """The `from` lists of the rules admitting `port` (an empty list: from anywhere); None when
    no rule admits it."""
    out = []
    for rule in policy["spec"].get("ingress", []):
        ports = rule.get("ports")
        if ports is None or any(p.get("port") == port for p in ports):
            out.append(rule.get("from") or [])
    return out or None


@pytest.fixture(scope="module")
def base():
    return build()


@pytest.fixture(scope="module")
def policy(base):
    [p] = [d for d in base if d["kind"] == "NetworkPolicy"]
    return p


def test_the_policy_selects_the_sidecar_pods_and_isolates_their_ingress(base, policy):
    labels = _pod(base)["metadata"]["labels"]
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= labels.items()
    assert "Ingress" in policy["spec"]["policyTypes"]
    kubernetes_validate.validate(policy, K8S_VERSION, strict=True)
    for rule in policy["spec"]["ingress"]:  # no rule opens every port, or a port to everyone
        assert rule.get("ports") and rule.get("from"), rule


def test_plaintext_ports_are_closed_to_pods_but_prometheus(base, policy):
    props = _props(base)
    [sidecar] = _pod(base)["spec"]["containers"]
    ports = {p["containerPort"] for p in sidecar["ports"]}
    metrics, probe = int(props["metrics.prometheus.port"]), port_of(props["health.listen.address"])
    assert {metrics, probe} <= ports
    # the probe port: no pod at all (the kubelet probes from the node, always admitted)
    assert admitted_from(policy, probe) is None
    # metrics: Prometheus pods only, never an address block
    [peers] = admitted_from(policy, metrics)
    assert peers and all("ipBlock" not in p and "podSelector" in p for p in peers)
    # every port the container opens is covered by a decision of this policy (no port forgotten)
    grpc = port_of(props["listen.address"])
    assert ports == {grpc, metrics, probe}


def test_the_mtls_port_admits_the_nodes_network_of_the_home_allow_list(base, policy):
    props = _props(base)
    grpc = port_of(props["listen.address"])
    [peers] = admitted_from(policy, grpc)
    cidrs = {p["ipBlock"]["cidr"] for p in peers if "ipBlock" in p}
    allowed = props["home.allowed.addresses"].rpartition(":")[0]
    assert cidrs == {str(ipaddress.ip_network(allowed))}
    namespaces = {p["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"]
                  for p in peers if "namespaceSelector" in p}
    assert namespaces == {"spark"}  # where the pod templates and the SparkApplication run
    assert yaml.safe_load(SPARK_APP.read_text())["metadata"]["namespace"] in namespaces


def test_the_policy_check_sees_an_opened_port(policy):
    opened = copy.deepcopy(policy)
    opened["spec"]["ingress"].append({"ports": [{"port": 50052, "protocol": "TCP"}]})
    assert admitted_from(opened, 50052) == [[]]  # from anywhere


# --- per-node certificates -------------------------------------------------------------------


def strategic_merge(target, patch):
    """Kubernetes' strategic merge for what the overlay's patch uses, ordered as kustomize
    (kyaml) orders it: maps merge, `null` deletes a key, lists of named items merge by name
    (the patch's items first, in its order, then the others), other lists are replaced."""
    if isinstance(target, dict) and isinstance(patch, dict):
        out = dict(target)
        for key, value in patch.items():
            if value is None:
                out.pop(key, None)
            elif key in out:
                out[key] = strategic_merge(out[key], value)
            else:
                out[key] = strip_nulls(value)
        return out
    if (isinstance(target, list) and isinstance(patch, list)
            and all(isinstance(x, dict) and "name" in x for x in target + patch)):
        by_name = {x["name"]: x for x in target}
        out = [strategic_merge(by_name[x["name"]], x) if x["name"] in by_name
               else strip_nulls(x) for x in patch]
        patched = {x["name"] for x in patch}
        return out + [x for x in target if x["name"] not in patched]
    return strip_nulls(patch)


def strip_nulls(value):
    if isinstance(value, dict):
        return {k: strip_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [strip_nulls(v) for v in value]
    return value


def build_overlay(overlay: Path = OVERLAY) -> list[dict]:
    # kustomize refuses a base that contains the overlay ("cycle detected")
    assert BASE.resolve() not in overlay.resolve().parents, f"{overlay} is inside the base"
    kust = yaml.safe_load((overlay / "kustomization.yaml").read_text())
    unknown = set(kust) - {"apiVersion", "kind", "namespace", "resources", "patches"}
    assert not unknown, f"{overlay}/kustomization.yaml uses {unknown}: teach this test"
    out: list[dict] = []
    for rel in kust["resources"]:
        path = (overlay / rel).resolve()
        if path.is_dir():
            assert path == BASE.resolve(), f"{rel}: only the base is composed here"
            out += build(path)
        else:
            for doc in _load_all(path):
                doc = copy.deepcopy(doc)
                if doc["kind"] not in ("Namespace",):
                    doc.setdefault("metadata", {})["namespace"] = kust["namespace"]
                out.append(doc)
    for entry in kust["patches"]:
        assert set(entry) == {"path"}, entry
        [patch] = _load_all(overlay / entry["path"])
        hits = [i for i, d in enumerate(out) if (d["kind"], d["metadata"]["name"]) ==
                (patch["kind"], patch["metadata"]["name"])]
        assert len(hits) == 1, f"{entry['path']} patches {len(hits)} resources"
        body = {k: v for k, v in patch.items() if k != "metadata"}
        out[hits[0]] = strategic_merge(out[hits[0]], body)
    return out


@pytest.fixture(scope="module")
def overlay():
    return build_overlay()


def _rendered_certificate(overlay, node: dict[str, str] = NODE) -> dict:
    """The template as the init container `render` writes it on `node`."""
    [cm] = [d for d in overlay if d["kind"] == "ConfigMap"
            and d["metadata"]["name"] == "spillway-node-certificate"]
    text = cm["data"]["certificate.yaml"]
    for name, value in node.items():
        text = text.replace(f"@{name}@", value)
    assert "@" not in text
    return yaml.safe_load(text)


def test_strategic_merge_follows_kubernetes_rules():
    base = {"volumes": [{"name": "a", "secret": {"secretName": "s"}}, {"name": "b"}],
            "args": ["x"]}
    patch = {"volumes": [{"name": "a", "secret": None, "emptyDir": {}}, {"name": "c"}],
             "args": ["y"]}
    assert strategic_merge(base, patch) == {
        "volumes": [{"name": "a", "emptyDir": {}}, {"name": "c"}, {"name": "b"}], "args": ["y"]}


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl (kustomize) not installed")
@pytest.mark.parametrize("root", [BASE, OVERLAY], ids=["base", "per-node-certs"])
def test_the_composition_is_what_kubectl_kustomize_builds(root):
    """Where kubectl is installed, its kustomize builds exactly what these tests check."""
    out = subprocess.run(["kubectl", "kustomize", str(root)], capture_output=True, text=True,
                         timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    real = sorted((d for d in yaml.safe_load_all(out.stdout) if d),
                  key=lambda d: (d["kind"], d["metadata"]["name"]))
    ours = sorted(build() if root == BASE else build_overlay(),
                  key=lambda d: (d["kind"], d["metadata"]["name"]))
    assert real == ours


def test_the_overlay_validates_against_kubernetes_and_cert_manager_schemas(overlay):
    cert_manager = _schema("cert-manager-v1.schema.json")
    kinds = {d["kind"] for d in overlay}
    assert {"DaemonSet", "Issuer", "Role", "RoleBinding", "NetworkPolicy"} <= kinds
    for doc in overlay:
        if doc["apiVersion"].startswith("cert-manager.io/"):
            cert_manager.validate(doc)
        else:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    cert_manager.validate(_rendered_certificate(overlay))
    # the schema has teeth: a misspelt field or a usage cert-manager does not know is refused
    bad = _rendered_certificate(overlay)
    bad["spec"]["ipAddress"] = bad["spec"].pop("ipAddresses")
    with pytest.raises(jsonschema.ValidationError):
        cert_manager.validate(bad)
    bad = _rendered_certificate(overlay)
    bad["spec"]["usages"] = ["server-auth"]
    with pytest.raises(jsonschema.ValidationError):
        cert_manager.validate(bad)


def test_each_node_gets_a_certificate_for_its_own_advertised_ip_and_the_peer_name(overlay):
    props = _props(overlay)
    pod = _pod(overlay)["spec"]
    [sidecar] = pod["containers"]
    inits = {c["name"]: c for c in pod["initContainers"]}
    render, node_cert = inits["render"], inits["node-cert"]
    env = {e["name"]: e for e in render["env"]}
    sidecar_env = {e["name"]: e for e in sidecar["env"]}
    # the IP in the certificate is the one the sidecar advertises: the node's (status.hostIP)
    assert env["HOST_IP"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.hostIP"}}
    assert sidecar_env["HOST_IP"]["valueFrom"] == env["HOST_IP"]["valueFrom"]
    assert sidecar_env["SPILLWAY_ADVERTISED_ADDRESS"]["value"].startswith("$(HOST_IP):")
    cert = _rendered_certificate(overlay)
    assert cert["spec"]["ipAddresses"] == [NODE["HOST_IP"]]
    assert set(props["auth.peer.identities"].split(",")) <= set(cert["spec"]["dnsNames"])
    assert {"server auth", "client auth"} <= set(cert["spec"]["usages"])
    # signed by the overlay's Issuer, in the namespace cmctl creates the request in
    [issuer] = [d for d in overlay if d["kind"] == "Issuer"]
    assert cert["spec"]["issuerRef"]["name"] == issuer["metadata"]["name"]
    assert cert["metadata"]["namespace"] == issuer["metadata"]["namespace"] == "spillway"
    assert "--namespace=spillway" in node_cert["args"]


def _mount_of(container: dict, volume: str) -> str:
    [m] = [m for m in container.get("volumeMounts", []) if m["name"] == volume]
    return m["mountPath"]


def test_the_init_step_writes_exactly_the_files_the_sidecar_reads(overlay):
    props = _props(overlay)
    pod = _pod(overlay)["spec"]
    [sidecar] = pod["containers"]
    inits = {c["name"]: c for c in pod["initContainers"]}
    render, node_cert = inits["render"], inits["node-cert"]
    [tls] = [v for v in pod["volumes"] if v["name"] == "tls"]
    assert "secret" not in tls and tls["emptyDir"]["medium"] == "Memory"  # no shared Secret
    in_sidecar = PurePosixPath(_mount_of(sidecar, "tls"))

    def written_by_node_cert(flag):
        [arg] = [a for a in node_cert["args"] if a.startswith(f"--{flag}=")]
        path = PurePosixPath(arg.split("=", 1)[1])
        return in_sidecar / path.relative_to(_mount_of(node_cert, "tls"))

    assert str(written_by_node_cert("output-key-file")) == props["tls.key.file"]
    assert str(written_by_node_cert("output-certificate-file")) == props["tls.cert.file"]
    # the CA bundle: copied by `render` from the ConfigMap into the same emptyDir
    script = render["command"][-1]
    ca_dest = PurePosixPath(_mount_of(render, "tls")) / PurePosixPath(props["tls.ca.file"]).name
    assert f"{_mount_of(render, 'ca-bundle')}/ca.crt {ca_dest}" in script
    assert in_sidecar / ca_dest.name == PurePosixPath(props["tls.ca.file"])
    # cmctl reads the rendered template render wrote, in their shared scratch volume
    [template_arg] = [a for a in node_cert["args"] if a.startswith("--from-certificate-file=")]
    rendered = PurePosixPath(template_arg.split("=", 1)[1])
    assert f"> {rendered}" in script
    assert rendered.parent == PurePosixPath(_mount_of(render, "cert-work"))
    # ordering: the files exist before the sidecar starts (init containers run in order)
    names = [c["name"] for c in pod["initContainers"]]
    assert names.index("render") < names.index("node-cert")


def test_only_the_request_step_holds_api_credentials(overlay):
    pod = _pod(overlay)["spec"]
    assert pod["automountServiceAccountToken"] is False
    holders = [c["name"] for c in pod["containers"] + pod["initContainers"]
               if any(m["name"] == "api-token" for m in c.get("volumeMounts", []))]
    assert holders == ["node-cert"]
    [role] = [d for d in overlay if d["kind"] == "Role"]
    [binding] = [d for d in overlay if d["kind"] == "RoleBinding"]
    assert role["rules"] == [{"apiGroups": ["cert-manager.io"],
                              "resources": ["certificaterequests"], "verbs": ["create", "get"]}]
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": pod["serviceAccountName"],
                                    "namespace": "spillway"}]


# --- SparkApplication ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def spark_app():
    return yaml.safe_load(SPARK_APP.read_text())


def test_the_spark_application_validates_against_the_crd_fields(spark_app):
    validator = _schema("sparkapplication-v1beta2.schema.json")
    validator.validate(spark_app)
    for role in ("driver", "executor"):  # the pod parts: the Kubernetes Pod schema
        pod = {"apiVersion": "v1", "kind": "Pod", **spark_app["spec"][role]["template"]}
        kubernetes_validate.validate(pod, K8S_VERSION, strict=True)
    bad = copy.deepcopy(spark_app)
    bad["spec"]["executor"]["instance"] = bad["spec"]["executor"].pop("instances")
    with pytest.raises(jsonschema.ValidationError, match="instance"):
        validator.validate(bad)
    bad = copy.deepcopy(spark_app)
    bad["spec"]["type"] = "PySpark"
    with pytest.raises(jsonschema.ValidationError):
        validator.validate(bad)


@pytest.mark.parametrize("role", sorted(TEMPLATES))
def test_the_spark_application_carries_the_pod_templates(spark_app, role):
    [pod] = _load_all(TEMPLATES[role])
    template = spark_app["spec"][role]["template"]
    assert template == {k: v for k, v in pod.items() if k not in ("apiVersion", "kind")}
    [container] = template["spec"]["containers"]
    conf = spark_app["spec"]["sparkConf"]
    assert conf[f"spark.kubernetes.{role}.podTemplateContainerName"] == container["name"]


def test_the_spark_application_runs_the_tested_spark_and_image(spark_app):
    pins = dict(line.split("==") for line in (ROOT / "requirements" / "dev.txt").read_text()
                .splitlines() if "==" in line and not line.startswith("#"))
    assert spark_app["spec"]["sparkVersion"] == pins["pyspark"]
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    assert spark_app["spec"]["image"] == compose["x-spark-image"]["image"]
    assert spark_app["spec"]["type"] == "Python" and spark_app["spec"]["pythonVersion"] == "3"


# --- Dockerfiles -----------------------------------------------------------------------------

DOCKERFILES = {"sidecar": ROOT / "sidecar" / "Dockerfile",
               "spark": ROOT / "deploy" / "spark.Dockerfile"}
_SECRET_NAME = re.compile(r"(PASSWORD|PASSWD|SECRET|TOKEN|API_?KEY|PRIVATE_?KEY|CREDENTIAL)",
                          re.IGNORECASE)
_SECRET_FILE = re.compile(r"(\.key|\.pem|\.p12|\.pfx|\.token|id_rsa|id_ed25519|\.env)$")


def lint_dockerfile(path: Path, context: Path) -> list[str]:
    """hadolint's rules that matter here, offline: pinned bases (DL3006/DL3007), a non-root
    USER last (DL3002), no secrets in ENV/ARG or copied in, no remote ADD, COPY sources that
    exist in the build context and pass its .dockerignore."""
    problems = []
    instrs = dockerfile_instructions(path)
    stages: set[str] = set()
    rules = dockerignore_rules(context, path)
    users = []
    for word, rest in instrs:
        args = instruction_args(rest) if word in ("COPY", "ADD") else rest.split()
        if word == "FROM":
            image = args[0]
            if "AS" in (a.upper() for a in args[1:]):
                stages.add(args[-1].lower())
            if image.lower() in stages:
                continue
            name, _, tag = image.partition("@")[0].rpartition(":")
            if "@sha256:" not in image and (not name or tag in ("", "latest")
                                             or not re.search(r"\d", tag)):
                problems.append(f"FROM {image}: pin a version tag (or a digest)")
            users = []
        elif word == "USER":
            users.append(args[0].split(":")[0])
        elif word in ("ENV", "ARG"):
            for key in re.findall(r"([A-Za-z_][A-Za-z0-9_]*)=", rest) or args[:1]:
                if _SECRET_NAME.search(key):
                    problems.append(f"{word} {key}: a secret baked into the image")
        if word in ("COPY", "ADD"):
            srcs = [a for a in args[:-1] if not a.startswith("--")]
            if any(a.startswith("--from=") for a in args):
                continue
            for src in srcs:
                if re.match(r"https?://", src):
                    problems.append(f"ADD {src}: fetch in a RUN with a checksum instead")
                    continue
                if _SECRET_FILE.search(src.rstrip("/")):
                    problems.append(f"{word} {src}: a secret copied into the image")
                rel = posixpath_norm(src)
                if not (context / rel).exists():
                    problems.append(f"{word} {src}: not in the build context")
                elif ignored(rel, rules):
                    problems.append(f"{word} {src}: excluded by .dockerignore")
    if not users or users[-1] in ("root", "0"):
        problems.append("the final stage runs as root: end with a non-root USER")
    return problems


def posixpath_norm(src: str) -> str:
    return str(PurePosixPath(src.rstrip("/")))


@pytest.mark.parametrize("name", sorted(DOCKERFILES))
def test_the_dockerfiles_pass_the_lint(name):
    assert lint_dockerfile(DOCKERFILES[name], ROOT) == []


def test_the_lint_catches_what_it_looks_for(tmp_path):
    (tmp_path / "app").mkdir()
    (tmp_path / ".dockerignore").write_text("app/secret\n")
    (tmp_path / "app" / "secret").write_text("x")
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nENV API_TOKEN=abc\nCOPY app/secret /s\n"
                   "COPY missing/ /m/\nCOPY certs/tls.key /k\n"
                   "ADD https://example.com/x.tgz /x\nUSER root\n")
    problems = "\n".join(lint_dockerfile(bad, tmp_path))
    for needle in ("FROM python:latest", "ENV API_TOKEN", "app/secret: excluded",
                   "missing/: not in the build context", "tls.key: a secret",
                   "ADD https://example.com/x.tgz", "runs as root"):
        assert needle in problems, (needle, problems)


def test_deploy_doc_builds_and_pushes_the_image_the_daemonset_runs(base):
    doc = DEPLOY_DOC.read_text()
    [sidecar] = _pod(base)["spec"]["containers"]
    image = sidecar["image"]
    version = tomllib.loads((ROOT / "sidecar" / "pyproject.toml").read_text())["project"][
        "version"]
    assert image == f"spillway/sidecar:{version}"
    assert f"docker build -f sidecar/Dockerfile -t {image} ." in doc
    assert "docker push" in doc and "newName:" in doc  # retagged for your registry
    for needle in ("NetworkPolicy", "per-node-certs", "spark-application.yaml",
                   "test_kubernetes_extras.py"):
        assert needle in doc, needle


# --- the per-node certificate, issued and used -----------------------------------------------


def _issue_as_the_ca_issuer(ca, template: dict, directory: Path):
    """What cmctl and a cert-manager CA Issuer make of the rendered Certificate: an EC key
    here, a certificate with its common name, SANs and usages, signed by the CA."""
    import datetime as dt

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    spec = template["spec"]
    assert (spec["privateKey"]["algorithm"], spec["privateKey"]["size"]) == ("ECDSA", 256)
    key = ec.generate_private_key(ec.SECP256R1())
    usages = set(spec["usages"])
    eku = {"server auth": ExtendedKeyUsageOID.SERVER_AUTH,
           "client auth": ExtendedKeyUsageOID.CLIENT_AUTH}
    now = dt.datetime.now(dt.UTC)
    sans = [x509.DNSName(d) for d in spec["dnsNames"]]
    sans += [x509.IPAddress(ipaddress.ip_address(i)) for i in spec["ipAddresses"]]
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME,
                                                        spec["commonName"])]))
            .issuer_name(ca.cert.subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(hours=int(spec["duration"].rstrip("h"))))
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(
                digital_signature="digital signature" in usages, content_commitment=False,
                key_encipherment="key encipherment" in usages, data_encipherment=False,
                key_agreement=False, key_cert_sign=False, crl_sign=False, encipher_only=False,
                decipher_only=False), critical=True)
            .add_extension(x509.ExtendedKeyUsage([eku[u] for u in sorted(usages & set(eku))]),
                           critical=False)
            .sign(ca.key, hashes.SHA256()))
    directory.mkdir(parents=True)
    (directory / "tls.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (directory / "tls.key").write_bytes(key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption()))
    return directory


@pytest.mark.integration
def test_a_node_certificate_from_the_template_carries_home_forwarding(overlay, tmp_path):
    """Two sidecars with certificates issued from the overlay's template for their own IP and
    the ConfigMap's peer identities: the node sidecar forwards a report to the job's home over
    mutual TLS; with a certificate for another node's IP the home is refused."""
    from spillway.client import SidecarClient
    from spillway.sidecar.server import start_server
    from spillway.v1 import sidecar_pb2 as pb
    from spillway.v1 import sidecar_pb2_grpc as pb_grpc
    from support.tls import Ca, write_token

    props = _props(overlay)
    ca = Ca.create(tmp_path / "ca")
    token = write_token(tmp_path / "node.token", "node-token")

    def node_cert(name, ip):
        template = _rendered_certificate(overlay, {"HOST_IP": ip, "NODE_NAME": name})
        return _issue_as_the_ca_issuer(ca, template, tmp_path / name)

    def sidecar(name, cert_dir):
        return start_server({
            "listen.address": "127.0.0.1:0", "sidecar.id": name,
            "tls.cert.file": str(cert_dir / "tls.crt"), "tls.key.file": str(cert_dir / "tls.key"),
            "tls.ca.file": str(ca.path), "tls.client.auth": props["tls.client.auth"],
            "auth.token.file": str(token),
            "auth.peer.identities": props["auth.peer.identities"],
            # the ConfigMap admits the nodes' network (10.0.0.0/8:50051); here, loopback
            "home.allowed.addresses": "127.0.0.1"})

    executor = ca.issue(tmp_path / "executor", "executor-1", dns=("executor-1",), ips=())
    running = []
    try:
        home = sidecar("node-a", node_cert("node-a", "127.0.0.1"))
        node = sidecar("node-b", node_cert("node-b", "127.0.0.1"))
        wrong = sidecar("node-c", node_cert("node-c", "10.9.9.9"))  # not the IP it is dialled at
        running += [home, node, wrong]

        def stub(address, server_name=""):
            return pb_grpc.ErrorSidecarStub(SidecarClient(
                address, tls_ca_file=str(ca.path), tls_cert_file=str(executor.cert),
                tls_key_file=str(executor.key), token_file=str(token),
                tls_server_name=server_name)._channel())

        props_job = {"errors.tolerance": "all"}
        reg = stub(home.address).RegisterJob(pb.RegisterJobRequest(
            job="per-node", run_id="r1", properties=props_job), timeout=10)
        jt = [("spillway-job-token", reg.job_token)]
        stub(node.address).RegisterJob(pb.RegisterJobRequest(
            job="per-node", run_id="r1", properties=props_job, home=reg.home,
            home_instance_id=reg.home_instance_id), metadata=jt, timeout=15)
        task = pb.TaskIdentity(stage_id=1, partition_id=0, task_attempt_id=1)
        record = pb.FailedRecord(record_id="x-1", stage=pb.STAGE_TRANSFORMATION,
                                 exception=pb.ExceptionInfo(class_name="builtins.ValueError"))
        [verdict] = stub(node.address).ReportFailures(pb.ReportFailuresRequest(
            job="per-node", run_id="r1", task=task, records=[record]), metadata=jt,
            timeout=10).verdicts
        assert verdict.action == pb.ACTION_SKIP
        # decided at the home: the node sidecar reached it over mutual TLS as a peer
        summary = stub(home.address).GetJobSummary(pb.GetJobSummaryRequest(
            job="per-node", run_id="r1"), metadata=jt, timeout=10)
        assert summary.total_record_failures == 1

        # a home whose certificate names another IP: the node sidecar refuses to trust it
        # (the executor checks it by its peer name, spillway-sidecar, to register there)
        reg = stub(wrong.address, "spillway-sidecar").RegisterJob(pb.RegisterJobRequest(
            job="per-node", run_id="r2", properties=props_job), timeout=10)
        with pytest.raises(grpc.RpcError) as err:
            stub(node.address).RegisterJob(pb.RegisterJobRequest(
                job="per-node", run_id="r2", properties=props_job, home=reg.home,
                home_instance_id=reg.home_instance_id),
                metadata=[("spillway-job-token", reg.job_token)], timeout=15)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "Hostname Verification" in err.value.details()
    finally:
        for r in running:
            r.stop(0)

