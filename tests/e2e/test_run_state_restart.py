"""A run survives its sidecar: `spillway serve` killed with SIGKILL mid-run and started again on
the same spool resumes the run where it was (docs/POLICY.md, "Across a restart").

Before, with ``errors.tolerance.max.errors=5``, 4 errors, kill -9 and a restart (the client
registering the run again, as spillway.spark does on NOT_FOUND), the run tolerated 5 more: 9
errors under a limit of 5, and a re-reported dead letter was written again.
"""

from __future__ import annotations

import os
import signal
import subprocess
import uuid

import grpc
import pytest
from spillway.client import SidecarClient
from spillway.client.errors import SpillwayClientError
from spillway.v1 import sidecar_pb2 as pb
from support import serve
from support.records import value_errors
from support.kafka import read_all

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

TASK = pb.TaskIdentity(stage_id=1, partition_id=0, task_attempt_id=1)


_records = value_errors


def _spawn(broker, spool):
    return serve.spawn(["--listen", "127.0.0.1:0", "--bootstrap-servers",
                        broker.bootstrap_servers, "--set", f"spool.dir={spool}",
                        "--set", "producer.linger.ms=5"], stderr=subprocess.DEVNULL)


def test_a_limit_is_never_loosened_nor_a_dead_letter_repeated_by_a_restart(broker, tmp_path):
    topic = f"dlq.restart-{uuid.uuid4().hex[:8]}"
    props = {"errors.tolerance": "all", "errors.tolerance.max.errors": "5",
             "errors.deadletterqueue.topic.name": topic,
             "errors.deadletterqueue.auto.create.topics.enable": "true",
             "errors.deadletterqueue.topic.replication.factor": "1"}
    proc, address = _spawn(broker, tmp_path / "spool")
    try:
        with SidecarClient(address) as client:
            run = client.register_job("restart", props)
            verdicts = client.report_failures(run, TASK, _records("r0", "r1", "r2", "r3"))
            assert [v.action for v in verdicts] == [pb.ACTION_SKIP] * 4
            assert all(v.dead_lettered for v in verdicts)
            assert client.flush_task(run, TASK, timeout_s=30) == 4
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()

    proc, address = _spawn(broker, tmp_path / "spool")
    try:
        with SidecarClient(address) as client:
            # someone without the run's token cannot take the resumed run over
            with pytest.raises(SpillwayClientError) as refused:
                client.register_job("restart", props, run_id=run.run_id)
            assert refused.value.code == grpc.StatusCode.PERMISSION_DENIED
            again = client.register_job("restart", props, run_id=run.run_id,
                                        job_token=run.job_token)
            summary = client.job_summary(again)
            assert summary.total_record_errors == 4 and not summary.failed
            # a re-report of a dead-lettered record: not written again, not counted again
            (v,) = client.report_failures(again, TASK, _records("r1"))
            assert v.action == pb.ACTION_SKIP and "already in the DLQ" in v.reason
            (v,) = client.report_failures(again, TASK, _records("r4"))   # the 5th: within
            assert v.action == pb.ACTION_SKIP and v.dead_lettered
            (v,) = client.report_failures(again, TASK, _records("r5"))   # the 6th: over
            assert v.action == pb.ACTION_FAIL and v.job_failed
            assert "errors.tolerance.max.errors=5" in v.reason
            client.flush_task(again, TASK, timeout_s=30)
            ids = sorted(dict(m.headers())["spillway.record.id"].decode()
                         for m in read_all(broker.bootstrap_servers, topic, idle_s=0.5))
            assert ids == ["r0", "r1", "r2", "r3", "r4"]    # each once
            client.end_job(again)
    finally:
        serve.stop(proc)

    # an ended run's state goes with it: the same run id starts afresh
    proc, address = _spawn(broker, tmp_path / "spool")
    try:
        with SidecarClient(address) as client:
            fresh = client.register_job("restart", props, run_id=run.run_id)
            assert client.job_summary(fresh).total_record_errors == 0
    finally:
        serve.stop(proc)


def test_a_run_of_records_failing_alike_survives_a_restart(broker, tmp_path):
    """Records failing the same way for the first time go into the run's id table a stretch at
    a time and are journaled as one columnar entry ("n", `IdTable.add_new`): after kill -9 and
    a restart each of them is still "already in the DLQ", counted once, dead-lettered once."""
    import pickle
    import sqlite3

    topic = f"dlq.restart-run-{uuid.uuid4().hex[:8]}"
    props = {"errors.tolerance": "all", "errors.deadletterqueue.topic.name": topic,
             "errors.deadletterqueue.auto.create.topics.enable": "true",
             "errors.deadletterqueue.topic.replication.factor": "1"}
    ids = [f"s{i:03d}" for i in range(200)]
    proc, address = _spawn(broker, tmp_path / "spool")
    try:
        with SidecarClient(address) as client:
            run = client.register_job("restart-run", props)
            verdicts = client.report_failures(run, TASK, _records(*ids))
            assert all(v.action == pb.ACTION_SKIP and v.dead_lettered for v in verdicts)
            assert client.flush_task(run, TASK, timeout_s=30) == 200
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    with sqlite3.connect(tmp_path / "spool" / "runs.sqlite") as db:   # what this test is about
        kinds = {e[0] for (blob,) in db.execute("SELECT blob FROM slices")
                 for e in pickle.loads(blob)}
    assert "n" in kinds, kinds

    proc, address = _spawn(broker, tmp_path / "spool")
    try:
        with SidecarClient(address) as client:
            again = client.register_job("restart-run", props, run_id=run.run_id,
                                        job_token=run.job_token)
            assert client.job_summary(again).total_record_errors == 200
            verdicts = client.report_failures(again, TASK, _records(*ids[::7], "new"))
            assert all("already in the DLQ" in v.reason for v in verdicts[:-1])
            assert verdicts[-1].dead_lettered
            client.flush_task(again, TASK, timeout_s=30)
            got = sorted(dict(m.headers())["spillway.record.id"].decode()
                         for m in read_all(broker.bootstrap_servers, topic, idle_s=0.5))
            assert got == sorted([*ids, "new"])    # each once
            assert client.job_summary(again).total_record_errors == 201
            client.end_job(again)
    finally:
        serve.stop(proc)
