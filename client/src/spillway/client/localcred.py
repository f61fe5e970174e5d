"""Where a client of this OS user finds the local credential of a sidecar on this host.

A sidecar with no credential configured that listens only on loopback or a Unix socket keeps
a random token in a file only its OS user can read (the sidecar's `transport.localcred`). A
client of the same user sends it - as the admin token - only to a sidecar on loopback or a
Unix socket, never off the host: the operator CLI, and an executor claiming a run's escrowed
job token.
"""

from __future__ import annotations

import ipaddress
import os
import stat

#: where a client is told the file is, first that is set: the CLI's own variable, then the
#: sidecar's (`auth.local.token.file` from the environment), so that a command run in the
#: sidecar's environment (`kubectl exec`, a systemd unit's environment file) finds it
PATH_ENVS = ("SPILLWAY_LOCAL_TOKEN_FILE", "SPILLWAY_AUTH_LOCAL_TOKEN_FILE")
FILE_NAME = "local.token"


def default_path() -> str:
    """``$XDG_STATE_HOME/spillway/local.token`` (``~/.local/state`` when unset)."""
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local",
                                                            "state")
    return os.path.join(base, "spillway", FILE_NAME)


def path() -> str:
    """The file this user's sidecars keep it in: the environment's, else the default."""
    return next((os.environ[e] for e in PATH_ENVS if os.environ.get(e)), "") or default_path()


def is_local(target: str) -> bool:
    """Whether ``target`` (host:port, [v6]:port, unix:path) is on this host only."""
    if target.startswith("unix:"):
        return True
    host = target[1:target.find("]")] if target.startswith("[") else target.rpartition(":")[0]
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def private_problem(file: str) -> str:
    """Why ``file`` cannot hold a credential of this user ('' when it can): it must be a
    regular file of this user that no other user can read or write."""
    try:
        st = os.lstat(file)
    except OSError as exc:
        return f"cannot read {file}: {exc.strerror}"
    if not stat.S_ISREG(st.st_mode):
        return f"{file} is not a regular file"
    if st.st_uid != os.geteuid():
        return (f"{file} belongs to uid {st.st_uid}, not to this user (uid {os.geteuid()}): "
                f"another user could know it")
    if stat.S_IMODE(st.st_mode) & 0o077:
        return (f"{file} is readable or writable by other users (mode "
                f"{stat.S_IMODE(st.st_mode):o}); chmod 600 it")
    return ""


def for_target(target: str) -> str:
    """The credential file to send to the sidecar at ``target`` ('' when there is none, it is
    not private, or the target is not on this host)."""
    if not is_local(target):
        return ""
    file = path()
    if private_problem(file):
        return ""
    return file if os.access(file, os.R_OK) else ""
