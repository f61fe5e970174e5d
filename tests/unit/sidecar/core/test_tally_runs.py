"""A home's tally decided from its columns in streaks (`core.streaks.tally_streaks`, what
TallyFailures does) answers exactly what a report of the same records answers (a payload-less
record per id, `_tally_records`, then `PolicyEngine.decide`, one outcome per record): the same
verdict columns, the same counts and remembered ids, the same journal slices. Drawn over
policies with and without streaks (tolerance limits, errors.tolerance=none, no DLQ, logging),
ids reported again, with another payload (collisions), records failing alike across groups and
retriable errors between them."""

from __future__ import annotations

import pickle
import random

import pytest
from spillway.sidecar.core.model import FailedRecord, TaskIdentity
from spillway.sidecar.transport import tally
from spillway.v1 import sidecar_pb2 as pb
from support.deciding import Tally, outcomes
from support.deciding import tally as tally_at_home
from support.engines import journaled, run_state

POLICIES = [
    {"errors.tolerance": "all", "errors.deadletterqueue.topic.name": "dlq.t"},
    {"errors.tolerance": "all", "errors.deadletterqueue.topic.name": "dlq.t",
     "errors.log.enable": "true"},
    {"errors.tolerance": "all"},
    {"errors.tolerance": "all", "errors.tolerance.max.errors": "40",
     "errors.deadletterqueue.topic.name": "dlq.t"},
    # room for several reports (counted at their end, in streaks), then one that crosses it
    {"errors.tolerance": "all", "errors.tolerance.max.errors": "600",
     "errors.deadletterqueue.topic.name": "dlq.t"},
    {"errors.tolerance": "none"},
    {"errors.tolerance": "all", "errors.retry.max.retries": "2",
     "errors.deadletterqueue.topic.name": "dlq.t"},
]

_DATA = pb.ExceptionInfo(class_name="json.decoder.JSONDecodeError", message="Expecting value",
                         class_chain=["json.decoder.JSONDecodeError", "builtins.ValueError",
                                      "builtins.Exception", "builtins.BaseException"])
_OTHER_DATA = pb.ExceptionInfo(class_name="builtins.KeyError", message="'price'",
                               class_chain=["builtins.KeyError", "builtins.LookupError",
                                            "builtins.Exception", "builtins.BaseException"])
_RETRIABLE = pb.ExceptionInfo(class_name="builtins.TimeoutError", message="timed out",
                              class_chain=["builtins.TimeoutError", "builtins.OSError",
                                           "builtins.Exception", "builtins.BaseException"])
_KINDS = [_DATA, _DATA, _DATA, _OTHER_DATA, _RETRIABLE]


def _report(rng: random.Random, n_ids: int) -> pb.TallyReport:
    rep = pb.TallyReport()
    rep.task.stage_id = rng.randrange(3)
    rep.task.partition_id = rng.randrange(4)
    rep.task.attempt_number = rng.randrange(2)
    ids, digests = [], bytearray()
    for _ in range(rng.randrange(1, 5)):
        count = rng.randrange(1, 40)
        rep.groups.add(count=count, stage=rng.choice([1, 1, 1, 6]), function_name="parse",
                       exception=rng.choice(_KINDS))
        for _ in range(count):
            ids.append(f"t-0-{rng.randrange(n_ids)}")
            # mostly the id's own payload; now and then another one (a collision)
            tag = hash(ids[-1]) & 0xFFFF if rng.random() < 0.9 else rng.randrange(1 << 64)
            digests += tag.to_bytes(8, "little")
    rep.record_ids.extend(ids)
    rep.payload_digests = bytes(digests)
    return rep


def _tally_records(rep: pb.TallyReport) -> list[FailedRecord]:
    """The reference: one payload-less record per id, sharing its group's values."""
    ids, digests, groups = tally.tally_groups(rep)
    out: list[FailedRecord] = []
    i = 0
    for stage, exc, fn, n in groups:
        out.extend(FailedRecord(ids[j], stage, exc, fn, tag=digests[j]) for j in range(i, i + n))
        i += n
    return out


def _tally_verdicts(answers) -> pb.TallyVerdicts:
    return tally.tally_streak_verdicts([(o, 1) for o in answers])


