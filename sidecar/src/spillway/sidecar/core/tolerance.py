"""KIP-298 tolerance: how many errors a job may skip before it fails.

An *error* is a record whose retries are exhausted or that was never retriable, and which the
handler chose to CONTINUE. ``errors.tolerance=none`` (the default) allows none: the first error
fails the job. ``errors.tolerance=all`` skips errors within these limits:

- ``errors.tolerance.max.errors`` (-1: none): more errors than this fails the job; every error
  counts the moment it is reported;
- ``errors.tolerance.max.ratio`` (-1: none): errors / processed records above this fails the
  job, checked once ``errors.tolerance.min.records`` records were processed;
- both over ``errors.tolerance.window.ms`` (0: the whole job), a sliding window;
- with ``errors.tolerance.per.stage=true``, both also apply to each stage on its own.

The ratio compares like with like. Processed counts arrive with FlushTask, when a task attempt
ends, while its errors arrive as they happen; dividing the errors of running tasks by the
records of finished ones would fail healthy jobs (100 errors, 0 processed, "ratio 1.0"). So the
ratio counts a task's errors once that task reported its processed records ("settled" errors),
and is checked at every error and at every FlushTask. A task's errors are settled when it
flushes, or at once if it already has.

Counting is idempotent by record id: a re-attempted Spark task re-reporting a record that was
already counted does not count it again (``MAX_COUNTED_IDS`` ids are remembered per job, least
recently seen evicted first). Ids are remembered as 60-bit digests (`record_key`) in an
`IdTable`, not as strings; the policy engine keeps its skipped-record answers in the same table
(`ToleranceTracker.ids`), so a job holds one id table, not two. Processed counts are per Spark
task (stage, partition): the same attempt reporting twice, or a new attempt of the task,
replaces the earlier count (``MAX_TASK_SLOTS`` tasks remembered; an evicted task's counts stay
but can no longer be replaced).
"""

from __future__ import annotations

from collections import OrderedDict
from array import array
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from hashlib import blake2b

from .counters import WindowedCounter
from . import idtable
from .idtable import KEY_MASK, IdTable
from .settings import ToleranceSettings

MAX_COUNTED_IDS = 200_000
MAX_TASK_SLOTS = 100_000

TaskKey = tuple[int, int]   # (Spark stage id, partition id): stable across task attempts

# Record ids are remembered as 60-bit digests, not strings: Python's str hash (64-bit SipHash,
# keyed per process: fine for in-process state, never persisted or compared across processes)
# masked to 60 bits (uniformly spread, so `IdTable` uses the low bits as a slot), stored in
# flat arrays with no object per id (`idtable.py`); the request's id strings are freed at once.
# Two of n remembered ids collide with probability about n^2 / 2^61 (~4e-8 at 300 000 ids). A
# collision can only make a distinct record look already counted / already skipped: it is still
# answered SKIP (and dead-lettered when the job has a DLQ), never lost; it is just not counted as
# a new error (docs/POLICY.md). The mask (idtable.KEY_BITS) lives with the table, which this
# module imports.


def record_key(record_id: str) -> int:
    """The digest under which a record id is remembered (see above)."""
    return hash(record_id) & KEY_MASK


_NO_KEY = b"\xff\xff\xff\xff"
_NO_VALUE = b"\xff"


def payload_tag(key: bytes | None, value: bytes | None, secret: bytes = b"") -> int:
    """A 64-bit digest of a record's payload (its key and value: the source record's bytes, or
    the failing stage's input), kept beside its remembered id: the same id with another payload
    is another record (`jobstate`: record identity). Keyed BLAKE2b with the run's secret
    (`run_secret`), so it is the same in every sidecar of the run (a node computes it for the
    home, `tally`) and after a restart, and nobody without the run's token can craft two
    payloads with one digest. A null key or value differs from an empty one."""
    k = _NO_KEY if key is None else len(key).to_bytes(4, "little") + key
    v = _NO_VALUE if value is None else b"\x00" + value
    return int.from_bytes(blake2b(k + v, digest_size=8, key=secret).digest(), "little")


def payload_tagger(secret: bytes = b"") -> Callable[[bytes | None, bytes | None], int]:
    """`payload_tag` with `secret` fixed: the keyed hash's first block (the key's) is
    compressed once and copied for each record (1.8 instead of 2.3 µs a 200-byte record)."""
    keyed = blake2b(digest_size=8, key=secret)
    copy, from_bytes = keyed.copy, int.from_bytes

    def tag(key: bytes | None, value: bytes | None) -> int:
        h = copy()   # fed in parts: no copy of the key and value joined (~85 ns a record)
        if key is None:
            h.update(_NO_KEY)
        else:
            h.update(len(key).to_bytes(4, "little"))
            h.update(key)
        if value is None:
            h.update(_NO_VALUE)
        else:
            h.update(b"\x00")
            h.update(value)
        return from_bytes(h.digest(), "little")

    return tag


