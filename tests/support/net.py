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
