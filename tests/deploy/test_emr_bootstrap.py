"""deploy/emr/bootstrap.sh as EMR runs a bootstrap action: as root (EMR's hadoop user with sudo),
with the bundle's location as its first argument and settings after it, on a node described by
/mnt/var/lib/info/instance.json and job-flow.json, before Spark is installed; then again once
Spark is (a re-run by hand), into a temporary root. The executors' environment otherwise comes
from the cluster's configurations (deploy/emr/configurations.json)."""

from __future__ import annotations

import json

import pytest
from support.ports import free_port
from support.recipes import (
    DEPLOY,
    Node,
    assert_second_run_changes_nothing,
    assert_serving_once,
    bare_python,
    base_env,
    executor_env_from_spark_defaults,
    probe_from_executor,
    properties,
)


@pytest.fixture(scope="module")
def core_node(bundle, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("emr")
    python311 = bare_python(tmp / "python3.11")
    node = Node(tmp / "root")
    info = node.path("/mnt/var/lib/info")
    info.mkdir(parents=True)
    (info / "instance.json").write_text(json.dumps(
        {"isMaster": False, "isRunningNameNode": False, "isRunningDataNode": True,
         "isRunningJobTracker": False, "isRunningTaskTracker": True,
         "instanceGroupId": "ig-2EXAMPLE", "instanceRole": "core"}))
    (info / "job-flow.json").write_text(json.dumps({"jobFlowId": "j-3EXAMPLE",
                                                    "masterInstanceType": "m5.xlarge"}))
    env = base_env(SPILLWAY_PYTHON=str(python311), SPILLWAY_NODE_ADDRESS="127.0.0.1")
    argv = ["bash", str(bundle / "emr-bootstrap.sh"), str(bundle),
            "SPILLWAY_BOOTSTRAP_SERVERS=b-1.msk.example:9092", f"SPILLWAY_PORT={free_port()}"]
    first = node.run(argv, env)
    yield node, python311, lambda: node.run(argv, env), first
    node.stop()


def test_bootstrap_installs_configures_and_starts_the_sidecar(core_node):
    node, _, _, first = core_node
    assert "sidecar SERVING" in first.stderr
    assert "Spark is not installed yet" in first.stderr
    assert not node.path("/etc/spark").exists()
    assert_serving_once(node)
    props = properties(node.path("/etc/spillway/sidecar.properties"))
    assert props["sidecar.id"].startswith("j-3EXAMPLE-core-")
    assert props["bootstrap.servers"] == "b-1.msk.example:9092"


def test_configurations_json_gives_executors_what_the_recipe_serves():
    classes = {c["Classification"]: c for c in json.loads(
        (DEPLOY / "emr" / "configurations.json").read_text())}
    defaults = classes["spark-defaults"]["Properties"]
    exported = classes["spark-env"]["Configurations"][0]["Properties"]
    address = "unix:///run/spillway/sidecar.sock"  # the recipe's socket without a test root
    assert defaults["spark.executorEnv.SPILLWAY_SIDECAR_ADDRESS"] == address
    assert defaults["spark.yarn.appMasterEnv.SPILLWAY_SIDECAR_ADDRESS"] == address
    assert exported["SPILLWAY_SIDECAR_ADDRESS"] == address
    assert defaults["spark.executorEnv.PYSPARK_PYTHON"] == exported["PYSPARK_PYTHON"]


def test_after_spark_is_installed_executors_reach_the_sidecar(core_node):
    node, python311, run, _ = core_node
    conf = node.path("/etc/spark/conf")
    conf.mkdir(parents=True)
    (conf / "spark-defaults.conf").write_text("spark.master yarn\n")
    (conf / "spark-env.sh").write_text("export JAVA_HOME=/usr/lib/jvm/jre-17\n")
    run()
    defaults = (conf / "spark-defaults.conf").read_text()
    assert defaults.startswith("spark.master yarn\n")
    env = executor_env_from_spark_defaults(conf / "spark-defaults.conf")
    assert env == {"SPILLWAY_SIDECAR_ADDRESS": node.socket_address}
    assert f"spark.yarn.appMasterEnv.SPILLWAY_SIDECAR_ADDRESS {node.socket_address}" in defaults
    target, health, sidecar_id = probe_from_executor(python311, env)
    assert (target, health) == (node.socket_address, "SERVING")
    assert sidecar_id.startswith("j-3EXAMPLE-core-")


def test_another_run_is_idempotent(core_node):
    node, _, run, _ = core_node
    assert_second_run_changes_nothing(
        node, run, ("/etc/spillway/sidecar.properties", "/etc/spark/conf/spark-defaults.conf",
                    "/etc/spark/conf/spark-env.sh"),
        once=(("/etc/spark/conf/spark-defaults.conf",
               "spark.executorEnv.SPILLWAY_SIDECAR_ADDRESS"),
              ("/etc/spark/conf/spark-env.sh", "SPILLWAY_SIDECAR_ADDRESS=")))


def test_the_restart_loop_stops_with_its_sidecar(core_node):
    node = core_node[0]
    node.stop()
    assert node.wait_gone() == []
