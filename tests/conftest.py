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


@pytest.fixture(scope="session")
def spark():
    from support.spark import local_spark

    session = local_spark()
    yield session
    session.stop()