def _expanded(entries: list) -> list:
    """Journal entries with each stretch of new ids (an ``"n"`` entry, `IdTable.add_new`'s) as
    the ``"i"`` entry per id that `IdTable.add` writes: the same changes, in the same order."""
    from spillway.sidecar.core.idtable import _from_le

    out: list = []
    for e in entries:
        if e[0] == "n":
            out.extend(("i", k, e[3], t) for k, t in zip(_from_le(e[1]), _from_le(e[2]),
                                                         strict=True))
        else:
            out.append(e)
    return out


def _slices(journal: list) -> list:
    return [(gen, _expanded(pickle.loads(blob))) for gen, blob in journal]


@pytest.mark.parametrize("policy", range(len(POLICIES)))
@pytest.mark.parametrize("seed", range(12))
def test_streaks_answer_what_the_record_by_record_path_answers(policy, seed):
    rng = random.Random(seed * 100 + policy)
    props = POLICIES[policy]
    old, key = journaled(props)
    new, _ = journaled(props)
    n_ids = rng.choice([30, 200, 5000])
    kept: list = []
    for _ in range(rng.randrange(3, 12)):
        rep = _report(rng, n_ids)
        task = TaskIdentity(stage_id=rep.task.stage_id, partition_id=rep.task.partition_id,
                            attempt_number=rep.task.attempt_number)
        j_old: list = []
        j_new: list = []
        want = _tally_verdicts(outcomes(old, key, task, _tally_records(rep), j_old))
        got = tally.tally_streak_verdicts(tally_at_home(
            new, key, Tally(task, *tally.tally_groups(rep)), j_new))
        assert got == want
        assert _slices(j_new) == _slices(j_old)
        assert new.summary(key) == old.summary(key)
        kept.extend(blob for _, blob in j_new)
    assert old._jobs[key].ids.keys() == new._jobs[key].ids.keys()
    assert old._jobs[key].records.keys() == new._jobs[key].records.keys()
    # what a restarted home replays from the journal slices is the state they describe
    again, _ = journaled(props)
    again.restore(key, kept)
    ids, want = run_state(again, key).ids, run_state(new, key).ids
    assert ids.keys() == want.keys() and [ids.tag(k) for k in ids.keys()] == [
        want.tag(k) for k in want.keys()] and [ids.get(k) for k in ids.keys()] == [
        want.get(k) for k in want.keys()]
    assert again.summary(key) == new.summary(key)


@pytest.mark.parametrize("policy", range(len(POLICIES)))
@pytest.mark.parametrize("seed", range(6))
def test_a_sidecars_own_report_in_streaks_answers_what_record_by_record_answers(policy, seed):
    """A sidecar deciding its own report (`PolicyEngine.decide`, ReportFailures of a run homed
    there) answers a streak of records decided alike once: given one outcome per record
    (`per_record`), the same answers, counts, remembered ids and journal as the same report
    answered per record (`support.deciding.outcomes`), and the same verdict columns."""
    from spillway.sidecar.core.decide import per_record

    rng = random.Random(seed * 100 + policy + 7)
    props = POLICIES[policy]
    old, key = journaled(props)
    new, _ = journaled(props)
    n_ids = rng.choice([30, 200, 5000])
    streaks_seen = records_seen = 0
    for _ in range(rng.randrange(3, 12)):
        rep = _report(rng, n_ids)
        task = TaskIdentity(stage_id=rep.task.stage_id, partition_id=rep.task.partition_id,
                            attempt_number=rep.task.attempt_number)
        records = _tally_records(rep)
        j_old: list = []
        j_new: list = []
        want = outcomes(old, key, task, records, j_old)
        streaks = new.decide(key, task, records, j_new)
        got = per_record(streaks, records)
        assert [(o[0].verdict, o[0].dead_letter, o[1], o[2]) for o in got] == [
            (o[0].verdict, o[0].dead_letter, o[1], o[2]) for o in want]
        assert tally.tally_streak_verdicts(streaks) == _tally_verdicts(want)
        assert _slices(j_new) == _slices(j_old)
        assert new.summary(key) == old.summary(key)
        streaks_seen += len(streaks)
        records_seen += len(records)
    assert run_state(old, key).ids.keys() == run_state(new, key).ids.keys()
    if "max.errors" not in str(props) and props["errors.tolerance"] == "all" \
            and "errors.retry.max.retries" not in props:
        assert streaks_seen < records_seen   # streaks answered once


