"""One gRPC channel per target per process, created lazily and recreated after a fork.

Spark's Python workers are forked from a daemon and reused across tasks: each worker keeps one
channel per sidecar target. A channel inherited through ``fork()`` is never used nor closed in
the child (gRPC's core state does not survive a fork); the child builds its own.

Transient UNAVAILABLE is retried by gRPC itself, per the retry policy in ``SERVICE_CONFIG``
(bounded: at most 5 attempts with exponential backoff, about 3 s in all), then surfaces. The
channel's connectivity is tracked (`connectivity`) so that a deadline passing while the sidecar
could not be reached is told apart from a sidecar that is slow to answer.
"""

from __future__ import annotations

import functools
import json
import os
import threading

import grpc

SERVICE = "spillway.v1.ErrorSidecar"

RETRY_POLICY = {
    "maxAttempts": 5,
    "initialBackoff": "0.2s",
    "maxBackoff": "2s",
    "backoffMultiplier": 2,
    "retryableStatusCodes": ["UNAVAILABLE"],
}

SERVICE_CONFIG = json.dumps({
    "methodConfig": [{
        "name": [{"service": SERVICE}, {"service": "grpc.health.v1.Health"}],
        "retryPolicy": RETRY_POLICY,
    }],
})

CHANNEL_OPTIONS: tuple[tuple[str, object], ...] = (
    ("grpc.enable_retries", 1),
    ("grpc.service_config", SERVICE_CONFIG),
    # Reconnect quickly so the bounded retries above can reach a sidecar that just restarted.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
)

_lock = threading.Lock()
_pid = os.getpid()
_channels: dict[str, grpc.Channel] = {}
_states: dict[str, grpc.ChannelConnectivity] = {}


def _on_state(target: str, channel: grpc.Channel, state: grpc.ChannelConnectivity) -> None:
    with _lock:
        if _channels.get(target) is channel:
            _states[target] = state


def get_channel(target: str) -> grpc.Channel:
    """The process's channel to ``target`` (created on first use, again after a fork)."""
    global _pid
    with _lock:
        if _pid != os.getpid():  # forked: forget the parent's channels without touching them
            _channels.clear()
            _states.clear()
            _pid = os.getpid()
        channel = _channels.get(target)
        if channel is None:
            channel = grpc.insecure_channel(target, options=CHANNEL_OPTIONS)
            _channels[target] = channel
            _states[target] = grpc.ChannelConnectivity.IDLE
            new = channel
        else:
            new = None
    if new is not None:  # outside the lock: the first callback may run at once
        new.subscribe(functools.partial(_on_state, target, new), try_to_connect=False)
    return channel


def connectivity(target: str) -> grpc.ChannelConnectivity | None:
    """The last known state of this process's channel to ``target`` (None: no channel)."""
    with _lock:
        return _states.get(target) if _pid == os.getpid() else None


def close_channel(target: str) -> None:
    with _lock:
        channel = _channels.pop(target, None) if _pid == os.getpid() else None
        _states.pop(target, None)
    if channel is not None:
        channel.close()


def cached_targets() -> list[str]:
    with _lock:
        return list(_channels) if _pid == os.getpid() else []
