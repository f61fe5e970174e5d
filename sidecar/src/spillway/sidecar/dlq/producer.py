"""The Kafka adapter of the DLQ pipeline: turns DLQ records into produce calls, and delivery
reports into typed outcomes the drain acts on.

Producer discipline: one idempotent producer (``enable.idempotence=true``, ``acks=all``),
constructed lazily on the first produce; the delivery report is the only proof of success;
``poll(0)`` after every produce; on BufferError (librdkafka's queue is full) poll and retry, for a
bounded time; purge, then close, so that closing never waits on a broker that is gone.

Every failure is classified once, here, by a table (KIP-1050 categories over librdkafka's
``retriable()``, ``fatal()``, ``txn_requires_abort()`` and error codes) into what the drain does:

- RETRY: produce the record again after a backoff. Retriable errors (librdkafka has already
  retried internally until ``message.timeout.ms``), and topic- or cluster-level problems that an
  operator can fix (authorization, a missing topic): the record is kept, counted and logged.
- REBUILD: the producer is unusable (a fatal error: fenced, out-of-order sequence; or one that
  requires an abort): close it, build a new one, and produce the record again.
- REJECT: Kafka can never accept this record (too large, invalid): never produced again.

"Possibly persisted": librdkafka does not expose a message's persistence status to Python, so
errors raised after a request may have reached the broker (timeouts, transport errors, purges of
in-flight requests, fatal errors) are marked ``possibly_persisted``: producing the record again
may write it twice. Duplicates are possible, losses are not (KIP-1191 says the same).
"""

from __future__ import annotations

import enum
import functools
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from confluent_kafka import KafkaError, KafkaException, Producer
from spillway.client import extensions
from spillway.client.kafka_auth import scrub

from ..core.model import DlqRecord
from ..errors import ConfigError, DlqError

log = logging.getLogger(__name__)

# The produce calls and delivery reports in C (`_produce.c`), on confluent-kafka's own producer;
# optional: without it (not built, or librdkafka not found) produce() does the same per record.
try:
    from . import _produce as _native
    _native.bind(Producer)
except ImportError as exc:  # pragma: no cover - the extension is built where a C compiler is
    _native = None
    NATIVE_MISSING = str(exc)
else:
    NATIVE_MISSING = ""
_QUEUE_FULL = KafkaError._QUEUE_FULL
_PLUGINS = "plugin.library.paths"

PASSTHROUGH = "producer.kafka."
# produce() takes its arguments by position here: (topic, value, key, partition, callback,
# on_delivery, timestamp, headers), as confluent-kafka's C signature lists them; its keyword
# parsing cost about 0.6 µs a record more. The partitioner picks the partition; timestamp 0 is
# "now"; the delivery callback goes in `callback` (`on_delivery` is its alias, left None).
_ANY_PARTITION = -1
DEFAULT_MESSAGE_TIMEOUT_MS = 30_000

# Settings the pipeline's guarantees rest on: a passthrough may not change them.
_LOCKED = {
    "enable.idempotence": "the DLQ producer is always idempotent",
    "acks": "the DLQ producer always waits for all in-sync replicas (acks=all)",
    "request.required.acks": "the DLQ producer always waits for all in-sync replicas (acks=all)",
    "transactional.id": "the DLQ producer is not transactional",
    "allow.auto.create.topics": "DLQ topics are only created by "
                                "errors.deadletterqueue.auto.create.topics.enable",
    "bootstrap.servers": "set the bootstrap.servers property instead",
    "on_delivery": "the pipeline owns the delivery callback",
    "error_cb": "the pipeline owns the error callback",
    "delivery.report.only.error": "the pipeline needs every record's delivery report",
    "spillway.acks": "the pipeline names its delivery reports' sink itself",
}


class Outcome(enum.Enum):
    RETRY = "retry"
    REBUILD = "rebuild"
    REJECT = "reject"


