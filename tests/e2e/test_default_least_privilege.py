"""The default configuration is least privilege (issue 23): `spillway serve` with no credential
configured, as its own process. A second local process without the sidecar's local credential
(another OS user on a shared node: the credential file is this user's only) cannot read, end,
take over or redirect another run, nor make the sidecar dial an address it chose; the owner's
own CLI (same user) reads the credential without flags and may."""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys
import textwrap

import pytest

from spillway.client import SidecarClient
from spillway.v1 import sidecar_pb2 as pb
from support import serve

pytestmark = pytest.mark.e2e

TASK = pb.TaskIdentity(stage_id=1, partition_id=0, task_attempt_id=7)

# The attacker: its own process, holding no credential, knowing the victim's job and run id.
ATTACK = textwrap.dedent("""
    import json, sys
    import grpc
    from spillway.v1 import sidecar_pb2 as pb, sidecar_pb2_grpc as pb_grpc

    address, job, run, trap = sys.argv[1:5]
    stub = pb_grpc.ErrorSidecarStub(grpc.insecure_channel(address))
    out = {}

    def call(name, fn, *args, **kw):
        try:
            resp = fn(*args, timeout=10, **kw)
            out[name] = ["OK", resp]
        except grpc.RpcError as exc:
            out[name] = [exc.code().name, exc.details()]

    call("status", stub.GetStatus, pb.GetStatusRequest())
    if out["status"][0] == "OK":
        s = out["status"][1]
        out["status"][1] = [s.jobs_total, [(j.job, j.run_id) for j in s.jobs]]
    call("summary", stub.GetJobSummary, pb.GetJobSummaryRequest(job=job, run_id=run))
    call("summary_forged", stub.GetJobSummary, pb.GetJobSummaryRequest(job=job, run_id=run),
         metadata=[("spillway-job-token", "guessed")])
    call("end", stub.EndJob, pb.EndJobRequest(job=job, run_id=run))
    call("end_local_only", stub.EndJob, pb.EndJobRequest(job=job, run_id=run, local_only=True))
    call("end_forged_admin", stub.EndJob, pb.EndJobRequest(job=job, run_id=run),
         metadata=[("spillway-admin-token", "guessed")])
    call("take_over", stub.RegisterJob, pb.RegisterJobRequest(job=job, run_id=run),
         metadata=[("spillway-job-token", "mine-now")])
    call("redirect", stub.RegisterJob,
         pb.RegisterJobRequest(job="evil", run_id="r1", home=trap),
         metadata=[("spillway-job-token", "made-up")])
    call("decide_only", stub.ReportFailures, pb.ReportFailuresRequest(
        job=job, run_id=run, decide_only=True, task=pb.TaskIdentity(task_attempt_id=9),
        records=[pb.FailedRecord(record_id="x", stage=pb.STAGE_TRANSFORMATION,
                                 exception=pb.ExceptionInfo(class_name="E"))]))
    print(json.dumps({k: [v[0], v[1] if isinstance(v[1], (str, list)) else ""]
                      for k, v in out.items()}))
""")


@pytest.fixture
def default_sidecar(tmp_path):
    state = tmp_path / "owner-state"
    env = {**os.environ, "XDG_STATE_HOME": str(state), "GRPC_VERBOSITY": "NONE"}
    proc, address = serve.spawn(["--listen", "127.0.0.1:0", "--set", "telemetry.enable=false"],
                                env=env)
    yield address, state, env
    serve.stop(proc)


