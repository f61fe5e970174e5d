"""Pure helpers that turn a Python exception and its record into a ``spillway.v1.FailedRecord``.

Nothing here talks to the network. Classification *hints* are extracted by duck typing, so the
client never imports confluent_kafka, requests or any HTTP library:

- gRPC: ``exc.code()`` returning a ``grpc.StatusCode``;
- HTTP: ``exc.status_code``, ``exc.status``, ``exc.response.status_code`` (first int in 100..599);
- confluent-kafka: a KafkaError (``retriable()``, ``fatal()``, ``txn_requires_abort()`` and its
  ``name()``, the code KIP-1050's table classifies) carried as ``exc.args[0]`` by the exception
  or, when it wraps one, by the first exception of its cause chain that carries one;
- spillway markers (`spillway.client.markers`): ``marker_category``.

The W3C trace context of the given (or current) OpenTelemetry context goes on each record, only
when its span context is valid.
"""

from __future__ import annotations

import builtins
from collections.abc import Iterable, Mapping
from typing import Any

import grpc
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from spillway.v1 import sidecar_pb2 as pb

# the stack-trace formatting lives in _stack; these names stay importable from here
from ._stack import STACK_CACHE_SIZE, StackCache, format_stack_trace, stack_cache  # noqa: F401
from .markers import marker_category_name

# --- stages and categories -----------------------------------------------------------------

#: Stage names accepted wherever a stage is given: the proto names with or without the STAGE_
#: prefix, and the KIP-298 names the sidecar writes to DLQ headers (TASK_PUT, KAFKA_PRODUCE).
STAGE_ALIASES: Mapping[str, int] = {
    **{name.removeprefix("STAGE_"): value for name, value in pb.Stage.items()},
    **dict(pb.Stage.items()),
    "TASK_PUT": pb.STAGE_SINK,
    "KAFKA_PRODUCE": pb.STAGE_PRODUCE,
}

CATEGORY_BY_NAME: Mapping[str, int] = {
    "retriable": pb.CATEGORY_RETRIABLE,
    "refresh-retriable": pb.CATEGORY_REFRESH_RETRIABLE,
    "abortable": pb.CATEGORY_ABORTABLE,
    "application-recoverable": pb.CATEGORY_APPLICATION_RECOVERABLE,
    "invalid-configuration": pb.CATEGORY_INVALID_CONFIGURATION,
    "data": pb.CATEGORY_DATA,
    "crash": pb.CATEGORY_CRASH,
    "timeout": pb.CATEGORY_TIMEOUT,
}


_STAGE_VALUES = frozenset(v for v in pb.Stage.values() if v != pb.STAGE_UNSPECIFIED)


def stage_value(stage: int | str) -> int:
    """The ``spillway.v1.Stage`` value of ``stage`` (an enum value or a name, see STAGE_ALIASES)."""
    if type(stage) is int and stage in _STAGE_VALUES:
        return stage
    if isinstance(stage, int) and not isinstance(stage, bool):
        if stage in pb.Stage.values() and stage != pb.STAGE_UNSPECIFIED:
            return stage
    elif isinstance(stage, str) and stage.strip().upper() in STAGE_ALIASES:
        value = STAGE_ALIASES[stage.strip().upper()]
        if value != pb.STAGE_UNSPECIFIED:
            return value
    allowed = sorted(n for n in STAGE_ALIASES if not n.startswith("STAGE_") and n != "UNSPECIFIED")
    raise ValueError(f"stage: unknown stage {stage!r}; allowed: {', '.join(allowed)}")


def stage_name(stage: int | str) -> str:
    """The short proto name of a stage, e.g. ``TRANSFORMATION`` or ``SINK``."""
    return pb.Stage.Name(stage_value(stage)).removeprefix("STAGE_")


# --- names ---------------------------------------------------------------------------------


def qualified_name(obj: Any) -> str:
    """``module.QualName`` of a class or function; builtins keep their module
    (``builtins.ValueError``).

    Instances are named by their class; callables without ``__qualname__`` (partials, callable
    objects) by their class, or by the wrapped function for ``functools.partial``.
    """
    func = getattr(obj, "func", None)  # functools.partial
    if func is not None and callable(func) and not hasattr(obj, "__qualname__"):
        return qualified_name(func)
    target = obj if isinstance(obj, type) or hasattr(obj, "__qualname__") else type(obj)
    module = getattr(target, "__module__", None) or builtins.__name__
    qual = getattr(target, "__qualname__", None) or getattr(target, "__name__", repr(target))
    return f"{module}.{qual}"


