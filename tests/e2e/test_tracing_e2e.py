"""One trace from the failing stage to the DLQ write, received by a real OTLP/gRPC receiver.

The demo job runs as `make run` runs it (Tansu, the sidecar as its own process, local Spark);
every process exports to the receiver through the standard OTEL_* variables.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from support.kafka import read_all
from support.otlp import OtlpReceiver

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.e2e]


@pytest.fixture
def receiver():
    r = OtlpReceiver().start()
    yield r
    r.stop()


def test_every_dlq_record_resolves_to_its_whole_trace(tmp_path, broker, receiver):
    topic = "dlq.e2e-traced"
    out = tmp_path / "summary.json"
    env = {**os.environ,
           "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint,
           "OTEL_EXPORTER_OTLP_INSECURE": "true",
           "OTEL_TRACES_SAMPLER": "parentbased_always_on",
           "OTEL_BSP_SCHEDULE_DELAY": "200",
           "OTEL_METRIC_EXPORT_INTERVAL": "1000"}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "demo_job.py"), "--records", "200",
         "--bootstrap-servers", broker.bootstrap_servers, "--dlq-topic", topic,
         "--json-summary", str(out)],
        capture_output=True, text=True, timeout=240, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    job = json.loads(out.read_text())["job"]
    records = [m for m in read_all(broker.bootstrap_servers, topic)
               if dict(m.headers()).get("spillway.job") == job.encode()]
    assert records

    def missing():
        problems = []
        produce_links = {ln for s in receiver.spans if s.kind == 4  # SPAN_KIND_PRODUCER
                         for ln in s.links}
        for m in records:
            _, trace_id, span_id, _ = dict(m.headers())["traceparent"].decode().split("-")
            spans = receiver.trace(trace_id)
            names = {s.name for s in spans}
            stage = [s for s in spans if s.name.startswith("spillway.TRANSFORMATION")
                     and s.span_id == span_id]
            if not stage or not any(e[0] == "exception" and
                                    e[1].get("exception.type", "").endswith("JSONDecodeError")
                                    for e in stage[0].events):
                problems.append(f"{m.key()}: no stage span {span_id} with exception event")
            if not any(s.kind == 3 and "ReportFailures" in s.name for s in spans):  # CLIENT
                problems.append(f"{m.key()}: no gRPC client span")
            if not any(s.kind == 2 and "ReportFailures" in s.name for s in spans):  # SERVER
                problems.append(f"{m.key()}: no gRPC server span")
            if "spillway.decide" not in names:
                problems.append(f"{m.key()}: no decision span")
            if (trace_id, span_id) not in produce_links:
                problems.append(f"{m.key()}: no batch produce span links to it")
        return problems

    deadline = time.monotonic() + 30  # exporters flush on their own schedule
    while (problems := missing()) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not problems, "\n".join(problems[:10])
    assert "spillway.record.failures" in receiver.metric_names
