"""Driver-side pieces of `spillway.spark.Job` that need no Spark session."""

from __future__ import annotations

import pickle

import pytest
from spillway.client import ToleranceExceededError
from spillway.spark import Job
from spillway.spark.job import JobReport, _wrapper_name
from spillway.v1 import sidecar_pb2 as pb


def parse(row):
    return row


def test_wrapper_names_are_qualified_and_lambdas_do_not_collide():
    assert _wrapper_name(parse, None) == "test_spark_job.parse"
    assert _wrapper_name(parse, "mine") == "mine"
    first, second = (lambda r: r), (lambda r: r)  # noqa: E731 - same line: same name
    third = lambda r: r  # noqa: E731
    assert _wrapper_name(first, None) == _wrapper_name(second, None)
    assert _wrapper_name(first, None) != _wrapper_name(third, None)
    assert "@L" in _wrapper_name(third, None)


def test_failure_message_digs_the_spillway_error_out_of_sparks_wrapping():
    spark_text = (
        "An exception was thrown from the Python worker. Please see the stack trace below.\n"
        "Traceback (most recent call last):\n  File \"x.py\", line 1, in parse\n"
        "ValueError: bad\n\nThe above exception was the direct cause of ...\n"
        "spillway.client.errors.ToleranceExceededError: spillway job 'orders' failed in stage "
        "TRANSFORMATION: record orders/0/3 raised builtins.ValueError: bad; sidecar: job "
        "'orders' failed on its first error: errors.tolerance=none\n")
    msg = Job.failure_message(RuntimeError(spark_text))
    assert msg.startswith("ToleranceExceededError: spillway job 'orders' failed in stage "
                          "TRANSFORMATION") and msg.endswith("errors.tolerance=none")
    direct = ToleranceExceededError("spillway job 'j' failed")
    assert Job.failure_message(direct) == "ToleranceExceededError: spillway job 'j' failed"
    assert Job.failure_message(RuntimeError("\n  plain failure\nmore")) == "plain failure"


def test_job_settings_are_checked_on_the_driver_and_travel_pickled():
    with pytest.raises(ValueError, match="on_sidecar_unavailable"):
        Job("j", on_sidecar_unavailable="ignore")
    with pytest.raises(ValueError, match="name"):
        Job("  ")
    job = Job("orders", {"errors.tolerance": "all", "b": 1}, sidecar="10.0.0.2:50051")
    spec = pickle.loads(pickle.dumps(job.spec))
    assert spec == job.spec and spec.props == {"b": "1", "errors.tolerance": "all"}


def test_job_report_sums_sidecars():
    r = JobReport("j")
    r.add("a:1", pb.JobSummary(job="j", records_processed=10, total_record_failures=2,
                               by_stage=[pb.CountEntry(key="TRANSFORMATION", count=2)]))
    r.add("b:1", pb.JobSummary(job="j", failed=True, failure_reason="too many", records_processed=5,
                               by_stage=[pb.CountEntry(key="TRANSFORMATION", count=1),
                                         pb.CountEntry(key="TASK_PUT", count=4)]))
    assert (r.records_processed, r.total_record_failures, r.failed) == (15, 2, True)
    assert r.by_stage == {"TRANSFORMATION": 3, "TASK_PUT": 4}
    assert r.failure_reasons == ["too many"] and set(r.per_sidecar) == {"a:1", "b:1"}
    assert "per_sidecar" not in repr(r)


@pytest.mark.parametrize("call", [
    lambda job: job.map_partitions([1, 2], str),
    lambda job: job.map_in_pandas([1, 2], str, "id long"),
    lambda job: job.map_in_arrow({"a": 1}, str, "id long"),
    lambda job: job.deserialize([b"x"], value=bytes.decode),
    lambda job: job.foreach_partition([1, 2], print),
])
def test_misuse_outside_spark_gets_a_clear_error(call):
    job = Job("misuse", {"errors.tolerance": "all"}, sidecar="127.0.0.1:1")
    with pytest.raises(TypeError, match=r"expected a pyspark DataFrame"):
        call(job)


def test_failure_message_finds_the_exception_that_ended_the_python_traceback():
    text = ("An exception was thrown from the Python worker. Please see the stack trace below.\n"
            "Traceback (most recent call last):\n  File \"w.py\", line 9, in f\n    g()\n"
            "    ^^^\npyarrow.lib.ArrowInvalid: Could not convert 'abc' with type str: tried "
            "to convert to double\n\n\tat org.apache.spark.api.python.BasePythonRunner")
    assert Job.failure_message(RuntimeError(text)) == (
        "pyarrow.lib.ArrowInvalid: Could not convert 'abc' with type str: tried to convert to "
        "double")
    try:
        try:
            raise RuntimeError(text)
        except RuntimeError as inner:
            raise Exception("Job aborted due to stage failure") from inner
    except Exception as outer:
        assert Job.failure_message(outer).startswith("pyarrow.lib.ArrowInvalid")


