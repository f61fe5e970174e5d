"""Targets 1 (end-to-end dead-letter rate), 5 (durability cost) and 6 (tracing cost)."""

from __future__ import annotations

import functools
import json
import subprocess
import sys
import uuid

from .. import cpu, peers, workloads
from ..clients import REPO_ROOT, ClientPool
from ..infra import BenchError, SidecarProcess
from ..model import TargetResult, fmt, ratio_check
from ..runner import Context
from .common import alternate_runs, dlq_props, profiled, start_listening
from .sparkutil import executor_env, python_daemons, ship_workloads, timed, timed_workers

PARTITIONS = 4
CLIENTS = 4
LINGER_MS = 20          # the sidecar's default producer.linger.ms
BATCH_BYTES = 1_000_000  # the sidecar's default producer.batch.size


def _sidecar_props(**extra: str) -> dict[str, str]:
    return {"producer.linger.ms": str(LINGER_MS), "producer.batch.size": str(BATCH_BYTES),
            **extra}


def plain_producer_rate(ctx: Context, records: int, cpu_figure):
    """The plain producer's rate, and its CPU per record as `cpu_figure`
    (`alternate_runs`' secondary figure)."""
    topic = ctx.infra.fresh_topic("plain")
    out = subprocess.run(
        [sys.executable, "-m", "bench.produce", "--bootstrap", ctx.infra.bootstrap, "--topic",
         topic, "--records", str(records), "--linger-ms", str(LINGER_MS), "--batch-size",
         str(BATCH_BYTES)], cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    lines = out.stdout.strip().splitlines()
    if not lines:
        raise BenchError(f"bench.produce printed nothing: {out.stderr[-1000:]}")
    r = json.loads(lines[-1])
    if r["acknowledged"] != records:
        raise BenchError(f"plain producer: {r['acknowledged']} of {records} acknowledged "
                         f"({r['first_error']})")
    return records / r["seconds"], {cpu_figure: cpu.us_per_record(r["cpu_seconds"], records)}


def spark_dlq_rate(ctx: Context, sidecar: SidecarProcess, records: int,
                   env: dict[str, str] | None = None, cpu_figure=None, worker_figure=None, *,
                   broker_figure=None):
    """Every record of a Kafka-shaped DataFrame fails in ``job.map_partitions``: the rate at
    which they reach the DLQ topic, acknowledged (the action returns after every task passed
    its flush barrier). With `cpu_figure`: ``(rate, {cpu_figure: the sidecar's CPU per
    dead-lettered record over the action})``; with `worker_figure` too, the Spark Python
    workers' CPU per record (`WorkerCpu`); with `broker_figure`, the broker's."""
    from spillway.spark import Job

    ship_workloads()
    spark = ctx.infra.spark
    topic = ctx.infra.fresh_topic("e2e")
    job = Job(f"bench-e2e-{uuid.uuid4().hex[:8]}", dlq_props(topic), sidecar=sidecar.address)
    job.register()
    with executor_env(spark, env or {}):
        df = workloads.kafka_frame(spark, records, PARTITIONS, fail_every=1)
        out = job.map_partitions(df, workloads.parse_order, schema=workloads.OUT_SCHEMA)
    broker = ctx.infra.broker_pid() if broker_figure is not None else None
    pids = [sidecar.pid, *([broker] if broker else [])]
    before = cpu.snapshot(pids)
    if worker_figure is not None:
        seconds, worker_s = timed_workers(lambda: workloads.noop_write(out))
    else:
        seconds = timed(lambda: workloads.noop_write(out))
    after = cpu.snapshot(pids)
    used = cpu.cpu_used(before, after, [sidecar.pid])
    written = job.summary().dlq_records_written
    if written < records:
        raise BenchError(f"the Spark job returned with {written} of {records} DLQ records "
                         f"acknowledged")
    extras = {}
    if cpu_figure is not None:
        extras[cpu_figure] = cpu.us_per_record(used, records)
    if worker_figure is not None:
        extras[worker_figure] = cpu.us_per_record(worker_s, records)
    if broker:
        extras[broker_figure] = cpu.us_per_record(cpu.cpu_used(before, after, [broker]),
                                                  records)
    return (records / seconds, extras) if extras else records / seconds


def handrolled_dlq_rate(ctx: Context, records: int, *, worker_figure=None,
                        broker_figure=None):
    """Peer (a) on target 1's job: the same rows fail in the same function, and each task
    produces its failures to a fresh DLQ topic itself; the action returns after every task's
    flush (all acknowledged). The topic's record count is checked after the clock stops.
    With the figures: ``(rate, {figure: the Spark Python workers' / the broker's CPU per
    record})``."""
    ship_workloads()
    spark = ctx.infra.spark
    topic = ctx.infra.fresh_topic("peer-a")
    conf = peers.producer_conf(ctx.infra.bootstrap, linger_ms=LINGER_MS, batch_size=BATCH_BYTES)
    df = workloads.kafka_frame(spark, records, PARTITIONS, fail_every=1)
    run = functools.partial(peers.kafka_batches, conf, topic, workloads.parse_order,
                            workloads.OUT_NAMES)
    out = df.mapInArrow(run, workloads.OUT_SCHEMA)
    broker = ctx.infra.broker_pid() if broker_figure is not None else None
    before = cpu.snapshot([broker] if broker else [])
    if worker_figure is not None:
        seconds, worker_s = timed_workers(lambda: workloads.noop_write(out))
    else:
        seconds = timed(lambda: workloads.noop_write(out))
    after = cpu.snapshot([broker] if broker else [])
    expect_topic_records(ctx, topic, records, "hand-rolled dead-lettering")
    extras = {}
    if worker_figure is not None:
        extras[worker_figure] = cpu.us_per_record(worker_s, records)
    if broker:
        extras[broker_figure] = cpu.us_per_record(cpu.cpu_used(before, after), records)
    return (records / seconds, extras) if extras else records / seconds


def expect_topic_records(ctx: Context, topic: str, records: int, who: str,
                         result: TargetResult | None = None) -> None:
    """The peer's DLQ topic holds its records. Its producer had an acknowledgement for every
    one (a peer task fails otherwise), so a short count after a longer second look is Tansu's
    (memory storage, several producers on one partition), noted in the report, not a failed run."""
    got = ctx.infra.topic_records(topic, records)
    if got < records:
        got = ctx.infra.topic_records(topic, records, idle_s=15.0)
    if got < records:
        note = (f"{who}: {got:,} of {records:,} acknowledged records readable in {topic} "
                f"(Tansu with several producers on one partition); the run counts")
        ctx.log("    " + note)
        if result is not None and note not in result.notes:
            result.notes.append(note)


def run_dlq_rate(ctx: Context, result: TargetResult) -> None:
    n = ctx.sizes.dlq_records
    result.setup = (
        f"Candidate: a local[2] Spark job over {n:,} Kafka-shaped rows (200-byte values, "
        f"{PARTITIONS} partitions) where every record fails in `job.map_partitions` (truncated "
        "JSON); records go through the client to the sidecar (its own process, `spillway serve`, "
        "spool on) and into a fresh DLQ topic; the rate is records / wall time of the action, "
        "which returns only after every task's flush barrier (all DLQ records acknowledged by "
        "Kafka). Baseline: one plain Python process (`bench.produce`) producing the same number "
        "of records (same key, 200-byte value and the sidecar's nine `spillway.*` headers) to a "
        f"fresh topic on the same broker, idempotent, acks=all, linger.ms={LINGER_MS}, "
        f"batch.size={BATCH_BYTES}, flush at the end. Peer (a), hand-rolled dead-lettering: the "
        "same Spark job and rows, `df.mapInArrow` over a function that calls the same "
        "`parse_order` on each value and, when it raises, produces the row to a fresh DLQ "
        "topic itself with "
        "confluent-kafka: one `Producer` per task (built at its first failure; idempotent, "
        f"acks=all, linger.ms={LINGER_MS}, batch.size={BATCH_BYTES}), the original key and "
        "value with five headers (error class, message, source topic, partition, offset), "
        "`poll(0)` after each produce, flush at the end of the partition, the task failing if "
        "any record is not acknowledged; no sidecar, spool or policy. Its rate is records / "
        "wall time of the same action; the DLQ topic's record count is checked afterwards.")
    sidecar = ctx.infra.sidecar(_sidecar_props(), name="e2e")
    f_base = result.figure("plain producer", "records/s")
    f_peer = result.figure("peer (a): hand-rolled dead-lettering in Spark", "records/s")
    f_cand = result.figure("Spark → client → sidecar → DLQ", "records/s")
    # CPU per record beside the rates: the plain producer's is the floor of producing these
    # records from Python (its delivery reports and librdkafka's threads included)
    f_base_cpu = result.figure("plain producer: CPU per record", "µs")
    f_cand_cpu = result.figure("sidecar: CPU per dead-lettered record", "µs")
    # where each variant's time goes: the 2 cores run Spark, its Python workers, the broker
    # and (the candidate) the sidecar, so the rates follow the CPU they spend per record
    f_peer_w = result.figure("peer (a): Spark Python workers' CPU per record", "µs")
    f_cand_w = result.figure("candidate: Spark Python workers' CPU per record", "µs")
    f_peer_b = result.figure("peer (a): broker (Tansu) CPU per record", "µs")
    f_cand_b = result.figure("candidate: broker (Tansu) CPU per record", "µs")
    alternate_runs(ctx, result, {
        f_base.name: lambda _r: plain_producer_rate(ctx, n, f_base_cpu),
        f_peer.name: lambda _r: handrolled_dlq_rate(ctx, n, worker_figure=f_peer_w,
                                                    broker_figure=f_peer_b),
        f_cand.name: lambda _r: spark_dlq_rate(ctx, sidecar, n, cpu_figure=f_cand_cpu,
                                               worker_figure=f_cand_w, broker_figure=f_cand_b),
    }, {f_base.name: f_base, f_peer.name: f_peer, f_cand.name: f_cand}, warmup=True)
    result.notes.append(_cpu_reading(f_cand_cpu, f_base_cpu))
    result.notes.append(_where_reading(f_cand_w, f_cand_cpu, f_cand_b, f_peer_w, f_peer_b))
    result.checks.append(ratio_check("dead-letter rate vs plain producer", f_cand, f_base,
                                     ">=", 0.5))
    result.checks.append(ratio_check("dead-letter rate vs hand-rolled (a)", f_cand, f_peer,
                                     ">=", 0.8))
    if ctx.sizes.profile and result.met is False:
        profile_dlq_job(ctx, result, sidecar, n, "dlq-rate")


def _tracing_cpu_reading(side: dict, work: dict) -> str:
    """Each variant's CPU per record, sidecar and Spark workers, against tracing off."""
    med = {k: (side[k].median or 0.0, work[k].median or 0.0) for k in side}
    off_s, off_w = med["tracing off"]
    parts = [f"{k}: sidecar {fmt(s)} µs ({s - off_s:+.1f}), Spark workers {fmt(w)} µs "
             f"({w - off_w:+.1f})" for k, (s, w) in med.items() if k != "tracing off"]
    return (f"CPU per record, medians (figures, not targets; against tracing off: sidecar "
            f"{fmt(off_s)} µs, Spark workers {fmt(off_w)} µs): " + "; ".join(parts) + ".")


def _where_reading(cand_workers, cand_sidecar, cand_broker, peer_workers, peer_broker) -> str:
    """Where a dead-lettered record's CPU goes in each variant, and what would close the
    rate gap."""
    vals = [f.median for f in (cand_workers, cand_sidecar, cand_broker, peer_workers,
                               peer_broker)]
    if None in vals:
        return "Where the CPU goes: not measured."
    cw, cs, cb, pw, pb = vals
    cand, peer = cw + cs + cb, pw + pb
    return (f"Where a dead-lettered record's CPU goes (medians, Spark's JVM not counted): "
            f"spillway: the Spark Python workers {fmt(cw)} µs + the sidecar {fmt(cs)} + the "
            f"broker {fmt(cb)} = {fmt(cand)} µs; peer (a): the workers {fmt(pw)} µs (its "
            f"producer and librdkafka's threads inside them) + the broker {fmt(pb)} = "
            f"{fmt(peer)} µs ({fmt(cand / peer)}×). On 2 shared cores the rates follow these "
            f"sums. The workers' figure also holds what the two ways into the rows cost: "
            f"`job.map_partitions` hands the function Row objects (each Arrow batch converted "
            f"by spillway's `_arrow_rows`, the same Rows as pyspark's converter at about a "
            f"third of its CPU, its outputs back), peer (a)'s `mapInArrow` function reads the "
            f"batches' columns itself. What would close "
            f"the gap: the sidecar's per-record work (target 11 reads it by thread) and the "
            f"executor side (target 4).")


def _cpu_reading(sidecar_cpu, producer_cpu) -> str:
    """The sidecar's CPU per record against the plain producer's (the floor)."""
    side, floor = sidecar_cpu.median, producer_cpu.median
    if not side or not floor:
        return "CPU per record: not measured."
    return (f"CPU per record (figures, not targets): the sidecar spends {fmt(side)} µs per "
            f"dead-lettered record over the action, the plain producer {fmt(floor)} µs per "
            f"record producing the same records with nine headers (its delivery reports and "
            f"librdkafka's threads included): {fmt(side / floor)}× the floor of producing them "
            f"from Python. The sidecar's records carry its default headers (about a dozen; "
            f"more with errors.deadletterqueue.context.headers.enable), each one copied by "
            f"librdkafka for every record, and go through its spool and its home's decision "
            f"first.")


def profile_dlq_job(ctx: Context, result: TargetResult, sidecar: SidecarProcess, n: int,
                    label: str, env: dict[str, str] | None = None) -> None:
    """One more candidate run with py-spy on the sidecar and on Spark's Python workers."""
    from ..profiling import Recording, section

    spark_side = Recording(python_daemons(), ctx.profile_dir or ctx.infra.workdir,
                           f"{label}-workers", subprocesses=True)
    try:
        profiled(ctx, result, "sidecar process during the Spark dead-letter job",
                 [sidecar.pid], lambda: spark_dlq_rate(ctx, sidecar, n, env),
                 label=f"{label}-sidecar")
    finally:
        stacks = spark_side.stop()
    if stacks:
        result.profiles.append(section("Spark Python workers during the same run", stacks))


def clients_dlq_rate(ctx: Context, pool: ClientPool, sidecar: SidecarProcess,
                     per_client: int, run_no: int) -> float:
    topic = ctx.infra.fresh_topic("dur")
    job = f"bench-dur-{uuid.uuid4().hex[:8]}"
    agg = pool.run(lambda i: {"target": sidecar.address, "job": job, "props": dlq_props(topic),
                              "records": per_client, "batch": 256, "flush": True,
                              "run_no": run_no})
    if agg.errors or agg.timed_out or agg.acked != agg.records:
        raise BenchError(f"durability run: errors={agg.errors}, acknowledged {agg.acked} of "
                         f"{agg.records}: {'; '.join(agg.error_samples)}")
    return agg.rate


def run_durability(ctx: Context, result: TargetResult) -> None:
    per = ctx.sizes.durability_per_client
    result.setup = (
        f"{CLIENTS} client processes (the real `SidecarClient`) each report {per:,} failed "
        "records (256 per report) for a job that dead-letters to a fresh topic, then call the "
        "flush barrier; DLQ throughput = records / (first report → last flush returned, i.e. "
        "all acknowledged by Kafka). Two sidecar processes, identical but for `spool.enable` "
        "(true: SQLite WAL, synchronous=FULL, group commit; false: bounded in-memory queue), "
        "alternated run by run.")
    on = ctx.infra.sidecar(_sidecar_props(**{"spool.enable": "true"}), name="spool-on")
    off = ctx.infra.sidecar(_sidecar_props(**{"spool.enable": "false"}), name="spool-off")
    pool = ClientPool(CLIENTS)
    ctx.infra.on_close(pool.close)
    f_off = result.figure("spool off", "records/s")
    f_on = result.figure("spool on", "records/s")
    alternate_runs(ctx, result, {
        f_off.name: lambda r: clients_dlq_rate(ctx, pool, off, per, r),
        f_on.name: lambda r: clients_dlq_rate(ctx, pool, on, per, r),
    }, {f_off.name: f_off, f_on.name: f_on}, warmup=True)
    result.checks.append(ratio_check("spool on vs spool off", f_on, f_off, ">=", 0.8))
    if ctx.sizes.profile and result.met is False:
        profiled(ctx, result, "sidecar process with spool on", [on.pid],
                 lambda: clients_dlq_rate(ctx, pool, on, per, 99), label="durability-on")


TRACING_VARIANTS: dict[str, dict[str, str]] = {
    "tracing off": {"OTEL_SDK_DISABLED": "true"},
    "1% parent-based sampling": {"OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
                                 "OTEL_TRACES_SAMPLER_ARG": "0.01"},
    "100% parent-based sampling": {"OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
                                   "OTEL_TRACES_SAMPLER_ARG": "1.0"},
}


def run_tracing(ctx: Context, result: TargetResult) -> None:
    n = ctx.sizes.tracing_records
    result.setup = (
        f"The end-to-end dead-letter job of target 1 ({n:,} rows, every one failing: the "
        "tracing-heaviest case, one `exception` event per failed record and the trace context on "
        "every report), with the executors' and the sidecar's OpenTelemetry set by the standard "
        "variables: off (`OTEL_SDK_DISABLED=true`), `OTEL_TRACES_SAMPLER=parentbased_traceidratio` "
        "with `OTEL_TRACES_SAMPLER_ARG=0.01` and `1.0`. The sampled variants export their spans "
        "over OTLP/gRPC (`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`) to a receiver of their own "
        "(`bench.otlp_sink`, its own process: it counts the spans and keeps nothing), executors "
        "and sidecar alike: a sidecar with no exporter records no span at all. Each variant has "
        "its own sidecar process and its own Spark worker daemon (PySpark keys worker daemons by "
        "environment), alternated run by run.")
    _, sink = start_listening(ctx, "bench.otlp_sink", "the OTLP sink")
    variants = {name: dict(env) if "OTEL_SDK_DISABLED" in env else {
        **env, "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": f"http://{sink}",
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "grpc"} for name, env in TRACING_VARIANTS.items()}
    sidecars = {name: ctx.infra.sidecar(_sidecar_props(), name=f"trace{i}", env=env)
                for i, (name, env) in enumerate(variants.items())}
    figs = {name: result.figure(name, "records/s") for name in TRACING_VARIANTS}
    # where the time goes: each variant's sidecar and Spark workers, CPU per record
    side = {name: result.figure(f"{name}: sidecar CPU per record", "µs")
            for name in TRACING_VARIANTS}
    work = {name: result.figure(f"{name}: Spark workers' CPU per record", "µs")
            for name in TRACING_VARIANTS}
    alternate_runs(ctx, result, {
        name: (lambda _r, name=name: spark_dlq_rate(ctx, sidecars[name], n, variants[name],
                                                    side[name], work[name]))
        for name in TRACING_VARIANTS}, figs, warmup=True)
    off, one, full = (figs[k] for k in TRACING_VARIANTS)
    result.checks.append(ratio_check("1% sampling vs off", one, off, ">=", 0.97))
    result.checks.append(ratio_check("100% sampling vs off", full, off, ">=", 0.90))
    result.notes.append(
        f"Medians: off {fmt(off.summary.median)}, 1% {fmt(one.summary.median)}, 100% "
        f"{fmt(full.summary.median)} records/s.")
    result.notes.append(_tracing_cpu_reading(side, work))
    if ctx.sizes.profile and result.met is False:
        name = "100% parent-based sampling"
        profile_dlq_job(ctx, result, sidecars[name], n, "tracing", variants[name])
