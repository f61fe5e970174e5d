"""Build the record written to the dead letter queue for one dead-lettered record (pure).

Header families (all values UTF-8):

- the original record's headers, when ``errors.deadletterqueue.copy.record.enable`` is true
  (the default); with it false the DLQ record is context-only: no key, no value, no original
  headers (KIP-1191's copy switch);
- the error-context headers, when ``errors.deadletterqueue.context.headers.enable`` is true, in the
  family ``errors.deadletterqueue.headers.format`` names: ``connect`` writes KIP-298's
  ``__connect.errors.*``, ``dlq`` writes KIP-1191's ``__dlq.errors.*``. A ``__connect.errors.*``
  header is added only if the original record does not already carry one of that name (KIP-298:
  "only if they don't already exist in the message"; e.g. a record dead-lettered a second time
  keeps the topic it first failed in); ``__dlq.errors.*`` headers overwrite original headers of
  the same name (KIP-1191). ``__connect.errors.task.id`` is the Spark task, ``<stage id>.<partition
  id>`` (docs/DLQ.md says why);
- spillway's own headers, always: ``spillway.record.id``, ``spillway.error.category``,
  ``spillway.attempts``, ``spillway.reason``, ``spillway.job``, ``spillway.task``,
  ``spillway.sidecar``, ``spillway.timestamp`` (ms since the epoch when the record was
  dead-lettered) and ``spillway.record.copied`` (whether key/value/headers are the original's:
  redrive refuses context-only records);
- ``traceparent`` (and ``tracestate``) when the record carries a valid W3C trace context. An
  invalid one is never copied through, not even from the original headers.

Stack traces are cut to ``errors.deadletterqueue.stacktrace.max.bytes`` on a UTF-8 character
boundary and end with a marker saying how many bytes were cut; 0 leaves the stack trace out.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterable, Sequence
from operator import attrgetter

from . import slots
from .model import DlqRecord, FailedRecord, Header, TaskIdentity, Verdict, task_key
from .settings import JobSettings

CONNECT_PREFIX = "__connect.errors."
DLQ_PREFIX = "__dlq.errors."
SPILLWAY_PREFIX = "spillway."

H_RECORD_ID = "spillway.record.id"
H_CATEGORY = "spillway.error.category"
H_ATTEMPTS = "spillway.attempts"
H_REASON = "spillway.reason"
H_JOB = "spillway.job"
H_TASK = "spillway.task"
H_SIDECAR = "spillway.sidecar"
H_TIMESTAMP = "spillway.timestamp"
H_COPIED = "spillway.record.copied"
H_PAYLOAD = "spillway.payload"      # what key/value are: "source" | "stage-input"
H_RUN_ID = "spillway.run.id"
H_REDRIVE_COUNT = "spillway.redrive.count"
H_TRACEPARENT = "traceparent"
H_TRACESTATE = "tracestate"

_TRACEPARENT = re.compile(r"00-([0-9a-f]{32})-([0-9a-f]{16})-[0-9a-f]{2}")
_TRACEPARENT_LEN = 55
_TRACESTATE_MAX = 512  # W3C: vendors may drop a longer tracestate
_ZERO_TRACE = "0" * 32
_ZERO_SPAN = "0" * 16

# A task reports every failure under the same trace context: each distinct traceparent is
# checked once (bounded; only strings of the one valid length are kept).
_TRACEPARENT_CACHE_SIZE = 4096
_traceparent_ok: dict[str, bool] = {}


def valid_traceparent(value: str) -> bool:
    """W3C trace context, version 00: ``00-<32 hex trace id>-<16 hex span id>-<2 hex flags>``,
    lower-case hex, neither id all zeros."""
    ok = _traceparent_ok.get(value)
    if ok is not None:
        return ok
    if len(value) != _TRACEPARENT_LEN:
        return False
    m = _TRACEPARENT.fullmatch(value)
    ok = bool(m) and m.group(1) != _ZERO_TRACE and m.group(2) != _ZERO_SPAN
    if len(_traceparent_ok) >= _TRACEPARENT_CACHE_SIZE:
        _traceparent_ok.clear()
    _traceparent_ok[value] = ok
    return ok


def valid_tracestate(value: str) -> bool:
    """Printable ASCII, at most 512 characters (the W3C bound); empty is not a tracestate."""
    return 0 < len(value) <= _TRACESTATE_MAX and all(0x20 <= ord(c) < 0x7F for c in value)


def _utf8(text: str) -> bytes:
    return text.encode("utf-8", "backslashreplace")


def record_id_header(record_id: str, name: str = H_RECORD_ID) -> Header:
    """The header naming a DLQ record's id, as its builder writes it."""
    return (name, _utf8(record_id))


