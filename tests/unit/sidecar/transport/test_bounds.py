"""Bounds on every request field and every numeric property (issue 11, "Bounds everywhere")."""

from __future__ import annotations

import pytest
from spillway.sidecar.core import config, names
from spillway.sidecar.core.model import JobSummary
from spillway.sidecar.core.settings import job_settings
from spillway.sidecar.errors import ConfigError
from spillway.sidecar.transport import validate as v
from spillway.sidecar.transport.convert import summary_to_pb
from spillway.sidecar.transport.status import MAX_DETAILS_CHARS, safe_details
from spillway.v1 import sidecar_pb2 as pb

# --- names ---------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["orders", "My ETL job", "a" * 200, "ünïcødé-job", "a.b:c/d@e"])
def test_good_job_names_pass_unchanged(name):
    assert names.check_job_name(name) == name


@pytest.mark.parametrize("name, words", [
    ("", "required"), ("   ", "required"), (" orders", "leading or trailing whitespace"),
    ("orders ", "leading or trailing whitespace"), ("orders\n", "leading or trailing"),
    ("a" * 201, "at most 200 characters"), ("é" * 130, "at most 255 bytes"),
    ("or\x00ders", "U+0000"), ("or\u202eders", "U+202E"), ("a\u2028b", "U+2028"),
])
def test_bad_job_names_are_refused_naming_the_field(name, words):
    with pytest.raises(ValueError) as e:
        names.check_job_name(name)
    assert str(e.value).startswith("job:") and words in str(e.value)
    assert len(str(e.value)) < 200


def test_the_settings_refuse_a_name_with_spaces_instead_of_trimming_it():
    with pytest.raises(ConfigError) as e:
        job_settings(" orders ", {})
    assert e.value.property == "job" and "whitespace" in str(e.value)


@pytest.mark.parametrize("run_id, ok", [
    ("", True), ("app-20231123102233-0001", True), ("local-1700000000000", True),
    ("application_1_0001", True), ("x" * 128, True), ("x" * 129, False), ("a b", False),
    ("a/b", False), ("ü", False)])
def test_run_ids(run_id, ok):
    if ok:
        assert names.check_run_id(run_id) == run_id
    else:
        with pytest.raises(ValueError, match="^run_id:"):
            names.check_run_id(run_id)


def test_record_ids_custom_stages_and_function_names_are_bounded():
    names.check_record_id("r" * names.MAX_RECORD_ID_BYTES)
    with pytest.raises(ValueError, match="record_id: at most 1024 bytes"):
        names.check_record_id("r" * (names.MAX_RECORD_ID_BYTES + 1))
    with pytest.raises(ValueError, match="record_id: at most 1024 bytes"):
        names.check_record_id("é" * 513)
    with pytest.raises(ValueError, match="required"):
        names.check_record_id("")
    with pytest.raises(ValueError, match="custom_stage: at most 128"):
        names.check_custom_stage("s" * 129)
    with pytest.raises(ValueError, match="function_name: at most 512"):
        names.check_function_name("f" * 513)
    with pytest.raises(ValueError, match="U\\+001B"):
        names.check_function_name("app.\x1b[31mf")


# --- request fields ------------------------------------------------------------------------

def _task(**kw):
    return pb.TaskIdentity(**{"stage_id": 1, "partition_id": 2, "task_attempt_id": 3, **kw})


def _record(**kw):
    fields = {"record_id": "r1", "stage": pb.STAGE_TRANSFORMATION,
              "exception": pb.ExceptionInfo(class_name="builtins.ValueError")}
    fields.update(kw)
    return pb.FailedRecord(**fields)


def _report(*records, **kw):
    return pb.ReportFailuresRequest(job="j", task=_task(), records=list(records), **kw)


def _refused(method, request, field, bound=None):
    with pytest.raises(ValueError) as e:
        v.check(method, request)
    msg = str(e.value)
    assert msg.startswith(field), msg
    if bound is not None:
        assert str(bound) in msg, msg
    assert len(msg) < 300, "the message names the bound, it does not echo the value"


