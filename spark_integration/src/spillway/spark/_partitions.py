"""Executor side of the DataFrame and RDD wrappers: one function per wrapper kind, run by Spark
once per partition (module-level, so pickled by reference), each driving the verdict loop
(`_engine.Engine`) over its rows or batches inside a `TaskSession` (reports, counts, the flush
barrier at the partition's end). `job.Job` builds them with `functools.partial` over one
`WrapperPlan` (the job, the wrapper, the user's hooks) and what is particular to the kind.

Each partition is also a task attempt that may follow one whose worker a record killed: its
`_isolation.TaskIsolation` says so, and then its user functions run guarded (`_guard`)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from spillway.v1 import sidecar_pb2 as pb

from ._adapters import (
    BatchAdapter,
    DeserializeAdapter,
    RowAdapter,
    SinkAdapter,
    batch_outputs,
    batch_units,
    chunk_units,
    listed,
    unvalued,
)
from ._arrow_rows import RowsOf
from ._collector import wrapper_ended, wrapper_started
from ._compat import arrow_conversions
from ._engine import Engine, StageRef, Unit
from ._isolation import TaskIsolation, begin_task
from ._records import positional_ids
from ._plan import WrapperPlan
from ._runtime import JobSpec, TaskSession, WrapperSpec, worker
from ._taskinfo import current_batch_id, current_task
from ._schema import arrow_conformer, pandas_checker, row_checker

_log = logging.getLogger("spillway.spark")

#: Rows per Arrow batch the DataFrame wrappers emit.
OUTPUT_BATCH_ROWS = 4096



def record_ids(spec: JobSpec, wrapper: WrapperSpec, task: pb.TaskIdentity, batch_id: Any = None):
    batch = batch_id if batch_id is not None else current_batch_id()
    return positional_ids(wrapper.stage.name, spec.name, wrapper.name, task.partition_id,
                          batch_id=batch, use=wrapper.use)


def isolation(plan: WrapperPlan, task: pb.TaskIdentity, batch_id: Any = None) -> TaskIsolation:
    """This task attempt's isolation (its crumb; guarded when an earlier attempt died)."""
    spec, wrapper = plan.spec, plan.wrapper
    batch = batch_id if batch_id is not None else current_batch_id()
    return begin_task((spec.run_id, spec.name, wrapper.name, wrapper.use, batch, task.stage_id,
                       task.partition_id), task.attempt_number, spec.record_timeout_ms,
                      f"partition {task.partition_id} of {wrapper.name} (attempt "
                      f"{task.attempt_number})")


def make_engine(plan: WrapperPlan, session: TaskSession, adapter: Any,
                count_stages: Sequence[StageRef] | None = None) -> Engine:
    spec, wrapper, w = plan.spec, plan.wrapper, worker()
    return Engine(session, adapter, stage=wrapper.stage, function_name=wrapper.function_name,
                  count_stages=count_stages, batch_size=spec.report_batch_size,
                  linger_s=spec.report_linger_s, refresh=plan.refresh, submit=w.submit,
                  max_inflight=spec.report_max_inflight, max_bytes=spec.report_max_bytes,
                  wake=w.waker.at)


def drive(session: TaskSession, engine: Engine, outputs: Iterator[Any],
          iso: TaskIsolation | None = None) -> Iterator[Any]:
    """Run the loop over a partition (``outputs``: engine.run or engine.run_rows); close the
    session (flush barrier) when it ends, then the attempt's isolation (none where no user
    code runs). While it runs, the collector's young generation is collected less often
    (`_collector`)."""
    ok, error = False, None
    wrapper_started(session.spec.gc_young_threshold)
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
        try:
            session.close(ok, error)
        except BaseException:
            ok = False
            raise
        finally:
            wrapper_ended()
            if iso is not None:
                iso.end(ok)


def rdd_partition(plan: WrapperPlan, fn, flat, iterator):
    session = TaskSession(plan.spec, plan.wrapper)
    iso = isolation(plan, session.task)
    ids = record_ids(plan.spec, plan.wrapper, session.task)
    fn = iso.wrap(listed(fn)) if iso.wraps and flat else iso.wrap(fn)
    adapter = RowAdapter(fn, ids=ids, flat=flat, record_id=plan.record_id, source=plan.source)
    engine = make_engine(plan, session, adapter)
    return drive(session, engine, engine.run_rows(iterator), iso)


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


