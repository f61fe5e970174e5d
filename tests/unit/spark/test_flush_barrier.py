"""The flush barrier on every wrapper: a partition (or, for a UDF, a skipped row) that reported
failures ends with a FlushTask, and a FlushTask that fails fails the task - also when the
partition only skipped records and so emits nothing. Otherwise a task could succeed before its
dead letters are acknowledged.

Each wrapper's executor-side function is the very closure the `Job` method hands to Spark
(captured from a stand-in DataFrame / RDD that records it), run off Spark against a real
in-process grpc.server with a scripted servicer whose FlushTask answers DEADLINE_EXCEEDED, as a
sidecar does when the task's DLQ records are not acknowledged in time."""

from __future__ import annotations

import datetime as dt
import threading
import uuid

import grpc
import pytest
from pyspark.sql import Row
from pyspark.sql.types import (
    ArrayType,
    BinaryType,
    IntegerType,
    LongType,
    StringType,
    StructField,
    StructType,
    TimestampType,
)

from spillway.client import _channel
from spillway.spark import FlushTimeoutError, Job, _inputs, _runtime, _taskinfo, _tracing, _udf
from spillway.spark import job as job_module
from spillway.spark._compat import arrow_conversions
from spillway.v1 import sidecar_pb2 as pb
from spillway.v1 import sidecar_pb2_grpc as pb_grpc
from support.rpc import serve_servicer
from support.spark import FakeTaskContext
from support.spark_files import ship_to

POISON = 3  # the row every wrapper's function fails on (with "only skipped": every row fails)
ID_SCHEMA = StructType([StructField("id", IntegerType(), True)])
# spillway.spark.KAFKA_SOURCE_SCHEMA as types (parsing DDL needs a running Spark)
KAFKA_SCHEMA = StructType([StructField(n, t, True) for n, t in (
    ("key", BinaryType()), ("value", BinaryType()), ("topic", StringType()),
    ("partition", IntegerType()), ("offset", LongType()), ("timestamp", TimestampType()),
    ("timestampType", IntegerType()),
    ("headers", ArrayType(StructType([StructField("key", StringType(), True),
                                      StructField("value", BinaryType(), True)]))))])


