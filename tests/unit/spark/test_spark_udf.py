"""The UDF wrapper's per-row function, off Spark, against the real sidecar servicer in-process
(a fake TaskContext stands in for Spark's task attempts)."""

from __future__ import annotations

import uuid

import pytest

from spillway.client import RetriableError
from spillway.spark import _runtime, _taskinfo, _tracing, _udf as udf_module
from spillway.spark._engine import StageRef
from spillway.spark._plan import WrapperPlan
from spillway.spark._runtime import WrapperSpec
from spillway.spark._udf import udf_function as _udf_function
from spillway.spark.job import Job
from support.native import skip_without_a_c_compiler
from support.spark import FakeTaskContext


@pytest.fixture(scope="module")
def sidecar(tmp_path_factory):
    from spillway.sidecar.server import start_server

    running = start_server({"listen.address": "127.0.0.1:0",
                            "spool.dir": str(tmp_path_factory.mktemp("spool"))})
    yield running
    running.stop(0.5)


@pytest.fixture(autouse=True, params=["native", "python"])
def per_row_function(request, monkeypatch):
    """Every test runs with the per-row function in C (`_udfcall.Call`, when built) and in
    Python (what an executor without the extension runs)."""
    if request.param == "native":
        if udf_module._NativeCall is None:
            pytest.skip("spillway-spark was installed without its C extension (no C compiler)")
    else:
        monkeypatch.setattr(udf_module, "_NativeCall", None)
    return request.param


@pytest.fixture(autouse=True)
def executor_like(monkeypatch):
    monkeypatch.setattr(_runtime, "_worker", None)
    monkeypatch.setattr(_tracing, "ensure_provider", lambda: None)
    monkeypatch.setattr(udf_module, "_udf_states", {})
    monkeypatch.setattr(udf_module, "TaskContext", FakeTaskContext)
    monkeypatch.setattr(_taskinfo, "_task_context", FakeTaskContext.get)
    monkeypatch.setattr(FakeTaskContext, "_taskContext", FakeTaskContext(tid=1))


def _job(sidecar, **kw):
    """A registered run, as the driver makes it: its spec carries the run id and job token."""
    job = Job(f"udf-{uuid.uuid4().hex[:8]}", {"errors.tolerance": "all",
                                             "errors.retry.timeout": "10000",
                                             "errors.retry.initial.backoff.ms": "10"},
              sidecar=sidecar.address, **kw)
    job.register()
    return job


def _spec(sidecar, **kw):
    return _job(sidecar, **kw).spec


def _wrapper(name="to_int", use="1"):
    return WrapperSpec(name, StageRef.of("TRANSFORMATION"), f"app.{name}", use=use)


def _to_int(s):
    return int(s)


def test_one_argument_functions_take_the_fast_path_and_others_pack_args():
    assert udf_module.single_argument(_to_int)
    assert not udf_module.single_argument(int)  # no signature: generic path
    assert not udf_module.single_argument(lambda a, b=1: a)
    assert not udf_module.single_argument(lambda *a: a)


@pytest.mark.parametrize("fn", [int, _to_int], ids=["generic", "one-argument"])
def test_failures_become_null_or_an_error_struct_and_are_reported(sidecar, fn):
    job = _job(sidecar)
    spec = job.spec
    plain = _udf_function(WrapperPlan(spec, _wrapper()), fn, False)
    assert [plain(v) for v in ("1", "x", "3")] == [1, None, 3]
    with_error = _udf_function(WrapperPlan(spec, _wrapper("to_int_err")), fn, True)
    assert with_error("7") == (7, None)
    value, error = with_error("y")
    assert value is None
    record_id, stage, exc_class, message, reason, dead_lettered = error
    # the use: the wrapper call's number and the Spark stage the UDF runs in
    assert record_id == f"TRANSFORMATION:{spec.name}/to_int_err#1s1:p0:r1"
    assert (stage, exc_class, dead_lettered) == ("TRANSFORMATION", "builtins.ValueError", False)
    assert "invalid literal" in message and reason.startswith("skipped")
    summary = job.summary()
    assert summary.total_record_failures == 2 and summary.total_records_skipped == 2


