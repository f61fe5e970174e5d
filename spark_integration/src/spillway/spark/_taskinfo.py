"""Spark's task identity as a Python worker reads it: the running task (`current_task`) and
its Structured Streaming micro-batch (`current_batch_id`; `batch_scope` tags a block's actions
with it where Spark does not say it)."""

from __future__ import annotations

import contextlib
import os
import re
import socket
from collections.abc import Iterator
from typing import Any

from spillway.v1 import sidecar_pb2 as pb

BATCH_ID_PROPERTY = "streaming.sql.batchId"
JOB_TAGS_PROPERTY = "spark.job.tags"
#: The job tag `batch_scope` adds: ``spillway-batch-<micro-batch id>``.
BATCH_TAG_PREFIX = "spillway-batch-"
_BATCH_TAG = re.compile(r"(?:^|[_-])" + re.escape(BATCH_TAG_PREFIX) + r"(\d+)$")


def _task_context():
    try:
        from pyspark import TaskContext
    except ImportError:  # pragma: no cover - spillway.spark requires pyspark
        return None
    return TaskContext.get()


def current_task(partition_fallback: int = 0) -> pb.TaskIdentity:
    """Spark's TaskContext plus the executor id and host (fallbacks off Spark: driver, p0)."""
    tc = _task_context()
    host = socket.gethostname()
    if tc is None:
        return pb.TaskIdentity(partition_id=partition_fallback,
                               executor_id=os.environ.get("SPARK_EXECUTOR_ID") or "driver",
                               host=host)
    executor = (tc.getLocalProperty("spark.executor.id") or os.environ.get("SPARK_EXECUTOR_ID")
                or "driver")
    return pb.TaskIdentity(stage_id=tc.stageId(), partition_id=tc.partitionId(),
                           attempt_number=tc.attemptNumber(), task_attempt_id=tc.taskAttemptId(),
                           executor_id=executor, host=host)


def current_batch_id() -> str | None:
    """The Structured Streaming micro-batch id of the running task, if any.

    Spark's own ``streaming.sql.batchId`` local property where the micro-batch's thread runs
    the job (classic Spark; a Connect server's sinks other than foreachBatch); else the job tag
    `batch_scope` put on the action (``job.foreach_batch`` does, on every Spark mode): over
    Spark Connect a foreachBatch function runs its actions through another Connect session on
    the server's request threads, whose tasks carry no ``streaming.sql.batchId``."""
    tc = _task_context()
    if tc is None:
        return None
    found = tc.getLocalProperty(BATCH_ID_PROPERTY)
    if found is not None:
        return found
    for tag in (tc.getLocalProperty(JOB_TAGS_PROPERTY) or "").split(","):
        m = _BATCH_TAG.search(tag.strip())
        if m:
            return m.group(1)
    return None


@contextlib.contextmanager
def batch_scope(session: Any, batch_id: int) -> Iterator[None]:
    """Tag the actions run in this block (this thread) as micro-batch ``batch_id``: their tasks
    see it in ``spark.job.tags`` (Spark Connect prefixes session tags with its own names, hence
    the suffix match in `current_batch_id`). A session without tags (classic 3.5, whose
    micro-batch thread has ``streaming.sql.batchId``) runs the block as it is."""
    add = getattr(session, "addTag", None)
    if add is None or isinstance(batch_id, bool) or not isinstance(batch_id, int):
        yield
        return
    tag = f"{BATCH_TAG_PREFIX}{batch_id}"
    add(tag)
    try:
        yield
    finally:
        session.removeTag(tag)
