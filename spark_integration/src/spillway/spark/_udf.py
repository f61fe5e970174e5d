"""Executor side of `Job.udf`: the per-row function Spark calls, its per-task-attempt state
(a UDF sees no partition end: its row count and session live per attempt of each worker
process), and the failure path of one row (report, verdict, retry in place, flush barrier).

A task attempt that follows one whose worker died (`_isolation`) calls the user's function
through a `_guard.Guard` for every row: the per-row function's ``fn`` is swapped when the
attempt is entered, so the happy path runs exactly as before."""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pyspark import TaskContext

from spillway.client import extensions
from spillway.client.columns import Failure
from spillway.v1 import sidecar_pb2 as pb

from ._collector import wrapper_ended, wrapper_started
from ._engine import Unit, follow, reported, trim_traceback
from ._isolation import TaskIsolation, begin_task
from ._plan import WrapperPlan
from ._records import context_of, positional_record_id
from ._runtime import JobSpec, TaskSession, WrapperSpec
from ._taskinfo import current_batch_id, current_task
from ._task_end import at_task_end

try:
    from ._udfcall import Call as _NativeCall, RowCounter
except ImportError:   # installed without a C compiler: the per-row function in Python
    _NativeCall = None

    class RowCounter:  # type: ignore[no-redef]
        """A task attempt's row count, shared by the uses of one UDF (`_udfcall.RowCounter`)."""

        __slots__ = ("value",)

        def __init__(self, value: int = 0) -> None:
            self.value = value


class _UdfState:
    """A UDF's state in the current task attempt of this worker (UDFs see no partition end):
    the rows it was called on (row index and processed count) and, once needed, a session."""

    __slots__ = ("pid", "tid", "tc", "task", "counter", "_session", "spec", "wrapper",
                 "isolation", "isolated", "run")

    def __init__(self, spec: JobSpec, wrapper: WrapperSpec, tid: int, tc: Any = None,
                 fn: Callable | None = None) -> None:
        self.pid = os.getpid()
        self.tid = tid
        self.tc = tc  # Spark's TaskContext object of the attempt (held: its id is not reused)
        self.task = t = current_task()  # once per task attempt: later it names another task
        self.counter = RowCounter()  # the rows it was called on (the per-row function counts)
        self._session: TaskSession | None = None
        self.spec, self.wrapper = spec, wrapper
        self.isolation: TaskIsolation = begin_task(
            (spec.run_id, spec.name, wrapper.name, wrapper.use, current_batch_id(), t.stage_id,
             t.partition_id), t.attempt_number, spec.record_timeout_ms,
            f"UDF {wrapper.name} in partition {t.partition_id} (attempt {t.attempt_number})")
        # the user's function through a helper process (an attempt that runs guarded) or timed
        # by the watchdog (a record timeout): what a retry in place calls too
        self.isolated: Callable | None = (self.isolation.wrap(fn) if fn is not None
                                         and self.isolation.wraps else None)
        self.run = self.isolated or fn  # what each row of the attempt calls
        wrapper_started(spec.gc_young_threshold)  # until `retire`

    @property
    def rows(self) -> int:
        return self.counter.value

    @property
    def session(self) -> TaskSession:
        if self._session is None:
            self._session = TaskSession(self.spec, self.wrapper, task=self.task,
                                        open_span=False)
        self._session.own[self.wrapper.stage.key] = self.rows
        return self._session

    def retire(self, final: bool = False) -> None:
        """The task attempt is over: send its unsent counts when ``final`` (the task's end) or
        once due, else park them for a later call."""
        if self.pid != os.getpid():
            return
        try:
            if self.rows:
                self.session.park_counts(final=final)
        finally:
            wrapper_ended()
            self.isolation.end(True)


_udf_states: dict[tuple[str, str], _UdfState] = {}


def _udf_task_end() -> None:
    """The worker ended a task (`_task_end.at_task_end`): send its UDFs' counts now."""
    for key, st in list(_udf_states.items()):
        if st.pid == os.getpid():
            del _udf_states[key]
            st.retire(final=True)


