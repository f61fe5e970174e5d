"""The ErrorSidecar service's method handlers, built so that no request can fail inside grpc.

grpc's generated registration deserializes in grpc's own code: an undecodable request then
answers INTERNAL ("Exception deserializing request!"). Here each method takes the raw bytes and
parses them itself, answering INVALID_ARGUMENT "request is not a valid spillway.v1.X: ..." on
failure; then refuses sidecar-only fields from callers that are not peer sidecars
(`security.check_sidecar_only`, against the caller the authentication interceptor established)
and checks the request's bounds (`validate`), so servicer code only ever sees a
well-formed, bounded request. The servicer's context is wrapped so every abort's details are
cut and cleaned (`status.safe_details`). Otherwise each method behaves as grpc's generated
handler would: unary-unary, the same serializer, server interceptors (authentication,
OpenTelemetry) wrap it as usual since they are passed to `grpc.server`.
"""

from __future__ import annotations

import logging

import grpc
from spillway.sidecar.transport import security, validate
from spillway.sidecar.transport.status import abort, safe_details
from spillway.v1 import sidecar_pb2 as pb

log = logging.getLogger("spillway.sidecar")

SERVICE = pb.DESCRIPTOR.services_by_name["ErrorSidecar"]


class SafeContext:
    """A servicer context whose abort/set_details never send an unbounded detail."""

    __slots__ = ("_ctx",)

    def __init__(self, ctx) -> None:
        self._ctx = ctx

    def abort(self, code, details=""):
        return self._ctx.abort(code, safe_details(details))

    def set_details(self, details) -> None:
        self._ctx.set_details(safe_details(details))

    def __getattr__(self, name):
        return getattr(self._ctx, name)


def _behaviour(method_name: str, fn, request_cls):
    full = request_cls.DESCRIPTOR.full_name

    def handle(raw: bytes, context):
        try:
            request = request_cls.FromString(raw)
        except Exception as exc:  # DecodeError, or anything else the parser raises
            abort(context, grpc.StatusCode.INVALID_ARGUMENT,
                  f"request is not a valid {full}: {type(exc).__name__}: {exc}")
        try:  # the interceptor authenticated the caller; the request is only readable here
            security.check_sidecar_only(request)
        except security.Refused as exc:
            log.info("refused: %s", exc)
            abort(context, exc.code, exc)
        try:
            validate.check(method_name, request)
        except ValueError as exc:
            abort(context, grpc.StatusCode.INVALID_ARGUMENT, exc)
        return fn(request, SafeContext(context))

    handle.__name__ = method_name
    return handle


def _raw(data: bytes) -> bytes:
    return data


def generic_handler(servicer) -> grpc.GenericRpcHandler:
    """The handler for every method of spillway.v1.ErrorSidecar, served by `servicer`."""
    handlers = {}
    for method in SERVICE.methods:
        request_cls = getattr(pb, method.input_type.name)
        response_cls = getattr(pb, method.output_type.name)
        handlers[method.name] = grpc.unary_unary_rpc_method_handler(
            _behaviour(method.name, getattr(servicer, method.name), request_cls),
            request_deserializer=_raw,
            response_serializer=response_cls.SerializeToString,
        )
    return grpc.method_handlers_generic_handler(SERVICE.full_name, handlers)


def add_servicer(servicer, server: grpc.Server) -> None:
    """Use instead of `add_ErrorSidecarServicer_to_server`."""
    server.add_generic_rpc_handlers((generic_handler(servicer),))
