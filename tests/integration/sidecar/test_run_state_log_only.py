"""A sidecar without Kafka (log-only) keeps a run's job-wide state across kill -9 and a restart
as a Kafka-backed one does (docs/POLICY.md, "Across a restart"): `errors.tolerance.max.errors=5`
tolerates 5 errors in all, not 5 before the kill and 5 after."""

from __future__ import annotations

import signal

import grpc
import pytest
from spillway.v1 import sidecar_pb2 as pb
from spillway.v1 import sidecar_pb2_grpc as pb_grpc
from support import serve
from support.homes import md, record, task

pytestmark = pytest.mark.integration

PROPS = {"errors.tolerance": "all", "errors.tolerance.max.errors": "5",
         "errors.log.enable": "true"}


def _serve(state_dir, address="127.0.0.1:0"):
    return serve.spawn(["--listen", address, "--set", f"spool.dir={state_dir}"])


def _register(channel, token=None) -> str:
    return pb_grpc.ErrorSidecarStub(channel).RegisterJob(
        pb.RegisterJobRequest(job="log only", run_id="r", properties=PROPS), timeout=20,
        metadata=md(token) if token else None).job_token


def _report(channel, token, rid: str) -> pb.Verdict:
    resp = pb_grpc.ErrorSidecarStub(channel).ReportFailures(pb.ReportFailuresRequest(
        job="log only", run_id="r", task=task(0), records=[record(rid)]), timeout=20,
        metadata=md(token))
    return resp.verdicts[0]


def test_a_log_only_sidecar_keeps_its_limit_across_kill_9(tmp_path):
    state_dir = tmp_path / "state"
    proc, address = _serve(state_dir)
    try:
        with grpc.insecure_channel(address) as ch:
            token = _register(ch)
            for i in range(4):
                assert _report(ch, token, f"before-{i}").action == pb.ACTION_SKIP
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    proc, again = _serve(state_dir, address)
    try:
        assert again == address
        with grpc.insecure_channel(address) as ch:
            _register(ch, token)    # the executors' token is adopted by the restarted sidecar
            actions = [_report(ch, token, f"after-{i}") for i in range(6)]
    finally:
        serve.stop(proc)
    # 4 errors before the kill: the 5th is the last one tolerated, the 6th fails the run
    assert [pb.Action.Name(v.action) for v in actions[:2]] == ["ACTION_SKIP", "ACTION_FAIL"]
    assert actions[1].job_failed


@pytest.mark.parametrize(("props", "kept"), [
    ({"listen.address": "127.0.0.1:7001"}, True),      # the default directory of its address
    ({"listen.address": "127.0.0.1:0", "spool.dir": "/s"}, True),
    ({"listen.address": "127.0.0.1:0"}, False),         # no address to come back at
    ({"listen.address": "127.0.0.1:7001", "run.state.durable": "false"}, False),
    ({"listen.address": "127.0.0.1:7001", "spool.enable": "false"}, False),
])
def test_where_a_log_only_sidecar_keeps_its_runs(props, kept):
    from spillway.sidecar.core import config
    from spillway.sidecar.service import runstate

    raw = config.resolve(explicit=props)
    assert runstate.wanted(config.parse(raw)) is kept