def df_partition(plan: WrapperPlan, fn, flat, in_schema, out_schema, batches, *, ledger=None):
    ArrowTableToRowsConversion, _ = arrow_conversions()
    rows_of = RowsOf(in_schema, ArrowTableToRowsConversion.convert)
    seen = {"large": False}

    def rows():
        for b in batches:
            seen["large"] = seen["large"] or _large_types(b)
            yield from rows_of(b)

    spec, wrapper = plan.spec, plan.wrapper
    iso = isolation(plan, current_task())
    checked = iso.wrap(_checked(fn, out_schema, flat, wrapper.stage.name))
    if ledger is not None:  # Job.reprocess: a session that records what it resolved
        session, checked = ledger.bind(spec, wrapper, checked)
    else:
        session = TaskSession(spec, wrapper)
    adapter = RowAdapter(checked, ids=record_ids(spec, wrapper, session.task), flat=flat,
                         record_id=plan.record_id, source=plan.source)
    engine = make_engine(plan, session, adapter)
    outputs = drive(session, engine, engine.run_rows(rows()), iso)
    return _rows_to_batches(outputs, out_schema, lambda: seen["large"])


def _checked(fn, schema, flat, stage):
    """``fn`` whose outputs are checked against ``schema`` (a Row by field name, a dict, or a
    tuple in schema order), so a bad output is that record's failure, not the task's."""
    normalize = row_checker(schema, stage)

    def run(row):
        out = fn(row)
        return [normalize(o) for o in out] if flat else normalize(out)

    return run


def vector_partition(plan: WrapperPlan, fn, kind, out_schema, batches):
    spec, wrapper = plan.spec, plan.wrapper
    session = TaskSession(spec, wrapper)
    iso = isolation(plan, session.task)
    if iso.wraps:
        fn = iso.wrap(batch_outputs(fn, kind))
    conform = (arrow_conformer if kind == "arrow" else pandas_checker)(out_schema,
                                                                       wrapper.stage.name)
    adapter = BatchAdapter(fn, kind, ids=record_ids(spec, wrapper, session.task),
                           record_id=plan.record_id, source=plan.source, conform=conform)
    engine = make_engine(plan, session, adapter)
    return drive(session, engine, engine.run(batch_units(batches)), iso)


def deserialize_partition(plan: WrapperPlan, steps, in_schema, new_schema, batches):
    import pyarrow as pa
    ArrowTableToRowsConversion, to_arrow = arrow_conversions()

    parts = {s.part for s in steps}
    rows_of = RowsOf(in_schema, ArrowTableToRowsConversion.convert)
    cache: dict[str, Any] = {"batch": None, "rows": None}
    seen = {"large": False}

    def to_row(batch, i):
        if cache["batch"] is not batch:
            cache["rows"] = rows_of(batch)
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

    session = TaskSession(plan.spec, plan.wrapper)
    iso = isolation(plan, session.task)
    if iso.wraps:
        steps = [s.with_fn(iso.wrap(s.fn)) for s in steps]
    adapter = DeserializeAdapter(steps, ids=record_ids(plan.spec, plan.wrapper, session.task),
                                 to_row=to_row)
    engine = make_engine(plan, session, adapter, count_stages=[s.stage for s in steps])
    outputs = drive(session, engine, engine.run(units()), iso)
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


def sink_partition(plan: WrapperPlan, write_fn, chunk, batch_id, rows):
    session = TaskSession(plan.spec, plan.wrapper)
    iso = isolation(plan, session.task, batch_id)
    if iso.wraps:
        write_fn = iso.wrap(unvalued(write_fn))
    adapter = SinkAdapter(write_fn, ids=record_ids(plan.spec, plan.wrapper, session.task,
                                                   batch_id),
                          record_id=plan.record_id, source=plan.source)
    engine = make_engine(plan, session, adapter)
    for _ in drive(session, engine, engine.run(chunk_units(rows, chunk)), iso):
        pass


def with_batch_id(write_fn, batch_id, rows):
    return write_fn(rows, batch_id)
