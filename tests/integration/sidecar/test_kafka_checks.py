"""Kafka problems say Kafka: a sidecar whose bootstrap.servers is wrong starts, logs one line
about it, reports it on health, and RegisterJob's topic check answers within the caller's
deadline with an error that names Kafka and its address (not "the sidecar is unreachable")."""

from __future__ import annotations

import logging
import time
import urllib.request

import pytest

from spillway.client import SidecarClient
from spillway.client.errors import SidecarKafkaError, SidecarUnavailableError

pytestmark = pytest.mark.integration


def test_wrong_bootstrap_address_is_reported_as_kafka_within_the_deadline(tmp_path, caplog,
                                                                         unreachable):
    from support.ports import free_port
    from spillway.sidecar.server import start_server

    wrong = unreachable
    caplog.set_level(logging.INFO, logger="spillway")
    metrics = free_port()
    running = start_server({"listen.address": "127.0.0.1:0", "bootstrap.servers": wrong,
                            "spool.dir": str(tmp_path / "spool"),
                            "kafka.check.interval.ms": "1000",
                            "metrics.prometheus.port": str(metrics)})
    client = SidecarClient(running.address, timeout_s=4.0)
    try:
        started = time.monotonic()
        with pytest.raises(SidecarKafkaError) as err:
            client.register_job("kafka-wrong", {
                "errors.tolerance": "all", "errors.deadletterqueue.topic.name": "dlq.kw"})
        elapsed = time.monotonic() - started
        assert not isinstance(err.value, SidecarUnavailableError)
        assert err.value.code.name == "FAILED_PRECONDITION"
        message = str(err.value)
        assert wrong in message and "Kafka" in message and "sidecar answered" in message
        assert elapsed < 4.0 + 4.0  # the client's own deadline (plus a loaded machine's scheduling)
        # health: the sidecar serves, its Kafka service does not
        deadline = time.monotonic() + 15
        while client.health("spillway.kafka") != "NOT_SERVING":
            assert time.monotonic() < deadline, "health never reported the unreachable Kafka"
            time.sleep(0.2)
        assert client.health() == "SERVING"
        assert client.status().counters["kafka-reachable"] == 0
        # and on the metric deploy/monitoring's SpillwayKafkaUnreachable alert reads
        scrape = urllib.request.urlopen(f"http://127.0.0.1:{metrics}/metrics", timeout=10)
        assert "\nspillway_kafka_reachable 0.0\n" in scrape.read().decode()
        lines = [r.getMessage() for r in caplog.records
                 if r.name.startswith("spillway") and wrong in r.getMessage()]
        assert any("unreachable" in ln for ln in lines), lines
        assert not [r for r in caplog.records if r.name.endswith("librdkafka")]
    finally:
        client.close()
        running.stop(1.0)


def test_reachable_kafka_is_logged_with_its_broker_count(broker, tmp_path, caplog):
    from spillway.sidecar.server import start_server

    caplog.set_level(logging.INFO, logger="spillway")
    running = start_server({"listen.address": "127.0.0.1:0",
                            "bootstrap.servers": broker.bootstrap_servers,
                            "spool.dir": str(tmp_path / "spool")})
    client = SidecarClient(running.address, timeout_s=10)
    try:
        deadline = time.monotonic() + 15
        while not any("reachable: 1 broker" in r.getMessage() for r in caplog.records):
            assert time.monotonic() < deadline, [r.getMessage() for r in caplog.records]
            time.sleep(0.1)
        assert client.health("spillway.kafka") == "SERVING"
        assert client.status().counters["kafka-reachable"] == 1
    finally:
        client.close()
        running.stop(1.0)
