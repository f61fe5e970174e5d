"""A run's DLQ topic checked against Kafka before the run exists (RegisterJob): it is there, or
created when the job and the operator's guardrails allow it; once per topic per sidecar."""

from __future__ import annotations

import threading
from collections.abc import Mapping

from spillway.sidecar.core.settings import JobSettings
from spillway.sidecar.errors import DlqError, KafkaUnreachableError, TopicGuardrailError
from spillway.sidecar.observability.health import quiet_librdkafka

# librdkafka answers a little after its timeout: the topic check leaves this much of the deadline
_KAFKA_ANSWER_MARGIN_S = 0.75


def kafka_conf(props: Mapping[str, object]) -> dict:
    """The sidecar's librdkafka settings for admin calls and checks."""
    return quiet_librdkafka({"bootstrap.servers": props["bootstrap.servers"],
                             **props.get("_kafka_overrides", {})})


class TopicChecks:
    def __init__(self, props: Mapping[str, object]) -> None:
        self.props = props
        self._checked: set[tuple[str, bool]] = set()
        self._lock = threading.Lock()

    def ensure(self, settings: JobSettings, timeout_s: float) -> None:
        """Within the caller's deadline (less a margin for our answer); a Kafka that does not
        answer is KafkaUnreachableError, which RegisterJob answers FAILED_PRECONDITION."""
        from spillway.sidecar.dlq.admin import ensure_topic

        key = (settings.dlq.topic, settings.dlq.auto_create)
        with self._lock:
            if key in self._checked:
                return
        budget = max(0.5, min(timeout_s - _KAFKA_ANSWER_MARGIN_S, 15.0))
        try:
            ensure_topic(kafka_conf(self.props), settings.dlq, timeout_s=budget,
                         required_prefix=self.props["dlq.topic.required.prefix"],
                         auto_create_allowed=self.props["dlq.topic.auto.create.allow"])
        except TopicGuardrailError:
            raise
        except DlqError as exc:
            raise KafkaUnreachableError(str(self.props["bootstrap.servers"]), str(exc)) from exc
        with self._lock:
            self._checked.add(key)
