"""Data at rest: the spool holds DLQ payloads, so only the sidecar's user (and an optional
operator group, ``spool.group``) may read it: directory 0700 (0750), files 0600 (0640).

SQLite gives its -wal and -shm files the mode of the database file, so the database is created
here, with the right mode, before SQLite opens it; files left by an older version are tightened.
"""

from __future__ import annotations

import grp
import logging
import os
import stat

from ..errors import ConfigError

log = logging.getLogger("spillway.sidecar.spool")


def _gid(group: str) -> int:
    if group.isdigit():
        return int(group)
    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        raise ConfigError("spool.group", f"no such group: {group!r}") from None


def modes(group: str) -> tuple[int, int]:
    """(directory mode, file mode)."""
    return (0o750, 0o640) if group else (0o700, 0o600)


def _tighten(path: str, mode: int, gid: int | None, *, follow: bool = False) -> None:
    st = os.stat(path) if follow else os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        raise ConfigError("spool.dir", f"{path} is a symbolic link; the spool refuses to "
                                       "follow it (point spool.dir at the real directory)")
    if gid is not None and st.st_gid != gid:
        try:
            os.chown(path, -1, gid)
        except OSError as exc:
            raise ConfigError("spool.group", f"cannot give {path} to group {gid}: "
                                             f"{exc.strerror}") from None
    if stat.S_IMODE(st.st_mode) & ~mode:
        log.warning("DLQ spool: %s was mode %o, now %o (only the sidecar may read DLQ "
                    "payloads)", path, stat.S_IMODE(st.st_mode), mode)
    if stat.S_IMODE(st.st_mode) != mode:
        os.chmod(path, mode)


def prepare(directory: str, db_path: str, extra: tuple[str, ...] = (), group: str = "") -> None:
    """Create the spool directory and database file with private modes; tighten existing ones."""
    dir_mode, file_mode = modes(group)
    gid = _gid(group) if group else None
    os.makedirs(directory, mode=dir_mode, exist_ok=True)
    _tighten(directory, dir_mode, gid, follow=True)  # a symlinked spool.dir is the operator's
    fd = os.open(db_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, file_mode)
    os.close(fd)
    for path in (db_path, db_path + "-wal", db_path + "-shm", *extra):
        if os.path.lexists(path):
            _tighten(path, file_mode, gid)
