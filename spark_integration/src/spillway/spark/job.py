"""`Job`: the driver-side handle that wraps user functions so failed records go to the sidecar.

    with Job("orders", {"errors.tolerance": "all",
                        "errors.deadletterqueue.topic.name": "dlq.orders"}) as job:
        # registered on entry: fails fast on a bad policy or a missing sidecar
        parsed = job.deserialize(kafka_df, value=json.loads, value_type="struct<id:int>")
        out = job.map_partitions(parsed, enrich, schema="id int, total double")
        out = job.map_in_pandas(parsed, score_batch, "id int, score double")
        job.foreach_partition(out, write_rows)       # stage TASK_PUT: retried, dead-lettered
        print(job.summary())
    print(job.report)       # the final counts; the run's state is released on every sidecar

Each `Job` is one run of the job (the Spark application id, or ``run_id=``): a run starts with
fresh counts, retry state and remembered record ids, whatever earlier runs of the same name did.
Everything executors need (job name, policy, sidecar address and its env variable's name, the
run's id, job token and home sidecar) travels inside the wrapped closures; executors register
the run with their node's sidecar themselves, once per Python worker process.

Every wrapper runs the user function inside the verdict loop (`_engine`): RETRY waits and runs
the record again (records after it keep flowing), SKIP drops it (the sidecar dead-letters it),
FAIL fails the Spark task with an exception naming the stage, the exception and the sidecar's
reason (`RecordFailedError`, `JobFailedError`, `ToleranceExceededError`). Good records come out
exactly once; their order is not preserved. Each action re-runs the wrappers (cache the result
to avoid reporting the same failures again).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
import os
import re
import sys
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pyspark import TaskContext

from spillway.client import SidecarClient, report
from spillway.client.runs import JobRun, Registration, new_run_id
from spillway.client.errors import (
    ADDRESS_ENV,
    SidecarProtocolError,
    SpillwayClientError,
    error_for_verdict,
)
from spillway.v1 import sidecar_pb2 as pb

from ._adapters import (
    BatchAdapter,
    DeserializeAdapter,
    Deserializer,
    RowAdapter,
    SinkAdapter,
    batch_units,
    chunk_units,
)
from ._compat import arrow_conversions, parse_ddl
from ._engine import Engine, StageRef, Unit, trim_traceback
from ._records import KAFKA_COORDINATES, context_of, payload_for, positional_record_id
from ._schema import arrow_conformer, pandas_checker, row_checker, value_checker
from ._runtime import (
    JobSpec,
    TaskSession,
    WrapperSpec,
    current_batch_id,
    current_task,
    worker,
)

_log = logging.getLogger("spillway.spark")

#: Rows per Arrow batch the DataFrame wrappers emit.
OUTPUT_BATCH_ROWS = 4096

_SPILLWAY_ERROR = re.compile(r"spillway\.client\.errors\.(\w+Error): ([^\n]+)")
_TRACEBACK = "Traceback (most recent call last):"
_RAISED = re.compile(r"^([A-Za-z_][\w.]*(?:Error|Exception|Invalid|Exit|Interrupt|Warning|"
                     r"Failure|Fault|Timeout)\b[^:\n]*)(?::\s*(.*))?$")


def _traceback_exception(text: str) -> str:
    """``Type: message`` of the exception that ends the last Python traceback in ``text``."""
    at = text.rfind(_TRACEBACK)
    if at < 0:
        return ""
    for line in text[at + len(_TRACEBACK):].splitlines():
        if not line.strip() or line.startswith((" ", "\t")) or line.startswith("^"):
            continue          # frames, source lines, carets
        m = _RAISED.match(line.strip())
        if m:
            return f"{m.group(1)}: {m.group(2).strip()}" if m.group(2) else m.group(1)
    return ""


def _wrapper_name(fn: Callable, name: str | None) -> str:
    if name:
        return name
    qual = report.qualified_name(fn)
    code = getattr(fn, "__code__", None)
    if code is not None and "<lambda>" in qual:  # two lambdas of a module must not share ids
        qual = f"{qual}@L{code.co_firstlineno}"
    return qual


def _struct(schema: Any):
    from pyspark.sql.types import StructType

    if isinstance(schema, StructType):
        return schema
    if isinstance(schema, str):
        parsed = parse_ddl(schema)
        if isinstance(parsed, StructType):
            return parsed
    raise TypeError(f"schema: expected a StructType or a DDL string like 'id int, name string', "
                    f"got {schema!r}")


def _datatype(dt: Any):
    from pyspark.sql.types import DataType

    if isinstance(dt, DataType):
        return dt
    if isinstance(dt, str):
        return parse_ddl(dt)
    raise TypeError(f"expected a pyspark DataType or a DDL type string, got {dt!r}")


def _native_corrupt_field() -> str:
    from ._native import CORRUPT_FIELD

    return CORRUPT_FIELD


def _is_dataframe(obj: Any) -> bool:
    from pyspark.sql import DataFrame

    if isinstance(obj, DataFrame):
        return True
    # A Spark Connect DataFrame is another class, from a module that is loaded once such a
    # DataFrame exists. Not imported here: without the connect extras, importing it calls
    # sys.exit(0) when __main__ has no __file__ (python -c, pytest-xdist workers), which ended
    # the program with success on any RDD passed to map_partitions.
    connect = sys.modules.get("pyspark.sql.connect.dataframe")
    return connect is not None and isinstance(obj, connect.DataFrame)


def _is_rdd(obj: Any) -> bool:
    from pyspark import RDD

    return isinstance(obj, RDD)


def _require(what: str, data: Any, *, rdd: bool = False) -> None:
    """Misuse gets a clear error on the driver, never an AttributeError deep in a wrapper."""
    if _is_dataframe(data) or (rdd and _is_rdd(data)):
        return
    kinds = "a pyspark DataFrame or RDD" if rdd else "a pyspark DataFrame"
    raise TypeError(f"{what}: expected {kinds}, got {type(data).__module__}."
                    f"{type(data).__qualname__}; spillway wraps Spark work (build one with "
                    f"spark.createDataFrame(...) or sc.parallelize(...))")


# --- executor side: one function per wrapper kind (module-level: pickled by reference) -------


def _ids(spec: JobSpec, wrapper: WrapperSpec, task: pb.TaskIdentity, batch_id: Any = None):
    batch = batch_id if batch_id is not None else current_batch_id()
    return functools.partial(positional_record_id, wrapper.stage.name, spec.name, wrapper.name,
                             task.partition_id, batch_id=batch)


def _engine(spec: JobSpec, session: TaskSession, adapter: Any, wrapper: WrapperSpec,
            refresh: Callable[[], None] | None, count_stages: Sequence[StageRef] | None = None,
            ) -> Engine:
    return Engine(session, adapter, stage=wrapper.stage, function_name=wrapper.function_name,
                  count_stages=count_stages, batch_size=spec.report_batch_size,
                  linger_s=spec.report_linger_s, refresh=refresh, submit=worker().submit,
                  max_inflight=spec.report_max_inflight)


def _drive(session: TaskSession, engine: Engine, outputs: Iterator[Any]) -> Iterator[Any]:
    """Run the loop over a partition (``outputs``: engine.run or engine.run_rows); close the
    session (flush barrier) when it ends."""
    ok, error = False, None
    try:
        yield from outputs
        ok = True
    except GeneratorExit:
        ok = True  # Spark stopped reading early (e.g. a limit): what was emitted stands
        left = engine.unfinished()
        if left:
            _log.info("spillway: Spark stopped reading partition %d early; %d failed record(s) "
                      "it did not ask for were left unreported", session.task.partition_id, left)
        raise
    except BaseException as exc:
        error = exc
        raise
    finally:
        session.close(ok, error)


def _rdd_partition(spec, wrapper, fn, flat, record_id, source, refresh, iterator):
    session = TaskSession(spec, wrapper)
    ids = _ids(spec, wrapper, session.task)
    adapter = RowAdapter(fn, ids=ids, flat=flat, record_id=record_id, source=source)
    engine = _engine(spec, session, adapter, wrapper, refresh)
    return _drive(session, engine, engine.run_rows(iterator))


def _large_types(batch: Any) -> bool:
    import pyarrow as pa

    return any(pa.types.is_large_string(f.type) or pa.types.is_large_binary(f.type)
               for f in batch.schema)


def _rows_to_batches(rows: Iterator[Any], schema: Any, large: Callable[[], bool]):
    _, to_arrow = arrow_conversions()

    buf: list = []
    try:
        for row in rows:
            buf.append(row)
            if len(buf) >= OUTPUT_BATCH_ROWS:
                yield from to_arrow(buf, schema, large()).to_batches()
                buf = []
        if buf:
            yield from to_arrow(buf, schema, large()).to_batches()
    finally:
        close = getattr(rows, "close", None)
        if close is not None:
            close()


def _df_partition(spec, wrapper, fn, flat, record_id, source, refresh, in_schema, out_schema,
                  batches):
    import pyarrow as pa
    ArrowTableToRowsConversion, _ = arrow_conversions()

    seen = {"large": False}

    def rows():
        for b in batches:
            seen["large"] = seen["large"] or _large_types(b)
            yield from ArrowTableToRowsConversion.convert(pa.Table.from_batches([b]), in_schema)

    session = TaskSession(spec, wrapper)
    adapter = RowAdapter(_checked(fn, out_schema, flat, wrapper.stage.name),
                         ids=_ids(spec, wrapper, session.task), flat=flat, record_id=record_id,
                         source=source)
    engine = _engine(spec, session, adapter, wrapper, refresh)
    outputs = _drive(session, engine, engine.run_rows(rows()))
    return _rows_to_batches(outputs, out_schema, lambda: seen["large"])


def _checked(fn, schema, flat, stage):
    """``fn`` whose outputs are checked against ``schema`` (a Row by field name, a dict, or a
    tuple in schema order), so a bad output is that record's failure, not the task's."""
    normalize = row_checker(schema, stage)

    def run(row):
        out = fn(row)
        return [normalize(o) for o in out] if flat else normalize(out)

    return run


def _vector_partition(spec, wrapper, fn, kind, record_id, source, refresh, out_schema, batches):
    session = TaskSession(spec, wrapper)
    conform = (arrow_conformer if kind == "arrow" else pandas_checker)(out_schema,
                                                                       wrapper.stage.name)
    adapter = BatchAdapter(fn, kind, ids=_ids(spec, wrapper, session.task), record_id=record_id,
                           source=source, conform=conform)
    engine = _engine(spec, session, adapter, wrapper, refresh)
    return _drive(session, engine, engine.run(batch_units(batches)))


def _deserialize_partition(spec, wrapper, steps, in_schema, new_schema, refresh, batches):
    import pyarrow as pa
    ArrowTableToRowsConversion, to_arrow = arrow_conversions()

    parts = {s.part for s in steps}
    cache: dict[str, Any] = {"batch": None, "rows": None}
    seen = {"large": False}

    def to_row(batch, i):
        if cache["batch"] is not batch:
            cache["rows"] = ArrowTableToRowsConversion.convert(pa.Table.from_batches([batch]),
                                                               in_schema)
            cache["batch"] = batch
        return cache["rows"][i]

    def units():
        offset = 0
        for b in batches:
            seen["large"] = seen["large"] or _large_types(b)
            cols = {p: b.column(p).to_pylist() for p in ("key", "value") if p in parts}
            for i in range(b.num_rows):
                yield Unit((b, i, {p: c[i] for p, c in cols.items()}), 1, offset + i)
            offset += b.num_rows

    def emit(buf):
        groups: dict[int, tuple[Any, list, list]] = {}
        for batch, i, parsed in buf:
            g = groups.setdefault(id(batch), (batch, [], []))
            g[1].append(i)
            g[2].append(parsed)
        for batch, idx, parsed in groups.values():
            taken = batch.take(pa.array(idx, type=pa.int64()))
            new = to_arrow(parsed, new_schema, seen["large"])
            arrays = list(taken.columns) + [c.combine_chunks() for c in new.columns]
            yield pa.RecordBatch.from_arrays(arrays, names=taken.schema.names + new.schema.names)

    session = TaskSession(spec, wrapper)
    adapter = DeserializeAdapter(steps, ids=_ids(spec, wrapper, session.task), to_row=to_row)
    engine = _engine(spec, session, adapter, wrapper, refresh,
                     count_stages=[s.stage for s in steps])
    outputs = _drive(session, engine, engine.run(units()))
    buf: list = []
    try:
        for out in outputs:
            buf.append(out)
            if len(buf) >= OUTPUT_BATCH_ROWS:
                yield from emit(buf)
                buf = []
        if buf:
            yield from emit(buf)
    finally:
        outputs.close()


def _sink_partition(spec, wrapper, write_fn, chunk, record_id, source, refresh, batch_id, rows):
    session = TaskSession(spec, wrapper)
    adapter = SinkAdapter(write_fn, ids=_ids(spec, wrapper, session.task, batch_id),
                          record_id=record_id, source=source)
    engine = _engine(spec, session, adapter, wrapper, refresh)
    for _ in _drive(session, engine, engine.run(chunk_units(rows, chunk))):
        pass


def _with_batch_id(write_fn, batch_id, rows):
    return write_fn(rows, batch_id)


# --- UDFs -------------------------------------------------------------------------------------


class _UdfState:
    """A UDF's state in the current task attempt of this worker (UDFs see no partition end):
    the rows it was called on (row index and processed count) and, once needed, a session."""

    __slots__ = ("pid", "tid", "tc", "task", "rows", "_session", "spec", "wrapper")

    def __init__(self, spec: JobSpec, wrapper: WrapperSpec, tid: int, tc: Any = None) -> None:
        self.pid = os.getpid()
        self.tid = tid
        self.tc = tc  # Spark's TaskContext object of the attempt (held: its id is not reused)
        self.task = current_task()  # once per task attempt: later it names another task
        self.rows = 0
        self._session: TaskSession | None = None
        self.spec, self.wrapper = spec, wrapper

    @property
    def session(self) -> TaskSession:
        if self._session is None:
            self._session = TaskSession(self.spec, self.wrapper, task=self.task,
                                        open_span=False)
        self._session.own[self.wrapper.stage.key] = self.rows
        return self._session

    def retire(self) -> None:
        """The task attempt is over: park (or send, once due) its unsent counts."""
        if self.pid == os.getpid() and self.rows:
            self.session.park_counts()


_udf_states: dict[tuple[str, str], _UdfState] = {}


def _udf_state(spec: JobSpec, wrapper: WrapperSpec, tid: int, tc: Any = None) -> _UdfState:
    """The UDF's state for task attempt ``tid`` in this process; a state of an earlier attempt
    is retired (one inherited through a fork is dropped as it is)."""
    key = (spec.name, wrapper.name)
    old = _udf_states.get(key)
    if old is not None and old.tid == tid and old.pid == os.getpid():
        old.tc = tc
        return old  # the same UDF applied twice in one task: one row count, distinct ids
    if old is not None:
        old.retire()
    st = _udf_states[key] = _UdfState(spec, wrapper, tid, tc)
    return st


@dataclass(frozen=True)
class _Skipped:
    record: pb.FailedRecord
    verdict: pb.Verdict


def _udf_function(spec: JobSpec, wrapper: WrapperSpec, fn: Callable, error_column: bool,
                  record_id: Callable[..., str] | None,
                  refresh: Callable[[], None] | None,
                  check: Callable[[Any], None] | None = None) -> Callable:
    """The per-row function Spark calls. Per row it only checks that the task attempt is the
    same (Spark sets a new TaskContext object for each task it runs in a worker: an identity
    check, the attempt id being read only when it changes) and counts the row before calling
    ``fn``; everything else happens on a failure. ``check(result)`` raises when a result does
    not fit the declared return type (Spark would turn it into a silent null): that row fails
    like one whose ``fn`` raised."""
    holder: list[_UdfState | None] = [None]  # unpickled afresh with the UDF on the executor
    tc_class = TaskContext
    if check is not None:
        user_fn = fn

        def checked(*args):
            out = user_fn(*args)
            check(out)
            return out
    else:
        checked = fn

    def enter() -> _UdfState:
        tc = tc_class.get()
        if tc is None:
            raise RuntimeError(
                f"spillway UDF {wrapper.function_name} was called outside a Spark task: apply "
                f"it to a column in a DataFrame (df.select(udf(df.col))); called directly it "
                f"has no task to report failures for")
        tid = tc.taskAttemptId()
        st = holder[0]
        if st is None or st.tid != tid or st.pid != os.getpid():
            st = _udf_state(spec, wrapper, tid, tc)
        st.tc = tc
        holder[0] = st
        return st

    def failed(st, args, index, exc):
        return _udf_failed(spec, wrapper, st, checked, args, index, exc, error_column, record_id,
                           refresh)

    # The per-row cost is what the happy path pays: read the class attribute that
    # TaskContext.get() returns (a method call costs more than the rest of the check), and
    # call a one-argument function without packing *args (half of the remaining overhead).
    direct = hasattr(tc_class, "_taskContext")  # pyspark's layout; else the public accessor
    current = (lambda: tc_class._taskContext) if direct else tc_class.get
    if direct and _single_argument(fn):
        def call(arg):
            st = holder[0]
            if st is None or st.tc is not tc_class._taskContext:
                st = enter()
            index = st.rows
            st.rows = index + 1
            try:
                out = fn(arg)
                if check is not None:
                    check(out)
            except Exception as exc:  # noqa: BLE001 - user code
                return failed(st, (arg,), index, exc)
            return (out, None) if error_column else out
    else:
        def call(*args):
            st = holder[0]
            if st is None or st.tc is not current():
                st = enter()
            index = st.rows
            st.rows = index + 1
            try:
                out = fn(*args)
                if check is not None:
                    check(out)
            except Exception as exc:  # noqa: BLE001 - user code
                return failed(st, args, index, exc)
            return (out, None) if error_column else out

    return call


def _single_argument(fn: Callable) -> bool:
    """Whether Spark can only ever call ``fn`` with exactly one column."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # builtins without a signature
        return False
    return (len(params) == 1 and params[0].default is inspect.Parameter.empty
            and params[0].kind in (inspect.Parameter.POSITIONAL_ONLY,
                                   inspect.Parameter.POSITIONAL_OR_KEYWORD))


