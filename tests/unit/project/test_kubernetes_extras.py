"""Kubernetes and image set-up beyond the base, offline (no cluster, no Docker, no hadolint):

- the NetworkPolicy of the base admits the plaintext ports (metrics, probes) to nobody but
  Prometheus and the node, and the mTLS port to the nodes' network and Spark;
- the csi-certs overlay (rendered by kubectl kustomize) validates against the Kubernetes schemas
  and cert-manager's CRD fields (tests/data/cert-manager-v1.schema.json); its csi-driver volume
  uses only attributes the driver knows, renews before expiry, writes the files the sidecar
  reads, and names the pod by the DNS name it advertises (computed by its real start command),
  which the home allow-list admits and a certificate issued from those attributes serves;
- the parameters (params.env, merged from an overlay) reach every place they stand for;
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
import os
import re
import subprocess
import tempfile
import tomllib
from pathlib import Path, PurePosixPath
from types import SimpleNamespace

import grpc
import javaproperties
import jsonschema
import kubernetes_validate
import pytest
import yaml
from test_compose import dockerfile_instructions, dockerignore_rules, ignored, instruction_args
from test_kubernetes import BASE, K8S_VERSION, TEMPLATES, _load_all, build, render
from support import paths
from support.rpc import port_of

ROOT = paths.ROOT
DATA = ROOT / "tests" / "data"
OVERLAY = ROOT / "deploy" / "kubernetes-csi-certs"
SPARK_APP = BASE / "spark" / "spark-application.yaml"
DEPLOY_DOC = ROOT / "docs" / "DEPLOY.md"


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
    allowed = _sidecar_env(base)["SPILLWAY_HOME_ALLOWED_ADDRESSES"]["value"].rpartition(":")[0]
    assert cidrs == {str(ipaddress.ip_network(allowed))}
    namespaces = {p["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"]
                  for p in peers if "namespaceSelector" in p}
    assert namespaces == {"spark"}  # where the pod templates and the SparkApplication run
    assert yaml.safe_load(SPARK_APP.read_text())["metadata"]["namespace"] in namespaces


def test_the_policy_check_sees_an_opened_port(policy):
    opened = copy.deepcopy(policy)
    opened["spec"]["ingress"].append({"ports": [{"port": 50052, "protocol": "TCP"}]})
    assert admitted_from(opened, 50052) == [[]]  # from anywhere


# --- per-pod certificates (cert-manager's csi-driver) ----------------------------------------

# every volume attribute csi-driver v0.9.0 knows (pkg/apis/v1alpha1/types.go): a misspelt one
# would be ignored by the driver, silently
CSI_ATTRIBUTES = {f"csi.cert-manager.io/{k}" for k in (
    "issuer-name", "issuer-kind", "issuer-group", "literal-subject", "common-name",
    "organizations", "organizationalunits", "countries", "provinces", "localities",
    "streetaddresses", "postalcodes", "serialnumber", "dns-names", "ip-sans", "uri-sans",
    "duration", "is-ca", "key-usages", "key-algorithm", "key-encoding", "key-size", "ca-file",
    "certificate-file", "privatekey-file", "fs-group", "renew-before", "reuse-private-key",
    "pkcs12-enable", "pkcs12-filename", "pkcs12-password")}
# the variables its dns-names, uri-sans and common-name expand (ip-sans expands none)
CSI_VARIABLES = {"POD_NAME", "POD_NAMESPACE", "POD_UID", "SERVICE_ACCOUNT_NAME"}
# cert-manager's key usages (cert-manager.io/v1 KeyUsage)
CERT_MANAGER_USAGES = {
    "signing", "digital signature", "content commitment", "key encipherment", "key agreement",
    "data encipherment", "cert sign", "crl sign", "encipher only", "decipher only", "any",
    "server auth", "client auth", "code signing", "email protection", "s/mime",
    "ipsec end system", "ipsec tunnel", "ipsec user", "timestamping", "ocsp signing",
    "microsoft sgc", "netscape sgc"}
POD_IP = "10.1.2.3"


@pytest.fixture(scope="module")
def overlay():
    return render(OVERLAY)


def _csi(resources) -> dict:
    [tls] = [v for v in _pod(resources)["spec"]["volumes"] if v["name"] == "tls"]
    return tls


def _sidecar_env(resources) -> dict[str, dict]:
    [sidecar] = _pod(resources)["spec"]["containers"]
    return {e["name"]: e for e in sidecar["env"]}


def _duration_h(value: str) -> float:
    m = re.fullmatch(r"(\d+)h", value)
    assert m, f"{value!r}: write durations in whole hours"
    return float(m.group(1))


def _advertised(resources, pod_ip: str = POD_IP) -> str:
    """The address the sidecar's start command advertises: the command itself, run by a real sh
    with the pod's environment, `spillway` on PATH being a stand-in that prints the address it
    was started with."""
    [sidecar] = _pod(resources)["spec"]["containers"]
    env = _sidecar_env(resources)
    assert sidecar["command"] == ["sh", "-c"]
    [script] = sidecar["args"]
    assert script.rstrip().endswith(
        "exec spillway serve --config /etc/spillway/config/sidecar.properties")
    with tempfile.TemporaryDirectory() as bin_dir:
        stand_in = Path(bin_dir) / "spillway"
        stand_in.write_text('#!/bin/sh\nprintf %s "$SPILLWAY_ADVERTISED_ADDRESS"\n')
        stand_in.chmod(0o755)
        out = subprocess.run(["sh", "-c", script], capture_output=True, text=True, check=True,
                             env={"PATH": f"{bin_dir}:/usr/bin:/bin", "POD_IP": pod_ip,
                                  "POD_DNS_SUFFIX": env["POD_DNS_SUFFIX"]["value"]})
    return out.stdout


def test_the_overlay_validates_against_kubernetes_and_cert_manager_schemas(overlay):
    cert_manager = _schema("cert-manager-v1.schema.json")
    kinds = {d["kind"] for d in overlay}
    assert {"DaemonSet", "Issuer", "NetworkPolicy", "ConfigMap"} <= kinds
    for doc in overlay:
        if doc["apiVersion"].startswith("cert-manager.io/"):
            cert_manager.validate(doc)
        else:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    assert all(d["metadata"].get("namespace") == "spillway" for d in overlay
               if d["kind"] != "Namespace")
    # the schema has teeth: an Issuer without its CA Secret is refused
    [issuer] = [copy.deepcopy(d) for d in overlay if d["kind"] == "Issuer"]
    del issuer["spec"]["ca"]["secretName"]
    with pytest.raises(jsonschema.ValidationError):
        cert_manager.validate(issuer)


def test_the_tls_volume_is_a_csi_driver_certificate_not_a_shared_secret(overlay):
    tls = _csi(overlay)
    assert "secret" not in tls
    csi = tls["csi"]
    assert csi["driver"] == "csi.cert-manager.io" and csi["readOnly"] is True
    attrs = csi["volumeAttributes"]
    unknown = set(attrs) - CSI_ATTRIBUTES
    assert not unknown, f"attributes csi-driver does not know: {unknown}"
    for key, value in attrs.items():
        assert isinstance(value, str), key  # volumeAttributes is a map of strings
        for var in re.findall(r"\$\{(\w+)\}", value):
            assert key != "csi.cert-manager.io/ip-sans" and var in CSI_VARIABLES, (key, var)
    # signed by the overlay's Issuer
    [issuer] = [d for d in overlay if d["kind"] == "Issuer"]
    assert attrs["csi.cert-manager.io/issuer-name"] == issuer["metadata"]["name"]
    assert attrs["csi.cert-manager.io/issuer-kind"] == "Issuer"
    # renewed ahead of expiry, by the driver (no restart, no person)
    duration = _duration_h(attrs["csi.cert-manager.io/duration"])
    assert 0 < _duration_h(attrs["csi.cert-manager.io/renew-before"]) < duration
    usages = set(attrs["csi.cert-manager.io/key-usages"].split(","))
    assert usages <= CERT_MANAGER_USAGES and {"server auth", "client auth"} <= usages
    # readable by the sidecar's group
    pod = _pod(overlay)["spec"]
    assert attrs["csi.cert-manager.io/fs-group"] == str(pod["securityContext"]["runAsGroup"])


def test_the_driver_writes_exactly_the_files_the_sidecar_reads(overlay):
    props = _props(overlay)
    attrs = _csi(overlay)["csi"]["volumeAttributes"]
    [sidecar] = _pod(overlay)["spec"]["containers"]
    [mount] = [m for m in sidecar["volumeMounts"] if m["name"] == "tls"]
    where = PurePosixPath(mount["mountPath"])
    for prop, attr in (("tls.cert.file", "certificate-file"), ("tls.key.file", "privatekey-file"),
                       ("tls.ca.file", "ca-file")):
        assert str(where / attrs[f"csi.cert-manager.io/{attr}"]) == props[prop], prop
    # no API credentials in the pod: the driver, not the pod, talks to cert-manager
    pod = _pod(overlay)["spec"]
    assert pod["automountServiceAccountToken"] is False
    assert not [v for v in pod["volumes"] if "projected" in v]
    assert not [d for d in overlay if d["kind"] in ("Role", "RoleBinding")]


def test_the_advertised_address_is_a_name_the_certificate_and_the_allow_list_carry(overlay):
    from spillway.sidecar.transport.listeners import home_allowed

    props = _props(overlay)
    env = _sidecar_env(overlay)
    attrs = _csi(overlay)["csi"]["volumeAttributes"]
    assert "SPILLWAY_ADVERTISED_ADDRESS" not in env  # set by the start command instead
    assert env["POD_IP"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    suffix = env["POD_DNS_SUFFIX"]["value"]
    advertised = _advertised(overlay)
    assert advertised == f"10-1-2-3.{suffix}:{port_of(props['listen.address'])}"
    assert _advertised(overlay, "fd00::1:2") == f"fd00--1-2.{suffix}:50051"  # IPv6 pods
    dns = attrs["csi.cert-manager.io/dns-names"].split(",")
    # the peer identity the other sidecars accept, and the wildcard over the pod records
    assert set(props["auth.peer.identities"].split(",")) <= set(dns)
    assert f"*.{suffix}" in dns
    # the allow-list of homes: the pod records, expanded as the kubelet expands $(VAR)
    allowed = env["SPILLWAY_HOME_ALLOWED_ADDRESSES"]["value"].replace("$(POD_DNS_SUFFIX)",
                                                                      suffix)
    cfg = SimpleNamespace(home_allowed=allowed.split(","))
    assert home_allowed(advertised, cfg)
    assert not home_allowed(f"10.1.2.3:{port_of(props['listen.address'])}", cfg)
    assert not home_allowed(f"evil.example.org:{port_of(props['listen.address'])}", cfg)
    names = [e["name"] for e in _pod(overlay)["spec"]["containers"][0]["env"]]
    assert names.index("POD_DNS_SUFFIX") < names.index("SPILLWAY_HOME_ALLOWED_ADDRESSES")
    # and `spillway serve` accepts both values
    from spillway.sidecar.core import config

    parsed = config.parse({**props, "advertised.address": advertised,
                           "home.allowed.addresses": allowed})
    assert parsed["advertised.address"] == advertised


def test_the_mtls_port_also_admits_the_sidecar_pods(overlay):
    [policy] = [d for d in overlay if d["kind"] == "NetworkPolicy"]
    labels = _pod(overlay)["metadata"]["labels"]
    [peers] = admitted_from(policy, 50051)
    selectors = [p["podSelector"]["matchLabels"] for p in peers
                 if set(p) == {"podSelector"}]
    assert selectors and all(s.items() <= labels.items() for s in selectors)


# --- parameters (params.env, kustomize replacements) -----------------------------------------

CUSTOM = {"nodeCIDR": "192.168.0.0/16", "sparkNamespace": "etl", "monitoringNamespace": "obs",
          "prometheusName": "kube-prometheus", "podDnsSuffix": "spillway.pod.k8s.example.org"}


@pytest.fixture(scope="module")
def custom(tmp_path_factory):
    """An overlay like deploy/kubernetes-csi-certs, outside the repository, with other values."""
    d = tmp_path_factory.mktemp("overlay")
    kust = yaml.safe_load((OVERLAY / "kustomization.yaml").read_text())
    base = os.path.relpath(BASE, d)  # kustomize takes relative paths only
    kust["resources"] = [base]
    kust["components"] = [f"{base}/components/{c}" for c in ("parameters", "csi-certs")]
    [gen] = kust["configMapGenerator"]
    gen["literals"] = [f"{k}={v}" for k, v in CUSTOM.items()]
    (d / "kustomization.yaml").write_text(yaml.safe_dump(kust))
    return render(d)


def test_every_parameter_reaches_its_place(custom):
    [policy] = [d for d in custom if d["kind"] == "NetworkPolicy"]
    env = _sidecar_env(custom)
    attrs = _csi(custom)["csi"]["volumeAttributes"]
    [nodes] = [p["ipBlock"]["cidr"] for p in admitted_from(policy, 50051)[0] if "ipBlock" in p]
    assert nodes == CUSTOM["nodeCIDR"]
    namespaces = {p["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"]
                  for rule in policy["spec"]["ingress"] for p in rule["from"]
                  if "namespaceSelector" in p}
    assert namespaces == {CUSTOM["sparkNamespace"], CUSTOM["monitoringNamespace"]}
    [prom] = admitted_from(policy, 9464)[0]
    assert prom["podSelector"]["matchLabels"] == {
        "app.kubernetes.io/name": CUSTOM["prometheusName"]}
    assert env["POD_DNS_SUFFIX"]["value"] == CUSTOM["podDnsSuffix"]
    assert attrs["csi.cert-manager.io/dns-names"] == (
        f"spillway-sidecar,*.{CUSTOM['podDnsSuffix']}")
    assert _advertised(custom).endswith(f".{CUSTOM['podDnsSuffix']}:50051")
    # nothing of the defaults is left, and the parameters are not applied to the cluster
    text = yaml.safe_dump_all(custom)
    for default in ("10.0.0.0/8", "spillway.pod.cluster.local", "name: monitoring"):
        assert default not in text, default
    assert "spillway-params" not in text


def test_the_base_takes_its_node_cidr_from_the_parameters(tmp_path):
    """The base alone (no csi-certs): nodeCIDR reaches the NetworkPolicy and the sidecar's
    home.allowed.addresses together."""
    base = os.path.relpath(BASE, tmp_path)
    kust = {"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
            "resources": [base],
            "configMapGenerator": [{"name": "spillway-params", "namespace": "spillway",
                                    "behavior": "merge", "literals": ["nodeCIDR=172.16.0.0/12"]}],
            "components": [f"{base}/components/parameters"]}
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump(kust))
    out = render(tmp_path)
    [policy] = [d for d in out if d["kind"] == "NetworkPolicy"]
    assert policy["spec"]["ingress"][0]["from"][0]["ipBlock"]["cidr"] == "172.16.0.0/12"
    assert _sidecar_env(out)["SPILLWAY_HOME_ALLOWED_ADDRESSES"]["value"] == "172.16.0.0/12:50051"
    assert _csi(out)["secret"]["secretName"] == "spillway-tls"


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
    for needle in ("NetworkPolicy", "kubernetes-csi-certs", "spark-application.yaml",
                   "test_kubernetes_extras.py"):
        assert needle in doc, needle


# --- the per-pod certificate, issued and used -------------------------------------------------


def _issue_as_the_csi_driver(ca, attrs: dict, directory: Path, pod: dict[str, str]):
    """What csi-driver and a cert-manager CA Issuer make of the volume attributes for a pod: an
    EC key, a certificate with the common name, the expanded DNS names and the key usages,
    signed by the CA, written under the attribute's file names."""
    import datetime as dt

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    a = {k.split("/", 1)[1]: v for k, v in attrs.items()}
    assert (a["key-algorithm"], a["key-size"]) == ("ECDSA", "256")
    key = ec.generate_private_key(ec.SECP256R1())
    usages = set(a["key-usages"].split(","))
    eku = {"server auth": ExtendedKeyUsageOID.SERVER_AUTH,
           "client auth": ExtendedKeyUsageOID.CLIENT_AUTH}
    dns = a["dns-names"].split(",")
    for var, value in pod.items():
        dns = [d.replace("${" + var + "}", value) for d in dns]
    now = dt.datetime.now(dt.UTC)
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME,
                                                        a["common-name"])]))
            .issuer_name(ca.cert.subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(hours=_duration_h(a["duration"])))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(d) for d in dns]),
                           critical=False)
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
    (directory / a["certificate-file"]).write_bytes(
        cert.public_bytes(serialization.Encoding.PEM))
    (directory / a["privatekey-file"]).write_bytes(key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption()))
    (directory / a["ca-file"]).write_bytes(ca.path.read_bytes())
    return directory


