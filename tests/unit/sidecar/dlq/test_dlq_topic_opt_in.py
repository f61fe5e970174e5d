"""KIP-1191's topic opt-in in `TopicAdmin.ensure_dlq_topic`, over the admin client's answers
(a fake AdminClient whose calls return futures, as confluent-kafka's do): what a broker that
knows ``errors.deadletterqueue.group.enable`` answers, which Tansu (tested in
tests/integration/sidecar/dlq/test_dlq_admin.py) cannot show: a refused configuration at
creation, an unreadable configuration, a broker that reports the KIP's default."""

from __future__ import annotations

import logging
from concurrent.futures import Future
from types import SimpleNamespace

import pytest
from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import ConfigEntry
from spillway.sidecar.core.settings import DlqSettings
from spillway.sidecar.dlq.admin import TopicAdmin
from spillway.sidecar.errors import DlqError, TopicGuardrailError

OPT_IN = "errors.deadletterqueue.group.enable"
SERVERS = "kafka-a:9092"


def dlq(topic: str = "dlq.orders", *, auto_create: bool = False,
        prefix: str = "") -> DlqSettings:
    return DlqSettings(topic=topic, prefix=prefix, context_headers=False,
                       header_format="connect", copy_record=True, auto_create=auto_create,
                       replication_factor=1, partitions=2, stacktrace_max_bytes=8192)


def done(value=None, error: int | None = None) -> Future:
    f: Future = Future()
    if error is None:
        f.set_result(value)
    else:
        f.set_exception(KafkaException(KafkaError(error, f"broker says {error}")))
    return f


class FakeAdmin:
    """Answers as a Kafka cluster of one broker would. ``configs``: topic -> its described
    configuration (name -> value), as a broker reports it; ``describe_error`` /
    ``create_errors``: KafkaError codes the calls fail with (create: one per call, in turn)."""

    def __init__(self, *, topics=(), configs=None, describe_error=None, create_errors=()):
        self.topics = set(topics)
        self.configs = dict(configs or {})
        self.describe_error = describe_error
        self.create_errors = list(create_errors)
        self.created: list[tuple[str, int, int, dict]] = []
        self.create_calls: list[dict] = []

    def list_topics(self, timeout):
        return SimpleNamespace(
            topics={t: SimpleNamespace(error=None, partitions={0: None}) for t in self.topics},
            brokers={1: None})

    def describe_configs(self, resources, request_timeout):
        (r,) = resources
        if self.describe_error is not None:
            return {r: done(error=self.describe_error)}
        entries = self.configs.get(r.name, {})
        return {r: done({k: ConfigEntry(k, v) for k, v in entries.items()})}

    def create_topics(self, new_topics, operation_timeout, request_timeout):
        (nt,) = new_topics
        self.create_calls.append(dict(nt.config))
        if self.create_errors:
            return {nt.topic: done(error=self.create_errors.pop(0))}
        self.created.append((nt.topic, nt.num_partitions, nt.replication_factor,
                             dict(nt.config)))
        self.topics.add(nt.topic)
        self.configs[nt.topic] = dict(nt.config)
        return {nt.topic: done(None)}


def admin(fake: FakeAdmin) -> TopicAdmin:
    return TopicAdmin(fake, SERVERS)


@pytest.fixture
def kafka_log(caplog):
    caplog.set_level(logging.INFO, logger="spillway.sidecar.kafka")
    return caplog


def test_a_topic_whose_opt_in_is_false_is_refused_naming_the_config_and_who_sets_it():
    fake = FakeAdmin(topics=["dlq.orders"], configs={"dlq.orders": {
        OPT_IN: "false", "retention.ms": "604800000"}})
    with pytest.raises(TopicGuardrailError) as info:
        admin(fake).ensure_dlq_topic(dlq(), 5)
    assert info.value.property == "errors.deadletterqueue.topic.name"
    assert str(info.value) == (
        "errors.deadletterqueue.topic.name: the topic 'dlq.orders' is not enabled as a DLQ "
        "topic: its configuration errors.deadletterqueue.group.enable is false (KIP-1191: a "
        "topic is usable as a DLQ only when its administrator sets it to true, e.g. "
        "kafka-configs.sh --bootstrap-server kafka-a:9092 --alter --entity-type topics "
        "--entity-name dlq.orders --add-config errors.deadletterqueue.group.enable=true); or "
        "name another DLQ topic")
    assert fake.created == []


def test_the_kip_default_reported_by_a_broker_that_knows_it_is_refused_too():
    """A broker with KIP-1191 describes every topic configuration, defaults included: a topic
    its administrator never opted in reports false, whatever its name."""
    fake = FakeAdmin(topics=["dlq.orders"], configs={"dlq.orders": {OPT_IN: "FALSE"}})
    with pytest.raises(TopicGuardrailError, match="is not enabled as a DLQ topic"):
        admin(fake).ensure_dlq_topic(dlq(), 5)


