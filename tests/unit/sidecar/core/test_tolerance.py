"""Tolerance limits: counts, ratios with a minimum, sliding windows, per stage, idempotency."""

from __future__ import annotations

import random
import sys
from collections import OrderedDict

import pytest
from spillway.sidecar.core.counters import WindowedCounter
from spillway.sidecar.core.model import (
    Action,
    ExceptionInfo,
    FailedRecord,
    Stage,
    StageRef,
    TaskIdentity,
)
from spillway.sidecar.core.policy import PolicyEngine
from spillway.sidecar.core.settings import ToleranceSettings
from spillway.sidecar.core.tolerance import KEY_MASK, IdTable, ToleranceTracker, record_key
from support.deciding import decisions
from support.fakes import FakeClock, FakeRng


def Clock() -> FakeClock:
    return FakeClock(start_ms=0.0, wall_start_ms=0)


def Rng() -> FakeRng:
    return FakeRng(0.0)


VALUE = ExceptionInfo("builtins.ValueError", message="bad")
T = StageRef(Stage.TRANSFORMATION)
SINK = StageRef(Stage.SINK)


def tol(mode="all", max_errors=-1, max_ratio=-1.0, min_records=0, window_ms=0, per_stage=False):
    return ToleranceTracker("x", ToleranceSettings(mode, max_errors, max_ratio, min_records,
                                                   window_ms, per_stage))


def engine_with(**props: str) -> tuple[PolicyEngine, Clock]:
    clock = Clock()
    e = PolicyEngine(clock=clock, rng=Rng())
    e.register_job("x", {"errors.tolerance": "all", **{k.replace("_", "."): v
                                                       for k, v in props.items()}})
    return e, clock


def bad(e: PolicyEngine, rid: str, stage: StageRef = T, partition: int = 0):
    t = TaskIdentity(stage_id=1, partition_id=partition, task_attempt_id=partition)
    return decisions(e, "x", t, [FailedRecord(rid, stage, VALUE)])[0].verdict


# --- the tracker -------------------------------------------------------------------------------

def test_none_fails_on_the_first_error():
    t = tol(mode="none")
    r = t.admit("a", "TRANSFORMATION", 0)
    assert r.exceeded and "errors.tolerance=none" in r.reason


def test_all_without_limits_never_fails():
    t = tol()
    assert not any(t.admit(str(i), "S", i).exceeded for i in range(10_000))


def test_max_errors_allows_exactly_that_many():
    t = tol(max_errors=5)
    assert [t.admit(str(i), "TRANSFORMATION", 0).exceeded for i in range(6)] == [False] * 5 + [True]
    assert t.admit("5", "TRANSFORMATION", 0).counted is False


def test_counting_is_idempotent_by_record_id():
    t = tol(max_errors=1)
    assert not t.admit("a", "S", 0).exceeded
    again = t.admit("a", "S", 1)
    assert not again.exceeded and not again.counted
    assert t.errors_total == 1


def test_counted_ids_are_bounded():
    t = ToleranceTracker("x", ToleranceSettings("all", -1, -1, 0, 0, False), max_ids=100)
    for i in range(1000):
        t.admit(str(i), "S", 0)
    assert len(t.ids) == 100 and t.ids_evicted == 900


def test_processed_slots_are_bounded_and_keep_their_counts():
    t = ToleranceTracker("x", ToleranceSettings("all", -1, -1, 0, 0, False), max_slots=10)
    for p in range(50):
        t.record_progress((1, p), {"S": 2}, 0)
    assert len(t._slots) == 10 and t.records_processed == 100


def test_windowed_counter_slides_and_corrects():
    w = WindowedCounter(10_000)
    w.add(0, 5)
    w.add(6_000, 3)
    assert w.total(9_000) == 8
    assert w.total(10_000) == 8        # the t=0 bucket [0, 500) is not wholly outside yet
    assert w.total(10_500) == 3        # now it is: it left the window
    w.add(12_000, -3, at_ms=6_000)     # a correction lands in the bucket it belongs to
    assert w.total(12_000) == 0
    w.add(20_000, -1, at_ms=0)         # that bucket is gone: nothing to correct
    assert w.total(20_000) == 0


def test_windowed_counter_without_window_is_a_running_total():
    w = WindowedCounter(0)
    for t in range(0, 10**9, 10**7):
        w.add(t)
    assert w.total(10**12) == 100


# --- through the engine: the messages a user reads ------------------------------------------------

