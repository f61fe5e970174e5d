"""Configuration: KIP property names are the public vocabulary.

Two scopes share one table:
- job properties (``errors.*`` and the retry knobs) arrive with RegisterJob; the sidecar's own
  config may set them too, as defaults for every job;
- sidecar properties (``listen.*``, ``bootstrap.servers``, ``spool.*``, ``producer.*``) only
  come from the sidecar's flags, environment and file.

Precedence: explicit argument (flag / RegisterJob), then environment (``SPILLWAY_`` + the name
upper-cased with dots as underscores), then file (Java properties), then default. Every value is
parsed and checked once; a bad one raises ConfigError naming the property and what is allowed.
"""

from __future__ import annotations

import difflib
import math
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError
from .names import MAX_SHOWN, prefix_fragment_error, shown

ENV_PREFIX = "SPILLWAY_"


@dataclass(frozen=True, slots=True)
class Prop:
    name: str
    parse: Callable[[str, str], Any]  # (property name, raw text) -> value; raises ConfigError
    default: str
    doc: str
    job: bool = True  # settable per job (else sidecar-only)


# --- bounds: every number has a range (days, not eons), so no sum or product of them can
# overflow what protobuf's int64/uint64 fields or a float carry ------------------------------
HOUR_MS = 3_600_000
DAY_MS = 24 * HOUR_MS
WEEK_MS = 7 * DAY_MS
MAX_COUNT = 10**12       # record counts, thresholds
MAX_RETRIES = 1_000_000  # per-record retry and hold counts, task counts


def _num(text: str) -> str:
    return text if len(text) <= MAX_SHOWN else text[:MAX_SHOWN] + "..."


# --- parsers -------------------------------------------------------------------------------


def p_bool(name: str, raw: str) -> bool:
    v = raw.strip().lower()
    if v in ("true", "false"):
        return v == "true"
    raise ConfigError(name, f"must be true or false, got {shown(raw)}")


def p_int(lo: int | None = None, hi: int | None = None, extra: Iterable[int] = ()):
    allowed = tuple(extra)

    def parse(name: str, raw: str) -> int:
        try:
            v = int(raw.strip())
        except ValueError:
            raise ConfigError(name, f"must be an integer, got {shown(raw)}") from None
        if v in allowed:
            return v
        if (lo is not None and v < lo) or (hi is not None and v > hi):
            rng = f"[{lo if lo is not None else '-inf'}, {hi if hi is not None else 'inf'}]"
            also = f" or one of {list(allowed)}" if allowed else ""
            raise ConfigError(name, f"must be in {rng}{also}, got {_num(str(v))}")
        return v

    parse.range = (lo, hi, allowed)  # type: ignore[attr-defined]  # for docs/CONFIGURATION.md
    return parse


def p_float(lo: float | None = None, hi: float | None = None, extra: Iterable[float] = ()):
    allowed = tuple(extra)

    def parse(name: str, raw: str) -> float:
        try:
            v = float(raw.strip())
        except ValueError:
            raise ConfigError(name, f"must be a number, got {shown(raw)}") from None
        if math.isnan(v) or math.isinf(v):
            raise ConfigError(name, f"must be a finite number, got {shown(raw)}")
        if v in allowed:
            return v
        if (lo is not None and v < lo) or (hi is not None and v > hi):
            rng = f"[{lo if lo is not None else '-inf'}, {hi if hi is not None else 'inf'}]"
            also = f" or one of {list(allowed)}" if allowed else ""
            raise ConfigError(name, f"must be in {rng}{also}, got {_num(raw.strip())}")
        return v

    parse.range = (lo, hi, allowed)  # type: ignore[attr-defined]
    return parse


def p_choice(*choices: str):
    def parse(name: str, raw: str) -> str:
        v = raw.strip().lower()
        if v not in choices:
            raise ConfigError(name, f"must be one of {', '.join(choices)}; got {shown(raw)}")
        return v

    return parse


def p_str(name: str, raw: str) -> str:
    return raw.strip()


