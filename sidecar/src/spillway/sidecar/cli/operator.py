"""The operator commands' credentials (`spillway status`, `spillway job ...`): which one a command
sends, the client that sends it, and what to tell a caller that may not see the runs.

Which credential, first that applies: ``--admin-token-file`` / ``$SPILLWAY_ADMIN_TOKEN_FILE``
(the operator token, sent as spillway-admin-token); else, with no node token given and a
sidecar on loopback or a Unix socket, the local credential of this OS user
(`localcred.for_client`, sent as the admin token); else ``--token-file`` /
``$SPILLWAY_TOKEN_FILE`` (the node token, which lists and ends no other run); else none.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass


def add_client_security_args(p: argparse.ArgumentParser) -> None:
    """TLS and token flags of the operator commands (status, job, ...)."""
    p.add_argument("--tls-ca", help="CA bundle to verify the sidecar (default "
                                    "$SPILLWAY_TLS_CA_FILE; TLS when set)")
    p.add_argument("--tls-cert", help="client certificate for mutual TLS "
                                      "(default $SPILLWAY_TLS_CERT_FILE)")
    p.add_argument("--tls-key", help="its private key (default $SPILLWAY_TLS_KEY_FILE)")
    p.add_argument("--token-file", help="node token file, sent as spillway-node-token "
                                        "(default $SPILLWAY_TOKEN_FILE)")
    p.add_argument("--admin-token-file", help="operator token file, sent as "
                                              "spillway-admin-token instead (default "
                                              "$SPILLWAY_ADMIN_TOKEN_FILE)")


@dataclass(frozen=True)
class Credential:
    """What an operator command sends: ``kind`` is "admin", "local", "node" or "" (none);
    ``path`` its file; ``local_path`` the local credential file it looked for (a sidecar on
    this host only)."""

    kind: str
    path: str
    target: str
    local_path: str = ""


def credential(args: argparse.Namespace) -> Credential:
    from spillway.client import ADMIN_TOKEN_FILE_ENV, TOKEN_FILE_ENV
    from spillway.client.client import resolve_target
    from spillway.sidecar.transport import localcred

    try:
        target = resolve_target(args.sidecar)
    except ValueError:
        target = args.sidecar or ""   # a malformed address: SidecarClient names it
    admin = args.admin_token_file or os.environ.get(ADMIN_TOKEN_FILE_ENV, "")
    if admin:
        return Credential("admin", admin, target)
    node = (os.environ.get(TOKEN_FILE_ENV, "") if args.token_file is None
            else args.token_file)   # '' turns the environment's off
    local_path = localcred.client_path() if localcred.is_local(target) else ""
    if not node:
        # the default configuration's local credential, for a sidecar on this host only
        local = localcred.for_client(target)
        if local:
            return Credential("local", local, target, local_path)
        return Credential("", "", target, local_path)
    return Credential("node", node, target, local_path)


def operator_client(args: argparse.Namespace):
    """A SidecarClient for the operator commands, with their TLS and token flags."""
    from spillway.client import ADMIN_TOKEN_KEY, NODE_TOKEN_KEY, ChannelSecurity, SidecarClient

    cred = credential(args)
    admin = cred.kind in ("admin", "local")
    security = ChannelSecurity.resolve(
        ca_file=args.tls_ca, cert_file=args.tls_cert, key_file=args.tls_key,
        token_file=cred.path,
        token_key=ADMIN_TOKEN_KEY if admin else NODE_TOKEN_KEY)
    return SidecarClient(args.sidecar, timeout_s=args.timeout, security=security)


def cannot_see(args: argparse.Namespace) -> str:
    """Why this caller may not see or end other runs, and which credential would let it."""
    cred = credential(args)
    if cred.kind == "node":
        why = ("it sent the node token (--token-file / $SPILLWAY_TOKEN_FILE), which lets a "
               "caller report failures, not list or end other runs")
    elif cred.kind:
        why = "the sidecar did not take its credential as an operator's"
    elif cred.local_path:
        why = (f"it sent no operator credential: no --admin-token-file or "
               f"$SPILLWAY_ADMIN_TOKEN_FILE, and no local credential of this OS user at "
               f"{cred.local_path}")
    else:
        why = ("it sent no operator credential (--admin-token-file or "
               "$SPILLWAY_ADMIN_TOKEN_FILE)")
    how = ("Operators see and end every run: pass the sidecar's admin token "
           "(its auth.admin.token.file) with --admin-token-file FILE or "
           "$SPILLWAY_ADMIN_TOKEN_FILE")
    if cred.local_path:
        how += ("; a sidecar on this host with no credential configured has its own local "
                "credential instead (its auth.local.token.file, default "
                "$XDG_STATE_HOME/spillway/local.token of the OS user it runs as), which this "
                "command reads without flags when run as that user, or from "
                "$SPILLWAY_LOCAL_TOKEN_FILE (or $SPILLWAY_AUTH_LOCAL_TOKEN_FILE, the "
                "sidecar's name for it) when that file is readable")
    return f"this caller sees and ends only runs whose job token it holds ({why}). {how}."


__all__ = ["Credential", "add_client_security_args", "cannot_see", "credential",
           "operator_client"]
