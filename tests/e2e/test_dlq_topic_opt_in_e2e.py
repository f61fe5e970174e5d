"""KIP-1191's topic opt-in at RegisterJob, against `spillway serve` as its own process and the
Tansu broker: a DLQ topic whose ``errors.deadletterqueue.group.enable`` is false is refused
(INVALID_ARGUMENT, the client's InvalidPolicyError) naming the configuration and who sets it,
and the run does not exist; a topic the broker reports no opt-in for is used by the prefix
rule, which the sidecar's log names; a topic the sidecar creates is opted in."""

from __future__ import annotations

import subprocess
import uuid

import grpc
import pytest
from spillway.client import InvalidPolicyError, SidecarClient
from support import serve
from support.kafka import create_topic, topic_config

pytestmark = pytest.mark.e2e

OPT_IN = "errors.deadletterqueue.group.enable"


@pytest.fixture
def sidecar_proc(broker, tmp_path):
    proc, address = serve.spawn(
        ["--listen", "127.0.0.1:0", "--bootstrap-servers", broker.bootstrap_servers,
         "--set", f"spool.dir={tmp_path / 'spool'}"], log_level="INFO")
    logs = {"proc": proc}
    yield address, logs
    if proc.poll() is None:
        serve.stop(proc)


def stderr_of(logs) -> str:
    proc: subprocess.Popen = logs["proc"]
    serve.stop(proc)
    return proc.stderr.read()


def props(topic: str, **extra: str) -> dict[str, str]:
    return {"errors.tolerance": "all", "errors.deadletterqueue.topic.name": topic, **extra}


def test_register_job_refuses_a_topic_not_opted_in_and_logs_the_rule_that_let_others(
        broker, sidecar_proc):
    address, logs = sidecar_proc
    refused, plain, made = (f"dlq.optin-{uuid.uuid4().hex[:8]}" for _ in range(3))
    create_topic(broker.bootstrap_servers, refused, config={OPT_IN: "false"})
    create_topic(broker.bootstrap_servers, plain)
    client = SidecarClient(address)
    try:
        job, run_id = f"optin-{uuid.uuid4().hex[:6]}", uuid.uuid4().hex
        with pytest.raises(InvalidPolicyError) as info:
            client.register_job(job, props(refused), run_id=run_id)
        assert info.value.code is grpc.StatusCode.INVALID_ARGUMENT
        msg = str(info.value)
        assert (f"errors.deadletterqueue.topic.name: the topic {refused!r} is not enabled as a "
                f"DLQ topic: its configuration {OPT_IN} is false") in msg
        assert (f"kafka-configs.sh --bootstrap-server {broker.bootstrap_servers} --alter "
                f"--entity-type topics --entity-name {refused} --add-config {OPT_IN}=true") in msg
        assert topic_config(broker.bootstrap_servers, refused) == {OPT_IN: "false"}

        # the refused run does not exist: the same run registers with another policy
        # (a live run would answer JobConflictError)
        run = client.register_job(job, props(plain), run_id=run_id)
        assert run.run_id == run_id
        client.end_job(run)
        run = client.register_job(f"{job}-2", props(
            made, **{"errors.deadletterqueue.auto.create.topics.enable": "true",
                     "errors.deadletterqueue.topic.replication.factor": "1"}))
        client.end_job(run)
    finally:
        client.close()
    assert topic_config(broker.bootstrap_servers, made) == {OPT_IN: "true"}
    err = stderr_of(logs)
    assert (f"DLQ topic {plain!r} may be used by the prefix rule: the name starts with 'dlq.' "
            f"(dlq.topic.required.prefix); the broker at {broker.bootstrap_servers} does not "
            f"report {OPT_IN} (it predates KIP-1191)") in err
    assert f"created the DLQ topic {made!r}" in err and f"with {OPT_IN}=true" in err
