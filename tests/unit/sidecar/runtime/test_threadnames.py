"""A thread's name as the OS shows it (runtime/threadnames.py)."""

from __future__ import annotations

import sys
import threading

import pytest
from spillway.sidecar.runtime import threadnames


@pytest.mark.parametrize("name, shown", [
    ("spillway-dlq-drain", "dlq-drain"),
    ("spillway-confirm-call_12", "confirm-call_12"),
    ("spillway-a-name-longer-than-linux-keeps", "a-name-longer-t"),
    ("spillway-", "spillway-"),
    ("grpc-thing", "grpc-thing"),
    ("spillway-ünïcödé-näme", "ünïcödé-nä"),   # 15 bytes, not cut inside a character
])
def test_the_os_name_drops_the_prefix_and_keeps_15_bytes(name, shown):
    assert threadnames.os_name(name) == shown
    assert len(threadnames.os_name(name).encode()) <= 15


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc: Linux only")
def test_a_thread_started_after_the_hook_has_its_name_in_the_os(monkeypatch):
    seen = {}

    def body():
        with open(f"/proc/self/task/{threading.get_native_id()}/comm") as f:
            seen["comm"] = f.read().strip()
        seen["profile"] = sys.getprofile()

    monkeypatch.setattr(threading, "_profile_hook", None)   # undone after the test
    assert threadnames.name_os_threads() is True
    t = threading.Thread(target=body, name="spillway-named-here")
    t.start()
    t.join()
    assert seen == {"comm": "named-here", "profile": None}   # named, and unprofiled after
