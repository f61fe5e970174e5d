"""Target 3 (happy-path overhead of the wrappers) and target 4 (error-path cost)."""

from __future__ import annotations

import functools
import os
import statistics
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from unittest import mock

from spillway.client import extensions

from .. import cpu, peers, workloads
from ..infra import BenchError
from ..model import TargetResult, absolute_check, fmt, ratio_check
from ..profiling import Recording, section
from ..runner import Context, missing_prerequisite
from .common import POLICY_ONLY, alternate_runs, dlq_props, profiled
from .failure_key import run_failure_key
from .sparkutil import python_daemons, ship_workloads, timed_workers

PARTITIONS = 8
# issue 47: at this failure rate the executor side (workers above catch-and-drop) may cost at
# most this much more per failed record than peer (a)'s
EXECUTOR_PCT = 10.0
EXECUTOR_ABOVE_PEER_US = 5.0


@dataclass(frozen=True)
class Wrapper:
    """One wrapper kind: how to run the same work bare and wrapped (each returns seconds)."""

    name: str
    threshold: float
    requires: str
    bare: Callable[[object, int], None]
    wrapped: Callable[[object, object, int], None]
    # the wrapper's C extension (spillway.client.extensions), run side by side with its Python
    # fallback: it stays only where this shows what it saves
    extension: str | None = None


def _pandas_bare(spark, rows):
    df = workloads.orders_frame(spark, rows, PARTITIONS)
    workloads.noop_write(df.mapInPandas(workloads.bare_pandas, workloads.VECTOR_SCHEMA))


def _pandas_wrapped(spark, job, rows):
    df = workloads.orders_frame(spark, rows, PARTITIONS)
    workloads.noop_write(job.map_in_pandas(df, workloads.pandas_total, workloads.VECTOR_SCHEMA))


def _arrow_bare(spark, rows):
    df = workloads.orders_frame(spark, rows, PARTITIONS)
    workloads.noop_write(df.mapInArrow(workloads.bare_arrow, workloads.VECTOR_SCHEMA))


def _arrow_wrapped(spark, job, rows):
    df = workloads.orders_frame(spark, rows, PARTITIONS)
    workloads.noop_write(job.map_in_arrow(df, workloads.arrow_total, workloads.VECTOR_SCHEMA))


def _rows_bare(spark, rows):
    rdd = workloads.order_values(spark.sparkContext, rows, PARTITIONS, 0)
    rdd.mapPartitions(workloads.bare_rows).count()


def _rows_wrapped(spark, job, rows):
    rdd = workloads.order_values(spark.sparkContext, rows, PARTITIONS, 0)
    job.map_partitions(rdd, workloads.parse_order).count()


def _udf_bare(spark, rows):
    from pyspark.sql.functions import udf

    df = workloads.orders_frame(spark, rows, PARTITIONS)
    workloads.noop_write(df.select(udf(workloads.amount_of, "double")("value").alias("a")))


def _udf_wrapped(spark, job, rows):
    df = workloads.orders_frame(spark, rows, PARTITIONS)
    amount = job.udf("double")(workloads.amount_of)
    workloads.noop_write(df.select(amount("value").alias("a")))


WRAPPERS = (
    Wrapper("mapInPandas", 1.03, "spillway.spark:Job.map_in_pandas", _pandas_bare,
            _pandas_wrapped),
    Wrapper("mapInArrow", 1.03, "spillway.spark:Job.map_in_arrow", _arrow_bare,
            _arrow_wrapped),
    Wrapper("mapPartitions (per row)", 1.05, "spillway.spark:Job.map_partitions", _rows_bare,
            _rows_wrapped),
    Wrapper("UDF decorator", 1.05, "spillway.spark:Job.udf", _udf_bare, _udf_wrapped,
            extension="udfcall"),
)
# the C per-row function's CPU per row at most this share of the Python one's
EXTENSION_CPU_RATIO = 0.99


def _job(ctx: Context, address: str, props: dict[str, str]):
    from spillway.spark import Job

    job = Job(f"bench-{uuid.uuid4().hex[:8]}", props, sidecar=address)
    job.register()
    return job


def _profile_workers(ctx: Context, result: TargetResult, title: str, run: Callable[[], object],
                     extra_pids: list[int] | None = None, label: str = "workers") -> None:
    rec = Recording(python_daemons(), ctx.profile_dir or ctx.infra.workdir, label,
                    subprocesses=True)
    try:
        if extra_pids:
            profiled(ctx, result, "sidecar process during " + title, extra_pids, run,
                     label=f"{label}-sidecar")
        else:
            run()
    finally:
        stacks = rec.stop()
    if stacks:
        result.profiles.append(section(f"Spark Python workers, {title}", stacks))
    elif rec.errors:
        result.notes.append(f"profile of {title} failed: {'; '.join(rec.errors)}")


