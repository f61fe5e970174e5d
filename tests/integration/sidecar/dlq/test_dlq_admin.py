"""ensure_topic against a real Tansu broker: existence, no auto-create by default, replication
factor checked against the broker count, guardrails before any network call, KIP-1191's topic
opt-in (``errors.deadletterqueue.group.enable``).

What Tansu answers (checked here, so a Tansu that changes shows up): it keeps any configuration
a topic is created with, unknown names included, and describes only what was set; a topic
created without the opt-in therefore reports nothing, as a broker before KIP-1191 does, and the
prefix rule decides. Answers Tansu cannot give (a broker refusing the unknown configuration,
the KIP's default described) are in tests/unit/sidecar/dlq/test_dlq_topic_opt_in.py."""

from __future__ import annotations

import logging
import time

import pytest
from confluent_kafka.admin import AdminClient
from spillway.sidecar.core.settings import DlqSettings
from spillway.sidecar.dlq import ensure_topic
from spillway.sidecar.errors import DlqError, TopicGuardrailError
from support.kafka import create_topic, topic_config

pytestmark = pytest.mark.integration

OPT_IN = "errors.deadletterqueue.group.enable"


def dlq(topic: str, *, auto_create: bool = False, rf: int = 1, partitions: int = 1,
        prefix: str = "dlq.") -> DlqSettings:
    return DlqSettings(topic=topic, prefix=prefix, context_headers=False, header_format="connect",
                       copy_record=True, auto_create=auto_create, replication_factor=rf,
                       partitions=partitions, stacktrace_max_bytes=8192)


def topics(bootstrap: str) -> dict:
    return AdminClient({"bootstrap.servers": bootstrap}).list_topics(timeout=10).topics


def test_an_existing_topic_is_accepted(broker, topic_name):
    create_topic(broker.bootstrap_servers, topic_name)
    conf = {"bootstrap.servers": broker.bootstrap_servers}
    assert ensure_topic(conf, dlq(topic_name), 10) is False


def test_a_missing_topic_is_not_created_by_default(broker, topic_name):
    conf = {"bootstrap.servers": broker.bootstrap_servers}
    with pytest.raises(TopicGuardrailError) as info:
        ensure_topic(conf, dlq(topic_name), 10)
    assert info.value.property == "errors.deadletterqueue.auto.create.topics.enable"
    assert str(info.value) == (
        f"errors.deadletterqueue.auto.create.topics.enable: the DLQ topic {topic_name!r} does "
        f"not exist and auto-create is disabled; create it (spillway dlq create-topic "
        f"--bootstrap-servers {broker.bootstrap_servers} --topic {topic_name} --partitions 1 "
        f"--replication-factor 1, which also sets errors.deadletterqueue.group.enable=true "
        f"where the brokers know KIP-1191), or set "
        f"errors.deadletterqueue.auto.create.topics.enable=true")
    assert topic_name not in topics(broker.bootstrap_servers)


def test_the_refusal_names_a_command_this_cluster_can_carry_out(broker, topic_name):
    """The default replication factor (3) on a one-broker cluster: the command says 1."""
    conf = {"bootstrap.servers": broker.bootstrap_servers}
    with pytest.raises(TopicGuardrailError) as info:
        ensure_topic(conf, dlq(topic_name, rf=3, partitions=4), 10)
    assert (f"(spillway dlq create-topic --bootstrap-servers {broker.bootstrap_servers} --topic "
            f"{topic_name} --partitions 4 --replication-factor 1, ") in str(info.value)
    assert topic_name not in topics(broker.bootstrap_servers)


def test_a_replication_factor_above_the_broker_count_is_refused_clearly(broker, topic_name):
    conf = {"bootstrap.servers": broker.bootstrap_servers}
    with pytest.raises(TopicGuardrailError) as info:
        ensure_topic(conf, dlq(topic_name, auto_create=True, rf=3), 10)
    assert info.value.property == "errors.deadletterqueue.topic.replication.factor"
    assert str(info.value) == (
        f"errors.deadletterqueue.topic.replication.factor: is 3 but the cluster at "
        f"{broker.bootstrap_servers} has only 1 broker(s), so the DLQ topic {topic_name!r} "
        f"cannot be created; set errors.deadletterqueue.topic.replication.factor to at most 1")
    assert topic_name not in topics(broker.bootstrap_servers)


