"""Target 10 (native deserialization, issue 14): `job.deserialize` with a format name (Spark
parses in the JVM, only corrupt rows go through Python) against peer (b), Spark's own
`from_json` in PERMISSIVE mode with hand-rolled dead-lettering of the corrupt rows, and against
spillway's Python deserializer."""

from __future__ import annotations

import functools
import uuid

from .. import peers, workloads
from ..infra import BenchError
from ..model import STATUS_NOT_RUN, Figure, TargetResult, fmt, ratio_check
from ..runner import Context
from ..stats import ratio
from .common import alternate_runs, dlq_props
from .dlq import BATCH_BYTES, LINGER_MS, expect_topic_records
from .sparkutil import ship_workloads, timed

PARTITIONS = 4
VALUE_DDL = "order_id long, amount double, note string"
KAFKA_COLUMNS = ["key", "value", "topic", "partition", "offset"]


def _job(sidecar_address: str, topic: str):
    from spillway.spark import Job

    job = Job(f"bench-deser-{uuid.uuid4().hex[:8]}", dlq_props(topic), sidecar=sidecar_address)
    job.register()
    return job


def native_missing(job, df) -> str | None:
    """Why the native fast path cannot run (``value="json"`` refused), or None. Building the
    plan is lazy: nothing runs."""
    try:
        job.deserialize(df, value="json", value_type=VALUE_DDL)
    except (TypeError, ValueError, NotImplementedError, AttributeError) as exc:
        return ("spillway.spark:Job.deserialize(value=\"json\") does not exist yet (the native "
                f"fast path is not on this branch): {type(exc).__name__}: {exc}")
    return None


def peer_b(ctx: Context, rows: int, every: int, n_corrupt: int) -> float:
    """Peer (b): from_json PERMISSIVE; corrupt rows dead-lettered by (a)'s producer code
    (`foreachPartition`), the others to the noop sink. Both actions are timed."""
    from pyspark.sql.functions import col

    spark = ctx.infra.spark
    topic = ctx.infra.fresh_topic("peer-b")
    conf = peers.producer_conf(ctx.infra.bootstrap, linger_ms=LINGER_MS, batch_size=BATCH_BYTES)
    parsed = peers.from_json_permissive(workloads.kafka_frame(spark, rows, PARTITIONS, every),
                                        VALUE_DDL)
    corrupt = col(f"parsed_value.{peers.CORRUPT_COLUMN}")
    bad = parsed.filter(corrupt.isNotNull()).select(*KAFKA_COLUMNS)
    good = parsed.filter(corrupt.isNull())
    send = functools.partial(peers.corrupt_rows, conf, topic)

    def action() -> None:
        bad.foreachPartition(send)
        workloads.noop_write(good)

    seconds = timed(action)
    expect_topic_records(ctx, topic, n_corrupt, "peer (b)")
    return seconds


def spillway_deser(ctx: Context, sidecar_address: str, rows: int, every: int, n_corrupt: int,
                   value) -> float:
    """`job.deserialize(df, value=..., value_type=VALUE_DDL)` to the noop sink; corrupt rows
    dead-lettered per the job's policy and acknowledged before the action returns."""
    job = _job(sidecar_address, ctx.infra.fresh_topic("deser"))
    df = workloads.kafka_frame(ctx.infra.spark, rows, PARTITIONS, every)
    out = job.deserialize(df, value=value, value_type=VALUE_DDL)
    seconds = timed(lambda: workloads.noop_write(out))
    written = job.summary().dlq_records_written
    if written < n_corrupt:
        raise BenchError(f"deserialize: {written} of {n_corrupt} corrupt rows acknowledged in "
                         "the DLQ when the action returned")
    return seconds


def _ratio_note(what: str, a: Figure, b: Figure) -> str:
    if not a.values or not b.values:
        return f"{what}: not measured."
    return (f"{what}: {fmt(ratio(a.summary.median, b.summary.median))}× (median {a.name} "
            f"{fmt(a.summary.median)} s / median {b.name} {fmt(b.summary.median)} s).")


