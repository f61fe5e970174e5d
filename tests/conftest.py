"""Shared fixtures: a real Tansu broker process and a real local Spark session.

Both are started once per test session (as pyspark.testing does) and stopped at its end.
"""

from __future__ import annotations

import os
import sys
import uuid

import pytest

sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture(scope="session")
def broker(tmp_path_factory):
    from spillway.sidecar.embedded import EmbeddedBroker

    log = tmp_path_factory.mktemp("tansu") / "tansu.log"
    b = EmbeddedBroker(log_path=str(log)).start()
    yield b
    b.stop()


@pytest.fixture
def topic_name():
    """A fresh DLQ-prefixed topic name per test."""
    return f"dlq.test-{uuid.uuid4().hex[:10]}"


def pytest_collection_finish(session):
    """Start the session's Spark (if any test needs it) before any test installs an
    OpenTelemetry SDK provider in this process: pyspark launches its JVM with a preexec_fn, so
    the provider's at-fork handler runs in the forked child, where its thread pool can crash the
    launcher in a process full of gRPC threads (seen as JAVA_GATEWAY_EXITED mid-suite)."""
    if any("spark" in getattr(item, "fixturenames", ()) for item in session.items):
        from support.spark import local_spark

        local_spark()   # the `spark` fixture gets this session (getOrCreate) and stops it


@pytest.fixture(scope="session")
def spark():
    from support.spark import local_spark

    session = local_spark()
    yield session
    session.stop()


@pytest.fixture(scope="module")
def sidecar_props():
    """Extra sidecar properties for a module's `sidecar`; override in the module to change."""
    return {}


@pytest.fixture(scope="module")
def sidecar(broker, tmp_path_factory, sidecar_props):
    """A real sidecar (gRPC server, policy engine, DLQ pipeline to the Tansu broker), one per
    test module, on a free loopback port."""
    from spillway.sidecar.server import start_server

    running = start_server({
        "listen.address": "127.0.0.1:0",
        "bootstrap.servers": broker.bootstrap_servers,
        "spool.dir": str(tmp_path_factory.mktemp("spool")),
        "producer.linger.ms": "5",
        **sidecar_props,
    })
    yield running
    running.stop(1.0)
