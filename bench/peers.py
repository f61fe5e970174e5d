"""The peers (issue 14): what a user would write instead of spillway, run beside it on the same
records, broker and sink.

(a) Hand-rolled dead-lettering: each Spark task catches its failures and produces them to Kafka
    itself with confluent-kafka — no sidecar, no spool, no policy. One `Producer` per task
    (built at the first failure), the original key and value with a few error headers, `poll(0)`
    after each produce and poll-and-retry on `BufferError`, flush at the end of the partition;
    a record not acknowledged fails the task (Spark retries it), so an action that returns has
    every dead letter acknowledged by Kafka, like spillway's flush barrier.
(b) Spark's own `from_json` in PERMISSIVE mode with a corrupt-record column: the rows whose
    corrupt-record field is set are dead-lettered by (a)'s code, the others go on to the sink.

Spark's Python workers get these functions by value (cloudpickle), as with `bench.workloads`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

CORRUPT_COLUMN = "_corrupt_record"
HEADER_NAMES = ("error.class", "error.message", "source.topic", "source.partition",
                "source.offset")


def producer_conf(bootstrap: str, *, linger_ms: int, batch_size: int) -> dict[str, Any]:
    """What a careful user sets for a DLQ producer: idempotent, acks=all, some linger."""
    return {"bootstrap.servers": bootstrap, "enable.idempotence": True, "acks": "all",
            "linger.ms": linger_ms, "batch.size": batch_size}


def error_headers(exc_class: str, message: str, topic: Any = None, partition: Any = None,
                  offset: Any = None) -> list[tuple[str, bytes]]:
    values = (exc_class, message[:1000], topic, partition, offset)
    return [(name, str(v).encode()) for name, v in zip(HEADER_NAMES, values) if v is not None]


class DeadLetters:
    """One task's DLQ producer, built at the first failure (a clean partition costs nothing)."""

    def __init__(self, conf: dict[str, Any], topic: str) -> None:
        self.conf = conf
        self.topic = topic
        self.sent = 0
        self.errors: list[str] = []
        self._producer = None

    def _on_delivery(self, err, _msg) -> None:
        if err is not None:
            self.errors.append(str(err))

    def send(self, key: bytes | None, value: bytes | None,
             headers: list[tuple[str, bytes]]) -> None:
        if self._producer is None:
            from confluent_kafka import Producer

            self._producer = Producer(self.conf)
        while True:
            try:
                self._producer.produce(self.topic, key=key, value=value, headers=headers,
                                       on_delivery=self._on_delivery)
                break
            except BufferError:
                self._producer.poll(0.05)
        self._producer.poll(0)
        self.sent += 1

    def close(self, timeout_s: float = 120.0) -> None:
        """Flush; raise unless every dead letter was acknowledged (the task then fails)."""
        if self._producer is None:
            return
        left = self._producer.flush(timeout_s)
        if left or self.errors:
            raise RuntimeError(f"dead-lettering: {left} of {self.sent} records unacknowledged, "
                               f"{len(self.errors)} failed (first: {self.errors[:1]})")


def _task_partition() -> int:
    from pyspark import TaskContext

    tc = TaskContext.get()
    return tc.partitionId() if tc is not None else -1


def values_partition(conf: dict[str, Any], topic: str, fn: Callable[[Any], Any],
                     values: Iterable[bytes]) -> Iterator[Any]:
    """(a) over an RDD of raw values (`rdd.mapPartitions`): ``fn(value)`` per value; a failed
    value is dead-lettered (no key; the task's partition and the value's position as its
    coordinates) and left out of the output."""
    dlq = DeadLetters(conf, topic)
    partition = _task_partition()
    for pos, value in enumerate(values):
        try:
            out = fn(value)
        except Exception as exc:  # noqa: BLE001 - every failure is dead-lettered
            dlq.send(None, value, error_headers(f"{type(exc).__module__}.{type(exc).__name__}",
                                                str(exc), None, partition, pos))
            continue
        yield out
    dlq.close()


def kafka_batches(conf: dict[str, Any], topic: str, fn: Callable[[Any], Any],
                  out_names: list[str], batches: Iterable[Any]) -> Iterator[Any]:
    """(a) over a Kafka-shaped DataFrame (`df.mapInArrow`): ``fn(value bytes)`` returns a tuple
    in ``out_names`` order; a failed row is dead-lettered with its key, value and Kafka
    coordinates and left out of the output."""
    import pyarrow as pa

    dlq = DeadLetters(conf, topic)
    for batch in batches:
        cols = {c: batch.column(c).to_pylist()
                for c in ("key", "value", "topic", "partition", "offset")}
        out: list[tuple] = []
        for i, value in enumerate(cols["value"]):
            try:
                out.append(fn(value))
            except Exception as exc:  # noqa: BLE001 - every failure is dead-lettered
                dlq.send(cols["key"][i], value, error_headers(
                    f"{type(exc).__module__}.{type(exc).__name__}", str(exc), cols["topic"][i],
                    cols["partition"][i], cols["offset"][i]))
        columns = list(zip(*out)) if out else [[] for _ in out_names]
        yield pa.RecordBatch.from_pydict(dict(zip(out_names, (list(c) for c in columns))))
    dlq.close()


def corrupt_rows(conf: dict[str, Any], topic: str, rows: Iterable[Any]) -> None:
    """(b)'s dead-lettering, `foreachPartition` over the rows `from_json` marked corrupt
    (key, value, topic, partition, offset): (a)'s producer code."""
    dlq = DeadLetters(conf, topic)
    for row in rows:
        dlq.send(row["key"], row["value"], error_headers(
            "from_json", "malformed record (from_json PERMISSIVE)", row["topic"],
            row["partition"], row["offset"]))
    dlq.close()


def json_schema_with_corrupt(ddl: str) -> str:
    """The value schema of (b): the user's schema plus the corrupt-record string field."""
    return f"{ddl}, {CORRUPT_COLUMN} string"


def from_json_permissive(df, ddl: str, column: str = "parsed_value"):
    """(b)'s parse: the Kafka DataFrame with ``column`` = from_json(value) in PERMISSIVE mode;
    the struct's ``_corrupt_record`` holds the raw text of a row that did not parse."""
    from pyspark.sql.functions import col, from_json

    return df.withColumn(column, from_json(
        col("value").cast("string"), json_schema_with_corrupt(ddl),
        {"mode": "PERMISSIVE", "columnNameOfCorruptRecord": CORRUPT_COLUMN}))
