"""Sidecar telemetry: decision/spool/batch-produce spans and the KIP metric set, scraped over
HTTP."""

from __future__ import annotations

import re
import time
import urllib.request

import grpc
import pytest
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind
from support.ports import free_port
from spillway.v1 import sidecar_pb2 as pb
from spillway.v1 import sidecar_pb2_grpc as pb_grpc
from support.creds import admin_md, peer_md
from support import paths

pytestmark = pytest.mark.integration

EXECUTOR_TRACE = "0af7651916cd43dd8448eb211c80319c"
EXECUTOR_SPAN = "b7ad6b7169203331"


@pytest.fixture(scope="module")
def observed(broker, tmp_path_factory):
    from spillway.sidecar.server import start_server

    port = free_port()
    running = start_server({
        "listen.address": "127.0.0.1:0", "bootstrap.servers": broker.bootstrap_servers,
        "spool.dir": str(tmp_path_factory.mktemp("spool")), "producer.linger.ms": "5",
        "metrics.prometheus.port": str(port), "spool.max.records": "100000",
    })
    spans = InMemorySpanExporter()
    running.sidecar.telemetry.tracer_provider.add_span_processor(SimpleSpanProcessor(spans))
    yield running, spans, port
    running.stop(1.0)


def _report(address, job, topic, n, traceparent):
    with grpc.insecure_channel(address) as ch:
        stub = pb_grpc.ErrorSidecarStub(ch)
        reg = stub.RegisterJob(pb.RegisterJobRequest(job=job, run_id="run-1", properties={
            "errors.tolerance": "all", "errors.deadletterqueue.topic.name": topic,
            "errors.deadletterqueue.auto.create.topics.enable": "true",
            "errors.deadletterqueue.topic.replication.factor": "1"}), timeout=20)
        md = [("spillway-job-token", reg.job_token)]
        task = pb.TaskIdentity(stage_id=2, partition_id=1, attempt_number=0, task_attempt_id=9)
        records = [pb.FailedRecord(
            record_id=f"r{i}", stage=pb.STAGE_TRANSFORMATION, function_name="app.f",
            value=b"x", exception=pb.ExceptionInfo(class_name="builtins.ValueError",
                                                   class_chain=["builtins.ValueError"]),
            traceparent=traceparent) for i in range(n)]
        out = stub.ReportFailures(pb.ReportFailuresRequest(job=job, run_id="run-1", task=task,
                                                           records=records),
                                  timeout=10, metadata=md)
        stub.FlushTask(pb.FlushTaskRequest(job=job, run_id="run-1", task=task, processed=[
            pb.StageCount(stage=pb.STAGE_TRANSFORMATION, records=50)]), timeout=20, metadata=md)
        return out.verdicts


def test_decision_spool_and_batch_spans_link_each_record(observed, topic_name):
    running, spans, _ = observed
    spans.clear()
    tp = f"00-{EXECUTOR_TRACE}-{EXECUTOR_SPAN}-01"
    verdicts = _report(running.address, "job-traced", topic_name, 3, tp)
    assert all(v.dead_lettered for v in verdicts)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not any(
            s.kind == SpanKind.PRODUCER for s in spans.get_finished_spans()):
        time.sleep(0.05)
    finished = spans.get_finished_spans()
    decide = next(s for s in finished if s.name == "spillway.decide")
    assert decide.attributes["spillway.job"] == "job-traced"
    assert [e.attributes["spillway.action"] for e in decide.events] == ["SKIP"] * 3
    spool = next(s for s in finished if s.name == "spillway.spool")
    assert spool.parent.span_id == decide.context.span_id
    produce = [s for s in finished if s.kind == SpanKind.PRODUCER]
    assert sum(s.attributes["messaging.batch.message_count"] for s in produce) == 3
    assert all(s.attributes["messaging.system"] == "kafka" and
               s.attributes["messaging.destination.name"] == topic_name and
               "messaging.destination.partition.id" in s.attributes for s in produce)
    linked = [(f"{ln.context.trace_id:032x}", f"{ln.context.span_id:016x}")
              for s in produce for ln in s.links]
    assert linked == [(EXECUTOR_TRACE, EXECUTOR_SPAN)] * 3