class Sidecar(pb_grpc.ErrorSidecarServicer):
    """Registers runs, skips (and "dead-letters") every reported record; FlushTask fails while
    ``flush_fails``."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.flush_fails = True
        self.lock = threading.Lock()

    def _seen(self, method: str) -> None:
        with self.lock:
            self.calls.append(method)

    def RegisterJob(self, request, context):
        self._seen("RegisterJob")
        return pb.RegisterJobResponse(job=request.job, run_id=request.run_id or "run-1",
                                      job_token="scripted-token",
                                      effective_properties={"errors.tolerance": "all"})

    def ReportFailures(self, request, context):
        self._seen("ReportFailures")
        return pb.ReportFailuresResponse(verdicts=[
            pb.Verdict(record_id=r.record_id, action=pb.ACTION_SKIP, reason="skipped",
                       dead_lettered=True) for r in request.records])

    def FlushTask(self, request, context):
        self._seen("FlushTask")
        if self.flush_fails:
            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                          "scripted: the task's DLQ records were not acknowledged in time")
        return pb.FlushTaskResponse(dlq_records_acknowledged=1)

    def flushes(self) -> int:
        with self.lock:
            return self.calls.count("FlushTask")


@pytest.fixture(scope="module")
def server():
    servicer = Sidecar()
    srv, servicer.target = serve_servicer(servicer)
    yield servicer
    srv.stop(0)
    _channel.close_channel(servicer.target)


class Captured:
    """Stands in for a DataFrame: records the function a wrapper hands to Spark."""

    def __init__(self, schema=ID_SCHEMA):
        self.schema = schema
        self.columns = [f.name for f in schema.fields]
        self.fn = None

    def _keep(self, fn, *_):
        self.fn = fn
        return self

    mapPartitions = mapInArrow = mapInPandas = foreachPartition = _keep


class CapturedRDD(Captured):
    """Stands in for an RDD."""


@pytest.fixture
def sidecar(server, monkeypatch, tmp_path):
    ship_to(monkeypatch, tmp_path)  # the run's token file, as executors read it
    monkeypatch.setattr(_runtime, "_worker", None)
    monkeypatch.setattr(_tracing, "ensure_provider", lambda: None)  # not an executor
    monkeypatch.delenv("SPILLWAY_SIDECAR_ADDRESS", raising=False)
    def is_dataframe(o):
        return isinstance(o, Captured) and not isinstance(o, CapturedRDD)

    monkeypatch.setattr(job_module, "is_dataframe", is_dataframe)
    monkeypatch.setattr(_inputs, "is_dataframe", is_dataframe)
    monkeypatch.setattr(_inputs, "is_rdd", lambda o: isinstance(o, CapturedRDD))
    monkeypatch.setattr(_udf, "_udf_states", {})
    monkeypatch.setattr(_udf, "TaskContext", FakeTaskContext)
    monkeypatch.setattr(_taskinfo, "_task_context", FakeTaskContext.get)
    monkeypatch.setattr(FakeTaskContext, "_taskContext",
                        FakeTaskContext(tid=int(uuid.uuid4().int % 10**6)))
    server.flush_fails = True
    server.calls.clear()
    return server


def _job(server) -> Job:
    job = Job(f"flush-{uuid.uuid4().hex[:8]}", {"errors.tolerance": "all"},
              sidecar=server.target, run_id=f"run-{uuid.uuid4().hex[:6]}",
              report_linger_s=0.0, flush_timeout_s=5, rpc_timeout_s=5)
    job.register()
    return job


def _ids(only_skipped: bool) -> list[int]:
    return [POISON] * 4 if only_skipped else list(range(8))


def _check(x):
    if x == POISON:
        raise ValueError(f"poison row {x}")
    return x


def _batch(ids):
    _, to_arrow = arrow_conversions()
    return to_arrow([(i,) for i in ids], ID_SCHEMA, False).to_batches()[0]


# --- one runner per wrapper: the partition (or the rows) as Spark would run it -------------


def run_rdd(job, ids):
    return list(job.map_partitions(CapturedRDD(), _check).fn(iter(ids)))


def run_dataframe(job, ids):
    part = job.map_partitions(Captured(), lambda r: Row(id=_check(r.id))).fn
    return [b.num_rows for b in part(iter([_batch(ids)]))]


def run_pandas(job, ids):
    import pandas as pd

    def fn(pdf):
        pdf["id"].map(_check)
        return pdf

    part = job.map_in_pandas(Captured(), fn, ID_SCHEMA).fn
    return [len(pdf) for pdf in part(iter([pd.DataFrame({"id": ids})]))]


def run_arrow(job, ids):
    def fn(batch):
        for i in batch.column("id").to_pylist():
            _check(i)
        return batch

    part = job.map_in_arrow(Captured(), fn, ID_SCHEMA).fn
    return [b.num_rows for b in part(iter([_batch(ids)]))]


def run_deserialize(job, ids):
    schema = KAFKA_SCHEMA
    _, to_arrow = arrow_conversions()
    ts = dt.datetime(2024, 5, 1, 12, 0, 0)
    batch = to_arrow([(b"k", str(i).encode(), "orders", 0, n, ts, 0, [])
                      for n, i in enumerate(ids)], schema, False).to_batches()[0]
    part = job.deserialize(Captured(schema), value=lambda v: _check(int(v)),
                           value_type=IntegerType()).fn
    return [b.num_rows for b in part(iter([batch]))]


def run_foreach(job, ids):
    written = []

    def write(rows):
        for r in rows:
            _check(r)
        written.extend(rows)

    rdd = CapturedRDD()
    job.foreach_partition(rdd, write, batch_size=2)
    rdd.fn(iter(ids))
    return written


def run_udf(job, ids):
    call = job.udf(IntegerType())(_check).func
    return [call(i) for i in ids]


WRAPPERS = {"map_partitions-rdd": run_rdd, "map_partitions-dataframe": run_dataframe,
            "map_in_pandas": run_pandas, "map_in_arrow": run_arrow,
            "deserialize": run_deserialize, "foreach_partition": run_foreach,
            "udf-skip": run_udf}


@pytest.mark.parametrize("only_skipped", [True, False], ids=["only-skipped", "mixed"])
@pytest.mark.parametrize("wrapper", sorted(WRAPPERS))
def test_a_flush_that_fails_at_the_end_fails_the_task(sidecar, wrapper, only_skipped):
    job = _job(sidecar)
    with pytest.raises(FlushTimeoutError, match="not acknowledged"):
        WRAPPERS[wrapper](job, _ids(only_skipped))
    assert sidecar.calls.count("ReportFailures") >= 1
    assert sidecar.flushes() == 1  # the first failed flush ended the task


@pytest.mark.parametrize("only_skipped", [True, False], ids=["only-skipped", "mixed"])
@pytest.mark.parametrize("wrapper", sorted(WRAPPERS))
def test_the_flush_barrier_follows_the_reports(sidecar, wrapper, only_skipped):
    """The control: with FlushTask succeeding the same partition completes, its last call
    being the flush barrier after the reports (per skipped row for a UDF)."""
    sidecar.flush_fails = False
    job = _job(sidecar)
    ids = _ids(only_skipped)
    WRAPPERS[wrapper](job, ids)
    reports = sidecar.calls.count("ReportFailures")
    assert reports >= 1 and sidecar.calls[-1] == "FlushTask", sidecar.calls
    assert sidecar.calls.index("FlushTask") > sidecar.calls.index("ReportFailures")
    if wrapper == "udf-skip":  # no partition end: one barrier per skipped row
        assert sidecar.flushes() == ids.count(POISON)
