"""Where `spillway serve`, the tests and the benchmarks start a sidecar (names kept here).

The parts live in their own modules: runtime/bootstrap.py (wire, serve, stop),
service/sidecar.py (the application service's facade `Sidecar`), transport/servicer.py (the
gRPC servicer and its status-code table); see docs/ARCHITECTURE.md.
"""

from spillway.sidecar.runtime.bootstrap import (
    MAX_MESSAGE_BYTES,
    RunningSidecar,
    build_sidecar,
    start_server,
)
from spillway.sidecar.service.sidecar import Sidecar
from spillway.sidecar.transport.servicer import SERVICE_NAME, ErrorSidecarServicer

__all__ = ["start_server", "build_sidecar", "RunningSidecar", "Sidecar", "ErrorSidecarServicer",
           "SERVICE_NAME", "MAX_MESSAGE_BYTES"]