def payload_tags(secret: bytes, records: Sequence,
                 tag: Callable[[bytes | None, bytes | None], int] | None = None) -> array:
    """Each record's payload tag, its own ``tag`` when that is >= 0 (`JobState.tag_of`), as an
    array('Q'). One C call where the sidecar's extension was built (`_idindex.c`: BLAKE2b as
    RFC 7693 writes it, the same digests as hashlib's; ~0.6 instead of ~1.3 µs a record of 200
    bytes), else ``tag`` (`payload_tagger(secret)`) per record."""
    out = idtable.payload_tags_in_c(secret, records)
    if out is not None:
        return out
    out = array("Q")
    tag = tag or payload_tagger(secret)
    out.extend([r.tag if r.tag >= 0 else tag(r.key, r.value) for r in records])
    return out


def run_secret(token: str) -> bytes:
    """The key of a run's payload digests, from its job token (every sidecar of the run holds
    it; a restarted one is given it again when the run registers)."""
    return blake2b(token.encode(), digest_size=32, person=b"spillway-tag").digest()


@dataclass(frozen=True, slots=True)
class ToleranceResult:
    exceeded: bool
    reason: str = ""
    counted: bool = True       # False: this record id had already been counted


WITHIN = ToleranceResult(False)   # within the limits: the common answer, shared (immutable)
_ALREADY_COUNTED = ToleranceResult(False, "", counted=False)


@dataclass(slots=True)
class _Slot:
    flushed: bool = False
    at_ms: dict[str, float] = field(default_factory=dict)       # when each stage was reported
    processed: dict[str, int] = field(default_factory=dict)     # by stage name
    errors: dict[str, int] = field(default_factory=dict)        # by stage name
    settled: dict[str, int] = field(default_factory=dict)       # errors moved into the ratio


class _Pair:
    """Errors (all, settled) and processed records over the window, for one scope."""

    __slots__ = ("errors", "processed", "settled")

    def __init__(self, window_ms: int) -> None:
        self.errors = WindowedCounter(window_ms)
        self.settled = WindowedCounter(window_ms)
        self.processed = WindowedCounter(window_ms)


