"""Where `spillway serve`, the tests and the benchmarks start a sidecar (names kept here).

The parts live in their own modules: bootstrap.py (build, serve, stop), service.py (the
application service `Sidecar`), status_page.py (GetStatus), adapters/servicer.py (the gRPC
servicer and its status-code table); see docs/ARCHITECTURE.md.
"""

from .adapters.servicer import SERVICE_NAME, ErrorSidecarServicer
from .bootstrap import MAX_MESSAGE_BYTES, RunningSidecar, build_sidecar, start_server
from .service import Sidecar

__all__ = ["start_server", "build_sidecar", "RunningSidecar", "Sidecar", "ErrorSidecarServicer",
           "SERVICE_NAME", "MAX_MESSAGE_BYTES"]
