"""Sidecar telemetry: decision/spool/batch-produce spans and the KIP metric set, scraped over HTTP."""

from __future__ import annotations

import re
import time
import urllib.request

import grpc
import pytest
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from spillway.sidecar.embedded import free_port
from spillway.v1 import sidecar_pb2 as pb
from spillway.v1 import sidecar_pb2_grpc as pb_grpc

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
        "metrics.prometheus.port": str(port),
    })
    spans = InMemorySpanExporter()
    running.sidecar.telemetry.tracer_provider.add_span_processor(SimpleSpanProcessor(spans))
    yield running, spans, port
    running.stop(1.0)


def _report(address, job, topic, n, traceparent):
    with grpc.insecure_channel(address) as ch:
        stub = pb_grpc.ErrorSidecarStub(ch)
        stub.RegisterJob(pb.RegisterJobRequest(job=job, properties={
            "errors.tolerance": "all", "errors.deadletterqueue.topic.name": topic,
            "errors.deadletterqueue.auto.create.topics.enable": "true",
            "errors.deadletterqueue.topic.replication.factor": "1"}), timeout=20)
        task = pb.TaskIdentity(stage_id=2, partition_id=1, attempt_number=0, task_attempt_id=9)
        records = [pb.FailedRecord(
            record_id=f"r{i}", stage=pb.STAGE_TRANSFORMATION, function_name="app.f",
            value=b"x", exception=pb.ExceptionInfo(class_name="builtins.ValueError",
                                                   class_chain=["builtins.ValueError"]),
            traceparent=traceparent) for i in range(n)]
        out = stub.ReportFailures(pb.ReportFailuresRequest(job=job, task=task, records=records),
                                  timeout=10)
        stub.FlushTask(pb.FlushTaskRequest(job=job, task=task, processed=[
            pb.StageCount(stage=pb.STAGE_TRANSFORMATION, records=50)]), timeout=20)
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


def test_prometheus_endpoint_shows_kip_counters_with_job_stage_task(observed, topic_name):
    running, _, port = observed
    _report(running.address, "job-metrics", topic_name, 4, "")
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()

    def value(metric, **labels):
        for line in body.splitlines():
            if line.startswith(metric + "{") and all(f'{k}="{v}"' in line
                                                     for k, v in labels.items()):
                return float(line.rsplit(" ", 1)[1])
        raise AssertionError(f"{metric} {labels} not in scrape:\n" + "\n".join(
            ln for ln in body.splitlines() if ln.startswith("spillway_")))

    labels = {"job": "job-metrics", "stage": "TRANSFORMATION", "task": "2.1"}
    assert value("spillway_record_failures_total", **labels) == 4
    assert value("spillway_record_errors_total", **labels) == 4
    assert value("spillway_records_skipped_total", **labels) == 4
    assert value("spillway_errors_logged_total", **labels) == 4
    assert value("spillway_retries_total", **labels) == 0
    assert value("spillway_dlq_records_total", job="job-metrics") == 4
    assert re.search(r"^spillway_dlq_produce_requests_total(\{[^}]*\})? [1-9]", body, re.M)
    assert re.search(r"^spillway_spool_records(\{[^}]*\})? ", body, re.M)
    assert re.search(r'^spillway_verdict_duration_seconds_count\{[^}]*job="job-metrics"', body,
                     re.M)
