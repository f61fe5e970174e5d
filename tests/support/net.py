"""Loopback addresses for tests that need nothing to answer there."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator


@contextlib.contextmanager
def nothing_listening() -> Iterator[str]:
    """``127.0.0.1:<port>`` where a connection is refused for as long as the block runs: the
    port is held bound but never listening, so no other process of a parallel run (a sidecar,
    a broker, a Spark driver binding port 0) can be given it meanwhile. A port that was only
    picked free and then released could be, and the test would then reach that process."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        yield f"127.0.0.1:{s.getsockname()[1]}"


@contextlib.contextmanager
def reserved_port() -> Iterator[int]:
    """A loopback port for a gRPC server the test starts later: held bound (refusing
    connections) with SO_REUSEPORT, as grpc binds its listeners, so that server can bind it
    while no other process can be given it meanwhile (Linux hands out no port held so for
    an ephemeral bind)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        s.bind(("127.0.0.1", 0))
        yield s.getsockname()[1]
