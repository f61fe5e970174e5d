"""The DLQ producer with no Python work per record: `_rdkafka.c` over librdkafka, standing where
a ``confluent_kafka.Producer`` would in `producer.KafkaDlqProducer` (`NativeHandle`).

confluent-kafka's ``produce()`` converts every header of every DLQ record and calls back into
Python for every delivery report; here a batch of records is one call, delivery reports are
stored by C callbacks and taken once per poll as lists, and so are librdkafka's errors (given
to the error callback as ``KafkaError``, a fatal one with its real code) and log lines (to the
same logger confluent-kafka would use). The semantics the drain relies on are the producer's:
an idempotent librdkafka producer with the same settings, a delivery report per record.

Used when the extension is built and librdkafka is found (the one confluent-kafka ships, else
the system's ``librdkafka.so.1``) and ``producer.native`` is on; otherwise the sidecar produces
through confluent-kafka, with the same results (`producer.py`).
"""

from __future__ import annotations

import glob
import logging
import os
import threading
from collections.abc import Callable, Mapping
from typing import Any

from confluent_kafka import KafkaError, KafkaException

log = logging.getLogger(__name__)

try:
    from . import _rdkafka
except ImportError:   # built without a C compiler: confluent-kafka's produce() is used
    _rdkafka = None

_lock = threading.Lock()
_state: dict[str, Any] = {}   # "version" once loaded, or "error": why it cannot be


def _library() -> str:
    """confluent-kafka's own librdkafka (its wheel's ``confluent_kafka.libs``), else the
    system's: the producer then runs the librdkafka version confluent-kafka was tested with."""
    import confluent_kafka

    pkg = os.path.dirname(confluent_kafka.__file__)
    found = sorted(glob.glob(os.path.join(pkg, os.pardir, "confluent_kafka.libs",
                                          "librdkafka*.so*")))
    return os.path.realpath(found[0]) if found else "librdkafka.so.1"


def unavailable() -> str | None:
    """Why the native producer cannot be used here, or None when it can."""
    with _lock:
        if not _state:
            if _rdkafka is None:
                _state["error"] = ("the C extension spillway.sidecar.dlq._rdkafka was not "
                                   "built (no C compiler when the sidecar was installed)")
            else:
                try:
                    _state["version"] = _rdkafka.load(_library())
                except OSError as exc:
                    _state["error"] = str(exc)
        return _state.get("error")


def _setting(value: Any) -> str | None:
    """A setting as librdkafka's text, None when it is not one (a Python callback)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (str, int, float)):
        return str(value)
    return None


def settings(conf: Mapping[str, Any]) -> dict[str, str] | None:
    """``conf`` as librdkafka settings, None when one of them only confluent-kafka can take."""
    out = {}
    for name, value in conf.items():
        text = _setting(value)
        if text is None:
            return None
        out[name] = text
    return out


# librdkafka's syslog levels -> logging's
_LEVELS = (logging.CRITICAL, logging.CRITICAL, logging.CRITICAL, logging.ERROR,
           logging.WARNING, logging.INFO, logging.INFO, logging.DEBUG)


class NativeHandle:
    """A librdkafka producer whose delivery reports go into ``deliveries`` (a
    `producer._Deliveries`: acked tokens, their partitions, failed (token, KafkaError)),
    errors to ``on_error`` and log lines to ``logger``, each time it is polled or flushed."""

    def __init__(self, conf: Mapping[str, str], deliveries: Any,
                 on_error: Callable[[KafkaError], None], logger: logging.Logger) -> None:
        try:
            self._p = _rdkafka.Producer(dict(conf))
        except ValueError as exc:
            raise KafkaException(KafkaError(KafkaError._INVALID_ARG, str(exc))) from None
        self._deliveries = deliveries
        self._on_error = on_error
        self._logger = logger

    def produce_records(self, records: list, tokens: list[int],
                        start: int) -> tuple[int, int, str]:
        """Hand ``records[start:]`` to librdkafka; (how many it took, the error code of the
        one it refused or 0, and its text). ``_QUEUE_FULL``: poll, then call again."""
        return self._p.produce(records, tokens, start)

    def _serve(self) -> None:
        acked, partitions, failed, errors, lines, dropped, lost = self._p.take()
        d = self._deliveries
        if acked:
            d.acked += acked
            d.partitions += partitions
        if failed:
            d.failed += [(token, KafkaError(code)) for token, code in failed]
        for level, _, line in lines:
            self._logger.log(_LEVELS[min(max(level, 0), 7)], "%s", line)
        for _, code, reason in errors:
            if code == KafkaError._FATAL:   # the real code and reason, as confluent-kafka does
                code, reason = self._p.fatal()
                self._on_error(KafkaError(code or KafkaError._FATAL, reason, fatal=True))
            else:
                self._on_error(KafkaError(code, reason))
        if dropped:
            log.warning("DLQ producer: %d librdkafka log lines or errors were not kept (more "
                        "than 256 between two polls)", dropped)
        if lost:   # a delivery report could not be stored: the producer's records are redone
            self._on_error(KafkaError(KafkaError._FATAL, "delivery reports lost (out of memory)",
                                      fatal=True))

    def poll(self, timeout: float) -> int:
        n = self._p.poll(timeout)
        self._serve()
        return n

    def flush(self, timeout: float) -> int:
        left = self._p.flush(timeout)
        self._serve()
        return left

    def __len__(self) -> int:
        return self._p.outstanding()

    def purge(self, in_queue: bool = True, in_flight: bool = True,
              blocking: bool = True) -> None:
        self._p.purge((1 if in_queue else 0) | (2 if in_flight else 0) | (0 if blocking else 4))

    def close(self) -> None:
        self._p.close()
