"""Make sure a job's DLQ topic exists before its first record is dead-lettered (KIP-1191 rules).

The name is checked first (`core.guardrails`). A missing topic is created only when
``errors.deadletterqueue.auto.create.topics.enable`` is true, never by default; the producer
itself never auto-creates topics (``allow.auto.create.topics=false``). Before creating, the broker
count is read from the cluster's metadata, so that a replication factor the cluster cannot honour
is refused with a message naming the property and both numbers (some brokers, Tansu among them,
would accept it silently).

confluent_kafka errors are mapped here, at the boundary, to DlqError (``raise ... from exc``).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import AdminClient, NewTopic

from ..core.guardrails import DEFAULT_REQUIRED_PREFIX, check_topic_name
from ..core.settings import DlqSettings
from ..errors import DlqError, TopicGuardrailError

AUTO_CREATE_PROP = "errors.deadletterqueue.auto.create.topics.enable"
RF_PROP = "errors.deadletterqueue.topic.replication.factor"


def _kafka_error(exc: KafkaException) -> str:
    err = exc.args[0] if exc.args else None
    return f"{err.name()}: {err.str()}" if isinstance(err, KafkaError) else str(exc)


def ensure_topic(admin_conf: Mapping[str, Any], settings: DlqSettings, timeout_s: float, *,
                 required_prefix: str = DEFAULT_REQUIRED_PREFIX,
                 auto_create_allowed: bool = True) -> bool:
    """Check that `settings.topic` may be used and exists; create it when allowed.

    Returns True when this call created the topic. Raises TopicGuardrailError for a refused name,
    a missing topic with auto-create disabled, or a replication factor above the broker count;
    DlqError when the cluster cannot be reached or refuses the creation.
    """
    if not settings.enabled:
        return False
    check_topic_name(settings, required_prefix, auto_create_allowed)
    topic = settings.topic
    servers = admin_conf.get("bootstrap.servers", "?")
    conf = dict(admin_conf)
    conf.setdefault("logger", logging.getLogger("spillway.dlq.librdkafka"))
    admin = AdminClient(conf)
    try:
        # All topics, not just ours: a metadata request naming a topic may auto-create it.
        md = admin.list_topics(timeout=timeout_s)
    except KafkaException as exc:
        raise DlqError(f"cannot read the metadata of the Kafka cluster at {servers} to check the "
                       f"DLQ topic {topic!r}: {_kafka_error(exc)}") from exc
    meta = md.topics.get(topic)
    if meta is not None and meta.error is None:
        return False
    if meta is not None and meta.error.code() != KafkaError.UNKNOWN_TOPIC_OR_PART:
        raise DlqError(f"the DLQ topic {topic!r} cannot be used: {meta.error.name()}: "
                       f"{meta.error.str()}")
    brokers = len(md.brokers)
    if not settings.auto_create:
        # the one command that makes it, with a replication factor this cluster can honour
        create = (f"kafka-topics.sh --bootstrap-server {servers} --create --topic {topic} "
                  f"--partitions {settings.partitions} --replication-factor "
                  f"{max(1, min(settings.replication_factor, brokers))}")
        raise TopicGuardrailError(
            AUTO_CREATE_PROP,
            f"the DLQ topic {topic!r} does not exist and auto-create is disabled; create it "
            f"({create}), or set {AUTO_CREATE_PROP}=true")
    if brokers < settings.replication_factor:
        raise TopicGuardrailError(
            RF_PROP,
            f"is {settings.replication_factor} but the cluster at {servers} has only {brokers} "
            f"broker(s), so the DLQ topic {topic!r} cannot be created; set {RF_PROP} to at most "
            f"{brokers}")
    futures = admin.create_topics(
        [NewTopic(topic, num_partitions=settings.partitions,
                  replication_factor=settings.replication_factor)],
        operation_timeout=timeout_s, request_timeout=timeout_s)
    try:
        futures[topic].result(timeout_s)
    except KafkaException as exc:
        err = exc.args[0] if exc.args else None
        if isinstance(err, KafkaError) and err.code() == KafkaError.TOPIC_ALREADY_EXISTS:
            return False  # created meanwhile by someone else
        raise DlqError(f"creating the DLQ topic {topic!r} ({settings.partitions} partition(s), "
                       f"replication factor {settings.replication_factor}) failed: "
                       f"{_kafka_error(exc)}") from exc
    except TimeoutError as exc:  # concurrent.futures.TimeoutError is TimeoutError on 3.11+
        raise DlqError(f"creating the DLQ topic {topic!r} did not finish within "
                       f"{timeout_s:g}s") from exc
    return True
