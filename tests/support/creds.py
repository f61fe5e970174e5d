"""The default configuration's local credential, as the operator (and a peer sidecar) of this
OS user present it: in-process sidecars started without credentials make it at
`localcred.default_path()` (docs/SECURITY.md, the default's threat model)."""

from __future__ import annotations

from spillway.sidecar.transport import localcred


def local_token() -> str:
    with open(localcred.default_path(), encoding="utf-8") as fh:
        return fh.read().split()[0]


def admin_md() -> list[tuple[str, str]]:
    """gRPC metadata of the operator (`spillway status` / `job` of this user)."""
    return [("spillway-admin-token", local_token())]


def peer_md() -> list[tuple[str, str]]:
    """gRPC metadata of another sidecar of this user."""
    return [("spillway-peer-token", local_token())]


def admin_client(address: str, **kw):
    """A SidecarClient sending the local credential as the admin token."""
    from spillway.client import ADMIN_TOKEN_KEY, ChannelSecurity, SidecarClient

    security = ChannelSecurity.resolve(token_file=localcred.default_path(),
                                       token_key=ADMIN_TOKEN_KEY)
    return SidecarClient(address, security=security, **kw)