def _udf_failed(spec, wrapper, st, fn, args, index, exc, error_column, record_id, refresh):
    outcome = _udf_failure(spec, wrapper, st, fn, args, index, exc, record_id, refresh)
    if not isinstance(outcome, _Skipped):
        return (outcome, None) if error_column else outcome
    if not error_column:
        return None
    info = outcome.record.exception
    return (None, (outcome.record.record_id, wrapper.stage.name, info.class_name, info.message,
                   outcome.verdict.reason, outcome.verdict.dead_lettered))


def _udf_failure(spec, wrapper, st, fn, args, index, exc, record_id, refresh):
    import time

    session = st.session
    trim_traceback(exc)
    subject = args[0] if len(args) == 1 else list(args)
    ctx = context_of(subject, lambda: positional_record_id(
        wrapper.stage.name, spec.name, wrapper.name, session.task.partition_id, index,
        batch_id=current_batch_id()),
        (lambda _row: record_id(*args)) if record_id is not None else None)
    session.begin_span()
    attempt, error = 1, None
    try:
        while True:
            record = report.failed_record(
                ctx.record_id, wrapper.stage.stage, exc, custom_stage=wrapper.stage.custom,
                function_name=wrapper.function_name, source=ctx.source, key=ctx.key,
                value=ctx.value, headers=ctx.headers, timestamp_ms=ctx.timestamp_ms,
                attempt=attempt, context=session.trace_context,
                payload=payload_for(wrapper.stage.stage, ctx))
            session.failed(exc, record)
            verdict = session.report([record])[0]
            if verdict.action == pb.ACTION_FAIL:
                raise error_for_verdict(spec.name, record, verdict) from exc
            if verdict.action == pb.ACTION_SKIP:
                session.skipped(record, verdict)
                session.flush()  # the flush barrier: no later hook in a UDF
                return _Skipped(record, verdict)
            if verdict.action != pb.ACTION_RETRY:
                raise SidecarProtocolError(
                    f"ReportFailures: verdict for record {verdict.record_id!r} has no action "
                    f"({pb.Action.Name(verdict.action)})") from exc
            time.sleep(verdict.retry_delay_ms / 1000.0)
            if verdict.category == pb.CATEGORY_REFRESH_RETRIABLE and refresh is not None:
                refresh()
            attempt += 1
            try:
                value = fn(*args)
            except Exception as again:  # noqa: BLE001 - user code
                exc = trim_traceback(again)
                continue
            session.recovered(record.record_id)
            session.flush()
            return value
    except BaseException as e:
        error = e
        raise
    finally:
        session.end_span(error)


