"""DLQ.md's promise: a DLQ topic refused by the operator's guardrails (KIP-1191) raises
`spillway.client.TopicGuardrailError` naming the property, whichever check refused it (the name
rules before anything is asked of Kafka, or the topic check against a real broker); any other
refused property stays a plain InvalidPolicyError; a refused registration leaves no run."""

from __future__ import annotations

import uuid

import grpc
import pytest

from spillway.client import InvalidPolicyError, SidecarClient, TopicGuardrailError
from support.creds import admin_client

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def client(sidecar):
    c = SidecarClient(sidecar.address, timeout_s=20)
    yield c
    c.close()


def _missing_topic() -> str:
    return f"dlq.never-made-{uuid.uuid4().hex[:8]}"


@pytest.mark.parametrize("props, prop, says", [
    ({"errors.deadletterqueue.topic.name": "orders-errors"},
     "errors.deadletterqueue.topic.name", "does not start with the DLQ prefix 'dlq.'"),
    ({"errors.deadletterqueue.topic.name": "__consumer_offsets"},
     "errors.deadletterqueue.topic.name", "reserved for Kafka's internal topics"),
    ({"errors.deadletterqueue.topic.name.prefix": "ord"},
     "errors.deadletterqueue.topic.name.prefix", "would loosen the operator's DLQ prefix"),
    # refused by the topic check against the broker: it does not exist, no auto-create ...
    ({"errors.deadletterqueue.topic.name": _missing_topic()},
     "errors.deadletterqueue.auto.create.topics.enable", "does not exist"),
    # ... or more replicas than the (one-broker) cluster has
    ({"errors.deadletterqueue.topic.name": _missing_topic(),
      "errors.deadletterqueue.auto.create.topics.enable": "true",
      "errors.deadletterqueue.topic.replication.factor": "3"},
     "errors.deadletterqueue.topic.replication.factor", "has only 1 broker"),
])
def test_a_guardrail_refusal_raises_topic_guardrail_error(client, sidecar, props, prop, says):
    job = f"guarded-{uuid.uuid4().hex[:6]}"
    with pytest.raises(TopicGuardrailError) as info:
        client.register_job(job, {"errors.tolerance": "all", **props}, run_id="run-1")
    err = info.value
    assert isinstance(err, InvalidPolicyError)          # existing handlers still catch it
    assert err.code is grpc.StatusCode.INVALID_ARGUMENT
    assert err.property == prop
    assert prop in str(err) and says in str(err)
    assert isinstance(err.__cause__, grpc.RpcError)     # mapped at the boundary
    # refused: nothing registered
    with admin_client(sidecar.address) as operator:
        assert [s.job for s in operator.runs(job)] == []


def test_another_refused_property_is_not_a_guardrail_refusal(client):
    with pytest.raises(InvalidPolicyError) as info:
        client.register_job("badly-tolerant", {"errors.tolerance": "sometimes"}, run_id="run-1")
    assert not isinstance(info.value, TopicGuardrailError)
    assert "errors.tolerance" in str(info.value)