@dataclasses.dataclass(frozen=True, slots=True)
class Streak:
    """DLQ records ``start`` .. ``start + n - 1`` of one build (`DlqBuilder.build_streak`)
    that differ only in their id, key and value: each is ``topic``, its source record's key
    and value when ``copied`` (else none), the headers ``before + (record_id_header(its id),)
    + after``, ``job``, ``task_key`` and ``traceparent``. The spool stores such records as
    columns (`dlq.codec`), with no tuple per record."""

    start: int
    n: int
    topic: str
    copied: bool
    before: tuple[Header, ...]
    after: tuple[Header, ...]
    job: str
    task_key: str
    traceparent: str

    def describes(self, rec: DlqRecord) -> bool:
        """Whether `rec` has this streak's shape (whatever its id, key and value)."""
        h, k = rec.headers, len(self.before)
        return (rec.topic == self.topic and rec.job == self.job
                and rec.task_key == self.task_key and rec.traceparent == self.traceparent
                and len(h) == k + 1 + len(self.after) and h[:k] == self.before
                and h[k + 1:] == self.after and h[k] == record_id_header(rec.record_id)
                and (self.copied or (rec.key is None and rec.value is None)))


def truncate_utf8(text: str, max_bytes: int) -> bytes:
    """`text` as UTF-8, at most `max_bytes` long, cut on a character boundary.

    A cut text ends with ``...[N bytes cut]``, counted within `max_bytes`; when `max_bytes` is
    too small for the marker, only the cut text is kept.
    """
    data = _utf8(text)
    if len(data) <= max_bytes:
        return data

    def boundary(n: int) -> int:  # never split a multi-byte character
        while n > 0 and (data[n] & 0xC0) == 0x80:
            n -= 1
        return n

    longest_marker = len(f"...[{len(data)} bytes cut]")
    if max_bytes < longest_marker:
        return data[:boundary(max_bytes)]
    keep = boundary(max_bytes - longest_marker)
    return data[:keep] + f"...[{len(data) - keep} bytes cut]".encode()


def task_description(task: TaskIdentity) -> str:
    """``spillway.task``: ``<stage>.<partition>.<attempt> tid=<task attempt id> executor=<id>
    host=<host>``."""
    return (f"{task.stage_id}.{task.partition_id}.{task.attempt_number} "
            f"tid={task.task_attempt_id} executor={task.executor_id} host={task.host}")



# --- the builder -----------------------------------------------------------------------------
#
# Every dead-lettered record costs CPU on a machine shared with Spark, so what does not depend
# on the record is worked out once: per job settings (header names, the job's encoded name, the
# set of names that replace original headers) and per report (the task's and sidecar's headers,
# the timestamp). The output is the same as building each record from scratch (tests compare
# them).

_SPILLWAY_NAMES = (H_RECORD_ID, H_CATEGORY, H_ATTEMPTS, H_REASON, H_JOB, H_TASK, H_SIDECAR,
                   H_TIMESTAMP, H_COPIED, H_TRACEPARENT, H_TRACESTATE, H_PAYLOAD, H_RUN_ID)