# --- classification hints ------------------------------------------------------------------


def grpc_status_code(exc: BaseException) -> int | None:
    code_fn = getattr(exc, "code", None)
    if not callable(code_fn):
        return None
    try:
        code = code_fn()
    except Exception:
        return None
    return code.value[0] if isinstance(code, grpc.StatusCode) else None


def _http_status(value: Any) -> int | None:
    if isinstance(value, int) and not isinstance(value, bool) and 100 <= value <= 599:
        return value
    return None


def http_status_code(exc: BaseException) -> int | None:
    for value in (getattr(exc, "status_code", None), getattr(exc, "status", None)):
        if (status := _http_status(value)) is not None:
            return status
    response = getattr(exc, "response", None)
    if response is not None:
        for attr in ("status_code", "status"):
            if (status := _http_status(getattr(response, attr, None))) is not None:
                return status
    return None


def _flag(obj: Any, name: str) -> bool | None:
    fn = getattr(obj, name, None)
    if not callable(fn):
        return None
    try:
        value = fn()
    except Exception:
        return None
    return value if isinstance(value, bool) else None


def _carried_kafka_error(obj: BaseException) -> Any:
    args = getattr(obj, "args", None)
    for cand in ((args[0], obj) if args else (obj,)):
        if callable(getattr(cand, "retriable", None)) and callable(getattr(cand, "fatal", None)):
            return cand
    return None


def kafka_error(exc: BaseException) -> Any:
    """The confluent-kafka KafkaError ``exc`` carries (a KafkaException's ``args[0]``), else
    the first one carried along its cause chain (an error raised ``from`` a KafkaException),
    by duck typing; None if there is none."""
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        found = _carried_kafka_error(cur)
        if found is not None:
            return found
        nxt = cur.__cause__
        if nxt is None and not cur.__suppress_context__:
            nxt = cur.__context__
        cur = nxt
    return None


def kafka_flags(exc: BaseException, err: Any = None) -> tuple[bool | None, bool | None,
                                                               bool | None]:
    """(retriable, fatal, txn_requires_abort) of a confluent-kafka error, by duck typing."""
    err = kafka_error(exc) if err is None else err
    if err is None:
        return None, None, None
    return _flag(err, "retriable"), _flag(err, "fatal"), _flag(err, "txn_requires_abort")


MAX_KAFKA_CODE_CHARS = 64    # librdkafka's names are under 40 characters


def kafka_error_code(exc: BaseException, err: Any = None) -> str | None:
    """``KafkaError.name()`` (e.g. ``NOT_LEADER_FOR_PARTITION``) of the Kafka error ``exc``
    carries (see `kafka_error`), for the sidecar's KIP-1050 code table."""
    err = kafka_error(exc) if err is None else err
    fn = getattr(err, "name", None) if err is not None else None
    if not callable(fn):
        return None
    try:
        name = fn()
    except Exception:
        return None
    return name[:MAX_KAFKA_CODE_CHARS] if isinstance(name, str) and name else None


def causes(exc: BaseException) -> list[str]:
    """The cause chain (``__cause__``, else ``__context__`` unless suppressed), outermost first."""
    out: list[str] = []
    seen = {id(exc)}
    cur: BaseException | None = exc
    while cur is not None:
        nxt = cur.__cause__
        if nxt is None and not cur.__suppress_context__:
            nxt = cur.__context__
        if nxt is None or id(nxt) in seen:
            break
        seen.add(id(nxt))
        out.append(f"{qualified_name(type(nxt))}: {nxt}")
        cur = nxt
    return out


_class_chains: dict[type, tuple[str, list[str]]] = {}


def _class_names(cls: type) -> tuple[str, list[str]]:
    names = _class_chains.get(cls)
    if names is None:
        chain = [qualified_name(c) for c in cls.__mro__ if c is not object]
        names = (qualified_name(cls), chain[:MAX_CLASS_CHAIN])
        if len(_class_chains) < 4096:
            _class_chains[cls] = names
    return names


# --- exceptions that carry no classification hint ----------------------------------------
#
# The hints above are found by duck typing: for the usual failure (a ValueError, a
# JSONDecodeError) every one of those lookups misses, and a missed getattr raises and swallows an
# AttributeError inside — several per failed record. An exception whose class defines none of
# the attributes they read (nor a custom attribute lookup), whose own __dict__ holds none of them
# either, whose first argument is a plain value and which has no cause chain to follow carries
# no hint: those lookups are skipped, with the same answer.