def test_a_normal_request_of_every_method_passes():
    v.check("RegisterJob", pb.RegisterJobRequest(job="j", properties={"errors.tolerance": "all"}))
    v.check("ReportFailures", _report(_record(source=pb.SourceCoordinates(
        topic="t", partition=0, offset=5), headers=[pb.Header(key="h", value=b"v")],
        timestamp_ms=1_700_000_000_000, attempt=3, traceparent="00-" + "1" * 32 + "-"
        + "2" * 16 + "-01"), recovered_record_ids=["r0"]))
    v.check("FlushTask", pb.FlushTaskRequest(job="j", task=_task(), processed=[
        pb.StageCount(stage=pb.STAGE_SINK, records=10)]))
    v.check("GetJobSummary", pb.GetJobSummaryRequest(job="j", run_id="app-1"))
    v.check("GetStatus", pb.GetStatusRequest())
    v.check("GetStatus", pb.GetStatusRequest(job="j", page_size=100))
    v.check("EndJob", pb.EndJobRequest(job="j"))
    tally = pb.TallyRequest(job="j", run_id="app-1")
    report = tally.reports.add(task=_task(), record_ids=["r0", "r1"], payload_digests=bytes(16))
    report.groups.add(count=2, stage=pb.STAGE_TRANSFORMATION, function_name="app.f",
                      exception=pb.ExceptionInfo(class_name="builtins.ValueError"))
    v.check("TallyFailures", tally)


@pytest.mark.parametrize("method, request_", [
    ("RegisterJob", pb.RegisterJobRequest(job=" j")),
    ("ReportFailures", pb.ReportFailuresRequest(job="j ")),
    ("FlushTask", pb.FlushTaskRequest(job=" j")),
    ("GetJobSummary", pb.GetJobSummaryRequest(job="\tj")),
    ("GetStatus", pb.GetStatusRequest(job="j\n")),
    ("EndJob", pb.EndJobRequest(job=" j ")),
    ("TallyFailures", pb.TallyRequest(job=" j")),
])
def test_every_method_applies_the_job_name_rule(method, request_):
    _refused(method, request_, "job:", "whitespace")


def test_every_job_method_applies_the_run_id_rule():
    for req in (pb.RegisterJobRequest(job="j", run_id="a b"),
                pb.GetJobSummaryRequest(job="j", run_id="x" * 200),
                pb.EndJobRequest(job="j", run_id="\x00")):
        _refused(type(req).__name__.removesuffix("Request"), req, "run_id:")


def test_property_maps_are_bounded():
    _refused("RegisterJob", pb.RegisterJobRequest(
        job="j", properties={f"k{i}": "v" for i in range(v.MAX_PROPERTIES + 1)}),
        "properties:", v.MAX_PROPERTIES)
    _refused("RegisterJob", pb.RegisterJobRequest(
        job="j", properties={"errors.tolerance": "x" * 100_000}),
        "properties[errors.tolerance]:", v.MAX_PROPERTY_VALUE_CHARS)
    _refused("RegisterJob", pb.RegisterJobRequest(job="j", properties={"k" * 300: "v"}),
             "properties:", v.MAX_PROPERTY_KEY_CHARS)
    _refused("RegisterJob", pb.RegisterJobRequest(job="j", home="h" * 600), "home:")


@pytest.mark.parametrize("task, field", [
    (_task(stage_id=-1), "task.stage_id"), (_task(partition_id=-5), "task.partition_id"),
    (_task(attempt_number=-1), "task.attempt_number"),
    (_task(task_attempt_id=-1), "task.task_attempt_id"),
    (_task(host="h" * 300), "task.host"), (_task(executor_id="e" * 300), "task.executor_id"),
])
def test_task_identities_are_bounded(task, field):
    _refused("ReportFailures", pb.ReportFailuresRequest(job="j", task=task), field)
    _refused("FlushTask", pb.FlushTaskRequest(job="j", task=task), field)


