"""DLQ topic guardrails (KIP-1191), pure: operator rules a job cannot loosen.

KIP-1191 makes the DLQ name prefix a cluster administrator's setting. Here the operator sets it
on the sidecar (``dlq.topic.required.prefix``, default ``dlq.``, sidecar-only); a job's own
``errors.deadletterqueue.topic.name.prefix`` can only narrow it (that prefix, or a longer one
starting with it) and, when unset, is the operator's. Both must be legal topic-name fragments
(checked when parsed, `config.p_topic_prefix`). Whether a job may auto-create its DLQ topic is
the operator's call too (``dlq.topic.auto.create.allow``; KIP-1191 never auto-creates by
default, whatever the job says).

A DLQ topic name is refused, with TopicGuardrailError naming ``errors.deadletterqueue.topic.name``,
when it is not a valid Kafka topic name, when it starts with ``__`` (Kafka's internal topics; never
allowed, whatever the prefix), or when it does not start with the effective prefix (unless the
operator set it to ''). The checks run in that order, so the message is about the most basic
problem. An empty name means "no DLQ" and passes.

KIP-1191's topic opt-in: a topic is usable as a DLQ only when its own configuration
``errors.deadletterqueue.group.enable`` is true, which the topic's administrator sets. Where the
broker reports that configuration, it decides (`dlq.admin` reads it); where it does not (a broker
before KIP-1191, Tansu among them), the prefix rule above decides, and the sidecar logs which
(`decided_by_prefix`).
"""

from __future__ import annotations

from ..errors import TopicGuardrailError
from .names import invalid_topic_message, valid_topic_name
from .settings import DlqSettings

TOPIC_PROP = "errors.deadletterqueue.topic.name"
PREFIX_PROP = "errors.deadletterqueue.topic.name.prefix"
REQUIRED_PREFIX_PROP = "dlq.topic.required.prefix"
AUTO_CREATE_PROP = "errors.deadletterqueue.auto.create.topics.enable"
AUTO_CREATE_ALLOW_PROP = "dlq.topic.auto.create.allow"
DEFAULT_REQUIRED_PREFIX = "dlq."
GROUP_ENABLE_PROP = "errors.deadletterqueue.group.enable"


def internal_name_message(name: str) -> str:
    return (f"{name!r} starts with '__', which is reserved for Kafka's internal topics; "
            f"a DLQ topic name never may")


def prefix_message(name: str, prefix: str) -> str:
    return (f"{name!r} does not start with the DLQ prefix {prefix!r} ({PREFIX_PROP}, within "
            f"the operator's {REQUIRED_PREFIX_PROP}); rename the topic")


def opt_in_refused_message(name: str, servers: str) -> str:
    """Why a topic whose own ``errors.deadletterqueue.group.enable`` is false is refused, and
    who can change that: the topic's administrator (or the job, by naming another topic)."""
    return (f"the topic {name!r} is not enabled as a DLQ topic: its configuration "
            f"{GROUP_ENABLE_PROP} is false (KIP-1191: a topic is usable as a DLQ only when its "
            f"administrator sets it to true, e.g. kafka-configs.sh --bootstrap-server {servers} "
            f"--alter --entity-type topics --entity-name {name} --add-config "
            f"{GROUP_ENABLE_PROP}=true); or name another DLQ topic")


def decided_by_prefix(settings: DlqSettings, required: str) -> str:
    """Which prefix rule let `settings.topic` be used, for the log line of a broker that does not
    report the topic opt-in."""
    prefix = effective_prefix(settings, required)
    if not prefix:
        return (f"the operator's {REQUIRED_PREFIX_PROP} is '' (any name but Kafka's internal "
                f"ones)")
    which = PREFIX_PROP if settings.prefix else REQUIRED_PREFIX_PROP
    return f"the name starts with {prefix!r} ({which})"


def effective_prefix(settings: DlqSettings, required: str) -> str:
    """The prefix a job's DLQ topic must start with: the job's own (narrower), else the
    operator's."""
    return settings.prefix or required


def _check_valid_name(name: str, prop: str) -> None:
    """A valid Kafka topic name, not one of Kafka's internal ones; else TopicGuardrailError
    naming `prop`."""
    if not valid_topic_name(name):
        raise TopicGuardrailError(prop, invalid_topic_message(name))
    if name.startswith("__"):
        raise TopicGuardrailError(prop, internal_name_message(name))


def check_created_name(name: str, required_prefix: str, what: str) -> None:
    """The operator's tools create topics (``spillway dlq create-topic``, ``redrive
    --create-target``) under the rules a DLQ topic name obeys: a valid name, not internal, and
    starting with the operator's prefix. TopicGuardrailError naming `what` (the option)."""
    _check_valid_name(name, what)
    if required_prefix and not name.startswith(required_prefix):
        raise TopicGuardrailError(what, (
            f"{name!r} does not start with {required_prefix!r}, the operator's prefix for the "
            f"topics spillway creates ({REQUIRED_PREFIX_PROP}); name one that does"))


def check_topic_name(settings: DlqSettings, required_prefix: str = DEFAULT_REQUIRED_PREFIX,
                     auto_create_allowed: bool = True) -> None:
    """Raise TopicGuardrailError when the job's DLQ settings break the operator's rules or
    `settings.topic` may not be used as a DLQ topic."""
    job_prefix = settings.prefix
    if job_prefix and not job_prefix.startswith(required_prefix):
        raise TopicGuardrailError(PREFIX_PROP, (
            f"{job_prefix!r} would loosen the operator's DLQ prefix {required_prefix!r} "
            f"({REQUIRED_PREFIX_PROP}): a job may only set that prefix or a longer one "
            f"starting with it"))
    name = settings.topic
    if not name:
        return
    _check_valid_name(name, TOPIC_PROP)
    prefix = effective_prefix(settings, required_prefix)
    if prefix and not name.startswith(prefix):
        raise TopicGuardrailError(TOPIC_PROP, prefix_message(name, prefix))
    if settings.auto_create and not auto_create_allowed:
        raise TopicGuardrailError(AUTO_CREATE_PROP, (
            f"this sidecar's operator does not let jobs create DLQ topics "
            f"({AUTO_CREATE_ALLOW_PROP}=false); create {name!r} first, or leave "
            f"{AUTO_CREATE_PROP} unset"))
