"""The id table's C loops (`core/_idindex.c`) against the same loops in Python: the same
tables, index, journal and digests, whichever runs; and what the extension refuses."""

from __future__ import annotations

import random
import sys
from array import array

import pytest
from spillway.sidecar.core import idtable as idt
from spillway.sidecar.core import tolerance
from support.native import skip_without_a_c_compiler

native = pytest.mark.skipif(not idt.NATIVE, reason="the sidecar was installed without its C "
                            "extension (no C compiler)")


def test_the_extension_is_built_where_a_c_compiler_and_pythons_headers_are():
    """`make test` installs the sidecar with its extension on a machine that can build it (a
    silent fallback would only show in the benchmarks)."""
    skip_without_a_c_compiler()
    assert idt.NATIVE, "the sidecar's C extension (core/_idindex.c) was not built"


def test_the_key_mask_is_tolerances():
    assert idt.KEY_MASK == tolerance.KEY_MASK


class _Both:
    """Two tables fed the same operations, one with the C loops and one without."""

    def __init__(self, limit: int, monkeypatch) -> None:
        self.fast, self.slow = idt.IdTable(limit), idt.IdTable(limit)
        self.fast.journal, self.slow.journal = [], []
        self._mp = monkeypatch
        self._native = idt._native

    def __call__(self, name: str, *args):
        out = []
        for table, lib in ((self.fast, self._native), (self.slow, None)):
            self._mp.setattr(idt, "_native", lib)
            out.append(getattr(table, name)(*args))
        self._mp.setattr(idt, "_native", self._native)
        assert out[0] == out[1], name
        return out[0]

    def check(self, pool) -> None:
        f, s = self.fast, self.slow
        assert len(f) == len(s) and f.evicted == s.evicted and f._mask == s._mask
        assert f._index == s._index and f._keys == s._keys and f._tags == s._tags
        assert f._vals == s._vals and f.journal == s.journal
        assert [f.tag(k) for k in pool] == [s.tag(k) for k in pool]


