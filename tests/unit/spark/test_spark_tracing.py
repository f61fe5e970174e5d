"""Executor-side tracing (`spillway.spark._tracing`). Each case runs in a fresh interpreter, as an
executor's Python worker would be: the global TracerProvider can only be set once per process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest
from support.otlp import OtlpReceiver

RUN_A_PARTITION = textwrap.dedent("""
    import json, sys
    from spillway.client import SidecarClient
    from spillway.sidecar.server import start_server
    from spillway.spark._adapters import RowAdapter, row_units
    from spillway.spark._engine import Engine, StageRef
    from spillway.spark._runtime import JobSpec, TaskSession, WrapperSpec
    from spillway.v1 import sidecar_pb2 as pb
    from opentelemetry import trace

    sidecar = start_server({"listen.address": "127.0.0.1:0"})
    spec = JobSpec("traced", (("errors.tolerance", "all"),))
    stage = StageRef.of("TRANSFORMATION")
    parent = sys.argv[1] if len(sys.argv) > 1 else ""
    wrapper = WrapperSpec("w", stage, "app.parse", traceparent=parent)
    session = TaskSession(spec, wrapper, task=pb.TaskIdentity(partition_id=4, task_attempt_id=9),
                          client=SidecarClient(sidecar.address))
    seen = []
    report = session.report
    def recording(records):
        seen.extend(r.traceparent for r in records)
        return report(records)
    session.report = recording

    def parse(x):
        if x == 2:
            raise ValueError("poison 2")
        return x

    engine = Engine(session, RowAdapter(parse, ids=lambda i: f"r{i}"), stage=stage,
                    function_name="app.parse")
    out = list(engine.run(row_units(range(4))))
    ctx = session.span.get_span_context()
    session.close(True)
    sidecar.stop(0.5)
    print(json.dumps({"out": out, "traceparents": seen,
                      "span": [format(ctx.trace_id, "032x"), format(ctx.span_id, "016x"),
                               ctx.trace_flags.sampled],
                      "provider": type(trace.get_tracer_provider()).__module__}))
""")


def _run(env: dict[str, str], *args: str, code: str = RUN_A_PARTITION) -> dict:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    out = subprocess.run([sys.executable, "-c", code, *args], env={**clean, **env},
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_installs_an_sdk_provider_so_reports_carry_the_partition_span():
    got = _run({})
    assert got["out"] == [0, 1, 3]
    assert got["provider"].startswith("opentelemetry.sdk.trace")
    trace_id, span_id, sampled = got["span"]
    assert sampled
    [tp] = got["traceparents"]
    assert tp.split("-")[1:3] == [trace_id, span_id]


def test_sampler_from_the_environment_and_sdk_disabled():
    got = _run({"OTEL_TRACES_SAMPLER": "always_off"})
    trace_id, _, sampled = got["span"]
    assert not sampled and int(got["traceparents"][0].split("-")[3], 16) & 1 == 0
    got = _run({"OTEL_SDK_DISABLED": "true"})
    assert got["traceparents"] == [""] and not got["provider"].startswith("opentelemetry.sdk")


def test_an_application_provider_is_left_alone():
    code = ("from opentelemetry import trace\n"
            "from opentelemetry.sdk.trace import TracerProvider\n"
            "from opentelemetry.sdk.resources import Resource\n"
            "mine = TracerProvider(resource=Resource.create({'service.name': 'mine'}))\n"
            "trace.set_tracer_provider(mine)\n"
            "from spillway.spark import _tracing\n"
            "_tracing.ensure_provider()\n"
            "import json; print(json.dumps({'same': trace.get_tracer_provider() is mine}))\n")
    assert _run({}, code=code) == {"same": True}


def test_spans_are_exported_over_otlp_only_when_an_endpoint_is_set_and_join_the_driver_trace():
    receiver = OtlpReceiver().start()
    try:
        driver_trace, driver_span = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"
        got = _run({"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint,
                    "OTEL_EXPORTER_OTLP_INSECURE": "true", "OTEL_SERVICE_NAME": "executor-test"},
                   f"00-{driver_trace}-{driver_span}-01")
        def stage_spans():
            return [s for s in receiver.trace(driver_trace) if s.name.startswith("spillway.TR")]

        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not stage_spans():
            time.sleep(0.1)
        [span] = stage_spans()
        clients = {s.name: s for s in receiver.trace(driver_trace) if s.kind == 3}  # CLIENT
    finally:
        receiver.stop()
    assert span.name == "spillway.TRANSFORMATION app.parse"
    # the sidecar calls of the partition are CLIENT spans under it, in the same trace
    assert {"spillway.v1.ErrorSidecar/RegisterJob", "spillway.v1.ErrorSidecar/ReportFailures",
            "spillway.v1.ErrorSidecar/FlushTask"} <= set(clients)
    report_span = clients["spillway.v1.ErrorSidecar/ReportFailures"]
    assert report_span.parent_span_id == span.span_id
    assert report_span.attributes["rpc.grpc.status_code"] == 0
    assert span.parent_span_id == driver_span and span.service == "executor-test"
    assert [tp.split("-")[2] for tp in got["traceparents"]] == [span.span_id]
    [(name, attrs)] = span.events
    assert name == "exception" and attrs["exception.type"] == "builtins.ValueError"
    assert attrs["spillway.record_id"] == "r2"
    assert span.attributes["spillway.failures"] == 1
    assert span.attributes["spark.partition_id"] == 4


@pytest.mark.parametrize("env", [{}, {"OTEL_EXPORTER_OTLP_PROTOCOL": "thrift"}])
def test_no_exporter_without_an_endpoint_or_with_an_unknown_protocol(env):
    code = ("from spillway.spark import _tracing\n"
            "_tracing.ensure_provider()\n"
            "import json; print(json.dumps({'exporting': _tracing._state['exporting']}))\n")
    endpoint = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:1"} if env else {}
    assert _run({**env, **endpoint}, code=code) == {"exporting": False}
