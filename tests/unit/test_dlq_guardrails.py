"""DLQ topic-name guardrails: exact messages, naming the property."""

from __future__ import annotations

import pytest
from spillway.sidecar.core.guardrails import check_topic_name
from spillway.sidecar.core.settings import DlqSettings
from spillway.sidecar.errors import ConfigError, TopicGuardrailError


def dlq(topic: str, prefix: str = "dlq.") -> DlqSettings:
    return DlqSettings(topic=topic, prefix=prefix, context_headers=False, header_format="connect",
                       copy_record=True, auto_create=False, replication_factor=3, partitions=1,
                       stacktrace_max_bytes=8192)


@pytest.mark.parametrize("topic,prefix", [
    ("dlq.orders", "dlq."),
    ("emea.sales.dlq", "emea."),
    ("anything-goes_1.x", ""),
    ("", "dlq."),                     # no DLQ
    ("dlq." + "a" * 245, "dlq."),     # 249 characters
])
def test_accepted(topic, prefix):
    check_topic_name(dlq(topic, prefix))


def refusal(topic: str, prefix: str = "dlq.") -> str:
    with pytest.raises(TopicGuardrailError) as info:
        check_topic_name(dlq(topic, prefix))
    assert info.value.property == "errors.deadletterqueue.topic.name"
    assert isinstance(info.value, ConfigError)
    return str(info.value)


def test_double_underscore_is_always_refused_even_without_a_prefix():
    assert refusal("__consumer_offsets", "") == (
        "errors.deadletterqueue.topic.name: '__consumer_offsets' starts with '__', which is "
        "reserved for Kafka's internal topics; a DLQ topic name never may")
    assert refusal("__dlq.x", "__") == (
        "errors.deadletterqueue.topic.name: '__dlq.x' starts with '__', which is reserved for "
        "Kafka's internal topics; a DLQ topic name never may")


def test_prefix_is_required_unless_empty():
    assert refusal("orders-errors") == (
        "errors.deadletterqueue.topic.name: 'orders-errors' does not start with the DLQ prefix "
        "'dlq.' (errors.deadletterqueue.topic.name.prefix); rename the topic, or set "
        "errors.deadletterqueue.topic.name.prefix to '' to allow any name")


@pytest.mark.parametrize("topic", [".", "..", "dlq.a b", "dlq.ä", "dlq." + "a" * 246, "dlq/x"])
def test_invalid_kafka_names(topic):
    assert refusal(topic, "") == (
        f"errors.deadletterqueue.topic.name: {topic!r} is not a valid Kafka topic name: use 1 to "
        f"249 characters from [a-zA-Z0-9._-], other than '.' and '..'")