@pytest.mark.parametrize("record, field, bound", [
    (_record(record_id="r" * 2000), "records[0].record_id", 1024),
    (_record(custom_stage="c" * 200, stage=pb.STAGE_CUSTOM), "records[0].custom_stage", 128),
    (_record(function_name="f" * 600), "records[0].function_name", 512),
    (_record(source=pb.SourceCoordinates(topic="t" * 250)), "records[0].source.topic", 249),
    (_record(source=pb.SourceCoordinates(topic="t", partition=-2)),
     "records[0].source.partition", None),
    (_record(source=pb.SourceCoordinates(topic="t", offset=-(2**63))),
     "records[0].source.offset", None),
    (_record(headers=[pb.Header(key="h")] * (v.MAX_HEADERS + 1)), "records[0].headers",
     v.MAX_HEADERS),
    (_record(headers=[pb.Header(key="k" * 2000)]), "records[0].headers[0].key", 1024),
    (_record(headers=[pb.Header(key="h", value=b"x" * (3 * 2**20))] * 2),
     "records[0].headers", v.MAX_HEADER_BYTES),
    (_record(timestamp_ms=2**63 - 1), "records[0].timestamp_ms", v.MAX_TIMESTAMP_MS),
    (_record(timestamp_ms=-(2**63)), "records[0].timestamp_ms", None),
    (_record(attempt=2**32 - 1), "records[0].attempt", v.MAX_ATTEMPT),
    (_record(traceparent="t" * 300), "records[0].traceparent", 256),
    (_record(tracestate="t" * 600), "records[0].tracestate", 512),
    (_record(exception=pb.ExceptionInfo(class_name="c" * 2000)),
     "records[0].exception.class_name", 1024),
    (_record(exception=pb.ExceptionInfo(class_name="E", message="m" * (v.MAX_MESSAGE_CHARS + 1))),
     "records[0].exception.message", v.MAX_MESSAGE_CHARS),
    (_record(exception=pb.ExceptionInfo(class_name="E",
                                        stack_trace="s" * (v.MAX_STACK_TRACE_CHARS + 1))),
     "records[0].exception.stack_trace", v.MAX_STACK_TRACE_CHARS),
    (_record(exception=pb.ExceptionInfo(class_name="E", class_chain=["E"] * 200)),
     "records[0].exception.class_chain", v.MAX_CLASS_CHAIN),
    (_record(exception=pb.ExceptionInfo(class_name="E", causes=["c"] * 100)),
     "records[0].exception.causes", v.MAX_CAUSES),
    (_record(exception=pb.ExceptionInfo(class_name="E", causes=["c" * 20_000])),
     "records[0].exception.causes[0]", v.MAX_CAUSE_CHARS),
    (_record(exception=pb.ExceptionInfo(class_name="E", kafka_error_code="K" * 100)),
     "records[0].exception.kafka_error_code", 64),
    (_record(exception=pb.ExceptionInfo(class_name="E", grpc_status_code=99)),
     "records[0].exception.grpc_status_code", 16),
    (_record(exception=pb.ExceptionInfo(class_name="E", http_status_code=-1)),
     "records[0].exception.http_status_code", 999),
])
def test_record_fields_are_bounded(record, field, bound):
    _refused("ReportFailures", _report(record), field, bound)


def test_record_counts_and_recovered_ids_are_bounded():
    _refused("ReportFailures", _report(*[_record()] * (v.MAX_RECORDS_PER_REPORT + 1)),
             "records:", v.MAX_RECORDS_PER_REPORT)
    _refused("ReportFailures", _report(recovered_record_ids=["r"] * (v.MAX_RECOVERED_IDS + 1)),
             "recovered_record_ids:", v.MAX_RECOVERED_IDS)
    _refused("FlushTask", pb.FlushTaskRequest(job="j", recovered_record_ids=["r" * 2000]),
             "recovered_record_ids[0]:", 1024)
    _refused("ReportFailures", _report(undo_dead_letter_record_ids=["r"] * 70_000),
             "undo_dead_letter_record_ids:", v.MAX_RECOVERED_IDS)


def test_every_request_field_is_covered_by_a_check():
    """A field added to the proto later must get a bound here too (or be listed as boundless:
    enums and bools, whose every value the servicer handles)."""
    import inspect
    src = inspect.getsource(v)
    boundless = {"decide_only", "progress_only", "local_only", "verdict_columns", "stage",
                 "payload",
                 "marker_category", "kafka_retriable", "kafka_fatal",
                 "kafka_txn_requires_abort", "exception", "source", "task", "key", "value",
                 "job", "run_id", "record_id", "records", "processed", "value",
                 # TallyReport.claim and .slice, SliceUse.id: any 64-bit value (0: none);
                 # SliceUse.used: any count (the home takes at most the slice's size)
                 "claim", "slice", "id", "used"}
    seen = set()

    def walk(desc):
        if desc.full_name in seen:
            return
        seen.add(desc.full_name)
        for f in desc.fields:
            if f.name not in boundless:
                assert f.name in src, f"{desc.name}.{f.name} has no bound in validate.py"
            if f.message_type is not None and not f.message_type.GetOptions().map_entry:
                walk(f.message_type)

    for name in ("RegisterJobRequest", "ReportFailuresRequest", "FlushTaskRequest",
                 "GetJobSummaryRequest", "GetStatusRequest", "EndJobRequest", "TallyRequest"):
        walk(pb.DESCRIPTOR.message_types_by_name[name])


