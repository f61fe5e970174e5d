"""The gRPC adapter: serves spillway.v1 over the policy engine and the DLQ pipeline.

The servicer only translates (protobuf <-> core values) and maps errors to status codes with
`context.abort(code, details)`; decisions belong to `core.policy`, durability to `dlq.pipeline`.
"""

from __future__ import annotations

import logging
import os
import random
import re
import socket
import threading
import time
import uuid
from collections import Counter
from collections.abc import Mapping, Sequence
from concurrent import futures
from contextlib import contextmanager
from dataclasses import dataclass, field
from itertools import islice
from operator import attrgetter
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from spillway.v1 import sidecar_pb2 as pb
from spillway.v1 import sidecar_pb2_grpc as pb_grpc

from . import __version__, memtune, security, telemetry
from .peers import Home, HomeError, end_on_node, resolve_home
from .probe import start_probe_server
from .adapters import convert, rpc
from .admission import Admission
from .health import KAFKA_HEALTH_SERVICE, KafkaWatch, quiet_librdkafka
from .core import config
from .core.dlq_record import DlqBuilder
from .core.guardrails import check_topic_name
from .core.handlers import HandlerRules
from .core.model import Action, Category, StageRef, Verdict, task_key
from .core.policy import PolicyEngine, run_key
from .core.ports import SystemClock
from .core.settings import JobSettings, job_settings
from .telemetry import Telemetry
from .errors import (
    BackpressureError,
    ConfigError,
    DlqError,
    FlushTimeoutError,
    JobAccessError,
    JobConflictError,
    KafkaUnreachableError,
    TopicGuardrailError,
    LiveRunsExhaustedError,
    SpillwayError,
    UnknownJobError,
)
from .registry import (
    JOB_TOKEN_METADATA,
    MAX_TOKEN_CHARS,
    Caller,
    Registry,
    Run,
    access_error,
    check_run_id,
    decode_page_token,
    encode_page_token,
    may_end,
    may_use,
    new_token,
    page_size,
    token_digest,
    visible,
)

log = logging.getLogger("spillway.sidecar")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["ErrorSidecar"].full_name
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
# Flush barriers answer a little before the caller's deadline so the caller sees our error.
_DEADLINE_MARGIN_S = 0.05
# librdkafka answers a little after its timeout: the topic check leaves this much of the deadline
_KAFKA_ANSWER_MARGIN_S = 0.75