def test_row_outputs_that_do_not_fit_the_schema_are_output_schema_errors():
    from pyspark.sql import Row
    from pyspark.sql.types import DoubleType, IntegerType, StructField, StructType

    from spillway.spark._schema import OutputSchemaError, row_checker

    check = row_checker(StructType([StructField("id", IntegerType()),
                                    StructField("amount", DoubleType())]), "TRANSFORMATION")
    assert check(Row(id=1, amount=2.5)) == {"id": 1, "amount": 2.5}
    assert check((1, 2)) == (1, 2)                  # an int for a double: Arrow takes it
    for bad, words in ((None, "output is None"), ({"id": "x", "amount": 1.0}, "field id"),
                       ((1,), "Length of object"), ("ab", "can not accept object 'ab'")):
        with pytest.raises(OutputSchemaError, match=words) as e:
            check(bad)
        assert str(e.value).startswith("TRANSFORMATION output does not fit") or bad is None


def test_udf_results_follow_sparks_own_conversion():
    from pyspark.sql.types import (ArrayType, DoubleType, IntegerType, StringType, StructField,
                                   StructType)

    from spillway.spark._schema import OutputSchemaError, value_checker

    def udf_check(dtype):
        return value_checker(dtype, "value", "TRANSFORMATION", exact=False)

    udf_check(StringType())(5)                            # Spark stores "5"
    udf_check(ArrayType(StringType()))([1, "a"])
    udf_check(StructType([StructField("n", IntegerType()), StructField("s", StringType())]))(
        {"n": 1, "s": 2.5})
    for dtype, bad in ((DoubleType(), 5), (IntegerType(), "7"), (IntegerType(), 2**40),
                       (ArrayType(IntegerType()), [1, "x"])):
        with pytest.raises(OutputSchemaError):          # Spark would make these a silent null
            udf_check(dtype)(bad)


def test_arrow_outputs_are_conformed_to_the_declared_schema_or_refused_naming_the_column():
    import pyarrow as pa
    from pyspark.sql.types import IntegerType, LongType, StructField, StructType

    from spillway.spark._schema import OutputSchemaError, arrow_conformer

    conform = arrow_conformer(StructType([StructField("id", LongType()),
                                          StructField("n", IntegerType())]), "TRANSFORMATION")
    swapped = pa.RecordBatch.from_arrays([pa.array(["2"]), pa.array([1])], names=["n", "id"])
    out = conform(swapped)                              # by name, cast where needed
    assert out.schema.names == ["id", "n"] and out.to_pylist() == [{"id": 1, "n": 2}]
    bad = pa.RecordBatch.from_arrays([pa.array([1]), pa.array(["x"])], names=["a", "b"])
    with pytest.raises(OutputSchemaError, match="column 'n'"):
        conform(bad)                                     # by position: "x" is no int
    with pytest.raises(OutputSchemaError, match="1 column"):
        conform(pa.RecordBatch.from_arrays([pa.array([1])], names=["a"]))


def test_the_runs_token_never_travels_pickled_nor_shows_in_a_repr():
    import dataclasses

    from spillway.client.runs import JobToken
    from spillway.spark._token import TokenFile

    job = Job("orders", {"errors.tolerance": "all"}, sidecar="10.0.0.2:50051", run_id="app-1")
    assert job.run_id == "app-1"
    spec = dataclasses.replace(job.spec, run_id="app-1", job_token=JobToken("s3cret-token"),
                               home="10.0.0.2:50051", home_instance_id="abc")
    assert "s3cret-token" not in repr(spec) and "s3cret-token" not in str(spec.run)
    with pytest.raises(TypeError, match="cannot be pickled.*as a Spark file"):
        pickle.dumps(spec)
    shipped = pickle.loads(pickle.dumps(dataclasses.replace(
        spec, job_token=TokenFile("spillway-jobtoken-x", "d"))))  # what executors get
    assert shipped.run_id == "app-1" and shipped.job_token == TokenFile("spillway-jobtoken-x", "d")
    with pytest.raises(ValueError, match="run_id"):
        Job("orders", run_id="  ")


def test_a_job_never_registered_closes_to_nothing():
    job = Job("orders", sidecar="10.0.0.2:50051")
    assert job.close() is None and job.report is None
