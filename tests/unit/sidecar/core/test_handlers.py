"""KIP-1033 handlers: built-ins, user classes loaded by name, context, crashes."""

from __future__ import annotations

import sys
import textwrap
import uuid

import pytest
from spillway.sidecar.core.handlers import (
    ErrorHandlerContext,
    HandlerResponse,
    LogAndContinue,
    LogAndFail,
    load_handler,
    split_spec,
)
from spillway.sidecar.core.model import (
    Action,
    Category,
    ExceptionInfo,
    FailedRecord,
    SourceCoordinates,
    Stage,
    StageRef,
    TaskIdentity,
)
from spillway.sidecar.core.policy import PolicyEngine
from spillway.sidecar.errors import ConfigError
from support.deciding import decisions
from support.fakes import FakeClock, FakeRng


def Clock() -> FakeClock:
    return FakeClock(start_ms=100_000.0, wall_start_ms=1_700_000_000_000)


def Rng() -> FakeRng:
    return FakeRng(0.0)


VALUE = ExceptionInfo("builtins.ValueError", message="bad")
CONN = ExceptionInfo("builtins.ConnectionError", message="down")
TASK = TaskIdentity(stage_id=4, partition_id=7, attempt_number=1, task_attempt_id=99)


@pytest.fixture
def handler_module(tmp_path, monkeypatch):
    """Write a module of user handlers to an importable place; yield its name."""
    name = f"user_handlers_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent("""
        import enum
        from spillway.sidecar.core.handlers import HandlerResponse

        SEEN = []

        class Recording:
            def handle(self, context):
                SEEN.append(context)
                return HandlerResponse.CONTINUE

        class ByStage:
            def configure(self, props):
                self.fail_stage = props.get("errors.deadletterqueue.topic.name", "")
            def handle(self, context):
                return "FAIL" if context.stage == "TASK_PUT" else "continue"

        class Crashing:
            def handle(self, context):
                raise RuntimeError("handler bug")

        class Nonsense:
            def handle(self, context):
                return 42

        class Own(enum.Enum):
            CONTINUE = 1
            FAIL = 2

        class OwnEnum:
            def handle(self, context):
                return Own.FAIL

        class NoHandle:
            pass

        class NeedsArgs:
            def __init__(self, x):
                pass
            def handle(self, context):
                return HandlerResponse.CONTINUE

        class BadConfigure:
            def configure(self, props):
                raise ValueError("missing setting")
            def handle(self, context):
                return HandlerResponse.CONTINUE

        class Outer:
            class Inner:
                def handle(self, context):
                    return HandlerResponse.FAIL
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    sys.modules.pop(name, None)


def engine(**props: str) -> PolicyEngine:
    e = PolicyEngine(clock=Clock(), rng=Rng())
    e.register_job("j", props)
    return e


TRANSFORM = StageRef(Stage.TRANSFORMATION)


def decide(e: PolicyEngine, rid: str, exc=VALUE, stage=TRANSFORM, **kw):
    return decisions(e, "j", TASK, [FailedRecord(rid, stage, exc, **kw)])[0].verdict


# --- loading -----------------------------------------------------------------------------------

@pytest.mark.parametrize(("spec", "mode", "cls", "derived"), [
    ("", "none", LogAndFail, True),
    ("", "all", LogAndContinue, True),
    ("LogAndContinue", "all", LogAndContinue, False),
    ("logandfail", "all", LogAndFail, False),
    ("LogAndFailExceptionHandler", "none", LogAndFail, False),
    ("LogAndContinueExceptionHandler", "all", LogAndContinue, False),
])
def test_builtins_and_the_tolerance_default(spec, mode, cls, derived):
    loaded = load_handler(spec, mode)
    assert isinstance(loaded.handler, cls) and loaded.derived is derived


@pytest.mark.parametrize(("spec", "parts"), [
    ("a.b:C", ("a.b", "C")), ("a.b.C", ("a.b", "C")), ("a:B.C", ("a", "B.C")),
])
def test_spec_forms(spec, parts):
    assert split_spec(spec) == parts


@pytest.mark.parametrize("form", ["{m}:Recording", "{m}.Recording", "{m}:Outer.Inner"])
def test_user_handler_loads_by_either_form(handler_module, form):
    loaded = load_handler(form.format(m=handler_module), "all")
    assert loaded.name == form.format(m=handler_module)
    assert callable(loaded.handler.handle)


@pytest.mark.parametrize(("spec", "words"), [
    ("no_such_module_xyz:H", "cannot import module 'no_such_module_xyz'"),
    ("{m}:Missing", "has no attribute 'Missing'"),
    ("{m}:NoHandle", "has no handle(context) method"),
    ("{m}:NeedsArgs", "cannot construct"),
    ("{m}:BadConfigure", "configure() raised ValueError: missing setting"),
    ("{m}:SEEN", "is not a class"),
])
def test_unloadable_handlers_are_config_errors_at_registration(handler_module, spec, words):
    with pytest.raises(ConfigError) as e:
        engine(**{"errors.tolerance": "all",
                  "errors.handler.class": spec.format(m=handler_module)})
    assert e.value.property == "errors.handler.class"
    assert words in str(e.value)