# How the sidecar's typed errors answer over gRPC: the first row whose type matches wins (a
# TopicGuardrailError is a ConfigError before it is a DlqError; a HomeError relays its own code).
_STATUS_OF: tuple[tuple[type[SpillwayError], grpc.StatusCode], ...] = (
    (JobAccessError, grpc.StatusCode.PERMISSION_DENIED),
    (LiveRunsExhaustedError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (JobConflictError, grpc.StatusCode.FAILED_PRECONDITION),
    (UnknownJobError, grpc.StatusCode.NOT_FOUND),
    (ConfigError, grpc.StatusCode.INVALID_ARGUMENT),
    (BackpressureError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (FlushTimeoutError, grpc.StatusCode.DEADLINE_EXCEEDED),
    # not UNAVAILABLE (which gRPC clients retry): the sidecar answered, its Kafka did not
    (KafkaUnreachableError, grpc.StatusCode.FAILED_PRECONDITION),
    # e.g. a record Kafka can never accept: kept aside, the task must fail
    (DlqError, grpc.StatusCode.FAILED_PRECONDITION),
)


@contextmanager
def _answering(context, *, dlq_what: str = ""):
    """Abort the call with the status of a typed sidecar error raised in the block; ``dlq_what``
    prefixes the message of a plain DlqError (what the call was doing with the DLQ)."""
    try:
        yield
    except HomeError as exc:
        context.abort(exc.code, str(exc))
    except SpillwayError as exc:
        for kind, code in _STATUS_OF:
            if isinstance(exc, kind):
                prefix = dlq_what if kind is DlqError else ""
                context.abort(code, f"{prefix}{exc}")
        raise


class ErrorSidecarServicer(pb_grpc.ErrorSidecarServicer):
    def __init__(self, sidecar: Sidecar) -> None:
        self._s = sidecar

    def RegisterJob(self, request, context):
        with _answering(context, dlq_what="DLQ topic check failed: "):
            return self._s.register_job(request, token=_job_token(context), caller=_caller(),
                                        timeout_s=_timeout(context))

    def ReportFailures(self, request, context):
        try:
            task = convert.task_identity(request.task)
            records = convert.failed_records(request.records)
            if request.undo_dead_letter_record_ids and not request.decide_only:
                raise ValueError("undo_dead_letter_record_ids: only for sidecar-to-sidecar "
                                 "(decide_only) requests")
        except ValueError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        with _answering(context):
            answers = self._s.report(request, task, records, timeout_s=_timeout(context),
                                     token=_job_token(context), caller=_caller())
        return convert.report_response(answers)

    def FlushTask(self, request, context):
        try:
            task = convert.task_identity(request.task)
            processed = {}
            for i, sc in enumerate(request.processed):
                ref = convert.stage_ref(sc.stage, sc.custom_stage, f"processed[{i}]")
                processed[ref] = processed.get(ref, 0) + sc.records
        except ValueError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        with _answering(context):
            acked = self._s.flush(request, task, processed,
                                  _timeout(context, self._s.flush_timeout_s),
                                  token=_job_token(context), caller=_caller())
        return pb.FlushTaskResponse(dlq_records_acknowledged=acked)

    def GetJobSummary(self, request, context):
        with _answering(context):
            return self._s.job_summary(request.job, request.run_id, token=_job_token(context))

    def GetStatus(self, request, context):
        with _answering(context):
            return self._s.status_pb(request, token=_job_token(context), caller=_caller())

    def EndJob(self, request, context):
        with _answering(context):
            return self._s.end_job(request, token=_job_token(context), caller=_caller(),
                                   timeout_s=_timeout(context))


def _job_token(context) -> str | None:
    for key, value in context.invocation_metadata() or ():
        if key == JOB_TOKEN_METADATA:
            return value if isinstance(value, str) else None
    return None


def _caller() -> Caller:
    """Who is calling (authenticated by `security`'s interceptor before any servicer code)."""
    return security.current_caller()


_STATUS_REASON_CHARS = 1024       # a run's failure reason in GetStatus (full in GetJobSummary)
_STATUS_BREAKDOWN_KEYS = 20       # per breakdown in GetStatus, the rest summed as "(other)"
_STATUS_KEY_CHARS = 256
# GetStatus pages stop short of this many bytes, so any page fits a default 4 MiB client limit
_STATUS_PAGE_BYTES = 3 * 1024 * 1024


def _status_summary(s: pb.JobSummary) -> pb.JobSummary:
    """A run's summary bounded for GetStatus (which lists many): reason and breakdowns cut."""
    if len(s.failure_reason) > _STATUS_REASON_CHARS:
        s.failure_reason = s.failure_reason[:_STATUS_REASON_CHARS] + "…"
    for entries in (s.by_stage, s.by_category, s.by_exception_class):
        if len(entries) <= _STATUS_BREAKDOWN_KEYS and all(
                len(e.key) <= _STATUS_KEY_CHARS for e in entries):
            continue
        ranked = sorted(entries, key=lambda e: (-e.count, e.key))
        kept = ranked[:_STATUS_BREAKDOWN_KEYS]
        other = sum(e.count for e in ranked[_STATUS_BREAKDOWN_KEYS:])
        cut = [pb.CountEntry(key=e.key[:_STATUS_KEY_CHARS], count=e.count) for e in kept]
        if other:
            cut.append(pb.CountEntry(key="(other)", count=other))
        del entries[:]
        entries.extend(cut)
    return s


@dataclass
class _Registered:
    settings: JobSettings
    run: Run
    token: str


@dataclass
class Sidecar:
    """The sidecar's parts wired together, independent of how it is served."""

    props: dict
    engine: PolicyEngine
    pipeline: object | None  # DlqPipeline when bootstrap.servers is set
    sidecar_id: str
    flush_timeout_s: float
    telemetry: Telemetry = field(default_factory=Telemetry)
    instance_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    registry: Registry = field(default_factory=lambda: Registry(max_live=1000,
                                                                idle_timeout_s=3600.0))
    admission: Admission | None = None  # backpressure gate, with a DLQ pipeline
    kafka: KafkaWatch | None = None     # the Kafka check, with bootstrap.servers
    security: security.SecurityConfig | None = None
    # hands the heap of ended runs back to the OS after a burst of EndJobs (memtune.py)
    trimmer: memtune.Trimmer = field(default_factory=memtune.Trimmer)
    listen_address: str = ""  # set by start_server once bound
    # advertised.address, else listen_address: RegisterJobResponse.home, the `peer` it names
    advertised_address: str = ""
    _topics_checked: set = field(default_factory=set)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    # --- runs --------------------------------------------------------------------------------

    def _run(self, job: str, run_id: str, token: str | None) -> Run:
        """The live run, once the caller proved it holds its token (else nothing happens)."""
        run = self.registry.get(job, run_id)
        if run is None:
            raise UnknownJobError(job, run_id)
        if not may_use(run.digest, token):
            raise access_error(job, run_id, token)
        self.registry.touch(run)
        return run

    def register_job(self, request: pb.RegisterJobRequest, *, token: str | None,
                     caller: Caller, timeout_s: float = 15.0) -> pb.RegisterJobResponse:
        """RegisterJob: a new run (issues its token), the same run again (its token needed),
        or, with ``home``, a run homed at another sidecar (registered there first)."""
        job = request.job  # validated by adapters/validate.py: used exactly as given
        run_id = check_run_id(request.run_id)
        properties = dict(request.properties)
        if request.peer and not caller.peer:
            raise JobAccessError(
                "RegisterJob.peer is for sidecar-to-sidecar calls only (an authenticated peer)")
        home_addr = request.home.strip()
        existing = self.registry.get(job, run_id)
        if existing is not None:
            if not may_use(existing.digest, token):
                raise access_error(job, run_id, token)
            reg = self._register_again(existing, properties, home_addr, request, token,
                                       timeout_s)
        elif home_addr:
            reg = self._register_homed_elsewhere(job, run_id, properties, request, token,
                                                 timeout_s)
        else:
            reg = self._register_new(job, run_id, properties, token, timeout_s)
        if reg.run.home is None and request.peer:
            self.registry.add_node(reg.run, request.peer)
        run = reg.run
        return pb.RegisterJobResponse(
            job=job, run_id=run_id, job_token=reg.token,
            effective_properties=dict(reg.settings.raw),
            home=run.home_address if run.home is not None else self.advertised_address,
            home_instance_id=run.home_instance_id if run.home is not None else self.instance_id)

    def _register_again(self, run: Run, properties, home_addr: str,
                        request: pb.RegisterJobRequest, token: str,
                        timeout_s: float) -> _Registered:
        """The caller holds the run's token: idempotent, but never a new policy or home."""
        if home_addr and run.home is not None and home_addr != run.home.address:
            raise JobConflictError(
                f"job {run.job!r} run {run.run_id!r} is homed at {run.home.address}; "
                f"RegisterJob names home {home_addr}: one run has one home")
        if home_addr and run.home is None and not self._names_me(home_addr, request):
            raise JobConflictError(
                f"job {run.job!r} run {run.run_id!r} is homed at this sidecar "
                f"({self.advertised_address or self.instance_id}); RegisterJob names home "
                f"{home_addr}: one run has one home")
        # idempotent for the run's own policy; JobConflictError for another one
        settings = self.engine.register_job(run.job, properties, run_id=run.run_id)
        if run.home is not None:
            # an executor registers again when a call answered NOT_FOUND: the home may have
            # lost the run (restart, idle expiry), so it hears of it again (its token adopted)
            run.home.register(run.job, run.run_id, properties, token=token,
                              peer=self.advertised_address, timeout_s=timeout_s)
        self.registry.touch(run)
        return _Registered(settings, run, token)

    def _names_me(self, home_addr: str, request: pb.RegisterJobRequest) -> bool:
        if request.home_instance_id:
            return request.home_instance_id == self.instance_id
        return home_addr == self.advertised_address

    def _prepare(self, job: str, properties, timeout_s: float) -> JobSettings:
        """Validate a new run's policy and its DLQ topic before anything is created."""
        settings = job_settings(job, properties, self.props.get("_job_defaults"))
        self.engine.handler_rules.check(settings.handler_class)  # before any side effect
        # the operator's topic guardrails (a job may only narrow them), before any side effect
        check_topic_name(settings.dlq, self.props["dlq.topic.required.prefix"],
                         self.props["dlq.topic.auto.create.allow"])
        if settings.dlq.enabled:
            if self.pipeline is None:
                raise ConfigError(
                    "errors.deadletterqueue.topic.name",
                    f"job {job!r} names DLQ topic {settings.dlq.topic!r} but this sidecar has "
                    "no bootstrap.servers to write it to",
                )
            self._ensure_topic(settings, timeout_s)
        return settings

    def _create(self, job: str, run_id: str, properties, token: str,
                home: Home | None = None, home_instance_id: str = "") -> tuple[JobSettings, Run]:
        reg = self.registry
        with reg.create_lock:
            run = reg.get(job, run_id)
            if run is not None:  # created meanwhile by another caller
                if not may_use(run.digest, token):
                    raise access_error(job, run_id, token)
                return self.engine.register_job(job, properties, run_id=run_id), run
            reg.check_room()
            settings = self.engine.register_job(job, properties, run_id=run_id)
            run = reg.add(Run(job=job, run_id=run_id, key=run_key(job, run_id),
                              digest=token_digest(token), home=home,
                              home_instance_id=home_instance_id))
        log.info("job %r run %r registered%s", job, run_id,
                 f" (homed at {home.address})" if home is not None else "")
        return settings, run

    def _register_new(self, job: str, run_id: str, properties, token: str | None,
                      timeout_s: float) -> _Registered:
        """A run homed here. A token the caller already holds is adopted (an executor whose
        sidecar restarted, or a run registered again after it ended); else one is issued."""
        self._prepare(job, properties, timeout_s)
        token = token if token and len(token) <= MAX_TOKEN_CHARS else new_token()
        settings, run = self._create(job, run_id, properties, token)
        return _Registered(settings, run, token)

    def _register_homed_elsewhere(self, job: str, run_id: str, properties,
                                  request: pb.RegisterJobRequest, token: str | None,
                                  timeout_s: float) -> _Registered:
        """An executor's registration of a run homed at another sidecar: the home must accept
        it (with the run's token) before this sidecar records anything."""
        if not token:
            raise access_error(job, run_id, None)
        remote = resolve_home(self, request.home.strip(), request.home_instance_id, timeout_s)
        if remote is None:  # the named home is this sidecar
            return self._register_new(job, run_id, properties, token, timeout_s)
        try:
            self._prepare(job, properties, timeout_s)
            answer = remote.register(job, run_id, properties, token=token,
                                     peer=self.advertised_address, timeout_s=timeout_s)
            settings, run = self._create(
                job, run_id, properties, token, remote,
                answer.home_instance_id or request.home_instance_id)
        except BaseException:
            remote.close()
            raise
        if run.home is not remote:
            remote.close()
        return _Registered(settings, run, token)

    def kafka_conf(self) -> dict:
        return quiet_librdkafka({"bootstrap.servers": self.props["bootstrap.servers"],
                                 **self.props.get("_kafka_overrides", {})})

    def _ensure_topic(self, settings: JobSettings, timeout_s: float) -> None:
        """Within the caller's deadline (less a margin for our answer); a Kafka that does not
        answer is KafkaUnreachableError, which RegisterJob answers FAILED_PRECONDITION."""
        from .dlq.admin import ensure_topic

        key = (settings.dlq.topic, settings.dlq.auto_create)
        with self._lock:
            if key in self._topics_checked:
                return
        budget = max(0.5, min(timeout_s - _KAFKA_ANSWER_MARGIN_S, 15.0))
        try:
            ensure_topic(self.kafka_conf(), settings.dlq, timeout_s=budget,
                         required_prefix=self.props["dlq.topic.required.prefix"],
                         auto_create_allowed=self.props["dlq.topic.auto.create.allow"])
        except TopicGuardrailError:
            raise
        except DlqError as exc:
            raise KafkaUnreachableError(self.props["bootstrap.servers"], str(exc)) from exc
        with self._lock:
            self._topics_checked.add(key)

    # --- reports -----------------------------------------------------------------------------

    def report(self, request: pb.ReportFailuresRequest, task, records, *,
               timeout_s: float, token: str | None = None,
               caller: Caller | None = None) -> list[tuple[Verdict, bool]]:
        """Verdicts for `records`, each with whether the caller must dead-letter it (only for
        decide_only requests from another node's sidecar). The run's token is checked first;
        under backpressure the report is then refused (BackpressureError) before anything is
        decided (admission.py)."""
        if request.decide_only and not (caller or _caller()).peer:
            raise JobAccessError("ReportFailures.decide_only is for sidecar-to-sidecar calls "
                                 "only (an authenticated peer)")
        run = self._run(request.job, request.run_id, token)
        gate = self.admission
        if gate is None or not records or request.decide_only:
            return self._report(run, request, task, records, timeout_s=timeout_s, token=token)
        try:
            reservation = gate.admit(len(records), request.ByteSize())
        except BackpressureError:
            self.engine.note_refused(run.key, len(records))
            raise
        try:
            return self._report(run, request, task, records, timeout_s=timeout_s, token=token)
        except BackpressureError:  # the estimate was short: decided, yet not spooled
            log.warning("job %s: the DLQ spool refused %d records admitted by the backpressure "
                        "estimate; they were decided and counted", request.job, len(records))
            gate.refused_after_admission(len(records))
            self.engine.note_refused(run.key, len(records))
            raise
        finally:
            gate.release(reservation)

    def _report(self, run: Run, request: pb.ReportFailuresRequest, task, records, *,
                timeout_s: float, token: str | None) -> list[tuple[Verdict, bool]]:
        job, key = run.job, run.key
        home = run.home
        if home is None and request.recovered_record_ids:
            self.engine.record_recovered(key, task, list(request.recovered_record_ids))
        if request.undo_dead_letter_record_ids:
            if home is None:
                self.engine.undo_dead_letters(key, list(request.undo_dead_letter_record_ids))
        if not records:
            if home is not None and request.recovered_record_ids:
                home.report(request, timeout_s, token=token)
            return []
        started = time.perf_counter()
        tracer = self.telemetry.tracer
        with tracer.start_as_current_span(
                "spillway.decide", attributes={"spillway.job": job,
                                               "spillway.run": run.run_id,
                                               "spillway.task.id": task.task_id,
                                               "spillway.records": len(records),
                                               "spillway.home": home.address if home else ""}
        ) as span:
            if home is not None:  # the job's home decides; durability stays on this node
                self.engine.settings(key)
                decisions = home.report(request, timeout_s, token=token)
            else:
                decisions = self.engine.decide(key, task, records)
            verdicts = [d.verdict for d in decisions]
            if request.decide_only:
                return [(v, d.dead_letter) for v, d in zip(verdicts, decisions, strict=True)]
            if span.is_recording():
                _annotate(span, verdicts)
            to_dlq = [i for i, d in enumerate(decisions) if d.dead_letter]
            if to_dlq:
                # A record reported without a trace context still gets one: the decision's.
                own = _traceparent(span)
                settings = self.engine.settings(key)
                now_ms = SystemClock().wall_ms()
                build = DlqBuilder(settings, task, now_ms=now_ms,
                                   sidecar_id=self.sidecar_id, run=key,
                                   run_id=request.run_id).build
                dlq = [build(records[i], verdicts[i], own) for i in to_dlq]
                with tracer.start_as_current_span(
                        "spillway.spool", attributes={"spillway.records": len(dlq)}):
                    try:
                        self.pipeline.submit(dlq)  # durable (spooled) before we answer
                    except BaseException:
                        # nothing spooled: the home must not answer a re-report "already in
                        # the DLQ" (one dead letter per record id), so it forgets these
                        self._undo_dead_letters(run, request,
                                                [records[i].record_id for i in to_dlq], token)
                        raise
                for i in to_dlq:  # fresh values from this call's decisions: marked in place
                    verdicts[i].dead_lettered = True
        self.telemetry.record_verdict_duration(time.perf_counter() - started)
        return [(v, False) for v in verdicts]

    def _undo_dead_letters(self, run: Run, request: pb.ReportFailuresRequest,
                           record_ids: list[str], token: str | None) -> None:
        if run.home is None:
            self.engine.undo_dead_letters(run.key, record_ids)
            return
        try:
            run.home.undo_dead_letters(request, record_ids, 5.0, token=token)
        except HomeError as exc:  # the report fails anyway; a re-report may then be refused
            log.warning("could not tell the home of job %r run %r that %d DLQ records were "
                        "not spooled (a re-report of them may not be dead-lettered): %s",
                        run.job, run.run_id, len(record_ids), exc)

    def flush(self, request: pb.FlushTaskRequest, task, processed: Mapping[StageRef, int],
              timeout_s: float, *, token: str | None = None,
              caller: Caller | None = None) -> int:
        if request.progress_only and not (caller or _caller()).peer:
            raise JobAccessError("FlushTask.progress_only is for sidecar-to-sidecar calls only "
                                 "(an authenticated peer)")
        run = self._run(request.job, request.run_id, token)
        key, home = run.key, run.home
        if home is not None:
            if processed or request.recovered_record_ids:
                home.progress(request, min(timeout_s, 10.0), token=token)
        else:
            if request.recovered_record_ids:
                self.engine.record_recovered(key, task, list(request.recovered_record_ids))
            if processed:
                self.engine.record_progress(key, task, processed)
        if self.pipeline is None or request.progress_only:
            return 0
        return self.pipeline.wait_task(task_key(key, task), timeout_s)

    # --- summaries, status, end --------------------------------------------------------------

    def job_summary(self, job: str, run_id: str, *, token: str | None) -> pb.JobSummary:
        run = self._run(job, check_run_id(run_id), token)
        return self.summary_pb(run.key)

    def summary_pb(self, key: str) -> pb.JobSummary:
        return convert.summary_to_pb(self.engine.summary(key), self.sidecar_id)

    def sidewide_counters(self) -> dict[str, float]:
        """The sidecar-wide counters (engine, runs, DLQ pipeline, health) by name: GetStatus
        and the metrics read the same numbers."""
        counters = dict(self.engine.counters())
        counters["jobs-expired"] = float(self.registry.expired)
        counters["jobs-ended"] = float(self.registry.ended)
        if self.pipeline is not None:
            counters.update(self.pipeline.stats())
        if self.kafka is not None:
            counters["kafka-reachable"] = float(self.kafka.reachable)
        gate = self.admission
        counters["records-refused"] = float(gate.refused_records if gate else 0)
        counters["backpressure"] = float(bool(gate and gate.refusing()))
        return counters

    def status_pb(self, request: pb.GetStatusRequest | None = None, *,
                  token: str | None = None, caller: Caller | None = None) -> pb.SidecarStatus:
        """Counters, and a page of the runs the caller may see (by job name, then run id)."""
        request = request or pb.GetStatusRequest()
        caller = caller or _caller()
        size = page_size(request.page_size)
        after = decode_page_token(request.page_token) if request.page_token else None
        runs = visible(self.registry.runs(request.job), caller, token)
        out = pb.SidecarStatus(
            sidecar_id=self.sidecar_id, version=__version__, counters=self.sidewide_counters(),
            instance_id=self.instance_id, advertised_address=self.advertised_address,
            jobs_total=len(runs))
        if after is not None:
            runs = [r for r in runs if (r.job, r.run_id) > after]
        budget = _STATUS_PAGE_BYTES - out.ByteSize()
        last = None
        for run in runs:
            if len(out.jobs) >= size:
                break
            try:
                summary = _status_summary(self.summary_pb(run.key))
            except UnknownJobError:  # ended meanwhile
                continue
            cost = summary.ByteSize() + 8
            if cost > budget and out.jobs:
                break
            budget -= cost
            out.jobs.append(summary)
            last = run
        if last is not None and runs and runs[-1] is not last:
            out.next_page_token = encode_page_token(last.job, last.run_id)
        return out

    def end_job(self, request: pb.EndJobRequest, *, token: str | None, caller: Caller,
                timeout_s: float) -> pb.EndJobResponse:
        """Waits (within the deadline) for the run's DLQ records, releases it here and, at its
        home, on every node sidecar that registered it."""
        job, run_id = request.job, check_run_id(request.run_id)
        if request.local_only and not caller.peer:
            raise JobAccessError("EndJob.local_only is for sidecar-to-sidecar calls only "
                                 "(an authenticated peer)")
        run = self.registry.get(job, run_id)
        if run is None:
            raise UnknownJobError(job, run_id)
        if not may_end(caller, run.digest, token, local_only=request.local_only):
            raise access_error(job, run_id, token)
        deadline = time.monotonic() + timeout_s
        out = pb.EndJobResponse()
        if run.home is not None and not request.local_only:
            # ended at its home, which releases it on every node (this one included)
            try:
                answer = run.home.end(job, run_id, token=token, timeout_s=timeout_s)
                out.CopyFrom(answer)
            except HomeError as exc:
                out.unreachable.append(run.home.address)
                log.warning("job %r run %r: could not end it at its home: %s", job, run_id, exc)
            if self.registry.get(job, run_id) is not run:
                return out
        summary = self._release(run, deadline)
        if summary is not None:
            out.summaries.insert(0, summary)
        if run.home is None and not request.local_only:
            for node in sorted(run.nodes):
                remaining = deadline - time.monotonic()
                try:
                    answer = end_on_node(self, node, job, run_id, token=token,
                                         timeout_s=min(max(remaining, 0.1), 10.0))
                    out.summaries.extend(answer.summaries)
                except HomeError as exc:
                    if exc.code == grpc.StatusCode.NOT_FOUND:
                        continue  # released there already (or it never recorded the run)
                    out.unreachable.append(node)
                    log.warning("job %r run %r: could not release it on node sidecar %s (it "
                                "ends there on its idle timeout): %s", job, run_id, node, exc)
        return out

    def _release(self, run: Run, deadline: float, *, expired: bool = False
                 ) -> pb.JobSummary | None:
        pending = 0
        if self.pipeline is not None and not expired:  # the run stays live while it drains
            pending = self.pipeline.wait_run(run.key + "/", max(0.0, deadline - time.monotonic()))
        with self.registry.create_lock:  # never half released: registry and engine together
            if not self.registry.remove(run, expired=expired):
                return None  # released meanwhile by another EndJob or the reaper
            final = self.engine.end_job(run.key)
        if run.home is not None:
            run.home.close()
        self.trimmer.freed()
        if pending:
            log.warning("job %r run %r ended with %d DLQ record(s) not yet acknowledged by "
                        "Kafka; they stay spooled and will be delivered", run.job, run.run_id,
                        pending)
        how = "expired after %.0f s idle" % self.registry.idle_timeout_s if expired else "ended"
        log.info("job %r run %r %s", run.job, run.run_id, how)
        return convert.summary_to_pb(final, self.sidecar_id) if final is not None else None

    def expire(self, run: Run) -> None:
        """The reaper's: a run nobody called for job.idle.timeout.ms."""
        if run.last_active >= time.monotonic() - self.registry.idle_timeout_s:
            return  # touched since it was picked
        self._release(run, time.monotonic(), expired=True)


def _timeout(context, default: float = 15.0) -> float:
    """What is left of the caller's deadline, less a margin so the caller sees our answer."""
    remaining = context.time_remaining()
    return default if remaining is None else max(0.0, remaining - _DEADLINE_MARGIN_S)


_ACTION_CATEGORY = attrgetter("action", "category")
# Per-record span events cost more than the decision itself at 100% sampling: a decision span
# carries counts for the whole report, and events for at most this many records (RETRY and FAIL
# verdicts before SKIPs, since they are the ones worth reading).
MAX_VERDICT_EVENTS = 8


def _annotate(span, verdicts: Sequence[Verdict]) -> None:
    """Summarise a report's verdicts on its decision span (docs/OBSERVABILITY.md)."""
    # counted in C (Counter over (action, category)); the event scans stop once they have
    # enough, and the one for non-SKIPs is skipped when the counts say there is none
    kinds = Counter(map(_ACTION_CATEGORY, verdicts))
    skip = Action.SKIP
    skipped = sum(n for (a, _), n in kinds.items() if a is skip)
    others = len(verdicts) - skipped
    picked = list(islice((i for i, v in enumerate(verdicts) if v.action is not skip),
                         min(others, MAX_VERDICT_EVENTS))) if others else []
    if len(picked) < MAX_VERDICT_EVENTS and skipped:
        picked = sorted(picked + list(islice(
            (i for i, v in enumerate(verdicts) if v.action is skip),
            min(skipped, MAX_VERDICT_EVENTS - len(picked)))))
    attrs: dict[str, int] = {}
    for (a, c), n in kinds.items():
        for name in (f"spillway.verdicts.{a.value.lower()}",
                     f"spillway.verdicts.category.{c.value}"):
            attrs[name] = attrs.get(name, 0) + n
    attrs["spillway.verdicts.events.omitted"] = len(verdicts) - len(picked)
    span.set_attributes(attrs)
    for i in picked:
        v = verdicts[i]
        span.add_event("spillway.verdict", {
            "spillway.record.id": v.record_id, "spillway.action": v.action.value,
            "spillway.category": v.category.value, "spillway.reason": v.reason,
            "spillway.attempt": v.attempt})


def _traceparent(span) -> str:
    ctx = span.get_span_context()
    if not ctx.is_valid:
        return ""
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"


class _Random:
    def __init__(self) -> None:
        self._r = random.Random()

    def random(self) -> float:
        return self._r.random()


def default_spool_dir(props: Mapping[str, str]) -> str:
    """Per-user state dir, one spool per listen address (two sidecars never share a spool)."""
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(Path.home(), ".local", "state")
    where = props.get("listen.address") or props.get("listen.unix.socket") or "default"
    return os.path.join(base, "spillway", "spool-" + re.sub(r"[^A-Za-z0-9._-]", "_", where))


@dataclass
class RunningSidecar:
    server: grpc.Server
    sidecar: Sidecar
    health: health.HealthServicer
    address: str  # what a client dials: host:port or unix:///path
    _stop: threading.Event = field(default_factory=threading.Event)
    _watch: threading.Thread | None = None
    probe: grpc.Server | None = None  # health.listen.address (probe.py)
    probe_address: str = ""

    def stop(self, grace_s: float | None = None) -> None:
        """Graceful: refuse new calls, let in-flight ones finish, drain what the DLQ can."""
        if self._stop.is_set():
            return
        self._stop.set()
        grace = grace_s if grace_s is not None else self.sidecar.props["shutdown.grace.ms"] / 1000
        deadline = time.monotonic() + grace  # one budget: calls, then the DLQ's last flush
        self.health.enter_graceful_shutdown()
        if self.sidecar.kafka is not None:
            self.sidecar.kafka.stop()
        self.server.stop(grace).wait()
        if self.probe is not None:  # probes saw NOT_SERVING for the whole grace period
            self.probe.stop(0).wait()
        self.sidecar.registry.stop()
        self.sidecar.trimmer.stop()
        if self.sidecar.pipeline is not None:
            self.sidecar.pipeline.shutdown(timeout=max(0.0, deadline - time.monotonic()))
        self.sidecar.telemetry.shutdown()  # flush spans and metrics
        log.info("spillway sidecar %s stopped", self.sidecar.sidecar_id)

    def wait(self) -> None:
        self.server.wait_for_termination()

    def _watch_backpressure(self) -> None:
        """Health follows backpressure and Kafka (health.py): NOT_SERVING while reports are
        refused (admission.py), SERVING again once the spool is below its low-water mark;
        ``spillway.kafka`` NOT_SERVING while the sidecar's Kafka does not answer."""
        serving, not_serving = (health_pb2.HealthCheckResponse.SERVING,
                                health_pb2.HealthCheckResponse.NOT_SERVING)
        last = last_kafka = None
        gate, kafka = self.sidecar.admission, self.sidecar.kafka
        while not self._stop.wait(0.25):
            status = not_serving if gate is not None and gate.refusing() else serving
            if status != last:
                for name in ("", SERVICE_NAME):
                    self.health.set(name, status)
                last = status
            k = serving if kafka is None or kafka.reachable else not_serving
            if k != last_kafka:
                self.health.set(KAFKA_HEALTH_SERVICE, k)
                last_kafka = k


def build_sidecar(raw: Mapping[str, str]) -> Sidecar:
    """Parse sidecar properties (already layered) and construct the engine and pipeline."""
    props = config.parse(raw)
    job_defaults = {k: v for k, v in raw.items() if k in config.JOB_PROPERTIES}
    # A sidecar-level job default must itself be valid: check it once, at start-up.
    defaults = job_settings("sidecar-defaults", {}, job_defaults)
    check_topic_name(defaults.dlq, props["dlq.topic.required.prefix"],
                     props["dlq.topic.auto.create.allow"])
    props["_job_defaults"] = job_defaults
    kafka_overrides = {k[len(config.PRODUCER_PASSTHROUGH):]: v for k, v in raw.items()
                       if k.startswith(config.PRODUCER_PASSTHROUGH)}
    props["_kafka_overrides"] = kafka_overrides
    if not props["listen.address"] and not props["listen.unix.socket"]:
        raise ConfigError("listen.address", "set listen.address or listen.unix.socket")
    # user handler classes are operator-owned: the allow-list and time limit are sidecar-only
    rules = HandlerRules.from_properties(
        props["errors.handler.allowed.classes"], props["errors.handler.timeout.ms"],
        props["errors.handler.pool.size"], also=[job_defaults.get("errors.handler.class", "")])
    engine = PolicyEngine(clock=SystemClock(), rng=_Random(), job_defaults=job_defaults,
                          handler_rules=rules)
    pipeline = None
    if props["bootstrap.servers"]:
        from .dlq.pipeline import DlqPipeline

        pipeline = DlqPipeline(
            props["bootstrap.servers"],
            spool_dir=props["spool.dir"] or default_spool_dir(raw),
            spool_enable=props["spool.enable"],
            max_bytes=props["spool.max.bytes"],
            max_records=props["spool.max.records"],
            linger_ms=props["producer.linger.ms"],
            batch_size=props["producer.batch.size"],
            max_inflight_bytes=props["producer.max.inflight.bytes"],
            producer_overrides=kafka_overrides,
            on_ack=engine.note_dead_letter_acked,
            spool_group=props["spool.group"],
        )
    return Sidecar(
        props=props, engine=engine, pipeline=pipeline,
        sidecar_id=props["sidecar.id"] or socket.gethostname(),
        flush_timeout_s=props["flush.timeout.ms"] / 1000,
        security=security.load_config(props),
        registry=Registry(max_live=props["jobs.max.live"],
                          idle_timeout_s=props["job.idle.timeout.ms"] / 1000),
    )


def start_server(
    raw: Mapping[str, str] | None = None,
    *,
    interceptors: Sequence[grpc.ServerInterceptor] = (),
    max_workers: int = 32,
    install_global_telemetry: bool = False,
) -> RunningSidecar:
    """Build and start a sidecar from layered raw properties (see `config.resolve`)."""
    raw = config.resolve(explicit=raw or {})  # idempotent over an already-layered mapping
    sidecar = build_sidecar(raw)
    sec = sidecar.security
    tcp = sidecar.props["listen.address"]
    if tcp:
        security.check_plaintext_listen(tcp, sec)
    if sidecar.props["listen.unix.socket"]:  # before anything starts: a refusal leaves no thread
        security.clear_stale_socket(sidecar.props["listen.unix.socket"])
    local_only = not tcp or security.is_loopback_host(security.split_host_port(tcp)[0])
    spans = None
    if sidecar.props["telemetry.enable"]:
        tel = telemetry.setup(prometheus_port=sidecar.props["metrics.prometheus.port"],
                              prometheus_host=sidecar.props["metrics.prometheus.host"],
                              sidecar_id=sidecar.sidecar_id,
                              install_global=install_global_telemetry)
        task_label = sidecar.props["metrics.task.label.enable"]
        tel.add_source(lambda: sidecar.engine.metric_rows(task_label=task_label))
        tel.add_source(lambda: [(k, {}, float(v)) for k, v in sidecar.sidewide_counters().items()
                                if k in telemetry.SIDECAR_WIDE])
        if sidecar.pipeline is not None:
            sidecar.pipeline.tracer = tel.tracer
        sidecar.telemetry = tel
        # gRPC server spans continue the executor's trace (W3C context in the metadata); only
        # a sampled call pays for its span
        spans = telemetry.ServerSpans(tel.tracer_provider)
    # one interceptor, authentication first: nothing (tracing included) sees a call before it
    # is authenticated; then the call's server span
    interceptors = [security.AuthInterceptor(
        security.Authenticator(sec, local_only=local_only),
        around=spans.wrap if spans is not None else None), *interceptors]
    if sidecar.pipeline is not None:
        sidecar.pipeline.start()
        sidecar.admission = Admission(sidecar.pipeline.store,
                                      low_water_percent=sidecar.props["spool.low.water.percent"])
        sidecar.kafka = KafkaWatch(
            sidecar.kafka_conf(),
            interval_s=sidecar.props["kafka.check.interval.ms"] / 1000).start()
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="spillway-rpc"),
        interceptors=interceptors,
        options=[("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                 ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                 ("grpc.so_reuseport", 0)],
    )
    # raw bytes in, parsed and bounded inside: undecodable requests answer INVALID_ARGUMENT
    rpc.add_servicer(ErrorSidecarServicer(sidecar), server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    address = ""
    if sidecar.props["listen.unix.socket"]:
        path = sidecar.props["listen.unix.socket"]
        old_umask = os.umask(0o177)  # nobody else can connect before the mode below is set
        try:
            server.add_insecure_port(f"unix://{path}")
        finally:
            os.umask(old_umask)
        security.secure_socket(path, sidecar.props["listen.unix.socket.mode"],
                               sidecar.props["listen.unix.socket.owner"],
                               sidecar.props["listen.unix.socket.group"])
        address = f"unix://{path}"
    if tcp:
        host, _, port = tcp.rpartition(":")
        if sec.tls is not None:
            bound = server.add_secure_port(tcp, security.TlsReloader(sec.tls).server_credentials())
        else:
            bound = server.add_insecure_port(tcp)
        if bound == 0:
            raise ConfigError("listen.address", f"cannot bind {tcp}")
        address = f"{host}:{bound}"  # port 0 picks a free port: report the real one
    sidecar.listen_address = address
    sidecar.advertised_address = sec.advertised_address or security.default_advertised(address)
    server.start()
    sidecar.registry.start_reaper(sidecar.expire)
    for name in ("", SERVICE_NAME) + ((KAFKA_HEALTH_SERVICE,) if sidecar.kafka else ()):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    running = RunningSidecar(server, sidecar, health_servicer, address)
    if sidecar.props["health.listen.address"]:
        try:
            running.probe, running.probe_address = start_probe_server(
                sidecar.props["health.listen.address"], health_servicer)
        except Exception:
            running.stop(0)
            raise
    if sidecar.pipeline is not None:
        running._watch = threading.Thread(target=running._watch_backpressure,
                                          name="spillway-health", daemon=True)
        running._watch.start()
    log.info("spillway sidecar %s serving on %s (%s)", sidecar.sidecar_id, address,
             security.describe(sec, local_only=local_only))
    for weakness in security.weaknesses(sec, local_only=local_only):
        log.warning("security: %s", weakness)
    return running


__all__ = ["start_server", "build_sidecar", "RunningSidecar", "Sidecar"]
