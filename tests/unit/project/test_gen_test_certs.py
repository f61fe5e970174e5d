"""deploy/gen-test-certs.sh outside compose: run into a temporary directory (a relative path,
as a user would type it), the files stay the caller's unless CHOWN_CERTS=1 asks for the compose
uids, and what it writes is a working PKI: checked with `cryptography`, then used for a real
mutual-TLS call to a sidecar (the docs/SECURITY.md single-host walk-through)."""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.x509.oid import ExtendedKeyUsageOID
from support import paths

ROOT = paths.ROOT
SCRIPT = ROOT / "deploy" / "gen-test-certs.sh"


def _run(cwd: Path, out: str, **env: str) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items()
            if k not in ("CHOWN_CERTS", "SIDECAR_UID", "SPARK_UID", "SIDECAR_SAN")}
    return subprocess.run(["sh", str(SCRIPT), out], cwd=cwd, capture_output=True, text=True,
                          check=False,
                          timeout=60, env={**base, **env})


def _cert(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def _sans(cert: x509.Certificate) -> tuple[set[str], set[str]]:
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    return (set(san.get_values_for_type(x509.DNSName)),
            {str(ip) for ip in san.get_values_for_type(x509.IPAddress)})


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Path:
    cwd = tmp_path_factory.mktemp("certs")
    # compose's uids in the environment do nothing without CHOWN_CERTS=1
    out = _run(cwd, "out", SIDECAR_UID="4242", SPARK_UID="4343")
    assert out.returncode == 0, out.stderr
    return cwd / "out"


def test_a_ca_and_two_leaves_signed_by_it(pki):
    ca = _cert(pki / "ca.pem")
    bc = ca.extensions.get_extension_for_class(x509.BasicConstraints)
    assert bc.critical and bc.value.ca
    assert ca.extensions.get_extension_for_class(x509.KeyUsage).value.key_cert_sign
    for who, usages in (("sidecar", {ExtendedKeyUsageOID.SERVER_AUTH,
                                     ExtendedKeyUsageOID.CLIENT_AUTH}),
                        ("spark", {ExtendedKeyUsageOID.CLIENT_AUTH})):
        leaf = _cert(pki / who / "tls.crt")
        leaf.verify_directly_issued_by(ca)  # raises unless the CA signed it
        assert not leaf.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
        assert usages <= set(leaf.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value)
        key = serialization.load_pem_private_key((pki / who / "tls.key").read_bytes(), None)
        assert key.public_key() == leaf.public_key(), f"{who}: key and certificate differ"
        assert leaf.not_valid_after_utc > ca.not_valid_before_utc
    assert _sans(_cert(pki / "sidecar" / "tls.crt")) == ({"sidecar", "localhost"}, {"127.0.0.1"})


def test_the_files_stay_the_callers_and_are_private(pki):
    me = os.getuid()
    token = (pki / "sidecar" / "node.token").read_text()
    assert len(token.strip()) == 64 and int(token, 16) >= 0
    assert (pki / "spark" / "node.token").read_text() == token
    for who in ("sidecar", "spark"):
        for f in (pki / who).iterdir():
            st = f.stat()
            assert st.st_uid == me, f"{f} was handed to uid {st.st_uid} without CHOWN_CERTS=1"
            assert stat.S_IMODE(st.st_mode) == 0o400, f
    assert stat.S_IMODE((pki / "ca.pem").stat().st_mode) == 0o444


def test_a_provisioned_directory_is_left_alone(pki):
    before = {p: p.read_bytes() for p in pki.rglob("*") if p.is_file()}
    out = _run(pki.parent, str(pki))
    assert out.returncode == 0 and "already holds certificates" in out.stdout
    assert {p: p.read_bytes() for p in pki.rglob("*") if p.is_file()} == before


def test_the_sidecar_names_are_chosen_with_sidecar_san(tmp_path):
    out = _run(tmp_path, "out", SIDECAR_SAN="DNS:node-a.example,IP:10.1.2.3")
    assert out.returncode == 0, out.stderr
    assert _sans(_cert(tmp_path / "out" / "sidecar" / "tls.crt")) == ({"node-a.example"},
                                                                       {"10.1.2.3"})


def test_chown_only_when_asked_and_only_as_root(tmp_path):
    out = _run(tmp_path, "bad", CHOWN_CERTS="yes")
    assert out.returncode == 2 and "CHOWN_CERTS must be 0 or 1" in out.stderr
    if os.getuid() == 0:
        out = _run(tmp_path, "compose", CHOWN_CERTS="1", SIDECAR_UID="4242", SPARK_UID="4343")
        assert out.returncode == 0, out.stderr
        assert {f.stat().st_uid for f in (tmp_path / "compose" / "sidecar").iterdir()} == {4242}
        assert {f.stat().st_uid for f in (tmp_path / "compose" / "spark").iterdir()} == {4343}
        # and as another user, CHOWN_CERTS=1 is refused with the reason
        nobody = tmp_path / "nobody"
        nobody.mkdir()
        os.chown(nobody, 65534, 65534)
        out = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                              "sh", str(SCRIPT), str(nobody / "out")],
                             capture_output=True, text=True, timeout=60, check=False,
                             env={"PATH": os.environ["PATH"], "CHOWN_CERTS": "1"})
        assert out.returncode == 2 and "needs root" in out.stderr, out.stderr
        assert not (nobody / "out").exists()
    else:
        out = _run(tmp_path, "compose", CHOWN_CERTS="1")
        assert out.returncode == 2 and "needs root" in out.stderr


