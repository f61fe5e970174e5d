"""The sidecar's gRPC server spans (telemetry.ServerSpans): a sampled call gets a SERVER span
continuing the caller's trace; an unsampled one gets none, and nothing under it is sampled."""

from __future__ import annotations

from collections import namedtuple

import grpc
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ParentBased, TraceIdRatioBased
from opentelemetry.trace import SpanKind, StatusCode
from spillway.sidecar.observability.telemetry import ServerSpans
from spillway.sidecar.transport import security

TRACE = "0af7651916cd43dd8448eb211c80319c"
SPAN = "b7ad6b7169203331"
METHOD = "/spillway.v1.ErrorSidecar/ReportFailures"
Md = namedtuple("Md", "key value")


class Context:
    """The part of grpc's servicer context the span reads (a call's metadata, peer, status)."""

    def __init__(self, metadata=()):
        self._md = tuple(Md(k, v) for k, v in metadata)
        self._code = self._details = None

    def invocation_metadata(self):
        return self._md

    def peer(self):
        return "ipv4:127.0.0.1:51234"

    def abort(self, code, details):
        self._code, self._details = code, details
        raise Exception()  # what grpc's abort raises

    def code(self):
        return self._code

    def details(self):
        return self._details


def _setup(sampler):
    tp = TracerProvider(sampler=sampler)
    spans = InMemorySpanExporter()
    tp.add_span_processor(SimpleSpanProcessor(spans))
    inner = tp.get_tracer("test")

    def servicer(request, context):
        with inner.start_as_current_span("spillway.decide"):
            if request == "abort":
                context.abort(grpc.StatusCode.INTERNAL, "broken")
            if request == "raise":
                raise ValueError("bad")
            return "ok"

    return ServerSpans(tp).wrap(METHOD, servicer, False), spans


def test_a_sampled_parent_gives_a_server_span_in_its_trace_with_the_rpc_attributes():
    call, spans = _setup(ParentBased(ALWAYS_OFF))  # roots never: only the parent samples
    assert call("x", Context([("traceparent", f"00-{TRACE}-{SPAN}-01"),
                              ("user-agent", "grpc-python/1")])) == "ok"
    server = next(s for s in spans.get_finished_spans() if s.kind == SpanKind.SERVER)
    decide = next(s for s in spans.get_finished_spans() if s.name == "spillway.decide")
    assert server.name == METHOD
    assert f"{server.context.trace_id:032x}" == TRACE
    assert f"{server.parent.span_id:016x}" == SPAN
    assert decide.parent.span_id == server.context.span_id
    assert dict(server.attributes) == {
        "rpc.system": "grpc", "rpc.grpc.status_code": 0, "rpc.method": "ReportFailures",
        "rpc.service": "spillway.v1.ErrorSidecar", "rpc.user_agent": "grpc-python/1",
        "net.peer.ip": "127.0.0.1", "net.peer.port": "51234", "net.peer.name": "localhost"}


@pytest.mark.parametrize("metadata", [
    [("traceparent", f"00-{TRACE}-{SPAN}-00")],   # the caller did not sample
    [],                                           # no context; the root sampler says no
])
def test_an_unsampled_call_records_no_span_and_nothing_under_it(metadata):
    call, spans = _setup(ParentBased(TraceIdRatioBased(0.0)))
    assert call("x", Context(metadata)) == "ok"
    assert spans.get_finished_spans() == ()


def test_an_abort_sets_the_status_and_an_exception_is_recorded():
    call, spans = _setup(ParentBased(TraceIdRatioBased(1.0)))
    with pytest.raises(Exception):
        call("abort", Context())
    server = next(s for s in spans.get_finished_spans() if s.kind == SpanKind.SERVER)
    assert server.attributes["rpc.grpc.status_code"] == grpc.StatusCode.INTERNAL.value[0]
    assert server.status.status_code == StatusCode.ERROR
    assert not server.events  # an abort is a status, not an exception
    spans.clear()
    with pytest.raises(ValueError):
        call("raise", Context())
    server = next(s for s in spans.get_finished_spans() if s.kind == SpanKind.SERVER)
    assert [e.name for e in server.events] == ["exception"]


def test_authentication_runs_before_the_span_and_a_refused_call_has_none():
    tp = TracerProvider()
    exported = InMemorySpanExporter()
    tp.add_span_processor(SimpleSpanProcessor(exported))
    seen = []

    class Refusing:
        def authenticate(self, method, metadata, identities, peer):
            seen.append(method)
            raise security.Refused(grpc.StatusCode.UNAUTHENTICATED, "no token")

    auth = Refusing()
    handler = grpc.unary_unary_rpc_method_handler(lambda req, ctx: "reached")
    details = namedtuple("D", "method invocation_metadata")(METHOD, ())
    inner = grpc.method_handlers_generic_handler("spillway.v1.ErrorSidecar",
                                                 {"ReportFailures": handler})
    served = security.Authenticating([inner], auth, around=ServerSpans(tp).wrap)
    wrapped = served.service(details)
    assert served.service(details) is wrapped   # built once
    other = namedtuple("D", "method invocation_metadata")("/x.Y/Z", ())
    assert served.service(other) is None and seen == []   # grpc answers UNIMPLEMENTED
    ctx = Context()
    ctx.auth_context = lambda: {}
    with pytest.raises(Exception):
        wrapped.unary_unary("x", ctx)
    assert seen == [METHOD] and ctx.code() == grpc.StatusCode.UNAUTHENTICATED
    assert exported.get_finished_spans() == ()
