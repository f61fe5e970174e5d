"""A report's per-record objects made in C (`_slots.c`), where the sidecar was built with it.

A node makes several objects for each record it dead-letters: the record's view over its
report's columns (`transport.columns.ColumnRecord`), its DLQ record and that record's headers
(`dlq_record.DlqBuilder.build_streak`) and the drain's entry (`dlq.handoff.Entry`). Each call of
a Python class's ``__init__`` costs more than the rest of the record's step, so these are made
column-wise in C instead: each instance's slots set through the class's member descriptors,
``__init__`` not called. A class is made so only where `Maker` checked that this gives what its
``__init__`` gives (its slots are exactly the fields it is given, it defines no ``__new__`` or
``__post_init__``, and an instance made both ways compares equal); otherwise, where the
extension was not built, or where the sidecar's start turned it off
(``SPILLWAY_NO_EXTENSIONS=slots``, `use_extension`), the callers' own Python loops run, with the
same results. `NATIVE` says which.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

try:
    from . import _slots as _native
except ImportError:   # installed without a C compiler: the callers' Python loops
    _native = None

BUILT = _native is not None
NATIVE = BUILT
_built = _native


def use_extension(on: bool) -> None:
    """Whether per-record objects are made in C (where the extension was built) or by the
    callers' Python loops. Decided once by the sidecar's start: the benchmarks compare the two
    side by side (target 11 (h)), and an operator can rule the extension out
    (docs/DEPLOY.md)."""
    global _native, NATIVE
    _native = _built if on else None
    NATIVE = _native is not None


class Maker:
    """Instances of `cls` from columns: `per` names the slots set from a list each (one value
    per instance), `shared` those set to one value for all. `usable` is False where the class
    cannot be made so (see the module); `sample` makes one instance through the class's own
    constructor from a dict of its fields, for the check."""

    __slots__ = ("cls", "per", "shared", "_per_d", "_shared_d", "usable")

    def __init__(self, cls: type, per: Sequence[str], shared: Sequence[str],
                 sample: Callable[[dict[str, Any]], Any], values: dict[str, Any]) -> None:
        self.cls, self.per, self.shared = cls, tuple(per), tuple(shared)
        self.usable = False
        self._per_d: tuple = ()
        self._shared_d: tuple = ()
        if _built is None:
            return
        # every slot of the class and its bases is one of the fields given, once; no __dict__
        slots: list[str] = []
        for base in cls.__mro__[:-1]:
            own = base.__dict__.get("__slots__")
            if own is None:
                return
            slots += [own] if isinstance(own, str) else list(own)
        names = (*self.per, *self.shared)
        if (sorted(slots) != sorted(names) or len(set(names)) != len(names) or not self.per
                or cls.__new__ is not object.__new__ or "__post_init__" in cls.__dict__):
            return
        descr = type(cls.__dict__.get(self.per[0]))
        if descr.__name__ != "member_descriptor" or any(
                type(cls.__dict__.get(n)) is not descr for n in (*self.per, *self.shared)):
            return
        self._per_d = tuple(cls.__dict__[n] for n in self.per)
        self._shared_d = tuple(cls.__dict__[n] for n in self.shared)
        try:
            made = _built.make(cls, self._per_d, tuple([values[n]] for n in self.per),
                               self._shared_d, tuple(values[n] for n in self.shared))[0]
            self.usable = type(made) is cls and made == sample(values)
        except Exception:   # noqa: BLE001 - a class this cannot make: its own loop serves
            self.usable = False

    def make(self, columns: Sequence[list], shared: Sequence[Any] = ()) -> list:
        """One instance per row of `columns` (lists of one length, in `per`'s order), each with
        `shared` (in `shared`'s order). Only while `native()`."""
        return _native.make(self.cls, self._per_d, tuple(columns), self._shared_d, tuple(shared))

    def native(self) -> bool:
        """Whether `make` may be called now (built, usable, not turned off)."""
        return self.usable and _native is not None


def alike_until(objs: list, start: int, end: int, names: tuple[str, ...],
                values: tuple) -> int:
    """The first index in [start, end) of `objs` whose attribute names[j] is not values[j]
    for some j (by identity); `end` if none."""
    if _native is not None:
        return _native.alike_until(objs, start, end, names, values)
    for i in range(start, end):
        o = objs[i]
        for name, value in zip(names, values):
            if getattr(o, name) is not value:
                return i
    return end


def id_headers(before: tuple, name: str, ids: list[str], after: tuple) -> list[tuple]:
    """Per id, ``before + ((name, id as UTF-8, backslashreplace),) + after``."""
    if _native is not None:
        return _native.id_headers(before, name, ids, after)
    return [before + ((name, i.encode("utf-8", "backslashreplace")),) + after for i in ids]


__all__ = ["BUILT", "Maker", "NATIVE", "alike_until", "id_headers", "use_extension"]
