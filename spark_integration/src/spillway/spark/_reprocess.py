"""`Job.reprocess`: run a fixed function over dead-lettered records, from a `read_dlq` frame.

Each DLQ record becomes the Kafka-shaped row it was (Spark's Kafka source schema,
`KAFKA_SOURCE_SCHEMA`): its original key, value and headers (without the error-context headers
and spillway's own), at its source coordinates when it has them (else at its place in the DLQ
topic), plus two headers that carry its history:

- ``spillway.redrive.count``: how many times it was sent round (added, or incremented), the
  loop protection `spillway dlq redrive` uses: records already at ``max_redrives`` are left out;
- ``spillway.redrive.of``: the record id it had when first dead-lettered.

The rows then go through `Job.map_partitions` with the job's policy: what now succeeds is the
output; what still fails is dead-lettered again (its DLQ record copies those headers, so the
next round sees the count) under the record id ``<first id>#redrive<count>``, which is stable
across Spark's task retries (one dead letter per record id) and distinct per round. Records
without a copy of the original (``copy.record.enable=false``) are left out.
"""

from __future__ import annotations

from typing import Any

REDRIVE_COUNT = "spillway.redrive.count"
REDRIVE_OF = "spillway.redrive.of"
_STRIPPED = ("__connect.errors.", "__dlq.errors.", "spillway.")


def redrive_frame(dlq_df: Any, max_redrives: int) -> Any:
    """The Kafka-shaped rows to reprocess (see the module docstring)."""
    from pyspark.sql import functions as F

    missing = {"key", "value", "headers", "topic", "partition", "offset", "timestamp",
               "record_id", "redrive_count", "record_copied", "source_topic",
               "source_partition", "source_offset"} - set(dlq_df.columns)
    if missing:
        raise ValueError(f"dlq_df: expected a read_dlq DataFrame; missing columns "
                         f"{sorted(missing)}")
    count = F.coalesce(F.col("redrive_count"), F.lit(0))
    first_id = F.coalesce(
        F.get(F.filter("headers", lambda h: h["key"] == REDRIVE_OF), 0)["value"]
        .cast("string"),
        F.col("record_id"), F.concat_ws("/", "topic", "partition", "offset"))
    kept = F.filter("headers", lambda h: ~(h["key"].startswith(_STRIPPED[0])
                                           | h["key"].startswith(_STRIPPED[1])
                                           | h["key"].startswith(_STRIPPED[2])))
    history = F.array(
        F.struct(F.lit(REDRIVE_COUNT).alias("key"),
                 (count + 1).cast("string").cast("binary").alias("value")),
        F.struct(F.lit(REDRIVE_OF).alias("key"), first_id.cast("binary").alias("value")))
    has_source = F.col("source_topic").isNotNull() & F.col("source_partition").isNotNull() \
        & F.col("source_offset").isNotNull()
    return (dlq_df
            .where((F.col("record_copied").isNull() | F.col("record_copied"))
                   & (count < F.lit(max_redrives)))
            .select(F.col("key"), F.col("value"),
                    F.when(has_source, F.col("source_topic")).otherwise(F.col("topic"))
                    .alias("topic"),
                    F.when(has_source, F.col("source_partition")).otherwise(F.col("partition"))
                    .cast("int").alias("partition"),
                    F.when(has_source, F.col("source_offset")).otherwise(F.col("offset"))
                    .cast("long").alias("offset"),
                    F.col("timestamp"), F.lit(0).alias("timestampType"),
                    F.concat(kept, history).alias("headers")))


def redrive_record_id(row: Any) -> str:
    """``<first record id>#redrive<count>`` from the row's history headers."""
    first, count = None, None
    for h in row["headers"] or ():
        key, value = h[0], h[1]   # a Row(key, value), or a (key, value) pair
        if key == REDRIVE_OF and value is not None:
            first = bytes(value).decode("utf-8", "replace")
        elif key == REDRIVE_COUNT and value is not None:
            count = bytes(value).decode("ascii", "replace")
    if first is None or count is None:  # not a row of redrive_frame: its own coordinates
        return f"{row['topic']}/{row['partition']}/{row['offset']}#redrive"
    return f"{first}#redrive{count}"
