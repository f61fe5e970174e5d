"""A policy engine over fakes with one run registered and journaled, for the core's unit tests,
and the one place a test reads what the engine keeps private (its table of runs)."""

from __future__ import annotations

from typing import Any

from spillway.sidecar.core.jobstate import run_key
from spillway.sidecar.core.policy import PolicyEngine
from support.fakes import FakeClock, FakeRng


class QuietLog:
    """An error log that drops its lines: the tests using it assert verdicts and counts."""

    def log_error(self, fields) -> None:
        pass


def journaled(props: dict, *, clock: FakeClock | None = None, job: str = "j",
              run_id: str = "r") -> tuple[PolicyEngine, str]:
    """An engine with the run ``job``/``run_id`` registered under ``props`` (a fixed tag
    secret) and journaled, as a home keeps it; returns the engine and the run's key."""
    engine = PolicyEngine(clock=clock or FakeClock(), rng=FakeRng(), logger=QuietLog())
    engine.register_job(job, props, run_id=run_id, tag_secret=b"k" * 32)
    key = run_key(job, run_id)
    engine.enable_journal(key)
    return engine, key


def runs(engine: PolicyEngine) -> dict[str, Any]:
    """The engine's table of runs (key -> JobState), private to it: tests that compare a run's
    remembered ids, records or slices, or replay its journal, read it through here."""
    return engine._jobs


def run_state(engine: PolicyEngine, key: str) -> Any:
    """One run's state (`JobState`) by its key."""
    return runs(engine)[key]
