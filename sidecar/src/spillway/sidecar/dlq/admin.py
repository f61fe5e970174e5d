"""Make sure a job's DLQ topic exists and may be used before its first record is dead-lettered
(KIP-1191 rules); create topics for the operator's tools.

The name is checked first (`core.guardrails`). A missing topic is created only when
``errors.deadletterqueue.auto.create.topics.enable`` is true, never by default; the producer
itself never auto-creates topics (``allow.auto.create.topics=false``). Before creating, the broker
count is read from the cluster's metadata, so that a replication factor the cluster cannot honour
is refused with a message naming the property and both numbers (some brokers, Tansu among them,
would accept it silently).

KIP-1191's topic opt-in: an existing topic's ``errors.deadletterqueue.group.enable`` is read
(DescribeConfigs). False: refused, naming the configuration and who sets it. True: accepted.
Not reported (a broker before KIP-1191) or not readable: the prefix rule decided, and the log
says so. A DLQ topic spillway creates gets the configuration set to true; a broker that refuses
the unknown configuration (INVALID_CONFIG) gets the topic without it, logged.

confluent_kafka errors are mapped here, at the boundary, to DlqError (``raise ... from exc``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import AdminClient, ConfigResource, NewTopic, ResourceType

from ..core.guardrails import (
    AUTO_CREATE_PROP,
    DEFAULT_REQUIRED_PREFIX,
    GROUP_ENABLE_PROP,
    TOPIC_PROP,
    check_created_name,
    check_topic_name,
    decided_by_prefix,
    opt_in_refused_message,
)
from ..core.settings import DlqSettings
from ..errors import DlqError, TopicGuardrailError

RF_PROP = "errors.deadletterqueue.topic.replication.factor"

log = logging.getLogger("spillway.sidecar.kafka")

# What `TopicAdmin.create` did.
CREATED = "created"
CREATED_WITHOUT_OPT_IN = "created without the opt-in"   # the broker refused the configuration
EXISTED = "existed"                                       # someone else created it meanwhile


def kafka_error_text(exc: KafkaException) -> str:
    err = exc.args[0] if exc.args else None
    return f"{err.name()}: {err.str()}" if isinstance(err, KafkaError) else str(exc)


def _code(exc: KafkaException) -> int | None:
    err = exc.args[0] if exc.args else None
    return err.code() if isinstance(err, KafkaError) else None


class TopicAdmin:
    """Topic checks and creation over one Kafka admin client (`AdminClient`, or a fake with its
    methods in unit tests). ``servers`` names the cluster in messages."""

    def __init__(self, admin: Any, servers: str) -> None:
        self._admin = admin
        self.servers = servers

    @classmethod
    def connect(cls, admin_conf: Mapping[str, Any]) -> TopicAdmin:
        conf = dict(admin_conf)
        conf.setdefault("logger", logging.getLogger("spillway.dlq.librdkafka"))
        return cls(AdminClient(conf), str(admin_conf.get("bootstrap.servers", "?")))

    def lookup(self, topic: str, timeout_s: float) -> tuple[Any | None, int]:
        """(the topic's metadata, None when it does not exist; the broker count)."""
        try:
            # All topics, not just ours: a metadata request naming a topic may auto-create it.
            md = self._admin.list_topics(timeout=timeout_s)
        except KafkaException as exc:
            raise DlqError(f"cannot read the metadata of the Kafka cluster at {self.servers} to "
                           f"check the topic {topic!r}: {kafka_error_text(exc)}") from exc
        meta = md.topics.get(topic)
        if meta is not None and meta.error is not None:
            if meta.error.code() != KafkaError.UNKNOWN_TOPIC_OR_PART:
                raise DlqError(f"the topic {topic!r} cannot be used: {meta.error.name()}: "
                               f"{meta.error.str()}")
            meta = None
        return meta, len(md.brokers)

    def opt_in(self, topic: str, timeout_s: float) -> tuple[bool | None, str]:
        """The topic's ``errors.deadletterqueue.group.enable``: True or False where the broker
        reports it, None where it does not (or the configuration cannot be read), with why."""
        resource = ConfigResource(ResourceType.TOPIC, topic)
        try:
            futures = self._admin.describe_configs([resource], request_timeout=timeout_s)
            entries = next(iter(futures.values())).result(timeout_s)
        except KafkaException as exc:
            # e.g. no DescribeConfigs permission: the broker's ACLs still govern the writes
            return None, f"its configuration could not be read ({kafka_error_text(exc)})"
        except TimeoutError as exc:
            raise DlqError(f"reading the configuration of the topic {topic!r} did not finish "
                           f"within {timeout_s:g}s") from exc
        entry = entries.get(GROUP_ENABLE_PROP)
        value = getattr(entry, "value", None)
        if value is None:
            return None, (f"the broker at {self.servers} does not report {GROUP_ENABLE_PROP} "
                          f"(it predates KIP-1191)")
        return value.strip().lower() == "true", f"{GROUP_ENABLE_PROP}={value}"

    def create(self, topic: str, partitions: int, replication_factor: int, timeout_s: float, *,
               dlq: bool) -> str:
        """Create `topic`; a DLQ topic (``dlq``) with ``errors.deadletterqueue.group.enable=true``,
        or without it where the broker refuses that configuration (CREATED_WITHOUT_OPT_IN).
        EXISTED when it was created meanwhile by someone else. DlqError when the broker refuses
        otherwise."""
        config = {GROUP_ENABLE_PROP: "true"} if dlq else {}
        try:
            self._create(topic, partitions, replication_factor, timeout_s, config)
        except KafkaException as exc:
            if _code(exc) == KafkaError.TOPIC_ALREADY_EXISTS:
                return EXISTED
            if not (config and _code(exc) == KafkaError.INVALID_CONFIG):
                raise self._creation_failed(topic, partitions, replication_factor, exc) from exc
            log.warning("the Kafka cluster at %s refused the topic configuration %s=true "
                        "(%s; a broker before KIP-1191): creating the DLQ topic %r without "
                        "it, so the prefix rule decides its use", self.servers,
                        GROUP_ENABLE_PROP, kafka_error_text(exc), topic)
            try:
                self._create(topic, partitions, replication_factor, timeout_s, {})
            except KafkaException as again:
                if _code(again) == KafkaError.TOPIC_ALREADY_EXISTS:
                    return EXISTED
                raise self._creation_failed(topic, partitions, replication_factor,
                                            again) from again
            return CREATED_WITHOUT_OPT_IN
        if config:
            log.info("created the DLQ topic %r on %s (%d partition(s), replication factor %d) "
                     "with %s=true", topic, self.servers, partitions, replication_factor,
                     GROUP_ENABLE_PROP)
        return CREATED

    def _create(self, topic: str, partitions: int, replication_factor: int, timeout_s: float,
                config: dict[str, str]) -> None:
        futures = self._admin.create_topics(
            [NewTopic(topic, num_partitions=partitions, replication_factor=replication_factor,
                      config=config)],
            operation_timeout=timeout_s, request_timeout=timeout_s)
        try:
            futures[topic].result(timeout_s)
        except TimeoutError as exc:  # concurrent.futures.TimeoutError is TimeoutError on 3.11+
            raise DlqError(f"creating the topic {topic!r} did not finish within "
                           f"{timeout_s:g}s") from exc

    @staticmethod
    def _creation_failed(topic: str, partitions: int, replication_factor: int,
                         exc: KafkaException) -> DlqError:
        return DlqError(f"creating the topic {topic!r} ({partitions} partition(s), "
                        f"replication factor {replication_factor}) failed: "
                        f"{kafka_error_text(exc)}")

    def check_usable(self, settings: DlqSettings, required_prefix: str,
                     timeout_s: float) -> None:
        """KIP-1191's opt-in for the existing DLQ topic of `settings`: TopicGuardrailError when
        its ``errors.deadletterqueue.group.enable`` is false; the log says which rule let it."""
        topic = settings.topic
        enabled, why = self.opt_in(topic, timeout_s)
        if enabled is False:
            raise TopicGuardrailError(TOPIC_PROP, opt_in_refused_message(topic, self.servers))
        if enabled:
            log.info("DLQ topic %r may be used: its %s is true (KIP-1191 opt-in)", topic,
                     GROUP_ENABLE_PROP)
        else:
            log.info("DLQ topic %r may be used by the prefix rule: %s; %s", topic,
                     decided_by_prefix(settings, required_prefix), why)

    def ensure_dlq_topic(self, settings: DlqSettings, timeout_s: float, *,
                         required_prefix: str = DEFAULT_REQUIRED_PREFIX,
                         auto_create_allowed: bool = True) -> bool:
        """Check that `settings.topic` may be used and exists; create it when allowed.

        Returns True when this call created the topic. Raises TopicGuardrailError for a refused
        name, a topic whose opt-in is false, a missing topic with auto-create disabled, or a
        replication factor above the broker count; DlqError when the cluster cannot be reached
        or refuses the creation. `timeout_s` bounds the calls together (the caller's deadline).
        """
        if not settings.enabled:
            return False
        check_topic_name(settings, required_prefix, auto_create_allowed)
        deadline = time.monotonic() + timeout_s

        def left() -> float:
            return max(0.1, deadline - time.monotonic())

        topic = settings.topic
        meta, brokers = self.lookup(topic, left())
        if meta is not None:
            self.check_usable(settings, required_prefix, left())
            return False
        if not settings.auto_create:
            # the one command that makes it, with a replication factor this cluster can honour
            create = (f"spillway dlq create-topic --bootstrap-servers {self.servers} --topic "
                      f"{topic} --partitions {settings.partitions} --replication-factor "
                      f"{max(1, min(settings.replication_factor, brokers))}, which also sets "
                      f"{GROUP_ENABLE_PROP}=true where the brokers know KIP-1191")
            raise TopicGuardrailError(
                AUTO_CREATE_PROP,
                f"the DLQ topic {topic!r} does not exist and auto-create is disabled; create it "
                f"({create}), or set {AUTO_CREATE_PROP}=true")
        check_replication(settings.replication_factor, brokers, servers=self.servers,
                          topic=topic, setting=RF_PROP, what="DLQ topic")
        if self.create(topic, settings.partitions, settings.replication_factor, left(),
                       dlq=True) != EXISTED:
            return True
        self.check_usable(settings, required_prefix, left())  # someone else's topic
        return False


def check_layout(partitions: int, replication_factor: int) -> None:
    """ValueError naming the option when a topic to create asks for fewer than one partition
    or replica (``--partitions``, ``--replication-factor``)."""
    if partitions < 1:
        raise ValueError(f"--partitions must be >= 1, got {partitions}")
    if replication_factor < 1:
        raise ValueError(f"--replication-factor must be >= 1, got {replication_factor}")


def check_replication(replication_factor: int, brokers: int, *, servers: str, topic: str,
                      setting: str, what: str = "topic") -> None:
    """TopicGuardrailError naming `setting` and both numbers when the cluster has fewer brokers
    than the replication factor asks for (some brokers, Tansu among them, accept it silently)."""
    if brokers < replication_factor:
        raise TopicGuardrailError(
            setting,
            f"is {replication_factor} but the cluster at {servers} has only {brokers} "
            f"broker(s), so the {what} {topic!r} cannot be created; set {setting} to at most "
            f"{brokers}")


def ensure_topic(admin_conf: Mapping[str, Any], settings: DlqSettings, timeout_s: float, *,
                 required_prefix: str = DEFAULT_REQUIRED_PREFIX,
                 auto_create_allowed: bool = True) -> bool:
    """`TopicAdmin.ensure_dlq_topic` with an admin client built from `admin_conf`."""
    if not settings.enabled:
        return False
    check_topic_name(settings, required_prefix, auto_create_allowed)  # before any connection
    return TopicAdmin.connect(admin_conf).ensure_dlq_topic(
        settings, timeout_s, required_prefix=required_prefix,
        auto_create_allowed=auto_create_allowed)


def create_dlq_topic(admin: TopicAdmin, topic: str, *, partitions: int, replication_factor: int,
                     required_prefix: str, if_not_exists: bool = False,
                     timeout_s: float = 10.0) -> str:
    """``spillway dlq create-topic``: create a DLQ topic under the operator's rules (the name
    rules and prefix, a replication factor the cluster can honour), with KIP-1191's opt-in.
    Returns what was done, as a sentence. TopicGuardrailError (a ValueError) for a refused
    request, DlqError when the topic exists (unless `if_not_exists` and it may be used as a
    DLQ) or Kafka fails."""
    check_created_name(topic, required_prefix, "--topic")
    check_layout(partitions, replication_factor)
    meta, brokers = admin.lookup(topic, timeout_s)
    if meta is None:
        check_replication(replication_factor, brokers, servers=admin.servers, topic=topic,
                          setting="--replication-factor")
        done = admin.create(topic, partitions, replication_factor, timeout_s, dlq=True)
        what = (f"the DLQ topic {topic!r} ({partitions} partition(s), replication factor "
                f"{replication_factor})")
        if done == CREATED:
            return f"created {what} with {GROUP_ENABLE_PROP}=true"
        if done == CREATED_WITHOUT_OPT_IN:
            return (f"created {what} without {GROUP_ENABLE_PROP}: the brokers at "
                    f"{admin.servers} refused it (they predate KIP-1191), so the prefix rule "
                    f"decides its use")
    enabled, why = admin.opt_in(topic, timeout_s)   # it exists: may it be used?
    if enabled is False:
        raise TopicGuardrailError("--topic", opt_in_refused_message(topic, admin.servers))
    state = f"its {GROUP_ENABLE_PROP} is true" if enabled else \
        f"{why}, so the prefix rule decides its use"
    exists = f"the topic {topic!r} exists already; {state}"
    if not if_not_exists:
        raise DlqError(f"{exists} (--if-not-exists accepts it)")
    return exists
