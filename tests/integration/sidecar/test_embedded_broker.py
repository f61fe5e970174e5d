"""The embedded broker listens on a port of its own, or says it cannot.

A port chosen free can be taken by another process before Tansu binds it; the port then
answers, but from someone else (in the parallel suite: another test's broker, whose topics the
test would then use, and whose outage it could not cause)."""

from __future__ import annotations

import socket

import pytest

from spillway.sidecar.runtime import embedded
from spillway.sidecar.runtime.embedded import EmbeddedBroker, EmbeddedBrokerError


@pytest.fixture
def held_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def test_a_port_someone_else_listens_on_is_refused_by_name(held_port, tmp_path):
    broker = EmbeddedBroker(port=held_port, log_path=str(tmp_path / "tansu.log"))
    with pytest.raises(EmbeddedBrokerError, match=rf"port {held_port} is held by another "
                                                  r"process"):
        broker.start()


def test_a_chosen_port_taken_before_the_bind_is_chosen_again(held_port, tmp_path, monkeypatch):
    ports = iter([held_port])
    real = embedded.free_port
    monkeypatch.setattr(embedded, "free_port", lambda: next(ports, None) or real())
    broker = EmbeddedBroker(log_path=str(tmp_path / "tansu.log")).start()
    try:
        assert broker.port != held_port
        assert embedded.listens(broker._proc.pid, broker.port) is True
    finally:
        broker.stop()


@pytest.fixture
def bound_port():
    """A port bound but not listening: as a connection's own end holds one."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        yield s.getsockname()[1]


def test_a_chosen_port_tansu_cannot_bind_is_chosen_again(bound_port, tmp_path, monkeypatch):
    ports = iter([bound_port])
    real = embedded.free_port
    monkeypatch.setattr(embedded, "free_port", lambda: next(ports, None) or real())
    broker = EmbeddedBroker(log_path=str(tmp_path / "tansu.log")).start()
    try:
        assert broker.port != bound_port
    finally:
        broker.stop()
    fixed = EmbeddedBroker(port=bound_port, log_path=str(tmp_path / "tansu.log"))
    with pytest.raises(EmbeddedBrokerError, match=rf"Tansu exited with code \d+ at start-up on "
                                                  rf"port {bound_port}"):
        fixed.start()
