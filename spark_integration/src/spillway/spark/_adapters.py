"""Adapters between the verdict loop and each kind of wrapped user function (executor side).

- `RowAdapter`: ``fn(row)`` per record (map_partitions);
- `BatchAdapter`: ``fn(batch)`` on a whole Arrow RecordBatch or pandas DataFrame (map_in_arrow,
  map_in_pandas); a failed batch is bisected until the failing rows are isolated;
- `SinkAdapter`: ``write_fn(rows)`` on chunks of rows (foreach_partition / foreach_batch),
  bisected the same way;
- `DeserializeAdapter`: key / value / whole-record deserializers on the Kafka source columns.

A guarded task attempt (`_isolation`) runs the user function in a helper process, whose result
must travel back pickled: `listed`, `batch_outputs` and `unvalued` make each kind's function
return what the adapter would make of its result anyway (a list of outputs; None for a write).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from ._engine import StageFailure, StageRef, Unit
from ._records import VALUE_ROWS, RecordContext, context_of, value_context

IdFactory = Callable[[int], str]  # partition row index -> positional record id


class RowAdapter:
    def __init__(self, fn: Callable[[Any], Any], *, ids: IdFactory, flat: bool = False,
                 record_id: Callable[[Any], str] | None = None,
                 source: Callable[[Any], Any] | None = None) -> None:
        self.fn, self.ids, self.flat, self.record_id, self.source = fn, ids, flat, record_id, source

    def run(self, unit: Unit) -> Sequence[Any]:
        out = self.fn(unit.payload)
        return list(out) if self.flat else (out,)

    def split(self, unit: Unit) -> list[Unit] | None:
        return None

    def context(self, unit: Unit) -> RecordContext:
        row = unit.payload
        # a value row with a positional id skips context_of's fallback-id closure (with
        # value_context's direct tuple, about 0.4 µs a failed record in the loop)
        if self.source is None and self.record_id is None and type(row) in VALUE_ROWS:
            return value_context(self.ids(unit.offset), row)
        return context_of(row, lambda: self.ids(unit.offset), self.record_id, self.source)


def row_units(rows: Iterable[Any]) -> Iterator[Unit]:
    for i, row in enumerate(rows):
        yield Unit(row, 1, i)


# --- vectorized ---------------------------------------------------------------------------


def _arrow_outputs(out: Any) -> list:
    import pyarrow as pa

    if out is None:
        return []
    if isinstance(out, pa.RecordBatch):
        return [out]
    if isinstance(out, pa.Table):
        return out.to_batches()
    if isinstance(out, Iterable):
        batches: list = []
        for item in out:
            batches.extend(_arrow_outputs(item))
        return batches
    raise TypeError(f"map_in_arrow: fn must return a pyarrow RecordBatch or Table (or an "
                    f"iterable of them), got {type(out).__name__}")


def _pandas_outputs(out: Any) -> list:
    import pandas as pd

    if out is None:
        return []
    if isinstance(out, pd.DataFrame):
        return [out]
    if isinstance(out, Iterable):
        frames: list = []
        for item in out:
            frames.extend(_pandas_outputs(item))
        return frames
    raise TypeError(f"map_in_pandas: fn must return a pandas DataFrame (or an iterable of "
                    f"them), got {type(out).__name__}")


class BatchAdapter:
    """``fn(batch) -> batch``; ``kind`` is "arrow" (RecordBatch) or "pandas" (DataFrame).

    ``conform(output) -> output`` (see `_schema`) checks each output against the declared
    schema: an output that does not fit fails the unit, which is bisected like any failure, so
    only the rows whose output does not fit are reported."""

    def __init__(self, fn: Callable[[Any], Any], kind: str, *, ids: IdFactory,
                 record_id: Callable[[Any], str] | None = None,
                 source: Callable[[Any], Any] | None = None,
                 conform: Callable[[Any], Any] | None = None) -> None:
        if kind not in ("arrow", "pandas"):
            raise ValueError(f"kind: arrow or pandas, got {kind!r}")
        self.fn, self.kind, self.ids, self.record_id, self.source = fn, kind, ids, record_id, source
        self.conform = conform

    def run(self, unit: Unit) -> Sequence[Any]:
        out = self.fn(unit.payload)
        outs = _arrow_outputs(out) if self.kind == "arrow" else _pandas_outputs(out)
        conform = self.conform
        return [conform(o) for o in outs] if conform is not None else outs

    def _slice(self, batch: Any, start: int, stop: int) -> Any:
        if self.kind == "arrow":
            return batch.slice(start, stop - start)
        return batch.iloc[start:stop].reset_index(drop=True)

    def split(self, unit: Unit) -> list[Unit] | None:
        n = unit.size
        if n < 2:
            return None
        half = n // 2
        return [Unit(self._slice(unit.payload, 0, half), half, unit.offset),
                Unit(self._slice(unit.payload, half, n), n - half, unit.offset + half)]

    def first_row(self, batch: Any) -> dict:
        if self.kind == "arrow":
            return batch.slice(0, 1).to_pylist()[0]
        return batch.iloc[0].to_dict()

    def context(self, unit: Unit) -> RecordContext:
        return context_of(self.first_row(unit.payload), lambda: self.ids(unit.offset),
                          self.record_id, self.source)


def batch_units(batches: Iterable[Any]) -> Iterator[Unit]:
    offset = 0
    for batch in batches:
        n = batch.num_rows if hasattr(batch, "num_rows") else len(batch)
        if n:
            yield Unit(batch, n, offset)
        offset += n


# --- sinks ----------------------------------------------------------------------------------


class SinkAdapter:
    """``write_fn(rows: list)`` per chunk; a failed chunk is bisected down to single rows."""

    def __init__(self, write_fn: Callable[[list], Any], *, ids: IdFactory,
                 record_id: Callable[[Any], str] | None = None,
                 source: Callable[[Any], Any] | None = None) -> None:
        self.write_fn, self.ids, self.record_id, self.source = write_fn, ids, record_id, source

    def run(self, unit: Unit) -> Sequence[Any]:
        self.write_fn(list(unit.payload))
        return ()

    def split(self, unit: Unit) -> list[Unit] | None:
        rows, n = unit.payload, unit.size
        if n < 2:
            return None
        half = n // 2
        return [Unit(rows[:half], half, unit.offset), Unit(rows[half:], n - half,
                                                           unit.offset + half)]

    def context(self, unit: Unit) -> RecordContext:
        return context_of(unit.payload[0], lambda: self.ids(unit.offset), self.record_id,
                          self.source)


def chunk_units(rows: Iterable[Any], size: int) -> Iterator[Unit]:
    chunk: list = []
    offset = 0
    for row in rows:
        chunk.append(row)
        if len(chunk) >= size:
            yield Unit(chunk, len(chunk), offset)
            offset += len(chunk)
            chunk = []
    if chunk:
        yield Unit(chunk, len(chunk), offset)


# --- deserialization ------------------------------------------------------------------------


class Deserializer:
    """One deserialization step: ``fn`` on the key bytes, the value bytes or the whole record;
    ``check(result)`` raises when the result does not fit the step's declared Spark type."""

    def __init__(self, part: str, fn: Callable[[Any], Any], stage: StageRef,
                 function_name: str, check: Callable[[Any], None] | None = None) -> None:
        self.part, self.fn, self.stage, self.function_name = part, fn, stage, function_name
        self.check = check

    def with_fn(self, fn: Callable[[Any], Any]) -> Deserializer:
        """This step running ``fn`` (its function, isolated) instead."""
        return Deserializer(self.part, fn, self.stage, self.function_name, self.check)