def _timed_cpu(action: Callable[[], object], figure, rows: int) -> tuple[float, dict]:
    """The action's wall time, and the Spark Python workers' CPU per row as `figure`."""
    seconds, worker_s = timed_workers(action)
    return seconds, {figure: worker_s * 1e9 / rows}


def _happy_cpu_reading(name: str, bare, wrapped) -> str:
    b, w = bare.median, wrapped.median
    if not b or not w:
        return f"{name}: the workers' CPU was not measured."
    return (f"{name}, Spark Python workers' CPU per row (medians, a figure, not the target): "
            f"bare {fmt(b)} ns, wrapped {fmt(w)} ns ({w - b:+,.0f} ns, {w / b:.3f}x).")


def _extension_reading(w: Wrapper, bare, native, python) -> str:
    b, n, p = bare.median, native.median, python.median
    if not (b and n and p):
        return f"{w.name}: the C extension's saving was not measured."
    return (f"{w.name}, what its C extension (`{w.extension}`) saves, Spark Python workers' "
            f"CPU per row (medians, same run, alternated): {fmt(n)} ns with it, {fmt(p)} ns "
            f"with the Python fallback ({p - n:+,.0f} ns a row saved, {n / p:.3f}x); the "
            f"wrapper's overhead above bare {fmt(n - b)} ns against {fmt(p - b)} ns.")


def run_happy(ctx: Context, result: TargetResult) -> None:
    rows = ctx.sizes.happy_rows
    result.setup = (
        f"No record fails. Each wrapper against the same work in bare PySpark, {rows:,} rows in "
        f"{PARTITIONS} partitions on local[2], wall time of the action (a `noop` write, or "
        "`count()` for the RDD), runs alternated bare/wrapped after one warm-up round. "
        "Vectorized: `pandas_total` / `arrow_total` (one output row per input row) on "
        "(id, amount, 200-byte JSON value); bare is `df.mapInPandas` / `df.mapInArrow` over the "
        "same function. Per row: `parse_order` (json.loads of a ~150-byte order, two fields "
        "out) over an RDD of values; bare is `rdd.mapPartitions` calling it in a loop. UDF: "
        "`amount_of` (json.loads, one field) as `pyspark.sql.functions.udf` vs `@job.udf`, "
        "and `@job.udf` made with `SPILLWAY_NO_EXTENSIONS=udfcall` (its per-row function in "
        "Python instead of C: what the extension saves, side by side). The "
        "job (`errors.tolerance=all`) is registered with a sidecar process before the clock "
        "starts.")
    ship_workloads()
    sidecar = ctx.infra.sidecar(name="happy")
    spark = ctx.infra.spark
    for w in WRAPPERS:
        why = missing_prerequisite([w.requires])
        if why is not None:
            result.notes.append(f"{w.name}: not run: {why}")
            continue
        job = _job(ctx, sidecar.address, POLICY_ONLY)
        f_bare = result.figure(f"{w.name}: bare PySpark", "s")
        f_wrapped = result.figure(f"{w.name}: spillway wrapper", "s")
        # the workers' CPU beside the wall time, which this machine's noise moves more than
        # the wrappers do
        c_bare = result.figure(f"{w.name}: bare, Spark workers' CPU per row", "ns")
        c_wrapped = result.figure(f"{w.name}: wrapper, Spark workers' CPU per row", "ns")
        variants = {
            f_bare.name: lambda _r, w=w: _timed_cpu(lambda: w.bare(spark, rows), c_bare, rows),
            f_wrapped.name: lambda _r, w=w, job=job: _timed_cpu(
                lambda: w.wrapped(spark, job, rows), c_wrapped, rows),
        }
        walls = {f_bare.name: f_bare, f_wrapped.name: f_wrapped}
        if w.extension:
            f_py = result.figure(f"{w.name}: wrapper without its C extension", "s")
            c_py = result.figure(f"{w.name}: wrapper without its C extension, Spark workers' "
                                 "CPU per row", "ns")

            def python(_r, w=w, job=job, c_py=c_py):
                # the driver makes the per-row function without the extension (the Python
                # fallback, pickled to the workers as it is)
                with mock.patch.dict(os.environ, {extensions.ENV: w.extension}):
                    return _timed_cpu(lambda: w.wrapped(spark, job, rows), c_py, rows)

            variants[f_py.name] = python
            walls[f_py.name] = f_py
        alternate_runs(ctx, result, variants, walls, warmup=True)
        check = ratio_check(f"{w.name} wrapped vs bare (wall time)", f_wrapped, f_bare, "<=",
                            w.threshold)
        result.checks.append(check)
        result.notes.append(_happy_cpu_reading(w.name, c_bare, c_wrapped))
        if w.extension:
            result.checks.append(ratio_check(
                f"{w.name}: workers' CPU per row with its C extension vs without", c_wrapped,
                c_py, "<=", EXTENSION_CPU_RATIO))
            result.notes.append(_extension_reading(w, c_bare, c_wrapped, c_py))
        if ctx.sizes.profile and check.met is False:
            _profile_workers(ctx, result, f"{w.name} wrapped, {rows:,} rows",
                             lambda w=w, job=job: w.wrapped(spark, job, rows),
                             label=f"happy-{w.name.split()[0]}")


