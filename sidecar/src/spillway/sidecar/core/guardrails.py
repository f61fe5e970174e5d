"""DLQ topic-name guardrails (KIP-1191), pure.

A DLQ topic name is refused, with TopicGuardrailError naming ``errors.deadletterqueue.topic.name``,
when it is not a valid Kafka topic name, when it starts with ``__`` (Kafka's internal topics; never
allowed, whatever the prefix), or when it does not start with
``errors.deadletterqueue.topic.name.prefix`` (unless that prefix is empty). The checks run in that
order, so the message is about the most basic problem. An empty name means "no DLQ" and passes.
"""

from __future__ import annotations

import re

from ..errors import TopicGuardrailError
from .settings import DlqSettings

TOPIC_PROP = "errors.deadletterqueue.topic.name"
PREFIX_PROP = "errors.deadletterqueue.topic.name.prefix"
MAX_TOPIC_LENGTH = 249
_LEGAL = re.compile(r"[a-zA-Z0-9._-]+")


def invalid_name_message(name: str) -> str:
    return (f"{name!r} is not a valid Kafka topic name: use 1 to {MAX_TOPIC_LENGTH} characters "
            f"from [a-zA-Z0-9._-], other than '.' and '..'")


def internal_name_message(name: str) -> str:
    return (f"{name!r} starts with '__', which is reserved for Kafka's internal topics; "
            f"a DLQ topic name never may")


def prefix_message(name: str, prefix: str) -> str:
    return (f"{name!r} does not start with the DLQ prefix {prefix!r} ({PREFIX_PROP}); "
            f"rename the topic, or set {PREFIX_PROP} to '' to allow any name")


def valid_topic_name(name: str) -> bool:
    return (0 < len(name) <= MAX_TOPIC_LENGTH and name not in (".", "..")
            and _LEGAL.fullmatch(name) is not None)


def check_topic_name(settings: DlqSettings) -> None:
    """Raise TopicGuardrailError when `settings.topic` may not be used as a DLQ topic."""
    name = settings.topic
    if not name:
        return
    if not valid_topic_name(name):
        raise TopicGuardrailError(TOPIC_PROP, invalid_name_message(name))
    if name.startswith("__"):
        raise TopicGuardrailError(TOPIC_PROP, internal_name_message(name))
    if settings.prefix and not name.startswith(settings.prefix):
        raise TopicGuardrailError(TOPIC_PROP, prefix_message(name, settings.prefix))
