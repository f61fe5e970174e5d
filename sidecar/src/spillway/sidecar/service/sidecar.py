"""The application service: one sidecar's parts wired together, independent of how it is served.

`Sidecar` takes the requests the servicer (transport/servicer.py) has parsed and answers with
protobuf messages: runs and their tokens (registry.py), decisions (`core.policy`), a run homed at
another sidecar (peers.py), dead letters (`dlq.pipeline`), backpressure (admission.py). Status
pages are built by service/status.py; `bootstrap.start_server` builds, serves and stops it.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from itertools import accumulate, islice
from operator import attrgetter

from spillway.sidecar.core.dlq_record import DlqBuilder
from spillway.sidecar.core.guardrails import check_topic_name
from spillway.sidecar.core.model import Action, StageRef, Verdict, task_key
from spillway.sidecar.core.policy import PolicyEngine, run_key
from spillway.sidecar.core.ports import SystemClock
from spillway.sidecar.core.settings import JobSettings, job_settings
from spillway.sidecar.core.tolerance import run_secret
from spillway.sidecar.errors import (
    BackpressureError,
    ConfigError,
    JobAccessError,
    JobConflictError,
    UnknownJobError,
)
from spillway.sidecar.federation import siblings, tallying
from spillway.sidecar.federation.confirm import Confirmations
from spillway.sidecar.federation.peers import Home, HomeError, LocalSidecar, resolve_home
from spillway.sidecar.observability.health import KafkaWatch
from spillway.sidecar.observability.telemetry import Telemetry
from spillway.sidecar.runtime import memtune
from spillway.sidecar.service import ending
from spillway.sidecar.service.admission import Admission
from spillway.sidecar.service.registry import (
    MAX_TOKEN_CHARS,
    Caller,
    Registry,
    Run,
    access_error,
    check_run_id,
    may_use,
    new_token,
    token_digest,
)
from spillway.sidecar.service.runstate import RunStore
from spillway.sidecar.service.status import status_page
from spillway.sidecar.service.topic_checks import TopicChecks
from spillway.sidecar.transport import convert, security
from spillway.v1 import sidecar_pb2 as pb

log = logging.getLogger("spillway.sidecar")

def _caller() -> Caller:
    """Who is calling (authenticated by `security`'s interceptor before any servicer code)."""
    return security.current_caller()


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
    runstate: RunStore | None = None    # runs' durable state, beside the spool (runstate.py)
    kafka: KafkaWatch | None = None     # the Kafka check, with bootstrap.servers
    security: security.SecurityConfig | None = None
    # hands the heap of ended runs back to the OS after a burst of EndJobs (memtune.py)
    trimmer: memtune.Trimmer = field(default_factory=memtune.Trimmer)
    listen_address: str = ""  # set by start_server once bound
    # advertised.address, else listen_address: RegisterJobResponse.home, the `peer` it names
    advertised_address: str = ""
    # one of several processes behind listen.address (processes.py): its own port, and every
    # process's advertised address (they may dial each other as a run's home)
    process_port: int = 0
    siblings: tuple[str, ...] = ()  # in process order (siblings.owner)
    # a node's provisional verdicts and their confirmation with runs' homes (confirm.py)
    confirmations: Confirmations | None = None

    def __post_init__(self) -> None:
        self._topics = TopicChecks(self.props)  # a run's DLQ topic, once per topic

    @property
    def local(self) -> LocalSidecar:
        """What dialling another sidecar needs of this one (peers.py)."""
        mine = frozenset(a for a in (self.advertised_address, self.listen_address) if a)
        return LocalSidecar(self.instance_id, mine, self.security, frozenset(self.siblings) - mine)

    # --- runs --------------------------------------------------------------------------------

    def run_for(self, job: str, run_id: str, token: str | None) -> Run:
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
        job = request.job  # validated by transport/validate.py: used exactly as given
        run_id = check_run_id(request.run_id)
        properties = dict(request.properties)
        if request.peer and not caller.peer:
            raise JobAccessError(
                "RegisterJob.peer is for sidecar-to-sidecar calls only (an authenticated peer)")
        home_addr = request.home.strip()
        existing = self.registry.get(job, run_id)
        owner = "" if existing or home_addr else siblings.elsewhere(
            self.siblings, self.advertised_address, job, run_id)
        if owner:  # one home per run, whichever process this reached (siblings.py)
            return siblings.register_at_owner(self.local, owner, request, token, timeout_s)
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
        if run.home is not None and self.confirmations is not None:
            self.confirmations.adopt(run, reg.token)   # rows held before a restart
        return pb.RegisterJobResponse(
            job=job, run_id=run_id, job_token=reg.token,
            effective_properties=dict(reg.settings.raw),
            home=run.home_address if run.home is not None else self.advertised_address,
            home_instance_id=run.home_instance_id if run.home is not None else self.instance_id,
            process_port=self.process_port, report_columns=True)

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
            self._topics.ensure(settings, timeout_s)
        return settings

    def _create(self, job: str, run_id: str, properties, token: str,
                home: Home | None = None, home_instance_id: str = "") -> tuple[JobSettings, Run]:
        reg = self.registry
        key = run_key(job, run_id)
        with reg.create_lock:
            run = reg.get(job, run_id)
            if run is not None:  # created meanwhile by another caller
                if not may_use(run.digest, token):
                    raise access_error(job, run_id, token)
                return self.engine.register_job(job, properties, run_id=run_id), run
            reg.check_room()
            store = self.runstate if home is None else None  # kept where the run is decided
            kept = store.load(key, job, run_id) if store is not None else None
            if kept is not None and not may_use(kept[0], token):
                # a run this sidecar was deciding before it restarted: its token only
                raise access_error(job, run_id, token)
            settings = self.engine.register_job(job, properties, run_id=run_id,
                                                tag_secret=run_secret(token))
            digest = token_digest(token)
            if store is not None:
                store.attach(self.engine, key, job, run_id, digest, kept)
            run = reg.add(Run(job=job, run_id=run_id, key=key, digest=digest, home=home,
                              home_instance_id=home_instance_id))
        log.info("job %r run %r %s%s", job, run_id,
                 "resumed from its kept state" if kept is not None else "registered",
                 f" (homed at {home.address})" if home is not None else "")
        return settings, run

    def persist(self, key: str, slices: list | None) -> None:
        if self.runstate is not None and slices:
            self.runstate.persist(self.engine, key, slices)

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
        remote = resolve_home(self.local, request.home.strip(), request.home_instance_id, timeout_s)
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

    # --- reports -----------------------------------------------------------------------------

    def report(self, request: pb.ReportFailuresRequest, task, records, *,
               timeout_s: float, token: str | None = None,
               caller: Caller | None = None) -> list[Answer]:
        """Verdicts for `records`, each with whether the caller must dead-letter it (only for
        decide_only requests from another node's sidecar), as spans: a verdict and how many
        consecutive records it answers. The run's token is checked first;
        under backpressure the report is then refused (BackpressureError) before anything is
        decided (admission.py)."""
        if request.decide_only and not (caller or _caller()).peer:
            raise JobAccessError("ReportFailures.decide_only is for sidecar-to-sidecar calls "
                                 "only (an authenticated peer)")
        run = self.run_for(request.job, request.run_id, token)
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
                timeout_s: float, token: str | None) -> list[Answer]:
        job, key = run.job, run.key
        home = run.home
        if home is None and request.recovered_record_ids:
            self.engine.record_recovered(key, task, list(request.recovered_record_ids))
        if request.undo_dead_letter_record_ids:
            if home is None:
                undone: list = []
                self.engine.undo_dead_letters(key, list(request.undo_dead_letter_record_ids),
                                              journal=undone)
                self.persist(key, undone)
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
            # this report's slice of the run's durable state: written once its dead letters
            # are spooled (a refused report leaves none behind), or at once for a peer's
            # decide_only report (the peer spools, and says so if it could not)
            journal: list | None = [] if self.runstate is not None else None
            # A record reported without a trace context still gets one: the decision's
            # (made here once for a run homed elsewhere, whose records may be held first).
            own = _traceparent(span) if home is not None else ""
            if home is not None and self.confirmations is not None \
                    and not request.recovered_record_ids:
                # answered now, its DLQ records held until the home confirms them
                held = self.confirmations.answer(run, request.task, task, records, token, own)
                if held is not None:
                    if span.is_recording():
                        _annotate(span, [v for v, n in held for _ in range(n)], records)
                        span.set_attribute("spillway.provisional", True)
                    self.telemetry.record_verdict_duration(time.perf_counter() - started)
                    return [((v, False), n) for v, n in held]
            guard = None
            if home is not None:  # the job's home decides; durability stays on this node
                decisions, guard = tallying.decide_at_home(self, run, request, task, records,
                                                           timeout_s, token, own)
                decided = [(d, 1) for d in decisions]
            else:   # a streak (records decided alike) stays one answer (no object per record)
                decided = [(o[0], n) for o, n in self.engine.decide(key, task, records,
                                                                          journal=journal)]
            if request.decide_only:
                self.persist(key, journal)
                return [((d.verdict, d.dead_letter), n) for d, n in decided]
            if span.is_recording():
                _annotate(span, [d.verdict for d, n in decided for _ in range(n)], records)
            # each streak's first record: its index is the lengths of the streaks before it
            to_dlq = [(i, n, d.verdict) for i, (d, n) in zip(
                accumulate((n for _, n in decided), initial=0), decided) if d.dead_letter]
            if to_dlq:
                own = own or _traceparent(span)
                settings = self.engine.settings(key)
                now_ms = SystemClock().wall_ms()
                build = DlqBuilder(settings, task, now_ms=now_ms,
                                   sidecar_id=self.sidecar_id, run=key,
                                   run_id=request.run_id).build_streak
                dlq: list = []
                for i, n, v in to_dlq:
                    build(records, i, n, v, own, dlq)
                with tracer.start_as_current_span(
                        "spillway.spool", attributes={"spillway.records": len(dlq)}):
                    try:   # durable (spooled) before we answer; held copies go with it
                        self.pipeline.submit(dlq, release=guard.rid if guard else 0)
                    except BaseException:
                        # nothing spooled: the home must not answer a re-report "already in
                        # the DLQ" (one dead letter per record id), so it forgets these
                        self._undo_dead_letters(run, request, [r.record_id for i, n, _ in to_dlq
                                                               for r in records[i:i + n]], token)
                        if guard is not None:
                            self.confirmations.drop(guard)
                        raise
                for _, _, v in to_dlq:  # fresh values from this call's decisions: marked here
                    v.dead_lettered = True
            elif guard is not None:   # nothing to write: the held copies go
                self.confirmations.drop(guard)
            self.persist(key, journal)
        self.telemetry.record_verdict_duration(time.perf_counter() - started)
        return _answers(decided)

    def tally(self, request: pb.TallyRequest, reports, *, token: str | None,
              caller: Caller | None = None) -> list[list]:
        """TallyFailures, at a run's home (tallying.py)."""
        return tallying.tally(self, request, reports, token=token, caller=caller)

    def _undo_dead_letters(self, run: Run, request: pb.ReportFailuresRequest,
                           record_ids: list[str], token: str | None) -> None:
        if run.home is None:
            undone: list = []
            self.engine.undo_dead_letters(run.key, record_ids, journal=undone)
            self.persist(run.key, undone)
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
        run = self.run_for(request.job, request.run_id, token)
        key, home = run.key, run.home
        if home is not None:
            if processed or request.recovered_record_ids:
                home.progress(request, min(timeout_s, 10.0), token=token)
        else:
            if request.recovered_record_ids:
                self.engine.record_recovered(key, task, list(request.recovered_record_ids))
            if processed:
                progress: list = []
                self.engine.record_progress(key, task, processed, journal=progress)
                self.persist(key, progress)
        if self.pipeline is None or request.progress_only:
            return 0
        deadline = time.monotonic() + timeout_s
        if home is not None and self.confirmations is not None:
            self.confirmations.wait_task(key, task, timeout_s)   # held: confirmed first
        return self.pipeline.wait_task(task_key(key, task),
                                       max(0.0, deadline - time.monotonic()))

    # --- summaries, status, end --------------------------------------------------------------

    def job_summary(self, job: str, run_id: str, *, token: str | None) -> pb.JobSummary:
        run_id = check_run_id(run_id)
        if self.registry.get(job, run_id) is None:
            owner = siblings.elsewhere(self.siblings, self.advertised_address, job, run_id)
            if owner and token:  # homed at another process of this sidecar (siblings.py)
                return siblings.summary_at_owner(self.local, owner, job, run_id, token, 10.0)
            raise siblings.unknown_here(owner, job, run_id)
        return self.summary_pb(self.run_for(job, run_id, token).key)

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
        if self.confirmations is not None:
            counters.update(self.confirmations.stats())
        if self.kafka is not None:
            counters["kafka-reachable"] = float(self.kafka.reachable)
        gate = self.admission
        counters["records-refused"] = float(gate.refused_records if gate else 0)
        counters["backpressure"] = float(bool(gate and gate.refusing()))
        return counters

    def status_pb(self, request: pb.GetStatusRequest | None = None, *,
                  token: str | None = None, caller: Caller | None = None) -> pb.SidecarStatus:
        """Counters, and a page of the runs the caller may see (service/status.py)."""
        return status_page(self, request or pb.GetStatusRequest(), caller or _caller(), token)
    def end_job(self, request: pb.EndJobRequest, *, token: str | None, caller: Caller,
                timeout_s: float) -> pb.EndJobResponse:
        """EndJob (ending.py)."""
        return ending.end_job(self, request, token=token, caller=caller, timeout_s=timeout_s)

    def expire(self, run: Run) -> None:
        """The reaper's: a run nobody called for job.idle.timeout.ms (ending.py)."""
        ending.expire(self, run)


_ACTION_CATEGORY = attrgetter("action", "category")
# Per-record span events cost more than the decision itself at 100% sampling: a decision span
# carries counts for the whole report, and events for at most this many records (RETRY and FAIL
# verdicts before SKIPs, since they are the ones worth reading).
MAX_VERDICT_EVENTS = 8


# a report's answers in order: (verdict, dead_letter) and how many consecutive records it is
# for (a run's verdict has no record id: `convert.report_response` gives each record its own)
Answer = tuple[tuple[Verdict, bool], int]


def _answers(decided) -> list[Answer]:
    return [((d.verdict, False), n) for d, n in decided]


def _annotate(span, verdicts: Sequence[Verdict], records) -> None:
    """Summarise a report's verdicts (one per record of `records`, in order) on its decision
    span (docs/OBSERVABILITY.md)."""
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
        span.add_event("spillway.verdict", {   # a span's verdict has no id: the record has
            "spillway.record.id": records[i].record_id, "spillway.action": v.action.value,
            "spillway.category": v.category.value, "spillway.reason": v.reason,
            "spillway.attempt": v.attempt})


def _traceparent(span) -> str:
    ctx = span.get_span_context()
    if not ctx.is_valid:
        return ""
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"


__all__ = ["Sidecar"]