def run_error_path(ctx: Context, result: TargetResult) -> None:
    from .dlq import BATCH_BYTES, LINGER_MS, expect_topic_records

    rows = ctx.sizes.error_rows
    result.setup = (
        f"`parse_order` over an RDD of {rows:,} JSON values ({PARTITIONS} partitions, local[2]) "
        "in which 1% or 10% are truncated JSON. Baseline: bare `rdd.mapPartitions` that catches "
        "and drops failed rows locally. Peer (a), hand-rolled dead-lettering: bare "
        "`rdd.mapPartitions` that catches each failure and produces the failed value to a "
        "fresh DLQ topic itself with confluent-kafka: one `Producer` per task (built at its "
        f"first failure; idempotent, acks=all, linger.ms={LINGER_MS}, batch.size="
        f"{BATCH_BYTES}), headers error class, message, partition and position, `poll(0)` "
        "after each produce, flush at the end of the partition, the task failing if any record "
        "is not acknowledged; no sidecar, spool or policy (the DLQ topic's record count is "
        "checked after the clock stops). Candidate: `job.map_partitions` with "
        "`errors.tolerance=all` and a DLQ topic (fresh per run): every failed row is reported "
        "(up to 1,024 per report, the default), decided by the sidecar (its own process, spool "
        "on), dead-lettered "
        "and acknowledged before the task ends (flush barrier). Wall time of `count()`, the "
        "three alternated run by run. CPU per failed record over the same action: Spark's "
        "Python workers (every PySpark daemon and the workers it forked, live or exited, from "
        "their /proc counters; the executor side is the difference from catch-and-drop) and, "
        "for spillway, the sidecar process. Then, in the harness's process, what the executors' "
        "frame signature extension saves (`failure_key.py`).")
    ship_workloads()
    sidecar = ctx.infra.sidecar(name="errors")
    spark = ctx.infra.spark
    conf = peers.producer_conf(ctx.infra.bootstrap, linger_ms=LINGER_MS, batch_size=BATCH_BYTES)
    # (failure rate, vs catch-and-drop, vs peer (a)): the peer ratios are issue 24's targets
    # (1% <= 1.05x, 10% <= 1.3x of (a)), which replaced the 1.2x both once had
    for pct, threshold, peer_threshold in ((1.0, 1.10, 1.05), (10.0, 1.30, 1.30)):
        every = workloads.poison_every(pct)
        n_fail = len(range(0, rows, every))
        f_bare = result.figure(f"{pct:g}% failing: catch and drop locally", "s")
        f_peer = result.figure(f"{pct:g}% failing: peer (a), hand-rolled dead-lettering", "s")
        f_cand = result.figure(f"{pct:g}% failing: spillway, dead-lettered", "s")

        w_bare, w_peer, w_cand = (result.figure(
            f"{pct:g}% failing: {who}: Spark Python workers' CPU per failed record", "µs")
            for who in ("catch and drop", "peer (a)", "spillway"))
        f_side = result.figure(f"{pct:g}% failing: spillway: sidecar CPU per failed record",
                               "µs")

        def measured(action, workers, n_fail=n_fail, side=None):
            """(wall seconds of the action, {CPU figures per failed record})."""
            side0 = cpu.cpu_seconds(sidecar.pid) if side is not None else 0.0
            seconds, worker_s = timed_workers(action)
            extras = {workers: cpu.us_per_record(worker_s, n_fail)}
            if side is not None:
                extras[side] = cpu.us_per_record(cpu.cpu_seconds(sidecar.pid) - side0, n_fail)
            return seconds, extras

        def bare(_r, every=every):
            rdd = workloads.order_values(spark.sparkContext, rows, PARTITIONS, every)
            return measured(lambda: rdd.mapPartitions(workloads.bare_rows_dropping).count(),
                            w_bare)

        def handrolled(_r, every=every, n_fail=n_fail):
            topic = ctx.infra.fresh_topic("peer-a")
            rdd = workloads.order_values(spark.sparkContext, rows, PARTITIONS, every)
            run = functools.partial(peers.values_partition, conf, topic, workloads.parse_order)
            out = measured(lambda: rdd.mapPartitions(run).count(), w_peer)
            expect_topic_records(ctx, topic, n_fail, "hand-rolled dead-lettering", result)
            return out

        def wrapped(_r, every=every, n_fail=n_fail):
            job = _job(ctx, sidecar.address, dlq_props(ctx.infra.fresh_topic("errors")))
            rdd = workloads.order_values(spark.sparkContext, rows, PARTITIONS, every)
            out = measured(lambda: job.map_partitions(rdd, workloads.parse_order).count(),
                           w_cand, side=f_side)
            written = job.summary().dlq_records_written
            if written < n_fail:
                raise BenchError(f"{written} of {n_fail} failed rows acknowledged in the DLQ")
            return out

        alternate_runs(ctx, result, {f_bare.name: bare, f_peer.name: handrolled,
                                     f_cand.name: wrapped},
                       {f_bare.name: f_bare, f_peer.name: f_peer, f_cand.name: f_cand},
                       warmup=True)
        check = ratio_check(f"{pct:g}% failing rows vs catch-and-drop (wall time)", f_cand,
                            f_bare, "<=", threshold)
        peer_check = ratio_check(f"{pct:g}% failing rows vs hand-rolled (a) (wall time)", f_cand,
                                 f_peer, "<=", peer_threshold)
        result.checks += [check, peer_check]
        if pct == EXECUTOR_PCT:
            result.checks.append(_executor_check(pct, w_bare, w_peer, w_cand))
        result.notes.append(_executor_reading(pct, w_bare, w_peer, w_cand, f_side))
        if ctx.sizes.profile and (check.met is False or peer_check.met is False):
            _profile_workers(ctx, result, f"{pct:g}% failing rows, {rows:,} rows",
                             lambda w=wrapped: w(0), extra_pids=[sidecar.pid],
                             label=f"errors-{pct:g}")
    run_failure_key(ctx, result)