def p_listen(name: str, raw: str) -> str:
    """A TCP listen address: host:port (IPv6 in brackets), port 0-65535 (0: pick a free
    one); '' disables TCP. A bare host is refused (gRPC would listen on port 443)."""
    v = raw.strip()
    if not v:
        return v
    host, sep, port = v.rpartition(":")
    if not sep or not host:
        raise ConfigError(name, f"must be host:port (e.g. 127.0.0.1:50051), got {raw!r}")
    if host.startswith("[") != host.endswith("]") or (":" in host and not host.startswith("[")):
        raise ConfigError(name, f"an IPv6 host goes in brackets ([::1]:50051), got {raw!r}")
    if not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ConfigError(name, f"port must be 0-65535 (0: any free port), got {port!r} in "
                                f"{raw!r}")
    return v


def p_topic_prefix(name: str, raw: str) -> str:
    """A DLQ topic-name prefix: '' or a legal topic-name fragment (KIP-1191)."""
    v = raw.strip()
    why = prefix_fragment_error(v)
    if why is not None:
        raise ConfigError(name, why)
    return v


def p_octal_mode(name: str, raw: str) -> int:
    try:
        v = int(raw.strip(), 8)
    except ValueError:
        raise ConfigError(name,
                          f"must be an octal file mode such as 0660, got {shown(raw)}") from None
    if not 0 <= v <= 0o777:
        raise ConfigError(name, f"must be an octal file mode in [0000, 0777], got {shown(raw)}")
    return v


def p_optional_int(lo: int, hi: int | None = None):
    """Unset ("") means 'not configured' (None): lets the two retry families be told apart."""
    inner = p_int(lo, hi)

    def parse(name: str, raw: str) -> int | None:
        return None if raw.strip() == "" else inner(name, raw)

    parse.range = inner.range  # type: ignore[attr-defined]
    return parse


def p_optional_float(lo: float, hi: float | None = None):
    inner = p_float(lo, hi)

    def parse(name: str, raw: str) -> float | None:
        return None if raw.strip() == "" else inner(name, raw)

    parse.range = inner.range  # type: ignore[attr-defined]
    return parse


# --- the table -----------------------------------------------------------------------------

CATEGORY_NAMES = (
    "retriable",
    "refresh-retriable",
    "abortable",
    "application-recoverable",
    "invalid-configuration",
    "data",
    "crash",
    "timeout",
)

