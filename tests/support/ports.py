"""Loopback ports for the processes tests start (brokers, sidecars, Spark, proxies).

A port chosen with ``bind(("127.0.0.1", 0))`` comes from the ephemeral range, which every other
``bind(0)`` and every outgoing connection also draws from: between the choice and the child's own
bind, another test's process (or a connection's own end) can take it, and the port then answers
from someone else. These come from below the ephemeral range instead, a block of its own per
xdist worker, handed out in turn (a port again only after the whole block) and each checked free;
a block starts at a random place, so two sessions at once rarely meet."""

from __future__ import annotations

import itertools
import os
import random
import socket

_FIRST, _BLOCK, _BLOCKS = 20_000, 1_000, 12
_turn = itertools.count(random.randrange(_BLOCK))


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32_768


def _block() -> range | None:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")[2:]
    low = _FIRST + (int(worker) % _BLOCKS if worker.isdigit() else 0) * _BLOCK
    if low + _BLOCK > _ephemeral_low():
        return None    # this machine's ephemeral range reaches down here
    return range(low, low + _BLOCK)


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    block = _block()
    if block is not None:
        for _ in range(len(block)):
            port = block[next(_turn) % len(block)]
            if _bindable(port):
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