def _above(f, bare) -> float:
    """A variant's workers' CPU per failed record above catch-and-drop's: the median of the
    rounds' own differences (the variants alternate, so a round's runs share the machine's
    moment)."""
    diffs = [x - y for x, y in zip(f.values, bare.values)]
    return statistics.median(diffs) if diffs else 0.0


def _executor_check(pct, bare, peer, cand):
    """Issue 47's executor target: spillway's executor side at most (a)'s + 5 µs per failed
    record, each above catch-and-drop."""
    c, p = _above(cand, bare), _above(peer, bare)
    value = c - p if cand.values and peer.values else None
    return absolute_check(
        f"{pct:g}% failing: executor side above (a)'s, per failed record", value, "<=",
        EXECUTOR_ABOVE_PEER_US, "µs",
        f"Spark Python workers' CPU above catch-and-drop, medians of the rounds' differences: "
        f"spillway {c:,.1f} µs − (a) {p:,.1f} µs")


def _executor_reading(pct, bare, peer, cand, side) -> str:
    """Where the CPU of one failed record goes at this failure rate: the executor side is the
    Python workers' CPU above the catch-and-drop baseline's (`_above`), and what would close
    its gap to (a) at the target's failure rate."""
    m = [f.median or 0.0 for f in (bare, peer, cand, side)]
    closing = "" if pct != EXECUTOR_PCT else (
        " Where the executor side's time goes, measured off Spark in one process "
        "(docs/design/failure-path.md, rounds four to eight; not in this run): describing the "
        "failure about 2.6 µs (its way of failing looked up, the frame signature in C), its "
        "context 1-1.6, trimming and releasing its traceback 0.8, the report thread 2-3 "
        "(encoding 0.7, the blocking gRPC call, whose CPU grows with the sidecar's answer "
        "time); the cyclic collector, which took about 1.4, runs less often while a wrapper "
        "runs (`Job(gc_young_threshold=...)`). What would close the gap to (a) + "
        f"{EXECUTOR_ABOVE_PEER_US:g} µs: a report kept as columns from the first failure (no "
        "object per failed record, no encoding pass: about 1-1.5 µs) and a faster answer "
        "from the sidecar.")
    return (f"CPU per failed record at {pct:g}% (Spark's Python workers: every PySpark "
            f"daemon and the workers it forked, from their /proc counters): the executor side "
            f"of spillway's failure path costs {_above(cand, bare):,.1f} µs above catch-and-drop "
            f"(median of the rounds' differences; medians {m[2]:,.1f} against {m[0]:,.1f} µs, "
            f"the parse and the rows' own work included), hand-rolled dead-lettering (a) "
            f"{_above(peer, bare):,.1f} µs; the sidecar spends {m[3]:,.1f} µs per failed record "
            f"besides." + closing)