def test_a_topic_whose_opt_in_is_true_is_accepted_and_the_log_says_so(kafka_log):
    fake = FakeAdmin(topics=["dlq.orders"], configs={"dlq.orders": {OPT_IN: "true"}})
    assert admin(fake).ensure_dlq_topic(dlq(), 5) is False
    (rec,) = [r for r in kafka_log.records if "dlq.orders" in r.getMessage()]
    assert rec.getMessage() == ("DLQ topic 'dlq.orders' may be used: its "
                                "errors.deadletterqueue.group.enable is true (KIP-1191 opt-in)")


def test_without_the_config_the_prefix_rule_decides_and_the_log_says_which(kafka_log):
    fake = FakeAdmin(topics=["dlq.orders"], configs={"dlq.orders": {"retention.ms": "1"}})
    assert admin(fake).ensure_dlq_topic(dlq(), 5) is False
    (rec,) = [r for r in kafka_log.records if "dlq.orders" in r.getMessage()]
    assert rec.levelno == logging.INFO
    assert rec.getMessage() == (
        "DLQ topic 'dlq.orders' may be used by the prefix rule: the name starts with 'dlq.' "
        "(dlq.topic.required.prefix); the broker at kafka-a:9092 does not report "
        "errors.deadletterqueue.group.enable (it predates KIP-1191)")


def test_the_log_names_the_jobs_narrower_prefix_or_an_open_operator_rule(kafka_log):
    fake = FakeAdmin(topics=["dlq.team-a.orders", "anything"])
    admin(fake).ensure_dlq_topic(dlq("dlq.team-a.orders", prefix="dlq.team-a."), 5)
    admin(fake).ensure_dlq_topic(dlq("anything"), 5, required_prefix="")
    got = [r.getMessage() for r in kafka_log.records]
    assert "the name starts with 'dlq.team-a.' (errors.deadletterqueue.topic.name.prefix)" \
        in got[0]
    assert "the operator's dlq.topic.required.prefix is '' (any name but Kafka's internal " \
           "ones)" in got[1]


def test_an_unreadable_configuration_leaves_the_prefix_rule_to_decide(kafka_log):
    fake = FakeAdmin(topics=["dlq.orders"],
                     describe_error=KafkaError.TOPIC_AUTHORIZATION_FAILED)
    assert admin(fake).ensure_dlq_topic(dlq(), 5) is False
    (rec,) = [r for r in kafka_log.records if "dlq.orders" in r.getMessage()]
    assert "may be used by the prefix rule: the name starts with 'dlq.'" in rec.getMessage()
    assert "its configuration could not be read (TOPIC_AUTHORIZATION_FAILED" in \
        rec.getMessage()


def test_a_created_dlq_topic_gets_the_opt_in(kafka_log):
    fake = FakeAdmin()
    assert admin(fake).ensure_dlq_topic(dlq(auto_create=True), 5) is True
    assert fake.created == [("dlq.orders", 2, 1, {OPT_IN: "true"})]
    assert any("with errors.deadletterqueue.group.enable=true" in r.getMessage()
               for r in kafka_log.records)


def test_a_broker_refusing_the_unknown_config_gets_the_topic_without_it_logged(kafka_log):
    fake = FakeAdmin(create_errors=[KafkaError.INVALID_CONFIG])
    assert admin(fake).ensure_dlq_topic(dlq(auto_create=True), 5) is True
    assert fake.create_calls == [{OPT_IN: "true"}, {}]
    assert fake.created == [("dlq.orders", 2, 1, {})]
    (rec,) = [r for r in kafka_log.records if r.levelno == logging.WARNING]
    assert rec.getMessage().startswith(
        "the Kafka cluster at kafka-a:9092 refused the topic configuration "
        "errors.deadletterqueue.group.enable=true (INVALID_CONFIG: ")
    assert "creating the DLQ topic 'dlq.orders' without it, so the prefix rule decides its " \
           "use" in rec.getMessage()


def test_other_creation_errors_are_not_retried_without_the_config():
    fake = FakeAdmin(create_errors=[KafkaError.POLICY_VIOLATION])
    with pytest.raises(DlqError, match=r"creating the topic 'dlq.orders' \(2 partition\(s\), "
                                       r"replication factor 1\) failed: POLICY_VIOLATION"):
        admin(fake).ensure_dlq_topic(dlq(auto_create=True), 5)
    assert fake.create_calls == [{OPT_IN: "true"}]


def test_a_topic_created_meanwhile_by_someone_else_is_checked_like_an_existing_one():
    class Racing(FakeAdmin):
        def create_topics(self, new_topics, operation_timeout, request_timeout):
            (nt,) = new_topics
            self.topics.add(nt.topic)
            self.configs[nt.topic] = {OPT_IN: "false"}
            return {nt.topic: done(error=KafkaError.TOPIC_ALREADY_EXISTS)}

    with pytest.raises(TopicGuardrailError, match="is not enabled as a DLQ topic"):
        admin(Racing()).ensure_dlq_topic(dlq(auto_create=True), 5)
