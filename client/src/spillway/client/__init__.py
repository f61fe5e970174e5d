"""spillway client: the thin gRPC client that executors use to reach their node's sidecar.

Needs only grpcio, protobuf and opentelemetry-api.

    from spillway.client import SidecarClient, report
    client = SidecarClient()         # $SPILLWAY_SIDECAR_ADDRESS, else 127.0.0.1:50051
    run = client.register_job("orders", {"errors.tolerance": "all"}, run_id=app_id)
    record = report.failed_record(record_id, "TRANSFORMATION", exc)
    verdicts = client.report_failures(run, task, [record])   # the run carries its job token
    client.end_job(run)
"""

from . import report
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
    error_for_verdict,
)
from .markers import (
    AbortableError,
    ApplicationRecoverableError,
    DataError,
    InvalidConfigurationError,
    RefreshRetriableError,
    RetriableError,
    SpillwayMarker,
)

__all__ = [
    "ADDRESS_ENV",
    "DEFAULT_TARGET",
    "AbortableError",
    "ApplicationRecoverableError",
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
    "RecordFailedError",
    "Registration",
    "ReportTooLargeError",
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
    "ToleranceExceededError",
    "error_for_verdict",
    "report",
    "resolve_target",
]
