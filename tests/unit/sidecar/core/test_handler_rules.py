"""Operator-owned handler code: the allow-list (nothing else is imported) and the time limit on
a small pool of daemon threads (a blocking handler is a handler crash, never a hang)."""

from __future__ import annotations

import sys
import textwrap
import threading
import time
import uuid

import pytest
from spillway.sidecar.core.handlers import HandlerRules, HandlerRunner, load_handler
from spillway.sidecar.core.model import ExceptionInfo, FailedRecord, Stage, StageRef, TaskIdentity
from spillway.sidecar.core.policy import PolicyEngine
from spillway.sidecar.errors import ConfigError, HandlerError
from support.deciding import decisions
from support.fakes import FakeClock, FakeRng

TASK = TaskIdentity(stage_id=1, partition_id=0, attempt_number=0, task_attempt_id=1)
RECORD = FailedRecord("r1", StageRef(Stage.TRANSFORMATION),
                      ExceptionInfo("builtins.ValueError", message="bad"))


@pytest.fixture
def mod(tmp_path, monkeypatch):
    name = f"handlers_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent("""
        import threading
        from spillway.sidecar.core.handlers import HandlerResponse
        IMPORTED = True
        RELEASE = threading.Event()

        class Ok:
            def handle(self, context):
                return HandlerResponse.CONTINUE

        class Blocking:
            def handle(self, context):
                RELEASE.wait()
                return HandlerResponse.CONTINUE

        class SlowInit:
            def __init__(self):
                RELEASE.wait()
            def handle(self, context):
                return HandlerResponse.CONTINUE
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    m = sys.modules.pop(name, None)
    if m is not None:
        m.RELEASE.set()


def rules(allowed="", timeout_ms=200, pool=2, also=()):
    return HandlerRules.from_properties(allowed, timeout_ms, pool, also=also)


@pytest.mark.parametrize("spec", ["os:abort", "signal:pause", "os.system", "builtins:print"])
def test_anything_not_allowed_is_refused_and_nothing_is_imported(spec, mod):
    r = rules(f"{mod}:Ok")
    with pytest.raises(ConfigError) as e:
        load_handler(spec, "all", {}, r)
    assert e.value.property == "errors.handler.class"
    msg = str(e.value)
    assert "errors.handler.allowed.classes" in msg and f"{mod}.Ok" in msg
    assert "LogAndContinue" in msg


def test_a_refused_class_is_not_imported(mod):
    with pytest.raises(ConfigError):
        load_handler(f"{mod}:Ok", "all", {}, rules(""))
    assert mod not in sys.modules


def test_an_allowed_class_loads_in_either_spelling(mod):
    r = rules(f"{mod}.Ok")
    assert load_handler(f"{mod}:Ok", "all", {}, r).runner is r.runner
    r = rules(f"{mod}:Ok")
    assert load_handler(f"{mod}.Ok", "all", {}, r).name == f"{mod}.Ok"


def test_builtins_and_the_sidecar_default_are_always_allowed(mod):
    r = rules("", also=[f"{mod}:Ok"])
    for spec in ("LogAndContinue", "logandfail", "", f"{mod}:Ok"):
        load_handler(spec, "all", {}, r)


def test_a_malformed_allow_list_entry_names_the_property():
    with pytest.raises(ConfigError) as e:
        rules("not a class!")
    assert e.value.property == "errors.handler.allowed.classes"


def test_a_constructor_that_blocks_is_refused_at_registration(mod):
    with pytest.raises(ConfigError) as e:
        load_handler(f"{mod}:SlowInit", "all", {}, rules(f"{mod}:SlowInit"))
    assert "did not return within errors.handler.timeout.ms=200" in str(e.value)


def test_a_blocking_handler_fails_its_job_and_counts_as_a_handler_crash(mod):
    e = PolicyEngine(clock=FakeClock(), rng=FakeRng(0.0), handler_rules=rules(f"{mod}:Blocking"))
    e.register_job("j", {"errors.tolerance": "all", "errors.handler.class": f"{mod}:Blocking"})
    v = decisions(e, "j", TASK, [RECORD])[0].verdict
    assert v.job_failed and "did not return within errors.handler.timeout.ms=200" in v.reason
    assert e.counters()["handler-failures"] == 1
    assert e.summary("j").failed


def test_a_saturated_pool_refuses_at_once_with_a_reason(mod):
    runner = HandlerRunner(timeout_s=0.05, size=2)
    release = threading.Event()
    for _ in range(2):
        with pytest.raises(HandlerError, match="did not return"):
            runner.call("h", release.wait)
    with pytest.raises(HandlerError) as e:
        runner.call("h", lambda: "never called")
    assert "all 2 handler threads (errors.handler.pool.size) are still held" in str(e.value)
    release.set()
    for t in runner._threads:
        assert t.daemon
    # the slots come back once the stuck handlers return
    for _ in range(100):
        try:
            assert runner.call("h", lambda: 7) == 7
            break
        except HandlerError:
            time.sleep(0.02)
    else:
        pytest.fail("slots never came back")


def test_a_handlers_own_exception_is_re_raised():
    runner = HandlerRunner(timeout_s=1, size=1)

    def boom():
        raise KeyError("x")

    with pytest.raises(KeyError):
        runner.call("h", boom)
    assert runner.call("h", lambda: 1) == 1
