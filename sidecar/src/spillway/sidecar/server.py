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
from collections.abc import Mapping, Sequence
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from spillway.v1 import sidecar_pb2 as pb
from spillway.v1 import sidecar_pb2_grpc as pb_grpc

from . import __version__, security, telemetry
from .peers import HomeError, resolve_home
from .probe import start_probe_server
from .adapters import convert, rpc
from .admission import Admission
from .health import KAFKA_HEALTH_SERVICE, KafkaWatch, quiet_librdkafka
from .core import config
from .core.dlq_record import DlqBuilder
from .core.guardrails import check_topic_name
from .core.handlers import HandlerRules
from .core.model import Action, Category, Decision, StageRef, Verdict, task_key
from .core.policy import PolicyEngine
from .core.ports import SystemClock
from .core.settings import JobSettings, job_settings
from .telemetry import Telemetry
from .errors import (
    BackpressureError,
    ConfigError,
    DlqError,
    FlushTimeoutError,
    JobConflictError,
    KafkaUnreachableError,
    TopicGuardrailError,
    UnknownJobError,
)

log = logging.getLogger("spillway.sidecar")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["ErrorSidecar"].full_name
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
# Flush barriers answer a little before the caller's deadline so the caller sees our error.
_DEADLINE_MARGIN_S = 0.05
# librdkafka answers a little after its timeout: the topic check leaves this much of the deadline
_KAFKA_ANSWER_MARGIN_S = 0.75