@pytest.mark.parametrize("policy", range(len(POLICIES)))
@pytest.mark.parametrize("seed", range(4))
def test_a_calls_reports_decided_together_answer_what_one_by_one_answers(policy, seed):
    """TallyFailures decides a call's reports under one hold of the run's lock and takes the
    run's journal once (`decide_tallies`): each report answers what it answers alone, in
    order, with the same counts and remembered ids, and the one slice replays to the state
    the per-report slices replay to."""
    rng = random.Random(seed * 100 + policy + 13)
    props = POLICIES[policy]
    one, key = journaled(props)
    calls, _ = journaled(props)
    n_ids = rng.choice([30, 200, 5000])
    kept_one: list = []
    kept_calls: list = []
    for _ in range(rng.randrange(2, 5)):
        reports = [_report(rng, n_ids) for _ in range(rng.randrange(1, 6))]
        tallies = []
        for rep in reports:
            task = TaskIdentity(stage_id=rep.task.stage_id, partition_id=rep.task.partition_id,
                                attempt_number=rep.task.attempt_number)
            tallies.append(Tally(task, *tally.tally_groups(rep)))
        want = []
        for t in tallies:
            journal: list = []
            want.append(tally.tally_streak_verdicts(tally_at_home(one, key, t, journal)))
            kept_one.extend(blob for _, blob in journal)
        journal = []
        entered: list[int] = []

        class _Around:
            def __init__(self, i: int) -> None:
                entered.append(i)

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                return False

        got = calls.decide_tallies(key, tallies, journal, _Around)
        assert [tally.tally_streak_verdicts(streaks) for streaks in got] == want
        assert entered == list(range(len(tallies)))   # one context per report, in order
        assert len(journal) == 1                       # one slice for the call
        kept_calls.extend(blob for _, blob in journal)
        assert calls.summary(key) == one.summary(key)
    assert run_state(calls, key).ids.keys() == run_state(one, key).ids.keys()
    assert run_state(calls, key).records.keys() == run_state(one, key).records.keys()
    a, _ = journaled(props)
    a.restore(key, kept_one)
    b, _ = journaled(props)
    b.restore(key, kept_calls)
    assert b.summary(key) == a.summary(key)
    ids, want_ids = run_state(b, key).ids, run_state(a, key).ids
    assert ids.keys() == want_ids.keys() and [ids.get(k) for k in ids.keys()] == [
        want_ids.get(k) for k in want_ids.keys()]


def test_a_streak_is_answered_once_with_its_length():
    e, key = journaled(POLICIES[0])
    rep = pb.TallyReport(record_ids=[f"t-0-{i}" for i in range(256)],
                         payload_digests=b"".join(i.to_bytes(8, "little") for i in range(256)))
    rep.groups.add(count=256, stage=1, function_name="parse", exception=_DATA)
    streaks = tally_at_home(e, key, Tally(TaskIdentity(stage_id=0, partition_id=0,
                                                        attempt_number=0),
                                           *tally.tally_groups(rep)))
    assert [n for _, n in streaks] == [1, 255]     # the first decided, the rest its streak
    v = tally.tally_streak_verdicts(streaks)
    assert len(v.actions) == 256 and len(set(v.actions)) == 1 and list(v.reasons) == [
        streaks[0][0][0].verdict.reason]
    assert e.summary(key).counts.total_records_skipped == 256


@pytest.mark.parametrize("limit", [8, 100, 5000])
def test_add_new_is_contains_then_add_for_each_key_until_a_present_one(limit):
    from array import array

    from spillway.sidecar.core.idtable import IdTable

    rng = random.Random(limit)
    plain, bulk = IdTable(limit), IdTable(limit)
    plain.journal, bulk.journal = [], []
    pool = [rng.getrandbits(60) for _ in range(limit * 3)]
    for _ in range(60):
        keys = [rng.choice(pool) for _ in range(rng.randrange(1, 200))]
        tags = array("Q", [rng.getrandbits(64) for _ in keys])
        start = rng.randrange(len(keys))
        added = 0
        for p in range(start, len(keys)):
            if keys[p] in plain:
                break
            plain.add(keys[p], "v", tags[p])
            added += 1
        assert bulk.add_new(keys, tags, "v", start, len(keys)) == added
        assert bulk.keys() == plain.keys() and _expanded(bulk.journal) == plain.journal
        assert [bulk.tag(k) for k in pool] == [plain.tag(k) for k in pool]
        assert len(bulk) == len(plain) and bulk.evicted == plain.evicted
        if rng.random() < 0.3:                  # other operations in between
            k = rng.choice(pool)
            for t in (plain, bulk):
                t.pop(k)


