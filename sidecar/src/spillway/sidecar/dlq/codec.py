"""How the spool stores DLQ records: the header codec, segments and batch rows (pure, no I/O).

A report's records are serialized once, as segments: one `marshal` call each, over a list of
their field tuples, or, for records that differ only in their id, key and value
(`core.dlq_record.Streak`), over a tuple of what they share and their ids, keys and values as
columns (cut at SEG_RECORDS records or ROW_BYTES). A batch row holds segments while they fit
in ROW_BYTES and ROW_RECORDS records; a record's seq is virtual, ``row_id * 2**ROW_BITS + index``,
so that seqs keep arrival order. The rejected table keeps a record's headers as a marshalled
tuple (`encode_headers`).
"""

from __future__ import annotations

import marshal
from array import array
from collections.abc import Sequence
from itertools import compress, groupby
from operator import attrgetter, itemgetter, not_, sub

from ..core.dlq_record import H_RECORD_ID, Streak, new_dlq_record, streak_records
from ..core.model import DlqRecord, Header
from ..errors import DlqError
from .store import SpooledRecord

ROW_BITS = 16  # seq = row id * 2**16 + index in the row
IDX_MASK = (1 << ROW_BITS) - 1
ROW_RECORDS = 1 << ROW_BITS  # records per batch row at most
ROW_BYTES = 1024 * 1024  # a batch row is closed once it holds this much
SEG_RECORDS = 4096  # records per segment (one marshal call) at most
_MARSHAL_VERSION = 4
_STREAK = 1   # the first field of a segment of a streak's columns (a plain segment is a list)
MIN_STREAK = 32   # records: a shorter streak is encoded as field tuples, with its neighbours
_STREAK_FIELDS = 11
_id_of, _key_of, _value_of = attrgetter("record_id"), attrgetter("key"), attrgetter("value")


def encode_headers(headers: Sequence[Header]) -> bytes:
    """A record's headers as the rejected table stores them: one marshal call (format 4)."""
    if type(headers) is not tuple:
        headers = tuple(headers)
    return marshal.dumps(headers, _MARSHAL_VERSION)


def decode_headers(blob: bytes) -> tuple[Header, ...]:
    out = marshal.loads(blob)
    if type(out) is not tuple:
        raise DlqError(f"corrupt DLQ spool row: headers decode to {type(out).__name__}")
    return out


def record_size(rec: DlqRecord, headers_blob: bytes) -> int:
    """The bytes a record accounts for against ``spool.max.bytes``."""
    return (len(rec.key or b"") + len(rec.value or b"") + len(headers_blob) + len(rec.topic)
            + len(rec.record_id) + len(rec.job) + len(rec.task_key) + len(rec.traceparent))


def encode_segments(records: Sequence[DlqRecord], streaks: Sequence[Streak] = ()
                    ) -> list[tuple[bytes, int]]:
    """A report's records as stored: one marshal call per segment, with its record count. One
    call per report instead of one per record: marshal's per-call set-up and its reference
    table (the header names repeat in every record) are paid once. ``streaks`` (in order, not
    overlapping): runs of `records` that differ only in their id, key and value, encoded as
    columns (no tuple per record); the others as a list of their field tuples. A segment holds
    at most SEG_RECORDS records and, unless it is one record, at most ROW_BYTES (a larger one
    is cut and encoded again: rare, reports are small)."""
    out: list[tuple[bytes, int]] = []
    pos = end = 0
    for s in streaks:
        if s.start < end or s.n < 1 or s.start + s.n > len(records):
            raise ValueError(f"streak {s.start}..{s.start + s.n - 1} is not within "
                             f"{end}..{len(records) - 1} (streaks in order, not overlapping)")
        end = s.start + s.n
        if s.n < MIN_STREAK:   # its shared headers would cost more than its records' tuples
            continue
        _encode_plain(records[pos:s.start], out)
        for i in range(s.start, end, SEG_RECORDS):
            _encode_streak(s, records[i:min(i + SEG_RECORDS, end)], out)
        pos = end
    _encode_plain(records[pos:] if pos else records, out)
    return out


def _encode_plain(records: Sequence[DlqRecord], out: list[tuple[bytes, int]]) -> None:
    fields = [(r.topic, r.key, r.value, r.headers if type(r.headers) is tuple else tuple(r.headers),
               r.record_id, r.job, r.task_key, r.traceparent) for r in records]
    for i in range(0, len(fields), SEG_RECORDS):
        _encode_into(fields[i:i + SEG_RECORDS], out)