_PROPS: list[Prop] = [
    # KIP-298 tolerance, logging, retry
    Prop("errors.tolerance", p_choice("none", "all"), "none",
         "none: fail on the first error (fail fast); all: skip failed records within the limits"),
    Prop("errors.tolerance.max.errors", p_int(-1, MAX_COUNT), "-1",
         "with errors.tolerance=all: fail the job past this many errors (-1: no count limit)"),
    Prop("errors.tolerance.max.ratio", p_float(0.0, 1.0, extra=(-1.0,)), "-1",
         "with errors.tolerance=all: fail the job past this ratio of errors to processed records "
         "(-1: no ratio limit)"),
    Prop("errors.tolerance.min.records", p_int(0, MAX_COUNT), "100",
         "the ratio limit applies once this many records were processed in the window"),
    Prop("errors.tolerance.window.ms", p_int(0, WEEK_MS), "0",
         "sliding window of the limits in ms (0: the whole job)"),
    Prop("errors.tolerance.per.stage", p_bool, "false",
         "apply the count and ratio limits to each stage separately as well as to the job"),
    Prop("errors.retry.timeout", p_int(-1, WEEK_MS), "0",
         "KIP-298: total ms a failed record is retried for, from its first failure (0: no "
         "retry unless errors.retry.max.retries is set, then no time bound; -1: no limit)"),
    Prop("errors.retry.delay.max.ms", p_int(1, DAY_MS), "60000",
         "KIP-298: max delay between two consecutive retries, ms"),
    Prop("errors.retry.max.retries", p_optional_int(0, MAX_RETRIES), "",
         "status-store KIP (alias status.storage.retry.max.retries): max retries of one "
         "record; with errors.retry.timeout both bound, whichever is reached first (unset: 5 "
         "once any knob of this family is set, else errors.retry.timeout alone decides)"),
    Prop("errors.retry.initial.backoff.ms", p_optional_int(0, DAY_MS), "",
         "status-store KIP (alias status.storage.retry.initial.backoff.ms): first backoff, ms "
         "(unset: 300)"),
    Prop("errors.retry.max.backoff.ms", p_optional_int(0, DAY_MS), "",
         "status-store KIP (alias status.storage.retry.max.backoff.ms): backoff cap, ms "
         "(unset: 10000, or errors.retry.delay.max.ms when that is lower)"),
    Prop("errors.retry.backoff.multiplier", p_optional_float(1.0, 100.0), "",
         "status-store KIP (alias status.storage.retry.backoff.multiplier): multiplier per "
         "attempt, >= 1 (unset: 2.0)"),
    Prop("errors.retry.jitter.factor", p_optional_float(0.0, 1.0), "",
         "status-store KIP (alias status.storage.retry.jitter.factor): jitter factor in [0, 1] "
         "(unset: 0.25)"),
    Prop("errors.retry.budget.ratio", p_float(0.0, 1.0, extra=(-1.0,)), "0.2",
         "retry budget (a rate bound that defers retries, never drops them): the job's retries "
         "per window may be errors.retry.budget.min.retries plus this fraction of the records "
         "it processed or saw fail for the first time in the window (-1: no budget)"),
    Prop("errors.retry.budget.min.retries", p_int(1, MAX_COUNT), "100",
         "retries per budget window always available, whatever the ratio (100 per 10 s: "
         "Finagle's 10 retries per second)"),
    Prop("errors.retry.budget.window.ms", p_int(1, DAY_MS), "10000",
         "the window over which the retry budget is measured, ms"),
    Prop("errors.circuit.enable", p_bool, "true",
         "share one wait among all executors when an error class fails for many at once"),
    Prop("errors.circuit.failure.threshold", p_int(1, MAX_COUNT), "20",
         "retriable failures of one error class within the window that open the circuit"),
    Prop("errors.circuit.min.tasks", p_int(1, MAX_RETRIES), "2",
         "distinct Spark tasks (stage.partition) that must see those failures (one task "
         "retrying alone never opens it)"),
    Prop("errors.circuit.window.ms", p_int(1, DAY_MS), "10000",
         "the window in which failures are counted, ms"),
    Prop("errors.circuit.open.ms", p_int(1, DAY_MS), "5000",
         "how long an open circuit holds everyone back before one probe goes through, ms"),
    Prop("errors.circuit.success.threshold", p_int(1, MAX_RETRIES), "3",
         "recoveries in half-open state that close the circuit again"),
    Prop("errors.circuit.max.holds", p_int(0, MAX_RETRIES), "10",
         "waits an open circuit may impose on one record without charging its retries; "
         "later ones count against errors.retry.max.retries and the retry budget"),
    Prop("errors.record.timeout.ms", p_int(0, DAY_MS), "0",
         "time limit of one record's processing on an executor, ms (0: none). A record past it "
         "is a failure of category timeout: its Python worker is stopped (C code cannot be "
         "interrupted), Spark runs the task again, and that attempt runs its records in a "
         "helper process under the same limit; decided like a data error (docs/POLICY.md, "
         "When a record kills or hangs its worker). Read by the executors from the run's "
         "effective policy"),
    Prop("errors.log.enable", p_bool, "false",
         "KIP-298: log one structured line with the context of each error"),
    Prop("errors.log.include.messages", p_bool, "false",
         "KIP-298: include the record's key, value and headers in that line"),
    # KIP-1033 handler and KIP-1050 classification
    Prop("errors.handler.class", p_str, "",
         "KIP-1033 handler (alias processing.exception.handler) for records whose retries "
         "are exhausted: LogAndContinue, LogAndFail, or a user class as package.module:Class "
         "(unset: follows errors.tolerance, none -> LogAndFail, all -> LogAndContinue)"),
    Prop("errors.classification.default", p_choice(*CATEGORY_NAMES), "data",
         "category of exceptions no rule matches (KIP-298 tolerates any exception in a stage)"),
    Prop("errors.classification.rules", p_str, "",
         "user rules: comma-separated qualified.ExceptionClass=category (any class in the "
         "reported class chain matches) or kafka:ERROR_CODE=category (a confluent-kafka "
         "KafkaError.name(), e.g. kafka:MSG_SIZE_TOO_LARGE=data)"),
    Prop("errors.handler.allowed.classes", p_str, "",
         "the user handler classes (package.module:Class, comma-separated) a job may name in "
         "errors.handler.class; the built-ins and the sidecar's own default are always allowed, "
         "anything else is refused before it is imported", job=False),
    Prop("errors.handler.timeout.ms", p_int(1, 600_000), "5000",
         "time limit of one call of a user handler (construction, configure, handle); one "
         "that does not answer in time counts as a handler crash (KIP-1033: fails the job)",
         job=False),
    Prop("errors.handler.pool.size", p_int(1, 64), "4",
         "threads that run user handlers; when all are held by handlers past their time "
         "limit, further handler calls fail at once (a handler crash), never wait", job=False),
    # DLQ (KIP-298, KIP-1191)
    Prop("errors.deadletterqueue.topic.name", p_str, "",
         "the DLQ topic; empty: no DLQ (skipped records are only logged and counted)"),
    Prop("errors.deadletterqueue.topic.name.prefix", p_topic_prefix, "",
         "KIP-1191: this job's DLQ topic names must start with this; a job may only narrow "
         "the operator's dlq.topic.required.prefix (that prefix or a longer one starting with "
         "it; unset: that prefix). A legal topic-name fragment: [a-zA-Z0-9._-]"),
    Prop("errors.deadletterqueue.context.headers.enable", p_bool, "false",
         "KIP-298: add the error-context headers to DLQ records"),
    Prop("errors.deadletterqueue.headers.format", p_choice("connect", "dlq"), "connect",
         "context header family: connect (__connect.errors.*, KIP-298) or dlq "
         "(__dlq.errors.*, KIP-1191)"),
    Prop("errors.deadletterqueue.copy.record.enable", p_bool, "true",
         "KIP-1191: copy the original key, value and headers (false: context-only records)"),
    Prop("errors.deadletterqueue.auto.create.topics.enable", p_bool, "false",
         "KIP-1191: create a missing DLQ topic (never by default)"),
    Prop("errors.deadletterqueue.topic.replication.factor", p_int(1, 32767), "3",
         "replication factor of an auto-created DLQ topic"),
    Prop("errors.deadletterqueue.topic.partitions", p_int(1, 100_000), "1",
         "partition count of an auto-created DLQ topic"),
    Prop("errors.deadletterqueue.stacktrace.max.bytes", p_int(0, 1024 * 1024), "8192",
         "stack traces in headers are cut to this many bytes (oversized headers break consumers)"),
    # sidecar-only
    Prop("listen.address", p_listen, "127.0.0.1:50051",
         "TCP host:port to serve on ('' disables TCP); loopback by default, never all interfaces",
         job=False),
    Prop("listen.unix.socket", p_str, "",
         "Unix socket path to serve on ('' disables); the recommended node-local transport "
         "(plaintext, guarded by its file mode). A stale socket there is replaced; any other "
         "file stops start-up", job=False),
    Prop("listen.unix.socket.mode", p_octal_mode, "0660",
         "file mode of listen.unix.socket (octal), set before the first call is accepted",
         job=False),
    Prop("listen.unix.socket.owner", p_str, "",
         "user (name or uid) to own listen.unix.socket ('': the sidecar's user)", job=False),
    Prop("listen.unix.socket.group", p_str, "",
         "group (name or gid) of listen.unix.socket, e.g. the executors' group ('': the "
         "sidecar's group)", job=False),
    Prop("dlq.topic.required.prefix", p_topic_prefix, "dlq.",
         "KIP-1191's prefix rule, owned by the operator: every DLQ topic name must start with "
         "this, and a job's errors.deadletterqueue.topic.name.prefix may only narrow it ('': "
         "any name other than Kafka's internal __ topics)", job=False),
    Prop("dlq.topic.auto.create.allow", p_bool, "true",
         "whether a job may ask for its DLQ topic to be created "
         "(errors.deadletterqueue.auto.create.topics.enable, false by default as KIP-1191 "
         "says); false: only topics the operator created are used", job=False),
    Prop("health.listen.address", p_listen, "",
         "plaintext host:port serving only grpc.health.v1 (no spillway.v1 method, no "
         "credentials), for probes that cannot speak TLS such as the kubelet's gRPC probes; its "
         "service spillway.liveness is SERVING while the process answers (for liveness probes) "
         "('' : none; the health service is always on listen.address too)", job=False),
    Prop("bootstrap.servers", p_str, "", "Kafka bootstrap servers for DLQ writes", job=False),
    Prop("sidecar.id", p_str, "", "this sidecar's name in summaries (default: host name)",
         job=False),
    Prop("sidecar.processes", p_int(1, 64), "1",
         "sidecar processes behind listen.address (Linux SO_REUSEPORT), to use more than one "
         "core of a node: each has its own process port, spool (spool.dir/process-N) and run "
         "state, and is started again when it exits; a start with another count is refused "
         "while the other count's directories hold records or live runs (docs/DEPLOY.md)",
         job=False),
    Prop("sidecar.processes.port.base", p_int(0, 65535), "0",
         "with sidecar.processes > 1, process N listens and is advertised on this port + N "
         "(0: the listen port + 1 + N, or free ports when that is 0)", job=False),
    Prop("spool.dir", p_str, "", "directory of the durable DLQ spool (default: a per-user "
         "state directory)", job=False),
    Prop("spool.enable", p_bool, "true", "spool DLQ records to disk before acknowledging",
         job=False),
    Prop("run.state.durable", p_bool, "true",
         "keep each run's job-wide state (counted errors and ids, progress, failure) in "
         "spool.dir, with or without Kafka, so that a restarted sidecar resumes its runs "
         "(not with spool.enable=false)", job=False),
    Prop("home.confirm.async", p_bool, "true",
         "a node answers a report of a run homed at another sidecar at once when nothing but "
         "the records' identity decides its verdicts (data errors, the built-in CONTINUE "
         "handler, no tolerance limit), holds its DLQ records in the spool and confirms them "
         "with the home in the background (docs/POLICY.md, \"Provisional verdicts\"); false: "
         "every such report waits for its home (needs the spool)", job=False),
    Prop("home.confirm.linger.ms", p_int(0, 60_000), "250",
         "how long a node's held report may wait for others to share its confirmation call "
         "(at most 64 reports and 16,384 records a call); a flush or an end of the run sends "
         "at once", job=False),
    Prop("spool.group", p_str, "",
         "group given read access to the spool (directory 0750, files 0640); '': directory "
         "0700, files 0600, the sidecar's user alone", job=False),
    Prop("spool.max.bytes", p_int(1, 2**50), str(512 * 1024 * 1024),
         "spool high-water mark in bytes: backpressure past it", job=False),
    Prop("spool.max.records", p_int(1, MAX_COUNT), "2000000",
         "spool high-water mark in records: backpressure past it", job=False),
    Prop("spool.low.water.percent", p_int(0, 100), "80",
         "after a refusal for backpressure, reports are refused (health NOT_SERVING) until the "
         "spool holds less than this percentage of both spool.max.records and spool.max.bytes "
         "and the refused report would fit",
         job=False),
    Prop("kafka.check.interval.ms", p_int(1000, DAY_MS), "30000",
         "how often the sidecar checks that its Kafka answers (health service spillway.kafka, "
         "metric spillway_kafka_reachable); the first check runs at start-up", job=False),
    Prop("producer.linger.ms", p_int(0, 900_000), "20",
         "DLQ producer linger, ms: how long after a produce request the drain gathers records "
         "for the next (a full one, or a flush barrier waiting, goes at once)", job=False),
    Prop("producer.native", lambda name, raw: p_bool(name, raw) if raw.strip() else None, "",
         "deprecated, no effect (true or false accepted; a warning at start-up): the DLQ "
         "drain's produce loop is C where the sidecar's extension was built, on "
         "confluent-kafka's producer (docs/DLQ.md, \"Producing\"); "
         "SPILLWAY_NO_EXTENSIONS=produce turns it off", job=False),
    Prop("producer.batch.size", p_int(1, 2**31 - 1), "1000000",
         "DLQ producer batch size, bytes: also what the drain hands librdkafka at a time, one "
         "produce request's worth (docs/DLQ.md, \"Producing\")", job=False),
    Prop("producer.max.inflight.bytes", p_int(1024, 2**31 - 1), str(1024 * 1024),
         "DLQ record bytes the drain takes for the producer and holds until acknowledged; what "
         "is in flight when the sidecar crashes may be written twice (docs/DLQ.md)", job=False),
    Prop("flush.timeout.ms", p_int(1, DAY_MS), "60000",
         "default flush-barrier deadline when the client sets none, ms", job=False),
    Prop("telemetry.enable", p_bool, "true",
         "OpenTelemetry traces and metrics (exported only where OTEL_* / the Prometheus port "
         "say so)", job=False),
    Prop("metrics.prometheus.port", p_int(0, 65535), "0",
         "serve metrics for Prometheus scrapes on this port (0: off)", job=False),
    Prop("metrics.prometheus.host", p_str, "127.0.0.1",
         "address of the Prometheus endpoint (0.0.0.0 inside a container)", job=False),
    Prop("metrics.task.label.enable", p_bool, "false",
         "label per-job metrics with the Spark task too (stage.partition): one series per "
         "partition, for debugging only", job=False),
    Prop("shutdown.grace.ms", p_int(0, HOUR_MS), "10000",
         "graceful stop: `spillway serve` ends within it, whatever Kafka does (in-flight calls, "
         "then the DLQ's last flush; what Kafka has not acknowledged stays in the spool), ms",
         job=False),
    # security (docs/SECURITY.md)
    Prop("auth.token.file", p_str, "",
         "file holding the node API token (one per line; the first is sent, all accepted; "
         "re-read on change): every call must carry it as spillway-node-token metadata, or "
         "a peer or admin credential ('' : no node token)", job=False),
    Prop("auth.peer.token.file", p_str, "",
         "file holding the cluster-wide sidecar-to-sidecar token (spillway-peer-token): "
         "proves a caller is a peer sidecar, which alone may set sidecar-only request fields; "
         "also sent when this sidecar dials a job's home", job=False),
    Prop("auth.admin.token.file", p_str, "",
         "file holding the operator token (spillway-admin-token) for spillway status and job "
         "commands", job=False),
    Prop("auth.local.token.file", p_str, "",
         "where the default configuration (no credential set, loopback / Unix socket only) "
         "keeps its own admin and peer token, made at first start and readable by this OS "
         "user only ('': $XDG_STATE_HOME/spillway/local.token)", job=False),
    Prop("auth.peer.identities", p_str, "",
         "comma-separated mTLS identities (certificate SAN DNS/URI or CN) accepted as peer "
         "sidecars; needs tls.ca.file", job=False),
    Prop("tls.cert.file", p_str, "",
         "PEM certificate chain to serve TLS with (with tls.key.file; re-read on change). "
         "Also this sidecar's client certificate when it dials a job's home", job=False),
    Prop("tls.key.file", p_str, "", "PEM private key of tls.cert.file", job=False),
    Prop("tls.ca.file", p_str, "",
         "PEM CA bundle that verifies client certificates (mutual TLS) and the certificates "
         "of homes this sidecar dials", job=False),
    Prop("tls.client.auth", p_choice("auto", "none", "require"), "auto",
         "client certificates: require (mutual TLS) or none; auto: require when tls.ca.file "
         "is set", job=False),
    Prop("listen.plaintext.allow", p_bool, "false",
         "allow plaintext (no TLS) on a non-loopback listen.address; refused by default",
         job=False),
    Prop("advertised.address", p_str, "",
         "host:port other nodes' sidecars reach this one at, named as a job's home (default: "
         "the listen address, its host name for 0.0.0.0; a loopback one only works on a "
         "single host)", job=False),
    Prop("home.allowed.addresses", p_str, "",
         "comma-separated addresses this sidecar may dial as a job's home: host, host:port, "
         "CIDR[:port], *.domain[:port] or * ('': none; its own addresses are always "
         "allowed). Matched before any DNS lookup and before any dial", job=False),
    Prop("jobs.max.live", p_int(1, 1_000_000), "1000",
         "live job runs this sidecar keeps at once; past it RegisterJob of a new run answers "
         "RESOURCE_EXHAUSTED", job=False),
    Prop("job.idle.timeout.ms", p_int(1000, 30 * 24 * 3600 * 1000), "3600000",
         "a job run with no call for this long ends on its own (driver gone without "
         "Job.close()); counted as jobs-expired", job=False),
    Prop("status.ended.runs.max", p_int(0, 10_000), "100",
         "ended job runs whose final summaries spillway status keeps (the oldest dropped "
         "first; about 1.5 KB each, 0: none). The totals of every ended run are kept "
         "whatever this is", job=False),
]