class _JobParts:
    """What a job's settings fix about its DLQ records."""

    __slots__ = ("settings", "topic", "job", "job_b", "copy", "copied_b", "context", "connect",
                 "stack_max", "n_topic", "n_partition", "n_offset", "n_job", "n_delivery",
                 "n_task_id", "n_stage", "n_class", "n_exc_class", "n_exc_message",
                 "n_stacktrace", "replaced", "keep_original")

    def __init__(self, settings: JobSettings) -> None:
        dlq = settings.dlq
        self.settings = settings
        self.topic = dlq.topic
        self.job = settings.job
        self.job_b = _utf8(settings.job)
        self.copy = dlq.copy_record
        self.copied_b = b"true" if dlq.copy_record else b"false"
        self.context = dlq.context_headers
        self.connect = dlq.header_format == "connect"
        self.stack_max = dlq.stacktrace_max_bytes
        prefix = CONNECT_PREFIX if self.connect else DLQ_PREFIX
        self.n_topic = prefix + "topic"
        self.n_partition = prefix + "partition"
        self.n_offset = prefix + "offset"
        self.n_job = prefix + ("connector.name" if self.connect else "group")
        self.n_delivery = prefix + "delivery.count"
        self.n_task_id = prefix + "task.id"
        self.n_stage = prefix + "stage"
        self.n_class = prefix + "class.name"
        self.n_exc_class = prefix + "exception.class.name"
        self.n_exc_message = prefix + "exception.message"
        self.n_stacktrace = prefix + "exception.stacktrace"
        # the names a DLQ record adds, by (has source coordinates, has a stack trace): they
        # replace same-named original headers, and no others do
        base = set(_SPILLWAY_NAMES)
        # KIP-298 adds a context header only where the original has none of that name
        self.keep_original = self.context and self.connect
        if self.context and not self.keep_original:
            base |= {self.n_job, self.n_task_id, self.n_stage, self.n_class, self.n_exc_class,
                     self.n_exc_message}
            if not self.connect:
                base.add(self.n_delivery)
        self.replaced: dict[tuple[bool, bool], frozenset[str]] = {}
        for has_source in (False, True):
            for has_stack in (False, True):
                names = set(base)
                if self.context and not self.keep_original and has_source:
                    names |= {self.n_topic, self.n_partition, self.n_offset}
                if self.context and not self.keep_original and has_stack:
                    names.add(self.n_stacktrace)
                self.replaced[has_source, has_stack] = frozenset(names)


def _trace_headers(parent: str, state: str) -> tuple[Header, ...]:
    """The trace headers of a DLQ record with this (valid) traceparent: its tracestate too
    when that is valid."""
    if state and valid_tracestate(state):
        return ((H_TRACEPARENT, parent.encode("ascii")), (H_TRACESTATE, state.encode("ascii")))
    return ((H_TRACEPARENT, parent.encode("ascii")),)


_job_parts: dict[int, _JobParts] = {}
_JOB_PARTS_MAX = 256


def _parts(settings: JobSettings) -> _JobParts:
    parts = _job_parts.get(id(settings))
    if parts is None or parts.settings is not settings:  # ids are reused once freed
        parts = _JobParts(settings)
        if len(_job_parts) >= _JOB_PARTS_MAX:
            _job_parts.clear()
        _job_parts[id(settings)] = parts
    return parts


def _dlq_record_factory() -> tuple[Callable[[tuple], DlqRecord], bool]:
    """A DlqRecord from its row: the tuple of its fields in order, ``(topic, key, value,
    headers, record_id, job, task_key, traceparent)`` (as the spool stores one, `dlq.codec`);
    and whether the fast path below is in use.

    A frozen dataclass's ``__init__`` sets each field through ``object.__setattr__`` and costs
    more than the rest of building a DLQ record (1,440 ns); calling the slots' own setters costs
    660. Here a class with the same slots and no ``__setattr__`` of its own sets them as plain
    attribute stores, then the instance becomes a DlqRecord (``__class__`` assignment between
    two classes of one layout): 370 ns, and an ordinary frozen DlqRecord. Used only while
    DlqRecord is exactly those slotted fields with no ``__post_init__`` and the assignment
    works; otherwise the class itself is called with the row's fields."""
    names = ("topic", "key", "value", "headers", "record_id", "job", "task_key", "traceparent")
    fields = dataclasses.fields(DlqRecord)

    def called(row: tuple) -> DlqRecord:
        return DlqRecord(*row)

    if (tuple(f.name for f in fields) != names or "__post_init__" in DlqRecord.__dict__
            or tuple(getattr(DlqRecord, "__slots__", ())) != names):
        return called, False
    frozen = DlqRecord

    class _Unfrozen:
        __slots__ = names

        def __init__(self, row: tuple) -> None:
            (self.topic, self.key, self.value, self.headers, self.record_id, self.job,
             self.task_key, self.traceparent) = row
            self.__class__ = frozen

    try:
        probe = _Unfrozen(names)
    except TypeError:   # the layouts differ after all
        return called, False
    if type(probe) is not DlqRecord or probe != DlqRecord(*names):
        return called, False
    return _Unfrozen, True