_HINT_ATTRS = frozenset(("code", "status_code", "status", "response", "retriable", "fatal",
                         "txn_requires_abort", "name"))
_PLAIN_ARGS = frozenset((str, int, float, bool, bytes, type(None)))
_hintless_classes: dict[type, bool] = {}


def hintless(exc: BaseException) -> bool:
    """Whether ``exc`` carries no classification hint (see above): its `exception_fields` are
    its class, message, trace and causes (and a marker's category), nothing looked up."""
    cls = type(exc)
    plain = _hintless_classes.get(cls)
    if plain is None:
        plain = (not any(hasattr(cls, a) for a in _HINT_ATTRS)
                 and not hasattr(cls, "__getattr__")
                 and cls.__getattribute__ is BaseException.__getattribute__)
        if len(_hintless_classes) < 4096:
            _hintless_classes[cls] = plain
    if not plain:
        return False
    attrs = exc.__dict__
    if attrs and not _HINT_ATTRS.isdisjoint(attrs):
        return False
    args = exc.args
    if args and type(args[0]) not in _PLAIN_ARGS:
        return False
    return exc.__cause__ is None and (exc.__suppress_context__ or exc.__context__ is None)


# The sidecar refuses longer texts (INVALID_ARGUMENT naming the field): cut them here, saying so.
MAX_MESSAGE_CHARS = 64 * 1024
MAX_STACK_TRACE_CHARS = 256 * 1024
MAX_CAUSES = 64
MAX_CAUSE_CHARS = 16 * 1024
MAX_CLASS_CHAIN = 128
_CUT = "... [cut by spillway]"


def _head(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit - len(_CUT)] + _CUT


def _tail(text: str, limit: int) -> str:
    """The end of a stack trace (the innermost frames and the exception line) is kept."""
    return text if len(text) <= limit else "[cut by spillway] ..." + text[-(limit - 21):]


def exception_fields(exc: BaseException) -> dict[str, Any]:
    """The fields of ``exc``'s ExceptionInfo (only those that are set), as keyword arguments:
    protobuf builds a nested message from them faster than it copies a built one in."""
    class_name, class_chain = _class_names(type(exc))
    fields: dict[str, Any] = {
        "class_name": class_name,
        "class_chain": class_chain,
        "message": _head(str(exc), MAX_MESSAGE_CHARS),
        "stack_trace": _tail(format_stack_trace(exc), MAX_STACK_TRACE_CHARS),
    }
    if exc.__cause__ is not None or exc.__context__ is not None:
        chain = causes(exc)
        if chain:
            fields["causes"] = [_head(c, MAX_CAUSE_CHARS) for c in chain[:MAX_CAUSES]]
    if hintless(exc):
        if (marker := marker_category_name(exc)) is not None:
            fields["marker_category"] = CATEGORY_BY_NAME[marker]
        return fields
    if (code := grpc_status_code(exc)) is not None:
        fields["grpc_status_code"] = code
    if (status := http_status_code(exc)) is not None:
        fields["http_status_code"] = status
    if (kerr := kafka_error(exc)) is not None:
        retriable, fatal, txn_abort = kafka_flags(exc, kerr)
        if (code := kafka_error_code(exc, kerr)) is not None:
            fields["kafka_error_code"] = code
    else:
        retriable = fatal = txn_abort = None
    if retriable is not None:
        fields["kafka_retriable"] = retriable
    if fatal is not None:
        fields["kafka_fatal"] = fatal
    if txn_abort is not None:
        fields["kafka_txn_requires_abort"] = txn_abort
    if (marker := marker_category_name(exc)) is not None:
        fields["marker_category"] = CATEGORY_BY_NAME[marker]
    return fields


def exception_info(exc: BaseException) -> pb.ExceptionInfo:
    return pb.ExceptionInfo(**exception_fields(exc))


# --- trace context -------------------------------------------------------------------------

_W3C = TraceContextTextMapPropagator()


_last_context: tuple[Context | None, tuple[str, str]] = (None, ("", ""))


def trace_context(context: Context | None = None) -> tuple[str, str]:
    """(traceparent, tracestate) of ``context`` (default: the current one); empty when invalid.

    The last explicit context's answer is kept: a task reports every failure under the same
    one (contexts are immutable)."""
    global _last_context
    if context is not None:
        last = _last_context  # one read: another thread may replace it
        if last[0] is context:
            return last[1]
    if not trace.get_current_span(context).get_span_context().is_valid:
        out = ("", "")
    else:
        carrier: dict[str, str] = {}
        _W3C.inject(carrier, context=context)
        out = (carrier.get("traceparent", ""), carrier.get("tracestate", ""))
    if context is not None:
        _last_context = (context, out)
    return out