class ToleranceTracker:
    def __init__(self, job: str, settings: ToleranceSettings, *,
                 max_ids: int = MAX_COUNTED_IDS, max_slots: int = MAX_TASK_SLOTS) -> None:
        self.job = job
        self.s = settings
        self.max_ids = max_ids
        self.max_slots = max_slots
        # counted record ids (as `record_key` digests); the policy engine stores its skip answer
        # as the value (None: counted but not skipped)
        self.ids: IdTable[object] = IdTable(max_ids)
        self._job = _Pair(settings.window_ms)
        self._stages: dict[str, _Pair] = {}
        self._slots: OrderedDict[TaskKey, _Slot] = OrderedDict()
        # no limit can be exceeded: `admit` is then a dedupe plus counting, which the policy
        # engine does per report (`ids`, then `count_errors` once per stage)
        self.unlimited = (settings.mode != "none" and settings.max_errors < 0
                          and settings.max_ratio < 0)
        self.records_processed = 0       # whole-job total, for the summary
        self.errors_total = 0
        self.slots_evicted = 0
        # a list: counted errors and progress are appended to it (`JobState.replay` redoes them)
        self.journal: list | None = None

    def room_for(self, n: int) -> bool:
        """Whether `n` more errors cannot exceed any limit, so a report of `n` records can be
        counted at its end like one of a tracker without limits (`count_errors`): no limit,
        or only a count limit (windowed or per stage: those counts are at most the run's
        total) with room for all of them. A ratio depends on processed records as well, and
        errors.tolerance=none fails on the first error."""
        if self.unlimited:
            return True
        s = self.s
        return (s.mode != "none" and s.max_ratio < 0
                and self.errors_total + n <= s.max_errors)

    @property
    def ids_evicted(self) -> int:
        return self.ids.evicted

    # --- errors ---------------------------------------------------------------------------

    def admit(self, record_id: str, stage: str, now_ms: float,
              task: TaskKey = (0, 0), key: int | None = None,
              tag: int = 0) -> ToleranceResult:
        """Count one error (once per record key) and check the limits. `key`: the record's key
        (`record_key` of its id, or the policy's key for a distinct record under a known id),
        when the caller already has it; `tag`: its payload digest (`payload_tag`)."""
        ids = self.ids
        if key is None:
            key = record_key(record_id)
        if key in ids:
            ids.touch(key)
            return _ALREADY_COUNTED
        ids.add(key, None, tag)
        if self.journal is not None:
            self.journal.append(("e", stage, task, now_ms, 1))
        self.errors_total += 1
        self._job.errors.add(now_ms)
        pair = self._stages.get(stage)
        (pair if pair is not None else self._stage(stage)).errors.add(now_ms)
        slot = self._slot(task)
        slot.errors[stage] = slot.errors.get(stage, 0) + 1
        if slot.flushed:
            self._settle(slot, now_ms)
        if self.s.mode == "none":
            return ToleranceResult(True, (
                f"job {self.job!r} failed on its first error: errors.tolerance=none "
                f"(stage {stage})"))
        return self.check(now_ms, stage)

    def count_errors(self, stage: str, task: TaskKey, n: int, now_ms: float) -> None:
        """What ``n`` calls of `admit` counting new ids of one stage and task at ``now_ms`` do
        besides remembering the ids, for a tracker with no limits (`unlimited`: every check
        passes, so counting a report's errors at its end is the same as one by one)."""
        if self.journal is not None:
            self.journal.append(("e", stage, task, now_ms, n))
        self.errors_total += n
        self._job.errors.add(now_ms, n)
        pair = self._stages.get(stage)
        (pair if pair is not None else self._stage(stage)).errors.add(now_ms, n)
        slot = self._slot(task)
        slot.errors[stage] = slot.errors.get(stage, 0) + n
        if slot.flushed:
            self._settle(slot, now_ms)

    # --- processed records ----------------------------------------------------------------

    def record_progress(self, task: TaskKey, counts: Mapping[str, int], now_ms: float) -> None:
        """A task's processed records for the stages it names. Each replaces that stage's
        earlier report for the task (a re-attempt, or a running total); stages not named keep
        theirs, so two wrappers in one Spark task (deserialize, then transform) both count."""
        if self.journal is not None:
            self.journal.append(("g", task, dict(counts), now_ms))
        slot = self._slot(task)
        for stage, n in counts.items():
            old = slot.processed.pop(stage, 0)
            if old:
                for pair in (self._job, self._stage(stage)):
                    pair.processed.add(now_ms, -old, at_ms=slot.at_ms[stage])
                self.records_processed -= old
            if int(n):
                slot.processed[stage] = int(n)
                slot.at_ms[stage] = now_ms
                for pair in (self._job, self._stage(stage)):
                    pair.processed.add(now_ms, int(n))
                self.records_processed += int(n)
        slot.flushed = True
        self._settle(slot, now_ms)

    def _settle(self, slot: _Slot, now_ms: float) -> None:
        for stage, n in slot.errors.items():
            new = n - slot.settled.get(stage, 0)
            if new:
                for pair in (self._job, self._stage(stage)):
                    pair.settled.add(now_ms, new)
                slot.settled[stage] = n

    # --- durable state (`JobState.snapshot`) ---------------------------------------------

    _STATE = ("_job", "_stages", "_slots", "records_processed", "errors_total",
              "slots_evicted")

    def state(self) -> dict:
        """What a snapshot keeps besides the ids (plain objects: picklable)."""
        return {name: getattr(self, name) for name in self._STATE}

    def set_state(self, state: dict) -> None:
        for name in self._STATE:
            setattr(self, name, state[name])

    # --- limits ---------------------------------------------------------------------------

    def check(self, now_ms: float, stage: str | None = None) -> ToleranceResult:
        """Whether the limits are exceeded now (job-wide, then per stage when enabled)."""
        if self.s.mode == "none":
            if self.errors_total:
                return ToleranceResult(True, f"job {self.job!r} failed on its first error: "
                                             f"errors.tolerance=none")
            return WITHIN
        if self.s.max_errors < 0 and self.s.max_ratio < 0:
            return WITHIN  # no limits: nothing to check
        reason = self._over(self._job, now_ms, f"job {self.job!r} exceeded",
                            f" (stage {stage})" if stage else "")
        if reason:
            return ToleranceResult(True, reason)
        if self.s.per_stage:
            for st in ([stage] if stage else list(self._stages)):
                reason = self._over(self._stage(st), now_ms, f"job {self.job!r} stage {st} "
                                    f"exceeded", " (errors.tolerance.per.stage=true)")
                if reason:
                    return ToleranceResult(True, reason)
        return WITHIN

    def _over(self, pair: _Pair, now_ms: float, who: str, where: str) -> str:
        in_window = f" in the last {self.s.window_ms} ms" if self.s.window_ms else ""
        errors = int(pair.errors.total(now_ms))
        if self.s.max_errors >= 0 and errors > self.s.max_errors:
            return (f"{who} errors.tolerance.max.errors={self.s.max_errors}: "
                    f"{errors} errors{in_window}{where}")
        if self.s.max_ratio >= 0:
            settled = pair.settled.total(now_ms)
            processed = max(pair.processed.total(now_ms), settled)
            if processed >= max(self.s.min_records, 1) and settled / processed > self.s.max_ratio:
                return (f"{who} errors.tolerance.max.ratio={self.s.max_ratio:g}: "
                        f"{int(settled)} errors in {int(processed)} processed records{in_window} "
                        f"(ratio {settled / processed:.3g}, errors.tolerance.min.records="
                        f"{self.s.min_records}){where}")
        return ""

    # --- bounded tables -------------------------------------------------------------------

    def _stage(self, stage: str) -> _Pair:
        pair = self._stages.get(stage)
        if pair is None:
            pair = self._stages[stage] = _Pair(self.s.window_ms)
        return pair

    def _slot(self, task: TaskKey) -> _Slot:
        slot = self._slots.get(task)
        if slot is None:
            slot = self._slots[task] = _Slot()
            if len(self._slots) > self.max_slots:
                self._slots.popitem(last=False)
                self.slots_evicted += 1
        else:
            self._slots.move_to_end(task)
        return slot