# A DlqRecord from its row, fast (the builder; the spool's decoding, `dlq.codec`)
new_dlq_record, FAST_DLQ_RECORDS = _dlq_record_factory()

# A streak's DlqRecords made column-wise in C (`slots`): with their source records' keys and
# values, or context-only (no key, no value)
_SAMPLE_RECORD = {"topic": "t", "key": b"k", "value": b"v", "headers": (("h", b"1"),),
                  "record_id": "r", "job": "j", "task_key": "j/1", "traceparent": ""}
_COPIED = slots.Maker(DlqRecord, ("key", "value", "headers", "record_id"),
                      ("topic", "job", "task_key", "traceparent"),
                      lambda v: DlqRecord(**v), _SAMPLE_RECORD)
_CONTEXT_ONLY = slots.Maker(DlqRecord, ("headers", "record_id"),
                            ("topic", "key", "value", "job", "task_key", "traceparent"),
                            lambda v: DlqRecord(**v), {**_SAMPLE_RECORD, "key": None,
                                                       "value": None})
# what the records of a streak share with its first (`DlqBuilder.build_streak`); with their
# source records' copied, also no original headers (the empty tuple is one object)
_ALIKE = ("exception", "stage", "payload", "function_name", "trace")
_ALIKE_COPIED = (*_ALIKE, "headers")
_id_of, _key_of, _value_of = attrgetter("record_id"), attrgetter("key"), attrgetter("value")


def streak_records(ids: list[str], keys: list | None, values: list | None, *, topic: str,
                   before: tuple[Header, ...], name: str, after: tuple[Header, ...], job: str,
                   task_key_: str, traceparent: str) -> list[DlqRecord]:
    """The DlqRecords of a streak's columns (`Streak`; the spool stores one so): record ids
    `ids`, each with the headers ``before + ((name, its id),) + after``, and `keys` and
    `values` (None: context-only records), as lists of the ids' length."""
    maker = _COPIED if keys is not None else _CONTEXT_ONLY
    if maker.native():   # column-wise, in C
        heads = slots.id_headers(before, name, ids, after)
        if keys is not None:
            return maker.make((keys, values, heads, ids), (topic, job, task_key_, traceparent))
        return maker.make((heads, ids), (topic, None, None, job, task_key_, traceparent))
    if keys is None:
        keys = values = [None] * len(ids)
    return [new_dlq_record((topic, k, v, before + (record_id_header(i, name),) + after, i, job,
                            task_key_, traceparent)) for i, k, v in zip(ids, keys, values)]


_category_b: dict[object, bytes] = {}
_STAGE_INPUT_B = b"stage-input"
_PAYLOAD_B = {"source": b"source", "stage-input": _STAGE_INPUT_B}
_stage_b: dict[object, bytes] = {}


