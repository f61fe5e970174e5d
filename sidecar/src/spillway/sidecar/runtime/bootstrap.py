"""Bootstrap: build a sidecar from its properties, serve it over gRPC, stop it; the one place
the sidecar's objects are wired, once (none is patched afterwards).

`configure` parses the layered properties and constructs the policy engine, the DLQ pipeline
and the registry; `start_server` sets up telemetry (and its Prometheus endpoint), binds the
listeners (so that the addresses are known), builds the service with them (`build_sidecar`:
the `Sidecar` facade over its collaborators), adds authentication, the servicer and
grpc.health.v1, serves, and returns a `RunningSidecar`, whose `stop()` shuts all of it down in
order.
"""

from __future__ import annotations

import logging
import os
import random
import socket
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from concurrent import futures
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from spillway.client import extensions
from spillway.sidecar.core import config, idtable, slots
from spillway.sidecar.core.guardrails import check_topic_name
from spillway.sidecar.core.handlers import HandlerRules
from spillway.sidecar.core.policy import PolicyEngine
from spillway.sidecar.core.ports import SystemClock
from spillway.sidecar.core.settings import job_settings
from spillway.sidecar.dlq import producer
from spillway.sidecar.errors import ConfigError
from spillway.sidecar.federation.confirm import Confirmations
from spillway.sidecar.federation.tallying import HomeTally, NodeTally
from spillway.sidecar.observability import prometheus, telemetry
from spillway.sidecar.observability.health import KAFKA_HEALTH_SERVICE, KafkaWatch
from spillway.sidecar.runtime import kafka_auth, memtune
from spillway.sidecar.service import runstate
from spillway.sidecar.service.admission import Admission
from spillway.sidecar.service.ended import EndedRuns, totals_rows
from spillway.sidecar.service.ending import Ending
from spillway.sidecar.service.identity import Identity
from spillway.sidecar.service.registration import Registrar, TopicRules
from spillway.sidecar.service.registry import Registry
from spillway.sidecar.service.reporting import Reporting
from spillway.sidecar.service.sidecar import Sidecar
from spillway.sidecar.service.status import Status
from spillway.sidecar.service.topic_checks import TopicChecks, kafka_conf
from spillway.sidecar.transport import listeners, localcred, rpc, security
from spillway.sidecar.transport.probe import start_probe_server
from spillway.sidecar.transport.servicer import SERVICE_NAME, ErrorSidecarServicer

if TYPE_CHECKING:
    from spillway.sidecar.dlq import DlqPipeline
    from spillway.sidecar.runtime.processes import ProcessRole

log = logging.getLogger("spillway.sidecar")

MAX_MESSAGE_BYTES = 64 * 1024 * 1024


class _Random:
    def __init__(self) -> None:
        self._r = random.Random()

    def random(self) -> float:
        return self._r.random()



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
        if self.sidecar.confirmations is not None:   # held rows stay: confirmed at the restart
            self.sidecar.confirmations.close()
        if self.sidecar.pipeline is not None:
            self.sidecar.pipeline.shutdown(timeout=max(0.0, deadline - time.monotonic()))
        if self.sidecar.runstate is not None:
            self.sidecar.runstate.close()
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


def _local_only(props: Mapping[str, object]) -> bool:
    """Nobody off this host can connect: no TCP listener, or a loopback one."""
    tcp = str(props.get("listen.address") or "")
    return not tcp or listeners.is_loopback_host(listeners.split_host_port(tcp)[0])


@dataclass(frozen=True)
class Parts:
    """What a sidecar's properties make before anything listens: the policy engine, the DLQ
    pipeline (with bootstrap.servers; not started), the runs' durable state, the security
    settings, the live-run registry and the ended runs."""

    props: dict
    engine: PolicyEngine
    pipeline: DlqPipeline | None   # with bootstrap.servers
    runstate: runstate.RunStore | None
    security: security.SecurityConfig
    registry: Registry
    sidecar_id: str
    ended: EndedRuns


