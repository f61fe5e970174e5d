"""A run whose kept state cannot be read after a restart (docs/POLICY.md, "Across a restart"):
RegisterJob answers DATA_LOSS naming the file and what to do, registers nothing (asked again,
the same answer), and `spillway job forget` drops the state so the run starts afresh."""

from __future__ import annotations

import os
import sqlite3

import grpc
import pytest
from spillway.client import JobRun, JobToken, RunStateLostError, SidecarClient
from spillway.sidecar.cli.main import main as cli
from spillway.sidecar.service import runstate
from spillway.v1 import sidecar_pb2 as pb
from support.homes import md, record, start, stub, task

pytestmark = pytest.mark.integration

PROPS = {"errors.tolerance": "all", "errors.tolerance.max.errors": "5"}


def _register(s, token=None):
    return stub(s).RegisterJob(pb.RegisterJobRequest(job="kept job", run_id="r",
                                                     properties=PROPS),
                               timeout=20, metadata=md(token) if token else None)


@pytest.mark.parametrize("damage", [
    "UPDATE slices SET blob = x'80059501'",            # a truncated slice
    "UPDATE slices SET blob = x'8005950b000000000000005d942858016200000094612e'",  # not ours
])
def test_an_unreadable_kept_state_is_refused_with_data_loss_and_can_be_forgotten(
        broker, tmp_path, damage, capsys):
    spool = tmp_path / "spool"
    s = start(broker, spool, "kept")
    token = _register(s).job_token
    stub(s).ReportFailures(pb.ReportFailuresRequest(
        job="kept job", run_id="r", task=task(0), records=[record("a"), record("b")]),
        timeout=20, metadata=md(token))
    s.stop(1.0)
    db = sqlite3.connect(os.path.join(spool, runstate.FILE_NAME))
    db.execute(damage)
    db.commit()
    db.close()
    s = start(broker, spool, "kept")
    try:
        for _ in range(2):   # refused twice alike: the first refusal left nothing behind
            with pytest.raises(grpc.RpcError) as refused:
                _register(s, token)
            assert refused.value.code() == grpc.StatusCode.DATA_LOSS
            details = refused.value.details()
            assert "cannot be read" in details and str(spool) in details
            assert "spillway job forget 'kept job' --run r" in details
        assert s.sidecar.engine.jobs() == [] and s.sidecar.registry.get("kept job", "r") is None
        with SidecarClient(s.address) as client, pytest.raises(RunStateLostError) as lost:
            client.register_job(JobRun("kept job", "r", JobToken(token)), PROPS)
        assert lost.value.code == grpc.StatusCode.DATA_LOSS and "job forget" in str(lost.value)
        assert cli(["job", "forget", "kept job", "--run", "r", "--spool-dir", str(spool)]) == 0
        assert "starts afresh" in capsys.readouterr().out
        assert cli(["job", "forget", "kept job", "--run", "r", "--spool-dir", str(spool)]) == 1
        _register(s, token)   # afresh: the tolerance count starts from zero
        summary = stub(s).GetJobSummary(pb.GetJobSummaryRequest(job="kept job", run_id="r"),
                                        timeout=10, metadata=md(token))
        assert summary.total_record_errors == 0 and not summary.failed
    finally:
        s.stop(1.0)