def test_a_transient_failure_is_retried_in_place(sidecar):
    job = _job(sidecar)
    spec = job.spec
    calls = []

    def flaky(v):
        calls.append(v)
        if len(calls) == 1:
            raise RetriableError("busy")
        return v * 2

    assert _udf_function(WrapperPlan(spec, _wrapper("flaky")), flaky, False)(21) == 42
    assert calls == [21, 21]
    assert job.summary().total_retries == 1


def test_rows_of_finished_tasks_are_counted_without_any_call_until_due(sidecar):
    job = _job(sidecar, counts_interval_s=0)
    fn = _udf_function(WrapperPlan(job.spec, _wrapper()), int, False)
    for v in range(5):
        fn(str(v))
    assert job.summary().records_processed == 0  # nothing sent while the task runs
    FakeTaskContext._taskContext = FakeTaskContext(tid=2, partition=1)
    fn("9")  # the next task's first row retires the first task: its 5 rows are sent (due)
    assert job.summary().records_processed == 5


def test_the_same_udf_twice_in_a_task_shares_one_row_count(sidecar):
    spec = _spec(sidecar)
    a = _udf_function(WrapperPlan(spec, _wrapper()), int, True)
    b = _udf_function(WrapperPlan(spec, _wrapper()), int, True)
    ids = [a("x")[1][0], b("y")[1][0]]
    assert ids == [f"TRANSFORMATION:{spec.name}/to_int#1s1:p0:r0",
                   f"TRANSFORMATION:{spec.name}/to_int#1s1:p0:r1"]


def test_a_udf_called_outside_a_spark_task_raises_instead_of_a_silent_none(sidecar):
    FakeTaskContext._taskContext = None                  # what a direct call sees
    fn = _udf_function(WrapperPlan(_spec(sidecar), _wrapper()), _to_int, False)
    with pytest.raises(RuntimeError, match="called outside a Spark task"):
        fn("x")
    with pytest.raises(RuntimeError, match="called outside a Spark task"):
        fn("1")


def test_a_result_that_does_not_fit_the_return_type_is_a_reported_failure(sidecar):
    from pyspark.sql.types import IntegerType

    from spillway.spark._schema import value_checker

    job = _job(sidecar)
    spec = job.spec
    check = value_checker(IntegerType(), "value", "TRANSFORMATION", exact=False)
    fn = _udf_function(WrapperPlan(spec, _wrapper("size")),
                       lambda s: "many" if s == "b" else len(s), True, check=check)
    assert fn("aa") == (2, None)
    value, error = fn("b")
    assert value is None
    assert error[2] == "spillway.spark._schema.OutputSchemaError"
    assert "TRANSFORMATION output does not fit the declared type int" in error[3]
    # the inlined fast test lets a fitting int and None through, never an int out of range
    big = _udf_function(WrapperPlan(spec, _wrapper("big")),
                        lambda s: None if s == "n" else 1 << (8 * len(s)), True, check=check)
    assert big("n") == (None, None)
    assert big("aaa") == (1 << 24, None)
    value, error = big("aaaa")
    assert value is None and "does not fit the declared type int" in error[3]
    summary = job.summary()
    assert summary.by_category == {"data": 2}


def test_the_extension_is_built_where_a_c_compiler_and_pythons_headers_are():
    """`make test` installs spillway-spark with its extension on a machine that can build it
    (a silent fallback would only show in the benchmarks)."""
    skip_without_a_c_compiler()
    from spillway.spark import _udfcall  # noqa: F401 - the import is the check


def test_the_per_row_function_is_the_extensions_only_where_it_can_be(per_row_function):
    fn = _udf_function(WrapperPlan(object(), _wrapper()), _to_int, False)
    assert (type(fn).__name__ == "Call") == (per_row_function == "native")