def test_a_second_local_process_cannot_read_end_take_over_or_redirect_a_run(default_sidecar,
                                                                            tmp_path):
    address, state, owner_env = default_sidecar
    cred = state / "spillway" / "local.token"
    assert stat.S_IMODE(cred.stat().st_mode) == 0o600
    assert stat.S_IMODE(cred.parent.stat().st_mode) == 0o700
    owner = SidecarClient(address)
    run = owner.register_job("victim", {"errors.tolerance": "all"}, run_id="run-1")
    owner.report_failures(run, TASK, [pb.FailedRecord(
        record_id="r1", stage=pb.STAGE_TRANSFORMATION,
        exception=pb.ExceptionInfo(class_name="builtins.ValueError"))])

    trap = socket.socket()
    trap.bind(("127.0.0.1", 0))
    trap.listen(8)
    trap.settimeout(0.5)
    attacker_env = {**os.environ, "XDG_STATE_HOME": str(tmp_path / "attacker-state"),
                    "GRPC_VERBOSITY": "NONE"}
    done = subprocess.run(
        [sys.executable, "-c", ATTACK, address, "victim", "run-1",
         "127.0.0.1:%d" % trap.getsockname()[1]],
        capture_output=True, text=True, env=attacker_env, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(done.stdout)

    assert got["status"][0] == "OK" and got["status"][1] == [0, []]   # sees no other run
    assert got["summary"][0] == "PERMISSION_DENIED"
    assert got["summary_forged"][0] == "PERMISSION_DENIED"
    assert got["end"][0] == "PERMISSION_DENIED"
    assert got["end_local_only"][0] == "PERMISSION_DENIED" and "peer" in got["end_local_only"][1]
    assert got["end_forged_admin"][0] == "UNAUTHENTICATED"
    assert got["take_over"][0] == "PERMISSION_DENIED"
    assert got["redirect"][0] == "PERMISSION_DENIED"
    assert "home.allowed.addresses" in got["redirect"][1]
    assert got["decide_only"][0] == "PERMISSION_DENIED"
    with pytest.raises(socket.timeout):
        trap.accept()             # the sidecar never dialled the address the attacker chose
    trap.close()

    # nothing changed for the owner: the run is live, its token still the only one
    summary = owner.job_summary(run)
    assert summary.total_record_failures == 1 and not summary.failed

    # the owner's CLI (same OS user: it reads the local credential without flags) sees and ends it
    cli = [sys.executable, "-m", "spillway.sidecar.cli", "job"]
    listed = subprocess.run([*cli, "list", "--sidecar", address], capture_output=True,
                            text=True, env=owner_env, timeout=60)
    assert listed.returncode == 0, listed.stderr
    assert "victim" in listed.stdout and "run-1" in listed.stdout
    ended = subprocess.run([*cli, "end", "victim", "--run", "run-1", "--sidecar", address],
                           capture_output=True, text=True, env=owner_env, timeout=60)
    assert ended.returncode == 0, ended.stderr
    # ...and the attacker's CLI, without the credential, cannot even list it
    listed = subprocess.run([*cli, "list", "--sidecar", address], capture_output=True,
                            text=True, env=attacker_env, timeout=60)
    assert "victim" not in listed.stdout


def test_the_cli_of_another_caller_says_it_may_not_see_the_runs_and_what_would(
        default_sidecar, tmp_path):
    """`spillway job list|end` and `status` without the local credential (another OS user,
    `sudo`, `kubectl exec` as someone else) do not answer "0 live run(s)" / "has no live run"
    while runs are live: they say the caller may not see them, name the credential that would,
    and the job commands exit 2. Nothing is ended."""
    address, state, owner_env = default_sidecar
    owner = SidecarClient(address)
    run = owner.register_job("victim", {"errors.tolerance": "all"}, run_id="run-1")
    owner.register_job("other", {"errors.tolerance": "all"}, run_id="run-2")
    stranger = {**os.environ, "XDG_STATE_HOME": str(tmp_path / "stranger-state"),
                "GRPC_VERBOSITY": "NONE"}
    for name in ("SPILLWAY_ADMIN_TOKEN_FILE", "SPILLWAY_TOKEN_FILE",
                 "SPILLWAY_LOCAL_TOKEN_FILE", "SPILLWAY_AUTH_LOCAL_TOKEN_FILE"):
        stranger.pop(name, None)
    looked_at = str(tmp_path / "stranger-state" / "spillway" / "local.token")

    def cli(*args, env=stranger):
        return subprocess.run([sys.executable, "-m", "spillway.sidecar.cli", *args,
                               "--sidecar", address], capture_output=True, text=True,
                              env=env, timeout=60)

    def names_the_credentials(err: str) -> None:
        assert "sees and ends only runs whose job token it holds" in err, err
        assert "--admin-token-file" in err and "$SPILLWAY_ADMIN_TOKEN_FILE" in err
        assert "local.token" in err and "$SPILLWAY_LOCAL_TOKEN_FILE" in err
        assert looked_at in err                      # where it looked for the local one
        assert "Traceback" not in err

    listed = cli("job", "list")
    assert listed.returncode == 2
    assert listed.stdout.startswith("0 live run(s)")
    assert "2 live run(s) on" in listed.stderr and "not shown" in listed.stderr
    names_the_credentials(listed.stderr)
    as_json = cli("job", "list", "--json")
    assert as_json.returncode == 2 and json.loads(as_json.stdout) == []
    names_the_credentials(as_json.stderr)

    ended = cli("job", "end", "victim")
    assert ended.returncode == 2
    assert "has no live run" not in ended.stdout + ended.stderr
    assert "1 live run(s) of job 'victim'" in ended.stderr and "not ended" in ended.stderr
    names_the_credentials(ended.stderr)
    by_id = cli("job", "end", "victim", "--run", "run-1")
    assert by_id.returncode == 2
    assert "PERMISSION_DENIED" in by_id.stderr or "refused" in by_id.stderr
    names_the_credentials(by_id.stderr)

    status = cli("status")
    assert status.returncode == 0 and "counters" in status.stdout
    assert "2 live run(s) not shown" in status.stderr
    names_the_credentials(status.stderr)

    # nothing was ended; the owner's CLI (same OS user, its local credential) sees both runs
    assert not owner.job_summary(run).failed
    mine = cli("job", "list", env=owner_env)
    assert mine.returncode == 0, mine.stderr
    assert mine.stdout.startswith("2 live run(s)") and mine.stderr == ""
    # and a job that truly has no run still says so (exit 1, as documented)
    none = cli("job", "end", "nobody", env=owner_env)
    assert none.returncode == 1 and "has no live run" in none.stdout


def test_the_cli_finds_a_moved_local_credential_by_the_sidecars_own_variable(tmp_path):
    """`auth.local.token.file` set through the sidecar's environment
    (SPILLWAY_AUTH_LOCAL_TOKEN_FILE): the operator's CLI run in that same environment
    (`kubectl exec`, a unit's environment file) finds it without SPILLWAY_LOCAL_TOKEN_FILE."""
    cred = tmp_path / "creds" / "sidecar.token"
    env = {**os.environ, "XDG_STATE_HOME": str(tmp_path / "elsewhere"),
           "SPILLWAY_AUTH_LOCAL_TOKEN_FILE": str(cred), "GRPC_VERBOSITY": "NONE"}
    env.pop("SPILLWAY_LOCAL_TOKEN_FILE", None)
    env.pop("SPILLWAY_ADMIN_TOKEN_FILE", None)
    proc, address = serve.spawn(["--listen", "127.0.0.1:0", "--set", "telemetry.enable=false"],
                                env=env)
    try:
        assert cred.exists() and not (tmp_path / "elsewhere" / "spillway").exists()
        SidecarClient(address).register_job("moved", {"errors.tolerance": "all"},
                                            run_id="run-1")
        listed = subprocess.run([sys.executable, "-m", "spillway.sidecar.cli", "job", "list",
                                 "--sidecar", address], capture_output=True, text=True,
                                env=env, timeout=60)
        assert listed.returncode == 0, listed.stderr
        assert listed.stdout.startswith("1 live run(s)") and "moved\trun-1" in listed.stdout
    finally:
        serve.stop(proc)
