"""KIP-1033 error handlers: the last word on a record whose retries are exhausted.

A handler gets an `ErrorHandlerContext` and answers CONTINUE (skip the record; tolerance limits
still apply) or FAIL (the job fails). ``errors.handler.class`` selects it:

- unset: follows ``errors.tolerance`` (none → LogAndFail, all → LogAndContinue);
- ``LogAndContinue`` / ``LogAndFail`` (also the Kafka names ``LogAndContinueExceptionHandler``,
  ``LogAndFailExceptionHandler``, any case): the built-ins;
- ``package.module:Class`` or ``package.module.Class``: a user class, imported with importlib
  when the job registers, built with no arguments, then given the job's effective properties
  through ``configure(properties)`` if it has that method (Kafka's ``Configurable``).

The "Log" of the built-ins is the KIP-298 error log: one structured line per error when
``errors.log.enable=true`` (the engine writes it for every error, whatever the handler).

A handler is called with the job's lock held, one call at a time per job, so a user handler
need not be thread-safe (KIP-1033 likewise runs one handler instance per task thread). A handler
that raises, or answers anything but CONTINUE / FAIL, fails the job (KIP-1033 "handler
crashes"); the reason names the handler and its exception.
"""

from __future__ import annotations

import enum
import importlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from ..errors import ConfigError, HandlerError
from .model import Category, ExceptionInfo, FailedRecord, Header


class HandlerResponse(enum.Enum):
    CONTINUE = "CONTINUE"
    FAIL = "FAIL"


@dataclass(frozen=True, slots=True)
class ErrorHandlerContext:
    """KIP-1033's ErrorHandlerContext for one failed record (metadata, no processing API).

    ``topic`` is None, ``partition`` and ``offset`` are -1 when the record did not come from
    Kafka. ``timestamp`` is the source record's timestamp, else the wall-clock ms at which the
    sidecar received the report. ``processor_node_id`` is the failing user function's name.
    """

    job: str
    record_id: str
    topic: str | None
    partition: int
    offset: int
    headers: tuple[Header, ...]
    processor_node_id: str
    task_id: str
    timestamp: int
    stage: str
    exception: ExceptionInfo
    category: Category
    attempt: int
    reason: str                 # why the record reached the handler
    record: FailedRecord        # key, value and headers as reported (KIP-1033 passes the record)


@runtime_checkable
class ErrorHandler(Protocol):
    def handle(self, context: ErrorHandlerContext) -> HandlerResponse: ...


class LogAndContinue:
    """KIP-1033 built-in: skip the record (tolerance limits still apply)."""

    name = "LogAndContinue"

    def handle(self, context: ErrorHandlerContext) -> HandlerResponse:
        return HandlerResponse.CONTINUE


class LogAndFail:
    """KIP-1033 built-in: fail the job on the record."""

    name = "LogAndFail"

    def handle(self, context: ErrorHandlerContext) -> HandlerResponse:
        return HandlerResponse.FAIL


_BUILTINS: dict[str, type[LogAndContinue] | type[LogAndFail]] = {
    "logandcontinue": LogAndContinue,
    "logandcontinueexceptionhandler": LogAndContinue,
    "log-and-continue": LogAndContinue,
    "logandfail": LogAndFail,
    "logandfailexceptionhandler": LogAndFail,
    "log-and-fail": LogAndFail,
}


_FIXED = {LogAndContinue: HandlerResponse.CONTINUE, LogAndFail: HandlerResponse.FAIL}


@dataclass(frozen=True, slots=True)
class LoadedHandler:
    handler: ErrorHandler
    name: str                   # what reasons call it
    derived: bool               # True: errors.handler.class unset, chosen by errors.tolerance
    # A built-in's answer, which never depends on the context: the engine then need not build
    # one. None for user classes.
    fixed: HandlerResponse | None = None


def is_builtin(spec: str) -> bool:
    return spec.strip().lower() in _BUILTINS


def builtin_kind(spec: str) -> str | None:
    cls = _BUILTINS.get(spec.strip().lower())
    return cls.name if cls else None


def split_spec(spec: str) -> tuple[str, str]:
    """'pkg.mod:Cls' or 'pkg.mod.Cls' -> ('pkg.mod', 'Cls'); ConfigError when malformed."""
    spec = spec.strip()
    if ":" in spec:
        module, _, attr = spec.partition(":")
    else:
        module, _, attr = spec.rpartition(".")
    if not module or not attr or any(not part.isidentifier()
                                      for part in (*module.split("."), *attr.split("."))):
        raise ConfigError("errors.handler.class", (
            f"expected LogAndContinue, LogAndFail, or a class as package.module:Class or "
            f"package.module.Class; got {spec!r}"))
    return module, attr


def load_handler(spec: str, tolerance_mode: str,
                 properties: Mapping[str, str] | None = None) -> LoadedHandler:
    """Resolve ``errors.handler.class`` to a handler instance; ConfigError naming the property."""
    spec = spec.strip()
    if not spec:
        cls = LogAndFail if tolerance_mode == "none" else LogAndContinue
        return LoadedHandler(cls(), cls.name, derived=True, fixed=_FIXED[cls])
    builtin = _BUILTINS.get(spec.lower())
    if builtin is not None:
        return LoadedHandler(builtin(), builtin.name, derived=False, fixed=_FIXED[builtin])
    module_name, attr = split_spec(spec)
    try:
        obj: object = importlib.import_module(module_name)
    except Exception as exc:
        raise ConfigError("errors.handler.class",
                          f"cannot import module {module_name!r} of {spec!r}: "
                          f"{type(exc).__name__}: {exc}") from exc
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ConfigError("errors.handler.class",
                              f"module {module_name!r} has no attribute {attr!r}") from None
    if not callable(obj):
        raise ConfigError("errors.handler.class", f"{spec!r} is not a class")
    try:
        handler = obj()
    except Exception as exc:
        raise ConfigError("errors.handler.class",
                          f"cannot construct {spec!r} with no arguments: "
                          f"{type(exc).__name__}: {exc}") from exc
    if not callable(getattr(handler, "handle", None)):
        raise ConfigError("errors.handler.class",
                          f"{spec!r} has no handle(context) method (KIP-1033 handler contract)")
    configure = getattr(handler, "configure", None)
    if callable(configure):
        try:
            configure(dict(properties or {}))
        except Exception as exc:
            raise ConfigError("errors.handler.class",
                              f"{spec!r}.configure() raised {type(exc).__name__}: {exc}") from exc
    return LoadedHandler(handler, spec, derived=False)


def invoke(loaded: LoadedHandler, context: ErrorHandlerContext) -> HandlerResponse:
    """Call the handler; HandlerError (from its exception) when it crashes or answers nonsense."""
    try:
        answer = loaded.handler.handle(context)
    except Exception as exc:
        raise HandlerError(
            f"errors.handler.class={loaded.name} raised {type(exc).__name__}: {exc} "
            f"while handling record {context.record_id!r}") from exc
    response = _normalize(answer)
    if response is None:
        raise HandlerError(
            f"errors.handler.class={loaded.name} returned {answer!r} for record "
            f"{context.record_id!r}; expected HandlerResponse.CONTINUE or FAIL")
    return response


def _normalize(answer: object) -> HandlerResponse | None:
    if isinstance(answer, HandlerResponse):
        return answer
    name = answer if isinstance(answer, str) else getattr(answer, "name", None)
    if isinstance(name, str):
        try:
            return HandlerResponse(name.strip().upper())
        except ValueError:
            return None
    return None
