"""IdTable: a bounded map from record-id digests to values, least recently used evicted first,
that holds no Python object per entry.

A job remembers up to hundreds of thousands of record ids (`tolerance.MAX_COUNTED_IDS`,
`policy.MAX_TRACKED_RECORDS`). Kept as dict keys, every id is an int object of its own (32
bytes, from Python's small-object allocator), allocated while a burst of reports is decided
and interleaved there with the burst's short-lived objects. The allocator hands a 1 MiB arena
back to the OS only once every object in it is gone, so a few thousand remembered ids spread
over a burst's arenas keep all of them resident after the burst (bench target 7: RSS after a
1M-record outage drained). Here the ids live in flat arrays (large buffers, from malloc):

- entries, in use order: ``_keys`` (array of unsigned 64-bit), ``_tags`` (array of unsigned
  64-bit: a second digest per entry, e.g. of the record's payload, so that a record reported
  under a remembered id can be told apart from the remembered one) and ``_vals`` (a list:
  values are shared objects such as None or a skipped record's answer, so the list adds a
  reference, not an object). A touched entry is appended again and its earlier place marked dead
  (``_DEAD``); eviction takes the first live entry from ``_head``; dead prefixes are cut off
  and dead entries in the middle compacted away (amortised O(1)), as a dict's own entries are.
- an open-addressing index (``_index``, array of unsigned 32-bit, linear probing, at most half
  full): slot -> entry number + 1 (0: empty), entry numbers counted from ``_off``. Deletion
  shifts the probe sequence back, so the index has no tombstones.

Keys are 60-bit digests (`tolerance.record_key`), uniformly spread, so a key's low bits are its
home slot. About 20-30 bytes an entry (a dict of int keys plus an order deque: ~92).
Not thread-safe: callers hold their job's lock.

The loops that run once per id of a stretch (`add_new`'s probing and indexing, the index built
again as the table grows, and record ids' digests: `digests`) run in C when the sidecar was
installed with its extension (`_idindex.c`, built where a C compiler is: ~20 ns an id instead
of ~0.5 µs; a home's tally spends about half its time here otherwise), and in Python with the
same results when it was not, or when the sidecar's start turned it off (`use_extension`:
``SPILLWAY_NO_EXTENSIONS=idindex``); `NATIVE` says which.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence
from typing import Generic, TypeVar

try:
    from . import _idindex as _native
except ImportError:   # installed without a C compiler: the same loops in Python
    _native = None

V = TypeVar("V")

BUILT = _native is not None
NATIVE = BUILT
_built = _native


def use_extension(on: bool) -> None:
    """Whether the per-id loops run in C (where the extension was built) or in Python. Decided
    once by the sidecar's start, before any table exists: the benchmarks compare the two side
    by side, and an operator can rule the extension out (docs/CONFIGURATION.md)."""
    global _native, NATIVE
    _native = _built if on else None
    NATIVE = _native is not None

_DEAD = (1 << 64) - 1          # a dead entry's key (digests have 60 bits)
_MIN_SLOTS = 16
_MAX_NUMBER = (1 << 32) - 2    # entry numbers + 1 must fit the index's 32 bits
_COMPACT_SLACK = 1024
KEY_BITS = 60                  # keys are record-id digests of this many bits (tolerance.py)
KEY_MASK = (1 << KEY_BITS) - 1


def _le(column: array) -> bytes:
    """An array of unsigned 64-bit as little-endian bytes (`export`, the journal)."""
    if sys.byteorder != "little":
        column = array("Q", column)
        column.byteswap()
    return column.tobytes()


def _from_le(data: bytes) -> array:
    column = array("Q")
    column.frombytes(data)
    if sys.byteorder != "little":
        column.byteswap()
    return column


def payload_tags_in_c(secret: bytes, records: Sequence) -> array | None:
    """`tolerance.payload_tags` in one C call (an array('Q')), or None where the extension was
    not built."""
    if _native is None:
        return None
    out = array("Q")
    out.frombytes(_native.payload_tags(secret, records if type(records) is list
                                       else list(records)))
    return out


def digests(ids: Sequence[str]) -> Sequence[int]:
    """`tolerance.record_key` of each record id, in order (an array of unsigned 64-bit)."""
    if _native is None:
        return array("Q", [hash(rid) & KEY_MASK for rid in ids])
    out = array("Q")
    out.frombytes(_native.digests(ids))
    return out


class IdTable(Generic[V]):
    """A bounded map of int keys in [0, 2**60), least recently used entry evicted first."""

    __slots__ = ("limit", "evicted", "journal", "_keys", "_tags", "_vals", "_index", "_mask",
                 "_grow_at", "_off", "_head", "_live", "_dead", "_mk", "_ms", "_ek", "_en")

    def __init__(self, limit: int) -> None:
        self.limit = max(1, limit)
        self.evicted = 0
        # a list: every add and replace is appended to it (a run's durable state, `runstate`)
        self.journal: list | None = None
        self._keys = array("Q")
        self._tags = array("Q")
        self._vals: list[V | None] = []
        self._index = array("I", bytes(4 * _MIN_SLOTS))
        self._mask = _MIN_SLOTS - 1
        self._grow_at = _MIN_SLOTS // 2   # live entries past which the index doubles
        self._off = 1          # entry number + 1 of _keys[0]: position = index value - _off
        self._head = 0         # position of the first entry that may be live
        self._live = 0
        self._dead = 0         # dead entries at or after _head
        # The policy engine asks about one key several times in a row (get, `in`, add,
        # replace): the last probe is remembered so that each asks the index once.
        self._mk = -1          # a key found absent, and the empty slot where its probe ended,
        self._ms = 0           # valid until the index next changes
        self._ek = -1          # a key just added or found, and its entry number, valid until
        self._en = 0           # that entry moves (touch, pop, eviction, rebuild)

    def __len__(self) -> int:
        return self._live

    def _slot(self, key: int) -> int:
        """The index slot holding key, or -1."""
        index, keys, off, mask = self._index, self._keys, self._off, self._mask
        i = key & mask
        while True:
            e = index[i]
            if not e:
                return -1
            if keys[e - off] == key:
                return i
            i = (i + 1) & mask

    def __contains__(self, key: int) -> bool:
        if key == self._mk:
            return False
        index, mask = self._index, self._mask
        i = key & mask
        e = index[i]
        while e:
            if self._keys[e - self._off] == key:
                return True
            i = (i + 1) & mask
            e = index[i]
        self._mk = key
        self._ms = i
        return False

    def get(self, key: int, default: V | None = None) -> V | None:
        if key == self._mk or not self._live:
            return default
        index, mask = self._index, self._mask
        i = key & mask
        e = index[i]
        while e:
            if self._keys[e - self._off] == key:
                self._ek = key
                self._en = e
                return self._vals[e - self._off]
            i = (i + 1) & mask
            e = index[i]
        self._mk = key
        self._ms = i
        return default

    def add(self, key: int, value: V, tag: int | None = None) -> None:
        """Set key's value and make it the most recently used; evict past the limit. ``tag``
        (an int in [0, 2**64)): the entry's tag; None keeps a present entry's (0 for a new one)."""
        if self.journal is not None:
            self.journal.append(("i", key, value, tag))
        index, keys, off = self._index, self._keys, self._off
        if key == self._mk:                  # just found absent: its slot is known
            i = self._ms
        else:
            mask = self._mask
            i = key & mask
            while True:
                e = index[i]
                if not e:
                    break
                if keys[e - off] == key:
                    self._set_and_touch(i, e - off, value, tag)
                    return
                i = (i + 1) & mask
        n = len(keys) + off
        if n > _MAX_NUMBER:
            self._rebuild(len(index))
            self.add(key, value, tag)
            return
        index[i] = n
        keys.append(key)
        self._tags.append(tag or 0)
        self._vals.append(value)
        self._mk = -1
        self._ek = key
        self._en = n
        if self._live < self.limit:
            self._live += 1
            if self._live > self._grow_at:
                self._rebuild(2 * len(index))
            return
        # full: evict the least recently used entry (inline: once per add in a long burst)
        head = self._head
        k = keys[head]
        while k == _DEAD:
            head += 1
            self._dead -= 1
            k = keys[head]
        mask = self._mask
        i = k & mask
        while keys[index[i] - off] != k:
            i = (i + 1) & mask
        j = i                                # empty slot i, shifting its probe run back
        while True:
            j = (j + 1) & mask
            e = index[j]
            if not e:
                break
            if (j - (keys[e - off] & mask)) & mask >= (j - i) & mask:
                index[i] = e
                i = j
        index[i] = 0
        keys[head] = _DEAD
        self._vals[head] = None
        head += 1
        self.evicted += 1
        if head >= _COMPACT_SLACK and 2 * head >= len(keys):
            del keys[:head]
            del self._tags[:head]
            del self._vals[:head]
            self._off = off + head
            head = 0
        self._head = head
        if k == key:                         # (a limit of 1)
            self._ek = -1

    def add_new(self, keys: Sequence[int], tags: Sequence[int], value: V, start: int,
                stop: int) -> int:
        """For each ``keys[p]``, ``tags[p]`` from `start` to `stop`, in order, while the key is
        absent: `add(key, value, tag)`; returns how many were added (a key left over is
        present). One call for a streak of new keys (a home's tally, `streaks.py`).

        The common insert (no growth, no eviction) is done in stretches: a stretch's keys and
        tags are appended to the columns first (so a key repeated inside the stretch is found
        present), probed and indexed one by one, and the part after a present key cut off
        again. The journal gets one ``("n", keys, tags, value)`` entry per stretch (the columns
        as little-endian bytes, `load`'s input) instead of a tuple per key. Any other insert
        goes through `add`."""
        added = 0
        p = start
        journal = self.journal
        # the columns are extended by slices of keys and tags: an array only of their own type
        if type(keys) is array and keys.typecode != "Q":
            keys = list(keys)
        if type(tags) is array and tags.typecode != "Q":
            tags = list(tags)
        while p < stop:
            ekeys, etags, off = self._keys, self._tags, self._off
            first = len(ekeys)
            room = min(self.limit, self._grow_at) - self._live
            room = min(room, _MAX_NUMBER + 1 - (first + off), stop - p)
            if room <= 0:
                key = keys[p]
                if key in self:                 # (remembers the empty slot it found)
                    return added
                self.add(key, value, tags[p])   # evicts, grows or renumbers
                added += 1
                p += 1
                continue
            index, mask = self._index, self._mask
            ekeys.extend(keys[p:p + room])
            etags.extend(tags[p:p + room])
            n = first + off
            q = 0
            if _native is not None:
                q = _native.insert(index, mask, ekeys, first, off)
            else:
                for key in ekeys[first:]:
                    i = key & mask
                    e = index[i]
                    while e:
                        if ekeys[e - off] == key:
                            break
                        i = (i + 1) & mask
                        e = index[i]
                    else:
                        index[i] = n + q
                        q += 1
                        continue
                    break
            if q < room:
                del ekeys[first + q:]
                del etags[first + q:]
            if q:
                self._vals.extend([value] * q)
                self._live += q
                self._mk = -1
                self._ek, self._en = ekeys[first + q - 1], n + q - 1
                if journal is not None:
                    journal.append(("n", _le(ekeys[first:first + q]),
                                    _le(etags[first:first + q]), value))
                added += q
                p += q
            if q < room:
                return added                    # keys[p] is present
        return added

    def _set_and_touch(self, i: int, p: int, value: V, tag: int | None = None) -> None:
        keys, vals, tags = self._keys, self._vals, self._tags
        if tag is None:
            tag = tags[p]
        if p == len(keys) - 1:               # already the most recently used
            vals[p] = value
            tags[p] = tag
            self._ek = keys[p]
            self._en = p + self._off
            return
        n = len(keys) + self._off
        if n > _MAX_NUMBER:
            key = keys[p]
            self._rebuild(len(self._index))
            self.add(key, value, tag)
            return
        key = keys[p]
        keys[p] = _DEAD
        vals[p] = None
        keys.append(key)
        tags.append(tag)
        vals.append(value)
        self._index[i] = n
        self._ek = key
        self._en = n
        self._dead += 1
        if self._dead > self._live + _COMPACT_SLACK:
            self._rebuild(len(self._index))

    def replace(self, key: int, value: V) -> None:
        """Change a present key's value without touching it (absent: nothing)."""
        if self.journal is not None:
            self.journal.append(("r", key, value))
        if key == self._ek:
            self._vals[self._en - self._off] = value
            return
        i = self._slot(key)
        if i >= 0:
            self._vals[self._index[i] - self._off] = value

    def tag(self, key: int) -> int:
        """A present key's tag; -1 when the key is absent (remembered, as by `get`, so that
        the get / add of the same key that follows asks the index no more)."""
        if key == self._ek:
            return self._tags[self._en - self._off]
        if key == self._mk or not self._live:
            return -1
        index, mask, keys, off = self._index, self._mask, self._keys, self._off
        i = key & mask
        e = index[i]
        while e:
            if keys[e - off] == key:
                self._ek = key
                self._en = e
                return self._tags[e - off]
            i = (i + 1) & mask
            e = index[i]
        self._mk = key
        self._ms = i
        return -1

    def touch(self, key: int) -> None:
        """Make a present key the most recently used."""
        i = self._slot(key)
        if i >= 0:
            p = self._index[i] - self._off
            self._set_and_touch(i, p, self._vals[p])

    def pop(self, key: int, default: V | None = None) -> V | None:
        i = self._slot(key)
        if i < 0:
            return default
        keys, vals = self._keys, self._vals
        p = self._index[i] - self._off
        value = vals[p]
        self._unindex(i)
        self._ek = -1
        self._live -= 1
        if p == len(keys) - 1:     # the most recent entry: the common case (a record's
            keys.pop()             # schedule dropped right after it was made)
            self._tags.pop()
            vals.pop()
        else:
            keys[p] = _DEAD
            vals[p] = None
            self._dead += 1
            if self._dead > self._live + _COMPACT_SLACK:
                self._rebuild(len(self._index))
        return value

    def export(self) -> tuple[bytes, bytes, list]:
        """The live entries, least recently used first, as (keys, tags, values): the keys and
        tags as little-endian 8-byte columns, copied from the flat arrays without an int
        object per entry (a run's snapshot, `jobstate.JobState.snapshot`: 200,000 ids made
        into tuples took tens of MB of small objects, and the allocator kept the arenas)."""
        if self._dead:
            self._rebuild(len(self._index))   # dead entries out: the live ones are a slice
        head = self._head
        return _le(self._keys[head:]), _le(self._tags[head:]), self._vals[head:]

    def load(self, keys: bytes, tags: bytes, values: Sequence[V]) -> None:
        """`add` each entry of an `export` (or of an ``"n"`` journal entry), in order."""
        k, t = _from_le(keys), _from_le(tags)
        if not len(k) == len(t) == len(values):
            raise ValueError("an exported id table's columns differ in length")
        for key, tag, value in zip(k, t, values):
            self.add(key, value, tag)

    def keys(self) -> list[int]:
        """The keys, least recently used first."""
        return [k for k in self._keys[self._head:] if k != _DEAD]

    # --- internals -------------------------------------------------------------------------

    def _unindex(self, i: int) -> None:
        """Empty index slot i, shifting later members of its probe run back into the gap."""
        index, keys, off, mask = self._index, self._keys, self._off, self._mask
        self._mk = -1
        j = i
        while True:
            j = (j + 1) & mask
            e = index[j]
            if not e:
                break
            if (j - (keys[e - off] & mask)) & mask >= (j - i) & mask:  # i is on e's path
                index[i] = e
                i = j
        index[i] = 0

    def _rebuild(self, slots: int) -> None:
        """Entries copied without dead ones, numbered from 1 again, into a fresh index."""
        keys, vals, tags = self._keys, self._vals, self._tags
        head = self._head
        if self._dead:
            live = [p for p in range(head, len(keys)) if keys[p] != _DEAD]
            new_keys = array("Q", [keys[p] for p in live])
            new_tags = array("Q", [tags[p] for p in live])
            new_vals = [vals[p] for p in live]
        else:
            new_keys, new_tags, new_vals = keys[head:], tags[head:], vals[head:]
        while slots > _MIN_SLOTS and 4 * len(new_keys) < slots:   # shrink after mass pops
            slots >>= 1
        index = array("I", bytes(4 * slots))
        mask = slots - 1
        if _native is not None:
            _native.reindex(index, mask, new_keys)
        else:
            for n, k in enumerate(new_keys, 1):
                i = k & mask
                while index[i]:
                    i = (i + 1) & mask
                index[i] = n
        self._keys, self._tags, self._vals = new_keys, new_tags, new_vals
        self._index, self._mask = index, mask
        self._grow_at = slots // 2
        self._off, self._head, self._dead = 1, 0, 0
        self._mk = self._ek = -1