E = KafkaError
# The producer instance is unusable (idempotence state lost): build a new one.
REBUILD_CODES = frozenset({E._FATAL, E.OUT_OF_ORDER_SEQUENCE_NUMBER, E.PRODUCER_FENCED})
# Record-specific: the broker (or the client's own check) refuses this very record, forever.
REJECTED_CODES = frozenset({
    E.MSG_SIZE_TOO_LARGE, E.RECORD_LIST_TOO_LARGE, E.INVALID_RECORD, E.INVALID_TIMESTAMP,
    E.INVALID_MSG_SIZE, E._INVALID_ARG, E._BAD_MSG,
})
REFRESH_RETRIABLE_CODES = frozenset({
    E.UNKNOWN_TOPIC_OR_PART, E._UNKNOWN_TOPIC, E._UNKNOWN_PARTITION, E.NOT_LEADER_FOR_PARTITION,
    E.LEADER_NOT_AVAILABLE,
})
# Local outcomes librdkafka does not flag retriable() but that a later attempt can fix.
RETRIABLE_CODES = frozenset({
    E._MSG_TIMED_OUT, E._TIMED_OUT, E._TRANSPORT, E._ALL_BROKERS_DOWN, E.REQUEST_TIMED_OUT,
    E.NETWORK_EXCEPTION, E._PURGE_QUEUE, E._PURGE_INFLIGHT, E._QUEUE_FULL, E._DESTROY,
    E.NOT_ENOUGH_REPLICAS, E.NOT_ENOUGH_REPLICAS_AFTER_APPEND,
})
POSSIBLY_PERSISTED_CODES = frozenset({
    E._MSG_TIMED_OUT, E._TIMED_OUT, E._TRANSPORT, E.REQUEST_TIMED_OUT, E.NETWORK_EXCEPTION,
    E._PURGE_INFLIGHT, E._FATAL, E.NOT_ENOUGH_REPLICAS_AFTER_APPEND,
})


@dataclass(frozen=True, slots=True)
class DeliveryFailure:
    code: int
    name: str
    message: str
    outcome: Outcome
    category: str  # KIP-1050: retriable, refresh-retriable, abortable, application-recoverable,
    #                invalid-configuration
    possibly_persisted: bool

    def __str__(self) -> str:
        return f"{self.name} ({self.category}): {self.message}"


def classify(err: KafkaError) -> DeliveryFailure:
    """The table: what a librdkafka error means for a DLQ record."""
    code = err.code()
    if err.fatal() or code in REBUILD_CODES:
        outcome, category = Outcome.REBUILD, "application-recoverable"
    elif err.txn_requires_abort():
        outcome, category = Outcome.REBUILD, "abortable"
    elif code in REJECTED_CODES:
        outcome, category = Outcome.REJECT, "invalid-configuration"
    elif code in REFRESH_RETRIABLE_CODES:
        outcome, category = Outcome.RETRY, "refresh-retriable"
    elif err.retriable() or code in RETRIABLE_CODES:
        outcome, category = Outcome.RETRY, "retriable"
    else:  # authorization, policy, unknown: kept and retried until an operator fixes it
        outcome, category = Outcome.RETRY, "invalid-configuration"
    return DeliveryFailure(code=code, name=err.name(), message=err.str(), outcome=outcome,
                           category=category,
                           possibly_persisted=err.fatal() or code in POSSIBLY_PERSISTED_CODES)


class ProduceRefused(DlqError):
    """produce() refused a record synchronously (e.g. larger than message.max.bytes)."""

    def __init__(self, failure: DeliveryFailure) -> None:
        self.failure = failure
        super().__init__(str(failure))


# What librdkafka puts in one produce request around its records (the request's and the record
# batch's headers, the topic's name): kept out of `request_bounds`.
_REQUEST_FRAMING = 4096
# librdkafka's upper bound of a record's size in a request (rd_kafka_msg_wire_size: a v2
# record's varints at their widest) and of a header's (its two length varints), as _produce.c
_WIRE_OVERHEAD, _HEADER_OVERHEAD = 36, 10