def configure(raw: Mapping[str, str]) -> Parts:
    """Parse sidecar properties (already layered) and construct the engine and pipeline."""
    props = config.parse(raw)
    try:
        idtable.use_extension(extensions.enabled("idindex"))
        slots.use_extension(extensions.enabled("slots"))
    except ValueError as e:
        raise ConfigError(extensions.ENV, str(e)) from None
    job_defaults = {k: v for k, v in raw.items() if k in config.JOB_PROPERTIES}
    # A sidecar-level job default must itself be valid: check it once, at start-up.
    defaults = job_settings("sidecar-defaults", {}, job_defaults)
    check_topic_name(defaults.dlq, props["dlq.topic.required.prefix"],
                     props["dlq.topic.auto.create.allow"])
    props["_job_defaults"] = job_defaults
    kafka_overrides = kafka_auth.passthrough(raw)   # ${env:...} etc. read; MSK IAM's oauth_cb
    props["_kafka_overrides"] = kafka_overrides
    if not props["listen.address"] and not props["listen.unix.socket"]:
        raise ConfigError("listen.address", "set listen.address or listen.unix.socket")
    # user handler classes are operator-owned: the allow-list and time limit are sidecar-only
    rules = HandlerRules.from_properties(
        props["errors.handler.allowed.classes"], props["errors.handler.timeout.ms"],
        props["errors.handler.pool.size"], also=[job_defaults.get("errors.handler.class", "")])
    engine = PolicyEngine(clock=SystemClock(), rng=_Random(), job_defaults=job_defaults,
                          handler_rules=rules)
    ended = EndedRuns(max_runs=props["status.ended.runs.max"])

    def on_ack(key: str, n: int) -> None:
        # a run's records may be acknowledged after it ended (an expired run does not wait)
        if not engine.note_dead_letter_acked(key, n):
            ended.note_acked(key, n)

    pipeline = None
    if props["bootstrap.servers"]:
        from spillway.sidecar.dlq import DlqPipeline, default_spool_dir

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
            on_ack=on_ack,
            spool_group=props["spool.group"],
        )
    store = None
    state_dir = runstate.directory(props, raw)
    if state_dir is not None:   # with or without Kafka: a log-only sidecar's limits hold too
        store = runstate.RunStore(state_dir, max_idle_s=props["job.idle.timeout.ms"] / 1000,
                                  lock=pipeline is None)  # else the spool holds the lock
    sec = security.load_config(props)
    if localcred.applies(sec, _local_only(props)):
        sec = localcred.apply(sec, props["auth.local.token.file"] or localcred.default_path())
    return Parts(
        props=props, engine=engine, pipeline=pipeline, runstate=store, security=sec,
        registry=Registry(max_live=props["jobs.max.live"],
                          idle_timeout_s=props["job.idle.timeout.ms"] / 1000),
        sidecar_id=props["sidecar.id"] or socket.gethostname(), ended=ended,
    )


def build_sidecar(parts: Parts, *, identity: Identity,
                  tel: telemetry.Telemetry | None = None) -> Sidecar:
    """The service, wired once: every collaborator gets what it uses in its constructor. With
    a DLQ pipeline (started first) come the backpressure gate, the Kafka check (started) and,
    with a spool that holds, a node's confirmations (started: also for rows held before a
    restart)."""
    props, engine, pipeline = parts.props, parts.engine, parts.pipeline
    registry, store = parts.registry, parts.runstate
    tel = tel if tel is not None else telemetry.Telemetry()
    confirmations = admission = kafka = None
    if pipeline is not None:
        pipeline.start()
        if pipeline.holds:
            confirmations = Confirmations(engine=engine, pipeline=pipeline, registry=registry,
                                          props=props, sidecar_id=identity.sidecar_id)
        admission = Admission(pipeline.store,
                              low_water_percent=props["spool.low.water.percent"])
        kafka = KafkaWatch(kafka_conf(props),
                           interval_s=props["kafka.check.interval.ms"] / 1000).start()
    trimmer = memtune.Trimmer()
    rules = TopicRules(job_defaults=props.get("_job_defaults"),
                       required_prefix=props["dlq.topic.required.prefix"],
                       auto_create_allow=props["dlq.topic.auto.create.allow"],
                       dlq_writable=pipeline is not None)
    return Sidecar(
        identity=identity, props=props, engine=engine, registry=registry, pipeline=pipeline,
        runstate=store, telemetry=tel, admission=admission, kafka=kafka,
        confirmations=confirmations, trimmer=trimmer,
        registrar=Registrar(identity=identity, engine=engine, registry=registry,
                            runstate=store, topics=TopicChecks(props), rules=rules,
                            confirmations=confirmations),
        reporting=Reporting(engine=engine, registry=registry, pipeline=pipeline,
                            admission=admission, runstate=store, telemetry=tel,
                            confirmations=confirmations,
                            node_tally=NodeTally(engine=engine, confirmations=confirmations),
                            sidecar_id=identity.sidecar_id),
        home_tally=HomeTally(engine=engine, registry=registry, runstate=store, telemetry=tel),
        ending=Ending(identity=identity, registry=registry, engine=engine,
                      ended=parts.ended, runstate=store,
                      pipeline=pipeline, confirmations=confirmations, trimmer=trimmer),
        status=Status(identity=identity, engine=engine, registry=registry,
                      ended=parts.ended, pipeline=pipeline, confirmations=confirmations,
                      kafka=kafka, admission=admission),
        flush_timeout_s=props["flush.timeout.ms"] / 1000,
    )


