"""A run's durable state: what the policy engine journals, replayed into a fresh engine (as a
restarted sidecar does), decides every later record as the first engine would; and the
SQLite store beside the spool keeps slices in order, compacts, drops and prunes."""

from __future__ import annotations

import os
import pickle
import stat
import threading
import time

import pytest
from spillway.sidecar.core.model import (
    Action,
    ExceptionInfo,
    FailedRecord,
    Stage,
    StageRef,
    TaskIdentity,
)
from spillway.sidecar.core.policy import PolicyEngine
from spillway.sidecar.service.runstate import RunStore
from support.deciding import decisions
from support.engines import run_state
from support.fakes import FakeClock, FakeRng

VALUE = ExceptionInfo("builtins.ValueError", ("builtins.ValueError", "builtins.Exception"),
                      "bad value")
T = StageRef(Stage.TRANSFORMATION)
TASK = TaskIdentity(stage_id=1, partition_id=0, attempt_number=0, task_attempt_id=1)


def rec(rid: str, value: bytes = b"v") -> FailedRecord:
    return FailedRecord(record_id=rid, stage=T, exception=VALUE, key=rid.encode(), value=value)


def engine(clock: FakeClock) -> PolicyEngine:
    return PolicyEngine(clock=clock, rng=FakeRng())


PROPS = {"errors.tolerance": "all", "errors.tolerance.max.errors": "5",
         "errors.deadletterqueue.topic.name": "dlq.x"}


def _durable(clock, props=PROPS, key="j"):
    e = engine(clock)
    e.register_job(key, props)
    e.enable_journal(key)
    return e


def _restarted(clock, slices, props=PROPS, key="j"):
    e = _durable(clock, props, key)
    e.restore(key, [b for _, b in sorted(slices)])
    return e


def test_a_restart_never_loosens_the_limit_nor_repeats_a_dead_letter():
    clock = FakeClock()
    first = _durable(clock)
    slices: list = []
    verdicts = [d.verdict for d in decisions(first, "j", TASK, [rec(f"r{i}") for i in range(4)],
                                                journal=slices)]
    assert [v.action for v in verdicts] == [Action.SKIP] * 4
    assert len(slices) == 1

    again = _restarted(clock, slices)
    # a re-report of a dead-lettered record: known, not dead-lettered again, not counted again
    (d,) = decisions(again, "j", TASK, [rec("r1")])
    assert d.verdict.action == Action.SKIP and not d.dead_letter
    assert again.summary("j").counts.total_record_errors == 4
    # one more error is within the limit (5); the next one is the sixth: the run fails
    (d,) = decisions(again, "j", TASK, [rec("r4")])
    assert d.verdict.action == Action.SKIP and d.dead_letter
    (d,) = decisions(again, "j", TASK, [rec("r5")])
    assert d.verdict.action == Action.FAIL and "max.errors=5" in d.verdict.reason

    # without the kept state the same sequence tolerated 5 more (the 9 under 5)
    fresh = _durable(clock)
    decisions(fresh, "j", TASK, [rec("r4")])
    assert fresh.summary("j").counts.total_record_errors == 1 and not fresh.summary("j").failed


def test_a_failed_run_stays_failed_and_ratio_limits_keep_their_progress():
    clock = FakeClock()
    props = {"errors.tolerance": "all", "errors.tolerance.max.ratio": "0.1",
             "errors.tolerance.min.records": "20"}
    first = _durable(clock, props)
    slices: list = []
    first.record_progress("j", TASK, {T: 30}, journal=slices)
    decisions(first, "j", TASK, [rec("a"), rec("b")], journal=slices)
    first.record_progress("j", TASK, {T: 30}, journal=slices)
    again = _restarted(clock, slices, props)
    s = again.summary("j")
    assert (s.records_processed, s.counts.total_record_errors) == (30, 2)
    # 2 of 30 is within 10%; two more errors (4 of 30) are not, as they would not have been
    answers = decisions(again, "j", TASK, [rec("c"), rec("d")])
    again.record_progress("j", TASK, {T: 30})
    assert again.summary("j").failed or answers[-1].verdict.action == Action.FAIL

    failed_slices: list = []
    f = _durable(clock, {"errors.tolerance": "none"})
    decisions(f, "j", TASK, [rec("x")], journal=failed_slices)
    back = _restarted(clock, failed_slices, {"errors.tolerance": "none"})
    assert back.summary("j").failed
    (d,) = decisions(back, "j", TASK, [rec("y")])
    assert d.verdict.action == Action.FAIL


