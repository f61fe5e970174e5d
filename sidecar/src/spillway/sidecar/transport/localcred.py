"""The local credential: least privilege with no configuration.

A sidecar with no credential configured (no auth.*.token.file, no peer identities, no client
certificates) that listens only on loopback or a Unix socket creates, at its first start, a
random token in a file only its OS user can read (``$XDG_STATE_HOME/spillway/local.token``,
``~/.local/state`` when unset; ``auth.local.token.file`` moves it), the way Jupyter keeps its
server token. It is then that sidecar's admin and peer token:

- the operator CLI (`spillway status`, `spillway job list|end`) of the same OS user reads it
  without flags, when it talks to a sidecar on loopback or a Unix socket (from
  ``$SPILLWAY_LOCAL_TOKEN_FILE``, else ``$SPILLWAY_AUTH_LOCAL_TOKEN_FILE`` as the sidecar
  reads it, else the default path);
- sidecars of the same user on one host (a node sidecar and the job's home) present it to each
  other as peers;
- every other local process - another user's on a shared node (YARN, standalone, Kubernetes
  with hostNetwork) - is anonymous: it may register runs and act on the runs whose job token it
  holds (a job token comes back only to the process that registered the run), and nothing
  else: no other run's status, no EndJob of another run, no sidecar-only request field.

The threat model (docs/SECURITY.md): other OS users on the node are not trusted; processes of
the sidecar's own user are (they can read its spool and its state anyway).
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import stat

from spillway.sidecar.errors import ConfigError
from spillway.sidecar.transport.security import SecurityConfig, TokenFile

PROP = "auth.local.token.file"
FILE_NAME = "local.token"


def default_path() -> str:
    """``$XDG_STATE_HOME/spillway/local.token`` (``~/.local/state`` when unset)."""
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local",
                                                            "state")
    return os.path.join(base, "spillway", FILE_NAME)


def applies(cfg: SecurityConfig, local_only: bool) -> bool:
    """The default configuration: nothing configured, nobody off this host can connect."""
    return local_only and not cfg.any_auth


def ensure(path: str) -> str:
    """The credential file at ``path``, created (directory 0700, file 0600, a 256-bit random
    token) when missing. An existing file must be a regular file of this user that no other
    user can read or write: anything else stops start-up naming the property."""
    directory = os.path.dirname(path) or "."
    os.makedirs(directory, mode=0o700, exist_ok=True)
    if not os.path.lexists(path):
        _create(path, directory)
    _check_private(path)
    return path


def _create(path: str, directory: str) -> None:
    """Write the token to a file of its own, then link it in as ``path`` unless that exists
    by then: the file appears with its token in it, so another sidecar of this user starting
    at the same moment never reads it empty (it uses whichever file was linked first)."""
    tmp = os.path.join(directory, f".{os.path.basename(path)}.{secrets.token_hex(8)}")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                fh.write(secrets.token_urlsafe(32) + "\n")
                fh.flush()
                os.fsync(fh.fileno())
            try:
                os.link(tmp, path)
            except FileExistsError:
                raise
            except OSError:   # a file system without hard links: moved in if still absent
                if not os.path.lexists(path):
                    os.rename(tmp, path)
                    return
        except FileExistsError:
            pass  # made meanwhile by another sidecar of this user
        finally:
            if os.path.lexists(tmp):
                os.unlink(tmp)
    except OSError as exc:
        raise ConfigError(PROP, f"cannot create {path}: {exc.strerror}") from None


def _check_private(path: str) -> None:
    try:
        st = os.lstat(path)
    except OSError as exc:
        raise ConfigError(PROP, f"cannot read {path}: {exc.strerror}") from None
    if not stat.S_ISREG(st.st_mode):
        raise ConfigError(PROP, f"{path} is not a regular file")
    if st.st_uid != os.geteuid():
        raise ConfigError(PROP, f"{path} belongs to uid {st.st_uid}, not to this user "
                                f"(uid {os.geteuid()}): another user could know it")
    if stat.S_IMODE(st.st_mode) & 0o077:
        raise ConfigError(PROP, f"{path} is readable or writable by other users (mode "
                                f"{stat.S_IMODE(st.st_mode):o}); chmod 600 it")


def apply(cfg: SecurityConfig, path: str) -> SecurityConfig:
    """``cfg`` with the local credential as its admin and peer token (created if need be)."""
    token = TokenFile(PROP, ensure(path))
    return dataclasses.replace(cfg, admin_token=token, peer_token=token, local_token=token)


def is_local(target: str) -> bool:
    """Whether ``target`` is a sidecar on this host: loopback or a Unix socket."""
    from spillway.sidecar.transport.listeners import is_loopback_host, split_host_port

    if target.startswith("unix:"):
        return True
    try:
        return is_loopback_host(split_host_port(target)[0])
    except ValueError:
        return False


#: Where an operator command is told the file is, first that is set: its own variable, then
#: the sidecar's (`auth.local.token.file` from the environment), so that a command run in the
#: sidecar's environment (`kubectl exec`, a systemd unit's environment file) finds it.
CLIENT_ENV = ("SPILLWAY_LOCAL_TOKEN_FILE", "SPILLWAY_AUTH_LOCAL_TOKEN_FILE")


def client_path() -> str:
    """Where an operator command looks for the local credential: the first of `CLIENT_ENV`
    that is set, else `default_path`."""
    for name in CLIENT_ENV:
        if os.environ.get(name):
            return os.environ[name]
    return default_path()


def for_client(target: str) -> str:
    """The credential file an operator command of this user sends to a sidecar on loopback
    or a Unix socket ('' when there is none, or the target is not local: never sent off the
    host)."""
    if not is_local(target):
        return ""
    path = client_path()
    try:
        _check_private(path)
    except ConfigError:
        return ""
    return path if os.access(path, os.R_OK) else ""
