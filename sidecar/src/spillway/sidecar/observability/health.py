"""What the sidecar's health says, and its Kafka check.

Health services (``grpc.health.v1``):

- ``""`` and ``spillway.v1.ErrorSidecar``: SERVING, or NOT_SERVING while reports are refused for
  backpressure (admission.py) and during a graceful stop.
- ``spillway.kafka``: SERVING while the last check reached the sidecar's Kafka (its metadata
  answered), NOT_SERVING when it did not. Reports are still accepted then (they wait in the
  spool), so the sidecar's own health stays SERVING: a Kafka outage is what the spool is for.

The Kafka check runs at start-up (never fatal: one log line, reachable with the broker count, or
the error) and then every ``kafka.check.interval.ms``, logging again only when the answer
changes. librdkafka's own log is routed to the ``spillway.kafka.librdkafka`` logger at
critical level only: a wrong address must not print a line per connection attempt.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from spillway.client.kafka_auth import scrub

log = logging.getLogger("spillway.sidecar.kafka")

KAFKA_HEALTH_SERVICE = "spillway.kafka"


@dataclass(frozen=True)
class KafkaStatus:
    reachable: bool
    brokers: int = 0
    error: str = ""


def quiet_librdkafka(conf: Mapping[str, Any], logger_name: str = "spillway.kafka.librdkafka",
                     level: int = 2) -> dict[str, Any]:
    """``conf`` with librdkafka's log routed to Python logging, at most syslog ``level``
    (2: critical only; librdkafka's per-attempt connection errors are level 3)."""
    out = dict(conf)
    out.setdefault("logger", logging.getLogger(logger_name))
    out.setdefault("log_level", level)
    return out


def probe(conf: Mapping[str, Any], timeout_s: float) -> KafkaStatus:
    """Read the cluster's metadata once; never raises."""
    from confluent_kafka import KafkaError, KafkaException
    from confluent_kafka.admin import AdminClient

    try:
        admin = AdminClient(quiet_librdkafka(conf))
        md = admin.list_topics(timeout=timeout_s)
    except KafkaException as exc:
        err = exc.args[0] if exc.args else None
        why = f"{err.name()}: {err.str()}" if isinstance(err, KafkaError) else str(exc)
        return KafkaStatus(False, error=scrub(why, conf))
    except Exception as exc:  # a bad client setting (producer.kafka.*) is also "unreachable"
        return KafkaStatus(False, error=scrub(f"{type(exc).__name__}: {exc}", conf))
    return KafkaStatus(True, brokers=len(md.brokers))


class KafkaWatch:
    """Checks the sidecar's Kafka at start-up and every ``interval_s`` in a daemon thread."""

    def __init__(self, conf: Mapping[str, Any], *, interval_s: float = 30.0,
                 timeout_s: float = 5.0) -> None:
        self._conf = dict(conf)
        self.servers = str(conf.get("bootstrap.servers", ""))
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.status: KafkaStatus | None = None   # None until the first check answered
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.changed = threading.Event()

    @property
    def reachable(self) -> bool:
        """False only once a check failed (unknown counts as reachable)."""
        st = self.status
        return st is None or st.reachable

    def check(self) -> KafkaStatus:
        st = probe(self._conf, self.timeout_s)
        before, self.status = self.status, st
        if before is None or before.reachable != st.reachable:
            if st.reachable:
                log.info("Kafka at %s reachable: %d broker(s)", self.servers, st.brokers)
            else:
                log.warning("Kafka at %s unreachable (%s); reports are still accepted into the "
                            "spool, health service %r is NOT_SERVING until it answers",
                            self.servers, st.error, KAFKA_HEALTH_SERVICE)
            self.changed.set()
        return st

    def start(self) -> KafkaWatch:
        self._thread = threading.Thread(target=self._run, name="spillway-kafka-check",
                                        daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.check()
            except Exception:
                log.exception("Kafka check failed")
            self._stop.wait(self.interval_s)

    def stop(self) -> None:
        self._stop.set()
