"""One report's bookkeeping in the policy engine (`Batch`): the per-report values (task,
clock readings) and the counters, breakdowns and budget deposits kept locally while its records
are decided, applied to the job's tables once at the end. Pure."""

from __future__ import annotations

from .classify import Classification
from .jobstate import JobState, SkipInfo
from .model import Category, FailedRecord, StageRef, TaskIdentity

MAX_BREAKDOWN_KEYS = 1_000
OTHER_KEY = "(other)"

# Indexes into a batch's per-stage amounts (`counters.BATCH_FIELDS` order).
FAILURES, ERRORS, SKIPPED, RETRIES, LOGGED, DROPPED = range(6)


def bump(table: dict[str, int], key: str, n: int = 1) -> None:
    if key not in table and len(table) >= MAX_BREAKDOWN_KEYS:
        key = OTHER_KEY
    table[key] = table.get(key, 0) + n


class Batch:
    """One report's bookkeeping, kept locally while its records are decided and applied to the
    job's tables once at the end (still under the job's lock, so nobody sees it half done):
    counters per stage, the breakdowns, and the retry budget's deposits (records failing for
    the first time), which are made before any retry is granted, so the budget sees exactly
    what it would per record.
    Also remembers the last record's description, which a batch failing the same way shares."""

    __slots__ = ("task", "tid", "now", "wall", "amounts", "last_stage", "last_amounts",
                 "last_ref", "by_stage", "by_class",
                 "by_category", "reports", "last_exc", "last_cls", "last_what", "reasons",
                 "last_info", "cls_exc", "cls", "new_errors", "collisions", "claim",
                 "unchecked")

    def __init__(self, task: TaskIdentity, now: float, wall: int) -> None:
        self.task = task                  # the reporting Spark task attempt
        self.tid = task.task_id
        self.now = now                    # monotonic ms, read once per report
        self.wall = wall                  # wall-clock ms, read once per report
        self.amounts: dict[str, list[int]] = {}
        self.last_stage: str | None = None
        self.last_amounts: list[int] = []
        self.last_ref: StageRef | None = None
        self.by_stage: dict[str, int] = {}
        self.by_class: dict[str, int] = {}
        self.by_category: dict[Category, int] = {}
        self.reports = 0
        self.last_exc: object = None
        self.last_cls: Classification | None = None
        self.last_what = ""
        self.reasons: dict[tuple[str, str], str] = {}
        self.last_info: SkipInfo | None = None
        self.cls_exc: object = None       # the last exception value classified, and its class
        self.cls: Classification | None = None
        self.new_errors: dict[str, int] = {}   # by stage: errors counted by tolerance at the end
        self.collisions: list[FailedRecord] = []   # records under an id known with another payload
        self.claim = 0        # the report's provisional claim (a node's held records), 0: none
        # no record of the report can exceed a tolerance limit (`ToleranceTracker.room_for`):
        # its new errors are counted at its end, as without limits
        self.unchecked = False

    def stage_amounts(self, stage: str) -> list[int]:
        if stage == self.last_stage:
            return self.last_amounts
        # re-inserted so that stages are applied in the order of their last record, as the
        # per-record counters would have touched them (least recently used first)
        a = self.amounts.pop(stage, None)
        if a is None:
            a = [0, 0, 0, 0, 0, 0]
        self.amounts[stage] = a
        self.last_stage, self.last_amounts = stage, a
        return a

    def charge_reports(self, j: JobState, now: float) -> None:
        if self.reports:
            j.budget.deposit(now, self.reports)
            self.reports = 0

    def apply(self, j: JobState) -> None:
        task, tid, now, wall = self.task, self.tid, self.now, self.wall
        self.charge_reports(j, now)
        if self.new_errors:
            tkey = (task.stage_id, task.partition_id)
            for stage, n in self.new_errors.items():
                j.tolerance.count_errors(stage, tkey, n, now)
        for stage, a in self.amounts.items():
            j.counts.add_batch(stage, tid, a, wall)
        for table, counted in ((j.by_stage, self.by_stage), (j.by_class, self.by_class)):
            for key, n in counted.items():
                bump(table, key, n)
        for category, n in self.by_category.items():
            bump(j.by_category, category.value, n)