class _Handlers:
    """Collects what a generated ``add_XServicer_to_server`` registers, so that it is served
    through `security.Authenticating` only (its registered-method copy is left out: grpc would
    serve those methods around the wrapper)."""

    def __init__(self) -> None:
        self.generic: list[grpc.GenericRpcHandler] = []

    def add_generic_rpc_handlers(self, handlers) -> None:
        self.generic.extend(handlers)

    def add_registered_method_handlers(self, service, handlers) -> None:
        pass


def start_server(
    raw: Mapping[str, str] | None = None,
    *,
    interceptors: Sequence[grpc.ServerInterceptor] = (),
    max_workers: int = 32,
    install_global_telemetry: bool = False,
    process: ProcessRole | None = None,
) -> RunningSidecar:
    """Build and start a sidecar from layered raw properties (see `config.resolve`);
    ``process``: one of several processes behind listen.address (processes.py). Its listeners
    are bound first (port 0 resolved), then the service is built with its addresses, then
    served."""
    raw = config.resolve(explicit=raw or {})  # idempotent over an already-layered mapping
    parts = configure(raw)
    props, sec, pipeline = parts.props, parts.security, parts.pipeline
    tcp = props["listen.address"]
    if tcp:
        listeners.check_plaintext_listen(tcp, sec)
    if props["listen.unix.socket"]:  # before anything starts: a refusal leaves no thread
        listeners.clear_stale_socket(props["listen.unix.socket"])
    local_only = _local_only(props)
    tel, spans = None, None
    if props["telemetry.enable"]:
        tel = telemetry.setup(sidecar_id=parts.sidecar_id,
                              install_global=install_global_telemetry)
        if props["metrics.prometheus.port"]:
            http = prometheus.serve(tel, props["metrics.prometheus.host"],
                                    props["metrics.prometheus.port"])
            tel.http_server, tel.prometheus_port = http, http.server_port
        if pipeline is not None:
            pipeline.tracer = tel.tracer
            pipeline.traced = tel.exporting
        # gRPC server spans continue the executor's trace (W3C context in the metadata); only
        # a sampled call pays for its span
        spans = telemetry.ServerSpans(tel.tracer_provider)
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="spillway-rpc"),
        interceptors=list(interceptors) or None,
        options=[("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                 ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                 ("grpc.so_reuseport", int(process is not None))],
    )
    address = _bind(server, props, sec, process)
    identity = Identity(
        sidecar_id=parts.sidecar_id, instance_id=uuid.uuid4().hex, listen_address=address,
        # where its runs are homed: its own port when it is one of several processes
        advertised_address=(process.advertised if process is not None else
                            sec.advertised_address or listeners.default_advertised(address)),
        process_port=process.port if process is not None else 0,
        siblings=tuple(process.siblings) if process is not None else (),
        security=sec)
    sidecar = build_sidecar(parts, identity=identity, tel=tel)
    if tel is not None:
        task_label = props["metrics.task.label.enable"]
        tel.add_source(lambda: sidecar.engine.metric_rows(task_label=task_label))
        tel.add_source(lambda: _sidecar_wide_rows(sidecar.status))
        if pipeline is not None:  # the spool's high-water marks, beside its fill
            limits = [("spool-max-records", {}, float(props["spool.max.records"])),
                      ("spool-max-bytes", {}, float(props["spool.max.bytes"]))]
            tel.add_source(lambda: limits)
    # raw bytes in, parsed and bounded inside: undecodable requests answer INVALID_ARGUMENT;
    # every method of both services authenticated first: nothing (tracing included) sees a
    # call before it is, then the call's server span (a handler wrapper, not an interceptor)
    health_servicer = health.HealthServicer()
    health_handlers = _Handlers()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, health_handlers)
    server.add_generic_rpc_handlers((security.Authenticating(
        [rpc.generic_handler(ErrorSidecarServicer(sidecar)), *health_handlers.generic],
        security.Authenticator(sec, local_only=local_only),
        around=spans.wrap if spans is not None else None),))
    server.start()
    sidecar.registry.start_reaper(sidecar.expire)
    for name in ("", SERVICE_NAME) + ((KAFKA_HEALTH_SERVICE,) if sidecar.kafka else ()):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    running = RunningSidecar(server, sidecar, health_servicer, address)
    if props["health.listen.address"]:
        try:
            running.probe, running.probe_address = start_probe_server(
                props["health.listen.address"], health_servicer,
                reuse_port=process is not None)
        except Exception:
            running.stop(0)
            raise
    if pipeline is not None:
        running._watch = threading.Thread(target=running._watch_backpressure,
                                          name="spillway-health", daemon=True)
        running._watch.start()
    where = (f"{address} (process {process.index + 1} of {process.count}, its own port "
             f"{process.advertised})" if process is not None else address)
    log.info("spillway sidecar %s serving on %s (%s)", sidecar.sidecar_id, where,
             security.describe(sec, local_only=local_only))
    for weakness in security.weaknesses(sec, local_only=local_only):
        log.warning("security: %s", weakness)
    if not idtable.BUILT:
        log.warning("the sidecar was installed without its C extension (no C compiler then): "
                    "its id tables' per-id loops run in Python, which about doubles what a "
                    "run's home spends per record (docs/DEPLOY.md)")
    elif not idtable.NATIVE:
        log.warning("the id tables' C extension is turned off (%s): their per-id loops run in "
                    "Python, which about doubles what a run's home spends per record",
                    extensions.ENV)
    if not slots.NATIVE:
        log.warning("a report's per-record objects are made by their Python constructors, not "
                    "column-wise in C (%s): about 10-20%% more of a node's CPU per dead-lettered "
                    "record (docs/DEPLOY.md)",
                    "turned off, " + extensions.ENV if slots.BUILT else
                    "the sidecar was installed without its C extension")
    without = (("not available", producer.NATIVE_MISSING) if producer.NATIVE_MISSING else
               None if extensions.enabled("produce") else ("turned off", extensions.ENV))
    if without:
        log.warning("the DLQ drain's C produce loop is %s (%s): each record goes through "
                    "confluent-kafka's produce(), about 4 µs more of a node's CPU per "
                    "dead-lettered record (docs/DEPLOY.md)", *without)
    if props["producer.native"] is not None:
        log.warning("producer.native is deprecated and has no effect: the DLQ drain's produce "
                    "loop is C where the sidecar's extension was built (%s=produce turns it "
                    "off; docs/DLQ.md, \"Producing\")", extensions.ENV)
    return running