class ErrorSidecarServicer(pb_grpc.ErrorSidecarServicer):
    def __init__(self, sidecar: Sidecar) -> None:
        self._s = sidecar

    def RegisterJob(self, request, context):
        try:
            settings = self._s.register_job(request.job, dict(request.properties),
                                            home=request.home.strip(),
                                            home_instance_id=request.home_instance_id,
                                            timeout_s=_timeout(context))
        except JobConflictError as exc:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        except ConfigError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except KafkaUnreachableError as exc:  # not UNAVAILABLE: the sidecar answered
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        except DlqError as exc:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"DLQ topic check failed: {exc}")
        except HomeError as exc:
            context.abort(exc.code, str(exc))
        home = self._s.homes.get(request.job.strip())
        return pb.RegisterJobResponse(
            job=request.job, effective_properties=dict(settings.raw),
            home=home.address if home else self._s.advertised_address,
            home_instance_id=home.instance if home else self._s.instance_id)

    def ReportFailures(self, request, context):
        try:
            task = convert.task_identity(request.task)
            records = convert.failed_records(request.records)
            if request.undo_dead_letter_record_ids and not request.decide_only:
                raise ValueError("undo_dead_letter_record_ids: only for sidecar-to-sidecar "
                                 "(decide_only) requests")
        except ValueError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        try:
            answers = self._s.report(request, task, records, timeout_s=_timeout(context))
        except UnknownJobError as exc:
            context.abort(grpc.StatusCode.NOT_FOUND, str(exc))
        except BackpressureError as exc:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except HomeError as exc:
            context.abort(exc.code, str(exc))
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
        try:
            acked = self._s.flush(request, task, processed,
                                  _timeout(context, self._s.flush_timeout_s))
        except UnknownJobError as exc:
            context.abort(grpc.StatusCode.NOT_FOUND, str(exc))
        except HomeError as exc:
            context.abort(exc.code, str(exc))
        except FlushTimeoutError as exc:
            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, str(exc))
        except DlqError as exc:  # a record Kafka can never accept: kept aside, task must fail
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        return pb.FlushTaskResponse(dlq_records_acknowledged=acked)

    def GetJobSummary(self, request, context):
        try:
            return self._s.summary_pb(request.job)
        except UnknownJobError as exc:
            context.abort(grpc.StatusCode.NOT_FOUND, str(exc))

    def GetStatus(self, request, context):
        return self._s.status_pb()


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
    homes: dict = field(default_factory=dict)  # job -> Home, for jobs homed elsewhere
    admission: Admission | None = None  # backpressure gate, with a DLQ pipeline
    kafka: KafkaWatch | None = None     # the Kafka check, with bootstrap.servers
    security: security.SecurityConfig | None = None
    listen_address: str = ""  # set by start_server once bound
    advertised_address: str = ""  # advertised.address, else listen_address
    _topics_checked: set = field(default_factory=set)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def register_job(self, job: str, properties: Mapping[str, str], *, home: str = "",
                     home_instance_id: str = "", timeout_s: float = 15.0) -> JobSettings:
        if home and job not in self.homes:
            # allow-listed, dialled with this sidecar's TLS + peer token, identity checked
            remote = resolve_home(self, home, home_instance_id, timeout_s)
            if remote is not None:
                try:
                    remote.register(job, properties=properties, timeout_s=timeout_s)
                except BaseException:
                    remote.close()
                    raise
                with self._lock:
                    self.homes[job] = remote
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
        return self.engine.register_job(job, properties)

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

    def report(self, request: pb.ReportFailuresRequest, task, records, *,
               timeout_s: float) -> list[tuple[Verdict, bool]]:
        """Verdicts for `records`, each with whether the caller must dead-letter it (only for
        decide_only requests from another node's sidecar). Under backpressure the report is
        refused (BackpressureError) before anything is decided (admission.py)."""
        gate = self.admission
        if gate is None or not records or request.decide_only:
            return self._report(request, task, records, timeout_s=timeout_s)
        self.engine.settings(request.job)  # UnknownJobError before any admission
        try:
            reservation = gate.admit(len(records), request.ByteSize())
        except BackpressureError:
            self.engine.note_refused(request.job, len(records))
            raise
        try:
            return self._report(request, task, records, timeout_s=timeout_s)
        except BackpressureError:  # the estimate was short: decided, yet not spooled
            log.warning("job %s: the DLQ spool refused %d records admitted by the backpressure "
                        "estimate; they were decided and counted", request.job, len(records))
            gate.refused_after_admission(len(records))
            self.engine.note_refused(request.job, len(records))
            raise
        finally:
            gate.release(reservation)

    def _report(self, request: pb.ReportFailuresRequest, task, records, *,
                timeout_s: float) -> list[tuple[Verdict, bool]]:
        job = request.job
        home = self.homes.get(job)
        if home is None and request.recovered_record_ids:
            self.engine.record_recovered(job, task, list(request.recovered_record_ids))
        if request.undo_dead_letter_record_ids:
            if home is None:
                self.engine.undo_dead_letters(job, list(request.undo_dead_letter_record_ids))
        if not records:
            if home is not None and request.recovered_record_ids:
                home.report(request, timeout_s)
            return []
        started = time.perf_counter()
        tracer = self.telemetry.tracer
        with tracer.start_as_current_span(
                "spillway.decide", attributes={"spillway.job": job,
                                               "spillway.task.id": task.task_id,
                                               "spillway.records": len(records),
                                               "spillway.home": home.address if home else ""}
        ) as span:
            if home is not None:  # the job's home decides; durability stays on this node
                self.engine.settings(job)
                decisions = home.report(request, timeout_s)
            else:
                decisions = self.engine.decide(job, task, records)
            verdicts = [d.verdict for d in decisions]
            if request.decide_only:
                return [(v, d.dead_letter) for v, d in zip(verdicts, decisions, strict=True)]
            if span.is_recording():
                _annotate(span, verdicts)
            to_dlq = [i for i, d in enumerate(decisions) if d.dead_letter]
            if to_dlq:
                # A record reported without a trace context still gets one: the decision's.
                own = _traceparent(span)
                settings = self.engine.settings(job)
                now_ms = SystemClock().wall_ms()
                build = DlqBuilder(settings, task, now_ms=now_ms,
                                   sidecar_id=self.sidecar_id).build
                dlq = [build(records[i], verdicts[i], own) for i in to_dlq]
                with tracer.start_as_current_span(
                        "spillway.spool", attributes={"spillway.records": len(dlq)}):
                    try:
                        self.pipeline.submit(dlq)  # durable (spooled) before we answer
                    except BaseException:
                        # nothing spooled: the home must not answer a re-report "already in
                        # the DLQ" (one dead letter per record id), so it forgets these
                        self._undo_dead_letters(job, home, request,
                                                [records[i].record_id for i in to_dlq])
                        raise
                for i in to_dlq:  # fresh values from this call's decisions: marked in place
                    verdicts[i].dead_lettered = True
        self.telemetry.record_verdict_duration(time.perf_counter() - started)
        return [(v, False) for v in verdicts]

    def _undo_dead_letters(self, job: str, home, request: pb.ReportFailuresRequest,
                           record_ids: list[str]) -> None:
        if home is None:
            self.engine.undo_dead_letters(job, record_ids)
            return
        try:
            home.undo_dead_letters(request, record_ids, 5.0)
        except HomeError as exc:  # the report fails anyway; a re-report may then be refused
            log.warning("could not tell the home of job %r that %d DLQ records were not "
                        "spooled (a re-report of them may not be dead-lettered): %s",
                        job, len(record_ids), exc)

    def flush(self, request: pb.FlushTaskRequest, task, processed: Mapping[StageRef, int],
              timeout_s: float) -> int:
        job = request.job
        self.engine.settings(job)  # raises UnknownJobError
        home = self.homes.get(job)
        if home is not None:
            if processed or request.recovered_record_ids:
                home.progress(request, min(timeout_s, 10.0))
        else:
            if request.recovered_record_ids:
                self.engine.record_recovered(job, task, list(request.recovered_record_ids))
            if processed:
                self.engine.record_progress(job, task, processed)
        if self.pipeline is None or request.progress_only:
            return 0
        return self.pipeline.wait_task(task_key(job, task), timeout_s)

    def summary_pb(self, job: str) -> pb.JobSummary:
        return convert.summary_to_pb(self.engine.summary(job), self.sidecar_id)

    def sidewide_counters(self) -> dict[str, float]:
        """The sidecar-wide counters (engine, DLQ pipeline, health) by name: GetStatus and
        the metrics read the same numbers."""
        counters = dict(self.engine.counters())
        if self.pipeline is not None:
            counters.update(self.pipeline.stats())
        if self.kafka is not None:
            counters["kafka-reachable"] = float(self.kafka.reachable)
        gate = self.admission
        counters["records-refused"] = float(gate.refused_records if gate else 0)
        counters["backpressure"] = float(bool(gate and gate.refusing()))
        return counters

    def status_pb(self) -> pb.SidecarStatus:
        counters = self.sidewide_counters()
        return pb.SidecarStatus(
            sidecar_id=self.sidecar_id, version=__version__, counters=counters,
            instance_id=self.instance_id, advertised_address=self.advertised_address,
            jobs=[self.summary_pb(j) for j in self.engine.jobs()],
        )


