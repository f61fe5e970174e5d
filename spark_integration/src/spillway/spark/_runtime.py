"""Executor side: the per-process worker state and the per-task `TaskSession`.

The job's name, policy and sidecar settings travel inside the wrapped closures as a `JobSpec`;
nothing has to be set up on executors beyond the sidecar's address. So does the run the driver
registered: its run id, its home sidecar (address and instance id) and where its job token is
(a `_token.TokenFile`: the token itself is not in the plan, it reaches executors as a Spark
file, read once per worker process; streaming over Spark Connect is the one exception, see
`_token.EscrowedToken`); executors register the run with their node's sidecar with
all of them, and every call for the run carries the token.

Sidecar address on an executor: ``$SPILLWAY_SIDECAR_ADDRESS`` (the executor's environment, i.e.
its node's sidecar; the variable's name travels with the job), else the job's explicit
``sidecar``, else ``127.0.0.1:50051``.

gRPC calls, per partition:

- a partition without failures makes one counts-only FlushTask at its end (and RegisterJob
  once per process per sidecar), so that the job's summary read after the action returns counts
  exactly what the action processed; if that call fails its counts are logged and kept in the
  worker process's accumulator, and ride on the next FlushTask this process sends for the job.
  A UDF sees no partition end of its own: its counts are sent when pyspark's worker ends the
  task (`at_task_end`), so they too are in the summary once the action returns;
- a partition with failures: RegisterJob once per process per sidecar (idempotent), one
  ReportFailures per batch of failures, and one FlushTask at its end (the flush barrier: DLQ
  records acknowledged by Kafka before the task can succeed) carrying the processed counts;
- with a ratio tolerance (``errors.tolerance.max.ratio``), the counts are also sent before a
  report when they grew by more than 10% since last sent, so the ratio's denominator is current.

The sidecar keeps processed counts per Spark task (stage, partition), the latest FlushTask
replacing the earlier ones, so every FlushTask carries the session's cumulative counts, and a
session adopts parked counts only of its own stages (wrappers pipelined in one Spark task flush
under the same task identity). Counts still parked when a worker process exits (a count call
that failed and found no later call) are lost (an undercount: the ratio limit then errs on
the strict side).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Status, StatusCode
from spillway.client import SidecarClient, check_job_name
from spillway.client.client import DEFAULT_TARGET, resolve_target
from spillway.client.columns import Failure
from spillway.client.errors import (
    ADDRESS_ENV,
    JobNotRegisteredError,
    SidecarBackpressureError,
    SidecarUnavailableError,
)
from spillway.client.report import extract_context
from spillway.client.runs import JobRun, JobToken, Registration
from spillway.v1 import sidecar_pb2 as pb

from . import _tracing
from ._collector import YOUNG_THRESHOLD
from ._engine import REPORT_BATCH_SIZE, REPORT_MAX_BYTES, StageRef
from ._taskinfo import current_task
from ._waker import Waker
from ._token import EscrowedToken, TokenFile, claim_client

log = logging.getLogger("spillway.spark")

T = TypeVar("T")

ON_UNAVAILABLE = ("fail", "wait")
#: Counts are re-sent before a report when they grew by more than this since last sent.
COUNTS_GROWTH = 1.10
#: Threads per worker process that send reports in the background (one Spark task runs at a
#: time in a Python worker; wrappers pipelined in it have up to ``report_max_inflight`` reports
#: in flight each; more than the threads wait in the pool's queue, still counted in flight).
REPORT_THREADS = 4
#: Exception events per session span: the span's event limit (``OTEL_SPAN_EVENT_COUNT_LIMIT``,
#: default 128), past which the SDK would drop them anyway. The first ones are kept; later
#: failures are only counted (span attribute ``spillway.exception_events_dropped``), so a
#: partition with many failures does not pay for events that would be dropped.
DEFAULT_EXCEPTION_EVENTS = 128


def exception_event_limit() -> int:
    try:
        return max(0, int(os.environ.get("OTEL_SPAN_EVENT_COUNT_LIMIT", "").strip()
                          or DEFAULT_EXCEPTION_EVENTS))
    except ValueError:
        return DEFAULT_EXCEPTION_EVENTS


@dataclass(frozen=True)
class JobSpec:
    """Everything executors need to know about a job: picklable, travels in the closures."""

    name: str
    properties: tuple[tuple[str, str], ...] = ()
    sidecar: str | None = None
    address_env: str = ADDRESS_ENV
    report_batch_size: int = REPORT_BATCH_SIZE
    report_max_bytes: int = REPORT_MAX_BYTES
    report_linger_s: float = 0.5
    # reports of one wrapper in one task sent and not yet answered (the verdict loop goes on
    # meanwhile; a full batch beyond this waits for the oldest)
    report_max_inflight: int = 2
    counts_interval_s: float = 10.0
    flush_timeout_s: float = 60.0
    rpc_timeout_s: float = 10.0
    on_sidecar_unavailable: str = "fail"
    sidecar_wait_s: float = 120.0
    # The run the driver registered (`Job.register`): its id and credential, and its home
    # sidecar (address and instance id), which decides for every node (job-wide limits). The
    # credential: the `JobToken` itself in the driver's spec (which a JobToken makes
    # unpicklable), the Spark file holding it in every spec shipped to executors (`_token`;
    # an `EscrowedToken` for streaming over Spark Connect).
    home: str = ""
    run_id: str = ""
    job_token: JobToken | TokenFile | EscrowedToken | None = None
    home_instance_id: str = ""
    # the run's effective errors.record.timeout.ms (0: none), set by `Job.register`
    record_timeout_ms: int = 0
    # young collections every this many allocations while a wrapper runs (`_collector`; 0: the
    # worker's collector is left alone)
    gc_young_threshold: int = YOUNG_THRESHOLD

    def __post_init__(self) -> None:
        check_job_name(self.name)  # the sidecar's rule, refused here on the driver
        if self.on_sidecar_unavailable not in ON_UNAVAILABLE:
            raise ValueError(f"on_sidecar_unavailable: must be one of {', '.join(ON_UNAVAILABLE)}"
                             f"; got {self.on_sidecar_unavailable!r}")
        for name in ("report_linger_s", "counts_interval_s", "sidecar_wait_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: must be >= 0, got {getattr(self, name)}")
        if type(self.gc_young_threshold) is not int or self.gc_young_threshold < 0:
            raise ValueError(f"gc_young_threshold: must be an int >= 0 (0: leave the workers' "
                             f"collector alone), got {self.gc_young_threshold!r}")
        for name in ("flush_timeout_s", "rpc_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: must be > 0, got {getattr(self, name)}")
        for name in ("report_batch_size", "report_max_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if isinstance(self.report_max_inflight, bool) or \
                not isinstance(self.report_max_inflight, int) or self.report_max_inflight < 1:
            raise ValueError(f"report_max_inflight: expected an int >= 1, got "
                             f"{self.report_max_inflight!r}")
        if self.sidecar:
            try:  # fail on the driver, not on every executor
                resolve_target(self.sidecar)
            except ValueError as exc:
                raise ValueError(str(exc).replace("target:", "sidecar:", 1)) from None

    @property
    def props(self) -> dict[str, str]:
        return dict(self.properties)

    @property
    def run(self) -> JobRun:
        token = self.job_token
        if isinstance(token, (TokenFile, EscrowedToken)):
            token = token.load()  # a file read (or a claim) once per process, then from memory
        return JobRun(self.name, self.run_id, token)

    def executor_target(self) -> str:
        """The node's sidecar: the executor's environment first, then the job's, then default."""
        env = os.environ.get(self.address_env, "").strip()
        if env:
            return resolve_target(env)
        return resolve_target(self.sidecar) if self.sidecar else DEFAULT_TARGET

    def driver_target(self) -> str:
        """The driver's sidecar: the explicit ``sidecar`` first, then the environment."""
        return resolve_target(self.sidecar, address_env=self.address_env)