def request_bounds(conf: Mapping[str, Any]) -> tuple[int, int]:
    """The bytes (librdkafka's bound of its records' sizes) and records one produce request
    holds: ``batch.size`` and ``message.max.bytes`` bound the first, ``batch.num.messages``
    the second (librdkafka's defaults where not set)."""
    def setting(name: str, default: int) -> int:
        try:
            return int(conf.get(name, default))
        except (TypeError, ValueError):
            return default
    size = min(setting("batch.size", 1_000_000), setting("message.max.bytes", 1_000_000))
    return max(1, size - _REQUEST_FRAMING), max(1, setting("batch.num.messages", 10_000))


def linger_of(conf: Mapping[str, Any]) -> float:
    """The producer's ``linger.ms`` (or its alias ``queue.buffering.max.ms``, the last set)."""
    value: Any = 5   # librdkafka's default
    for name, v in conf.items():
        if name in ("linger.ms", "queue.buffering.max.ms"):
            value = v
    try:
        return max(0.0, float(value))
    except (TypeError, ValueError):
        return 5.0


def _length(b: bytes | str | None) -> int:
    return 0 if b is None else len(b) if isinstance(b, bytes) else len(b.encode())


def wire_size(rec: DlqRecord) -> int:
    """librdkafka's upper bound of a record's size in a produce request."""
    n = _WIRE_OVERHEAD + _length(rec.key) + _length(rec.value)
    for name, value in rec.headers or ():
        n += _HEADER_OVERHEAD + _length(name) + _length(value)
    return n


