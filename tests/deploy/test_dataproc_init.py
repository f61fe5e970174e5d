"""deploy/dataproc/init.sh as Dataproc runs an initialization action: as root, on a node whose
Spark is configured, reading its settings from the instance metadata through
/usr/share/google/get_metadata_value (a stub in the temporary root answering what Dataproc and
the operator's --metadata would). It starts a real sidecar; a second run changes nothing."""

from __future__ import annotations

import pytest
from support.ports import free_port
from support.recipes import (
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
def worker(bundle, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dataproc")
    conda_python = bare_python(tmp / "conda-default")
    node = Node(tmp / "root")
    metadata = {
        "attributes/dataproc-role": "Worker",
        "attributes/dataproc-cluster-name": "etl-cluster",
        "attributes/dataproc-bucket": "dataproc-staging-example",
        "attributes/dataproc-worker-count": "2",
        "attributes/spillway-deploy-uri": str(bundle),
        "attributes/spillway-bootstrap-servers": "kafka-1.internal:9092",
        "network-interfaces/0/ip": "127.0.0.1",
    }
    stub = node.path("/usr/share/google/get_metadata_value")
    stub.parent.mkdir(parents=True)
    cases = "".join(f"  '{k}') echo '{v}' ;;\n" for k, v in metadata.items())
    stub.write_text(f"#!/bin/bash\ncase \"$1\" in\n{cases}  *) exit 1 ;;\nesac\n")
    stub.chmod(0o755)
    conf = node.path("/etc/spark/conf")
    conf.mkdir(parents=True)
    (conf / "spark-defaults.conf").write_text("spark.master=yarn\nspark.submit.deployMode=client\n")
    (conf / "spark-env.sh").write_text("SPARK_DAEMON_MEMORY=4000m\n")
    env = base_env(SPILLWAY_PYTHON=str(conda_python), SPILLWAY_SPARK_PYTHON=str(conda_python),
                   SPILLWAY_PORT=str(free_port()))
    argv = ["bash", str(bundle / "dataproc-init.sh")]
    first = node.run(argv, env)
    yield node, conda_python, lambda: node.run(argv, env), first
    node.stop()


def test_init_action_installs_configures_and_starts_the_sidecar(worker):
    node, _, _, first = worker
    assert "sidecar SERVING" in first.stderr
    # two workers and no TLS material: said once, at the start (jobs across nodes are refused)
    assert first.stderr.count("without SPILLWAY_TLS_DIR (cluster mode)") == 1
    assert_serving_once(node)
    props = properties(node.path("/etc/spillway/sidecar.properties"))
    assert props["sidecar.id"].startswith("etl-cluster-Worker-")
    assert props["bootstrap.servers"] == "kafka-1.internal:9092"


def test_executors_reach_the_sidecar_through_spark_defaults(worker):
    node, conda_python, _, _ = worker
    conf = node.path("/etc/spark/conf")
    defaults = (conf / "spark-defaults.conf").read_text()
    assert defaults.startswith("spark.master=yarn\nspark.submit.deployMode=client\n")
    env = executor_env_from_spark_defaults(conf / "spark-defaults.conf")
    assert env == {"SPILLWAY_SIDECAR_ADDRESS": node.socket_address}
    assert f"export SPILLWAY_SIDECAR_ADDRESS={node.socket_address}" in \
        (conf / "spark-env.sh").read_text()
    target, health, sidecar_id = probe_from_executor(conda_python, env)
    assert (target, health) == (node.socket_address, "SERVING")
    assert sidecar_id.startswith("etl-cluster-Worker-")


def test_second_run_is_idempotent(worker):
    node, _, run, _ = worker
    assert_second_run_changes_nothing(
        node, run, ("/etc/spillway/sidecar.properties", "/etc/spark/conf/spark-defaults.conf",
                    "/etc/spark/conf/spark-env.sh"),
        once=(("/etc/spark/conf/spark-defaults.conf",
               "spark.executorEnv.SPILLWAY_SIDECAR_ADDRESS"),))


def test_the_restart_loop_stops_with_its_sidecar(worker):
    node = worker[0]
    node.stop()
    assert node.wait_gone() == []
