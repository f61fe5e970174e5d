"""`_pins`: a run's calls follow the process of a several-process sidecar that registered it."""

from __future__ import annotations

import pytest
from spillway.client import _pins


@pytest.mark.parametrize("target,port,want", [
    ("127.0.0.1:50051", 50053, "127.0.0.1:50053"),
    ("[::1]:50051", 7, "[::1]:7"),
    ("sidecar.local:50051", 50052, "sidecar.local:50052"),
    ("127.0.0.1:50051", 0, ""),                    # a single process: no pin
    ("unix:///run/spillway.sock", 50052, ""),      # no port to replace
    ("dns:///sidecar:50051", 50052, ""),           # the resolver may expand it
])
def test_pinned_target_replaces_only_a_plain_ports(target, port, want):
    assert _pins.pinned_target(target, port) == want


def test_a_pin_is_per_target_and_run_and_forgotten(monkeypatch):
    monkeypatch.setattr(_pins, "_pins", type(_pins._pins)())
    _pins.pin("h:1", "job", "r1", 5)
    assert _pins.lookup("h:1", "job", "r1") == "h:5"
    assert _pins.lookup("h:1", "job", "r2") == "h:1"
    assert _pins.lookup("h:2", "job", "r1") == "h:2"
    assert _pins.lookup("h:1", "job", "") == "h:1"
    _pins.pin("h:1", "job", "r1", 0)   # registered again at a single process: unpinned
    assert _pins.lookup("h:1", "job", "r1") == "h:1"
    _pins.pin("h:1", "job", "r1", 6)
    _pins.forget("h:1", "job", "r1")
    assert _pins.lookup("h:1", "job", "r1") == "h:1"


def test_pins_are_bounded_oldest_first(monkeypatch):
    monkeypatch.setattr(_pins, "_pins", type(_pins._pins)(3))
    for i in range(5):
        _pins.pin("h:1", "job", f"r{i}", 10 + i)
    assert [_pins.lookup("h:1", "job", f"r{i}") for i in range(5)] == \
        ["h:1", "h:1", "h:12", "h:13", "h:14"]