# --- summaries --------------------------------------------------------------------------------


@dataclass
class JobReport:
    """A job's counts summed over sidecars (KIP-298 task-error-metrics names, snake_case)."""

    job: str
    run_id: str = ""
    failed: bool = False
    failure_reasons: list[str] = field(default_factory=list)
    records_processed: int = 0
    total_record_failures: int = 0
    total_record_errors: int = 0
    total_records_skipped: int = 0
    total_retries: int = 0
    total_errors_logged: int = 0
    dlq_records_written: int = 0
    dropped_records: int = 0
    retry_budget_exhausted: int = 0   # retries the job's retry budget deferred or refused
    last_error_timestamp_ms: int = 0
    by_stage: dict[str, int] = field(default_factory=dict)
    by_category: dict[str, int] = field(default_factory=dict)
    by_exception_class: dict[str, int] = field(default_factory=dict)
    per_sidecar: dict[str, pb.JobSummary] = field(default_factory=dict, repr=False)
    #: Node sidecars `Job.close()` could not reach (they end the run on their idle timeout).
    unreachable: list[str] = field(default_factory=list)

    _SUMS = ("records_processed", "total_record_failures", "total_record_errors",
             "total_records_skipped", "total_retries", "total_errors_logged",
             "dlq_records_written", "dropped_records", "retry_budget_exhausted")

    def add(self, target: str, s: pb.JobSummary) -> None:
        self.per_sidecar[target] = s
        self.failed = self.failed or s.failed
        if s.failure_reason and s.failure_reason not in self.failure_reasons:
            self.failure_reasons.append(s.failure_reason)
        for name in self._SUMS:
            setattr(self, name, getattr(self, name) + getattr(s, name))
        self.last_error_timestamp_ms = max(self.last_error_timestamp_ms, s.last_error_timestamp_ms)
        for table, entries in ((self.by_stage, s.by_stage), (self.by_category, s.by_category),
                               (self.by_exception_class, s.by_exception_class)):
            for e in entries:
                table[e.key] = table.get(e.key, 0) + e.count


