"""spillway for PySpark: wrappers that route failed records to the node's sidecar.

    from spillway.spark import Job, RetriableError
    job = Job("orders", {"errors.tolerance": "all",
                         "errors.deadletterqueue.topic.name": "dlq.orders"})
    job.register()
    out = job.map_partitions(df, parse, schema="id int, total double")

See `spillway.spark.job` for every wrapper and `spillway.spark._runtime` for when gRPC calls
happen.
"""

from typing import TYPE_CHECKING

from spillway.client.errors import (
    FlushTimeoutError,
    InvalidPolicyError,
    JobConflictError,
    JobFailedError,
    RecordFailedError,
    SidecarUnavailableError,
    SpillwayClientError,
    ToleranceExceededError,
)
from spillway.client.markers import (
    AbortableError,
    ApplicationRecoverableError,
    DataError,
    InvalidConfigurationError,
    RecordTimeoutError,
    RefreshRetriableError,
    RetriableError,
    WorkerCrashError,
)

# The driver's API is imported when first used: a Spark Python worker imports this package to
# run a wrapper (`_partitions`, `_udf`), which needs none of it, and pays for what it imports
# once per worker process (the Job class and its pyspark.sql imports, the DLQ reader, the
# native deserializer: ~35 ms of CPU).
_LAZY = {
    "UnsupportedOnThisSparkError": "._compat",
    "DLQ_SCHEMA": "._dlq_reader",
    "read_dlq": "._dlq_reader",
    "CorruptRecordError": "._native",
    "KAFKA_SOURCE_COLUMNS": "._records",
    "Job": ".job",
    "JobReport": ".job",
}

if TYPE_CHECKING:
    from ._compat import UnsupportedOnThisSparkError
    from ._dlq_reader import DLQ_SCHEMA, read_dlq
    from ._native import CorruptRecordError
    from ._records import KAFKA_SOURCE_COLUMNS
    from .job import Job, JobReport


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


#: Spark's Kafka source schema, as a DDL string (what `Job.deserialize` expects).
KAFKA_SOURCE_SCHEMA = ("key binary, value binary, topic string, partition int, offset long, "
                       "timestamp timestamp, timestampType int, "
                       "headers array<struct<key:string,value:binary>>")

__all__ = [
    "DLQ_SCHEMA",
    "KAFKA_SOURCE_COLUMNS",
    "KAFKA_SOURCE_SCHEMA",
    "AbortableError",
    "ApplicationRecoverableError",
    "CorruptRecordError",
    "DataError",
    "FlushTimeoutError",
    "InvalidConfigurationError",
    "InvalidPolicyError",
    "Job",
    "JobConflictError",
    "JobFailedError",
    "JobReport",
    "RecordFailedError",
    "RecordTimeoutError",
    "RefreshRetriableError",
    "RetriableError",
    "SidecarUnavailableError",
    "SpillwayClientError",
    "ToleranceExceededError",
    "UnsupportedOnThisSparkError",
    "WorkerCrashError",
    "read_dlq",
]
