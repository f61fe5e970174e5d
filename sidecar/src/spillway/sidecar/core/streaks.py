"""A home's tally decided from its columns (TallyFailures), in streaks.

A *streak* is consecutive records decided alike: `decide.Decider.decide` decides a report
record by record, except along a streak: records failing the same way as a first-seen data
error just skipped, which get its answer (their id remembered, their counts added together at
the end of the streak) as one `Streak`, the answer and its length. A tally arrives as columns
(record ids, payload digests, and each group of records failing the same way once), and the
answers go back as columns in which a streak's records differ in nothing. So here a streak's
records are not made into `FailedRecord`, `Decision` or `Verdict` objects at all: each costs its
id's digest and its insert into the run's id table (`IdTable.add_new`, one call for the streak
while no record of it is retrying), and the streak is answered once with its length. Every
other record is decided by `decide_one` exactly as `Decider.decide` would.

The answers are the same as `Decider.decide`'s over one payload-less `FailedRecord` per id,
state, counts and journal included (tests/unit/sidecar/core/test_tally_runs.py checks it).
"""

from __future__ import annotations

from collections.abc import Sequence

from .batch import Batch
from .decide import Decider, Streak, count_streak, streak_start, streaks_allowed
from .idtable import digests
from .jobstate import JobState
from .model import Action, Category, Decision, ExceptionInfo, FailedRecord, StageRef, Verdict

# a group of a tally: records failing the same way, in order (stage, exception, function, count)
Group = tuple[StageRef, ExceptionInfo, str, int]


def tally_streaks(decider: Decider, j: JobState, b: Batch, ids: Sequence[str],
                  tags: Sequence[int], groups: Sequence[Group]) -> list[Streak]:
    """The answers for a tally's records (``ids[k]`` with payload digest ``tags[k]``, in
    `groups`' order), under the run's lock."""
    out: list[Streak] = []
    append = out.append
    decide_one = decider.decide_one
    b.unchecked = j.tolerance.room_for(len(ids))
    if not streaks_allowed(j, b):
        x = 0
        for stage, exc, fn, n in groups:
            for k in range(x, x + n):
                append((decide_one(j, b, FailedRecord(ids[k], stage, exc, fn, tag=tags[k])),
                        1))
            x += n
        return out
    known, tracked = j.ids, j.records
    logged = j.settings.log_enable
    dead_letter = j.settings.dlq.enabled
    streak_exc = streak_ref = info = streak = None
    pending = 0
    x = 0
    for stage, exc, fn, n in groups:
        k, end = x, x + n
        keys = gtags = None   # the group's id digests and payload tags, once it has a streak
        while k < end:
            if exc is streak_exc and stage is streak_ref:
                if keys is None:
                    keys = digests(ids[x:end])   # record_key of each
                    gtags = tags[x:end]
                if not len(tracked):   # nothing retrying: only `known` can end the streak
                    added = known.add_new(keys, gtags, info, k - x, end - x)
                    pending += added
                    k += added
                    if k == end:
                        break
                else:
                    key = keys[k - x]
                    if key not in known and tracked.get(key) is None:
                        known.add(key, info, tags[k])
                        pending += 1
                        k += 1
                        continue
            if pending:
                count_streak(b, streak_exc, pending, dead_letter, logged)
                append((streak, pending))
                pending = 0
            o = decide_one(j, b, FailedRecord(ids[k], stage, exc, fn, tag=tags[k]))
            append((o, 1))
            k += 1
            streak_exc = None
            start = streak_start(j, b, o)
            if start is not None:
                reason, info, rule = start
                streak_exc, streak_ref = exc, stage
                streak = (Decision(Verdict("", Action.SKIP, Category.DATA, reason, 1),
                                   dead_letter), logged, rule)
        x = end
    if pending:
        count_streak(b, streak_exc, pending, dead_letter, logged)
        append((streak, pending))
    return out


__all__ = ["Group", "Streak", "tally_streaks"]
