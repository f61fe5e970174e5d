"""spillway client: the thin gRPC client that executors use to reach their node's sidecar.

Needs only grpcio, protobuf and opentelemetry-api.

    from spillway.client import SidecarClient, report
    client = SidecarClient()         # $SPILLWAY_SIDECAR_ADDRESS, else 127.0.0.1:50051
    run = client.register_job("orders", {"errors.tolerance": "all"}, run_id=app_id)
    record = report.failed_record(record_id, "TRANSFORMATION", exc)
    verdicts = client.report_failures(run, task, [record])   # the run carries its job token
    client.end_job(run)

`ChannelSecurity` says how to reach a sidecar (TLS material, a token file and the metadata key
its token goes under: `NODE_TOKEN_KEY`, `ADMIN_TOKEN_KEY`); by default it is read from the
environment (`TOKEN_FILE_ENV`, `ADMIN_TOKEN_FILE_ENV`, `SPILLWAY_TLS_*`). `check_job_name` is
the sidecar's job-name rule, for a driver to refuse a bad name before anything is sent.
"""

from . import report
from ._auth import (
    ADMIN_TOKEN_FILE_ENV,
    ADMIN_TOKEN_KEY,
    NODE_TOKEN_KEY,
    TOKEN_FILE_ENV,
    ChannelSecurity,
    CredentialFileError,
)
from ._names import check_job_name
from .client import DEFAULT_TARGET, SidecarClient, resolve_target
from .runs import JobRun, JobToken, Registration
from .errors import (
    ADDRESS_ENV,
    FlushTimeoutError,
    InvalidPolicyError,
    JobAccessError,
    JobConflictError,
    JobFailedError,
    JobLimitError,
    JobNotRegisteredError,
    RecordFailedError,
    ReportTooLargeError,
    RunStateLostError,
    SidecarAuthError,
    SidecarBackpressureError,
    SidecarKafkaError,
    SidecarProtocolError,
    SidecarTimeoutError,
    SidecarTlsError,
    SidecarUnavailableError,
    SpillwayClientError,
    ToleranceExceededError,
    TopicGuardrailError,
    error_for_verdict,
)
from .markers import (
    AbortableError,
    ApplicationRecoverableError,
    DataError,
    InvalidConfigurationError,
    RecordTimeoutError,
    RefreshRetriableError,
    RetriableError,
    SpillwayMarker,
    WorkerCrashError,
)

__all__ = [
    "ADDRESS_ENV",
    "ADMIN_TOKEN_FILE_ENV",
    "ADMIN_TOKEN_KEY",
    "DEFAULT_TARGET",
    "AbortableError",
    "ApplicationRecoverableError",
    "ChannelSecurity",
    "CredentialFileError",
    "DataError",
    "FlushTimeoutError",
    "InvalidConfigurationError",
    "InvalidPolicyError",
    "JobAccessError",
    "JobConflictError",
    "JobFailedError",
    "JobLimitError",
    "JobNotRegisteredError",
    "JobRun",
    "JobToken",
    "NODE_TOKEN_KEY",
    "RecordFailedError",
    "Registration",
    "ReportTooLargeError",
    "RecordTimeoutError",
    "RefreshRetriableError",
    "RetriableError",
    "RunStateLostError",
    "SidecarAuthError",
    "SidecarBackpressureError",
    "SidecarClient",
    "SidecarKafkaError",
    "SidecarProtocolError",
    "SidecarTimeoutError",
    "SidecarTlsError",
    "SidecarUnavailableError",
    "SpillwayClientError",
    "SpillwayMarker",
    "TOKEN_FILE_ENV",
    "ToleranceExceededError",
    "TopicGuardrailError",
    "WorkerCrashError",
    "check_job_name",
    "error_for_verdict",
    "report",
    "resolve_target",
]
