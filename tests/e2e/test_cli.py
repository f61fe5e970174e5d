"""The sidecar as its own process, started and stopped through its CLI as an operator would."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

pytestmark = pytest.mark.e2e


def _spawn(args, env=None):
    proc = subprocess.Popen(
        [sys.executable, "-m", "spillway.sidecar.cli", "--log-level", "WARNING", "serve", *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, **(env or {})},
    )
    line = proc.stdout.readline()
    m = re.search(r"listening on (\S+)", line)
    if not m:
        proc.kill()
        raise AssertionError(f"no listening line: {line!r} {proc.stderr.read()[-2000:]}")
    return proc, m.group(1)


def _health(address):
    with grpc.insecure_channel(address) as ch:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(),
                                                    timeout=5).status


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
        assert _health(address) == health_pb2.HealthCheckResponse.SERVING
        from spillway.v1 import sidecar_pb2 as pb
        from spillway.v1 import sidecar_pb2_grpc as pb_grpc

        with grpc.insecure_channel(address) as ch:
            stub = pb_grpc.ErrorSidecarStub(ch)
            eff = stub.RegisterJob(pb.RegisterJobRequest(job="j"), timeout=10).effective_properties
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


def test_unix_socket_listener(tmp_path):
    sock = tmp_path / "spillway.sock"
    proc, address = _spawn(["--listen", "", "--unix-socket", str(sock)])
    try:
        assert address == f"unix://{sock}"
        assert _health(address) == health_pb2.HealthCheckResponse.SERVING
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0


def test_status_against_no_sidecar_is_a_clear_error():
    out = subprocess.run([sys.executable, "-m", "spillway.sidecar.cli", "status", "--sidecar",
                          "127.0.0.1:1", "--timeout", "2"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 2
    assert "127.0.0.1:1" in out.stderr and "SPILLWAY_SIDECAR_ADDRESS" in out.stderr
