"""`PolicyEngine` answers one record at a time, for tests that assert per-record verdicts: the
engine answers a report in streaks (`PolicyEngine.decide`) and a tally as columns
(`PolicyEngine.decide_tallies`); `core.decide.per_record` gives each record its own answer."""

from __future__ import annotations

from collections.abc import Sequence

from spillway.sidecar.core.decide import Outcome, Streak, per_record
from spillway.sidecar.core.model import Decision, FailedRecord, TaskIdentity
from spillway.sidecar.core.policy import PolicyEngine, Tally


def outcomes(engine: PolicyEngine, key: str, task: TaskIdentity,
             records: Sequence[FailedRecord], journal: list | None = None) -> list[Outcome]:
    """A report's (decision, logged, rule) per record."""
    return per_record(engine.decide(key, task, records, journal), records)


def decisions(engine: PolicyEngine, key: str, task: TaskIdentity,
              records: Sequence[FailedRecord], journal: list | None = None) -> list[Decision]:
    """A report's decision per record."""
    return [o[0] for o in outcomes(engine, key, task, records, journal)]


def tally(engine: PolicyEngine, key: str, report: Tally,
          journal: list | None = None) -> list[Streak]:
    """One report's answers at its home, a TallyFailures call of its own."""
    return engine.decide_tallies(key, [report], journal)[0]


__all__ = ["Tally", "decisions", "outcomes", "tally"]