def test_auto_create_uses_the_partition_count(broker, topic_name):
    conf = {"bootstrap.servers": broker.bootstrap_servers}
    assert ensure_topic(conf, dlq(topic_name, auto_create=True, partitions=3), 10) is True
    deadline = time.monotonic() + 10
    while topic_name not in topics(broker.bootstrap_servers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert len(topics(broker.bootstrap_servers)[topic_name].partitions) == 3
    assert topic_config(broker.bootstrap_servers, topic_name) == {OPT_IN: "true"}
    assert ensure_topic(conf, dlq(topic_name, auto_create=True, partitions=3), 10) is False


def test_a_topic_its_administrator_did_not_opt_in_is_refused(broker, topic_name):
    create_topic(broker.bootstrap_servers, topic_name, config={OPT_IN: "false"})
    conf = {"bootstrap.servers": broker.bootstrap_servers}
    with pytest.raises(TopicGuardrailError) as info:
        ensure_topic(conf, dlq(topic_name, auto_create=True), 10)
    assert info.value.property == "errors.deadletterqueue.topic.name"
    assert str(info.value) == (
        f"errors.deadletterqueue.topic.name: the topic {topic_name!r} is not enabled as a DLQ "
        f"topic: its configuration {OPT_IN} is false (KIP-1191: a topic is usable as a DLQ "
        f"only when its administrator sets it to true, e.g. kafka-configs.sh "
        f"--bootstrap-server {broker.bootstrap_servers} --alter --entity-type topics "
        f"--entity-name {topic_name} --add-config {OPT_IN}=true); or name another DLQ topic")
    assert topic_config(broker.bootstrap_servers, topic_name) == {OPT_IN: "false"}


def test_an_opted_in_topic_is_accepted_and_the_log_says_by_which_rule(broker, topic_name,
                                                                      caplog):
    caplog.set_level(logging.INFO, logger="spillway.sidecar.kafka")
    create_topic(broker.bootstrap_servers, topic_name, config={OPT_IN: "true"})
    conf = {"bootstrap.servers": broker.bootstrap_servers}
    assert ensure_topic(conf, dlq(topic_name), 10) is False
    assert [r.getMessage() for r in caplog.records if topic_name in r.getMessage()] == [
        f"DLQ topic {topic_name!r} may be used: its {OPT_IN} is true (KIP-1191 opt-in)"]


def test_a_topic_without_the_config_is_left_to_the_prefix_rule(broker, topic_name, caplog):
    """Tansu describes only what was set: like a broker before KIP-1191, it reports no opt-in
    for a topic created without one."""
    caplog.set_level(logging.INFO, logger="spillway.sidecar.kafka")
    create_topic(broker.bootstrap_servers, topic_name)
    assert OPT_IN not in topic_config(broker.bootstrap_servers, topic_name)
    conf = {"bootstrap.servers": broker.bootstrap_servers}
    assert ensure_topic(conf, dlq(topic_name), 10) is False
    assert [r.getMessage() for r in caplog.records if topic_name in r.getMessage()] == [
        f"DLQ topic {topic_name!r} may be used by the prefix rule: the name starts with "
        f"'dlq.' (errors.deadletterqueue.topic.name.prefix); the broker at "
        f"{broker.bootstrap_servers} does not report {OPT_IN} (it predates KIP-1191)"]


def test_guardrails_refuse_a_name_before_any_network_call(unreachable):
    conf = {"bootstrap.servers": unreachable}
    t0 = time.monotonic()
    with pytest.raises(TopicGuardrailError, match="starts with '__'"):
        ensure_topic(conf, dlq("__consumer_offsets", prefix=""), 10)
    with pytest.raises(TopicGuardrailError, match="does not start with the DLQ prefix"):
        ensure_topic(conf, dlq("orders"), 10)
    assert time.monotonic() - t0 < 5.0  # a network call would wait out its 10 s


def test_an_unreachable_cluster_is_a_dlq_error_within_the_timeout(unreachable):
    conf = {"bootstrap.servers": unreachable}
    t0 = time.monotonic()
    with pytest.raises(DlqError, match="cannot read the metadata of the Kafka cluster"):
        ensure_topic(conf, dlq("dlq.x"), 1.0)
    assert time.monotonic() - t0 < 5.0