def test_max_errors_message_names_limit_count_and_stage():
    e, _ = engine_with(errors_tolerance_max_errors="5")
    verdicts = [bad(e, f"r{i}") for i in range(6)]
    assert [v.action for v in verdicts] == [Action.SKIP] * 5 + [Action.FAIL]
    last = verdicts[-1]
    assert last.job_failed
    assert last.reason.startswith(
        "job 'x' exceeded errors.tolerance.max.errors=5: 6 errors (stage TRANSFORMATION)")
    s = e.summary("x")
    assert s.failed and s.failure_reason == last.reason
    # every later verdict of the job is FAIL with that reason
    later = bad(e, "r99", SINK)
    assert later.action is Action.FAIL and later.job_failed and last.reason in later.reason


def test_ratio_applies_only_once_min_records_were_processed():
    e, _ = engine_with(errors_tolerance_max_ratio="0.1", errors_tolerance_min_records="100")
    for i in range(20):                      # 20 errors, nothing processed yet: no ratio
        assert bad(e, f"r{i}").action is Action.SKIP
    t = TaskIdentity(stage_id=1, partition_id=0, task_attempt_id=1)
    e.record_progress("x", t, {T: 99})       # 20/99 but still under min.records
    assert not e.summary("x").failed
    e.record_progress("x", t, {T: 150})      # same attempt again: replaces, 20/150 > 0.1
    s = e.summary("x")
    assert s.failed
    assert s.failure_reason.startswith(
        "job 'x' exceeded errors.tolerance.max.ratio=0.1: 20 errors in 150 processed records")
    assert bad(e, "late").action is Action.FAIL


def test_ratio_within_limit_keeps_skipping():
    e, _ = engine_with(errors_tolerance_max_ratio="0.1", errors_tolerance_min_records="100")
    e.record_progress("x", TaskIdentity(1, 0, 0, 1), {T: 1000})
    actions = [bad(e, f"r{i}").action for i in range(101)]
    assert actions == [Action.SKIP] * 100 + [Action.FAIL]      # 101/1000 > 0.1


def test_sliding_window_forgets_old_errors():
    e, clock = engine_with(errors_tolerance_max_errors="2", errors_tolerance_window_ms="10000")
    assert bad(e, "a").action is Action.SKIP
    assert bad(e, "b").action is Action.SKIP
    clock.ms += 11_000                        # a and b left the window
    assert bad(e, "c").action is Action.SKIP
    assert bad(e, "d").action is Action.SKIP
    v = bad(e, "f")
    assert v.action is Action.FAIL
    assert "errors.tolerance.max.errors=2: 3 errors in the last 10000 ms" in v.reason


def test_whole_job_window_never_forgets():
    e, clock = engine_with(errors_tolerance_max_errors="2")
    bad(e, "a")
    bad(e, "b")
    clock.ms += 10**9
    assert bad(e, "c").action is Action.FAIL


def test_per_stage_limit_fails_on_one_stage_while_the_job_total_is_within():
    e, _ = engine_with(errors_tolerance_max_ratio="0.2", errors_tolerance_min_records="10",
                       errors_tolerance_per_stage="true")
    e.record_progress("x", TaskIdentity(1, 0, 0, 1), {T: 1000, SINK: 20})
    for i in range(4):
        assert bad(e, f"s{i}", SINK).action is Action.SKIP     # 4/20 = 0.2: at the limit
    v = bad(e, "s4", SINK)                                     # 5/20 = 0.25 > 0.2; job 5/1020
    assert v.action is Action.FAIL and v.job_failed
    assert v.reason.startswith("job 'x' stage TASK_PUT exceeded errors.tolerance.max.ratio=0.2")
    assert "(errors.tolerance.per.stage=true)" in v.reason


def test_without_per_stage_only_the_job_total_counts():
    e, _ = engine_with(errors_tolerance_max_ratio="0.2", errors_tolerance_min_records="10")
    e.record_progress("x", TaskIdentity(1, 0, 0, 1), {T: 1000, SINK: 20})
    assert all(bad(e, f"s{i}", SINK).action is Action.SKIP for i in range(10))


def test_reattempted_task_replaces_its_processed_count_for_the_ratio():
    e, _ = engine_with(errors_tolerance_max_ratio="0.5", errors_tolerance_min_records="1")
    for i in range(10):
        bad(e, f"r{i}")
    e.record_progress("x", TaskIdentity(1, 0, 0, 100), {T: 30})
    e.record_progress("x", TaskIdentity(1, 0, 1, 101), {T: 30})  # re-run of the same partition
    assert e.summary("x").records_processed == 30
    assert not e.summary("x").failed                             # 10/30, not 10/60
    e.record_progress("x", TaskIdentity(1, 0, 2, 102), {T: 15})  # the last re-run saw fewer
    assert e.summary("x").failed                                 # 10/15 > 0.5


