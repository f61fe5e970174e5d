"""Job token escrow (issue 44): a streaming query over Spark Connect reads no session file, so
its plan carries only the token's digest; the driver escrows the token with the run's home and
each executor claims it from its node's sidecar. `spillway serve` as its own processes (a home
and a node of the same OS user, the default configuration's local credential between them).

Only an authenticated caller claims: anonymous processes (another OS user on the node) are
refused before anything is read or forwarded; a run that escrowed nothing gives nothing; an
ended run's escrow is gone."""

from __future__ import annotations

import os
import uuid

import grpc
import pytest

from spillway.client import SidecarClient
from spillway.client.errors import JobAccessError, SidecarAuthError
from spillway.client.runs import JobRun
from spillway.v1 import sidecar_pb2 as pb
from spillway.v1 import sidecar_pb2_grpc as pb_grpc
from support import serve

pytestmark = pytest.mark.e2e

PROPS = {"errors.tolerance": "all"}


@pytest.fixture(scope="module")
def sidecars(tmp_path_factory):
    """A home and a node sidecar of this user (one local credential), and the environment an
    executor of this user has (the credential's place)."""
    state = tmp_path_factory.mktemp("state")
    env = {**os.environ, "XDG_STATE_HOME": str(state), "GRPC_VERBOSITY": "NONE"}
    args = ["--listen", "127.0.0.1:0", "--set", "telemetry.enable=false",
            "--set", "home.allowed.addresses=127.0.0.0/8"]
    home, home_addr = serve.spawn(args, env=env)
    node, node_addr = serve.spawn(args, env=env)
    yield home_addr, node_addr, state
    serve.stop(node)
    serve.stop(home)


@pytest.fixture
def executor_env(sidecars, monkeypatch):
    monkeypatch.setenv("XDG_STATE_HOME", str(sidecars[2]))
    for name in ("SPILLWAY_AUTH_LOCAL_TOKEN_FILE", "SPILLWAY_LOCAL_TOKEN_FILE",
                 "SPILLWAY_TOKEN_FILE"):
        monkeypatch.delenv(name, raising=False)


def _escrowed_run(home: str, escrow: bool = True):
    """A run registered by its driver at ``home``, its token escrowed there."""
    driver = SidecarClient(home, timeout_s=15, token_file="")
    reg = driver.register_job(JobRun(f"esc-{uuid.uuid4().hex[:8]}", "app-1", None), PROPS)
    if escrow:
        driver.register_job(reg.run(), PROPS, token_escrow=True)
    return driver, reg


def _claim(address: str, reg, metadata=()):
    """RegisterJob with claim_token and no job token, as a raw gRPC caller."""
    stub = pb_grpc.ErrorSidecarStub(grpc.insecure_channel(address))
    return stub.RegisterJob(pb.RegisterJobRequest(
        job=reg.job, run_id=reg.run_id, properties=PROPS, home=reg.home,
        home_instance_id=reg.home_instance_id, claim_token=True),
        metadata=list(metadata), timeout=15)


def test_an_executor_claims_the_escrowed_token_at_the_home_and_through_its_node(
        sidecars, executor_env):
    from spillway.spark._token import claim_client

    home, node, _ = sidecars
    driver, reg = _escrowed_run(home)
    for address in (home, node):
        client = claim_client(SidecarClient(address, timeout_s=15, token_file=""))
        claimed = client.register_job(JobRun(reg.job, reg.run_id, None), PROPS, home=reg.home,
                                      home_instance_id=reg.home_instance_id, claim_token=True)
        assert claimed.job_token.reveal() == reg.job_token.reveal()
        # and it works as the run's token: the run's summary at that sidecar
        plain = SidecarClient(address, timeout_s=15, token_file="")
        assert plain.job_summary(claimed.run()).job == reg.job
    driver.end_job(reg.run())


def test_an_anonymous_caller_is_refused_and_learns_nothing(sidecars):
    home, node, _ = sidecars
    driver, reg = _escrowed_run(home)
    for address in (home, node):
        with pytest.raises(grpc.RpcError) as err:
            _claim(address, reg)
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "authenticated caller" in err.value.details()
        assert reg.job_token.reveal() not in err.value.details()
    # a forged credential is no credential
    with pytest.raises(grpc.RpcError) as err:
        _claim(node, reg, [("spillway-admin-token", "guessed")])
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    driver.end_job(reg.run())


def test_a_run_that_escrowed_nothing_gives_nothing_and_an_ended_run_no_more(sidecars,
                                                                          executor_env):
    from spillway.spark._token import claim_client

    home, node, _ = sidecars
    driver, reg = _escrowed_run(home, escrow=False)
    client = claim_client(SidecarClient(node, timeout_s=15, token_file=""))
    # the home's refusal, passed on by the node
    with pytest.raises((JobAccessError, SidecarAuthError), match="no escrowed job token"):
        client.register_job(JobRun(reg.job, reg.run_id, None), PROPS, home=reg.home,
                            home_instance_id=reg.home_instance_id, claim_token=True)
    driver.register_job(reg.run(), PROPS, token_escrow=True)
    driver.end_job(reg.run())
    client = claim_client(SidecarClient(home, timeout_s=15, token_file=""))
    with pytest.raises((JobAccessError, SidecarAuthError)) as err:
        client.register_job(JobRun(reg.job, reg.run_id, None), PROPS, home=reg.home,
                            home_instance_id=reg.home_instance_id, claim_token=True)
    assert err.value.code == grpc.StatusCode.PERMISSION_DENIED


def test_escrow_and_claim_in_one_request_is_refused_as_invalid(sidecars):
    home, _, _ = sidecars
    stub = pb_grpc.ErrorSidecarStub(grpc.insecure_channel(home))
    with pytest.raises(grpc.RpcError) as err:
        stub.RegisterJob(pb.RegisterJobRequest(job="esc-both", run_id="r", token_escrow=True,
                                               claim_token=True), timeout=15)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "token_escrow and claim_token" in err.value.details()
