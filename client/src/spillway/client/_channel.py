"""One gRPC channel per target per process, created lazily and recreated after a fork.

Spark's Python workers are forked from a daemon and reused across tasks: each worker keeps one
channel per sidecar target. A channel inherited through ``fork()`` is never used nor closed in
the child (gRPC's core state does not survive a fork); the child builds its own.

Transient UNAVAILABLE is retried by gRPC itself, per the retry policy in ``SERVICE_CONFIG``
(bounded: at most 5 attempts with exponential backoff, about 3 s in all), then surfaces. When a
call fails, the channel's connectivity is read (`connectivity`) so that a deadline passing while
the sidecar could not be reached is told apart from a sidecar that is slow to answer. It is read
then, not watched: `Channel.subscribe` starts a polling thread that races `close()` (grpc raises
"Channel closed!" in it when a channel is closed soon after it was opened).

Channels are keyed by target and `ChannelSecurity` (TLS material, token file; see `_auth`): a
TLS channel carries the token as call credentials, a plaintext one through an interceptor.
"""

from __future__ import annotations

import json
import os
import threading

import grpc

from ._auth import ChannelSecurity, MetadataInterceptor

SERVICE = "spillway.v1.ErrorSidecar"
# gRPC target schemes (resolve_target accepts them as they are; `_pins` leaves them unpinned)
SCHEMES = ("unix:", "unix-abstract:", "dns:", "ipv4:", "ipv6:", "vsock:")

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
_Key = tuple[str, ChannelSecurity | None]
_channels: dict[_Key, tuple[grpc.Channel, grpc.Channel]] = {}  # key -> (base, with auth)
# gRPC core's connectivity codes, as grpc.ChannelConnectivity values carry them
_STATES = {state.value[0]: state for state in grpc.ChannelConnectivity}


def _key(target: str, security: ChannelSecurity | None) -> _Key:
    return (target, security if security is not None and (security.tls or security.token_file)
            else None)


def _open(target: str, security: ChannelSecurity | None) -> tuple[grpc.Channel, grpc.Channel]:
    if security is not None and security.uses_tls(target):
        options = CHANNEL_OPTIONS
        if security.server_name:
            options += (("grpc.ssl_target_name_override", security.server_name),)
        base = grpc.secure_channel(target, security.channel_credentials(), options=options)
        return base, base
    base = grpc.insecure_channel(target, options=CHANNEL_OPTIONS)
    if security is not None and security.token_file:
        return base, grpc.intercept_channel(base, MetadataInterceptor(security))
    return base, base


def get_channel(target: str, security: ChannelSecurity | None = None) -> grpc.Channel:
    """The process's channel to ``target`` (created on first use, again after a fork)."""
    global _pid
    key = _key(target, security)
    with _lock:
        if _pid != os.getpid():  # forked: forget the parent's channels without touching them
            _channels.clear()
            _pid = os.getpid()
        pair = _channels.get(key)
        if pair is None:
            pair = _open(target, key[1])
            _channels[key] = pair
    return pair[1]


def connectivity(target: str, security: ChannelSecurity | None = None
                 ) -> grpc.ChannelConnectivity | None:
    """The state of this process's channel to ``target`` now (None: no channel, or a grpcio
    whose channel does not tell: the caller then cannot say "unreachable")."""
    with _lock:
        pair = _channels.get(_key(target, security)) if _pid == os.getpid() else None
    # grpcio's Channel exposes no public state read but subscribe(); its core channel answers
    # at once (every grpcio this client supports has it)
    check = getattr(getattr(pair[0], "_channel", None), "check_connectivity_state", None) \
        if pair is not None else None
    if check is None:
        return None
    try:
        return _STATES.get(check(False))
    except Exception:  # noqa: BLE001 - a closed channel, or another grpcio: state unknown
        return None


def close_channel(target: str, security: ChannelSecurity | None = None) -> None:
    key = _key(target, security)
    with _lock:
        pair = _channels.pop(key, None) if _pid == os.getpid() else None
    if pair is not None:
        pair[0].close()
