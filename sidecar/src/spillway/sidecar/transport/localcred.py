"""The local credential: least privilege with no configuration.

A sidecar with no credential configured (no auth.*.token.file, no peer identities, no client
certificates) that listens only on loopback or a Unix socket creates, at its first start, a
random token in a file only its OS user can read (``$XDG_STATE_HOME/spillway/local.token``,
``~/.local/state`` when unset; ``auth.local.token.file`` moves it), the way Jupyter keeps its
server token. It is then that sidecar's admin and peer token:

- the operator CLI (`spillway status`, `spillway job list|end`) of the same OS user reads it
  without flags, when it talks to a sidecar on loopback or a Unix socket;
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

from spillway.client.localcred import (
    FILE_NAME,
    PATH_ENVS as CLIENT_ENV,
    default_path,
    for_target,
    is_local,
    private_problem,
)
from spillway.client.localcred import path as client_path
from spillway.sidecar.errors import ConfigError
from spillway.sidecar.transport.security import SecurityConfig, TokenFile

PROP = "auth.local.token.file"


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
    problem = private_problem(path)
    if problem:
        raise ConfigError(PROP, problem)


def apply(cfg: SecurityConfig, path: str) -> SecurityConfig:
    """``cfg`` with the local credential as its admin and peer token (created if need be)."""
    token = TokenFile(PROP, ensure(path))
    return dataclasses.replace(cfg, admin_token=token, peer_token=token, local_token=token)


def for_client(target: str) -> str:
    """The credential file an operator command of this user sends to a sidecar on loopback
    or a Unix socket ('' when there is none, or the target is not local: never sent off the
    host); `spillway.client.localcred` finds it."""
    return for_target(target)


__all__ = ["CLIENT_ENV", "FILE_NAME", "PROP", "applies", "apply", "client_path", "default_path",
           "ensure", "for_client", "is_local"]