def test_invalid_traceparent_is_replaced_by_the_decisions_context(observed, topic_name, broker):
    from support.kafka import read_all

    running, spans, _ = observed
    spans.clear()
    _report(running.address, "job-badtrace", topic_name, 1, "00-zzzz-not-a-traceparent")
    records = read_all(broker.bootstrap_servers, topic_name)
    tp = dict(records[0].headers())["traceparent"].decode()
    assert "zzzz" not in tp
    decide = next(s for s in spans.get_finished_spans() if s.name == "spillway.decide")
    ctx = decide.context
    assert tp == f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"


def _tally_call(address: str, job: str, reports: int) -> None:
    """One TallyFailures call of `reports` reports (2 records each) to a run homed at
    `address`, as a node sends it."""
    with grpc.insecure_channel(address) as ch:
        stub = pb_grpc.ErrorSidecarStub(ch)
        reg = stub.RegisterJob(pb.RegisterJobRequest(job=job, run_id="run-1", properties={
            "errors.tolerance": "all"}), timeout=20)
        req = pb.TallyRequest(job=job, run_id="run-1")
        for r in range(reports):
            rep = req.reports.add(task=pb.TaskIdentity(stage_id=1, partition_id=r),
                                  record_ids=[f"p{r}-{i}" for i in range(2)],
                                  payload_digests=bytes(16))
            rep.groups.add(count=2, stage=pb.STAGE_TRANSFORMATION,
                           exception=pb.ExceptionInfo(class_name="builtins.ValueError"))
        resp = stub.TallyFailures(req, timeout=10, metadata=[
            *peer_md(), ("spillway-job-token", reg.job_token)])
        assert [len(v.actions) for v in resp.reports] == [2] * reports


def test_a_homes_tally_records_a_decision_span_per_report_while_exported(observed):
    """A home decides a call's reports together (one hold of the run's lock, one journal
    slice), yet while spans are exported each report still gets its own decision span."""
    running, spans, _ = observed
    spans.clear()
    _tally_call(running.address, "job-tally-spans", 3)
    decided = [s for s in spans.get_finished_spans() if s.name == "spillway.decide"]
    assert sorted(s.attributes["spillway.task.id"] for s in decided) == ["1.0", "1.1", "1.2"]
    assert all(s.attributes["spillway.tally"] and s.attributes["spillway.records"] == 2
               for s in decided)


def test_a_sidecar_without_an_exporter_records_nothing_yet_propagates_valid_contexts(
        broker, tmp_path, topic_name):
    """No exporter: no span is recorded (`exported`), but a record's own trace context still
    goes into its DLQ headers as it came, and one without gets the decision's, unsampled."""
    from spillway.sidecar.server import start_server
    from support.kafka import read_all

    running = start_server({"listen.address": "127.0.0.1:0",
                            "bootstrap.servers": broker.bootstrap_servers,
                            "spool.dir": str(tmp_path / "spool"), "producer.linger.ms": "5"})
    try:
        assert not running.sidecar.telemetry.exporting()
        given = f"00-{EXECUTOR_TRACE}-{EXECUTOR_SPAN}-01"
        _report(running.address, "job-quiet", topic_name, 1, given)
        _report(running.address, "job-quiet-bad", topic_name, 1, "00-zzzz-not-a-traceparent")
        _tally_call(running.address, "job-quiet-tally", 2)   # decided without a span to drop
    finally:
        running.stop(1.0)
    headers = [dict(r.headers())["traceparent"].decode()
               for r in read_all(broker.bootstrap_servers, topic_name)]
    assert headers[0] == given
    assert re.fullmatch(r"00-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}", headers[1]), headers[1]
    assert not int(headers[1][-2:], 16) & 1      # the sampled flag: nothing was recorded


def _scrape(port: int) -> str:
    return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()


