"""The embedded broker listens on a port of its own, or says it cannot.

A port chosen free can be taken by another process before Tansu binds it; the port then
answers, but from someone else (in the parallel suite: another test's broker, whose topics the
test would then use, and whose outage it could not cause), or Tansu cannot bind it and exits."""

from __future__ import annotations

import socket

import pytest

from spillway.sidecar.runtime import embedded
from spillway.sidecar.runtime.embedded import EmbeddedBroker, EmbeddedBrokerError

TAKEN = {  # how the port is taken -> what a broker told to use it says
    "listened on": r"port {port} is held by another process",
    "bound (a connection's own end)": r"Tansu exited with code \d+ at start-up on port {port}",
}


@pytest.fixture(params=sorted(TAKEN))
def taken(request):
    """(a port another socket holds, how)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        if request.param == "listened on":
            s.listen()
        yield s.getsockname()[1], request.param


def test_a_port_taken_is_refused_by_name(taken, tmp_path):
    port, how = taken
    broker = EmbeddedBroker(port=port, log_path=str(tmp_path / "tansu.log"))
    with pytest.raises(EmbeddedBrokerError, match=TAKEN[how].format(port=port)):
        broker.start()


def test_a_chosen_port_taken_before_the_bind_is_chosen_again(taken, tmp_path, monkeypatch):
    port, _ = taken
    ports = iter([port])
    real = embedded.free_port
    monkeypatch.setattr(embedded, "free_port", lambda: next(ports, None) or real())
    broker = EmbeddedBroker(log_path=str(tmp_path / "tansu.log")).start()
    try:
        assert broker.port != port
        assert embedded.listens(broker._proc.pid, broker.port) is True
    finally:
        broker.stop()
