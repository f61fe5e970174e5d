"""A start that would strand what another layout's spool directories hold is refused (stranded.py):
real spools and run stores on disk, read back read-only."""

from __future__ import annotations

import os
import sqlite3

import pytest
from spillway.sidecar.core.model import DlqRecord
from spillway.sidecar.dlq.spool import Spool
from spillway.sidecar.errors import ConfigError
from spillway.sidecar.runtime import stranded
from spillway.sidecar.service.runstate import RunStore


def rec(i: int) -> DlqRecord:
    return DlqRecord(topic="dlq.t", key=b"k", value=b"v" * 10, headers=(), record_id=f"r{i}",
                     job="job@run", task_key="job@run/0.0.0/1", traceparent="")


def spool_in(directory) -> Spool:
    return Spool(str(directory), max_bytes=10_000_000, max_records=100_000)


def props(processes: int = 1, spool: bool = True, bootstrap: str = "127.0.0.1:9092") -> dict:
    return {"sidecar.processes": processes, "spool.enable": spool,
            "bootstrap.servers": bootstrap, "job.idle.timeout.ms": 3_600_000}


def test_what_the_directories_hold_is_counted_read_only(tmp_path):
    d = tmp_path / "process-1"
    s = spool_in(d)
    seqs = s.append([rec(i) for i in range(5)])
    s.delete(seqs[:2])                     # acknowledged: not counted
    s.hold([rec(9), rec(10)], "job@run", b"meta")
    s.reject([(seqs[4], "too large")], 0)
    s.close()
    store = RunStore(d)
    store.open_run("job@run", "job", "run", b"digest")
    store.close()
    before = {p: os.stat(d / p).st_mtime_ns for p in os.listdir(d)}
    held = stranded.holdings(str(d), 3600)
    assert (held.pending, held.held, held.rejected, held.runs) == (2, 2, 1, 1)
    assert held.describe() == (f"{d} holds 2 DLQ record(s) not yet written to Kafka, 2 DLQ "
                               "record(s) held for their run's home to confirm, 1 record(s) "
                               "Kafka rejected, kept for the operator, the kept state of 1 "
                               "live run(s)")
    # SQLite may add its -wal and -shm files (with the database's mode); nothing is written
    assert {p: os.stat(d / p).st_mtime_ns for p in before} == before
    assert not stranded.holdings(str(d), -1).runs   # idle past job.idle.timeout.ms


def test_each_layout_opens_its_own_directories_and_is_refused_the_others(tmp_path):
    root = tmp_path / "spool"
    for sub in ("process-0", "process-1"):
        s = spool_in(root / sub)
        s.append([rec(1)])
        s.close()
    assert stranded.stranded(str(root), 2, True, 3600) == []
    assert stranded.stranded(str(root), 3, True, 3600) == []   # more processes: opens them
    found = stranded.stranded(str(root), 1, True, 3600)
    assert [h.directory for h in found] == [str(root / "process-0"), str(root / "process-1")]
    live = spool_in(root / "process-1")    # a sidecar still serving from it is named
    try:
        assert f"process-1 (in use by pid {os.getpid()}) holds 1 DLQ" in \
            stranded.stranded(str(root), 1, True, 3600)[1].describe()
    finally:
        live.close()
    with pytest.raises(ConfigError) as err:
        stranded.check(str(root), props(1))
    msg = str(err.value)
    assert msg.startswith("spool.dir: ") and str(root / "process-1") in msg
    assert "only a start with sidecar.processes=2 or more" in msg
    assert "This start (sidecar.processes=1)" in msg

    s = spool_in(root)   # one process's own spool, then several processes
    s.append([rec(2)])
    s.close()
    with pytest.raises(ConfigError, match="only a start with sidecar.processes=1 "):
        stranded.check(str(root), props(2))
    with pytest.raises(ConfigError, match=r"This start \(spool.enable=false\)"):
        stranded.check(str(root), props(2, spool=False))


def test_directories_that_hold_nothing_do_not_stop_a_start(tmp_path):
    root = tmp_path / "spool"
    s = spool_in(root / "process-1")
    s.delete(s.append([rec(1), rec(2)]))   # all written
    s.close()
    RunStore(root / "process-1").close()   # no run kept
    (root / "process-x").mkdir()           # not a process directory
    stranded.check(str(root), props(1))
    stranded.check(str(tmp_path / "absent"), props(1))


def test_a_directory_that_cannot_be_read_stops_the_start(tmp_path):
    d = tmp_path / "process-3"
    d.mkdir()
    (d / "dlq-spool.sqlite3").write_bytes(b"not a database" * 100)
    found = stranded.stranded(str(tmp_path), 1, True, 3600)
    assert len(found) == 1 and found[0].unreadable.startswith("DatabaseError")
    with pytest.raises(ConfigError, match="could not be read.*sidecar.processes=4 or more"):
        stranded.check(str(tmp_path), props(1))


def test_a_spool_without_the_newer_tables_is_read(tmp_path):
    d = tmp_path / "process-1"
    d.mkdir()
    conn = sqlite3.connect(d / "dlq-spool.sqlite3")
    conn.execute("CREATE TABLE batches (id INTEGER PRIMARY KEY, n INTEGER, size INTEGER)")
    conn.execute("INSERT INTO batches VALUES (1, 3, 30)")
    conn.commit()
    conn.close()
    # (no held, rejected or settled table: an older spool)
    assert stranded.holdings(str(d), 3600).pending == 3


def test_default_directories_of_other_addresses_are_reported_not_refused(tmp_path, caplog):
    base = tmp_path / "spillway"
    mine = base / "spool-127.0.0.1_50051"
    mine.mkdir(parents=True)
    left = spool_in(base / "spool-127.0.0.1_50099")        # a start on another port left these
    left.append([rec(1), rec(2)])
    left.close()
    serving = spool_in(base / "spool-127.0.0.1_50077")     # another sidecar serving: its own
    serving.append([rec(3)])
    several = spool_in(base / "spool-0.0.0.0_50060" / "process-1")
    several.append([rec(4)])
    several.close()
    try:
        found = stranded.elsewhere(str(mine), 3600)
        assert [(h.directory, h.pending) for h in found] == [
            (str(base / "spool-0.0.0.0_50060" / "process-1"), 1),
            (str(base / "spool-127.0.0.1_50099"), 2)]
        with caplog.at_level("WARNING", logger="spillway.sidecar"):
            stranded.warn_elsewhere(str(mine), {**props(1), "spool.dir": ""})
        assert [r.getMessage().split(",")[0] for r in caplog.records] == [
            f"{base / 'spool-0.0.0.0_50060' / 'process-1'} holds 1 DLQ record(s) not yet "
            "written to Kafka",
            f"{base / 'spool-127.0.0.1_50099'} holds 2 DLQ record(s) not yet written to Kafka"]
        caplog.clear()
        stranded.warn_elsewhere(str(mine), {**props(1), "spool.dir": str(mine)})
        assert not caplog.records                          # a spool.dir of one's own: not read
        stranded.check(str(mine), props(1))                # and never a refusal
    finally:
        serving.close()


def test_records_released_from_a_held_row_count_as_pending_not_held(tmp_path):
    d = tmp_path / "process-1"
    s = spool_in(d)
    records = [rec(i) for i in range(3)]
    rid, segments = s.hold(records, "job@run", b"meta")
    s.append(records, release=rid, segments=segments)   # in place: the held row stays on disk
    s.hold([rec(7)], "job@run", b"meta")
    s.close()
    held = stranded.holdings(str(d), 3600)
    assert (held.pending, held.held) == (3, 1)