def extract_context(traceparent: str, tracestate: str = "") -> Context:
    """An OpenTelemetry context whose parent span is the given W3C trace context."""
    carrier = {"traceparent": traceparent}
    if tracestate:
        carrier["tracestate"] = tracestate
    return _W3C.extract(carrier)


# --- the record ----------------------------------------------------------------------------


def as_bytes(value: Any) -> bytes | None:
    if value is None:
        return None
    if isinstance(value, bytes):
        return value
    if isinstance(value, (bytearray, memoryview)):
        return bytes(value)
    if isinstance(value, str):
        return value.encode("utf-8")
    raise TypeError(f"expected bytes or str, got {type(value).__name__}")


def failed_record(
    record_id: str,
    stage: int | str,
    exc: BaseException,
    *,
    custom_stage: str = "",
    function_name: str = "",
    source: tuple[str, int, int] | None = None,
    key: bytes | str | None = None,
    value: bytes | str | None = None,
    headers: Iterable[tuple[str, bytes | str | None]] = (),
    timestamp_ms: int | None = None,
    attempt: int = 1,
    context: Context | None = None,
    payload: int | str | None = None,
) -> pb.FailedRecord:
    """A FailedRecord for ``exc``; ``source`` is (topic, partition, offset) of a Kafka record.

    ``payload`` says what ``key``/``value`` are: ``"source"`` (the source record as read, e.g.
    in a deserialization stage) or ``"stage-input"`` (the failing stage's input, e.g. a row as
    JSON); unset, the sidecar treats them as the stage's input. `spillway dlq redrive` sends
    only source payloads back to their source topic."""
    stage_v = checked_stage(record_id, stage, custom_stage)
    traceparent, tracestate = trace_context(context)
    # keyword construction, defaults left out (setting a proto3 scalar to its default is the
    # same as not setting it; `optional` fields and `source` are set only when given)
    fields: dict[str, Any] = {
        "record_id": record_id,
        "stage": stage_v,
        "exception": exception_fields(exc),
        "attempt": max(1, int(attempt)),
    }
    if custom_stage:
        fields["custom_stage"] = custom_stage
    if function_name:
        fields["function_name"] = function_name
    if traceparent:
        fields["traceparent"] = traceparent
    if tracestate:
        fields["tracestate"] = tracestate
    hs = [{"key": k, "value": as_bytes(v)} if v is not None else {"key": k} for k, v in headers]
    if hs:
        fields["headers"] = hs
    if source is not None:
        topic, partition, offset = source
        fields["source"] = {"topic": topic, "partition": int(partition), "offset": int(offset)}
    if (k := as_bytes(key)) is not None:
        fields["key"] = k
    if (v := as_bytes(value)) is not None:
        fields["value"] = v
    if timestamp_ms is not None:
        fields["timestamp_ms"] = int(timestamp_ms)
    if payload is not None:
        fields["payload"] = payload_value(payload)
    return pb.FailedRecord(**fields)


def checked_stage(record_id: str, stage: int | str, custom_stage: str) -> int:
    """The stage value of a failed record, after the checks every record passes: a record id,
    and a name with stage CUSTOM (ValueError naming the argument)."""
    if not record_id:
        raise ValueError("record_id: a stable, non-empty record id is required")
    stage_v = stage_value(stage)
    if stage_v == pb.STAGE_CUSTOM and not custom_stage:
        raise ValueError("custom_stage: required with stage CUSTOM")
    return stage_v


_PAYLOADS: dict[Any, int] = {"source": pb.PAYLOAD_SOURCE, "stage-input": pb.PAYLOAD_STAGE_INPUT,
                             pb.PAYLOAD_SOURCE: pb.PAYLOAD_SOURCE,
                             pb.PAYLOAD_STAGE_INPUT: pb.PAYLOAD_STAGE_INPUT}


def payload_value(payload: Any) -> int:
    """The Payload value of ``payload`` ("source", "stage-input" or the enum value)."""
    try:
        return _PAYLOADS[payload]
    except KeyError:
        raise ValueError(f"payload: expected 'source' or 'stage-input', got {payload!r}") \
            from None