def test_prometheus_endpoint_shows_kip_counters_per_job_and_stage(observed, topic_name):
    running, _, port = observed
    _report(running.address, "job-metrics", topic_name, 4, "")
    body = _scrape(port)

    def value(metric, **labels):
        for line in body.splitlines():
            if line.startswith(metric + "{") and all(f'{k}="{v}"' in line
                                                     for k, v in labels.items()):
                return float(line.rsplit(" ", 1)[1])
        raise AssertionError(f"{metric} {labels} not in scrape:\n" + "\n".join(
            ln for ln in body.splitlines() if ln.startswith("spillway_")))

    labels = {"job": "job-metrics", "stage": "TRANSFORMATION"}
    assert value("spillway_record_failures_total", **labels) == 4
    assert value("spillway_record_errors_total", **labels) == 4
    assert value("spillway_records_skipped_total", **labels) == 4
    assert value("spillway_errors_logged_total", **labels) == 4
    assert value("spillway_retries_total", **labels) == 0
    assert value("spillway_dlq_records_total", job="job-metrics") == 4
    # epoch seconds, not milliseconds
    assert abs(value("spillway_last_error_timestamp_seconds", **labels) - time.time()) < 600
    assert 'task="' not in body  # no per-partition series unless asked for
    assert re.search(r"^spillway_dlq_produce_requests_total(\{[^}]*\})? [1-9]", body, re.M)
    assert re.search(r"^spillway_spool_records(\{[^}]*\})? ", body, re.M)
    # provisional verdicts' series, at zero on a sidecar that is every run's home
    assert re.search(r"^spillway_dlq_held(\{[^}]*\})? 0", body, re.M)
    assert re.search(r"^spillway_home_confirm_calls_total(\{[^}]*\})? 0", body, re.M)
    assert re.search(r"^spillway_verdict_duration_seconds_count [1-9]", body, re.M)
    # the buckets are in seconds: a verdict of this sidecar (decide + spool) takes well under
    # a second, so it is counted below the 1 s boundary (the old ms buckets put all in "5")
    buckets = {m.group(1): float(m.group(2)) for m in re.finditer(
        r'^spillway_verdict_duration_seconds_bucket\{le="([^"]+)"\} (\S+)', body, re.M)}
    assert list(buckets)[:3] == ["0.0001", "0.00025", "0.0005"] and list(buckets)[-1] == "+Inf"
    assert buckets["1.0"] > 0 and buckets["10.0"] <= buckets["+Inf"]


def test_the_spool_limits_and_kafkas_reachability_are_served_for_alerts(observed):
    """What deploy/monitoring's alerts compare with: the spool's high-water marks as
    configured, and the Kafka check's answer."""
    _, _, port = observed
    body = _scrape(port)
    served = dict(re.findall(r"^(spillway_\w+) (\S+)$", body, re.M))
    assert float(served["spillway_spool_records_limit"]) == 100_000
    assert float(served["spillway_spool_size_limit_bytes"]) == 512 * 1024 * 1024  # the default
    assert float(served["spillway_kafka_reachable"]) == 1


def _doc_table() -> dict[str, tuple[str, set[str]]]:
    """Prometheus name -> (kind, labels) from docs/OBSERVABILITY.md's metric table."""
    doc = (paths.DOCS / "OBSERVABILITY.md").read_text()
    out = {}
    for line in doc.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 6 and cells[2].startswith("`spillway_"):
            labels = set() if cells[4] == "—" else {x.strip() for x in cells[4].split(",")}
            out[cells[2].strip("`")] = (cells[3], labels)
    return out


def test_every_scraped_series_is_documented_with_its_labels(observed, topic_name):
    """docs/OBSERVABILITY.md against a real scrape: every family, its type and label names."""
    running, _, port = observed
    _report(running.address, "job-doc", topic_name, 1, "")
    body = _scrape(port)
    documented = _doc_table()
    types = dict(re.findall(r"^# TYPE (\S+) (\S+)$", body, re.M))
    assert set(types) == set(documented), (
        f"scraped but undocumented: {sorted(set(types) - set(documented))}; documented but "
        f"not scraped: {sorted(set(documented) - set(types))}")
    seen: dict[str, set[str]] = {}
    for m in re.finditer(r"^(spillway_\w+?)(_bucket|_count|_sum)?(?:\{([^}]*)\})? \S+$", body,
                         re.M):
        family = m.group(1) if m.group(1) in types else m.group(1) + (m.group(2) or "")
        labels = set(re.findall(r'(\w+)="', m.group(3) or "")) - {"le"}
        seen.setdefault(family, set()).update(labels)
    for family, (kind, labels) in documented.items():
        assert types[family] == kind, f"{family}: scraped {types[family]}, documented {kind}"
        assert seen.get(family, set()) == labels, (
            f"{family}: scraped labels {seen.get(family)}, documented {labels}")


def test_series_of_a_released_job_disappear(observed, topic_name):
    running, _, port = observed
    _report(running.address, "job-gone", topic_name, 1, "")
    assert 'job="job-gone"' in _scrape(port)
    with grpc.insecure_channel(running.address) as ch:  # the run ends: its state is released
        pb_grpc.ErrorSidecarStub(ch).EndJob(pb.EndJobRequest(job="job-gone", run_id="run-1"),
                                            timeout=20, metadata=admin_md())   # the operator
    body = _scrape(port)
    assert 'job="job-gone"' not in body and "spillway_jobs_ended_total 1" in body
