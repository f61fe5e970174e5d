"""The DLQ pipeline's per-task counts: how many of each task's records are pending,
acknowledged and settled, or rejected; what flush barriers (`wait_task`, `wait_run`,
`wait_done`) wait on.

`TaskCounts` is one of the parts `pipeline.DlqPipeline` is composed of, shared by three kinds of
thread under its one lock: the spool's writer registers committed records (`register`, right
after the commit, before any delete can run), the drain counts them acknowledged or rejected and
settled (`acked`, `rejected`, `settled`, `set_done_through`), and callers wait. It calls
nothing else while it holds its lock.

A row counts for the task stored on it (its owner): the drain settles the owner's count when the
row is acknowledged or rejected, whether that happens before or after the registration (the
count may dip below zero meanwhile). A record that was already spooled under another task, or by
an earlier process (seq up to ``recovered_upto``), is followed by seq: it is then unread, in the
drain's hands, acknowledged-not-yet-deleted or rejected-not-yet-moved.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from operator import attrgetter

from ..core.model import task_run_prefix
from ..core.ports import Clock
from ..errors import DlqError, FlushTimeoutError
from .handoff import Entry
from .store import Placed

_TASKS_KEPT = 65_536  # finished task attempts whose counts wait_task can still report
_job_task_of = attrgetter("rec.job", "rec.task_key")


@dataclass(slots=True)
class _TaskCount:
    pending: int = 0
    acked: int = 0
    rejected: int = 0
    last_error: str = ""
    ack_gen: int = 0  # the drain's acknowledgement round of its last acknowledged record


class TaskCounts:
    """Per-task counts of DLQ records, and the waits on them."""

    def __init__(self, clock: Clock, *, recovered_upto: int) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._cv = threading.Condition(self._lock)
        self._tasks: collections.OrderedDict[str, _TaskCount] = collections.OrderedDict()
        # run prefix -> its task keys in `_tasks`: wait_run and forget_run touch one run's tasks
        # only, and an ended run's counts go with it (they would otherwise stay until 65,536
        # later tasks pushed them out: long-lived small objects that pin heap pages)
        self._run_tasks: dict[str, dict[str, None]] = {}
        self._recovered_upto = recovered_upto  # rows up to it were spooled by an earlier process
        self._followers: dict[int, list[str]] = {}  # seq -> other task keys waiting on it
        self._acked_set: set[int] = set()
        self._rejected_pending: dict[int, str] = {}
        # flush barriers waiting (`wait_done`): the drain settles at once while there are any
        self.flush_waiters = 0
        self.task_waiters = 0   # FlushTask barriers waiting (`wait_task`)
        # acknowledgement rounds (`acked`, counted by the drain thread, its only writer) and the
        # last one settled in the store: a flush barrier returns once its task's records are
        # settled, so that a crash right after it does not produce them again
        self.ack_gen = 0
        self._settled_gen = 0
        self._done_through = 0
        self._closed = False

    # -- the spool's writer ---------------------------------------------------------------

    def register(self, keys: Sequence[str], placed: Sequence[Placed], all_fresh: bool) -> None:
        """Count committed records for their tasks (`keys`, one per record; runs right after
        the commit, before any delete can run)."""
        with self._cv:
            if all_fresh:  # the usual case: count per task, not per record
                for tk, n in collections.Counter(keys).items():
                    self._task(tk).pending += n
            else:
                for tk, (seq, owner, fresh, _) in zip(keys, placed, strict=True):
                    t = self._task(tk)
                    if fresh:
                        t.pending += 1
                    elif owner == tk and seq > self._recovered_upto:
                        continue  # the same task reported it again: already counted
                    elif seq in self._acked_set:   # acknowledged, its settling under way
                        t.acked += 1
                        t.ack_gen = self.ack_gen
                    elif seq in self._rejected_pending:
                        t.rejected += 1
                        t.last_error = self._rejected_pending[seq]
                    else:
                        self._followers.setdefault(seq, []).append(tk)
                        t.pending += 1
            self._evict()

    # -- the drain ------------------------------------------------------------------------

    def acked(self, acked: Sequence[Entry], acked_seqs: Sequence[int]
              ) -> collections.Counter[str]:
        """Count one round of acknowledged entries (their seqs: `acked_seqs`) for their owners
        and followers; returns the records per job."""
        per_job: collections.Counter[str] = collections.Counter()
        per_task: collections.Counter[str] = collections.Counter()
        with self._cv:
            self.ack_gen += 1
            gen = self.ack_gen
            self._acked_set.update(acked_seqs)
            followers, upto = self._followers, self._recovered_upto
            if not followers and (not upto or min(acked_seqs) > upto):
                # one pass for both counts: a batch's records come from a few tasks of a few jobs
                for (job, tk), n in collections.Counter(map(_job_task_of, acked)).items():
                    per_task[tk] += n
                    per_job[job] += n
            else:
                for e in acked:
                    per_job[e.rec.job] += 1
                    if followers and e.seq in followers:
                        self._count(e, acked=True)
                    elif e.seq > upto:  # the owner's count, settled per task below
                        per_task[e.rec.task_key] += 1
            for tk, n in per_task.items():
                t = self._task(tk)
                t.pending -= n
                t.acked += n
                t.ack_gen = gen
            self._evict()
            self._cv.notify_all()
        return per_job

    def rejected(self, e: Entry, reason: str) -> None:
        """Count an entry Kafka can never accept, until the store has moved it (`moved`)."""
        with self._cv:
            self._rejected_pending[e.seq] = reason
            self._count(e, acked=False, reason=reason)
            self._cv.notify_all()

    def moved(self, rejects: Sequence[tuple[int, str]]) -> None:
        """The store moved these rejected records to its rejected table."""
        with self._lock:
            for seq, _ in rejects:
                self._rejected_pending.pop(seq, None)

    def settled(self, seqs: Sequence[int], gen: int) -> None:
        """The store settled these acknowledged seqs, every acknowledgement up to round `gen`
        among them (flush barriers wait for that)."""
        with self._cv:
            self._acked_set.difference_update(seqs)
            self._settled_gen = gen
            self._cv.notify_all()

    def all_settled(self) -> None:
        """No acknowledgement waits to be settled (called by the drain, the only writer of
        both rounds)."""
        if self._settled_gen != self.ack_gen:
            with self._cv:
                self._settled_gen = self.ack_gen
                self._cv.notify_all()

    def set_done_through(self, seq: int) -> None:
        """Every record up to `seq` is acknowledged or rejected (`wait_done`)."""
        with self._cv:
            self._done_through = seq
            self._cv.notify_all()

    def close(self) -> None:
        """The pipeline shut down: waits end now."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()

    # -- callers --------------------------------------------------------------------------

    def forget_run(self, prefix: str) -> None:
        """Drop the counts of an ended run's settled tasks (`prefix`: ``run_key + "/"``). A
        task with records still pending keeps its count until they settle; its FlushTask can
        no longer come (the run is gone), so it leaves with the usual eviction."""
        with self._cv:
            keys = self._run_tasks.get(prefix)
            if not keys:
                return
            for tk in list(keys):
                t = self._tasks.get(tk)
                if t is None or t.pending == 0:
                    self._tasks.pop(tk, None)
                    del keys[tk]
            if not keys:
                del self._run_tasks[prefix]

    def wait_task(self, task_key: str, timeout_s: float, last_error: Callable[[], str]) -> int:
        """`DlqPipeline.wait_task`; `last_error()`: the drain's last failure, for the message
        past the deadline."""
        deadline = self._clock.monotonic() + timeout_s
        with self._cv:
            self.task_waiters += 1
            try:
                return self._wait_task(task_key, timeout_s, deadline, last_error)
            finally:
                self.task_waiters -= 1

    def _wait_task(self, task_key: str, timeout_s: float, deadline: float,
                   last_error: Callable[[], str]) -> int:
        """`wait_task`'s loop, under the condition's lock."""
        while True:
            t = self._tasks.get(task_key)
            if t is None:
                return 0
            if t.rejected:
                raise DlqError(
                    f"{t.rejected} DLQ record(s) of task {task_key} can never be written to "
                    f"Kafka ({t.last_error}); they are kept in the spool's rejected table "
                    f"({t.acked} acknowledged, {t.pending} pending)")
            if t.pending <= 0 and (t.ack_gen <= self._settled_gen or self._closed):
                return t.acked
            if self._closed:
                raise DlqError(f"the DLQ pipeline shut down with {t.pending} record(s) of "
                               f"task {task_key} not yet acknowledged; they stay spooled")
            remaining = deadline - self._clock.monotonic()
            if remaining <= 0:
                error = last_error()
                raise FlushTimeoutError(
                    f"{t.pending} DLQ record(s) of task {task_key} not acknowledged by Kafka "
                    f"within {timeout_s:g}s ({t.acked} were); they stay spooled and will be "
                    f"delivered later" + (f"; last error: {error}" if error else ""))
            self._cv.wait(min(remaining, 0.1))

    def wait_run(self, prefix: str, timeout_s: float) -> int:
        """`DlqPipeline.wait_run`."""
        deadline = self._clock.monotonic() + timeout_s
        with self._cv:
            while True:
                tasks = self._tasks
                pending = sum(t.pending for t in map(tasks.get, self._run_tasks.get(prefix, ()))
                              if t is not None and t.pending > 0)
                remaining = deadline - self._clock.monotonic()
                if not pending or remaining <= 0 or self._closed:
                    return pending
                self._cv.wait(min(remaining, 0.1))

    def wait_done(self, target: int, timeout_s: float, alive: Callable[[], bool],
                  wake: Callable[[], object]) -> bool:
        """Wait until every record up to seq `target` is acknowledged or rejected (the drain
        `wake()`-d while waiting); False past `timeout_s` or once the drain is not `alive()`."""
        deadline = self._clock.monotonic() + timeout_s
        with self._cv:
            self.flush_waiters += 1
            try:
                while self._done_through < target:
                    remaining = deadline - self._clock.monotonic()
                    if remaining <= 0 or not alive():
                        return False
                    wake()
                    self._cv.wait(min(remaining, 0.05))
                return True
            finally:
                self.flush_waiters -= 1

    # -- inside ---------------------------------------------------------------------------

    def _task(self, tk: str) -> _TaskCount:
        t = self._tasks.get(tk)
        if t is None:
            t = self._tasks[tk] = _TaskCount()
            self._run_tasks.setdefault(task_run_prefix(tk), {})[tk] = None
        else:
            self._tasks.move_to_end(tk)
        return t

    def _count(self, e: Entry, *, acked: bool, reason: str = "") -> None:
        """Count an acknowledged or rejected row for its owner and followers (under _cv)."""
        keys = self._followers.pop(e.seq, [])
        if e.seq > self._recovered_upto:
            keys.append(e.rec.task_key)
        for tk in keys:
            t = self._task(tk)
            t.pending -= 1
            if acked:
                t.acked += 1
                t.ack_gen = self.ack_gen
            else:
                t.rejected += 1
                t.last_error = reason

    def _evict(self) -> None:
        while len(self._tasks) > _TASKS_KEPT:
            first = next(iter(self._tasks.values()))
            if first.pending:
                break
            self._unindex(self._tasks.popitem(last=False)[0])

    def _unindex(self, tk: str) -> None:
        run = task_run_prefix(tk)
        keys = self._run_tasks.get(run)
        if keys is not None:
            keys.pop(tk, None)
            if not keys:
                del self._run_tasks[run]


__all__ = ["TaskCounts"]