def test_add_new_takes_keys_and_tags_in_any_sequence():
    from array import array

    from spillway.sidecar.core.idtable import IdTable

    plain, bulk = IdTable(100), IdTable(100)
    for k in range(10):
        plain.add(k, "v", 100 + k)
    assert bulk.add_new(array("L", range(10)), array("I", range(100, 110)), "v", 0, 10) == 10
    assert bulk.keys() == plain.keys() and [bulk.tag(k) for k in range(10)] == list(
        range(100, 110))


def _spelled_out(outcomes) -> list:
    """Outcomes as plain values (verdicts compared field by field)."""
    return [(d.verdict, d.dead_letter, logged, rule) for d, logged, rule in outcomes]


@pytest.mark.parametrize("seed", range(20))
def test_a_node_reads_an_answer_alike_for_every_record_as_the_records_one_by_one(seed):
    """`tally_outcomes` gives an `AlikeOutcomes` only when every column is the same for every
    record, and its items are what the record-by-record reading makes."""
    from spillway.sidecar.core.model import Action, Category, Decision, Verdict

    rnd = random.Random(seed)
    n = rnd.choice([1, 2, 7, 256])
    ids = [f"r-{seed}-{i}" for i in range(n)]
    kinds = [
        (Verdict("", Action.SKIP, Category.DATA, "skipped, dead-lettered", 1), True, False, ""),
        (Verdict("", Action.SKIP, Category.DATA, "already in the DLQ", 2, dead_lettered=True),
         False, True, "r1"),
        (Verdict("", Action.FAIL, Category.DATA, "job failed", 1, job_failed=True), False,
         False, "r2"),
        (Verdict("", Action.RETRY, Category.RETRIABLE, "retry 1 in 50 ms", 1,
                 retry_delay_ms=50, retry_budget_exhausted=True), False, False, "r3"),
    ]
    alike = rnd.random() < 0.5
    first = rnd.randrange(len(kinds))
    picks = [first if alike else rnd.randrange(len(kinds)) for _ in range(n)]
    streaks = [((Decision(Verdict(rid, *[getattr(kinds[k][0], f) for f in
                                      ("action", "category", "reason", "attempt",
                                       "retry_delay_ms", "dead_lettered", "job_failed",
                                       "retry_budget_exhausted")]), kinds[k][1]),
               kinds[k][2], kinds[k][3]), 1) for rid, k in zip(ids, picks, strict=True)]
    resp = tally.tally_streak_verdicts(streaks)
    got = tally.tally_outcomes(resp, ids)
    uniform = len(set(picks)) == 1
    assert (type(got) is tally.AlikeOutcomes) == uniform
    want = [(d.verdict, d.dead_letter, logged, rule) for (d, logged, rule), _ in streaks]
    assert _spelled_out(got) == want
    assert len(got) == n
    if uniform:
        kind = kinds[picks[0]]
        assert got.action is kind[0].action
        assert got.dead_letter is kind[1] and got.logged is kind[2]
        assert _spelled_out(got[1:3]) == want[1:3]
        assert got[0][0].verdict is not got[0][0].verdict   # a fresh verdict each time


def test_an_alike_answer_of_the_wrong_length_is_refused():
    from spillway.sidecar.core.model import Action, Category, Decision, Verdict

    streaks = [((Decision(Verdict("a", Action.SKIP, Category.DATA, "s", 1), True), False, ""),
              3)]
    resp = tally.tally_streak_verdicts(streaks)
    with pytest.raises(ValueError, match="one entry per record"):
        tally.tally_outcomes(resp, ["a", "b"])