PROPERTIES: dict[str, Prop] = {p.name: p for p in _PROPS}
JOB_PROPERTIES = frozenset(p.name for p in _PROPS if p.job)

# Other KIPs' literal names for spillway's properties: accepted anywhere a property is, and
# read as the canonical name (which effective properties and messages use). Setting an alias
# and its canonical name to different values in one place is refused, naming both.
ALIASES: dict[str, str] = {
    # the status-store KIP (its defaults apply whenever the family is in use: settings.py)
    "status.storage.retry.max.retries": "errors.retry.max.retries",
    "status.storage.retry.initial.backoff.ms": "errors.retry.initial.backoff.ms",
    "status.storage.retry.max.backoff.ms": "errors.retry.max.backoff.ms",
    "status.storage.retry.backoff.multiplier": "errors.retry.backoff.multiplier",
    "status.storage.retry.jitter.factor": "errors.retry.jitter.factor",
    # KIP-1033 (Kafka Streams' name for its processing handler)
    "processing.exception.handler": "errors.handler.class",
}
# librdkafka settings for the DLQ producer pass through under this prefix: producer.kafka.<key>
PRODUCER_PASSTHROUGH = "producer.kafka."


def env_name(prop: str) -> str:
    return ENV_PREFIX + prop.upper().replace(".", "_").replace("-", "_")