# --- decisions ---------------------------------------------------------------------------------

def test_handler_gets_the_kip1033_context(handler_module):
    e = engine(**{"errors.tolerance": "all", "errors.handler.class": f"{handler_module}:Recording",
                  "errors.retry.max.retries": "1"})
    rec_kw = dict(source=SourceCoordinates("orders", 2, 1234), headers=(("h", b"1"),),
                  function_name="pipeline.parse_order", timestamp_ms=1_600_000_000_000,
                  key=b"k", value=b"v")
    assert decide(e, "r1", **rec_kw).action is Action.SKIP
    ctx: ErrorHandlerContext = sys.modules[handler_module].SEEN[-1]
    assert (ctx.topic, ctx.partition, ctx.offset) == ("orders", 2, 1234)
    assert ctx.headers == (("h", b"1"),)
    assert ctx.processor_node_id == "pipeline.parse_order"
    assert ctx.task_id == "4.7" and ctx.stage == "TRANSFORMATION"
    assert ctx.timestamp == 1_600_000_000_000
    assert ctx.exception is VALUE and ctx.category is Category.DATA
    assert ctx.record.key == b"k" and ctx.job == "j" and ctx.attempt == 1
    # a retriable record reaches the handler only once its retries are exhausted
    assert decide(e, "r2", CONN).action is Action.RETRY
    assert len(sys.modules[handler_module].SEEN) == 1
    assert decide(e, "r2", CONN).action is Action.SKIP
    ctx = sys.modules[handler_module].SEEN[-1]
    assert ctx.record_id == "r2" and "retries exhausted" in ctx.reason
    assert (ctx.topic, ctx.partition, ctx.offset) == (None, -1, -1)
    assert ctx.timestamp == Clock().wall_ms()        # no source timestamp: when it was reported


def test_handler_answers_per_record_and_fail_fails_the_job(handler_module):
    e = engine(**{"errors.tolerance": "all", "errors.handler.class": f"{handler_module}:ByStage"})
    assert decide(e, "a").action is Action.SKIP                      # "continue" string
    v = decide(e, "b", stage=StageRef(Stage.SINK))
    assert v.action is Action.FAIL and v.job_failed
    assert f"errors.handler.class={handler_module}:ByStage returned FAIL" in v.reason
    assert decide(e, "c").action is Action.FAIL                      # the job has failed


def test_handler_may_answer_with_its_own_enum(handler_module):
    e = engine(**{"errors.tolerance": "all", "errors.handler.class": f"{handler_module}:OwnEnum"})
    assert decide(e, "a").action is Action.FAIL


@pytest.mark.parametrize(("cls", "words"), [
    ("Crashing", "raised RuntimeError: handler bug while handling record 'r'"),
    ("Nonsense", "returned 42 for record 'r'; expected HandlerResponse.CONTINUE or FAIL"),
])
def test_handler_crash_fails_the_job_naming_the_handler(handler_module, cls, words):
    e = engine(**{"errors.tolerance": "all", "errors.handler.class": f"{handler_module}:{cls}"})
    v = decide(e, "r")
    assert v.action is Action.FAIL and v.job_failed
    assert f"errors.handler.class={handler_module}:{cls}" in v.reason and words in v.reason
    s = e.summary("j")
    assert s.failed and words in s.failure_reason
    assert e.counters()["handler-failures"] == 1


def test_continue_is_still_subject_to_tolerance_limits(handler_module):
    e = engine(**{"errors.tolerance": "all", "errors.tolerance.max.errors": "1",
                  "errors.handler.class": f"{handler_module}:Recording"})
    assert decide(e, "a").action is Action.SKIP
    v = decide(e, "b")
    assert v.action is Action.FAIL and "errors.tolerance.max.errors=1: 2 errors" in v.reason


def test_user_handler_continue_under_tolerance_none_still_fails(handler_module):
    e = engine(**{"errors.handler.class": f"{handler_module}:Recording"})
    v = decide(e, "a")
    assert v.action is Action.FAIL and "errors.tolerance=none" in v.reason
    assert len(sys.modules[handler_module].SEEN) == 1     # it was consulted


def test_explicit_logandfail_with_tolerance_all():
    e = engine(**{"errors.tolerance": "all", "errors.handler.class": "LogAndFail"})
    v = decide(e, "a")
    assert v.action is Action.FAIL and "errors.handler.class=LogAndFail returned FAIL" in v.reason


def test_builtins_answer_without_context_use():
    assert LogAndContinue().handle(None) is HandlerResponse.CONTINUE   # type: ignore[arg-type]
    assert LogAndFail().handle(None) is HandlerResponse.FAIL           # type: ignore[arg-type]