@pytest.mark.parametrize("limit", [0, 3])
def test_max_errors_zero_means_no_error_tolerated(limit):
    e, _ = engine_with(errors_tolerance_max_errors=str(limit))
    actions = [bad(e, f"r{i}").action for i in range(limit + 1)]
    assert actions == [Action.SKIP] * limit + [Action.FAIL]


def test_errors_of_running_tasks_do_not_count_in_the_ratio_until_the_task_flushes():
    e, _ = engine_with(errors_tolerance_max_ratio="0.05", errors_tolerance_min_records="100")
    e.record_progress("x", TaskIdentity(1, 9, 0, 9), {T: 5000})      # a finished, clean task
    # a running task reports 300 errors: 300 / 5000 = 0.06 compares a running task's errors
    # with other tasks' records; nothing fails on them yet
    assert all(bad(e, f"r{i}", partition=1).action is Action.SKIP for i in range(300))
    assert not e.summary("x").failed
    e.record_progress("x", TaskIdentity(1, 1, 0, 1), {T: 400})       # it ends: 300 of 400
    s = e.summary("x")
    assert s.failed
    assert "errors.tolerance.max.ratio=0.05: 300 errors in 5400 processed records" in (
        s.failure_reason)


def test_progress_replaces_per_stage_so_two_wrappers_in_one_task_both_count():
    t = ToleranceTracker("x", ToleranceSettings("all", -1, -1, 0, 0, False))
    t.record_progress((1, 0), {"DESERIALIZATION": 40}, 0)
    t.record_progress((1, 0), {"TRANSFORMATION": 36}, 1)
    assert t.records_processed == 76
    # a running total for one stage replaces that stage's earlier figure only
    t.record_progress((1, 0), {"TRANSFORMATION": 38}, 2)
    assert t.records_processed == 78


# --- the compact id table ------------------------------------------------------------------------

def test_counted_ids_are_kept_as_60_bit_digests_not_strings():
    t = tol()
    t.admit("job/TRANSFORMATION/3/12345", "S", 0)
    assert t.ids.keys() == [record_key("job/TRANSFORMATION/3/12345")]
    key = t.ids.keys()[0]
    assert type(key) is int and 0 <= key <= KEY_MASK and sys.getsizeof(key) <= 32
    # a caller that already has the key passes it: the same id is not counted twice
    assert not t.admit("job/TRANSFORMATION/3/12345", "S", 1, key=key).counted
    assert t.errors_total == 1


def test_id_table_evicts_the_least_recently_used():
    t: IdTable[int] = IdTable(3)
    for k in (1, 2, 3):
        t.add(k, k)
    t.touch(1)                       # order now 2, 3, 1
    t.add(4, 4)                      # evicts 2
    assert t.keys() == [3, 1, 4] and 2 not in t and t.evicted == 1
    t.add(3, 30)                     # present: new value, most recently used
    t.replace(1, 10)                 # new value, order unchanged
    assert t.keys() == [1, 4, 3] and t.get(3) == 30 and t.get(1) == 10
    assert t.pop(4) == 4 and t.pop(4) is None and t.pop(99, -1) == -1
    t.add(5, 5)
    t.add(6, 6)                      # evicts 1, the least recently used
    assert t.keys() == [3, 5, 6] and len(t) == 3 and t.evicted == 2
    t.replace(1, 1)                  # absent: nothing
    assert 1 not in t


def test_id_table_matches_an_lru_ordered_dict_under_random_use():
    rng = random.Random(7)
    t: IdTable[int] = IdTable(50)
    ref: OrderedDict[int, int] = OrderedDict()
    evicted = 0
    for step in range(60_000):
        k = rng.randrange(120)
        op = rng.random()
        if op < 0.45:
            t.add(k, step)
            ref[k] = step
            ref.move_to_end(k)
            if len(ref) > 50:
                ref.popitem(last=False)
                evicted += 1
        elif op < 0.75:
            if k in ref:
                t.touch(k)
                ref.move_to_end(k)
        elif op < 0.95:
            assert t.pop(k) == ref.pop(k, None)
        else:
            t.replace(k, -step)
            if k in ref:
                ref[k] = -step
        if step % 997 == 0:
            assert t.keys() == list(ref) and t.evicted == evicted
            assert all(t.get(k) == v for k, v in ref.items())
            # dead entries are compacted away: the entries stay within bounds
            assert len(t._keys) - t._head <= 2 * len(t) + 1025
    assert t.keys() == list(ref) and len(t) == len(ref) and t.evicted == evicted


def test_id_table_stays_compact_under_churn():
    t: IdTable[None] = IdTable(2_000)
    keys = [record_key(f"job/TRANSFORMATION/0/{k}") for k in range(50_000)]
    for k in keys:                   # every add past 2 000 evicts one
        t.add(k, None)
    assert len(t) == 2_000 and t.keys() == keys[48_000:]
    # no object per entry: 8 bytes of key, 8 of value reference, 8-16 of index, and evicted
    # entries cut off
    size = sys.getsizeof(t._keys) + sys.getsizeof(t._vals) + sys.getsizeof(t._index)
    assert size < 2_000 * 64
    assert len(t._keys) <= 2 * 2_000 + 1024