@dataclass(frozen=True)
class WrapperSpec:
    """One wrapped user function: its name in record ids and spans, its stage, trace parent."""

    name: str
    stage: StageRef
    function_name: str
    traceparent: str = ""
    tracestate: str = ""
    # which call of the wrapper on the driver this is (`Job._wrapper`): part of record ids, so
    # two calls never share ids while one call's DataFrame evaluated again keeps them
    use: str = ""


# --- per-process state ---------------------------------------------------------------------


class _Worker:
    def __init__(self) -> None:
        self.pid = os.getpid()
        self.lock = threading.Lock()
        self.clients: dict[tuple[str, float, str], SidecarClient] = {}
        self.registered: dict[tuple[str, str, str, tuple], Registration] = {}
        self.counts: dict[tuple[str, ...], Counter] = {}
        self.counts_since: dict[tuple[str, ...], float] = {}
        self._reporter: ThreadPoolExecutor | None = None
        self.waker = Waker()  # ends the verdict loops' lingers (its thread starts when asked)

    def submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        """Run ``fn(*args)`` on this process's reporting threads (reports sent in the background
        while the verdict loop goes on; each loop has a bounded number in flight)."""
        with self.lock:
            if self._reporter is None:
                self._reporter = ThreadPoolExecutor(max_workers=REPORT_THREADS,
                                                    thread_name_prefix="spillway-report")
            pool = self._reporter
        return pool.submit(fn, *args)

    def client(self, target: str, timeout_s: float, address_env: str) -> SidecarClient:
        key = (target, timeout_s, address_env)
        with self.lock:
            c = self.clients.get(key)
            if c is None:
                c = self.clients[key] = SidecarClient(target, timeout_s=timeout_s,
                                                      address_env=address_env)
            return c

    def add_counts(self, key: tuple[str, ...], counts: Mapping[tuple[int, str], int]) -> None:
        if not any(counts.values()):
            return
        with self.lock:
            acc = self.counts.setdefault(key, Counter())
            acc.update({k: v for k, v in counts.items() if v > 0})
            self.counts_since.setdefault(key, time.monotonic())

    def take_counts(self, key: tuple[str, ...], stages: Iterable[tuple[int, str]]) -> Counter:
        """Remove and return the parked counts of ``stages`` only (see `TaskSession._totals`)."""
        with self.lock:
            acc = self.counts.get(key)
            if not acc:
                return Counter()
            taken = Counter({s: acc.pop(s) for s in set(stages) if s in acc})
            if not acc:
                self.counts.pop(key, None)
                self.counts_since.pop(key, None)
            return taken

    def counts_due(self, key: tuple[str, ...], interval_s: float) -> bool:
        with self.lock:
            since = self.counts_since.get(key)
        return since is not None and time.monotonic() - since >= interval_s


