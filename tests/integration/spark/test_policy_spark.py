"""The policy engine's promises, through real Spark, a real sidecar and a real broker.

Attempts are counted by the user function itself (one line appended to a file per call), so the
counts are what the user's code saw, not what spillway says it did.
"""

from __future__ import annotations

import sys
import uuid


import pytest
from pyspark import cloudpickle

from spillway.spark import Job
from support.kafka import read_all

pytestmark = pytest.mark.integration

cloudpickle.register_pickle_by_value(sys.modules[__name__])


def _job(sidecar, topic, **props):
    return Job(f"policy-{uuid.uuid4().hex[:8]}", {
        "errors.tolerance": "all", "errors.deadletterqueue.topic.name": topic,
        "errors.deadletterqueue.context.headers.enable": "true",
        "errors.deadletterqueue.auto.create.topics.enable": "true",
        "errors.deadletterqueue.topic.replication.factor": "1", **props},
        sidecar=sidecar.address)


def _calls(path) -> dict[int, int]:
    counts: dict[int, int] = {}
    if path.exists():
        for line in path.read_text().split():
            counts[int(line)] = counts.get(int(line), 0) + 1
    return counts


def test_port_of_connects_error_handling_integration_test(spark, sidecar, broker, topic_name,
                                                          tmp_path):
    """Kafka Connect's ErrorHandlingIntegrationTest: 20 records, errors.tolerance=all; one record
    fails once then succeeds, one always fails -> 19 out, exactly 1 in the DLQ with context."""
    job = _job(sidecar, topic_name, **{"errors.retry.timeout": "30000",
                                       "errors.retry.delay.max.ms": "100"})
    calls = tmp_path / "calls"

    def fn(x):
        with open(calls, "a") as fh:
            fh.write(f"{x}\n")
        if x == 5 and _calls(calls)[5] == 1:
            raise ConnectionError("transient: dependency reset")
        if x == 13:
            raise ValueError("poison record 13")
        return x * 10

    out = sorted(job.map_partitions(spark.sparkContext.parallelize(range(20), 2), fn).collect())
    assert out == [x * 10 for x in range(20) if x != 13]
    seen = _calls(calls)
    assert seen[5] == 2       # failed once, then succeeded: N+1 attempts with N=1
    assert seen[13] == 1      # a data error is attempted exactly once
    assert all(seen[x] == 1 for x in range(20) if x not in (5, 13))
    [dlq] = read_all(broker.bootstrap_servers, topic_name)
    h = dict(dlq.headers())
    assert h["__connect.errors.exception.class.name"] == b"builtins.ValueError"
    assert h["__connect.errors.exception.message"] == b"poison record 13"
    assert h["__connect.errors.connector.name"] == job.name.encode()
    s = job.summary()
    assert (s.total_record_failures, s.total_retries, s.total_record_errors,
            s.total_records_skipped, s.dlq_records_written) == (2, 1, 1, 1, 1)


def test_always_retriable_record_is_attempted_max_retries_plus_one_times(spark, sidecar, broker,
                                                                       topic_name, tmp_path):
    job = _job(sidecar, topic_name, **{"errors.retry.max.retries": "3",
                                       "errors.retry.initial.backoff.ms": "10",
                                       "errors.retry.max.backoff.ms": "50"})
    calls = tmp_path / "calls"

    def fn(x):
        with open(calls, "a") as fh:
            fh.write(f"{x}\n")
        if x == 2:
            raise TimeoutError("dependency never answers")
        return x

    out = sorted(job.map_partitions(spark.sparkContext.parallelize(range(6), 1), fn).collect())
    assert out == [0, 1, 3, 4, 5]
    assert _calls(calls)[2] == 4  # max.retries + 1, then handled by tolerance (dead-lettered)
    [dlq] = read_all(broker.bootstrap_servers, topic_name)
    h = dict(dlq.headers())
    assert h["spillway.attempts"] == b"4" and h["spillway.error.category"] == b"retriable"


def test_tolerance_across_parallel_executors_fails_as_soon_as_the_job_limit_is_crossed(
        spark, sidecar, topic_name):
    job = _job(sidecar, topic_name, **{"errors.tolerance.max.errors": "5"})

    def fn(x):
        raise ValueError(f"every record is bad ({x})")

    with pytest.raises(Exception) as info:
        job.map_partitions(spark.sparkContext.parallelize(range(80), 4), fn).count()
    message = Job.failure_message(info.value)
    assert "ToleranceExceededError" in message and job.name in message
    assert "errors.tolerance.max.errors=5" in message and "6 errors" in message
    assert "stage TRANSFORMATION" in message
    s = job.summary()
    assert s.failed and s.total_record_errors >= 6