def run_native_deser(ctx: Context, result: TargetResult) -> None:
    rows = ctx.sizes.deser_rows
    result.setup = (
        f"{rows:,} Kafka-shaped rows built in the JVM with Spark's Kafka source schema (key, "
        "value binary, topic, partition, offset, timestamp, timestampType, headers; the Kafka "
        f"connector jar is not available), {PARTITIONS} partitions, local[2]; values are "
        f"200-byte JSON orders (`{VALUE_DDL}`), none or 1% of them truncated JSON. Every variant "
        "ends in the same sink (a `noop` write of the parsed rows) and is timed over its whole "
        "effect, corrupt rows acknowledged in a fresh DLQ topic included. Peer (b): "
        "`from_json(col('value').cast('string'), schema + '_corrupt_record string', "
        "{mode: PERMISSIVE, columnNameOfCorruptRecord: _corrupt_record})` as `parsed_value`; "
        "the rows with `parsed_value._corrupt_record` set (key, value, topic, partition, offset) "
        "go to `foreachPartition` with peer (a)'s producer code (one confluent-kafka `Producer` "
        f"per task, idempotent, acks=all, linger.ms={LINGER_MS}, original key and value with "
        "error and source-coordinate headers, flush at the end, the task failing on any "
        "unacknowledged record), then the others are written to the sink: two actions, no cache, "
        "wall time of both; the DLQ topic's record count is checked afterwards. Written the "
        "plain way, (b) parses each row three times: once in the corrupt rows' filter, and in "
        "the good rows' action Spark's optimizer evaluates `from_json` in the filter and again "
        "in the projection. Native: "
        f"`job.deserialize(df, value=\"json\", value_type=\"{VALUE_DDL}\")` (Spark parses in the "
        "JVM, the input read twice: JVM-only good rows unioned with a `mapInArrow` branch that "
        "gets only the corrupt rows; these go through spillway's failure path: reported to the "
        "sidecar, its own process with spool on, dead-lettered per `errors.tolerance=all` and "
        "acknowledged before the action returns). Python deserializer: "
        "`job.deserialize(df, value=order_json, value_type=...)` with `order_json = "
        "json.loads(bytes)`. Variants alternated run by run after one warm-up round.")
    ship_workloads()
    sidecar = ctx.infra.sidecar(name="deser")
    probe_job = _job(sidecar.address, ctx.infra.fresh_topic("deser-probe"))
    why = native_missing(probe_job, workloads.kafka_frame(ctx.infra.spark, 10, 1, 0))
    if why is not None:
        result.status, result.reason = STATUS_NOT_RUN, why
        ctx.log(f"[10] {result.key}: not run: {why}")
        return

    f_peer = result.figure("no corrupt rows: peer (b) from_json PERMISSIVE", "s")
    f_native = result.figure("no corrupt rows: spillway native (value=\"json\")", "s")
    f_py = result.figure("no corrupt rows: spillway Python deserializer", "s")
    alternate_runs(ctx, result, {
        f_peer.name: lambda _r: peer_b(ctx, rows, 0, 0),
        f_native.name: lambda _r: spillway_deser(ctx, sidecar.address, rows, 0, 0, "json"),
        f_py.name: lambda _r: spillway_deser(ctx, sidecar.address, rows, 0, 0,
                                             workloads.order_json),
    }, {f.name: f for f in (f_peer, f_native, f_py)}, warmup=True)
    result.checks.append(ratio_check("native vs peer (b), no corrupt rows (wall time)",
                                     f_native, f_peer, "<=", 1.05))

    every = workloads.poison_every(1.0)
    n_corrupt = len(range(0, rows, every))
    g_peer = result.figure("1% corrupt: peer (b) from_json PERMISSIVE", "s")
    g_native = result.figure("1% corrupt: spillway native (value=\"json\")", "s")
    alternate_runs(ctx, result, {
        g_peer.name: lambda _r: peer_b(ctx, rows, every, n_corrupt),
        g_native.name: lambda _r: spillway_deser(ctx, sidecar.address, rows, every, n_corrupt,
                                                 "json"),
    }, {g_peer.name: g_peer, g_native.name: g_native}, warmup=True)
    result.notes += [
        _ratio_note("Native vs peer (b) with 1% corrupt rows (figure, not a target)",
                    g_native, g_peer),
        _ratio_note("Python deserializer vs peer (b), no corrupt rows (figure, not a target)",
                    f_py, f_peer),
        _ratio_note("Python deserializer vs native, no corrupt rows", f_py, f_native),
    ]
