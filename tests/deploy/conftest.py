"""Fixtures of the platform recipe tests (tests/support/recipes.py): the bundle an operator
would upload, built once per test process, and the checks every platform shares."""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess

import pytest

from support.recipes import Node, build_bundle

# what an executor does first: reach its node's sidecar with the environment its platform gave it
EXECUTOR_PROBE = """
from spillway.client import SidecarClient
client = SidecarClient(timeout_s=10)
print(client.target, client.health(), client.status().sidecar_id)
"""


@pytest.fixture(scope="session")
def bundle(tmp_path_factory):
    """Built once per test run: under pytest-xdist the workers share the run's temporary
    directory (each worker's is below it), and the first to get there builds it."""
    if os.geteuid() != 0:
        pytest.skip("the platform recipes run as root, as their platforms run them")
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    out = shared / "deploy-bundle"
    with open(shared / "deploy-bundle.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (out / ".complete").exists():
            shutil.rmtree(out, ignore_errors=True)
            build_bundle(out)
            (out / ".complete").touch()
    return out


def probe_from_executor(python, env: dict[str, str], *, source: str | None = None) -> list[str]:
    """Run EXECUTOR_PROBE with the executors' Python: with ``env`` (a YARN container's
    environment) or after sourcing ``source`` (a spark-env.sh, as a Spark worker does)."""
    base = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/root")}
    if source:
        argv = ["bash", "-c", f'. "{source}" && exec "{python}" -c "$0"', EXECUTOR_PROBE]
    else:
        argv = [str(python), "-c", EXECUTOR_PROBE]
    proc = subprocess.run(argv, env={**base, **env}, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.split()


def assert_serving_once(node: Node) -> int:
    """One restart loop and one sidecar in this root, SERVING on its socket; the sidecar's pid."""
    from spillway.client import SidecarClient

    assert len(node.supervisors()) == 1, node.supervisors()
    sidecars = node.sidecars()
    assert len(sidecars) == 1, sidecars
    client = SidecarClient(node.socket_address, timeout_s=10)
    try:
        assert client.health() == "SERVING"
    finally:
        client.close()
    return sidecars[0]


def properties(path) -> dict[str, str]:
    out = {}
    for line in path.read_text().splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            out[key] = value
    return out


def executor_env_from_spark_defaults(path) -> dict[str, str]:
    """What YARN gives an executor's container: the spark.executorEnv.* of spark-defaults.conf."""
    out = {}
    for line in path.read_text().splitlines():
        if line.startswith("spark.executorEnv."):
            key, value = line.split(None, 1)
            out[key.removeprefix("spark.executorEnv.")] = value
    return out