def test_the_environment_turns_the_extension_off_where_the_udf_is_made(per_row_function,
                                                                        monkeypatch):
    """SPILLWAY_NO_EXTENSIONS=udfcall: the Python per-row function even where the extension
    was built (bench target 3 runs both side by side); an unknown name is refused by name."""
    monkeypatch.setenv("SPILLWAY_NO_EXTENSIONS", "udfcall")
    fn = _udf_function(WrapperPlan(object(), _wrapper()), _to_int, False)
    assert type(fn).__name__ == "function"
    monkeypatch.setenv("SPILLWAY_NO_EXTENSIONS", "all, udfcal")
    with pytest.raises(ValueError, match="udfcal"):
        _udf_function(WrapperPlan(object(), _wrapper()), _to_int, False)


def test_the_udf_pickles_as_its_arguments_and_runs_after_unpickling(sidecar, per_row_function,
                                                                    monkeypatch, tmp_path):
    """Spark ships a UDF to its executors with cloudpickle: the native function is rebuilt
    from its arguments there, in C where the executor has the extension, else in Python. The
    run's job token is not among them: it is read from the Spark file the driver shipped."""
    from pyspark import cloudpickle
    from support.spark_files import ship_to

    ship_to(monkeypatch, tmp_path)
    job = _job(sidecar)
    fn = _udf_function(WrapperPlan(job._shipped_spec(None), _wrapper()), _to_int, True)
    shipped = cloudpickle.dumps(fn)
    assert job.spec.job_token.reveal().encode() not in shipped
    again = cloudpickle.loads(shipped)
    assert type(again) is type(fn)
    assert again("5") == (5, None)
    assert again("z")[1][0] == f"TRANSFORMATION:{job.spec.name}/to_int#1s1:p0:r1"
    monkeypatch.setattr(udf_module, "_NativeCall", None)   # an executor without the extension
    python = cloudpickle.loads(shipped)
    assert type(python).__name__ == "function" and python("6") == (6, None)
    assert job.summary().total_record_failures == 1


def test_functools_wraps_the_per_row_function_as_spark_names_it(sidecar):
    import functools

    fn = functools.update_wrapper(
        _udf_function(WrapperPlan(_spec(sidecar), _wrapper()), _to_int, False), _to_int)
    assert fn.__name__ == "_to_int" and fn.__wrapped__ is _to_int
    assert fn("4") == 4


def test_an_interrupt_is_not_a_record_failure(sidecar):
    job = _job(sidecar)

    def interrupted(v):
        raise KeyboardInterrupt

    fn = _udf_function(WrapperPlan(job.spec, _wrapper()), interrupted, False)
    with pytest.raises(KeyboardInterrupt):
        fn("1")
    assert job.summary().total_record_failures == 0


def test_several_columns_and_no_result_check(sidecar):
    job = _job(sidecar)
    fn = _udf_function(WrapperPlan(job.spec, _wrapper()), lambda a, b: int(a) + int(b), True)
    assert fn("1", "2") == (3, None)
    value, error = fn("1", "x")
    assert value is None and error[2] == "builtins.ValueError"
    assert job.summary().total_record_failures == 1


def test_named_arguments_are_refused_clearly(sidecar, per_row_function):
    fn = _udf_function(WrapperPlan(_spec(sidecar), _wrapper()), _to_int, False)
    with pytest.raises(TypeError):
        fn(s="1")


def test_the_happy_path_keeps_no_reference_to_its_results(sidecar):
    import sys

    class Result:
        pass

    out = Result()
    fn = _udf_function(WrapperPlan(_spec(sidecar), _wrapper()), lambda v: out, True)
    fn("warm")
    before = sys.getrefcount(out)
    for _ in range(1000):
        fn("x")
    assert sys.getrefcount(out) == before


@pytest.mark.parametrize("fn, args", [(_to_int, ["arg"]), (lambda a, b: a, [])],
                         ids=["one-argument", "several"])
def test_pyspark_reads_the_per_row_functions_signature_without_a_warning(sidecar, fn, args):
    """pyspark chooses a UDF's evaluation type from ``getfullargspec`` of the function (and
    warns when it cannot read one): the native function answers as the Python one does."""
    import inspect
    import warnings

    from pyspark.sql.functions import udf
    from pyspark.sql.types import IntegerType

    call = _udf_function(WrapperPlan(_spec(sidecar), _wrapper()), fn, False)
    assert inspect.getfullargspec(call).args == args
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        udf(call, IntegerType())
