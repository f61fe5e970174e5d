"""spillway client: the thin gRPC client that executors use to reach their node's sidecar.

Needs only grpcio, protobuf and opentelemetry-api.

    from spillway.client import SidecarClient, report
    client = SidecarClient()         # $SPILLWAY_SIDECAR_ADDRESS, else 127.0.0.1:50051
    client.register_job("orders", {"errors.tolerance": "all"})
    record = report.failed_record(record_id, "TRANSFORMATION", exc)
    verdicts = client.report_failures("orders", task, [record])
"""

from . import report
from .client import DEFAULT_TARGET, SidecarClient, resolve_target
from .errors import (
    ADDRESS_ENV,
    FlushTimeoutError,
    InvalidPolicyError,
    JobConflictError,
    JobFailedError,
    JobNotRegisteredError,
    RecordFailedError,
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
    "JobConflictError",
    "JobFailedError",
    "JobNotRegisteredError",
    "RecordFailedError",
    "RefreshRetriableError",
    "RetriableError",
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
