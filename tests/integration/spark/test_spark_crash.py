"""Records that kill or hang their Python worker (issue 46), against real Spark workers.

A record that segfaults the worker (``ctypes.string_at(0)``), one that calls ``os._exit(3)``
and one that hangs past ``errors.record.timeout.ms`` (a sleep, a regular expression
backtracking in C) finish their job under ``errors.tolerance=all``: the record is dead-lettered
(category crash / timeout, its payload, how its process died and the Python stack), every other
row comes out exactly once, per row (``job.map_partitions``, RDD and DataFrame) and through
``@job.udf``; under ``errors.tolerance=none`` the job fails naming the record, its payload's
digest and how the worker died; crashes count against the tolerance limits, in ``job.report``
and in the sidecar's metrics.

Spark retries a task only where ``spark.task.maxFailures`` > 1: the jobs run in a driver of
their own on ``local[2,4]`` (tests/support/crash_jobs.py), against ``spillway serve`` as its
own process and the Tansu broker; over Spark Connect, against a Connect server on
``local[2,4]``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid

import pytest
from pyspark import cloudpickle
from support import serve
from support.kafka import header_map, read_all
from support.ports import free_port

pytestmark = pytest.mark.integration
cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import tests/

DRIVER = os.path.join(os.path.dirname(__file__), "..", "..", "support", "crash_jobs.py")
SCENARIOS = ("rows-segfault", "frame-exit", "udf-segfault", "rows-hang", "udf-backtrack",
             "two-killers", "mixed", "arrow-segfault", "sink-exit", "deserialize-segfault",
             "example", "none-segfault", "limit-crashes")
CATEGORY = "spillway.error.category"
CLASS = "__connect.errors.exception.class.name"
MESSAGE = "__connect.errors.exception.message"
STACK = "__connect.errors.exception.stacktrace"


@pytest.fixture(scope="module")
def served(broker, tmp_path_factory):
    """`spillway serve` as its own process: (its address, its Prometheus port)."""
    port = free_port()
    proc, address = serve.spawn(
        ["--listen", "127.0.0.1:0", "--bootstrap-servers", broker.bootstrap_servers,
         "--set", f"spool.dir={tmp_path_factory.mktemp('crash-spool')}",
         "--set", "producer.linger.ms=5", "--set", f"metrics.prometheus.port={port}"],
        stderr=subprocess.DEVNULL)
    yield address, port
    serve.stop(proc, 30)


@pytest.fixture(scope="module")
def results(served):
    """Every scenario run once, in one driver (one JVM): name -> its JSON line."""
    address, port = served
    prefix = f"dlq.crash-{uuid.uuid4().hex[:8]}"
    run = subprocess.run(
        [sys.executable, DRIVER, address, f"http://127.0.0.1:{port}/metrics", prefix,
         *SCENARIOS], capture_output=True, text=True, timeout=600,
        env={**os.environ, "PYSPARK_PYTHON": sys.executable})
    lines = [json.loads(x) for x in run.stdout.splitlines() if x.startswith("{")]
    assert run.returncode == 0 and len(lines) == len(SCENARIOS), run.stderr[-4000:]
    return {x["name"]: x for x in lines}


def expected(n: int, *dropped: int) -> list[int]:
    return [x * 10 for x in range(n) if x not in dropped]


def dead_letters(broker, result) -> list:
    return sorted(read_all(broker.bootstrap_servers, result["topic"]),
                  key=lambda m: header_map(m)["spillway.record.id"])


def test_a_record_that_segfaults_the_worker_is_dead_lettered_and_the_rest_comes_out_once(
        results, broker):
    r = results["rows-segfault"]
    assert r["error"] is None
    assert r["out"] == expected(40, 7)        # each other row once, no duplicates
    assert r["report"]["by_category"] == {"crash": 1}
    assert r["report"]["records_processed"] == 40
    assert r["record_errors_metric"] == 1
    [dl] = dead_letters(broker, r)
    h = header_map(dl)
    assert dl.value() == b"7"                  # the record's payload (the row as JSON)
    assert h[CATEGORY] == b"crash"
    assert h["spillway.record.id"].endswith(b":p0:r7")
    assert h[CLASS] == b"spillway.client.markers.WorkerCrashError"
    assert b"killed by signal 11 (SIGSEGV)" in h[MESSAGE]
    assert b"record payload sha256:" in h[MESSAGE]
    # the Python stack of the process when it died: faulthandler's, down to the user's code
    assert b"Fatal Python error: Segmentation fault" in h[STACK]
    assert b"in segfault" in h[STACK] and b"in string_at" in h[STACK]


def test_a_record_that_exits_the_worker_is_dead_lettered_from_a_dataframe(results, broker):
    r = results["frame-exit"]
    assert r["error"] is None and r["out"] == expected(40, 13)
    assert r["report"]["by_category"] == {"crash": 1}
    [dl] = dead_letters(broker, r)
    h = header_map(dl)
    assert json.loads(dl.value()) == {"id": 13}
    assert h[CATEGORY] == b"crash" and b"exited with status 3" in h[MESSAGE]


def test_a_udf_record_that_segfaults_is_null_with_its_error_and_dead_lettered(results, broker):
    r = results["udf-segfault"]
    assert r["error"] is None and r["out"] == expected(40, 7)
    assert r["report"]["by_exception_class"] == {"spillway.client.markers.WorkerCrashError": 1}
    [dl] = dead_letters(broker, r)
    assert header_map(dl)[CATEGORY] == b"crash" and dl.value() == b"7"


def test_a_record_past_the_record_timeout_is_dead_lettered_as_a_timeout(results, broker):
    r = results["rows-hang"]
    assert r["error"] is None and r["out"] == expected(40, 5)
    assert r["report"]["by_category"] == {"timeout": 1}
    [dl] = dead_letters(broker, r)
    h = header_map(dl)
    assert h[CATEGORY] == b"timeout"
    assert h[CLASS] == b"spillway.client.markers.RecordTimeoutError"
    assert b"errors.record.timeout.ms=1500" in h[MESSAGE]
    assert b"in hangs" in h[STACK]             # where it was when it was stopped


def test_a_udf_record_backtracking_in_c_past_the_timeout_is_a_timeout(results, broker):
    r = results["udf-backtrack"]
    assert r["error"] is None and r["out"] == expected(40, 9)
    assert r["report"]["by_category"] == {"timeout": 1}
    [dl] = dead_letters(broker, r)
    assert header_map(dl)[CATEGORY] == b"timeout" and b"in backtracks" in header_map(dl)[STACK]


def test_two_killers_in_one_partition_are_both_dead_lettered(results, broker):
    r = results["two-killers"]
    assert r["error"] is None and r["out"] == expected(20, 3, 8)
    assert r["report"]["by_category"] == {"crash": 2}
    letters = dead_letters(broker, r)
    assert sorted(dl.value() for dl in letters) == [b"3", b"8"]
    assert {header_map(dl)[CATEGORY] for dl in letters} == {b"crash"}


def test_a_killer_beside_bad_and_flaky_records(results, broker):
    r = results["mixed"]
    # the flaky records come out (retried, or run again in the guarded attempt); the bad ones
    # and the killer are dead-lettered once each
    assert r["error"] is None and r["out"] == expected(20, 4, 9, 11)
    letters = dead_letters(broker, r)
    assert sorted((dl.value(), header_map(dl)[CATEGORY]) for dl in letters) == [
        (b"11", b"data"), (b"4", b"data"), (b"9", b"crash")]
    assert r["report"]["total_record_errors"] == 3 == r["report"]["dlq_records_written"]


@pytest.mark.parametrize(("name", "killer", "stage", "how"), [
    ("arrow-segfault", 7, b"TRANSFORMATION", b"killed by signal 11 (SIGSEGV)"),
    ("sink-exit", 13, b"TASK_PUT", b"exited with status 3"),
    ("deserialize-segfault", 21, b"VALUE_CONVERTER", b"killed by signal 11 (SIGSEGV)"),
])
def test_vectorized_sink_and_deserialize_wrappers_isolate_the_killer(results, broker, name,
                                                                     killer, stage, how):
    r = results[name]
    assert r["error"] is None and r["out"] == expected(40, killer)
    [dl] = dead_letters(broker, r)
    h = header_map(dl)
    assert h[CATEGORY] == b"crash" and how in h[MESSAGE]
    assert h["__connect.errors.stage"] == stage
    if name == "deserialize-segfault":   # the source record's own bytes, as read
        assert (dl.key(), dl.value()) == (b"k21", b"21")


def test_the_copyable_example_dead_letters_its_crash_and_its_hang(results, broker):
    r = results["example"]           # examples/crash_isolation.py
    assert r["error"] is None
    assert r["out"] == [[i, len(f"order-{i}")] for i in range(20) if i not in (5, 11)]
    assert r["report"]["by_category"] == {"crash": 1, "timeout": 1}
    letters = {header_map(dl)[CATEGORY]: dl for dl in dead_letters(broker, r)}
    assert letters[b"crash"].value() == b"\x00corrupt" and letters[b"crash"].key() == b"k5"
    assert letters[b"timeout"].value() == b"a" * 48 + b"b"


def test_with_tolerance_none_the_job_fails_naming_the_record_and_how_it_died(results):
    r = results["none-segfault"]
    assert r["out"] is None and r["report"]["failed"]
    message = r["error"]
    assert ":p0:r7" in message                              # the record's id
    assert "record payload sha256:" in message              # its payload's digest
    assert "killed by signal 11 (SIGSEGV)" in message       # how the worker died
    assert "errors.tolerance=none" in message


def test_crashes_count_against_the_tolerance_limits(results):
    r = results["limit-crashes"]
    assert r["out"] is None and r["report"]["failed"]
    assert "ToleranceExceededError" in r["error"] and "max.errors" in r["error"]
    assert r["report"]["by_category"].get("crash", 0) >= 2


# --- Spark Connect --------------------------------------------------------------------------


def connect_step(x):
    if x == 7:
        import ctypes

        ctypes.string_at(0)
    if x == 13:
        os._exit(3)
    return x * 10


@pytest.mark.slow
def test_over_spark_connect_killers_are_dead_lettered_per_row_and_through_a_udf(
        served, broker, tmp_path_factory):
    from spillway.spark import Job
    from support.connect import connect_session, running_connect_server

    address, _ = served
    topic = f"dlq.crash-connect-{uuid.uuid4().hex[:8]}"
    with running_connect_server(tmp_path_factory.mktemp("connect"), task_attempts=4,
                                env={"SPILLWAY_SIDECAR_ADDRESS": address}) as server, \
            connect_session(server) as spark:
        with Job(f"crash-connect-{uuid.uuid4().hex[:6]}", {
                "errors.tolerance": "all", "errors.deadletterqueue.topic.name": topic,
                "errors.deadletterqueue.context.headers.enable": "true",
                "errors.deadletterqueue.auto.create.topics.enable": "true",
                "errors.deadletterqueue.topic.replication.factor": "1"},
                sidecar=address) as job:
            df = spark.range(20).repartition(2)
            rows = job.map_partitions(df, lambda r: (connect_step(r.id),), schema="v long")
            assert sorted(r.v for r in rows.collect()) == expected(20, 7, 13)
            f = job.udf("long")(connect_step)
            out = [r.o for r in df.select(f("id").alias("o")).collect()]
            assert sorted(v for v in out if v is not None) == expected(20, 7, 13)
    assert job.report.by_category == {"crash": 4}
    letters = read_all(broker.bootstrap_servers, topic)
    assert sorted(m.value() for m in letters) == [b"13", b"7", b'{"id":13}', b'{"id":7}']
    assert {header_map(m)[CATEGORY] for m in letters} == {b"crash"}
