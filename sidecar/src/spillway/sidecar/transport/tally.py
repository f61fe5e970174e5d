"""The home protocol in columns (TallyFailures): protobuf <-> core values, both ends.

A node sidecar sends the job's home a report's job-wide part only (`tally_report`): record ids,
payload digests (8 bytes each, keyed by the run) and each group of records failing the same way
once (stage, function, exception without its stack trace); never payloads, headers or stack
traces. The home reads the ids, digests and groups (`tally_groups`: one exception and stage
value per group), decides them with the same algorithm as any report (in streaks,
`core/streaks.py`), and answers the verdicts as columns (`tally_streak_verdicts`): one byte of
action, category and flags per record, the distinct reasons and rules once each with an index
per record. The node turns them back into
verdicts (`tally_outcomes`) and dead-letters and logs with the records it holds.
docs/POLICY.md, "The home protocol", says why this decides exactly what ReportFailures does.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from itertools import repeat
from typing import NamedTuple

from spillway.client.columns import (  # the wire's column codec and flags, shared
    BUDGET_EXHAUSTED,
    DEAD_LETTER,
    DEAD_LETTERED,
    JOB_FAILED,
    pack_le,
    unpack_le,
)
from spillway.sidecar.core import model as m
from spillway.sidecar.core.streaks import Group
from spillway.sidecar.transport import convert
from spillway.v1 import sidecar_pb2 as pb

LOGGED = 16   # TallyVerdicts.flags: the home wrote the record's error log line


# --- node side --------------------------------------------------------------------------------

def tally_report(task: pb.TaskIdentity, records: Sequence, digests: bytes) -> pb.TallyReport:
    """One report's job-wide part. `records`: its converted records (records failing the same
    way share one exception value, `convert.failed_records`); `digests`: their payload
    digests, packed (`PolicyEngine.payload_digests`)."""
    out = pb.TallyReport(record_ids=[r.record_id for r in records], payload_digests=digests)
    out.task.CopyFrom(task)
    add = out.groups.add
    group = None
    prev = (None, None, None)
    for r in records:
        fn = r.function_name
        if r.exception is prev[0] and r.stage is prev[1] and fn == prev[2]:
            group.count += 1
            continue
        prev = (r.exception, r.stage, fn)
        ref = r.stage
        group = add(count=1, stage=convert.STAGE_TO_PB[ref.stage], custom_stage=ref.custom,
                    function_name=fn, exception=convert.exception_pb(r.exception))
    return out


class Answer(NamedTuple):
    """One record's verdict columns, read back (all but its id)."""

    action: m.Action
    category: m.Category
    reason: str
    attempt: int
    flags: int
    delay: int | None   # retry delay, ms (None: the report has no delay column)
    rule: str


class AlikeOutcomes(Sequence):
    """`tally_outcomes` of a report whose records the home answered alike, every column the
    same (a confirmation's usual answer: all new data errors, dead-lettered). The confirmer
    reads the shared answer (`action`, `dead_letter`, `logged`) without a Verdict and a
    Decision per record (~2 µs a record on a node, `confirm.py`); an item is made when asked
    for, a fresh one each time (verdicts are mutable)."""

    __slots__ = ("record_ids", "answer", "action", "flags")

    def __init__(self, record_ids: Sequence[str], answer: Answer) -> None:
        self.record_ids, self.answer = record_ids, answer
        self.action, self.flags = answer.action, answer.flags

    @property
    def dead_letter(self) -> bool:
        return bool(self.flags & DEAD_LETTER)

    @property
    def logged(self) -> bool:
        return bool(self.flags & LOGGED)

    def __len__(self) -> int:
        return len(self.record_ids)

    def __iter__(self):   # (Sequence's own goes by IndexError)
        return map(self.__getitem__, range(len(self.record_ids)))

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(len(self)))]
        return _outcome(self.record_ids[i], self.answer)