def _encode_streak(s: Streak, records: Sequence[DlqRecord], out: list[tuple[bytes, int]]
                   ) -> None:
    blob = marshal.dumps((_STREAK, s.topic, s.before, H_RECORD_ID, s.after, s.job,
                          s.task_key, s.traceparent, list(map(_id_of, records)),
                          list(map(_key_of, records)) if s.copied else None,
                          list(map(_value_of, records)) if s.copied else None),
                         _MARSHAL_VERSION)
    if len(blob) <= ROW_BYTES or len(records) == 1:
        out.append((blob, len(records)))
        return
    half = len(records) // 2   # a half that is still too large is cut again
    _encode_streak(s, records[:half], out)
    _encode_streak(s, records[half:], out)


def _encode_into(fields: list[tuple], out: list[tuple[bytes, int]]) -> None:
    blob = marshal.dumps(fields, _MARSHAL_VERSION)
    if len(blob) <= ROW_BYTES or len(fields) == 1:
        out.append((blob, len(fields)))
        return
    parts = -(-len(blob) // ROW_BYTES)  # a part that is still too large is cut again
    step = -(-len(fields) // parts)
    for i in range(0, len(fields), step):
        _encode_into(fields[i:i + step], out)


def seg_sizes(nbytes: int, count: int) -> list[int]:
    """The bytes each record of a segment accounts for: the segment's bytes split evenly (the
    remainder on its last record), so that a row's per-record ends fall on segment bounds."""
    q, r = divmod(nbytes, count)
    sizes = [q] * count
    sizes[-1] += r
    return sizes


def record_from_row(row: Sequence) -> DlqRecord:
    """A record from the rejected table's columns (job .. traceparent)."""
    job, record_id, task_key, topic, key, value, blob, traceparent = row
    return DlqRecord(topic=topic, key=key, value=value, headers=decode_headers(blob),
                     record_id=record_id, job=job, task_key=task_key, traceparent=traceparent)


def seq_ranges(seqs: Sequence[int]) -> list[tuple[int, int]]:
    """Sorted, de-duplicated runs of consecutive seqs as (first, last) pairs."""
    ordered = sorted(set(seqs))
    out: list[tuple[int, int]] = []
    lo = hi = ordered[0]
    for s in ordered[1:]:
        if s == hi + 1:
            hi = s
        else:
            out.append((lo, hi))
            lo = hi = s
    out.append((lo, hi))
    return out


def row_ends(data_ends: bytes) -> array:
    """A batch row's per-record end offsets (``ends``) or segment counts (``segs``)."""
    a = array("I")
    a.frombytes(data_ends)
    return a


def decode_row(rid: int, ends: bytes, segs: bytes, data: bytes, start: int,
               done: bytes | bytearray | None) -> list[tuple[int, SpooledRecord]]:
    """The records of batch row `rid` from index `start` on, in order, but those `done` marks
    settled, as (index, record) pairs (`decode_columns`)."""
    seqs: list[int] = []
    records: list[DlqRecord] = []
    sizes: list[int] = []
    decode_columns(rid, ends, segs, data, start=start, stop=ROW_RECORDS, done=done,
                   into=(seqs, records, sizes))
    return [(seq & IDX_MASK, SpooledRecord(seq, rec, size))
            for seq, rec, size in zip(seqs, records, sizes)]


def decode_columns(rid: int, ends: bytes, segs: bytes, data: bytes, *, start: int, stop: int,
                   done: bytes | bytearray | None,
                   into: tuple[list[int], list[DlqRecord], list[int]]) -> None:
    """`decode_row`'s records with index in [`start`, `stop`), appended to the columns `into`
    (seqs, records, bytes): `segs` holds the record count of each segment (one marshalled list of
    records); a segment's records are picked, checked and made in one pass each, so the drain
    reading a backlog back makes no object per record but the record."""
    seqs, records, sizes = into
    e = row_ends(ends)
    base = rid << ROW_BITS
    first = 0
    for count in row_ends(segs):
        last = first + count
        lo, hi = max(first, start), min(last, stop)
        if hi > lo and (done is None or not all(done[lo:hi])):
            seg_start = e[first - 1] if first else 0
            picked = _segment_records(memoryview(data)[seg_start:e[last - 1]], count,
                                      lo - first, hi - first)
            size = map(sub, e[lo:hi], [e[lo - 1] if lo else 0, *e[lo:hi - 1]])
            index = range(base | lo, base | hi)
            if done is not None:
                keep = list(map(not_, done[lo:hi]))
                picked, size, index = compress(picked, keep), compress(size, keep), \
                    compress(index, keep)
            seqs.extend(index)
            records.extend(picked)
            sizes.extend(size)
        if last >= stop:
            return
        first = last


def decode_segments(segments: Sequence[tuple[bytes, int]], records: list[DlqRecord],
                    sizes: list[int]) -> None:
    """Records encoded by `encode_segments`, and the bytes each accounts for (`seg_sizes`, as
    the spool's rows say), appended to `records` and `sizes`: the hand-off keeps a commit's
    records so and the drain makes them when it takes them."""
    for blob, count in segments:
        records += _segment_records(blob, count, 0, count)
        sizes += seg_sizes(len(blob), count)


def _segment_records(blob: bytes | memoryview, count: int, lo: int, hi: int
                     ) -> list[DlqRecord]:
    """Records `lo` .. `hi` - 1 of one segment (`encode_segments`), checked to be of its
    `count` records."""
    items = marshal.loads(blob)
    if type(items) is tuple:
        return _streak_records(items, count, lo, hi)
    if type(items) is not list or len(items) != count:
        raise DlqError("corrupt DLQ spool row: a segment does not decode to its records")
    picked = items[lo:hi]
    if set(map(type, picked)) != {tuple} or set(map(len, picked)) != {8}:
        raise DlqError("corrupt DLQ spool row: a record does not decode to its 8 fields")
    return list(map(new_dlq_record, picked))


def _streak_records(columns: tuple, count: int, lo: int, hi: int) -> list[DlqRecord]:
    """Records `lo` .. `hi` - 1 of a streak's segment (`_encode_streak`)."""
    if len(columns) != _STREAK_FIELDS or columns[0] != _STREAK:
        raise DlqError("corrupt DLQ spool row: a segment is neither records nor a streak")
    _, topic, before, name, after, job, task_key, parent, ids, keys, values = columns
    if (type(ids) is not list or len(ids) != count or type(before) is not tuple
            or type(after) is not tuple or (keys is None) != (values is None)
            or (keys is not None and (type(keys) is not list or type(values) is not list
                                      or len(keys) != count or len(values) != count))
            or type(name) is not str or (ids and set(map(type, ids)) != {str})):
        raise DlqError("corrupt DLQ spool row: a streak does not decode to its records")
    if keys is not None:
        keys, values = keys[lo:hi], values[lo:hi]
    return streak_records(ids[lo:hi], keys, values, topic=topic, before=before, name=name,
                          after=after, job=job, task_key_=task_key, traceparent=parent)


def rows_in_order(parts: Sequence[tuple[list[tuple[bytes, int]], int]]
                  ) -> tuple[list[list[tuple[bytes, int]]], list[int]]:
    """The batch rows of a commit's parts, in order (each part a request's segments and the
    held row they are read from, 0: none), and per row its held row: a part read from a held
    row is a row of its own; the other parts' segments are cut into rows between them."""
    rows: list[list[tuple[bytes, int]]] = []
    srcs: list[int] = []
    for held, group in groupby(parts, key=itemgetter(1)):
        if held:
            for segments, _ in group:
                rows.append(segments)
                srcs.append(held)
        else:
            cut = split_segments([seg for segments, _ in group for seg in segments])
            rows += cut
            srcs += [0] * len(cut)
    return rows, srcs


def split_segments(segments: list[tuple[bytes, int]]) -> list[list[tuple[bytes, int]]]:
    """Cut segments into batch rows, in order: a row takes segments while they fit in ROW_BYTES
    (a larger segment gets a row of its own) and ROW_RECORDS records."""
    rows: list[list[tuple[bytes, int]]] = []
    cur: list[tuple[bytes, int]] = []
    nbytes = nrecs = 0
    for seg in segments:
        if cur and (nbytes + len(seg[0]) > ROW_BYTES or nrecs + seg[1] > ROW_RECORDS):
            rows.append(cur)
            cur, nbytes, nrecs = [], 0, 0
        cur.append(seg)
        nbytes += len(seg[0])
        nrecs += seg[1]
    if cur:
        rows.append(cur)
    return rows