def test_id_table_matches_a_dict_with_colliding_keys():
    """Keys sharing their low bits (one probe run) under adds, touches, pops, evictions, growth
    and shrinking: every answer as an LRU OrderedDict's."""
    rng = random.Random(11)
    t: IdTable[int] = IdTable(300)
    ref: OrderedDict[int, int] = OrderedDict()
    universe = [rng.getrandbits(50) << 10 | 16 * rng.randrange(64) for _ in range(600)]
    universe += [0, KEY_MASK]
    evicted = 0
    for step in range(24_000):
        k = rng.choice(universe)
        op = rng.random()
        if step % 8_000 > 7_000:
            op = 0.8                   # bursts of pops: the table shrinks
        if op < 0.5:
            t.add(k, step)
            ref[k] = step
            ref.move_to_end(k)
            if len(ref) > 300:
                ref.popitem(last=False)
                evicted += 1
        elif op < 0.7:
            t.touch(k)
            if k in ref:
                ref.move_to_end(k)
        elif op < 0.9:
            assert t.pop(k, -1) == ref.pop(k, -1)
        else:
            assert (k in t) == (k in ref) and t.get(k) == ref.get(k)
        if step % 499 == 0:
            assert t.keys() == list(ref) and len(t) == len(ref) and t.evicted == evicted
            assert all(t.get(k) == v for k, v in ref.items())
            assert 2 * len(t) <= len(t._index)
    assert t.keys() == list(ref)


def test_id_table_remembered_probe_is_forgotten_when_the_table_changes():
    """get / `in` remember where an absent key's probe ended, add / get where a key's entry
    is: a change in between (another key taking that slot, a pop, an eviction) must not
    mislead the next call."""
    a, b, c = 5 << 20, 6 << 20, 7 << 20          # one home slot
    t: IdTable[str] = IdTable(2)
    assert t.get(a) is None and a not in t        # probe of a ends at slot 0
    t.add(b, "b")                                 # b takes slot 0
    t.add(a, "a")                                 # a must not land on b's slot
    assert t.get(b) == "b" and t.get(a) == "a" and t.keys() == [b, a]
    t.add(c, "c")                                 # evicts b; a just found, c just added
    t.replace(a, "A")
    assert t.keys() == [a, c] and t.get(a) == "A" and b not in t
    assert c not in t or t.pop(c) == "c"
    t.replace(c, "C")                             # popped: nothing
    assert c not in t and t.keys() == [a]
    assert t.get(b) is None
    t.add(c, "c")
    t.pop(a)                                      # a's removal shifts c back
    t.add(b, "b")
    assert t.keys() == [c, b] and t.get(c) == "c" and t.get(b) == "b"
    t = IdTable(3)
    t.add(a, "a")
    t.add(b, "b")
    assert c not in t                             # probe of c ends past a and b
    t.pop(a)                                      # b shifts back: a gap on c's path
    t.add(c, "c")
    assert t.get(c) == "c" and t.keys() == [b, c]


def test_count_errors_equals_admits_when_unlimited():
    """With no limits, counting a report's new errors at once (`count_errors`, what the policy
    engine does per report) leaves the tracker as one `admit` per record would."""
    settings = ToleranceSettings("all", -1, -1, 0, 60_000, True)
    one, batch = ToleranceTracker("x", settings), ToleranceTracker("x", settings)
    assert one.unlimited and batch.unlimited
    for t in (one, batch):
        t.record_progress((1, 0), {"S": 10}, 5.0)
    for i in range(3):
        assert not one.admit(f"r{i}", "S", 10.0, (1, 0)).exceeded
    one.admit("q", "T", 10.0, (1, 1))
    batch.count_errors("S", (1, 0), 3, 10.0)
    batch.count_errors("T", (1, 1), 1, 10.0)
    assert batch.errors_total == one.errors_total == 4
    for pa, pb_ in ((one._job, batch._job), (one._stages["S"], batch._stages["S"])):
        for f in ("errors", "settled", "processed"):
            assert getattr(pa, f).total(10.0) == getattr(pb_, f).total(10.0)
    assert list(one._slots) == list(batch._slots)
    assert one._slots[(1, 0)] == batch._slots[(1, 0)]
    assert not ToleranceTracker("x", ToleranceSettings("none", -1, -1, 0, 0, False)).unlimited
    assert not ToleranceTracker("x", ToleranceSettings("all", 5, -1, 0, 0, False)).unlimited
