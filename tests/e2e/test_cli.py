"""The sidecar as its own process, started and stopped through its CLI as an operator would."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import grpc
import pytest
from grpc_health.v1 import health_pb2
from support import rpc, serve

pytestmark = pytest.mark.e2e


def _spawn(args, env=None):
    return serve.spawn(args, extra_env=env)


def test_serve_layers_flags_over_env_over_file_and_stops_on_sigterm(tmp_path, broker):
    conf = tmp_path / "sidecar.properties"
    conf.write_text(
        "# KIP property names, Java-properties syntax\n"
        "errors.tolerance=none\n"
        "errors.retry.timeout=1000\n"
        f"spool.dir={tmp_path / 'spool'}\n"
        "sidecar.id=from-file\n"
    )
    proc, address = _spawn(
        ["--config", str(conf), "--listen", "127.0.0.1:0",
         "--bootstrap-servers", broker.bootstrap_servers, "--set", "sidecar.id=from-flag"],
        env={"SPILLWAY_ERRORS_RETRY_TIMEOUT": "5000", "SPILLWAY_SIDECAR_ID": "from-env"},
    )
    try:
        assert address.startswith("127.0.0.1:")  # loopback, never all interfaces by default
        assert rpc.health_at(address) == health_pb2.HealthCheckResponse.SERVING
        from spillway.v1 import sidecar_pb2 as pb
        from spillway.v1 import sidecar_pb2_grpc as pb_grpc

        with grpc.insecure_channel(address) as ch:
            stub = pb_grpc.ErrorSidecarStub(ch)
            eff = stub.RegisterJob(pb.RegisterJobRequest(job="j", run_id="run-1"),
                                   timeout=10).effective_properties
            status = stub.GetStatus(pb.GetStatusRequest(), timeout=5)
        assert eff["errors.tolerance"] == "none"        # from the file
        assert eff["errors.retry.timeout"] == "5000"    # env beats file
        assert status.sidecar_id == "from-flag"         # flag beats env

        out = subprocess.run([sys.executable, "-m", "spillway.sidecar.cli", "status",
                              "--sidecar", address], capture_output=True, text=True, timeout=30)
        assert out.returncode == 0, out.stderr
        assert "from-flag" in out.stdout and "job j: running" in out.stdout
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0


def test_bad_config_stops_start_up_naming_the_property(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "spillway.sidecar.cli", "serve", "--listen", "127.0.0.1:0",
         "--set", "errors.retry.backoff.multiplier=0.5"],
        capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2
    assert "errors.retry.backoff.multiplier" in proc.stderr and "1.0" in proc.stderr


def test_an_alias_and_its_property_set_differently_stop_start_up_naming_both(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "spillway.sidecar.cli", "serve", "--listen", "127.0.0.1:0",
         "--set", "status.storage.retry.max.retries=4", "--set", "errors.retry.max.retries=3"],
        capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2
    assert "status.storage.retry.max.retries" in proc.stderr
    assert "errors.retry.max.retries" in proc.stderr


def test_unix_socket_listener(tmp_path):
    sock = tmp_path / "spillway.sock"
    proc, address = _spawn(["--listen", "", "--unix-socket", str(sock)])
    try:
        assert address == f"unix://{sock}"
        assert rpc.health_at(address) == health_pb2.HealthCheckResponse.SERVING
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0


def test_status_against_no_sidecar_is_a_clear_error():
    out = subprocess.run([sys.executable, "-m", "spillway.sidecar.cli", "status", "--sidecar",
                          "127.0.0.1:1", "--timeout", "2"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 2
    assert "127.0.0.1:1" in out.stderr and "SPILLWAY_SIDECAR_ADDRESS" in out.stderr


def _run(*args, env=None, timeout=30):
    return subprocess.run([sys.executable, "-m", "spillway.sidecar.cli", *args],
                          capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def test_version():
    from spillway.sidecar import __version__

    out = _run("--version")
    assert out.returncode == 0 and out.stdout.strip() == f"spillway {__version__}"


@pytest.mark.parametrize("listen, why", [
    ("localhost", "must be host:port"), ("127.0.0.1:70000", "port must be 0-65535"),
    ("127.0.0.1:http", "port must be 0-65535"), (":50051", "must be host:port")])
def test_listen_address_is_validated(listen, why):
    out = _run("serve", "--listen", listen)
    assert out.returncode == 2
    assert f"listen.address: {why}" in out.stderr and "Traceback" not in out.stderr


def test_port_in_use_is_one_line_and_a_nonzero_exit(tmp_path):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = _run("serve", "--listen", f"127.0.0.1:{port}")
        assert out.returncode != 0
        lines = out.stderr.strip().splitlines()
        assert lines == [f"spillway: listen.address: cannot listen on 127.0.0.1:{port}: the "
                         f"port is in use (another sidecar?)"], out.stderr


def test_unknown_environment_variable_gets_a_did_you_mean(tmp_path):
    proc, address = _spawn(["--listen", "127.0.0.1:0", "--unix-socket", ""],
                           env={"SPILLWAY_ERRORS_TOLERENCE": "all",
                                "XDG_STATE_HOME": str(tmp_path)})
    try:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert ("SPILLWAY_ERRORS_TOLERENCE: unknown environment variable, ignored (did you mean "
            "SPILLWAY_ERRORS_TOLERANCE?)") in err


def test_status_piped_into_a_closed_reader_ends_quietly(tmp_path):
    proc, address = _spawn(["--listen", "127.0.0.1:0"], env={"XDG_STATE_HOME": str(tmp_path)})
    try:
        status = subprocess.Popen(
            [sys.executable, "-m", "spillway.sidecar.cli", "status", "--sidecar", address],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            env={**os.environ, "XDG_STATE_HOME": str(tmp_path)})  # the sidecar's credential
        status.stdout.close()  # like `| head -0`: the reader is gone before the first line
        err = status.stderr.read().decode()
        assert status.wait(timeout=30) == 0, err
        assert "Traceback" not in err and "BrokenPipe" not in err
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=30)


def test_job_list_json_carries_every_field_its_text_shows(tmp_path):
    """`job list` and `job list --json` of the same runs: each text row's values are in the
    JSON entry (zeros and false too: a run that never retried has totalRetries 0, a live run
    failed false), and the options say what they do."""
    from spillway.client import SidecarClient
    from spillway.v1 import sidecar_pb2 as pb

    env = {"XDG_STATE_HOME": str(tmp_path)}   # the sidecar's own user: its local credential
    proc, address = _spawn(["--listen", "127.0.0.1:0", "--set", "telemetry.enable=false"],
                           env=env)
    try:
        client = SidecarClient(address)
        for job, n in (("quiet", 0), ("noisy", 3)):
            run = client.register_job(job, {"errors.tolerance": "all"}, run_id="run-1")
            if n:
                client.report_failures(run, pb.TaskIdentity(task_attempt_id=1), [
                    pb.FailedRecord(record_id=f"r{i}", stage=pb.STAGE_TRANSFORMATION,
                                    exception=pb.ExceptionInfo(class_name="builtins.KeyError"))
                    for i in range(n)])
        text = _run("job", "list", "--sidecar", address, env=env)
        as_json = _run("job", "list", "--sidecar", address, "--json", env=env)
        assert text.returncode == 0 and as_json.returncode == 0, text.stderr + as_json.stderr
        entries = {(e["job"], e["runId"]): e for e in json.loads(as_json.stdout)}
        rows = text.stdout.splitlines()[1:]
        assert len(rows) == len(entries) == 2
        key = {"processed": "recordsProcessed", "failures": "totalRecordFailures",
               "errors": "totalRecordErrors", "skipped": "totalRecordsSkipped",
               "dlq-written": "dlqRecordsWritten"}
        for row in rows:
            job, run_id, state, *counts = row.split("\t")
            entry = entries[(job, run_id)]
            assert entry["failed"] is (state == "FAILED")
            for name, value in (c.split("=") for c in counts):
                assert int(entry[key[name]]) == int(value), (row, entry)
        assert int(entries[("noisy", "run-1")]["totalRecordErrors"]) == 3
        assert int(entries[("quiet", "run-1")]["totalRetries"]) == 0
        for command in (["status"], ["job", "list"]):
            helped = _run(*command, "--help")
            assert "--json" in helped.stdout
            for option in ("--json", "--timeout"):
                block = helped.stdout.split(option, 1)[1].split("\n  -", 1)[0]
                assert len(block.split()) > 2, (command, option, block)   # says something
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=30)


def _environ(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as fh:
        items = [kv.decode(errors="replace").split("=", 1) for kv in fh.read().split(b"\0") if kv]
    return {kv[0]: kv[1] for kv in items if len(kv) == 2}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc: Linux only")
@pytest.mark.parametrize("chosen, expected", [(None, "malloc"), ("pymalloc", "pymalloc")])
def test_serve_runs_on_glibc_malloc_unless_an_allocator_was_chosen(tmp_path, chosen, expected):
    # memtune.py: the same process (pid) re-executed once on glibc's malloc so a burst's memory
    # goes back after a drain; an operator's own PYTHONMALLOC is left alone
    env = {k: v for k, v in os.environ.items() if k != "PYTHONMALLOC"}
    env["XDG_STATE_HOME"] = str(tmp_path)
    if chosen:
        env["PYTHONMALLOC"] = chosen
    proc, address = serve.spawn(["--listen", "127.0.0.1:0"], env=env, log_level="INFO")
    try:
        assert rpc.health_at(address) == health_pb2.HealthCheckResponse.SERVING
        assert _environ(proc.pid).get("PYTHONMALLOC") == expected
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert f"allocator: {expected}" in err
    assert err.count("allocator:") == 1  # re-executed once, not in a loop


def _thread_names(pid: int) -> list[str]:
    names = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as fh:
                names.append(fh.read().strip())
        except OSError:
            continue
    return names


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc: Linux only")
def test_serve_names_its_threads_for_top(tmp_path, broker):
    """`top -H` and /proc tell the sidecar's threads apart (runtime/threadnames.py): the drain,
    the spool's writer and the threads that serve calls, not a row of "python"."""
    proc, address = _spawn(["--listen", "127.0.0.1:0", "--bootstrap-servers",
                            broker.bootstrap_servers, "--set", f"spool.dir={tmp_path / 'spool'}"])
    try:
        assert rpc.health_at(address) == health_pb2.HealthCheckResponse.SERVING
        names = _thread_names(proc.pid)
        assert {"dlq-drain", "spool-writer"} <= set(names), names
        assert any(n.startswith("rpc_") for n in names), names   # the health call's thread
        assert not [n for n in names if n.startswith("spillway-")], names
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