def test_flush_counts_are_capped_per_call():
    _refused("FlushTask", pb.FlushTaskRequest(job="j", processed=[
        pb.StageCount(stage=pb.STAGE_SINK, records=2**64 - 1)]), "processed[0].records",
        v.MAX_PROCESSED_PER_ENTRY)
    _refused("FlushTask", pb.FlushTaskRequest(job="j", processed=[
        pb.StageCount(stage=pb.STAGE_SINK, records=1)] * (v.MAX_STAGE_COUNTS + 1)),
        "processed:", v.MAX_STAGE_COUNTS)
    v.check("FlushTask", pb.FlushTaskRequest(job="j", processed=[
        pb.StageCount(stage=pb.STAGE_SINK, records=v.MAX_PROCESSED_PER_ENTRY)]))


def test_status_paging_is_bounded():
    _refused("GetStatus", pb.GetStatusRequest(page_size=v.MAX_PAGE_SIZE + 1), "page_size",
             v.MAX_PAGE_SIZE)
    _refused("GetStatus", pb.GetStatusRequest(page_token="t" * 2000), "page_token", 1024)


def test_summaries_saturate_instead_of_overflowing_uint64():
    s = JobSummary(job="j", records_processed=2 * (2**64 - 1))
    s.by_stage["SINK"] = 2**70
    out = summary_to_pb(s, "sc")
    assert out.records_processed == 2**64 - 1
    assert out.by_stage[0].count == 2**64 - 1


# --- error details -------------------------------------------------------------------------

def test_error_details_are_short_and_single_line():
    d = safe_details("properties: " + "x" * 100_000 + "\n\x00\x1b[31m")
    assert len(d) == MAX_DETAILS_CHARS and d.endswith("[truncated]")
    assert safe_details("a\nb\x00\x7fc\r\n") == "a b c "


# --- numeric properties --------------------------------------------------------------------

_NUMERIC = [p for p in config.PROPERTIES.values()
            if p.parse.__qualname__.split(".")[0] in ("p_int", "p_float", "p_optional_int",
                                                      "p_optional_float")]


def test_every_numeric_property_has_an_upper_bound():
    assert len(_NUMERIC) >= 25
    for p in _NUMERIC:
        for huge in (str(2**64), "1e300", "9" * 5000):
            with pytest.raises(ConfigError) as e:
                p.parse(p.name, huge)
            assert e.value.property == p.name
            assert len(str(e.value)) < 300


@pytest.mark.parametrize("prop, value", [
    ("errors.retry.max.backoff.ms", str(2**64 + 1)),
    ("errors.retry.initial.backoff.ms", str(2**64)),
    ("errors.deadletterqueue.topic.partitions", str(2**31)),
    ("errors.retry.timeout", str(10**18)),
    ("errors.tolerance.max.errors", str(2**63)),
    ("errors.retry.backoff.multiplier", "1e30"),
])
def test_absurd_job_numbers_are_refused_naming_the_property(prop, value):
    with pytest.raises(ConfigError) as e:
        job_settings("j", {prop: value})
    assert e.value.property == prop and "must be in" in str(e.value)


def test_a_bad_exception_after_shared_good_ones_is_still_found():
    good = _record()
    bad = _record(record_id="r3", exception=pb.ExceptionInfo(
        class_name="E", class_chain=["E"] * 3, causes=["c" * 20_000]))
    _refused("ReportFailures", _report(good, _record(record_id="r2"), bad),
             "records[2].exception.causes[0]", v.MAX_CAUSE_CHARS)
    long_chain = _record(exception=pb.ExceptionInfo(class_name="E", stack_trace="s" * 5000,
                                                    class_chain=["x" * 1025]))
    _refused("ReportFailures", _report(good, long_chain), "records[1].exception.class_chain[0]",
             v.MAX_CLASS_NAME_CHARS)
