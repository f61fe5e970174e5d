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

User classes are operator-owned code (`HandlerRules`): a job may name only a class on the
sidecar's ``errors.handler.allowed.classes`` list (or the sidecar's own default handler);
anything else is refused before anything is imported. A user handler (its construction,
``configure`` and every ``handle``) runs on a small pool of its own daemon threads
(``errors.handler.pool.size``) with a time limit (``errors.handler.timeout.ms``): one that does
not answer in time counts as a handler crash, and when every pool thread is still held by a
handler that never returned, further calls are refused at once (also a crash), so a blocking
handler can neither hang a gRPC worker nor keep the process from stopping.
"""

from __future__ import annotations

import enum
import importlib
import queue
import threading
from collections.abc import Callable, Iterable, Mapping
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


ALLOWED_PROP = "errors.handler.allowed.classes"
TIMEOUT_PROP = "errors.handler.timeout.ms"
POOL_PROP = "errors.handler.pool.size"


class _Call:
    __slots__ = ("fn", "args", "done", "result", "error")

    def __init__(self, fn: Callable, args: tuple) -> None:
        self.fn, self.args = fn, args
        self.done = threading.Event()
        self.result: object = None
        self.error: BaseException | None = None


class HandlerRunner:
    """Runs user handler code on `size` daemon threads with a time limit per call.

    At most `size` calls are in flight: a call that times out keeps its thread (Python cannot
    stop it) and its slot until it returns, so `size` handlers that never return make every
    further call fail at once with a clear reason instead of queueing forever. Daemon threads:
    a handler stuck forever never keeps the sidecar from exiting.
    """

    def __init__(self, timeout_s: float = 5.0, size: int = 4) -> None:
        self.timeout_s = timeout_s
        self.size = size
        self._slots = threading.BoundedSemaphore(size)
        self._queue: queue.SimpleQueue[_Call] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()

    def _worker(self) -> None:
        while True:
            call = self._queue.get()
            try:
                call.result = call.fn(*call.args)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                call.error = exc
            finally:
                call.done.set()
                self._slots.release()

    def call(self, what: str, fn: Callable, *args):
        """fn(*args) on a pool thread; HandlerError when the pool is saturated or the time
        limit passes; fn's own exception is re-raised as is."""
        if not self._slots.acquire(blocking=False):
            raise HandlerError(
                f"{what} was not called: all {self.size} handler threads ({POOL_PROP}) are "
                f"still held by handlers that did not return within {TIMEOUT_PROP}="
                f"{self.timeout_s * 1000:g}")
        with self._lock:
            if len(self._threads) < self.size:
                t = threading.Thread(target=self._worker, daemon=True,
                                     name=f"spillway-handler-{len(self._threads)}")
                t.start()
                self._threads.append(t)
        c = _Call(fn, args)
        self._queue.put(c)
        if not c.done.wait(self.timeout_s):
            raise HandlerError(f"{what} did not return within {TIMEOUT_PROP}="
                               f"{self.timeout_s * 1000:g} ms (KIP-1033: a handler crash)")
        if c.error is not None:
            raise c.error
        return c.result


def _dotted(spec: str) -> str:
    module, attr = split_spec(spec)
    return f"{module}.{attr}"


@dataclass(frozen=True)
class HandlerRules:
    """The operator's rules for user handler classes (sidecar-only properties)."""

    allowed: frozenset[str] | None = frozenset()  # dotted names; None: any (library use)
    runner: HandlerRunner | None = None

    @classmethod
    def from_properties(cls, allowed: str, timeout_ms: int, pool_size: int,
                        also: Iterable[str] = ()) -> HandlerRules:
        """`allowed`: the comma-separated list; `also`: specs the operator set elsewhere (the
        sidecar's own default errors.handler.class), allowed too."""
        specs = [p.strip() for p in allowed.split(",") if p.strip()]
        specs += [a.strip() for a in also if a.strip() and not is_builtin(a)]
        names = set()
        for spec in specs:
            try:
                names.add(_dotted(spec))
            except ConfigError:
                raise ConfigError(ALLOWED_PROP, (
                    f"each entry is a class as package.module:Class or package.module.Class; "
                    f"got {spec[:100]!r}")) from None
        return cls(frozenset(names), HandlerRunner(timeout_ms / 1000, pool_size))

    def check(self, spec: str) -> None:
        """ConfigError naming errors.handler.class unless `spec` is a built-in or allowed."""
        spec = spec.strip()
        if not spec or is_builtin(spec) or self.allowed is None:
            return
        if _dotted(spec) not in self.allowed:
            choices = ", ".join(["LogAndContinue", "LogAndFail", *sorted(self.allowed)])
            raise ConfigError("errors.handler.class", (
                f"{spec[:100]!r} is not allowed on this sidecar: a job may name a built-in or "
                f"a class the operator listed in {ALLOWED_PROP}; allowed: {choices}"))


UNRESTRICTED = HandlerRules(allowed=None)


@dataclass(frozen=True, slots=True)
class LoadedHandler:
    handler: ErrorHandler
    name: str                   # what reasons call it
    derived: bool               # True: errors.handler.class unset, chosen by errors.tolerance
    # A built-in's answer, which never depends on the context: the engine then need not build
    # one. None for user classes.
    fixed: HandlerResponse | None = None
    runner: HandlerRunner | None = None  # runs a user handler with a time limit


def is_builtin(spec: str) -> bool:
    return spec.strip().lower() in _BUILTINS


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
                 properties: Mapping[str, str] | None = None,
                 rules: HandlerRules = UNRESTRICTED) -> LoadedHandler:
    """Resolve ``errors.handler.class`` to a handler instance; ConfigError naming the property.
    A user class must be allowed by `rules` (checked before anything is imported)."""
    spec = spec.strip()
    if not spec:
        cls = LogAndFail if tolerance_mode == "none" else LogAndContinue
        return LoadedHandler(cls(), cls.name, derived=True, fixed=_FIXED[cls])
    builtin = _BUILTINS.get(spec.lower())
    if builtin is not None:
        return LoadedHandler(builtin(), builtin.name, derived=False, fixed=_FIXED[builtin])
    rules.check(spec)
    runner = rules.runner
    if runner is None:
        return _load_user(spec, properties)
    try:
        return runner.call(f"loading errors.handler.class={spec}", _load_user, spec, properties,
                           runner)
    except HandlerError as exc:
        raise ConfigError("errors.handler.class", str(exc)) from exc


def _load_user(spec: str, properties: Mapping[str, str] | None,
               runner: HandlerRunner | None = None) -> LoadedHandler:
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
    return LoadedHandler(handler, spec, derived=False, runner=runner)


def invoke(loaded: LoadedHandler, context: ErrorHandlerContext) -> HandlerResponse:
    """Call the handler; HandlerError (from its exception) when it crashes, answers nonsense or
    (a user handler) does not answer within its time limit."""
    try:
        if loaded.runner is not None:
            answer = loaded.runner.call(
                f"errors.handler.class={loaded.name} for record {context.record_id[:100]!r}",
                loaded.handler.handle, context)
        else:
            answer = loaded.handler.handle(context)
    except HandlerError:
        raise
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
