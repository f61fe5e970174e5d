"""A plain systemd host (or a YARN NodeManager host): deploy/platform/spillway-node.sh install
with the bundle's wheelhouse, into a temporary root. There is no systemd to run the unit here,
so the sidecar runs under the installer's restart loop (SPILLWAY_SUPERVISOR=loop), with the
command line the unit's ExecStart has; the unit the installer writes for systemd is checked with
`systemd-analyze verify` against the venv that install made."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import zipfile

import pytest
from support.ports import free_port
from support.recipes import (
    DEPLOY,
    Node,
    assert_second_run_changes_nothing,
    assert_serving_once,
    base_env,
    properties,
    tool,
)
from support.tls import Ca, write_token


@pytest.fixture(scope="module")
def host(bundle, tmp_path_factory):
    node = Node(tmp_path_factory.mktemp("systemd-host") / "root")
    env = base_env(SPILLWAY_WHEELHOUSE=str(bundle / "wheelhouse"),
                   SPILLWAY_PYTHON=sys.executable, SPILLWAY_SPARK_PYTHON="",
                   SPILLWAY_SUPERVISOR="loop", SPILLWAY_SIDECAR_ID="host-17",
                   SPILLWAY_SOCKET_GROUP="root", SPILLWAY_PORT=str(free_port()))
    argv = ["bash", str(bundle / "spillway-node.sh"), "install"]
    first = node.run(argv, env)
    yield node, lambda **more: node.run(argv, {**env, **more}), first
    node.stop()


def test_install_starts_the_sidecar_the_unit_describes(host):
    node, _, first = host
    assert "sidecar SERVING" in first.stderr
    pid = assert_serving_once(node)
    argv = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
    unit = (DEPLOY / "systemd" / "spillway.service").read_text()
    exec_start = re.search(r"^ExecStart=(.*)$", unit, re.M).group(1).split()
    ours = [a.decode() for a in argv if a][1:]  # the venv's python runs bin/spillway
    root = str(node.root)
    assert [a.replace(root, "") for a in ours] == exec_start
    props = properties(node.path("/etc/spillway/sidecar.properties"))
    assert props["sidecar.id"] == "host-17"
    assert props["listen.unix.socket.group"] == "root"
    assert props["listen.unix.socket.mode"] == "0660"
    assert node.path("/etc/spillway/spillway.env").read_text() == \
        (DEPLOY / "systemd" / "spillway.env").read_text()


def test_the_unit_the_installer_writes_verifies(host, bundle):
    node = host[0]
    analyze = tool("systemd-analyze", "Debian package systemd; `make venv` installs it as root")
    unit = node.path("/etc/systemd/system/spillway.service")
    unit.parent.mkdir(parents=True, exist_ok=True)
    script = bundle / "spillway-node.sh"
    # the installer's own rendering (what it installs under systemd), for the user the restart
    # loop ran as, with the paths of the venv and configuration this install made
    subprocess.run(["bash", "-c", f'. "{script}" && spillway_paths && '
                                  f'spillway_unit root root > "{unit}"'],
                   env=base_env(SPILLWAY_ROOT=str(node.root)), check=True, timeout=30,
                   cwd=node.root)
    text = unit.read_text()
    assert f"ExecStart={node.root}/opt/spillway/bin/spillway serve --config " \
           f"{node.root}/etc/spillway/sidecar.properties" in text
    proc = subprocess.run([analyze, "verify", str(unit)], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.strip() == ""


def test_second_install_is_idempotent(host):
    node, run, _ = host
    assert_second_run_changes_nothing(node, run, ("/etc/spillway/sidecar.properties",))


def test_a_changed_setting_restarts_the_sidecar_once(host, tmp_path):
    node, run, _ = host
    pid = assert_serving_once(node)
    extra = tmp_path / "extra.properties"
    extra.write_text("errors.deadletterqueue.topic.replication.factor=1\n")
    changed = run(SPILLWAY_EXTRA_PROPERTIES=str(extra))
    assert "restarting the sidecar" in changed.stderr
    assert properties(node.path("/etc/spillway/sidecar.properties"))[
        "errors.deadletterqueue.topic.replication.factor"] == "1"
    assert assert_serving_once(node) != pid  # a new sidecar, and only one


def test_cluster_mode_serves_tls_on_the_node_address(host, tmp_path):
    """SPILLWAY_TLS_DIR: peers and sandboxed executors reach the node address over mutual TLS
    with the node token; local executors keep the Unix socket."""
    node, run, _ = host
    port = properties(node.path("/etc/spillway/sidecar.properties"))["listen.address"].rsplit(
        ":", 1)[1]
    ca = Ca.create(tmp_path / "ca")
    sidecar = ca.issue(tmp_path / "leaves", "spillway-sidecar", dns=("spillway-sidecar",))
    executor = ca.issue(tmp_path / "leaves", "executor", dns=("spark-executor",))
    tls = tmp_path / "tls"
    tls.mkdir()
    for name, src in (("tls.crt", sidecar.cert), ("tls.key", sidecar.key), ("ca.crt", ca.path),
                      ("client.crt", executor.cert), ("client.key", executor.key)):
        (tls / name).write_bytes(src.read_bytes())
    write_token(tls / "node.token", "n0de-t0ken-for-the-test")
    run(SPILLWAY_TLS_DIR=str(tls), SPILLWAY_NODE_ADDRESS="127.0.0.1",
        SPILLWAY_HOME_ALLOWED_ADDRESSES=f"127.0.0.1:{port}")
    props = properties(node.path("/etc/spillway/sidecar.properties"))
    assert props["listen.address"] == props["advertised.address"] == f"127.0.0.1:{port}"
    assert props["auth.token.file"] == str(node.path("/etc/spillway/tls/node.token"))
    assert props["auth.peer.identities"] == "spillway-sidecar"
    assert node.path("/etc/spillway/tls/tls.key").stat().st_mode & 0o777 == 0o600
    assert_serving_once(node)  # the socket, as before

    from spillway.client import SidecarClient

    client = SidecarClient(f"127.0.0.1:{port}", timeout_s=10,
                           tls_ca_file=str(node.path("/etc/spillway/tls/ca.crt")),
                           tls_cert_file=str(node.path("/etc/spillway/tls/client.crt")),
                           tls_key_file=str(node.path("/etc/spillway/tls/client.key")),
                           token_file=str(node.path("/etc/spillway/tls/node.token")),
                           tls_server_name="spillway-sidecar")
    try:
        assert client.health() == "SERVING"
        assert client.status().sidecar_id == "host-17"
    finally:
        client.close()


def test_a_rebuilt_bundle_is_installed_again(host, bundle, tmp_path):
    """Same version numbers, other contents (a bundle rebuilt from a changed checkout): the new
    wheel is installed and the sidecar restarted on it."""
    node, run, _ = host
    pid = assert_serving_once(node)
    wheelhouse = tmp_path / "wheelhouse"
    shutil.copytree(bundle / "wheelhouse", wheelhouse)
    wheel = next(wheelhouse.glob("spillway_sidecar-*.whl"))
    with zipfile.ZipFile(wheel, "a") as zf:
        zf.writestr("spillway/sidecar/REBUILT", "a rebuilt bundle\n")
    rebuilt = run(SPILLWAY_WHEELHOUSE=str(wheelhouse))
    assert "sidecar: installed into" in rebuilt.stderr
    site = node.path("/opt/spillway/lib")
    assert list(site.glob("python3*/site-packages/spillway/sidecar/REBUILT"))
    assert assert_serving_once(node) != pid


def test_the_restart_loop_stops_with_its_sidecar(host):
    node = host[0]
    node.stop()
    assert node.wait_gone() == []