@native
@pytest.mark.parametrize("limit", [1, 8, 100, 5000])
@pytest.mark.parametrize("seed", range(3))
def test_the_c_loops_leave_the_table_as_the_python_loops_do(limit, seed, monkeypatch):
    rng = random.Random(seed * 7919 + limit)
    both = _Both(limit, monkeypatch)
    # a pool with keys sharing low bits, so that probe runs are long and wrap around
    pool = [rng.getrandbits(60) for _ in range(limit * 2)]
    pool += [(rng.getrandbits(40) << 20) | rng.randrange(4) for _ in range(limit)]
    for _ in range(150):
        op = rng.random()
        if op < 0.5:
            keys = [rng.choice(pool) for _ in range(rng.randrange(1, 400))]
            tags = array("Q", [rng.getrandbits(64) for _ in keys])
            start = rng.randrange(len(keys))
            both("add_new", keys, tags, "v", start, len(keys))
        elif op < 0.7:
            both("add", rng.choice(pool), ("s", rng.randrange(3)), rng.getrandbits(64))
        elif op < 0.8:
            for _ in range(rng.randrange(1, 50)):
                both("pop", rng.choice(pool))
        elif op < 0.9:
            both("touch", rng.choice(pool))
        else:
            both("replace", rng.choice(pool), "r")
        both.check(pool[::max(1, len(pool) // 200)])
    assert both("export") is not None
    both.check(pool)


@native
def test_a_growing_table_is_indexed_as_by_python(monkeypatch):
    both = _Both(200_000, monkeypatch)
    rng = random.Random(5)
    pool = [rng.getrandbits(60) for _ in range(20_000)]
    for i in range(0, len(pool), 256):
        both("add_new", pool[i:i + 256], array("Q", range(256)), None, 0,
             len(pool[i:i + 256]))
    both.check(pool[::97])
    assert len(both.fast) == len(set(pool))


@pytest.mark.parametrize("ids", [
    [], ["a"], ["topic-0-1", "topic-0-2", "topic-0-1"], ["", "é", "\U0001f600" * 40],
    [f"job/stage-{i}/{i * 7}" for i in range(1000)],
])
def test_digests_are_record_keys(ids):
    want = [tolerance.record_key(rid) for rid in ids]
    assert list(idt.digests(ids)) == want
    assert list(idt.digests(tuple(ids))) == want


@native
def test_the_extension_refuses_what_the_table_never_passes():
    lib = idt._native
    index, keys = array("I", bytes(16 * 4)), array("Q", [1, 2, 3])
    with pytest.raises(TypeError, match="4-byte"):
        lib.insert(array("Q", bytes(16 * 8)), 15, keys, 0, 1)
    with pytest.raises(TypeError, match="8-byte"):
        lib.insert(index, 15, array("I", [1, 2]), 0, 1)
    with pytest.raises(BufferError):
        lib.insert(b"\0" * 64, 15, keys, 0, 1)          # not writable
    with pytest.raises(ValueError, match="mask"):
        lib.insert(index, 7, keys, 0, 1)                # mask of another size
    with pytest.raises(ValueError, match="mask"):
        lib.insert(array("I"), (1 << 64) - 1, keys, 0, 1)   # no slots (mask + 1 wraps to 0)
    with pytest.raises(ValueError, match="mask"):
        lib.reindex(array("I"), (1 << 64) - 1, array("Q"))
    with pytest.raises(ValueError, match="do not fit"):
        lib.insert(index, 15, keys, 4, 1)               # first past the keys
    with pytest.raises(ValueError, match="do not fit"):
        lib.insert(index, 15, keys, 0, 0)               # entry numbers start at 1
    assert lib.insert(index, 15, keys, 0, 1) == 3
    with pytest.raises(ValueError, match="empty"):
        lib.reindex(index, 15, keys)                    # not empty
    with pytest.raises(ValueError, match="larger"):
        lib.reindex(array("I", bytes(4 * 4)), 3, array("Q", range(4)))   # too small
    with pytest.raises(ValueError, match="mask"):
        lib.reindex(array("I", bytes(4 * 6)), 5, array("Q", range(2)))   # not a power of 2
    with pytest.raises(TypeError, match="str"):
        lib.digests(["a", 1])
    # a full index (which the table never makes) is an error, not an endless probe
    full = array("I", range(1, 9))
    with pytest.raises(ValueError, match="full"):
        lib.insert(full, 7, array("Q", list(range(8)) + [99]), 8, 1)


@pytest.mark.parametrize("built", [True, False])
def test_a_sidecar_without_the_extension_says_so_at_start(built, monkeypatch, caplog):
    import logging

    from spillway.sidecar.server import start_server

    monkeypatch.setattr(idt, "BUILT", built)
    monkeypatch.setattr(idt, "_built", idt._built if built else None)
    with caplog.at_level(logging.WARNING, logger="spillway.sidecar.runtime.bootstrap"):
        running = start_server({"listen.address": "127.0.0.1:0", "spool.enable": "false"})
        running.stop(0)
    said = [r.getMessage() for r in caplog.records if "C extension" in r.getMessage()]
    assert bool(said) is not built
    assert idt.NATIVE is (built and idt._built is not None)


@native
def test_the_extension_turned_off_by_the_environment_runs_the_python_loops(monkeypatch, caplog):
    """SPILLWAY_NO_EXTENSIONS=idindex: the benchmarks' side-by-side switch (target 11 (g))."""
    import logging

    from spillway.sidecar.server import start_server

    monkeypatch.setenv("SPILLWAY_NO_EXTENSIONS", "idindex")
    try:
        with caplog.at_level(logging.WARNING, logger="spillway.sidecar.runtime.bootstrap"):
            running = start_server({"listen.address": "127.0.0.1:0", "spool.enable": "false"})
            running.stop(0)
        assert not idt.NATIVE
        assert any("turned off" in r.getMessage() for r in caplog.records)
        assert idt.payload_tags_in_c(b"k", [b"x"]) is None
    finally:
        idt.use_extension(True)
    assert idt.NATIVE


def test_an_unknown_extension_name_stops_the_start_with_its_name(monkeypatch):
    from spillway.sidecar.errors import ConfigError
    from spillway.sidecar.server import start_server

    monkeypatch.setenv("SPILLWAY_NO_EXTENSIONS", "idindx")
    with pytest.raises(ConfigError, match="SPILLWAY_NO_EXTENSIONS.*idindx"):
        start_server({"listen.address": "127.0.0.1:0", "spool.enable": "false"})


@native
def test_an_id_whose_hash_changes_the_list_is_an_error_not_a_crash():
    """(Ids come from protobuf as plain str; this is the extension's own memory safety.)"""
    class Shrinking(str):
        def __hash__(self):
            ids.clear()
            return 5

    ids = [Shrinking("a"), "b", "c"]
    with pytest.raises(IndexError):
        idt._native.digests(ids)
    assert idt._native.digests([Shrinking("a")]) == (5).to_bytes(8, sys.byteorder)


class _Rec:
    __slots__ = ("key", "value", "tag")

    def __init__(self, key, value, tag=-1) -> None:
        self.key, self.value, self.tag = key, value, tag


def _payload_records(rng: random.Random) -> list[_Rec]:
    out = []
    for n in [*range(0, 260), 383, 384, 385, 1000, 5000]:    # around every block boundary
        for kn in (None, 0, 3, 122, 123, 124, 200):
            key = None if kn is None else rng.randbytes(kn)
            out.append(_Rec(key, None if n == 7 else rng.randbytes(n)))
    out += [_Rec(b"a", b"b", 12345), _Rec(b"a", b"b", 2**64 - 1), _Rec(b"a", b"b", 0)]
    return out


@native
@pytest.mark.parametrize("secret", [b"", b"x", tolerance.run_secret("a token"), b"k" * 64])
def test_payload_tags_in_c_are_hashlibs_blake2b(secret, monkeypatch):
    """The C BLAKE2b gives the digests `payload_tagger` (hashlib) gives, key and value of every
    length around the 128-byte block, null and empty ones, unkeyed and keyed; a record's own
    tag (a tally's record) is kept, up to 2**64 - 1. The fallback gives the same."""
    recs = _payload_records(random.Random(7))
    tag = tolerance.payload_tagger(secret)
    want = [r.tag if r.tag >= 0 else tag(r.key, r.value) for r in recs]
    assert list(tolerance.payload_tags(secret, recs)) == want
    monkeypatch.setattr(idt, "_native", None)
    assert list(tolerance.payload_tags(secret, recs)) == want


@native
def test_payload_tags_refuse_what_is_not_a_payload_by_name():
    lib = idt._native
    with pytest.raises(TypeError, match="record 1's key"):
        lib.payload_tags(b"s", [_Rec(b"k", b"v"), _Rec("str", b"v")])
    with pytest.raises(TypeError, match="record 0's value"):
        lib.payload_tags(b"s", [_Rec(b"k", 3)])
    with pytest.raises(ValueError, match="64 bytes"):
        lib.payload_tags(b"k" * 65, [])
    with pytest.raises(TypeError):
        lib.payload_tags(b"s", (_Rec(b"k", b"v"),))     # a list is needed
    with pytest.raises(AttributeError):
        lib.payload_tags(b"s", [object()])
    assert lib.payload_tags(b"s", []) == b""
