"""Native deserialization: `Job.deserialize(df, value="json" | "csv" | "avro")` parses with Spark's
own functions (``from_json``, ``from_csv``, ``from_avro``) in PERMISSIVE mode, in the JVM, and
sends only the rows Spark could not parse through spillway's failure path.

The plan is a union of two branches over the same input:

    base = df + parsed columns + spark_partition_id()   (nondeterministic: Spark cannot push the
                                                          filters below the parse, so each branch
                                                          parses every row once, not twice)
    good = base.filter(no step corrupt)  -> source columns + parsed columns   (JVM only)
    bad  = base.filter(a step corrupt)   -> mapInArrow(report): the corrupt rows, with their raw
                                            key/value, coordinates and headers, reported as
                                            failures of KEY_CONVERTER / VALUE_CONVERTER; it
                                            emits no rows
    out  = good.unionByName(bad)

So the input is read and parsed twice (once per branch); the good rows never reach Python. The
reporting branch gets a Python worker per partition (Spark starts one for every partition of a
Python node), which returns at once when its partition has no corrupt row: no session, no gRPC.

A row is corrupt for a step when its input is not null and Spark's parse is null, or (JSON and
CSV into a struct) when Spark filled the corrupt-record field spillway adds to the schema. A
null key or value is not corrupt: its parsed column is null.

With a ratio limit (``errors.tolerance.max.ratio``) the sidecar needs every partition's processed
count, so the reporting branch then gets every row as well, its columns nulled unless the row is
corrupt (a cheap Arrow batch per 10,000 rows), and counts them: correct ratios, at the price of a
Python pass over the row count.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from spillway.client.markers import DataError

from ._compat import UnsupportedOnThisSparkError, pyspark_version
from ._engine import StageFailure, StageRef, Unit
from ._records import KAFKA_SOURCE_COLUMNS, RecordContext, context_of

#: The native formats and the Spark function each one parses with.
FORMATS = {"json": "from_json", "csv": "from_csv", "avro": "from_avro"}
#: The field spillway adds to a JSON / CSV struct schema for Spark's corrupt-record text.
CORRUPT_FIELD = "__spillway_corrupt"
_PARSED = "__spillway_parsed_{}"
_BAD = "__spillway_bad_{}"
_FORBIDDEN_OPTIONS = {"mode": "mode", "columnnameofcorruptrecord": "columnNameOfCorruptRecord"}


class CorruptRecordError(DataError, ValueError):
    """Spark's native parse (from_json / from_csv / from_avro in PERMISSIVE mode) marked the
    record corrupt: a data error (never retried; tolerance decides)."""


@dataclass(frozen=True)
class NativeStep:
    """One natively parsed part (``key`` or ``value``) of the Kafka record."""

    part: str
    fmt: str
    stage: StageRef
    column: str
    type_text: str            # what the message names: the Spark type or the Avro schema
    options: tuple[tuple[str, str], ...] = ()

    @property
    def function_name(self) -> str:
        return f"spark:{FORMATS[self.fmt]}"


def options_of(part: str, options: Mapping[str, Any] | None) -> tuple[tuple[str, str], ...]:
    """The user's reader options as strings; spillway's own (mode, corrupt-record column) are
    refused with the reason."""
    if options is None:
        return ()
    if not isinstance(options, Mapping):
        raise TypeError(f"{part}_options: expected a dict of Spark reader options, got "
                        f"{type(options).__name__}")
    out = []
    for k, v in options.items():
        if not isinstance(k, str):
            raise TypeError(f"{part}_options: option names are strings, got {k!r}")
        name = _FORBIDDEN_OPTIONS.get(k.strip().lower())
        if name == "mode" and str(v).strip().upper() != "PERMISSIVE":
            raise ValueError(
                f"{part}_options: mode={v!r} is not supported: spillway parses in PERMISSIVE "
                f"mode and routes the corrupt records through the job's error policy (FAILFAST "
                f"is errors.tolerance=none; DROPMALFORMED is errors.tolerance=all)")
        if name == "columnNameOfCorruptRecord":
            raise ValueError(
                f"{part}_options: columnNameOfCorruptRecord is spillway's: it adds its own "
                f"corrupt-record field ({CORRUPT_FIELD}) and dead-letters the corrupt records "
                f"with their original bytes; remove the option")
        out.append((k, str(v).lower() if isinstance(v, bool) else str(v)))
    return tuple(out)


def _avro_missing(exc: BaseException) -> bool:
    text = f"{type(exc).__name__}: {exc}"
    return ("AVRO_NOT_LOADED" in text or "JavaPackage" in text
            or ("avro" in text.lower() and ("ClassNotFound" in text or "NoClassDefFound" in text)))


def _avro_package_error(spark: Any, exc: BaseException) -> UnsupportedOnThisSparkError:
    version = getattr(spark, "version", None) or pyspark_version()
    scala = "2.12" if version.startswith("3.") else "2.13"
    try:
        scala = ".".join(spark.sparkContext._jvm.scala.util.Properties.versionNumberString()
                         .split(".")[:2])
    except Exception:  # noqa: BLE001 - Spark Connect has no JVM here: keep the default
        pass
    return UnsupportedOnThisSparkError(
        f"deserialize: 'avro' parses with Spark's from_avro, which needs the spark-avro "
        f"package on the classpath; it is not in the pyspark distribution. Start the session "
        f"with spark.jars.packages=org.apache.spark:spark-avro_{scala}:{version} (or "
        f"--packages, or its jar in spark.jars) (Spark said: {str(exc).splitlines()[0]})")


def _parse_expr(step: NativeStep, dtype: Any, spark: Any):
    """(parsed Column with the corrupt field, whether it has one)."""
    from pyspark.sql import functions as F
    from pyspark.sql.types import ArrayType, MapType, StringType, StructField, StructType

    options = {"mode": "PERMISSIVE", **dict(step.options)}
    source = F.col(step.part)
    if step.fmt == "avro":
        from pyspark.sql.avro.functions import from_avro

        try:
            return from_avro(source, step.type_text, options), False
        except Exception as exc:  # noqa: BLE001 - 3.5 raises here when the package is missing
            if _avro_missing(exc):
                raise _avro_package_error(spark, exc) from exc
            raise
    text = source.cast("string")
    if isinstance(dtype, StructType):
        schema = StructType(list(dtype.fields) + [StructField(CORRUPT_FIELD, StringType(), True)])
        options["columnNameOfCorruptRecord"] = CORRUPT_FIELD
        if step.fmt == "csv":  # from_csv takes its schema as a DDL string
            ddl = ", ".join(f"`{f.name.replace('`', '``')}` {f.dataType.simpleString()}"
                            for f in schema.fields)
            return F.from_csv(text, ddl, options), True
        return F.from_json(text, schema, options), True
    if step.fmt == "json" and isinstance(dtype, (ArrayType, MapType)):
        return F.from_json(text, dtype, options), False
    allowed = "a struct, array or map type" if step.fmt == "json" else "a struct type"
    raise ValueError(f"{step.part}_type: {FORMATS[step.fmt]} parses into {allowed}, got "
                     f"{dtype.simpleString()}")


def native_deserialize(df: Any, steps: Sequence[NativeStep], dtypes: Sequence[Any],
                       report_fn: Any, counting: bool) -> Any:
    """``df`` with each step's parsed column (its corrupt rows reported by ``report_fn``, a
    mapInArrow function over the source columns and the per-step corrupt flags)."""
    from pyspark.sql import functions as F

    spark = df.sparkSession
    cols = list(df.columns)
    # spark_partition_id() is nondeterministic: the optimizer can then neither push the filters
    # below the parse nor inline the parse into them, so each branch parses each row once
    barrier = F.spark_partition_id() >= 0
    parsed, flags, outs = [], [], []
    for i, (step, dtype) in enumerate(zip(steps, dtypes)):
        expr, has_corrupt_field = _parse_expr(step, dtype, spark)
        name = _PARSED.format(i)
        parsed.append(F.when(barrier, expr).alias(name))
        p = F.col(name)
        bad = p.isNull() | p[CORRUPT_FIELD].isNotNull() if has_corrupt_field else p.isNull()
        flags.append(F.col(step.part).isNotNull() & bad)
        outs.append((p.dropFields(CORRUPT_FIELD) if has_corrupt_field else p).alias(step.column))
    try:
        base = df.select(*[F.col(c) for c in cols], *parsed)
    except Exception as exc:  # noqa: BLE001 - 4.x refuses from_avro at analysis
        if any(s.fmt == "avro" for s in steps) and _avro_missing(exc):
            raise _avro_package_error(spark, exc) from exc
        raise
    any_bad = functools.reduce(lambda a, b: a | b, flags)
    good = base.filter(~any_bad).select(*[F.col(c) for c in cols], *outs)
    kafka = [c for c in KAFKA_SOURCE_COLUMNS if c in cols]
    flag_cols = [f.alias(_BAD.format(s.part)) for f, s in zip(flags, steps)]
    if counting:  # every row, its columns nulled unless corrupt: the count is exact
        bad = base.select(*[F.when(any_bad, F.col(c)).alias(c) for c in kafka], *flag_cols)
    else:
        bad = base.filter(any_bad).select(*[F.col(c) for c in kafka], *flag_cols)
    return good.unionByName(bad.mapInArrow(report_fn, good.schema))


# --- executor side ----------------------------------------------------------------------------


def corrupt_message(step: NativeStep, raw: bytes | None) -> str:
    """What Spark could not parse, with a hint where one is cheap to give."""
    what = f"Spark's {FORMATS[step.fmt]} (PERMISSIVE) could not parse the record's {step.part}"
    target = (f"with the Avro schema {_clip(step.type_text)}" if step.fmt == "avro"
              else f"as {step.type_text}")
    hint = ""
    if raw is not None and not raw:
        hint = ": it is empty"
    elif step.fmt == "json" and raw is not None:
        import json

        try:
            json.loads(raw)
        except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError
            hint = f": {exc}"
        else:
            hint = ": well-formed JSON that does not fit the declared type"
    return f"{what} {target}; Spark marked it corrupt{hint}"


def _clip(text: str, n: int = 200) -> str:
    text = " ".join(text.split())
    return text if len(text) <= n else text[:n] + "..."


class NativeAdapter:
    """Units are corrupt rows: payload (row dict, step). Running one always fails with a
    `CorruptRecordError` of its step (Spark's parse is deterministic: a retry fails again)."""

    def __init__(self, ids: Any) -> None:
        self.ids = ids

    def run(self, unit: Unit) -> Sequence[Any]:
        row, step = unit.payload
        raise StageFailure(step.stage, step.function_name,
                           CorruptRecordError(corrupt_message(step, row.get(step.part))))

    def split(self, unit: Unit) -> list[Unit] | None:
        return None

    def context(self, unit: Unit) -> RecordContext:
        return context_of(unit.payload[0], lambda: self.ids(unit.offset))


def report_partition(plan: Any, steps: Sequence[NativeStep], batches: Iterator[Any]
                     ) -> Iterator[Any]:
    """The reporting branch's mapInArrow function: reports the corrupt rows, emits nothing. A
    partition without rows (the no-failure case, unless counting) returns at once."""
    import itertools

    from ._partitions import drive, make_engine, record_ids
    from ._runtime import TaskSession

    it = iter(batches)
    first = next((b for b in it if b.num_rows), None)
    if first is None:
        return
    session = TaskSession(plan.spec, plan.wrapper)
    stages = [s.stage for s in steps]
    engine = make_engine(plan, session,
                         NativeAdapter(record_ids(plan.spec, plan.wrapper, session.task)),
                         count_stages=stages)
    units = corrupt_units(itertools.chain([first], it), steps,
                          lambda n: session.processed(stages, n))
    for _ in drive(session, engine, engine.run(units)):
        pass
    yield from ()


def corrupt_units(batches: Iterator[Any], steps: Sequence[NativeStep], good: Any
                  ) -> Iterator[Unit]:
    """The corrupt rows of ``batches`` as units (the first corrupt step of each row);
    ``good(n)`` counts the rows of each batch that were not corrupt (counting mode)."""
    import pyarrow.compute as pc

    offset = 0
    flags = [_BAD.format(s.part) for s in steps]
    for b in batches:
        n = b.num_rows
        if not n:
            continue
        mask = b.column(flags[0])
        for f in flags[1:]:
            mask = pc.or_(mask, b.column(f))
        bad = b.filter(mask)
        if n - bad.num_rows:
            good(n - bad.num_rows)
        if bad.num_rows:
            rows = bad.to_pylist()
            for i, row in enumerate(rows):
                step = next(s for s, f in zip(steps, flags) if row.get(f))
                yield Unit(({k: v for k, v in row.items() if k not in flags}, step), 1,
                           offset + i)
        offset += bad.num_rows