def producer_config(bootstrap_servers: str, *, linger_ms: int, batch_size: int,
                    overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """librdkafka settings of the DLQ producer; `overrides` are ``producer.kafka.*`` values
    (with or without that prefix)."""
    if not bootstrap_servers:
        raise ConfigError("bootstrap.servers", "the DLQ producer needs Kafka bootstrap servers")
    conf: dict[str, Any] = {
        "bootstrap.servers": bootstrap_servers,
        "client.id": "spillway-dlq",
        "enable.idempotence": True,
        "acks": "all",
        "linger.ms": linger_ms,
        "batch.size": batch_size,
        "message.timeout.ms": DEFAULT_MESSAGE_TIMEOUT_MS,
        "allow.auto.create.topics": False,
    }
    for key, value in (overrides or {}).items():
        name = key[len(PASSTHROUGH):] if key.startswith(PASSTHROUGH) else key
        if name in _LOCKED:
            raise ConfigError(PASSTHROUGH + name, f"cannot be overridden: {_LOCKED[name]}")
        conf[name] = value
    return conf


class _Deliveries:
    """The delivery reports of one producer generation, collected inside poll()/flush(): one
    Python call per record (``on_delivery`` is ``partial(deliveries.report, token)``), the rest
    is done per batch by `KafkaDlqProducer.take_reports`. A rebuilt producer gets a new one, so
    that late reports of the old producer (purged, or arriving after the rebuild) are dropped."""

    __slots__ = ("acked", "partitions", "failed")

    def __init__(self) -> None:
        self.acked: list[int] = []
        self.partitions: list[int] = []
        self.failed: list[tuple[int, KafkaError]] = []

    def report(self, token: int, err: KafkaError | None, msg: Any) -> None:
        if err is None:
            self.acked.append(token)
            self.partitions.append(msg.partition() if msg is not None else -1)
        else:
            self.failed.append((token, err))

    def report_unplaced(self, token: int, err: KafkaError | None, msg: Any) -> None:
        """`report` without asking the message its partition (-1): only the DLQ batch spans
        read it, and a record produced while they are not exported needs none."""
        if err is None:
            self.acked.append(token)
            self.partitions.append(-1)
        else:
            self.failed.append((token, err))


class KafkaDlqProducer:
    """One idempotent producer, built lazily and rebuilt after a fatal error.

    Delivery reports are collected inside `poll()`/`flush()` (in the caller's thread) and taken
    with `take_reports()`, once per produced record of the current producer generation. Reports
    of a producer that was rebuilt are dropped: the caller re-produces what that producer held.
    """

    def __init__(self, config: Mapping[str, Any], *,
                 factory: Callable[[dict[str, Any]], Any] | None = None) -> None:
        self._config = dict(config)
        self.request_bytes, self.request_records = request_bounds(self._config)
        # confluent-kafka's Producer, or the factory given (tests' fakes)
        self._factory = factory or Producer
        self._producer: Any = None
        self._deliveries = _Deliveries()
        # the C produce loop and its delivery reports' sink (one per producer generation), on
        # confluent-kafka's Producer only (SPILLWAY_NO_EXTENSIONS=produce: produce() instead)
        self.native = factory is None and _native is not None and extensions.enabled("produce")
        self._acks: Any = None
        self._lock = threading.Lock()
        self.fatal_error: DeliveryFailure | None = None
        self.last_error: DeliveryFailure | None = None
        self.builds = 0
        self._last_log = 0.0

    @property
    def config(self) -> dict[str, Any]:
        return dict(self._config)

    def _get(self) -> Any:
        if self._producer is None:
            logger = logging.getLogger("spillway.dlq.librdkafka")
            try:
                conf = dict(self._config)
                conf["error_cb"] = self._on_error
                conf.setdefault("logger", logger)
                self._producer = self._build(conf)
            except KafkaException as exc:
                why = exc.args[0].str() if exc.args else str(exc)
                raise ConfigError("producer.kafka", f"invalid DLQ producer settings: "
                                  f"{scrub(why, self._config)}") from exc
            self.builds += 1
            self.fatal_error = None
        return self._producer

    def _build(self, conf: dict[str, Any]) -> Any:
        if not self.native:
            return self._factory(conf)
        # this module is a librdkafka plugin too: its interceptor notes each record's delivery
        # report in the sink the conf names (set after the plugin is loaded: dict order)
        try:
            acks = _native.Acks()
        except RuntimeError as exc:   # 256 sinks alive in this process: its registry's bound
            return self._without_native(conf, str(exc))
        plugins = conf.get(_PLUGINS)
        with_plugin = dict(conf)
        with_plugin[_PLUGINS] = f"{plugins};{_native.__file__}" if plugins else _native.__file__
        with_plugin["spillway.acks"] = str(acks.slot)
        try:
            producer = self._factory(with_plugin)
        except KafkaException as exc:
            return self._without_native(conf, exc.args[0].str() if exc.args else str(exc))
        self._acks = acks
        return producer

    def _without_native(self, conf: dict[str, Any], why: str) -> Any:
        """The producer built without the C loop (the settings' own error, if any, is raised
        from here), and a warning saying why."""
        producer = self._factory(conf)
        self.native = False
        log.warning("the DLQ producer's C produce loop could not be loaded (%s): producing "
                    "through confluent-kafka's produce()", scrub(why, self._config))
        return producer

    def _on_error(self, err: KafkaError) -> None:
        failure = classify(err)
        self.last_error = failure
        if err.fatal():
            self.fatal_error = failure
            log.error("DLQ producer fatal error, it will be rebuilt: %s", failure)
        elif time.monotonic() - self._last_log > 10.0:
            self._last_log = time.monotonic()
            log.warning("DLQ producer: %s", failure)

    def take_reports(self) -> tuple[list[int], list[int], list[tuple[int, DeliveryFailure]]]:
        """The reports collected since the last call: acknowledged tokens, their partitions
        (-1 when unknown), and the failed tokens with their classified failure."""
        if self._acks is not None:
            self._collect()
        d = self._deliveries
        if not d.acked and not d.failed:
            return [], [], []
        acked, partitions, failed = d.acked, d.partitions, d.failed
        d.acked, d.partitions, d.failed = [], [], []
        out: list[tuple[int, DeliveryFailure]] = []
        for token, err in failed:
            failure = classify(err)
            self.last_error = failure
            out.append((token, failure))
        return acked, partitions, out

    def _collect(self) -> None:
        """Move the C sink's reports into this generation's `_Deliveries`."""
        try:
            acked, partitions, failed = self._acks.take()
        except MemoryError:   # reports lost: the records in flight are produced again
            self.fatal_error = self.fatal_error or DeliveryFailure(
                KafkaError._FATAL, "_FATAL", "delivery reports lost (out of memory)",
                Outcome.REBUILD, "application-recoverable", True)
            return
        d = self._deliveries
        if acked:
            d.acked += acked
            d.partitions += partitions
        for token, code in failed:
            d.failed.append((token, KafkaError(code)))

    def _refused(self, exc: KafkaException) -> ProduceRefused:
        err = exc.args[0] if exc.args and isinstance(exc.args[0], KafkaError) else None
        if err is None:
            raise DlqError(f"DLQ produce failed: {exc}") from exc
        return self._refused_by(err)

    def _refused_by(self, err: KafkaError) -> ProduceRefused:
        failure = classify(err)
        self.last_error = failure
        if failure.outcome is Outcome.REBUILD:
            self.fatal_error = failure
        return ProduceRefused(failure)

    def produce(self, rec: DlqRecord, token: int, *, max_wait_s: float = 5.0,
                poll: bool = True) -> None:
        """Hand `rec` to librdkafka. Raises ProduceRefused when it refuses the record, and
        BufferError when its queue stays full for `max_wait_s` (the caller retries later).
        ``poll=False``: the caller polls itself once after a batch of produce calls."""
        p = self._get()
        if self._acks is not None:
            n, refused = self._produce_native(p, [token], [rec], 0, max_wait_s, 0)
            if refused is not None:
                raise refused
            if not n:
                raise BufferError("librdkafka's queue stayed full")
            if poll:
                self.poll(0)
            return
        report = functools.partial(self._deliveries.report, token)
        headers = list(rec.headers) if rec.headers else None
        deadline = 0.0
        while True:
            try:
                p.produce(rec.topic, rec.value, rec.key, _ANY_PARTITION, report, None, 0, headers)
                break
            except BufferError:
                if not deadline:
                    deadline = time.monotonic() + max_wait_s
                elif time.monotonic() >= deadline:
                    raise
                self.poll(0.05)
            except KafkaException as exc:
                raise self._refused(exc) from exc
        if poll:
            self.poll(0)

    def produce_many(self, tokens: Sequence[int], records: Sequence[DlqRecord], *,
                     start: int = 0, max_wait_s: float = 0.5, partitions: bool = True,
                     max_bytes: int = 0) -> tuple[int, ProduceRefused | None]:
        """Hand ``records[start:]`` (each reported under its ``tokens[i]``) to librdkafka in
        order, without polling in between; returns the index of the first it did not take
        (len(records): all taken), and, when it refused that one, why (the caller files it as
        failed and goes on after it). Not all taken and no refusal: the next would have taken
        those handed over past ``max_bytes`` (by `wire_size` in C; through produce(), by the
        first one's; the first is always taken; 0: no bound), or librdkafka's queue stayed
        full for `max_wait_s` (the caller keeps the rest for later). ``partitions``: whether
        their delivery reports note the partition (-1 else)."""
        p = self._get()
        if self._acks is not None:
            return self._produce_native(p, tokens, records, start, max_wait_s, max_bytes)
        produce = p.produce
        d = self._deliveries
        report = d.report if partitions else d.report_unplaced
        partial, any_partition = functools.partial, _ANY_PARTITION
        n, total, deadline = start, len(records), 0.0
        if max_bytes and total > start:
            # by the first record's size (`wire_size` of each would cost more than its produce
            # call): the records handed over together are alike (a report's, or a backlog's)
            total = min(total, start + max(1, max_bytes // wire_size(records[start])))
        while n < total:
            rec = records[n]
            headers = rec.headers
            try:
                produce(rec.topic, rec.value, rec.key, any_partition, partial(report, tokens[n]),
                        None, 0, list(headers) if headers else None)
            except BufferError:
                now = time.monotonic()
                if not deadline:
                    deadline = now + max_wait_s
                elif now >= deadline:
                    return n, None
                self.poll(0.05)
                continue
            except KafkaException as exc:
                return n, self._refused(exc)
            n += 1
        return n, None

    def _produce_native(self, p: Any, tokens: Sequence[int], records: Sequence[DlqRecord],
                        start: int, max_wait_s: float, max_bytes: int
                        ) -> tuple[int, ProduceRefused | None]:
        """`produce_many` in one C loop (its delivery reports come through the sink)."""
        tokens = tokens if type(tokens) is list else list(tokens)
        records = records if type(records) is list else list(records)
        n, total, deadline = start, len(records), 0.0
        while n < total:
            began = n
            n, code = _native.produce(p, tokens, records, n, max_bytes)
            if not code:
                break
            if code != _QUEUE_FULL:
                return n, self._refused_by(KafkaError(code))
            if max_bytes and n > began:   # a bounded hand-over: the rest goes with the next
                break
            now = time.monotonic()
            if not deadline:
                deadline = now + max_wait_s
            elif now >= deadline:
                break
            self.poll(0.05)
        return n, None

    def _raised(self, exc: KafkaException) -> None:
        """confluent-kafka raises a fatal error out of poll()/flush(): note it for a rebuild."""
        err = exc.args[0] if exc.args and isinstance(exc.args[0], KafkaError) else None
        if err is None:
            raise DlqError(f"DLQ producer failed: {exc}") from exc
        failure = classify(err)
        self.last_error = failure
        if failure.outcome is Outcome.REBUILD:
            self.fatal_error = failure
            log.error("DLQ producer fatal error, it will be rebuilt: %s", failure)
        else:
            log.warning("DLQ producer: %s", failure)

    def poll(self, timeout: float) -> int:
        if self._producer is None:
            return 0
        try:
            return self._producer.poll(timeout)
        except KafkaException as exc:
            self._raised(exc)
            return 0

    def outstanding(self) -> int:
        """Records librdkafka still holds (queued or in flight)."""
        return len(self._producer) if self._producer is not None else 0

    def flush(self, timeout: float) -> int:
        """Serve delivery reports until nothing is outstanding or `timeout`; returns what is
        left."""
        if self._producer is None:
            return 0
        try:
            return self._producer.flush(timeout)
        except KafkaException as exc:
            self._raised(exc)
            return len(self._producer)

    def _discard(self) -> None:
        if self._acks is not None:
            self._collect()
            self._acks = None   # the old generation's later reports go to its sink alone
        p, self._producer = self._producer, None
        # reports served until now are kept (close() flushes first); what the old producer
        # reports from here on (its purged records, late reports) goes to lists nobody reads
        old, self._deliveries = self._deliveries, _Deliveries()
        kept = self._deliveries
        kept.acked, kept.partitions, kept.failed = old.acked, old.partitions, old.failed
        old.acked, old.partitions, old.failed = [], [], []
        if p is None:
            return
        try:
            p.purge(in_queue=True, in_flight=True, blocking=True)
            p.poll(0)
            if len(p) == 0:  # close() flushes: only call it when that cannot wait on Kafka
                p.close()
        except (KafkaException, RuntimeError) as exc:
            log.warning("closing the old DLQ producer: %s", exc)

    def rebuild(self) -> None:
        """Drop the current producer (what it held must be produced again) and build lazily."""
        self._discard()
        self.fatal_error = None

    def close(self, timeout: float) -> int:
        """Flush for up to `timeout`, then drop whatever is left; returns how many were left."""
        left = self.flush(max(0.0, timeout)) if self.fatal_error is None else self.outstanding()
        self._discard()
        return left