@pytest.mark.slow
def test_a_3_second_outage_of_60_records_recovers_all_60_with_the_default_retry_budget(
        spark, sidecar, broker, topic_name, tmp_path):
    """KIP-298's promise through a short outage: 60 records on one partition hit a dependency
    that is down for 3 s; errors.retry.timeout=60000 and the default retry budget. Every record
    comes out, none is skipped (the old budget skipped 55 of 60 here)."""
    job = _job(sidecar, topic_name, **{"errors.retry.timeout": "60000"})
    down = tmp_path / "down-since"

    def fn(x):
        import os
        import time
        try:
            fd = os.open(down, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            os.write(fd, repr(time.time()).encode())
            os.close(fd)
        except FileExistsError:
            pass
        if time.time() < float(down.read_text() or time.time()) + 3.0:
            raise ConnectionError("dependency unavailable")
        return x

    out = job.map_partitions(spark.sparkContext.parallelize(range(60), 1), fn).collect()
    assert sorted(out) == list(range(60))
    s = job.summary()
    assert (s.total_records_skipped, s.total_record_errors) == (0, 0)
    assert s.total_retries >= 60          # every record was retried at least once


def test_kafka_refresh_retriable_codes_run_the_refresh_hook_and_config_codes_fail_the_job(
        spark, sidecar, broker, topic_name, tmp_path):
    """KIP-1050 end to end: a real KafkaException(NOT_LEADER_FOR_PARTITION) from the user's
    produce is refresh-then-retry (the refresh hook runs before the retry, the record comes
    out); TOPIC_AUTHORIZATION_FAILED is invalid-configuration (the job fails, nothing
    retried)."""
    from confluent_kafka import KafkaError, KafkaException

    job = _job(sidecar, topic_name, **{"errors.retry.timeout": "30000"})
    calls, refreshes = tmp_path / "calls", tmp_path / "refreshes"

    def refresh():
        with open(refreshes, "a") as fh:
            fh.write("1\n")

    def fn(x):
        with open(calls, "a") as fh:
            fh.write(f"{x}\n")
        if x == 3 and _calls(calls)[3] == 1:
            raise KafkaException(KafkaError(KafkaError.NOT_LEADER_FOR_PARTITION))
        return x

    out = job.map_partitions(spark.sparkContext.parallelize(range(5), 1), fn,
                             refresh=refresh).collect()
    assert sorted(out) == list(range(5))
    assert _calls(calls)[3] == 2 and refreshes.read_text().split() == ["1"]
    assert job.summary().by_category == {"refresh-retriable": 1}

    denied = _job(sidecar, topic_name, **{"errors.retry.timeout": "30000"})

    def produce(x):
        raise KafkaException(KafkaError(KafkaError.TOPIC_AUTHORIZATION_FAILED))

    with pytest.raises(Exception) as failed:
        denied.map_partitions(spark.sparkContext.parallelize([1], 1), produce).collect()
    assert "invalid-configuration" in denied.failure_message(failed.value)
    s = denied.summary()
    assert s.failed and s.total_retries == 0 and s.by_category == {"invalid-configuration": 1}


@pytest.mark.slow
@pytest.mark.parametrize("iteration", range(3))
def test_summary_right_after_the_action_counts_exactly_what_it_processed(spark, sidecar, broker,
                                                                         topic_name, iteration):
    """Exact summaries: clean partitions send their counts before their task ends, so the summary
    read right after the action is exact, every time (not only once a count interval passed)."""
    job = _job(sidecar, topic_name)
    bad = {3, 17}  # both in the first of 4 partitions: the other three have no failure

    def fn(x):
        if x in bad:
            raise ValueError(f"poison record {x}")
        return x

    out = job.map_partitions(spark.sparkContext.parallelize(range(80), 4), fn).collect()
    assert sorted(out) == [x for x in range(80) if x not in bad]
    s = job.summary()
    assert (s.records_processed, s.total_records_skipped, s.total_record_failures,
            s.dlq_records_written) == (80, 2, 2, 2)