_worker_lock = threading.Lock()
_worker: _Worker | None = None


def worker() -> _Worker:
    """This process's state; a forked child starts afresh (counts stay with the parent)."""
    global _worker
    with _worker_lock:
        if _worker is None or _worker.pid != os.getpid():
            _worker = _Worker()
        return _worker


def record_timeout_ms(effective: Mapping[str, str]) -> int:
    """A run's effective ``errors.record.timeout.ms`` (the sidecar validated it)."""
    try:
        return max(0, int(effective.get("errors.record.timeout.ms", "0") or 0))
    except ValueError:
        return 0


def ratio_limited(effective: Mapping[str, str]) -> bool:
    """Whether a run's effective policy has a ratio tolerance (its counts are then sent before
    reports, so the ratio's denominator is current)."""
    try:
        return (effective.get("errors.tolerance") == "all"
                and float(effective.get("errors.tolerance.max.ratio", "-1")) >= 0)
    except ValueError:
        return False


# --- the session ----------------------------------------------------------------------------


class TaskSession:
    """One wrapper's work in one Spark task attempt: reports, counts, flush barrier and span."""

    def __init__(self, spec: JobSpec, wrapper: WrapperSpec, *,
                 task: pb.TaskIdentity | None = None, client: SidecarClient | None = None,
                 span_attributes: Mapping[str, Any] | None = None, open_span: bool = True,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.spec = spec
        self.job = spec.name
        self.wrapper = wrapper
        self.target = client.target if client is not None else spec.executor_target()
        self.client = client or worker().client(self.target, spec.rpc_timeout_s, spec.address_env)
        self.run = spec.run  # the registration's answer replaces it (see `register`)
        self.task = task if task is not None else current_task()
        self._sleep = sleep
        self._key = (self.target, self.job, spec.run_id)
        self.own: Counter = Counter()
        self.adopted: Counter = Counter()
        self.sent: Counter | None = None  # what the sidecar holds for this task (None: nothing)
        self.recovered_ids: list[str] = []
        self._recovered_lock = threading.Lock()  # reports may be sent from another thread
        # reports of one session may be in flight on several threads: the counts sent before a
        # report (ratio tolerance) are read, adopted and sent by one of them at a time
        self._counts_lock = threading.Lock()
        self.failures = 0
        self.events = self.events_dropped = 0  # exception events of the current span
        self._event_limit = exception_event_limit()
        self.skips = 0
        self.reports = 0
        self._span_attributes = dict(span_attributes or {})
        self.span: trace.Span = trace.INVALID_SPAN
        self.trace_context = None
        if open_span:
            self.begin_span()

    def begin_span(self) -> None:
        """Start this session's span: ``spillway.<stage> <function>``."""
        w = self.wrapper
        parent = extract_context(w.traceparent, w.tracestate) if w.traceparent else None
        attrs = {"spillway.job": self.job, "spillway.stage": w.stage.name,
                 "spillway.function": w.function_name,
                 "spark.stage_id": self.task.stage_id,
                 "spark.partition_id": self.task.partition_id,
                 "spark.attempt_number": self.task.attempt_number,
                 "spark.task_attempt_id": self.task.task_attempt_id,
                 "spark.executor_id": self.task.executor_id, **self._span_attributes}
        self.span = _tracing.start_span(_tracing.span_name(w.stage.name, w.function_name),
                                        parent, attrs)
        self.trace_context = trace.set_span_in_context(self.span)
        self.events = self.events_dropped = 0

    def end_span(self, exc: BaseException | None = None) -> None:
        if exc is not None:
            self.span.set_status(Status(StatusCode.ERROR, str(exc)))
        self.span.set_attribute("spillway.records_processed", max(self.own.values(), default=0))
        self.span.set_attribute("spillway.failures", self.failures)
        self.span.set_attribute("spillway.skipped", self.skips)
        if self.events_dropped:
            self.span.set_attribute("spillway.exception_events_dropped", self.events_dropped)
        self.span.end()
        self.span, self.trace_context = trace.INVALID_SPAN, None
        _tracing.flush_exported()

    # --- Session protocol (called by the engine) ------------------------------------------

    def processed(self, stages: Sequence[StageRef], n: int) -> None:
        for s in stages:
            self.own[s.key] += n

    def recovered(self, record_id: str) -> None:
        with self._recovered_lock:
            self.recovered_ids.append(record_id)

    def _take_recovered(self) -> list[str]:
        with self._recovered_lock:
            recovered, self.recovered_ids = self.recovered_ids, []
        return recovered

    def failed(self, exc: BaseException, record: Failure) -> None:
        self.failures += 1
        if not self.span.is_recording():
            return
        if self.events >= self._event_limit:
            self.events_dropped += 1
            return
        self.events += 1
        # The report already carries the formatted trace: reuse it rather than have
        # record_exception() format it again (semantic-convention `exception` event).
        e = record.exception
        self.span.add_event("exception", {
            "exception.type": e.class_name,
            "exception.message": e.message,
            "exception.stacktrace": e.stack_trace,
            "spillway.record_id": record.record_id,
            "spillway.attempt": record.attempt,
            "spillway.stage": pb.Stage.Name(record.stage).removeprefix("STAGE_"),
        })

    def skipped(self, records: Sequence[Failure], verdicts: Sequence[pb.Verdict]) -> None:
        self.skips += len(records)
        if log.isEnabledFor(logging.DEBUG):
            for record, verdict in zip(records, verdicts):
                log.debug("spillway: record %s skipped: %s", record.record_id, verdict.reason)

    def report(self, records: list[Failure]) -> list[pb.Verdict]:
        self.reports += 1
        effective = self.register()
        if ratio_limited(effective):
            with self._counts_lock:
                if self._counts_grew():
                    self.flush()
        recovered = self._take_recovered()
        return self._call(lambda: self.client.report_failures(self.run, self.task, records,
                                                              recovered))

    # --- the rest ---------------------------------------------------------------------------

    @property
    def had_failures(self) -> bool:
        return self.reports > 0

    def _reg_key(self) -> tuple[str, str, str, tuple]:
        return (self.target, self.job, self.spec.run_id, self.spec.properties)

    def _register_call(self) -> Registration:
        spec = self.spec
        escrowed = spec.job_token
        if isinstance(escrowed, EscrowedToken) and escrowed.load() is None:
            # claimed once per process, then used as any token
            claimer = claim_client(self.client)
            try:
                reg = claimer.register_job(
                    JobRun(spec.name, spec.run_id, None), spec.props, home=spec.home,
                    home_instance_id=spec.home_instance_id, claim_token=True)
            finally:
                if claimer is not self.client:   # a channel of its own, used this once
                    claimer.close()
            escrowed.accept(reg.job_token)
            return reg
        return self.client.register_job(spec.run, spec.props, home=spec.home,
                                        home_instance_id=spec.home_instance_id)

    def register(self, force: bool = False) -> Registration:
        """RegisterJob of the driver's run once per process per sidecar (again after the sidecar
        forgot it). A spec without a run (built by hand, not by `Job`) gets one per process."""
        w = worker()
        key = self._reg_key()
        if not force:
            with w.lock:
                known = w.registered.get(key)
            if known is not None:
                self.run = known.run()
                return known
        reg = self._call(self._register_call, reregister=False)
        with w.lock:
            w.registered[key] = reg
        self.run = reg.run()
        return reg

    def _totals(self) -> Counter:
        """Own counts plus the parked counts of the same stages, adopted into this session.

        Only its own stages: another spillway wrapper pipelined in the same Spark task (e.g.
        deserialize then map_in_pandas) flushes under the same task identity, and each flush
        stands for the task's count of the stages it names.
        """
        self.adopted.update(worker().take_counts(self._key, self.own.keys()))
        return self.own + self.adopted

    def _counts_grew(self) -> bool:
        total = sum(self._totals().values())
        if self.sent is None:
            return total > 0
        return total > sum(self.sent.values()) * COUNTS_GROWTH

    def flush(self) -> int:
        """FlushTask: the cumulative counts and pending recoveries; waits for this task's DLQ
        records to be acknowledged (FlushTimeoutError past ``flush_timeout_s``)."""
        self.register()
        totals = self._totals()
        recovered = self._take_recovered()
        acked = self._call(lambda: self.client.flush_task(
            self.run, self.task, dict(totals), recovered, timeout_s=self.spec.flush_timeout_s))
        self.sent = totals
        return acked

    def unsent_counts(self) -> Counter:
        totals = self.own + self.adopted
        return totals - self.sent if self.sent is not None else totals

    def close(self, ok: bool, exc: BaseException | None = None) -> None:
        """End of the partition: the flush barrier when it had failures, else counts only."""
        error = exc if not ok else None
        try:
            if ok:
                if self.had_failures or self.recovered_ids:
                    acked = self.flush()
                    self.span.set_attribute("spillway.dlq_acknowledged", acked)
                else:  # before the task ends: a summary read after the action is exact
                    self.park_counts(final=True)
        except BaseException as e:
            error = e
            raise
        finally:
            if error is None and not ok:
                error = RuntimeError("the partition failed")
            self.end_span(error)

    def park_counts(self, final: bool = False) -> None:
        """The session is over without a flush barrier: send its unsent counts with the
        process's other parked counts of its stages under this task (whose slot then holds what
        it held plus those) when ``final`` (a partition's end) or once due; otherwise, or when
        the call fails, leave them to a later call."""
        w = worker()
        w.add_counts(self._key, self.unsent_counts())
        if not final and not w.counts_due(self._key, self.spec.counts_interval_s):
            return
        parked = w.take_counts(self._key, self.own.keys())
        if not parked:
            return
        counts = parked + (self.sent or Counter())
        try:  # plain calls, never the wait policy: counts must not hold a clean partition up
            reg_key = self._reg_key()
            with w.lock:
                known = w.registered.get(reg_key)
            if known is None:
                known = self._in_span(self._register_call)
                with w.lock:
                    w.registered[reg_key] = known
            self.run = known.run()
            self._in_span(lambda: self.client.flush_task(self.run, self.task, dict(counts),
                                                         timeout_s=self.spec.rpc_timeout_s))
            self.sent = counts
        except Exception as exc:  # noqa: BLE001 - counts are kept, tried again after the interval
            w.add_counts(self._key, parked)
            log.warning("spillway: could not send processed counts of job %r to %s (kept for "
                        "the next call): %s", self.job, self.target, exc)

    def _in_span(self, fn: Callable[[], T]) -> T:
        """Run a client call with this session's span current: its CLIENT span is a child."""
        if self.trace_context is None:
            return fn()
        token = otel_context.attach(self.trace_context)
        try:
            return fn()
        finally:
            otel_context.detach(token)

    def _call(self, fn: Callable[[], T], *, reregister: bool = True) -> T:
        """Run one client call under the job's policy for an unreachable or busy sidecar."""
        waited_since: float | None = None
        delay = 0.1
        while True:
            try:
                return self._in_span(fn)
            except JobNotRegisteredError:
                if not reregister:
                    raise
                reregister = False  # the sidecar restarted and forgot the job: once
                log.info("spillway: sidecar %s does not know job %r; registering again",
                         self.target, self.job)
                self.register(force=True)
                continue
            except (SidecarUnavailableError, SidecarBackpressureError) as exc:
                busy = isinstance(exc, SidecarBackpressureError)
                if not busy and self.spec.on_sidecar_unavailable == "fail":
                    raise
                now = time.monotonic()
                waited_since = now if waited_since is None else waited_since
                if now - waited_since >= self.spec.sidecar_wait_s:
                    raise
                log.warning("spillway: sidecar %s %s; retrying for up to %.0f s", self.target,
                            "is applying backpressure" if busy else "is unreachable",
                            self.spec.sidecar_wait_s - (now - waited_since))
                self._sleep(delay)
                delay = min(delay * 2, 5.0)