def canonical(layer: Mapping[str, str]) -> dict[str, str]:
    """``layer`` with every alias (`ALIASES`) replaced by its canonical name; ConfigError naming
    both when an alias and its canonical name (or two aliases of it) disagree."""
    if not any(k in ALIASES for k in layer):
        return dict(layer)
    out: dict[str, str] = {}
    given: dict[str, str] = {}          # canonical name -> the name it was given as
    for k, v in layer.items():
        name = ALIASES.get(k, k)
        if name in out and out[name].strip() != v.strip():
            first = given[name]
            raise ConfigError(k, (
                f"conflicts with {first}={out[name]!r}: {k}={v!r} "
                f"{'is an alias of' if k != name else 'is the canonical name of'} "
                f"{name if k != name else first}; set only one of {first} and {k}"))
        out[name] = v
        given.setdefault(name, k)
    return out


# SPILLWAY_* variables that are not properties: read by the CLI and the client library.
OTHER_ENV = frozenset({
    "SPILLWAY_CONFIG", "SPILLWAY_LOG_LEVEL", "SPILLWAY_SIDECAR_ADDRESS", "SPILLWAY_TOKEN_FILE",
    "SPILLWAY_ADMIN_TOKEN_FILE", "SPILLWAY_PEER_TOKEN_FILE", "SPILLWAY_TLS_CA_FILE",
    "SPILLWAY_TLS_CERT_FILE", "SPILLWAY_TLS_KEY_FILE", "SPILLWAY_TLS_SERVER_NAME",
    "SPILLWAY_LOCAL_TOKEN_FILE", "SPILLWAY_NO_EXTENSIONS", "SPILLWAY_CRUMB_DIR"})


