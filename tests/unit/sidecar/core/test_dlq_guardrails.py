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
    check_topic_name(dlq(topic, prefix), required_prefix=prefix)  # the operator's prefix


def refusal(topic: str, prefix: str = "dlq.") -> str:
    with pytest.raises(TopicGuardrailError) as info:
        check_topic_name(dlq(topic, prefix), required_prefix=prefix)
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
        "'dlq.' (errors.deadletterqueue.topic.name.prefix, within the operator's "
        "dlq.topic.required.prefix); rename the topic")


@pytest.mark.parametrize("topic", [".", "..", "dlq.a b", "dlq.ä", "dlq." + "a" * 246, "dlq/x"])
def test_invalid_kafka_names(topic):
    assert refusal(topic, "") == (
        f"errors.deadletterqueue.topic.name: {topic!r} is not a valid Kafka topic name: use 1 to "
        f"249 characters from [a-zA-Z0-9._-], other than '.' and '..'")


# --- operator guardrails a job cannot loosen ---------------------------------------------------

def test_a_job_prefix_may_only_narrow_the_operators():
    check_topic_name(dlq("dlq.team-a.orders", "dlq.team-a."), required_prefix="dlq.")
    check_topic_name(dlq("dlq.orders", "dlq."), required_prefix="dlq.")
    for loose in ("emea.", "dl", "x"):
        with pytest.raises(TopicGuardrailError) as info:
            check_topic_name(dlq("dlq.orders", loose), required_prefix="dlq.")
        assert info.value.property == "errors.deadletterqueue.topic.name.prefix"
        assert f"{loose!r} would loosen the operator's DLQ prefix 'dlq.' " \
               "(dlq.topic.required.prefix)" in str(info.value)


def test_an_empty_job_prefix_means_the_operators_not_any_topic():
    for topic in ("orders", "payments.events", "connect-offsets"):
        with pytest.raises(TopicGuardrailError, match="does not start with the DLQ prefix 'dlq.'"):
            check_topic_name(dlq(topic, ""), required_prefix="dlq.")
    check_topic_name(dlq("dlq.orders", ""), required_prefix="dlq.")


def test_only_the_operator_can_lift_the_prefix_rule():
    check_topic_name(dlq("orders-errors", ""), required_prefix="")


def test_auto_create_is_the_operators_call():
    import dataclasses
    s = dataclasses.replace(dlq("dlq.orders"), auto_create=True)
    check_topic_name(s, auto_create_allowed=True)
    with pytest.raises(TopicGuardrailError) as info:
        check_topic_name(s, auto_create_allowed=False)
    assert info.value.property == "errors.deadletterqueue.auto.create.topics.enable"
    assert "dlq.topic.auto.create.allow=false" in str(info.value)


@pytest.mark.parametrize("prefix", ["bad prefix!", "dlq/", "ä.", "__", "__dlq.", "p" * 249])
def test_a_prefix_must_be_a_legal_topic_name_fragment(prefix):
    from spillway.sidecar.core.config import PROPERTIES
    from spillway.sidecar.core.settings import job_settings

    for prop in ("errors.deadletterqueue.topic.name.prefix", "dlq.topic.required.prefix"):
        with pytest.raises(ConfigError) as info:
            PROPERTIES[prop].parse(prop, prefix)
        assert info.value.property == prop
    with pytest.raises(ConfigError) as info:
        job_settings("j", {"errors.deadletterqueue.topic.name.prefix": prefix})
    assert info.value.property == "errors.deadletterqueue.topic.name.prefix"
    assert "legal topic-name fragment" in str(info.value) or "'__'" in str(info.value)