def _sidecar_wide_rows(status: Status) -> list[telemetry.Row]:
    """The sidecar-wide series: its counters, and the totals that outlive the runs."""
    counters, totals = status.snapshot()
    rows: list[telemetry.Row] = [(k, {}, float(v)) for k, v in counters.items()
                                 if k in telemetry.SIDECAR_WIDE]
    rows.extend(totals_rows(totals))
    return rows


def _bind(server: grpc.Server, props: Mapping, sec: security.SecurityConfig,
          process: ProcessRole | None) -> str:
    """Bind the listeners (before any handler is added or the server started): what a client
    dials, host:port (port 0 resolved) or unix:///path."""
    address = ""
    if props["listen.unix.socket"]:
        path = props["listen.unix.socket"]
        old_umask = os.umask(0o177)  # nobody else can connect before the mode below is set
        try:
            server.add_insecure_port(f"unix://{path}")
        finally:
            os.umask(old_umask)
        listeners.secure_socket(path, props["listen.unix.socket.mode"],
                                props["listen.unix.socket.owner"],
                                props["listen.unix.socket.group"])
        address = f"unix://{path}"
    tcp = props["listen.address"]
    if tcp:
        host = tcp.rpartition(":")[0]
        creds = listeners.TlsReloader(sec.tls).server_credentials() if sec.tls else None

        def bind(where: str) -> int:
            bound = (server.add_secure_port(where, creds) if creds is not None
                     else server.add_insecure_port(where))
            if bound == 0:
                raise ConfigError("listen.address", f"cannot bind {where}")
            return bound

        address = f"{host}:{bind(tcp)}"  # port 0 picks a free port: report the real one
        if process is not None:  # and its own port, with the same credentials
            bind(process.process_address())
    return address


__all__ = ["start_server", "configure", "build_sidecar", "Parts", "RunningSidecar",
           "MAX_MESSAGE_BYTES"]
