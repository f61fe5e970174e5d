"""Record identity in the policy engine: a record is its id *and* its payload. The same id with
the same payload is a re-report (deduplicated); the same id with another payload is another
record, decided, counted, logged and dead-lettered on its own (docs/POLICY.md, Record identity).
"""

from __future__ import annotations

import logging

import pytest
from spillway.sidecar.core.idtable import IdTable
from spillway.sidecar.core.model import (
    Action,
    ExceptionInfo,
    FailedRecord,
    Stage,
    StageRef,
    TaskIdentity,
)
from spillway.sidecar.core.policy import PolicyEngine
from support.deciding import decisions
from support.fakes import FakeClock, FakeRng

VALUE = ExceptionInfo("builtins.ValueError", ("builtins.ValueError", "builtins.Exception"),
                      "invalid literal for int()")
CONN = ExceptionInfo("builtins.ConnectionError", ("builtins.ConnectionError",
                                                  "builtins.Exception"), "refused")
T = StageRef(Stage.TRANSFORMATION)
DLQ = {"errors.tolerance": "all", "errors.deadletterqueue.topic.name": "dlq.j"}


def task(attempt: int = 0, stage_id: int = 1) -> TaskIdentity:
    return TaskIdentity(stage_id=stage_id, partition_id=0, attempt_number=attempt,
                        task_attempt_id=stage_id * 100 + attempt)


def rec(rid: str, value: bytes | None, exc: ExceptionInfo = VALUE,
        fn: str = "app.parse") -> FailedRecord:
    return FailedRecord(record_id=rid, stage=T, exception=exc, function_name=fn, value=value)


@pytest.fixture
def engine() -> PolicyEngine:
    return PolicyEngine(clock=FakeClock(), rng=FakeRng(), logger=None)


# (tolerance without limits takes the engine's short path for runs of equal failures; a limit
# takes the record-by-record path: both must keep records apart)
@pytest.fixture(params=[{}, {"errors.tolerance.max.errors": "100"}], ids=["short", "limited"])
def props(request):
    return {**DLQ, **request.param}


def test_the_same_id_with_another_payload_is_a_second_record(engine, props, caplog):
    engine.register_job("j", props)
    caplog.set_level(logging.WARNING, "spillway.sidecar.policy")
    orders = decisions(engine, "j", task(), [rec("TRANSFORMATION:j/parse:p0:r3", b'{"o":1')])[0]
    refunds = decisions(engine, "j", task(stage_id=2),
                            [rec("TRANSFORMATION:j/parse:p0:r3", b'{"r":2')])[0]
    for d in (orders, refunds):
        assert d.verdict.action is Action.SKIP and d.dead_letter and not d.verdict.dead_lettered
        assert "already" not in d.verdict.reason
    s = engine.summary("j")
    assert (s.counts.total_record_failures, s.counts.total_record_errors,
            s.counts.total_records_skipped, s.counts.total_errors_logged) == (2, 2, 2, 2)
    assert s.record_id_collisions == 1 and engine.counters()["record-id-collisions"] == 1
    warned = [r.getMessage() for r in caplog.records if r.name == "spillway.sidecar.policy"]
    assert len(warned) == 1
    assert "app.parse" in warned[0] and "TRANSFORMATION:j/parse:p0:r3" in warned[0]


def test_the_same_id_with_the_same_payload_is_one_record(engine, props):
    engine.register_job("j", props)
    first = decisions(engine, "j", task(), [rec("r", b"same")])[0]
    again = decisions(engine, "j", task(attempt=1), [rec("r", b"same")])[0]
    assert first.dead_letter and not again.dead_letter and again.verdict.dead_lettered
    s = engine.summary("j")
    assert (s.counts.total_record_errors, s.record_id_collisions) == (1, 0)


def test_each_of_two_records_under_one_id_is_deduplicated_on_its_own(engine, props):
    engine.register_job("j", props)
    a1, b1 = decisions(engine, "j", task(), [rec("r", b"a"), rec("r", b"b")])
    assert a1.dead_letter and b1.dead_letter
    # a task retry reports both again, in the other order: both are re-reports now
    b2, a2 = decisions(engine, "j", task(attempt=1), [rec("r", b"b"), rec("r", b"a")])
    assert not a2.dead_letter and not b2.dead_letter
    assert a2.verdict.dead_lettered and b2.verdict.dead_lettered
    c = decisions(engine, "j", task(attempt=2), [rec("r", b"c")])[0]     # a third record
    assert c.dead_letter
    s = engine.summary("j")
    assert (s.counts.total_record_errors, s.record_id_collisions) == (3, 2)