def test_the_same_id_with_another_payload_stays_another_record_after_a_restart():
    clock = FakeClock()
    first = _durable(clock)
    slices: list = []
    decisions(first, "j", TASK, [rec("p0:r3", b"orders")], journal=slices)
    again = _restarted(clock, slices)
    (d,) = decisions(again, "j", TASK, [rec("p0:r3", b"refunds")])
    assert d.dead_letter and again.summary("j").record_id_collisions == 1


def test_an_undone_dead_letter_is_dead_lettered_again_after_a_restart():
    clock = FakeClock()
    first = _durable(clock)
    slices: list = []
    decisions(first, "j", TASK, [rec("r1")], journal=slices)
    first.undo_dead_letters("j", ["r1"], journal=slices)
    again = _restarted(clock, slices)
    (d,) = decisions(again, "j", TASK, [rec("r1")])
    assert d.dead_letter


def test_a_snapshot_replays_to_the_same_state():
    clock = FakeClock()
    first = _durable(clock)
    slices: list = []
    for i in range(3):
        decisions(first, "j", TASK, [rec(f"r{i}")], journal=slices)
    gen, snap = first.snapshot("j")
    assert gen > max(g for g, _ in slices)
    again = _restarted(clock, [(gen, snap)])
    assert again.summary("j").counts.total_record_errors == 3
    (d,) = decisions(again, "j", TASK, [rec("r2")])
    assert not d.dead_letter


def test_the_store_keeps_slices_in_order_compacts_and_drops(tmp_path):
    store = RunStore(tmp_path / "spool")
    assert stat.S_IMODE(os.stat(store.path).st_mode) == 0o600
    assert store.load("j@r") is None
    assert store.append("j@r", [(1, b"x")]) == 0           # not kept: nothing written
    store.open_run("j@r", "j", "r", b"digest")
    store.append("j@r", [(2, b"bb"), (1, b"a")])
    assert store.load("j@r") == (b"digest", [b"a", b"bb"])  # in their order, not the writes'
    store.compact("j@r", 2, b"SNAP")
    assert store.append("j@r", [(2, b"late"), (3, b"c")]) == len(b"SNAP") + 1
    assert store.load("j@r") == (b"digest", [b"SNAP", b"c"])  # a slice in the snapshot: not again
    store.close()
    reopened = RunStore(tmp_path / "spool")                  # survives the process
    assert reopened.load("j@r") == (b"digest", [b"SNAP", b"c"])
    assert reopened.prune(3600) == 0 and reopened.prune(-1) == 1
    assert reopened.load("j@r") is None
    reopened.open_run("k", "k", "", b"d")
    reopened.drop("k")
    assert reopened.keys() == []


def test_appends_made_during_a_write_are_committed_together_and_each_returns_its_total(
        tmp_path):
    store = RunStore(tmp_path)
    store.open_run("a", "a", "", b"d")
    store.open_run("b", "b", "", b"d")
    begins: list[str] = []
    store._conn.set_trace_callback(lambda sql: begins.append(sql) if sql.startswith("BEGIN")
                                   else None)
    totals: dict[str, int] = {}
    calls = [("a", 1, b"x" * 10), ("b", 1, b"y" * 7), ("a", 2, b"z" * 5), ("gone", 1, b"w")]

    def call(key, gen, blob):
        totals[f"{key}{gen}"] = store.append(key, [(gen, blob)])

    with store._lock:  # a transaction in progress: the calls queue up behind it
        threads = [threading.Thread(target=call, args=c) for c in calls]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 5
        while len(store._queue) < len(calls):
            assert time.monotonic() < deadline
            time.sleep(0.01)
    for t in threads:
        t.join(5)
    assert len(begins) == 1                                 # one commit for the four
    assert totals["gone1"] == 0                             # a run not kept here: not written
    assert totals["b1"] == 7
    assert {totals["a1"], totals["a2"]} <= {10, 15, 5} and max(totals["a1"], totals["a2"]) == 15
    store._conn.set_trace_callback(None)
    assert store.load("a") == (b"d", [b"x" * 10, b"z" * 5])
    assert store.load("b") == (b"d", [b"y" * 7])
    assert store.append("a", [(3, b"q")]) == 16             # the kept total goes on


def test_a_failed_group_commit_is_counted_for_every_append_in_it(tmp_path):
    store = RunStore(tmp_path)
    store.open_run("a", "a", "", b"d")
    store._conn.execute("DROP TABLE slices")                # every write now fails
    assert store.append("a", [(1, b"x")]) == 0
    assert store.write_failures == 1


