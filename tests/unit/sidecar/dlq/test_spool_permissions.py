"""Data at rest: the DLQ spool (payloads) is private to the sidecar's user."""

from __future__ import annotations

import os
import stat

import pytest
from spillway.sidecar.dlq.spool import DB_NAME, Spool
from spillway.sidecar.errors import ConfigError


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def _files(directory):
    return [p for p in os.listdir(directory) if p.startswith(DB_NAME)]


def test_new_spool_directory_0700_and_files_0600_whatever_the_umask(tmp_path):
    old = os.umask(0o022)
    try:
        spool = Spool(str(tmp_path / "spool"), max_bytes=10_000_000, max_records=1000)
    finally:
        os.umask(old)
    try:
        d = tmp_path / "spool"
        assert _mode(d) == 0o700
        names = _files(d)
        assert {DB_NAME, DB_NAME + "-wal", DB_NAME + "-shm"} <= set(names)
        for name in names + ["dlq-spool.lock"]:
            assert _mode(d / name) == 0o600, name
    finally:
        spool.close()


def test_existing_world_readable_spool_is_tightened(tmp_path):
    d = tmp_path / "spool"
    Spool(str(d), max_bytes=10_000_000, max_records=1000).close()
    os.chmod(d, 0o755)
    for name in _files(d):
        os.chmod(d / name, 0o644)
    Spool(str(d), max_bytes=10_000_000, max_records=1000).close()
    assert _mode(d) == 0o700
    assert all(_mode(d / n) == 0o600 for n in _files(d))


def test_spool_group_gives_the_group_read_access(tmp_path):
    gid = os.getgid()
    d = tmp_path / "spool"
    Spool(str(d), max_bytes=10_000_000, max_records=1000, group=str(gid)).close()
    assert _mode(d) == 0o750 and os.stat(d).st_gid == gid
    assert all(_mode(d / n) == 0o640 for n in _files(d))
    with pytest.raises(ConfigError, match="spool.group: no such group"):
        Spool(str(tmp_path / "x"), max_bytes=10, max_records=1, group="no-such-group-spillway")