def _udf_state(spec: JobSpec, wrapper: WrapperSpec, tid: int, tc: Any = None,
               fn: Callable | None = None) -> _UdfState:
    """The UDF's state for task attempt ``tid`` in this process; a state of an earlier attempt
    is retired (one inherited through a fork is dropped as it is)."""
    key = (spec.name, wrapper.name)
    old = _udf_states.get(key)
    if old is not None and old.tid == tid and old.pid == os.getpid():
        old.tc = tc
        return old  # the same UDF applied twice in one task: one row count, distinct ids
    if old is not None:
        old.retire()
    st = _udf_states[key] = _UdfState(spec, wrapper, tid, tc, fn)
    return st


@dataclass(frozen=True)
class _Skipped:
    record: Failure
    verdict: pb.Verdict


def udf_function(plan: WrapperPlan, fn: Callable, error_column: bool,
                 check: Callable[[Any], None] | None = None) -> Callable:
    """The per-row function Spark calls. Per row it only checks that the task attempt is the
    same (Spark sets a new TaskContext object for each task it runs in a worker: an identity
    check, the attempt id being read only when it changes) and counts the row before calling
    ``fn``; everything else happens on a failure (`_RowFailure`; ``plan.record_id(*args)``:
    a row's own id). ``check(result)`` raises when a result does not fit the declared return
    type (Spark would turn it into a silent null): that row fails like one whose ``fn`` raised.

    Where the extension is built and pyspark's TaskContext has its usual layout, the function
    is `_udfcall.Call`: the same steps in C, pickled as these arguments (an executor without
    the extension, or with ``SPILLWAY_NO_EXTENSIONS=udfcall``, rebuilds it in Python; the same
    variable where the UDF is made makes it Python there)."""
    spec, wrapper = plan.spec, plan.wrapper
    holder: list[_UdfState | None] = [None]  # unpickled afresh with the UDF on the executor
    tc_class = TaskContext

    def enter() -> _UdfState:
        tc = tc_class.get()
        if tc is None:
            raise RuntimeError(
                f"spillway UDF {wrapper.function_name} was called outside a Spark task: apply "
                f"it to a column in a DataFrame (df.select(udf(df.col))); called directly it "
                f"has no task to report failures for")
        tid = tc.taskAttemptId()
        at_task_end(_udf_task_end)  # once per process: counts sent as each task ends
        st = holder[0]
        if st is None or st.tid != tid or st.pid != os.getpid():
            st = _udf_state(spec, wrapper, tid, tc, fn)
        st.tc = tc
        holder[0] = st
        return st

    failed = _RowFailure(plan, fn, error_column, check)

    # The per-row cost is what the happy path pays: read the class attribute that
    # TaskContext.get() returns (a method call costs more than the rest of the check), and
    # call a one-argument function without packing *args (half of the remaining overhead).
    direct = hasattr(tc_class, "_taskContext")  # pyspark's layout; else the public accessor
    current = (lambda: tc_class._taskContext) if direct else tc_class.get
    # The result check's fast test (a type, and a range for integers), inlined: calling it
    # was half of the per-row overhead. Anything it does not pass (None too) asks `check`;
    # without a fast test (or a check) every result does.
    fast = getattr(check, "fast_type", None)
    kind, bounds = fast or (_NoFastTest, None)
    bounded = bounds is not None
    lo, hi = bounds or (0, 0)
    verify = check if check is not None else _accept
    if extensions.enabled("udfcall") and direct and _NativeCall is not None:
        def enter_native():
            st = enter()
            if native_call.fn is not st.run:  # the attempt's: ``fn``, or ``fn`` guarded
                native_call.fn = st.run
            return st, st.tc, st.counter

        mode = 0 if check is None else 2 if fast else 1
        native_call = _NativeCall(fn, mode, kind, bounded, lo, hi, verify, tc_class,
                                  enter_native, failed, error_column,
                                  (udf_function, (plan, fn, error_column, check)), RowCounter)
        # the Python function's own signature: pyspark reads it (getfullargspec) to choose the
        # UDF's evaluation type, and warns on a callable it cannot read
        native_call.__signature__ = _ONE_ARGUMENT if single_argument(fn) else _ANY_ARGUMENTS
        return native_call
    if direct and single_argument(fn):
        def call(arg):
            st = holder[0]
            if st is None or st.tc is not tc_class._taskContext:
                st = enter()
            c = st.counter
            index = c.value
            c.value = index + 1
            try:
                out = st.run(arg)
                if type(out) is not kind or bounded and not lo <= out <= hi:
                    verify(out)
            except Exception as exc:  # noqa: BLE001 - user code
                return failed(st, (arg,), index, exc)
            return (out, None) if error_column else out
    else:
        def call(*args):
            st = holder[0]
            if st is None or st.tc is not current():
                st = enter()
            c = st.counter
            index = c.value
            c.value = index + 1
            try:
                out = st.run(*args)
                if check is not None:
                    check(out)
            except Exception as exc:  # noqa: BLE001 - user code
                return failed(st, args, index, exc)
            return (out, None) if error_column else out

    return call