@pytest.mark.parametrize("n", [1, 50])
def test_one_slice_per_report_and_none_for_a_run_that_is_not_durable(n):
    clock = FakeClock()
    e = _durable(clock, {"errors.tolerance": "all"})
    slices: list = []
    decisions(e, "j", TASK, [rec(f"r{i}") for i in range(n)], journal=slices)
    decisions(e, "j", TASK, [rec("r0")], journal=slices)
    assert [g for g, _ in slices] == [1, 2]
    plain = engine(clock)
    plain.register_job("j", PROPS)
    none: list = []
    decisions(plain, "j", TASK, [rec("r0")], journal=none)
    assert none == []


def test_kept_states_written_under_another_hash_seed_are_dropped_not_misread(tmp_path):
    store = RunStore(tmp_path)
    store.open_run("j@r", "j", "r", b"d")
    store.append("j@r", [(1, b"x")])
    store._conn.execute("UPDATE meta SET value = 'another seed' WHERE name = 'seed'")
    store.close()
    again = RunStore(tmp_path)
    assert again.load("j@r") is None and again.keys() == []


def test_a_run_past_the_compaction_size_is_kept_as_one_snapshot(tmp_path, monkeypatch):
    from spillway.sidecar.service import runstate

    monkeypatch.setattr(runstate, "COMPACT_BYTES", 100)
    clock = FakeClock()
    store = RunStore(tmp_path)
    e = engine(clock)
    e.register_job("j", {"errors.tolerance": "all"})
    store.attach(e, "j", "j", "", b"d", None)
    for i in range(5):
        slices: list = []
        decisions(e, "j", TASK, [rec(f"r{i}")], journal=slices)
        store.persist(e, "j", slices)
    digest, blobs = store.load("j")
    assert len(blobs) == 1                                  # compacted at every write past 100 B
    again = engine(clock)
    again.register_job("j", {"errors.tolerance": "all"})
    store.attach(again, "j", "j", "", b"d", (digest, blobs))
    assert again.summary("j").counts.total_record_errors == 5
    assert not decisions(again, "j", TASK, [rec("r3")])[0].dead_letter


def test_a_snapshot_keeps_the_id_table_as_columns_and_replays_it_whole():
    clock = FakeClock()
    first = _durable(clock, {"errors.tolerance": "all",
                             "errors.deadletterqueue.topic.name": "dlq.x"})
    decisions(first, "j", TASK, [rec(f"r{i}", value=b"v%d" % i) for i in range(3000)])
    decisions(first, "j", TASK,
              [rec(f"r{i}", value=b"v%d" % i) for i in range(0, 3000, 7)])  # touched
    gen, blob = first.snapshot("j")
    entries = pickle.loads(blob)
    assert len(entries) < 10                       # no entry per id: the table as columns
    (table,) = [e for e in entries if e[0] == "I"]
    assert len(table[1]) == len(table[2]) == 8 * 3000 and len(table[3]) == 3000
    again = _restarted(clock, [(gen, blob)], {"errors.tolerance": "all",
                                              "errors.deadletterqueue.topic.name": "dlq.x"})
    a, b = run_state(first, "j").ids, run_state(again, "j").ids
    assert a.keys() == b.keys()                    # same ids, same least-recently-used order
    assert [a.tag(k) for k in a.keys()] == [b.tag(k) for k in b.keys()]
    assert [a.get(k) for k in a.keys()] == [b.get(k) for k in b.keys()]
    (d,) = decisions(again, "j", TASK, [rec("r5", value=b"v5")])
    assert not d.dead_letter                       # already in the DLQ: not again


def test_a_store_of_the_previous_format_is_read_and_one_of_an_unknown_format_dropped(tmp_path):
    from spillway.sidecar.service import runstate

    store = RunStore(tmp_path)
    store.open_run("j@r", "j", "r", b"d")
    store.append("j@r", [(1, b"x")])
    seed = f"{hash(runstate._SEED_PROBE)}"
    store._conn.execute("UPDATE meta SET value = ? WHERE name = 'seed'", (f"{seed}/2",))
    store.close()
    again = RunStore(tmp_path)                     # an upgrade: what format 2 wrote is kept
    assert again.load("j@r") == (b"d", [b"x"])
    again._conn.execute("UPDATE meta SET value = ? WHERE name = 'seed'", (f"{seed}/99",))
    again.close()
    newer = RunStore(tmp_path)                     # a format it does not know: dropped
    assert newer.load("j@r") is None