# --- the driver-side handle -------------------------------------------------------------------


# The runs this driver process registered, by (sidecar, job, run id): a second `Job` object for
# the same run (e.g. a notebook cell run again) presents the same job token.
_driver_runs: dict[tuple[str, str, str], Registration] = {}
_driver_lock = threading.Lock()


def _spark_run_id() -> str | None:
    """The active Spark application's id: one run of the job per Spark application."""
    try:
        from pyspark.sql import SparkSession

        session = SparkSession.getActiveSession()
        return session.sparkContext.applicationId if session is not None else None
    except Exception:  # noqa: BLE001 - e.g. Spark Connect, which has no SparkContext
        return None


class Job:
    """A spillway job: its name, error policy (KIP property names) and sidecar settings.

    ``sidecar``: the driver's sidecar (and the executors' when their environment does not name
    one in ``$SPILLWAY_SIDECAR_ADDRESS``). ``on_sidecar_unavailable``: ``"fail"`` (default) fails
    the task at once when the sidecar cannot be reached (after gRPC's own short retries);
    ``"wait"`` keeps retrying for up to ``sidecar_wait_s`` (e.g. through a sidecar restart),
    then fails. Nothing is ever dropped: a report that cannot be delivered fails the task.
    A sidecar applying backpressure is always waited for, up to ``sidecar_wait_s``.

    Failed records go to the sidecar in reports of up to ``report_batch_size``, a partial one
    once its oldest record waited ``report_linger_s``. Reports are sent in the background while
    the task goes on with its rows, at most ``report_max_inflight`` per wrapper and task (a
    full batch beyond that waits for the oldest report's verdicts); verdicts are followed in
    the order the reports were sent.

    A `Job` is one run (``run_id``: default the active Spark application's id, else a random
    one): registered with the driver's sidecar (its home) on ``with Job(...)``, `register()` or
    the first wrapper, ended by `close()` (or leaving the ``with`` block), which releases the
    run's state on every sidecar and keeps the final counts in ``report``. A run never closed
    ends on its own after the sidecars' ``job.idle.timeout.ms``.
    """

    def __init__(self, name: str, properties: Mapping[str, str] | None = None, *,
                 sidecar: str | None = None, address_env: str = ADDRESS_ENV,
                 on_sidecar_unavailable: str = "fail", sidecar_wait_s: float = 120.0,
                 report_batch_size: int = 256, report_linger_s: float = 0.5,
                 counts_interval_s: float = 10.0, flush_timeout_s: float = 60.0,
                 rpc_timeout_s: float = 10.0, run_id: str | None = None,
                 report_max_inflight: int = 2) -> None:
        props = tuple(sorted((str(k), str(v)) for k, v in (properties or {}).items()))
        self.spec = JobSpec(
            name=name.strip() if isinstance(name, str) else name, properties=props,
            sidecar=sidecar, address_env=address_env,
            on_sidecar_unavailable=on_sidecar_unavailable, sidecar_wait_s=sidecar_wait_s,
            report_batch_size=report_batch_size, report_linger_s=report_linger_s,
            report_max_inflight=report_max_inflight, counts_interval_s=counts_interval_s, flush_timeout_s=flush_timeout_s,
            rpc_timeout_s=rpc_timeout_s)
        if run_id is not None and (not isinstance(run_id, str) or not run_id.strip()):
            raise ValueError(f"run_id: expected a non-empty string, got {run_id!r}")
        self._run_id = run_id.strip() if run_id else None
        self.effective_properties: dict[str, str] | None = None
        self.registration: Registration | None = None
        #: The final counts, once `close()` ended the run.
        self.report: JobReport | None = None

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def properties(self) -> dict[str, str]:
        return self.spec.props

    @property
    def run_id(self) -> str:
        """This run's id (known once registered, or when given)."""
        return self.spec.run_id or self._run_id or ""

    def __repr__(self) -> str:
        return f"Job({self.name!r}, run_id={self.run_id!r}, sidecar={self.spec.sidecar!r})"

    def __enter__(self) -> Job:
        self.register()
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is None:
            self.close()
            return
        try:  # the block's own error is the one to see; the run then ends on its idle timeout
            self.close()
        except Exception as err:  # noqa: BLE001
            _log.warning("spillway: job %r run %r could not be ended (%s); the sidecars end it "
                         "after job.idle.timeout.ms", self.name, self.run_id, err)

    def _client(self, target: str | None = None) -> SidecarClient:
        return SidecarClient(target or self.spec.driver_target(),
                             timeout_s=self.spec.rpc_timeout_s, address_env=self.spec.address_env)

    # --- driver calls -----------------------------------------------------------------------

    def register(self) -> dict[str, str]:
        """RegisterJob of this run on the driver's sidecar, the run's home (idempotent);
        returns the effective policy. Also the driver-side check that the sidecar is there.

        Raises InvalidPolicyError naming the bad property, JobConflictError when the sidecar
        runs this run with other properties, SidecarUnavailableError (naming the address) when
        it is unreachable, JobLimitError when it has jobs.max.live runs already.
        """
        spec = self.spec
        run_id = spec.run_id or self._run_id or _spark_run_id() or new_run_id()
        key = (spec.driver_target(), self.name, run_id)
        token = spec.job_token
        if token is None:  # another Job object of this driver registered the run (a notebook
            with _driver_lock:  # cell run again): the same driver holds the same run
                known = _driver_runs.get(key)
            token = known.job_token if known is not None else None
        reg = self._client().register_job(JobRun(self.name, run_id, token), self.properties)
        with _driver_lock:
            _driver_runs[key] = reg
        # Executors on other nodes name the home (its advertised address and instance id) when
        # they register with their own sidecar, which then forwards decisions to it.
        self.spec = dataclasses.replace(
            spec, run_id=reg.run_id, job_token=reg.job_token,
            home=reg.home or spec.driver_target(), home_instance_id=reg.home_instance_id)
        self.registration = reg
        self.effective_properties = dict(reg.effective_properties)
        self.report = None
        return dict(self.effective_properties)

    def _task_spec(self) -> JobSpec:
        """The spec wrappers hand to executors: the registered run's (registers it first)."""
        if not self.spec.run_id or self.registration is None:
            self.register()
        return self.spec

    def summary(self, all_sidecars: Sequence[str] | None = None) -> JobReport:
        """This run's counts summed over ``all_sidecars`` (default: the driver's sidecar).

        Processed counts of failure-free partitions reach the sidecar late (see `_runtime`), so
        ``records_processed`` may lag while the job runs. An unreachable sidecar raises.
        """
        if self.registration is None and self.report is not None:
            return self.report  # closed: its final counts
        run = self._task_spec().run
        out = JobReport(self.name, run_id=run.run_id)
        for target in all_sidecars or [self.spec.driver_target()]:
            client = self._client(target)
            out.add(client.target, client.job_summary(run))
        return out

    def close(self, timeout_s: float | None = None) -> JobReport | None:
        """End this run: EndJob at its home, which waits (up to ``timeout_s``, default
        ``flush_timeout_s``) for the run's DLQ records and releases the run there and on every
        node sidecar that registered it. Returns the final counts (also kept in ``report``);
        None when the run was never registered. Idempotent."""
        if self.registration is None:
            return self.report
        run = self.spec.run
        client = self._client()
        answer = client.end_job(run, timeout_s=timeout_s or self.spec.flush_timeout_s)
        out = JobReport(self.name, run_id=run.run_id)
        for i, s in enumerate(answer.summaries):
            out.add(client.target if i == 0 else (s.sidecar_id or f"node-{i}"), s)
        if answer.unreachable:
            _log.warning("spillway: job %r run %r: node sidecar(s) %s could not be reached to "
                         "release the run; they end it on their idle timeout", self.name,
                         run.run_id, ", ".join(answer.unreachable))
        out.unreachable = list(answer.unreachable)
        with _driver_lock:
            _driver_runs.pop((self.spec.driver_target(), self.name, run.run_id), None)
        self.registration = None
        self.report = out
        return out

    @staticmethod
    def failure_message(exc: BaseException) -> str:
        """The real cause inside a failed Spark action's exception.

        Spark wraps the executor's Python exception (with its traceback) in its own ("An
        exception was thrown from the Python worker", a Py4J error, a SparkException ...). This
        finds the last spillway error in it, e.g. ``ToleranceExceededError: spillway job
        'orders' failed in stage TRANSFORMATION: ...``; else the exception that ended the last
        Python traceback in it, e.g. ``pyarrow.lib.ArrowInvalid: Could not convert ...``; else
        the exception's first line.
        """
        if isinstance(exc, SpillwayClientError):
            return f"{type(exc).__name__}: {exc}"
        texts, seen = [], set()
        cur: BaseException | None = exc
        while cur is not None and id(cur) not in seen:   # Spark's wrappers chain the cause
            seen.add(id(cur))
            texts.append(str(cur))
            cur = cur.__cause__ or cur.__context__
        text = "\n".join(texts)
        found = _SPILLWAY_ERROR.findall(text)
        if found:
            name, message = found[-1]
            return f"{name}: {message.strip()}"
        raised = _traceback_exception(text)
        if raised:
            return raised
        lines = [ln.strip() for ln in texts[0].splitlines() if ln.strip()]
        return lines[0] if lines else type(exc).__name__

    # --- wrappers ---------------------------------------------------------------------------

    def _wrapper(self, fn: Callable, name: str | None, stage: str | int,
                 custom_stage: str = "") -> WrapperSpec:
        if not callable(fn):
            raise TypeError(f"expected a function, got {type(fn).__name__}")
        tp, ts = report.trace_context()  # executors' spans join the driver's trace, if any
        return WrapperSpec(name=_wrapper_name(fn, name), stage=StageRef.of(stage, custom_stage),
                           function_name=report.qualified_name(fn), traceparent=tp,
                           tracestate=ts)

    def map_partitions(self, data: Any, fn: Callable[[Any], Any], *, schema: Any = None,
                       stage: str | int = "TRANSFORMATION", custom_stage: str = "",
                       record_id: Callable[[Any], str] | None = None,
                       source: Callable[[Any], Any] | None = None, name: str | None = None,
                       flat: bool = False, refresh: Callable[[], None] | None = None) -> Any:
        """Run ``fn(row)`` on every record, per partition, inside the verdict loop.

        ``data``: an RDD (returns an RDD) or a DataFrame (returns a DataFrame with ``schema``,
        default the input's; rows are ``pyspark.sql.Row``; ``fn`` returns a Row, tuple or dict;
        works on streaming DataFrames too). ``flat=True``: ``fn`` returns an iterable of
        outputs. ``record_id(row)``: your own stable id; ``source(row)``: a mapping with the
        Kafka columns (topic, partition, offset, key, value, headers, timestamp) when the row
        does not carry them itself. ``name``: the wrapper's name in record ids (default: the
        function's qualified name). ``refresh``: called before re-running a refresh-retriable
        record.
        """
        _require("map_partitions: data", data, rdd=True)
        wrapper = self._wrapper(fn, name, stage, custom_stage)
        if _is_dataframe(data):
            in_schema = data.schema
            out_schema = _struct(schema) if schema is not None else in_schema
            run = functools.partial(_df_partition, self._task_spec(), wrapper, fn, flat, record_id,
                                    source, refresh, in_schema, out_schema)
            return data.mapInArrow(run, out_schema)
        if schema is not None:
            raise ValueError("schema: only for DataFrames (an RDD's records have no schema)")
        run = functools.partial(_rdd_partition, self._task_spec(), wrapper, fn, flat, record_id, source,
                                refresh)
        return data.mapPartitions(run)

    def reprocess(self, dlq_df: Any, fn: Callable[[Any], Any], *, schema: Any = None,
                  max_redrives: int = 3, stage: str | int = "TRANSFORMATION",
                  custom_stage: str = "", name: str | None = None, flat: bool = False,
                  refresh: Callable[[], None] | None = None) -> Any:
        """Run a fixed ``fn`` over dead-lettered records (a `read_dlq` DataFrame) under this
        job's policy: what now succeeds is the returned DataFrame (``schema``, default Spark's
        Kafka source schema, which is what ``fn``'s rows have: the original key, value and
        headers); what still fails is dead-lettered again with its history
        (``spillway.redrive.count``, ``spillway.redrive.of``). Records already sent round
        ``max_redrives`` times, and context-only ones, are left out (loop protection, as
        `spillway dlq redrive` has it). See `spillway.spark._reprocess`."""
        from ._reprocess import redrive_frame, redrive_record_id

        if isinstance(max_redrives, bool) or not isinstance(max_redrives, int) \
                or max_redrives < 1:
            raise ValueError(f"max_redrives: expected an int >= 1, got {max_redrives!r}")
        if not _is_dataframe(dlq_df):
            raise TypeError("dlq_df: expected a DataFrame from spillway.spark.read_dlq")
        rows = redrive_frame(dlq_df, max_redrives)
        return self.map_partitions(rows, fn, schema=schema, stage=stage,
                                   custom_stage=custom_stage, name=name, flat=flat,
                                   refresh=refresh, record_id=redrive_record_id)

    def map_in_pandas(self, df: Any, fn: Callable[[Any], Any], schema: Any, *,
                      stage: str | int = "TRANSFORMATION", custom_stage: str = "",
                      record_id: Callable[[Any], str] | None = None,
                      source: Callable[[Any], Any] | None = None, name: str | None = None,
                      refresh: Callable[[], None] | None = None) -> Any:
        """``df.mapInPandas`` with ``fn(pandas.DataFrame) -> pandas.DataFrame`` per Arrow batch.

        The happy path is one call per batch. When ``fn`` raises, the batch is bisected until
        the failing rows are isolated; only those are reported, the rest still flow. ``fn``
        must therefore be row-wise (map, filter, explode: the output of a batch is the
        concatenation of the outputs of its parts), not an aggregate over the batch.
        """
        _require("map_in_pandas: df", df)
        wrapper = self._wrapper(fn, name, stage, custom_stage)
        out_schema = _struct(schema)
        run = functools.partial(_vector_partition, self._task_spec(), wrapper, fn, "pandas", record_id,
                                source, refresh, out_schema)
        return df.mapInPandas(run, out_schema)

    def map_in_arrow(self, df: Any, fn: Callable[[Any], Any], schema: Any, *,
                     stage: str | int = "TRANSFORMATION", custom_stage: str = "",
                     record_id: Callable[[Any], str] | None = None,
                     source: Callable[[Any], Any] | None = None, name: str | None = None,
                     refresh: Callable[[], None] | None = None) -> Any:
        """``df.mapInArrow`` with ``fn(pyarrow.RecordBatch) -> RecordBatch | Table`` per batch;
        failures isolated by bisection, as in `map_in_pandas`."""
        _require("map_in_arrow: df", df)
        wrapper = self._wrapper(fn, name, stage, custom_stage)
        out_schema = _struct(schema)
        run = functools.partial(_vector_partition, self._task_spec(), wrapper, fn, "arrow", record_id,
                                source, refresh, out_schema)
        return df.mapInArrow(run, out_schema)

    def deserialize(self, df: Any, *, key: Callable[[bytes | None], Any] | str | None = None,
                    key_type: Any = "string",
                    value: Callable[[bytes | None], Any] | str | None = None,
                    value_type: Any = "string", record: Callable[[Any], Any] | None = None,
                    record_type: Any = None, key_column: str = "parsed_key",
                    value_column: str = "parsed_value", record_column: str = "parsed",
                    name: str | None = None, refresh: Callable[[], None] | None = None,
                    key_options: Mapping[str, Any] | None = None,
                    value_options: Mapping[str, Any] | None = None) -> Any:
        """Deserialize a DataFrame with Spark's Kafka source schema (batch or streaming).

        ``key(bytes)`` (stage KEY_CONVERTER) and ``value(bytes)`` (VALUE_CONVERTER) get the raw
        bytes (or None); ``record(row)`` (DESERIALIZATION) gets the whole source row. Their
        results are added as ``key_column`` / ``value_column`` / ``record_column`` of the given
        Spark types; the original key, value, headers, timestamp and coordinates stay, so the
        DLQ gets the original bytes and later stages keep the coordinates. A record failing in
        any step is reported with that step's stage and function, and so is a record whose
        result does not fit the step's declared type (an ``OutputSchemaError`` naming the
        field: a data error, never a task killed by the Arrow conversion).

        Native formats: ``key`` / ``value`` may be ``"json"``, ``"csv"`` or ``"avro"`` instead
        of a function: Spark parses them itself (``from_json`` / ``from_csv`` into
        ``key_type`` / ``value_type``, a struct type, or for JSON an array or map type;
        ``from_avro`` with ``value_type`` the Avro schema as a JSON string, which needs the
        spark-avro package) in PERMISSIVE mode, with ``key_options`` / ``value_options`` as
        the reader options. Only the rows Spark marks corrupt reach Python, where they are
        reported (function ``spark:from_json`` ..., a `CorruptRecordError`: a data error) and
        dead-lettered with their original bytes; the other rows never leave the JVM. See
        `spillway.spark._native` for the plan and its cost (the input is read twice). With a
        Python ``key`` / ``record`` as well, Spark's parse runs first and the Python steps run
        on the rows it parsed.
        """
        from pyspark.sql.types import StructField, StructType

        _require("deserialize: df", df)
        steps: list[Deserializer] = []
        fields: list = []
        native, native_types = self._native_steps(
            (("key", key, key_type, key_column, "KEY_CONVERTER", key_options),
             ("value", value, value_type, value_column, "VALUE_CONVERTER", value_options)))
        for part, fn, dtype, column, stage in (
                ("key", key, key_type, key_column, "KEY_CONVERTER"),
                ("value", value, value_type, value_column, "VALUE_CONVERTER"),
                ("record", record, record_type, record_column, "DESERIALIZATION")):
            if fn is None or isinstance(fn, str):
                continue
            if not callable(fn):
                raise TypeError(f"{part}: expected a function, got {type(fn).__name__}")
            if dtype is None:
                raise ValueError(f"{part}_type: required with {part}=")
            spark_type = _datatype(dtype)
            steps.append(Deserializer(part, fn, StageRef.of(stage), report.qualified_name(fn),
                                      check=value_checker(spark_type, column, stage)))
            fields.append(StructField(column, spark_type, True))
        if not steps and not native:
            raise ValueError("deserialize: give at least one of key=, value=, record=")
        missing = [c for c in ("key", "value", *KAFKA_COORDINATES) if c not in df.columns]
        if missing:
            raise ValueError(f"deserialize: the DataFrame lacks the Kafka source columns "
                             f"{missing}; expected Spark's Kafka source schema (key, value, "
                             f"topic, partition, offset, timestamp, timestampType, headers)")
        names = [f.name for f in fields] + [n.column for n in native]
        clash = [n for n in names if n in df.columns]
        if clash or len(set(names)) < len(names):
            raise ValueError(f"deserialize: output column(s) {clash or names} already exist or "
                             f"repeat; choose other key_column / value_column / record_column "
                             f"names")
        if native:
            df = self._native_deserialize(df, native, native_types, name)
            if not steps:
                return df
        first = steps[0]
        wrapper = self._wrapper(first.fn, name or "deserialize:" + "+".join(
            f"{s.part}={s.function_name}" for s in steps), "DESERIALIZATION")
        wrapper = WrapperSpec(wrapper.name, StageRef.of("DESERIALIZATION"),
                              ",".join(s.function_name for s in steps), wrapper.traceparent,
                              wrapper.tracestate)
        new_schema = StructType(fields)
        out_schema = StructType(list(df.schema.fields) + fields)
        run = functools.partial(_deserialize_partition, self._task_spec(), wrapper, steps, df.schema,
                                new_schema, refresh)
        return df.mapInArrow(run, out_schema)

    def _native_steps(self, parts):
        """The key / value steps given as a format name (see `_native`), with their types."""
        from ._native import FORMATS, NativeStep, options_of

        steps, types = [], []
        for part, fn, dtype, column, stage, options in parts:
            if not isinstance(fn, str):
                if options is not None:
                    raise ValueError(f"{part}_options: only with a native format "
                                     f"({part}={' / '.join(map(repr, FORMATS))})")
                continue
            fmt = fn.strip().lower()
            if fmt not in FORMATS:
                raise ValueError(f"{part}: unknown format {fn!r}; a function, or one of "
                                 f"{', '.join(map(repr, FORMATS))} (parsed by Spark)")
            opts = options_of(part, options)
            if fmt == "avro":
                import json

                try:
                    json.loads(dtype if isinstance(dtype, str) else "")
                except ValueError:
                    raise ValueError(f"{part}_type: with {part}='avro', the Avro schema as a "
                                     f"JSON string, got {dtype!r}") from None
                spark_type, text = None, dtype
            else:
                if dtype is None:
                    raise ValueError(f"{part}_type: required with {part}={fmt!r}")
                spark_type = _datatype(dtype)
                text = spark_type.simpleString()
                names = [f.name for f in getattr(spark_type, "fields", [])]
                if _native_corrupt_field() in names:
                    raise ValueError(f"{part}_type: the field name {_native_corrupt_field()} "
                                     f"is spillway's corrupt-record field; rename yours")
            steps.append(NativeStep(part, fmt, StageRef.of(stage), column, text, opts))
            types.append(spark_type)
        return steps, types

    def _native_deserialize(self, df, steps, types, name):
        from ._native import native_deserialize, report_partition
        from ._runtime import TaskSession

        spec = self._task_spec()
        tp, ts = report.trace_context()
        wrapper = WrapperSpec(
            name or "deserialize:" + "+".join(f"{s.part}={s.function_name}" for s in steps),
            StageRef.of("DESERIALIZATION"), ",".join(s.function_name for s in steps), tp, ts)
        counting = TaskSession._ratio_limited(self.effective_properties or {})
        run = functools.partial(report_partition, spec, wrapper, tuple(steps))
        return native_deserialize(df, steps, types, run, counting)

    def udf(self, returnType: Any = "string", *, error_column: bool = False,
            stage: str | int = "TRANSFORMATION", custom_stage: str = "",
            record_id: Callable[..., str] | None = None, name: str | None = None,
            refresh: Callable[[], None] | None = None) -> Callable[[Callable], Any]:
        """Decorator: a scalar Python UDF whose failures become null (and a report).

        With ``error_column=True`` the UDF returns ``struct<value: returnType, error:
        struct<record_id, stage, exception_class, message, reason: string, dead_lettered:
        boolean>>`` instead, ``error`` being null for good rows. RETRY verdicts wait and call
        the function again for that row; FAIL fails the task. A UDF sees no partition end, so
        each skipped record is followed by its own FlushTask (the flush barrier), and its span
        covers that one row. Record ids are positional per task unless ``record_id(*args)`` is
        given (or the UDF's single argument is a struct with the Kafka columns).
        """
        from pyspark.sql.functions import udf as spark_udf
        from pyspark.sql.types import BooleanType, StringType, StructField, StructType

        dtype = _datatype(returnType)
        if error_column:
            error_type = StructType([StructField(n, StringType(), True) for n in (
                "record_id", "stage", "exception_class", "message", "reason")]
                + [StructField("dead_lettered", BooleanType(), True)])
            dtype = StructType([StructField("value", dtype, True),
                                StructField("error", error_type, True)])

        check = value_checker(_datatype(returnType), "value", StageRef.of(
            stage, custom_stage).name, exact=False)

        def decorate(fn: Callable) -> Any:
            wrapper = self._wrapper(fn, name, stage, custom_stage)
            call = _udf_function(self._task_spec(), wrapper, fn, error_column, record_id, refresh,
                                 check=check)
            functools.update_wrapper(call, fn)
            return spark_udf(call, dtype)

        return decorate

    def foreach_partition(self, data: Any, write_fn: Callable[[list], Any], *,
                          batch_size: int = 500, stage: str | int = "SINK",
                          custom_stage: str = "", record_id: Callable[[Any], str] | None = None,
                          source: Callable[[Any], Any] | None = None, name: str | None = None,
                          refresh: Callable[[], None] | None = None,
                          batch_id: int | None = None) -> None:
        """Write a DataFrame or RDD with ``write_fn(rows: list)`` per chunk of ``batch_size``.

        A failed chunk is bisected down to the failing rows, which are reported (stage
        TASK_PUT): retried per the verdicts, dead-lettered when unwritable. Parts of a chunk
        may be written more than once (a chunk that failed half-way is re-written in halves),
        so ``write_fn`` must be idempotent, as Kafka Connect asks of sink tasks.
        """
        wrapper = self._wrapper(write_fn, name, stage, custom_stage)
        self._foreach(data, write_fn, wrapper, batch_size, record_id, source, refresh, batch_id)

    def _foreach(self, data, write, wrapper, batch_size, record_id, source, refresh, batch_id):
        _require("foreach_partition: data", data, rdd=True)
        if batch_size < 1:
            raise ValueError(f"batch_size: must be >= 1, got {batch_size}")
        run = functools.partial(_sink_partition, self._task_spec(), wrapper, write, batch_size,
                                record_id, source, refresh, batch_id)
        data.foreachPartition(run)

    def foreach_batch(self, write_fn: Callable[[list, int], Any], *, batch_size: int = 500,
                      stage: str | int = "SINK", custom_stage: str = "",
                      record_id: Callable[[Any], str] | None = None,
                      source: Callable[[Any], Any] | None = None, name: str | None = None,
                      refresh: Callable[[], None] | None = None,
                      ) -> Callable[[Any, int], None]:
        """A function for ``writeStream.foreachBatch``: each micro-batch is written with
        ``write_fn(rows, batch_id)`` per chunk, as in `foreach_partition`.

        It returns only once every task of the micro-batch passed its flush barrier, i.e. once
        the DLQ records of the batch are acknowledged by Kafka, so Structured Streaming commits
        the batch only then. Record ids carry the micro-batch id.
        """
        self._wrapper(write_fn, name, stage, custom_stage)  # check the arguments now
        if batch_size < 1:
            raise ValueError(f"batch_size: must be >= 1, got {batch_size}")

        def for_each_batch(batch_df: Any, batch_id: int) -> None:
            wrapper = self._wrapper(write_fn, name, stage, custom_stage)
            self._foreach(batch_df, functools.partial(_with_batch_id, write_fn, batch_id),
                          wrapper, batch_size, record_id, source, refresh, batch_id)

        return for_each_batch