@pytest.mark.integration
def test_a_pod_certificate_from_the_volume_attributes_serves_mutual_tls_by_its_pod_name(
        overlay, tmp_path):
    """A sidecar serving the certificate the csi-driver would issue for the overlay's volume
    attributes: a peer that dials it by its pod DNS name (the wildcard) and presents another
    such certificate is admitted as a peer; a name outside the wildcard is refused by TLS.
    Here the name is checked as gRPC's target name over loopback (no cluster DNS)."""
    from spillway.client import SidecarClient
    from spillway.sidecar.server import start_server
    from spillway.v1 import sidecar_pb2 as pb
    from spillway.v1 import sidecar_pb2_grpc as pb_grpc
    from support.tls import Ca, write_token

    props = _props(overlay)
    attrs = _csi(overlay)["csi"]["volumeAttributes"]
    ca = Ca.create(tmp_path / "ca")
    token = write_token(tmp_path / "node.token", "node-token")
    pod = {"POD_NAME": "spillway-sidecar-abcde", "POD_NAMESPACE": "spillway"}
    home_dir = _issue_as_the_csi_driver(ca, attrs, tmp_path / "home", pod)
    peer_dir = _issue_as_the_csi_driver(ca, attrs, tmp_path / "peer", pod)
    home = start_server({
        "listen.address": "127.0.0.1:0", "sidecar.id": "node-a",
        "tls.cert.file": str(home_dir / "tls.crt"), "tls.key.file": str(home_dir / "tls.key"),
        "tls.ca.file": str(home_dir / "ca.crt"), "tls.client.auth": props["tls.client.auth"],
        "auth.token.file": str(token), "auth.peer.identities": props["auth.peer.identities"]})
    advertised_host = _advertised(overlay).rpartition(":")[0]
    try:
        def status(server_name):
            channel = SidecarClient(
                home.address, tls_ca_file=str(peer_dir / "ca.crt"),
                tls_cert_file=str(peer_dir / "tls.crt"), tls_key_file=str(peer_dir / "tls.key"),
                token_file=str(token), tls_server_name=server_name)._channel()
            return pb_grpc.ErrorSidecarStub(channel).GetStatus(pb.GetStatusRequest(page_size=1),
                                                               timeout=10)

        assert status(advertised_host).instance_id
        with pytest.raises(grpc.RpcError) as err:
            status("10-1-2-3.elsewhere.example.org")
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        home.stop(0)