def _outcome(rid: str, answer: Answer | tuple):
    """One record's (decision, logged, rule) from its id and its columns' values."""
    action, category, reason, attempt, f, delay, rule = answer
    v = m.Verdict(rid, action, category, reason, attempt)
    if f:
        v.dead_lettered = bool(f & DEAD_LETTERED)
        v.job_failed = bool(f & JOB_FAILED)
        v.retry_budget_exhausted = bool(f & BUDGET_EXHAUSTED)
    if delay is not None:
        v.retry_delay_ms = delay
    return (m.Decision(v, bool(f & DEAD_LETTER)), bool(f & LOGGED), rule)


def tally_outcomes(resp: pb.TallyVerdicts, record_ids: Sequence[str]):
    """The home's answers as (decision, logged, rule) per record (an `AlikeOutcomes` when
    every record got the same answer); ValueError if the columns do not match the report (a
    home that answered another question)."""
    n = len(record_ids)
    actions, categories, flags = resp.actions, resp.categories, resp.flags
    attempts = unpack_le("I", resp.attempts)
    reason_ix = unpack_le("I", resp.reason_index)
    rule_ix = unpack_le("I", resp.rule_index)
    delays = unpack_le("Q", resp.retry_delays_ms) if resp.retry_delays_ms else None
    if (len(actions) != n or len(categories) != n or len(flags) != n or len(attempts) != n
            or len(reason_ix) != n or len(rule_ix) != n
            or (delays is not None and len(delays) != n)):
        raise ValueError(f"TallyVerdicts: columns do not have one entry per record ({n})")
    reasons, rules = list(resp.reasons), list(resp.rules)
    if (reason_ix and max(reason_ix) >= len(reasons)) or (rule_ix and max(rule_ix) >= len(rules)):
        raise ValueError("TallyVerdicts: an index past its table")
    action_of, category_of = convert.ACTION_FROM_PB, convert.CATEGORY_FROM_PB
    if (n and actions.count(actions[:1]) == n and categories.count(categories[:1]) == n
            and flags.count(flags[:1]) == n and attempts.count(attempts[0]) == n
            and reason_ix.count(reason_ix[0]) == n and rule_ix.count(rule_ix[0]) == n
            and (delays is None or delays.count(delays[0]) == n)):
        return AlikeOutcomes(record_ids, Answer(
            action_of[actions[0]], category_of[categories[0]], reasons[reason_ix[0]],
            attempts[0], flags[0], delays[0] if delays is not None else None,
            rules[rule_ix[0]]))
    # each record's columns as one tuple, made by zip (in C; `_outcome` unpacks it)
    answers = zip(map(action_of.__getitem__, actions), map(category_of.__getitem__, categories),
                  map(reasons.__getitem__, reason_ix), attempts, flags,
                  delays if delays is not None else repeat(None), map(rules.__getitem__, rule_ix))
    return [_outcome(rid, a) for rid, a in zip(record_ids, answers)]


# --- home side --------------------------------------------------------------------------------

def tally_groups(req: pb.TallyReport, where: str = "reports[0]"
                 ) -> tuple[list[str], array, list[Group]]:
    """The report's record ids, payload digests and groups (stage, exception, function,
    count): one exception and stage value per group (ValueError naming the first invalid
    field; bounds are `validate.tally_failures`')."""
    groups: list[Group] = []
    for g, group in enumerate(req.groups):
        at = f"{where}.groups[{g}]"
        groups.append((convert.stage_ref(group.stage, group.custom_stage, at),
                       convert.exception_value(group.exception, at), group.function_name,
                       group.count))
    return list(req.record_ids), unpack_le("Q", req.payload_digests), groups


def tally_streak_verdicts(streaks, grant: pb.BudgetSlice | None = None) -> pb.TallyVerdicts:
    """A report's answers from `PolicyEngine.decide_tallies`, (outcome, records) streaks, as
    TallyVerdicts (with the budget slice granted to the report, if any)."""
    out = encode_streaks([((d.verdict, d.dead_letter, logged, rule), n)
                          for (d, logged, rule), n in streaks], rules=True)
    if grant is not None:
        out.grant.CopyFrom(grant)
    return out