class DeserializeAdapter:
    """Units are rows of a Kafka-source Arrow batch: payload (batch, row index, row dict)."""

    def __init__(self, steps: Sequence[Deserializer], *, ids: IdFactory,
                 to_row: Callable[[Any, int], Any] | None = None) -> None:
        self.steps = list(steps)
        self.ids = ids
        self.to_row = to_row  # (batch, i) -> pyspark Row, for whole-record deserializers

    def run(self, unit: Unit) -> Sequence[Any]:
        batch, i, fields = unit.payload
        parsed = []
        for step in self.steps:
            arg = (fields.get(step.part) if step.part in ("key", "value")
                   else self.to_row(batch, i))
            try:
                out = step.fn(arg)
                if step.check is not None:   # a result Arrow cannot take is this record's
                    step.check(out)
            except Exception as exc:  # noqa: BLE001 - user code
                raise StageFailure(step.stage, step.function_name, exc) from exc
            parsed.append(out)
        return ((batch, i, tuple(parsed)),)

    def split(self, unit: Unit) -> list[Unit] | None:
        return None

    def context(self, unit: Unit) -> RecordContext:
        batch, i, _ = unit.payload
        return context_of(batch.slice(i, 1).to_pylist()[0], lambda: self.ids(unit.offset))


# --- results that can leave a helper process (`_guard`) ------------------------------------------


def listed(fn: Callable[..., Any]) -> Callable[..., list]:
    """``fn`` returning its iterable of outputs as a list (a flat map's outputs)."""
    return functools.partial(_listed, fn)


def _listed(fn: Callable[..., Any], *args: Any) -> list:
    return list(fn(*args))


def batch_outputs(fn: Callable[[Any], Any], kind: str) -> Callable[[Any], list]:
    """``fn(batch)`` returning its output batches (or frames) as a list."""
    return functools.partial(_batch_outputs, fn, kind)


def _batch_outputs(fn: Callable[[Any], Any], kind: str, batch: Any) -> list:
    out = fn(batch)
    return _arrow_outputs(out) if kind == "arrow" else _pandas_outputs(out)


def unvalued(fn: Callable[..., Any]) -> Callable[..., None]:
    """``fn`` whose result is dropped (a sink's write: only its effect counts)."""
    return functools.partial(_unvalued, fn)


def _unvalued(fn: Callable[..., Any], *args: Any) -> None:
    fn(*args)