class DlqBuilder:
    """Builds the DLQ records of one report: `settings.job`'s records dead-lettered by `task`
    at `now_ms` on sidecar `sidecar_id`. ``build(record, verdict)`` is `build_dlq_record`."""

    # A report's records mostly fail one way and are decided alike: the bytes of what they
    # share (function, exception class, message and stack trace, source topic, reason) are
    # encoded once and the same objects go into every record's headers, so the spool's
    # marshal writes them once per segment (a back-reference after that) and the drain's
    # in-flight byte window holds that many more records.
    __slots__ = ("_p", "_task_id_b", "_tail", "_task_key", "_run", "_kind", "_kind_fn",
                 "_kind_b", "_stack_b", "_topic", "_topic_b", "_reason", "_reason_b",
                 "_shared_key", "_mid", "_post", "_has_stack", "_part", "_part_b", "_fallback",
                 "_trace", "_trace_fb", "_trace_own", "_trace_parent", "_trace_b")

    def __init__(self, settings: JobSettings, task: TaskIdentity, *, now_ms: int,
                 sidecar_id: str, run: str = "", run_id: str = "") -> None:
        p = self._p = _parts(settings)
        self._task_id_b = _utf8(task.task_id)
        self._tail = ((H_JOB, p.job_b), (H_TASK, _utf8(task_description(task))),
                      (H_SIDECAR, _utf8(sidecar_id)), (H_TIMESTAMP, str(now_ms).encode()),
                      (H_COPIED, p.copied_b)) + (((H_RUN_ID, _utf8(run_id)),) if run_id else ())
        # `run`: the run's key (`policy.run_key`): DlqRecord.job carries it, so flush barriers,
        # the spool's dedupe and acknowledgements are per run (headers carry the job's name)
        self._run = run or settings.job
        self._task_key = task_key(self._run, task)
        self._kind = self._kind_fn = self._stack_b = self._topic = self._reason = None
        self._kind_b: tuple[Header, ...] = ()
        self._topic_b = self._reason_b = b""
        self._shared_key: tuple | None = None   # what `_mid` and `_post` were built for
        self._mid: tuple[Header, ...] = ()
        self._post: tuple[Header, ...] = ()
        self._has_stack = False
        self._part, self._part_b = -1, b""   # a report's records mostly share a partition
        self._fallback: tuple[str, str] = ("", "")   # a fallback trace context, if valid
        # the last trace tuple worked out (with the fallback it was given, whether it was the
        # record's own context), the traceparent it gave and its headers
        self._trace: tuple[str, str] | None = None
        self._trace_fb = ""
        self._trace_own = False
        self._trace_parent = ""
        self._trace_b: tuple[Header, ...] = ()

    def _kind_headers(self, exc, fn: str) -> tuple[Header, ...]:
        if exc is not self._kind or fn != self._kind_fn:
            p = self._p
            self._kind, self._kind_fn = exc, fn
            self._kind_b = ((p.n_class, _utf8(fn)), (p.n_exc_class, _utf8(exc.class_name)),
                            (p.n_exc_message, _utf8(exc.message)))
            self._stack_b = (truncate_utf8(exc.stack_trace, p.stack_max)
                             if exc.stack_trace and p.stack_max > 0 else None)
        return self._kind_b

    def build(self, record: FailedRecord, verdict: Verdict,
              fallback_traceparent: str = "") -> DlqRecord:
        """The DLQ record for `record`, dead-lettered with `verdict`. A record without a valid
        trace context of its own gets `fallback_traceparent` (if valid) as if it were its own.

        The headers are put together from tuples: what records failing and decided alike share
        (the context headers from the job's name to the stack trace, and the verdict's and the
        report's headers) is built once and kept while the records keep coming that way; a
        record adds its coordinates, its id and its trace context."""
        p = self._p
        copy = p.copy
        key = (record.exception, record.function_name, record.stage, verdict.attempt,
               verdict.category, verdict.reason, record.payload)
        if key != self._shared_key:
            self._share(key)
        original = record.headers if copy else ()
        # the coordinates are needed for the context headers and to merge original headers
        source = record.source if p.context or original else None
        if p.context and source is not None:
            if source.topic != self._topic:
                self._topic, self._topic_b = source.topic, _utf8(source.topic)
            if source.partition != self._part:
                self._part, self._part_b = source.partition, str(source.partition).encode()
            added = ((p.n_topic, self._topic_b), (p.n_partition, self._part_b),
                     (p.n_offset, str(source.offset).encode())) + self._mid
        else:
            added = self._mid
        if p.keep_original and original:
            # KIP-298 (Connect format): a context header only where the original has none
            have = {h[0] for h in original if h[0].startswith(CONNECT_PREFIX)}
            if have:
                added = tuple([h for h in added if h[0] not in have])
        added += ((H_RECORD_ID, _utf8(record.record_id)),) + self._post
        # The records of one trace share its tuple (a report's columns), so what it gives is
        # worked out once: its own context, else the fallback when no original headers count
        trace = record.trace
        if trace is self._trace and fallback_traceparent is self._trace_fb \
                and (self._trace_own or not original):
            parent, trace_b = self._trace_parent, self._trace_b
        else:
            parent, state = trace
            own = bool(parent) and valid_traceparent(parent)
            if not own:
                if fallback_traceparent != self._fallback[0]:   # checked once per report
                    self._fallback = (fallback_traceparent,
                                      fallback_traceparent
                                      if valid_traceparent(fallback_traceparent) else "")
                parent, state = self._fallback[1], ""
                if not parent and original:
                    parent, state = self._trace_of(original)
            trace_b = _trace_headers(parent, state) if parent else ()
            if own or not original:
                self._trace, self._trace_fb, self._trace_own = trace, fallback_traceparent, own
                self._trace_parent, self._trace_b = parent, trace_b
        added += trace_b
        if original:
            # added headers overwrite same-named original ones (KIP-1191); trace headers are
            # always spillway's decision
            replaced = p.replaced[source is not None, self._has_stack]
            added = tuple([h for h in original if h[0] not in replaced]) + added
        return new_dlq_record((p.topic, record.key if copy else None,
                               record.value if copy else None, added, record.record_id,
                               self._run, self._task_key, parent))

    def build_streak(self, records: Sequence[FailedRecord], start: int, n: int,
                     verdict: Verdict, fallback_traceparent: str, out: list[DlqRecord], *,
                     streaks: list[Streak] | None = None) -> None:
        """`build` for each of ``records[start:start + n]`` (a streak of records decided alike:
        one `verdict` for all), appended to `out`.

        Records that also fail the same way, share a trace context and carry no original
        headers differ only in their id, key and value: after `build` made the first of them
        (and so its shared headers and trace headers), the rest are put together here without
        `build`'s checks. Anything else (context headers, which need each record's
        coordinates; original headers; another way of failing or trace) goes through
        `build`. ``streaks``: each run of such records in `out` is noted there (`Streak`)."""
        build = self.build
        p = self._p
        if p.context:
            out += [build(r, verdict, fallback_traceparent) for r in records[start:start + n]]
            return
        copy, topic, run, task_key_ = p.copy, p.topic, self._run, self._task_key
        new, utf8, h_rid = new_dlq_record, _utf8, H_RECORD_ID
        i, end = start, start + n
        while i < end:
            r = records[i]
            out.append(build(r, verdict, fallback_traceparent))
            i += 1
            exc, fn, stage, payload = r.exception, r.function_name, r.stage, r.payload
            trace = self._trace
            if self._trace_fb is not fallback_traceparent:   # the cached trace is not for it
                continue
            mid, post, parent = self._mid, self._post + self._trace_b, self._trace_parent
            first = len(out) - 1
            maker = _COPIED if copy else _CONTEXT_ONLY
            if type(records) is list and maker.native():   # column-wise, in C
                stop = slots.alike_until(
                    records, i, end, _ALIKE_COPIED if copy else _ALIKE,
                    (exc, stage, payload, fn, trace, ()) if copy else
                    (exc, stage, payload, fn, trace))
                if stop > i:
                    chunk = records[i:stop]
                    out += streak_records(
                        list(map(_id_of, chunk)), list(map(_key_of, chunk)) if copy else None,
                        list(map(_value_of, chunk)) if copy else None, topic=topic,
                        before=mid, name=h_rid, after=post, job=run, task_key_=task_key_,
                        traceparent=parent)
                    i = stop
            while i < end:
                r = records[i]
                if (r.exception is not exc or r.stage is not stage or r.payload is not payload
                        or r.function_name is not fn or r.trace is not trace
                        or (copy and r.headers)):
                    break
                rid = r.record_id
                out.append(new((topic, r.key if copy else None, r.value if copy else None,
                                mid + ((h_rid, utf8(rid)),) + post, rid, run, task_key_,
                                parent)))
                i += 1
            if streaks is not None and len(out) - first > 1:
                # its first record, made by `build`, is of the streak when shaped alike
                streak = Streak(first, len(out) - first, topic, copy, mid, post, run,
                                task_key_, parent)
                if not streak.describes(out[first]):
                    streak = dataclasses.replace(streak, start=first + 1, n=streak.n - 1)
                streaks.append(streak)

    def _share(self, key: tuple) -> None:
        """The headers records failing and decided this way share (`key`: exception,
        function, stage, attempt, category, reason, payload kind)."""
        exc, fn, stage, attempt, category, reason, payload = key
        p = self._p
        attempt_b = str(attempt).encode()
        self._has_stack = has_stack = bool(exc.stack_trace) and p.stack_max > 0
        if p.context:
            stage_b = _stage_b.get(stage)
            if stage_b is None:
                stage_b = _utf8(stage.name)
                if len(_stage_b) < 1024:
                    _stage_b[stage] = stage_b
            mid = (((p.n_job, p.job_b), (p.n_task_id, self._task_id_b)) if p.connect else
                   ((p.n_job, p.job_b), (p.n_delivery, attempt_b),
                    (p.n_task_id, self._task_id_b)))
            mid += ((p.n_stage, stage_b),) + self._kind_headers(exc, fn)
            if has_stack:
                mid += ((p.n_stacktrace, self._stack_b),)
        else:
            mid = ()
        category_b = _category_b.get(category)
        if category_b is None:
            category_b = _category_b[category] = category.value.encode()
        if reason is not self._reason:   # records decided alike share one reason string
            self._reason, self._reason_b = reason, _utf8(reason)
        post = ((H_CATEGORY, category_b), (H_ATTEMPTS, attempt_b),
                (H_REASON, self._reason_b)) + self._tail
        if p.copy:
            post += ((H_PAYLOAD, _PAYLOAD_B.get(payload, _STAGE_INPUT_B)),)
        self._mid, self._post, self._shared_key = mid, post, key

    @staticmethod
    def _trace_of(original) -> tuple[str, str]:
        """A valid trace context from the original headers; an invalid one is never copied
        through (a record's own context, else the report's fallback, come first)."""
        orig = dict(original)
        raw_parent = orig.get(H_TRACEPARENT)
        if raw_parent is not None:
            text = raw_parent.decode("ascii", "replace")
            if valid_traceparent(text):
                raw_state = orig.get(H_TRACESTATE)
                return text, (raw_state.decode("ascii", "replace")
                              if raw_state is not None else "")
        return "", ""


def build_dlq_record(settings: JobSettings, record: FailedRecord, verdict: Verdict,
                     task: TaskIdentity, *, now_ms: int, sidecar_id: str) -> DlqRecord:
    """The DLQ record for `record`, dead-lettered with `verdict` by `task` of `settings.job`."""
    return DlqBuilder(settings, task, now_ms=now_ms, sidecar_id=sidecar_id).build(record, verdict)


def build_dlq_records(settings: JobSettings, task: TaskIdentity,
                      items: Iterable[tuple[FailedRecord, Verdict]], *, now_ms: int,
                      sidecar_id: str, fallback_traceparent: str = "") -> list[DlqRecord]:
    """`build_dlq_record` for each (record, verdict) of one report; records without a valid
    trace context of their own get `fallback_traceparent` (if valid)."""
    build = DlqBuilder(settings, task, now_ms=now_ms, sidecar_id=sidecar_id).build
    return [build(r, v, fallback_traceparent) for r, v in items]
