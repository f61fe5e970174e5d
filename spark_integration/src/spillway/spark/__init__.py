"""spillway for PySpark: wrappers that route failed records to the node's sidecar.

    from spillway.spark import Job, RetriableError
    job = Job("orders", {"errors.tolerance": "all",
                         "errors.deadletterqueue.topic.name": "dlq.orders"})
    job.register()
    out = job.map_partitions(df, parse, schema="id int, total double")

See `spillway.spark.job` for every wrapper and `spillway.spark._runtime` for when gRPC calls
happen.
"""

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
    RefreshRetriableError,
    RetriableError,
)

from ._compat import UnsupportedOnThisSparkError
from ._dlq_reader import DLQ_SCHEMA, read_dlq
from ._native import CorruptRecordError
from ._records import KAFKA_SOURCE_COLUMNS
from .job import Job, JobReport

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
    "RefreshRetriableError",
    "RetriableError",
    "SidecarUnavailableError",
    "SpillwayClientError",
    "ToleranceExceededError",
    "UnsupportedOnThisSparkError",
    "read_dlq",
]
