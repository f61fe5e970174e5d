"""Errors the spillway client raises. gRPC errors are mapped at the boundary (`map_rpc_error`)
with ``raise X from exc``: the original ``grpc.RpcError`` stays on ``__cause__`` and its status
code on ``.code``.

    SpillwayClientError                 root; ``.code`` is the grpc.StatusCode when one applies
    ├── SidecarUnavailableError         the sidecar cannot be reached (UNAVAILABLE)
    │   └── SidecarTlsError             ... because the TLS handshake failed (CA, expiry, name)
    ├── SidecarAuthError                the sidecar refused the caller's credentials
    │                                   (UNAUTHENTICATED, PERMISSION_DENIED)
    ├── SidecarTimeoutError             a call's deadline passed (DEADLINE_EXCEEDED)
    │   └── FlushTimeoutError           ... on FlushTask: DLQ records not acknowledged
    ├── SidecarBackpressureError        the sidecar's spool is full (RESOURCE_EXHAUSTED)
    ├── ReportTooLargeError             a report larger than the sidecar's whole spool: split
    │                                   it, never retry it (FAILED_PRECONDITION)
    ├── JobNotRegisteredError           the job is unknown to this sidecar (NOT_FOUND)
    ├── InvalidPolicyError              RegisterJob refused a property (INVALID_ARGUMENT)
    │   └── TopicGuardrailError         ... the operator's DLQ topic rules (KIP-1191): a
    │                                   topic name, prefix or auto-create refused; ``.property``
    ├── JobConflictError                a live job re-registered with other properties
    │                                   (FAILED_PRECONDITION)
    ├── SidecarKafkaError               the sidecar answered, but its Kafka did not
    │                                   (FAILED_PRECONDITION naming the bootstrap servers)
    ├── JobAccessError                  the run's job token is missing or wrong
    │                                   (PERMISSION_DENIED)
    ├── JobLimitError                   RegisterJob: the sidecar's live-run bound
    │                                   (jobs.max.live) is reached (RESOURCE_EXHAUSTED)
    ├── RunStateLostError               RegisterJob: the state the sidecar kept for the run
    │                                   before a restart cannot be read (DATA_LOSS)
    ├── SidecarProtocolError            any other status, or an answer that breaks the contract
    └── RecordFailedError               a FAIL verdict: the task must fail
        └── JobFailedError              ... with job_failed: the whole job has failed
            └── ToleranceExceededError  ... because the error tolerance was exceeded
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

import grpc

if TYPE_CHECKING:
    from spillway.v1 import sidecar_pb2 as pb

ADDRESS_ENV = "SPILLWAY_SIDECAR_ADDRESS"

#: Trailing metadata of a refusal that says which kind it is, where the status code alone does
#: not (the sidecar's transport sets them; `map_rpc_error` reads them).
ERROR_REASON_KEY = "spillway-error-reason"
ERROR_PROPERTY_KEY = "spillway-error-property"
#: ERROR_REASON_KEY's value for a DLQ topic refused by the operator's guardrails.
TOPIC_GUARDRAIL_REASON = "topic-guardrail"


class SpillwayClientError(Exception):
    """Root of every error the spillway client raises on purpose."""

    code: grpc.StatusCode | None = None

    def __init__(self, message: str, *, code: grpc.StatusCode | None = None) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code


class SidecarUnavailableError(SpillwayClientError, ConnectionError):
    def __init__(self, target: str, detail: str = "", *,
                 code: grpc.StatusCode | None = grpc.StatusCode.UNAVAILABLE,
                 address_env: str = ADDRESS_ENV) -> None:
        self.target = target
        why = f" ({detail})" if detail else ""
        super().__init__(
            f"the spillway sidecar at {target} is unreachable{why}. Start the sidecar on this "
            f"node, or point the client at it with {address_env}=host:port (or unix:///path); "
            f"on Spark executors set it with spark.executorEnv.{address_env}",
            code=code,
        )


class SidecarTlsError(SidecarUnavailableError):
    def __init__(self, target: str, detail: str = "") -> None:
        self.target = target
        SpillwayClientError.__init__(
            self,
            f"TLS with the spillway sidecar at {target} failed ({detail}). The sidecar's "
            "certificate must be signed by the CA in SPILLWAY_TLS_CA_FILE (tls_ca_file), be "
            "valid now (not expired) and name the host dialled; with mutual TLS the client "
            "certificate (SPILLWAY_TLS_CERT_FILE / SPILLWAY_TLS_KEY_FILE) must be signed by the "
            "sidecar's tls.ca.file and valid too", code=grpc.StatusCode.UNAVAILABLE)


class SidecarAuthError(SpillwayClientError, PermissionError):
    pass


class SidecarTimeoutError(SpillwayClientError, TimeoutError):
    pass


class FlushTimeoutError(SidecarTimeoutError):
    pass


class SidecarBackpressureError(SpillwayClientError):
    pass


class ReportTooLargeError(SpillwayClientError):
    """The report can never fit in the sidecar's DLQ spool (``spool.max.bytes`` /
    ``spool.max.records``); `SidecarClient.report_failures` splits it and raises this only for
    a single record that does not fit."""


class JobNotRegisteredError(SpillwayClientError, LookupError):
    def __init__(self, message: str, *, job: str = "", code: grpc.StatusCode | None = None):
        self.job = job
        super().__init__(message, code=code)


class InvalidPolicyError(SpillwayClientError, ValueError):
    pass


class TopicGuardrailError(InvalidPolicyError):
    """RegisterJob refused the job's DLQ topic under the operator's guardrails (KIP-1191,
    docs/DLQ.md): a name outside the required prefix, an internal or invalid name, a job prefix
    that would loosen the operator's, auto-create where the operator does not allow it.
    ``property``: the property the refusal names, e.g. ``errors.deadletterqueue.topic.name``."""

    def __init__(self, message: str, *, property: str = "",  # noqa: A002 - the sidecar's word
                 code: grpc.StatusCode | None = None) -> None:
        self.property = property
        super().__init__(message, code=code)


class JobConflictError(SpillwayClientError):
    pass


class JobAccessError(SpillwayClientError, PermissionError):
    pass


class JobLimitError(SpillwayClientError):
    pass


class RunStateLostError(SpillwayClientError):
    """The run is not resumed: its kept state is unreadable (the message says what to do)."""


class SidecarProtocolError(SpillwayClientError):
    pass


class SidecarKafkaError(SpillwayClientError):
    """The sidecar is reachable and answered; the Kafka cluster it writes the DLQ to is not."""


class RecordFailedError(SpillwayClientError):
    """A FAIL verdict. The message names the job, stage, record, exception and the reason."""

    def __init__(self, message: str, *, job: str = "", stage: str = "", record_id: str = "",
                 exception_class: str = "", reason: str = "",
                 verdict: pb.Verdict | None = None) -> None:
        self.job = job
        self.stage = stage
        self.record_id = record_id
        self.exception_class = exception_class
        self.reason = reason
        self.verdict = verdict
        super().__init__(message)

    def __reduce__(self):  # picklable across Spark's Python worker boundary
        return (_rebuild, (type(self), str(self), self.job, self.stage, self.record_id,
                           self.exception_class, self.reason))


class JobFailedError(RecordFailedError):
    pass


class ToleranceExceededError(JobFailedError):
    """The job's error tolerance was exceeded; ``limit`` and ``count`` when the reason names
    them."""

    @property
    def limit(self) -> str | None:
        m = _LIMIT.search(self.reason)
        return m.group(1) if m else None

    @property
    def count(self) -> int | None:
        m = _COUNT.search(self.reason)
        if m:
            return int(m.group(1))
        return 1 if "first error" in self.reason else None


_LIMIT = re.compile(r"(errors\.tolerance(?:\.[a-z.]+)?\s*=\s*[-\w.]+)")
_COUNT = re.compile(r"(\d+)\s+errors?\b")


def _rebuild(cls, message, job, stage, record_id, exception_class, reason):
    return cls(message, job=job, stage=stage, record_id=record_id,
               exception_class=exception_class, reason=reason)


# --- mapping at the boundary ---------------------------------------------------------------

_BY_CODE: dict[grpc.StatusCode, type[SpillwayClientError]] = {
    grpc.StatusCode.RESOURCE_EXHAUSTED: SidecarBackpressureError,
    grpc.StatusCode.DEADLINE_EXCEEDED: SidecarTimeoutError,
    grpc.StatusCode.NOT_FOUND: JobNotRegisteredError,
    grpc.StatusCode.INVALID_ARGUMENT: InvalidPolicyError,
    grpc.StatusCode.FAILED_PRECONDITION: JobConflictError,
    grpc.StatusCode.PERMISSION_DENIED: JobAccessError,
    grpc.StatusCode.DATA_LOSS: RunStateLostError,
}


# The sidecar's wording for a Kafka it cannot reach (sidecar errors.KafkaUnreachableError) or a
# DLQ topic check that failed on the Kafka side.
_KAFKA = re.compile(r"sidecar's Kafka at |DLQ topic check failed")
# The sidecar's wording for a report that cannot fit even an empty spool (sidecar admission.py).
_TOO_LARGE = re.compile(r"can never fit in the sidecar's DLQ spool")
# What gRPC reports when the handshake fails on the client side (certificate problems).
_TLS_FAILURE = re.compile(r"SSL_ERROR|handshake fail|CERTIFICATE_VERIFY|TSI_|certificate",
                          re.IGNORECASE)
# A TLS client whose handshake the server rejected sees the connection closed.
_HANDSHAKE = re.compile(r"Socket closed|Connection reset|end of file", re.IGNORECASE)

_NOT_CONNECTED = (grpc.ChannelConnectivity.TRANSIENT_FAILURE, grpc.ChannelConnectivity.CONNECTING,
                  grpc.ChannelConnectivity.IDLE, grpc.ChannelConnectivity.SHUTDOWN)


def map_rpc_error(exc: grpc.RpcError, *, method: str, target: str, job: str = "",
                  address_env: str = ADDRESS_ENV,
                  connectivity: grpc.ChannelConnectivity | None = None,
                  tls: bool = False) -> SpillwayClientError:
    """The client error for a failed call; raise it ``from exc``.

    ``connectivity``: the channel's state when the call failed; a deadline that passed while
    the channel was not connected (gRPC was still retrying to reach the sidecar) is reported
    as SidecarUnavailableError, keeping DEADLINE_EXCEEDED as its code.
    """
    code = exc.code() if callable(getattr(exc, "code", None)) else None
    details = exc.details() if callable(getattr(exc, "details", None)) else str(exc)
    if code is grpc.StatusCode.UNAVAILABLE and _TLS_FAILURE.search(details or ""):
        return SidecarTlsError(target, f"{method}: {details}")
    if code is grpc.StatusCode.UNAVAILABLE and tls and _HANDSHAKE.search(details or ""):
        return SidecarTlsError(target, f"{method}: {details}")
    if code is grpc.StatusCode.UNAUTHENTICATED:
        return SidecarAuthError(
            f"{method} on {target}: the sidecar refused the credentials ({details}). Give the "
            "client the node token with SPILLWAY_TOKEN_FILE (token_file) on this node", code=code)
    if code is grpc.StatusCode.PERMISSION_DENIED:
        return SidecarAuthError(f"{method} on {target} was refused: {details}", code=code)
    if code is grpc.StatusCode.UNAVAILABLE:
        hint = ("; if the sidecar serves TLS, give the client its CA with SPILLWAY_TLS_CA_FILE"
                if not tls and _HANDSHAKE.search(details or "") else "")
        return SidecarUnavailableError(target, f"{method}: {details}{hint}",
                                       address_env=address_env)
    if code is grpc.StatusCode.DEADLINE_EXCEEDED and connectivity in _NOT_CONNECTED:
        hint = ("; over TLS a refused handshake (CA, expired or missing client certificate) "
                "looks the same: check the certificates" if tls else "")
        return SidecarUnavailableError(
            target, f"{method}: no connection before the deadline ({connectivity.name}){hint}",
            code=code, address_env=address_env)
    if code is grpc.StatusCode.DEADLINE_EXCEEDED and method == "FlushTask":
        return FlushTimeoutError(
            f"FlushTask on {target} for job {job!r}: the DLQ records of this task were not "
            f"acknowledged before the deadline ({details})", code=code)
    if code is grpc.StatusCode.FAILED_PRECONDITION and _KAFKA.search(details or ""):
        return SidecarKafkaError(
            f"{method} on {target}: the sidecar answered, but its Kafka is the problem: "
            f"{details}", code=code)
    if code is grpc.StatusCode.FAILED_PRECONDITION and _TOO_LARGE.search(details or ""):
        return ReportTooLargeError(f"{method} on {target}: {details}", code=code)
    reason = _trailing(exc)
    if reason.get(ERROR_REASON_KEY) == TOPIC_GUARDRAIL_REASON:
        name = code.name if code is not None else "UNKNOWN"
        return TopicGuardrailError(f"{method} on {target} failed with {name}: {details}",
                                   property=reason.get(ERROR_PROPERTY_KEY, ""), code=code)
    cls = _BY_CODE.get(code) if code is not None else None
    if code is grpc.StatusCode.RESOURCE_EXHAUSTED and method == "RegisterJob":
        cls = JobLimitError  # the live-run bound, not backpressure: waiting does not help
    name = code.name if code is not None else "UNKNOWN"
    message = f"{method} on {target} failed with {name}: {details}"
    if cls is JobNotRegisteredError:
        return JobNotRegisteredError(message, job=job, code=code)
    if cls is None:
        return SidecarProtocolError(message, code=code)
    return cls(message, code=code)


def _trailing(exc: grpc.RpcError) -> dict[str, str]:
    """The call's trailing metadata (spillway's keys only), {} when there is none."""
    read = getattr(exc, "trailing_metadata", None)
    try:
        items = read() if callable(read) else None
    except Exception:  # noqa: BLE001 - an error without metadata is still an error
        items = None
    return {k: v for k, v in (items or ()) if k in (ERROR_REASON_KEY, ERROR_PROPERTY_KEY)
            and isinstance(v, str)}


#: KIP-298's names where they differ from spillway.v1's (the sidecar uses them in its reasons).
_KIP_STAGE = {6: "TASK_PUT", 7: "KAFKA_PRODUCE"}  # STAGE_SINK, STAGE_PRODUCE


def error_for_verdict(job: str, record: pb.FailedRecord, verdict: pb.Verdict) -> RecordFailedError:
    """The exception that fails the task for a FAIL verdict on ``record``.

    ``job_failed`` verdicts give JobFailedError; those caused by the error tolerance (the reason
    names ``errors.tolerance``) give ToleranceExceededError, whose message names the job, the
    stage, and the limit and count the sidecar's reason carries.
    """
    from spillway.v1 import sidecar_pb2 as pb_

    stage = _KIP_STAGE.get(record.stage) or (
        pb_.Stage.Name(record.stage).removeprefix("STAGE_") if record.stage else "UNSPECIFIED")
    if record.stage == pb_.STAGE_CUSTOM and record.custom_stage:
        stage = record.custom_stage
    exc = record.exception
    what = f"{exc.class_name}: {exc.message}" if exc.message else exc.class_name
    where = f" in {record.function_name}" if record.function_name else ""
    reason = verdict.reason or "no reason given"
    if verdict.job_failed:
        cls: type[RecordFailedError] = (ToleranceExceededError if "tolerance" in reason.lower()
                                        else JobFailedError)
        message = (f"spillway job {job!r} failed in stage {stage}: record {record.record_id}"
                   f"{where} raised {what}; sidecar: {reason}")
    else:
        cls = RecordFailedError
        message = (f"spillway job {job!r}: record {record.record_id} failed in stage {stage}"
                   f"{where} with {what}; sidecar: {reason}")
    return cls(message, job=job, stage=stage, record_id=record.record_id,
               exception_class=exc.class_name, reason=reason, verdict=verdict)
