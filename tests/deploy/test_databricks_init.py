"""deploy/databricks/init.sh as a Databricks classic cluster runs a cluster-scoped init script:
as root, with the DB_* variables Databricks sets and SPILLWAY_DEPLOY_DIR from the cluster's
environment variables (the bundle's directory in a volume; here a local directory), into a
temporary root. It starts a real sidecar under its restart loop; a second run changes nothing."""

from __future__ import annotations

import subprocess

import pytest
from support.ports import free_port
from support.recipes import (
    Node,
    assert_second_run_changes_nothing,
    assert_serving_once,
    bare_python,
    base_env,
    probe_from_executor,
    properties,
)


@pytest.fixture(scope="module")
def driver(bundle, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("databricks")
    cluster_python = bare_python(tmp / "databricks-python3")
    node = Node(tmp / "root")
    env = base_env(
        DB_IS_DRIVER="TRUE", DB_CLUSTER_ID="1206-033000-abcd1234", DB_CLUSTER_NAME="etl",
        DB_CONTAINER_IP="127.0.0.1", DB_DRIVER_IP="127.0.0.1", DB_INSTANCE_TYPE="m5.xlarge",
        DB_IS_JOB_CLUSTER="FALSE",
        SPILLWAY_DEPLOY_DIR=str(bundle),
        SPILLWAY_BOOTSTRAP_SERVERS="127.0.0.1:9",
        # /databricks/python3 does not exist here: the cluster's Python, by its variables
        SPILLWAY_PYTHON=str(cluster_python), SPILLWAY_SPARK_PYTHON=str(cluster_python),
        SPILLWAY_PORT=str(free_port()))
    argv = ["bash", str(bundle / "databricks-init.sh")]
    first = node.run(argv, env)
    yield node, cluster_python, lambda: node.run(argv, env), first
    node.stop()


def test_first_run_installs_configures_and_starts_the_sidecar(driver):
    node, cluster_python, _, first = driver
    assert "sidecar SERVING" in first.stderr
    assert_serving_once(node)
    props = properties(node.path("/etc/spillway/sidecar.properties"))
    assert props["sidecar.id"] == "1206-033000-abcd1234-driver-127.0.0.1"
    assert props["bootstrap.servers"] == "127.0.0.1:9"
    assert props["listen.unix.socket"] == str(node.path("/run/spillway/sidecar.sock"))
    assert props["listen.address"].startswith("127.0.0.1:")  # dedicated mode: loopback only
    assert props["spool.dir"] == str(node.path("/var/lib/spillway/spool"))


def test_executors_reach_the_sidecar_through_spark_env(driver):
    node, cluster_python, _, _ = driver
    spark_env = node.path("/databricks/spark/conf/spark-env.sh")
    assert f"export SPILLWAY_SIDECAR_ADDRESS={node.socket_address}" in spark_env.read_text()
    # the cluster's Python got spillway-client and spillway-spark (without a second pyspark)
    target, health, sidecar_id = probe_from_executor(cluster_python, {}, source=str(spark_env))
    assert (target, health) == (node.socket_address, "SERVING")
    assert sidecar_id == "1206-033000-abcd1234-driver-127.0.0.1"
    assert not list((cluster_python.parent.parent / "lib").glob("python3*/site-packages/pyspark"))


def test_the_operator_status_command_of_deploy_md(driver):
    node = driver[0]
    proc = subprocess.run(
        [str(node.path("/opt/spillway/bin/spillway")), "status", "--sidecar", node.socket_address],
        env=base_env(SPILLWAY_LOCAL_TOKEN_FILE=str(
            node.path("/var/lib/spillway/credentials/local.token"))),
        capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("sidecar 1206-033000-abcd1234-driver-127.0.0.1 (spillway ")


def test_second_run_is_idempotent(driver):
    node, _, run, _ = driver
    spark_env = node.path("/databricks/spark/conf/spark-env.sh")
    before = spark_env.read_text()
    second = assert_second_run_changes_nothing(
        node, run, ("/etc/spillway/sidecar.properties",),
        once=(("/databricks/spark/conf/spark-env.sh", "SPILLWAY_SIDECAR_ADDRESS="),))
    assert "unchanged" in second.stderr
    assert spark_env.read_text() == before


def test_the_restart_loop_stops_with_its_sidecar(driver):
    node = driver[0]
    node.stop()
    assert node.wait_gone() == []