def unknown_environment(env: Mapping[str, str]) -> list[str]:
    """One message per ``SPILLWAY_*`` variable that names no property, passthrough or known
    client variable, with the same did-you-mean as an unknown ``--set`` property."""
    known = {env_name(p) for p in PROPERTIES} | OTHER_ENV
    passthrough = env_name(PRODUCER_PASSTHROUGH)
    out = []
    for name in sorted(env):
        if not name.startswith(ENV_PREFIX) or name in known or name.startswith(passthrough):
            continue
        close = difflib.get_close_matches(name, sorted(known), n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        out.append(f"{name}: unknown environment variable, ignored{hint}")
    return out


def _check_known(name: str, scope: str, allowed: frozenset[str] | None) -> None:
    if name.startswith(PRODUCER_PASSTHROUGH) and allowed is None:
        return
    if name not in PROPERTIES or (allowed is not None and name not in allowed):
        choices = sorted(allowed if allowed is not None else PROPERTIES)
        close = difflib.get_close_matches(name, choices, n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        raise ConfigError(name, f"unknown {scope} property{hint}")


def resolve(
    *,
    explicit: Mapping[str, str] | None = None,
    env: Mapping[str, str] | None = None,
    file: Mapping[str, str] | None = None,
    defaults: Mapping[str, str] | None = None,
    scope: str = "sidecar",
) -> dict[str, str]:
    """Merge the layers (explicit > env > file > defaults > table default) into raw strings.

    Unknown names in explicit/file layers are refused; env is scanned only for known names.
    """
    allowed = JOB_PROPERTIES if scope == "job" else None
    out: dict[str, str] = {
        name: p.default for name, p in PROPERTIES.items() if allowed is None or name in allowed
    }
    for layer in (canonical(defaults or {}),):
        for k, v in layer.items():
            if allowed is None or k in allowed:
                out[k] = v
    for k, v in canonical(file or {}).items():
        _check_known(k, scope, allowed)
        out[k] = v
    if env is not None:
        found = {name: ev for name in (*out, *ALIASES)
                 if (ev := env.get(env_name(name))) is not None}
        for name, ev in canonical(found).items():
            if name in out:
                out[name] = ev
        if allowed is None:
            for ek, ev in env.items():
                if ek.startswith(env_name(PRODUCER_PASSTHROUGH)):
                    out[PRODUCER_PASSTHROUGH + ek[len(env_name(PRODUCER_PASSTHROUGH)):].lower()
                        .replace("_", ".")] = ev
    for k, v in canonical(explicit or {}).items():
        _check_known(k, scope, allowed)
        out[k] = v
    return out


def parse(raw: Mapping[str, str]) -> dict[str, Any]:
    """Parse every known property; unknown producer passthrough keys stay strings."""
    out: dict[str, Any] = {}
    for k, v in raw.items():
        p = PROPERTIES.get(k)
        out[k] = p.parse(k, v) if p else v
    return out


def load_properties_file(path: str) -> dict[str, str]:
    """Read a Java-properties file (the format Kafka's own configs use)."""
    import javaproperties

    try:
        with open(path, encoding="utf-8") as fh:
            return dict(javaproperties.load(fh))
    except FileNotFoundError:
        raise ConfigError("config", f"file not found: {path}") from None
    except OSError as exc:
        raise ConfigError("config", f"cannot read {path}: {exc}") from exc


def from_environment() -> dict[str, str]:
    return dict(os.environ)