def _joined(streaks, rules: bool) -> list:
    """`streaks` with neighbours whose records get the same columns made one (records decided
    one by one that still read alike, e.g. a streak's, share one reason object)."""
    out: list = []
    pv = pdl = plogged = prule = None
    for streak in streaks:
        (v, dl, logged, rule), k = streak
        if (pv is not None and dl == pdl and logged == plogged
                and (not rules or rule == prule) and v.reason is pv.reason
                and v.action is pv.action and v.category is pv.category
                and v.attempt == pv.attempt and v.dead_lettered == pv.dead_lettered
                and v.job_failed == pv.job_failed
                and v.retry_budget_exhausted == pv.retry_budget_exhausted
                and v.retry_delay_ms == pv.retry_delay_ms):
            out[-1] = (out[-1][0], out[-1][1] + k)
            continue
        out.append(streak)
        pv, pdl, plogged, prule = v, dl, logged, rule
    return out


def encode_streaks(streaks, *, rules: bool) -> pb.TallyVerdicts:
    """((verdict, dead_letter, logged, rule), records) streaks, in order, as TallyVerdicts
    columns: a streak's records get the same verdict, written once per streak (neighbours
    that read alike joined first)."""
    streaks = _joined(streaks, rules)
    n = sum(k for _, k in streaks)
    actions, categories, flags = bytearray(n), bytearray(n), bytearray(n)
    attempts, delays = array("I", bytes(4 * n)), None
    reason_ix, rule_ix = array("I", bytes(4 * n)), array("I", bytes(4 * n))
    reasons: dict[str, int] = {}
    rule_names: dict[str, int] = {}
    action_pb, category_pb = convert.ACTION_TO_PB, convert.CATEGORY_TO_PB
    last_reason, last_ix = None, 0
    i = 0
    for (v, dead_letter, logged, rule), k in streaks:
        f = LOGGED if logged else 0
        if dead_letter:
            f |= DEAD_LETTER
        if v.dead_lettered:
            f |= DEAD_LETTERED
        if v.job_failed:
            f |= JOB_FAILED
        if v.retry_budget_exhausted:
            f |= BUDGET_EXHAUSTED
        reason = v.reason
        if reason is not last_reason:   # records decided alike share one reason string
            last_reason = reason
            last_ix = reasons.setdefault(reason, len(reasons))
        rix = rule_names.setdefault(rule, len(rule_names)) if rules else 0
        if v.retry_delay_ms and delays is None:
            delays = array("Q", bytes(8 * n))
        if k == 1:
            actions[i] = action_pb[v.action]
            categories[i] = category_pb[v.category]
            flags[i] = f
            attempts[i] = v.attempt
            reason_ix[i] = last_ix
            rule_ix[i] = rix
            if v.retry_delay_ms:
                delays[i] = int(v.retry_delay_ms)
        else:
            end = i + k
            actions[i:end] = bytes((action_pb[v.action],)) * k
            categories[i:end] = bytes((category_pb[v.category],)) * k
            flags[i:end] = bytes((f,)) * k
            attempts[i:end] = array("I", (v.attempt,)) * k
            reason_ix[i:end] = array("I", (last_ix,)) * k
            rule_ix[i:end] = array("I", (rix,)) * k
            if v.retry_delay_ms:
                delays[i:end] = array("Q", (int(v.retry_delay_ms),)) * k
        i += k
    out = pb.TallyVerdicts(
        actions=bytes(actions), categories=bytes(categories), flags=bytes(flags),
        attempts=pack_le(attempts), retry_delays_ms=pack_le(delays) if delays else b"",
        reasons=list(reasons), reason_index=pack_le(reason_ix))
    if rules:
        out.rules.extend(rule_names)
        out.rule_index = pack_le(rule_ix)
    return out


__all__ = ["AlikeOutcomes", "Answer", "encode_streaks", "tally_groups", "tally_outcomes",
           "tally_report", "tally_streak_verdicts"]