@pytest.mark.integration
def test_the_generated_pki_carries_a_mutual_tls_call(pki):
    """The walk-through of docs/SECURITY.md: the sidecar on 127.0.0.1 with the sidecar's files,
    a client with the Spark side's files."""
    from spillway.client import SidecarClient
    from spillway.client.errors import SidecarTlsError, SidecarUnavailableError
    from spillway.sidecar.server import start_server

    running = start_server({
        "listen.address": "127.0.0.1:0",
        "tls.cert.file": str(pki / "sidecar" / "tls.crt"),
        "tls.key.file": str(pki / "sidecar" / "tls.key"),
        "tls.ca.file": str(pki / "ca.pem"),
        "auth.token.file": str(pki / "sidecar" / "node.token"),
    })
    try:
        port = running.address.rpartition(":")[2]
        with SidecarClient(f"127.0.0.1:{port}", tls_ca_file=str(pki / "ca.pem"),
                           tls_cert_file=str(pki / "spark" / "tls.crt"),
                           tls_key_file=str(pki / "spark" / "tls.key"),
                           token_file=str(pki / "spark" / "node.token")) as client:
            run = client.register_job("certs-check", {"errors.tolerance": "all"})
            assert client.job_summary(run).job == "certs-check"
        # without the client certificate the handshake is refused
        with SidecarClient(f"127.0.0.1:{port}", tls_ca_file=str(pki / "ca.pem"),
                           token_file=str(pki / "spark" / "node.token"),
                           timeout_s=3) as client, \
                pytest.raises((SidecarTlsError, SidecarUnavailableError)):
            client.register_job("certs-check", {"errors.tolerance": "all"})
    finally:
        running.stop(0)



def test_the_single_host_walk_through_uses_real_flags_and_files(pki):
    """docs/SECURITY.md's commands parse with `spillway`'s own parser, and every file they name
    is one the script wrote."""
    import re
    import shlex

    from spillway.sidecar.cli.main import build_parser

    doc = (ROOT / "docs" / "SECURITY.md").read_text()
    section = doc[doc.index("## Single host, step by step"):]
    section = section[:section.index("\n## ")]
    assert "sh deploy/gen-test-certs.sh" in section and "CHOWN_CERTS=1" in section
    blocks = re.findall(r"```sh\n(.*?)```", section, re.DOTALL)
    commands = [shlex.split(line, comments=True)
                for block in blocks for line in block.replace("\\\n", " ").splitlines()]
    spillway = [c for c in commands if c and c[0] == "spillway"]
    assert {c[1] for c in spillway} == {"serve", "status"}
    parser = build_parser()
    for argv in spillway:
        parser.parse_args(argv[1:])  # exits (SystemExit) on a flag spillway does not have
    named = re.findall(r"\$T/([\w/.]+)", section)
    assert len(set(named)) >= 8
    for path in named:
        assert (pki / path).is_file(), f"docs/SECURITY.md names $T/{path}, not written"