def test_a_payload_less_record_and_one_with_a_payload_are_two(engine):
    engine.register_job("j", DLQ)
    a, b = decisions(engine, "j", task(), [rec("r", None), rec("r", b"")])
    assert a.dead_letter and b.dead_letter     # None and b"" are different payloads


def test_undo_by_id_reaches_every_record_reported_under_it(engine):
    engine.register_job("j", DLQ)
    decisions(engine, "j", task(), [rec("r", b"a"), rec("r", b"b")])
    assert engine.undo_dead_letters("j", ["r"]) == 2
    a, b = decisions(engine, "j", task(attempt=1), [rec("r", b"a"), rec("r", b"b")])
    assert a.dead_letter and b.dead_letter     # both written again, neither lost


def test_a_retrying_record_and_another_record_under_its_id_keep_their_own_schedules(engine):
    engine.register_job("j", {**DLQ, "errors.retry.max.retries": "2",
                              "errors.retry.budget.ratio": "-1",
                              "errors.circuit.enable": "false"})
    for attempt in range(2):
        v = decisions(engine, "j", task(attempt), [rec("r", b"a", CONN)])[0].verdict
        assert v.action is Action.RETRY and v.attempt == attempt + 1
    other = decisions(engine, "j", task(), [rec("r", b"b", CONN)])[0].verdict
    assert other.action is Action.RETRY and other.attempt == 1     # its own, fresh schedule
    last = decisions(engine, "j", task(2), [rec("r", b"a", CONN)])[0].verdict
    assert last.action is Action.SKIP and last.attempt == 3         # a's schedule went on
    assert engine.summary("j").record_id_collisions == 1


def test_a_digest_collision_of_two_ids_with_other_payloads_keeps_both():
    class Colliding(str):
        def __hash__(self) -> int:
            return 42

    engine = PolicyEngine(clock=FakeClock(), rng=FakeRng(), logger=None)
    engine.register_job("j", DLQ)
    a, b = decisions(engine, "j", task(), [rec(Colliding("a"), b"1"), rec(Colliding("b"), b"2")])
    assert a.dead_letter and b.dead_letter


def test_id_table_tags_follow_their_keys_through_touch_eviction_and_compaction():
    t: IdTable[int] = IdTable(300)
    for k in range(5_000):
        t.add(k, k, tag=k * 7 + 1)
        if k % 3 == 0:
            t.touch(k // 2)            # moves entries: dead slots, compaction, rebuilds
        if k % 5 == 0:
            t.pop(k - 1)
    assert len(t) <= 300
    for k in t.keys():
        assert t.tag(k) == k * 7 + 1 and t.get(k) == k
    assert t.tag(10**9) == -1
    t.add(4_999, 0)                    # re-adding without a tag keeps the entry's tag
    assert t.tag(4_999) == 4_999 * 7 + 1
    t.add(4_999, 0, tag=5)
    assert t.tag(4_999) == 5


def test_payload_digests_keep_their_format_and_the_fixed_key_tagger_matches():
    """Payload digests are kept across restarts (run state) and computed by a node for its
    home: their format is pinned (keyed BLAKE2b-64 of the key's length, key, a null marker and
    the value), and the per-run tagger (the keyed first block copied) computes the same."""
    import random

    from spillway.sidecar.core.tolerance import payload_tag, payload_tagger

    secret = b"k" * 32
    cases = [(b"key", b"value"), (None, b"value"), (b"", b""), (b"key", None), (None, None)]
    assert [payload_tag(k, v, secret) for k, v in cases] == [
        16732026223705424195, 15994909874574856828, 2971162502910884699,
        15638658595591056672, 8680750440221112550]
    rng = random.Random(7)
    for sec in (secret, b"", b"other-run"):
        tag = payload_tagger(sec)
        for _ in range(200):
            k = None if rng.random() < 0.2 else rng.randbytes(rng.randrange(0, 40))
            v = None if rng.random() < 0.2 else rng.randbytes(rng.randrange(0, 400))
            assert tag(k, v) == payload_tag(k, v, sec)
    assert payload_tagger(secret)(b"a", b"b") != payload_tagger(b"x" * 32)(b"a", b"b")