_ONE_ARGUMENT = inspect.Signature([inspect.Parameter("arg",
                                                    inspect.Parameter.POSITIONAL_OR_KEYWORD)])
_ANY_ARGUMENTS = inspect.Signature([inspect.Parameter("args", inspect.Parameter.VAR_POSITIONAL)])


class _NoFastTest:
    """A type no result has: every result goes to the check."""


def _accept(_value: Any) -> None:
    """No check."""


def single_argument(fn: Callable) -> bool:
    """Whether Spark can only ever call ``fn`` with exactly one column."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # builtins without a signature
        return False
    return (len(params) == 1 and params[0].default is inspect.Parameter.empty
            and params[0].kind in (inspect.Parameter.POSITIONAL_ONLY,
                                   inspect.Parameter.POSITIONAL_OR_KEYWORD))


@dataclass(frozen=True)
class _RowFailure:
    """What a UDF does with a row whose ``fn`` raised (the per-row function's ``failed``):
    report it, follow the verdict (`_engine.follow`, as every wrapper does), retry in place
    (through the attempt's guard when it has one; ``check`` the result as the row did)."""

    plan: WrapperPlan
    fn: Callable
    error_column: bool
    check: Callable[[Any], None] | None = None

    def __call__(self, st: _UdfState, args: tuple, index: int, exc: Exception) -> Any:
        """The row's result: its value once a retry succeeds, else null (with the error
        struct when ``error_column``)."""
        outcome = self._outcome(st, args, index, exc)
        if not isinstance(outcome, _Skipped):
            return (outcome, None) if self.error_column else outcome
        if not self.error_column:
            return None
        info = outcome.record.exception
        return (None, (outcome.record.record_id, self.plan.wrapper.stage.name, info.class_name,
                       info.message, outcome.verdict.reason, outcome.verdict.dead_lettered))

    def _outcome(self, st: _UdfState, args: tuple, index: int, exc: Exception) -> Any:
        import time

        spec, wrapper, record_id = self.plan.spec, self.plan.wrapper, self.plan.record_id
        session = st.session
        trim_traceback(exc)
        subject = args[0] if len(args) == 1 else list(args)
        # a UDF is decorated once and used in many queries: the Spark stage it runs in tells
        # the uses apart (the same for every attempt of a task; a second action re-running the
        # query gets new ids: a duplicate DLQ record at worst, never a lost one)
        ctx = context_of(subject, lambda: positional_record_id(
            wrapper.stage.name, spec.name, wrapper.name, session.task.partition_id, index,
            batch_id=current_batch_id(), use=f"{wrapper.use}s{session.task.stage_id}"),
            (lambda _row: record_id(*args)) if record_id is not None else None)
        session.begin_span()
        unit = Unit(args, 1, index)
        error = None
        try:
            while True:
                unit.exc = exc
                unit.record = reported(session, ctx, exc, wrapper.stage, wrapper.function_name,
                                       unit.attempt)
                verdict = session.report([unit.record])[0]
                if not follow(session, [unit], [verdict]):   # skipped: dead-lettered
                    session.flush()  # the flush barrier: no later hook in a UDF
                    return _Skipped(unit.record, verdict)
                time.sleep(verdict.retry_delay_ms / 1000.0)
                if verdict.category == pb.CATEGORY_REFRESH_RETRIABLE \
                        and self.plan.refresh is not None:
                    self.plan.refresh()
                try:
                    value = (st.isolated or self.fn)(*args)
                    if self.check is not None:
                        self.check(value)
                except Exception as again:  # noqa: BLE001 - user code
                    exc = trim_traceback(again)
                    continue
                session.recovered(unit.record.record_id)
                session.flush()
                return value
        except BaseException as e:
            error = e
            st.isolation.end(False)  # the task fails here, its process lives: not a death
            raise
        finally:
            session.end_span(error)
