"""Provisional verdicts (core/provisional.py) and claims at the home (`Tally.claim`):
a node's answer before its home's is the home's answer to a record it meets first, offered only
when nothing but identity decides; a home asked again under the same claim answers as the
first time (the claimant writes the record), under another as "already in the DLQ"; claims
survive re-reports, undos and a replay of the run's journal."""

from __future__ import annotations

import pytest
from spillway.sidecar.core.model import Action, Category, ExceptionInfo, FailedRecord, TaskIdentity
from spillway.sidecar.core.policy import PolicyEngine
from support.deciding import Tally, decisions, tally
from support.engines import journaled, run_state

DATA = ExceptionInfo("json.decoder.JSONDecodeError",
                     ("json.decoder.JSONDecodeError", "builtins.ValueError",
                      "builtins.Exception"), "Expecting value")
OTHER = ExceptionInfo("builtins.KeyError",
                      ("builtins.KeyError", "builtins.LookupError", "builtins.Exception"),
                      "'price'")
RETRIABLE = ExceptionInfo("builtins.TimeoutError",
                          ("builtins.TimeoutError", "builtins.OSError", "builtins.Exception"),
                          "timed out")
BASE = {"errors.tolerance": "all", "errors.deadletterqueue.topic.name": "dlq.t"}
TASK = TaskIdentity(stage_id=1, partition_id=0, attempt_number=0, task_attempt_id=7)


def _stage():
    from spillway.sidecar.transport import convert
    from spillway.v1 import sidecar_pb2 as pb
    return convert.stage_ref(pb.STAGE_TRANSFORMATION, "", "t")


def _records(ids, exc=DATA) -> list[FailedRecord]:
    stage = _stage()
    return [FailedRecord(rid, stage, exc, "parse", tag=7) for rid in ids]


def _tally(e: PolicyEngine, key: str, ids, claim: int, exc=DATA):
    """(dead_letter, dead_lettered, action) per record of a tally under `claim`."""
    stage = _stage()
    streaks = tally(e, key, Tally(TASK, list(ids), [7] * len(ids),
                                  [(stage, exc, "parse", len(ids))], claim), [])
    out = []
    for (d, _logged, _rule), n in streaks:
        out += [(d.dead_letter, d.verdict.dead_lettered, d.verdict.action)] * n
    return out


NEW = (True, False, Action.SKIP)
ALREADY = (False, True, Action.SKIP)


def test_the_provisional_verdict_is_the_homes_answer_to_a_first_seen_record():
    e, key = journaled(BASE)
    records = _records([f"r{i}" for i in range(5)]) + _records(["k1"], OTHER)
    spans = e.provisional(key, records)
    # records failing the same way share one verdict: a span of them, with no record id
    assert [n for _, n in spans] == [5, 1] and all(v.record_id == "" for v, _ in spans)
    provisional = [(r.record_id, v) for r, v in zip(records, (v for v, n in spans
                                                              for _ in range(n)))]
    home = [d.verdict for d in decisions(e, key, TASK, records)]
    assert [(rid, v.action, v.category, v.reason, v.attempt) for rid, v in provisional] == \
        [(v.record_id, v.action, v.category, v.reason, v.attempt) for v in home]
    assert all(v.action is Action.SKIP and v.category is Category.DATA for _, v in provisional)


@pytest.mark.parametrize("props, records", [
    ({**BASE, "errors.tolerance.max.errors": "10"}, None),        # a limit may fail the run
    ({"errors.tolerance": "none", "errors.deadletterqueue.topic.name": "dlq.t"}, None),
    ({"errors.tolerance": "all"}, None),                            # no DLQ: nothing to hold
    (BASE, "retriable"),                                            # retried, not skipped
], ids=["limit", "tolerance-none", "no-dlq", "retriable"])
def test_no_provisional_verdict_where_the_home_could_answer_otherwise(props, records):
    e, key = journaled(props)
    recs = _records(["a", "b"])
    if records == "retriable":
        recs.append(_records(["c"], RETRIABLE)[0])
    assert e.provisional(key, recs) is None


def test_no_provisional_verdict_once_the_run_failed():
    e, key = journaled(BASE)
    run_state(e, key).fail("stopped")
    assert e.provisional(key, _records(["a"])) is None


def test_the_same_claim_asked_again_is_answered_as_the_first_time():
    e, key = journaled(BASE)
    ids = [f"r{i}" for i in range(50)]
    assert _tally(e, key, ids, claim=11) == [NEW] * 50
    # the claimant, restarted before it released its copy, asks again: it still writes them
    assert _tally(e, key, ids, claim=11) == [NEW] * 50
    # another node's copy (a speculative attempt) is already in the DLQ
    assert _tally(e, key, ids, claim=12) == [ALREADY] * 50
    # a task re-run through the synchronous path (no claim): already in the DLQ
    assert _tally(e, key, ids, claim=0) == [ALREADY] * 50
    # the claim outlives those re-reports
    assert _tally(e, key, ids, claim=11) == [NEW] * 50
    summary = e.summary(key)
    assert summary.counts.total_record_errors == 50          # counted once, whoever asked


def test_a_claim_survives_an_undo_and_a_replay_of_the_journal():
    e, key = journaled(BASE)
    journal: list = []
    stage = _stage()
    tally(e, key, Tally(TASK, ["a", "b"], [7, 7], [(stage, DATA, "parse", 2)], 5), journal)
    e.undo_dead_letters(key, ["a"], journal=journal)
    fresh, fkey = journaled(BASE)
    fresh.restore(fkey, [blob for _gen, blob in journal])
    assert _tally(fresh, fkey, ["a", "b"], claim=5) == [NEW, NEW]
    assert _tally(fresh, fkey, ["b"], claim=6) == [ALREADY]


def test_claims_do_not_change_what_an_unclaimed_report_is_answered():
    e, key = journaled(BASE)
    ids = [f"r{i}" for i in range(10)]
    assert _tally(e, key, ids, claim=0) == [NEW] * 10
    assert _tally(e, key, ids, claim=0) == [ALREADY] * 10
    assert _tally(e, key, ids, claim=9) == [ALREADY] * 10   # not its claim