def _timeout(context, default: float = 15.0) -> float:
    """What is left of the caller's deadline, less a margin so the caller sees our answer."""
    remaining = context.time_remaining()
    return default if remaining is None else max(0.0, remaining - _DEADLINE_MARGIN_S)


# Per-record span events cost more than the decision itself at 100% sampling: a decision span
# carries counts for the whole report, and events for at most this many records (RETRY and FAIL
# verdicts before SKIPs, since they are the ones worth reading).
MAX_VERDICT_EVENTS = 8


def _annotate(span, verdicts: Sequence[Verdict]) -> None:
    """Summarise a report's verdicts on its decision span (docs/OBSERVABILITY.md)."""
    kinds: dict[tuple[Action, Category], int] = {}
    picked: list[int] = []
    skips: list[int] = []
    skip = Action.SKIP
    for i, v in enumerate(verdicts):
        a = v.action
        key = (a, v.category)
        kinds[key] = kinds.get(key, 0) + 1
        if a is not skip:
            if len(picked) < MAX_VERDICT_EVENTS:
                picked.append(i)
        elif len(skips) < MAX_VERDICT_EVENTS:
            skips.append(i)
    if len(picked) < MAX_VERDICT_EVENTS:
        picked = sorted(picked + skips[:MAX_VERDICT_EVENTS - len(picked)])
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
        self.health.enter_graceful_shutdown()
        if self.sidecar.kafka is not None:
            self.sidecar.kafka.stop()
        self.server.stop(grace).wait()
        if self.probe is not None:  # probes saw NOT_SERVING for the whole grace period
            self.probe.stop(0).wait()
        if self.sidecar.pipeline is not None:
            self.sidecar.pipeline.shutdown(timeout=max(1.0, grace))
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
            producer_overrides=kafka_overrides,
            on_ack=engine.note_dead_letter_acked,
            spool_group=props["spool.group"],
        )
    return Sidecar(
        props=props, engine=engine, pipeline=pipeline,
        sidecar_id=props["sidecar.id"] or socket.gethostname(),
        flush_timeout_s=props["flush.timeout.ms"] / 1000,
        security=security.load_config(props),
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
    # authentication first: nothing (tracing included) sees a call before it is authenticated
    interceptors = [security.AuthInterceptor(security.Authenticator(sec, local_only=local_only)),
                    *interceptors]
    if sidecar.props["telemetry.enable"]:
        from opentelemetry.instrumentation.grpc import server_interceptor

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
        # gRPC server spans continue the executor's trace (W3C context in the metadata)
        interceptors.append(server_interceptor(tracer_provider=tel.tracer_provider))
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
