"""Target 6's trace backend (`bench.otlp_sink`) is a real OTLP/gRPC receiver: an SDK exporter's
spans reach it, and it counts them."""

from __future__ import annotations

import re
import signal
import subprocess
import sys

from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor

from support import paths

REPO = paths.ROOT


def test_the_sink_receives_and_counts_exported_spans():
    proc = subprocess.Popen([sys.executable, "-m", "bench.otlp_sink", "--listen", "127.0.0.1:0"],
                            cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        m = re.search(r"listening on (\S+)", proc.stdout.readline())
        assert m, "the sink did not start"
        tp = TracerProvider()
        tp.add_span_processor(SimpleSpanProcessor(
            OTLPSpanExporter(endpoint=f"http://{m.group(1)}", insecure=True, timeout=10)))
        tracer = tp.get_tracer("t")
        for name in ("a", "b", "c"):
            tracer.start_span(name).end()
        tp.shutdown()
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
        assert out.strip().splitlines()[-1] == "spans 3"
    finally:
        if proc.poll() is None:
            proc.kill()
