"""A run's job token is checked against the whole SHA-256 digest the sidecar keeps, never a
prefix of it: a presented token whose digest agrees with the run's in its first bytes (or a
stored digest that differs from the presented token's in one byte only, wherever that byte
is) is refused, by every access rule and by the real sidecar's calls.

A comparison of the first byte only would let one wrong token in 256 through; a random wrong
token (as the other tests use) differs in the first byte 255 times in 256, so only tokens
chosen for their digest's prefix catch it."""

from __future__ import annotations

import itertools
import uuid

import pytest
from spillway.client import SidecarClient
from spillway.client.errors import JobAccessError, SidecarAuthError
from spillway.client.runs import JobRun, JobToken
from spillway.sidecar.service import registry as r
from spillway.v1 import sidecar_pb2 as pb
from support.fakes import Caller

APP = Caller()


def _same_prefix(token: str, nbytes: int) -> str:
    """A token other than ``token`` whose digest starts with the same ``nbytes`` bytes."""
    want = r.token_digest(token)[:nbytes]
    for i in itertools.count():
        other = f"{token[:8]}-near-{i}"
        if r.token_digest(other)[:nbytes] == want:
            return other
    raise AssertionError("unreachable")


def _one_byte_off(digest: bytes, i: int) -> bytes:
    return digest[:i] + bytes([digest[i] ^ 0x01]) + digest[i + 1:]


def _run(digest: bytes, run_id: str = "app-1") -> r.Run:
    return r.Run(job="j", run_id=run_id, key=f"j@{run_id}", digest=digest)


@pytest.mark.parametrize("i", range(32))
def test_a_stored_digest_differing_in_any_one_byte_refuses_the_token(i):
    token = "the-runs-token"
    good = r.token_digest(token)
    assert len(good) == 32
    bad = _one_byte_off(good, i)
    assert r.may_use(good, token) and r.may_see(APP, good, token)  # the control
    assert not r.may_use(bad, token)
    assert not r.may_see(APP, bad, token)
    assert not r.may_end(APP, bad, token, local_only=False)
    assert not r.may_end(APP, bad, token, local_only=True)
    assert [x.run_id for x in r.visible([_run(good, "a"), _run(bad, "b")], APP, token)] == ["a"]


@pytest.mark.parametrize("nbytes", [1, 2])
def test_a_token_whose_digest_shares_its_first_bytes_is_refused(nbytes):
    token = "secret-token"
    near = _same_prefix(token, nbytes)
    d = r.token_digest(token)
    assert r.token_digest(near)[:nbytes] == d[:nbytes] and r.token_digest(near) != d
    assert not r.token_matches(d, near)
    assert not r.may_use(d, near) and not r.may_see(APP, d, near)
    assert not r.may_end(APP, d, near, local_only=False)
    assert r.visible([_run(d)], APP, near) == []


def test_tokens_differing_only_after_their_first_character_are_refused():
    token = "s" + "e" * 40
    d = r.token_digest(token)
    for i in range(1, len(token)):
        other = token[:i] + "x" + token[i + 1:]
        assert not r.may_use(d, other), i
    assert not r.may_use(d, token + "e") and not r.may_use(d, token[:-1])


@pytest.fixture(scope="module")
def sidecar(tmp_path_factory):
    """A sidecar that requires the node token: its callers are applications, not operators
    (with no credential on loopback everyone is trusted, and may end any run)."""
    from spillway.sidecar.server import start_server
    from support.tls import write_token

    tmp = tmp_path_factory.mktemp("digest")
    token = write_token(tmp / "node.token", "node-token")
    running = start_server({"listen.address": "127.0.0.1:0", "telemetry.enable": "false",
                            "spool.dir": str(tmp / "spool"), "auth.token.file": str(token)})
    running.token_file = str(token)
    yield running
    running.stop(0.5)


@pytest.mark.parametrize("nbytes", [1, 2])
def test_the_sidecar_refuses_a_token_whose_digest_shares_the_runs_first_bytes(sidecar, nbytes):
    client = SidecarClient(sidecar.address, timeout_s=10, token_file=sidecar.token_file)
    reg = client.register_job(f"digest-{uuid.uuid4().hex[:8]}", {"errors.tolerance": "all"})
    near = JobRun(reg.job, reg.run_id, JobToken(_same_prefix(reg.job_token.reveal(), nbytes)))
    task = pb.TaskIdentity(stage_id=1, partition_id=0, task_attempt_id=1)
    refused = (JobAccessError, SidecarAuthError)
    with pytest.raises(refused):
        client.job_summary(near)
    with pytest.raises(refused):
        client.flush_task(near, task, timeout_s=5)
    with pytest.raises(refused):
        client.report_failures(near, task, [])
    with pytest.raises(refused):
        client.register_job(near, {"errors.tolerance": "all"})
    with pytest.raises(refused):
        client.end_job(near)
    assert client.job_summary(reg.run()).job == reg.job  # the run's own token still works
    client.end_job(reg.run())
