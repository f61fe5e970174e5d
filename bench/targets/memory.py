"""Target 7: the sidecar's memory while a million dead-lettered records sit in its spool during
a broker outage, and after they drain."""

from __future__ import annotations

import time
import uuid

from ..clients import ClientPool
from ..infra import BenchError, RssSampler, proc_status, rss_kib
from ..model import TargetResult, absolute_check, fmt
from ..runner import Context
from .common import dlq_props

CLIENTS = 4
SETTLE_S = 5.0
SPOOL_MAX_BYTES = 2 * 1024 ** 3
MB = 1_000_000 / 1024  # KiB per MB (10^6 bytes): VmRSS is in KiB


def _status(address: str) -> dict[str, float]:
    from spillway.client import SidecarClient

    return dict(SidecarClient(address, timeout_s=10).status().counters)


def run_memory(ctx: Context, result: TargetResult) -> None:
    n = ctx.sizes.memory_records
    per = n // CLIENTS
    n = per * CLIENTS
    result.setup = (
        "A fresh sidecar process (spool on, `spool.max.bytes` raised to 2 GiB so that a million "
        "records fit whatever their spooled size: ~450 bytes each since a report's records "
        "share their header bytes, ~940 before, which passed the 512 MiB default, whose "
        "backpressure then refuses reports; other settings default) and a fresh DLQ topic; "
        "the broker "
        f"is frozen (SIGSTOP), then {CLIENTS} client processes report {n:,} failed records "
        "(200-byte values, 256 per report) that the sidecar accepts into its spool; RSS is read "
        "from /proc/<pid>/status (VmRSS) every 100 ms. Then the broker is resumed and the spool "
        f"drains to Kafka; 'after drain' is VmRSS {SETTLE_S:.0f} s after the spool reached 0. One "
        "run (the outage is long), so min = max = median.")
    if ctx.short:
        result.notes.append(f"--short: {n:,} records instead of 1,000,000; the absolute "
                            "bounds are judged on this smaller spool.")
    broker = ctx.infra.broker
    # ~450 bytes a record once spooled (200-byte value, key, spillway's headers, shared by a
    # report's records); the bound is raised so that a million fit whatever that size is.
    sidecar = ctx.infra.sidecar({"spool.max.bytes": str(SPOOL_MAX_BYTES)}, name="memory")
    try:
        _measure(ctx, result, broker, sidecar, n, per)
    finally:
        # A sidecar left draining a large spool would load the machine for the next target.
        ctx.infra.stop_sidecar(sidecar)


def _measure(ctx: Context, result: TargetResult, broker, sidecar, n: int, per: int) -> None:
    topic = ctx.infra.fresh_topic("memory")
    job = f"bench-memory-{uuid.uuid4().hex[:8]}"
    pool = ClientPool(CLIENTS)
    ctx.infra.on_close(pool.close)
    time.sleep(1.0)
    idle_kib = rss_kib(sidecar.pid)
    f_idle = result.figure("sidecar RSS at rest", "MB")
    f_peak = result.figure("peak RSS while the spool fills (broker paused)", "MB")
    f_depth = result.figure("spool depth at the end of the outage", "records")
    f_fill = result.figure("spool fill rate during the outage", "records/s")
    f_drain_peak = result.figure("peak RSS while draining", "MB")
    f_drain = result.figure("drain time", "s")
    f_after = result.figure(f"RSS {SETTLE_S:.0f} s after the drain", "MB")
    f_idle.add(idle_kib / MB)

    paused = False

    def pause() -> None:
        nonlocal paused
        broker.pause()
        paused = True

    try:
        with RssSampler(sidecar.pid) as outage:
            agg = pool.run(lambda i: {"target": sidecar.address, "job": job,
                                      "props": dlq_props(topic), "records": per, "batch": 256,
                                      "flush": False, "deadline_s": 1800, "timeout_s": 120},
                           on_start=pause, timeout_s=2400)
            status = _status(sidecar.address)
            time.sleep(0.5)
            mem = proc_status(sidecar.pid)
        if agg.errors or agg.records != n:
            raise BenchError(f"the spool did not accept every record: {agg.records} of {n}, "
                             f"{agg.errors} errors: {'; '.join(agg.error_samples)}")
        depth = status.get("spool-depth", 0.0)
        f_depth.add(depth)
        f_peak.add(outage.peak_kib / MB)
        f_fill.add(agg.rate)
        result.notes.append(
            "At the end of the outage: VmRSS {:.0f} MB of which anonymous (heap) {:.0f} MB and "
            "file-backed {:.0f} MB, {} threads; the DLQ drain held {:,.0f} records in memory "
            "(`in-flight-records`) and had made {:,.0f} produce requests.".format(
                mem.get("VmRSS", 0) / MB, mem.get("RssAnon", 0) / MB, mem.get("RssFile", 0) / MB,
                mem.get("Threads", 0), status.get("in-flight-records", 0),
                status.get("deadletterqueue-produce-requests", 0)))
        ctx.log(f"    outage: {n:,} records spooled at {agg.rate:,.0f}/s, depth {depth:,.0f}, "
                f"peak RSS {outage.peak_kib / MB:.1f} MB")
    finally:
        if paused:
            broker.resume()
    t0 = time.monotonic()
    with RssSampler(sidecar.pid) as draining:
        deadline = t0 + 1800
        while time.monotonic() < deadline:
            st = _status(sidecar.address)
            if st.get("spool-depth", 1) == 0 and st.get("dlq-records-written", 0) >= n:
                break
            time.sleep(0.5)
        else:
            raise BenchError(f"the spool did not drain within 30 min: {st}")
    f_drain.add(time.monotonic() - t0)
    f_drain_peak.add(draining.peak_kib / MB)
    time.sleep(SETTLE_S)
    after = rss_kib(sidecar.pid) / MB
    f_after.add(after)
    ctx.log(f"    drained in {time.monotonic() - t0 - SETTLE_S:.1f} s; RSS after {after:.1f} MB")
    peak_all = max(outage.peak_kib, draining.peak_kib) / MB
    result.checks.append(absolute_check(
        f"peak RSS with {fmt(f_depth.summary.median)} records spooled", f_peak.summary.median,
        "<=", 200.0, "MB", "VmRSS peak while the broker was paused"))
    result.checks.append(absolute_check(
        "RSS after the spool drained", after, "<", 100.0, "MB",
        f"VmRSS {SETTLE_S:.0f} s after spool-depth reached 0"))
    result.notes.append(f"Peak RSS over the whole run, drain included: {fmt(peak_all)} MB "
                        "(the targets bound the outage and the state after the drain).")


JOBS_THREADS = 4


def run_jobs_memory(ctx: Context, result: TargetResult) -> None:
    """Target 9: RSS of a sidecar before and after it served and ended many short jobs."""
    n = ctx.sizes.jobs_closed
    result.setup = (
        f"A fresh sidecar process (spool on, `jobs.max.live` default) and a fresh DLQ topic; "
        f"after a warm-up of 100 jobs, {JOBS_THREADS} client threads run {n:,} short jobs, "
        "each: RegisterJob (a new run), one ReportFailures of 20 failed records (5 data errors, "
        "dead-lettered; 15 transient, RETRY), a FlushTask, then EndJob (the driver's "
        "`Job.close()`). 'Before' is VmRSS after the warm-up; 'after' is VmRSS "
        f"{SETTLE_S:.0f} s after the last EndJob, once the spool is empty. One run.")
    sidecar = ctx.infra.sidecar(name="jobs-memory")
    try:
        _measure_jobs(ctx, result, sidecar, n)
    finally:
        ctx.infra.stop_sidecar(sidecar)


def _job_round(client, topic: str, prefix: str, count: int) -> None:
    from spillway.v1 import sidecar_pb2 as pb

    props = {**dlq_props(topic), "errors.deadletterqueue.auto.create.topics.enable": "false"}
    data = pb.ExceptionInfo(class_name="builtins.ValueError",
                            class_chain=["builtins.ValueError"], message="bad")
    transient = pb.ExceptionInfo(class_name="builtins.ConnectionError",
                                 class_chain=["builtins.ConnectionError"], message="reset")
    for i in range(count):
        run = client.register_job(f"{prefix}-{i}", props)
        task = pb.TaskIdentity(stage_id=1, partition_id=i % 8, task_attempt_id=i)
        records = [pb.FailedRecord(record_id=f"r{k}", stage=pb.STAGE_TRANSFORMATION,
                                   key=f"{prefix}-{i}/{k}".encode(), value=b"v" * 200,
                                   exception=data if k % 4 == 0 else transient)
                   for k in range(20)]
        client.report_failures(run, task, records)
        client.flush_task(run, task, {pb.STAGE_TRANSFORMATION: 100}, timeout_s=60)
        client.end_job(run)


def _measure_jobs(ctx: Context, result: TargetResult, sidecar, n: int) -> None:
    from concurrent.futures import ThreadPoolExecutor

    from spillway.client import SidecarClient

    topic = ctx.infra.fresh_topic("jobs-memory")
    tag = uuid.uuid4().hex[:6]
    client = SidecarClient(sidecar.address, timeout_s=60)
    ctx.infra.on_close(client.close)
    _job_round(client, topic, f"warm-{tag}", 100)
    time.sleep(SETTLE_S)
    before = rss_kib(sidecar.pid) / MB
    per = n // JOBS_THREADS
    t0 = time.monotonic()
    with RssSampler(sidecar.pid) as during:
        with ThreadPoolExecutor(JOBS_THREADS) as pool:
            for f in [pool.submit(_job_round, client, topic, f"bench-{tag}-{t}", per)
                      for t in range(JOBS_THREADS)]:
                f.result()
    elapsed = time.monotonic() - t0
    status = _status(sidecar.address)
    deadline = time.monotonic() + 120
    while status.get("spool-depth", 0) > 0 and time.monotonic() < deadline:
        time.sleep(0.5)
        status = _status(sidecar.address)
    time.sleep(SETTLE_S)
    after = rss_kib(sidecar.pid) / MB
    status = _status(sidecar.address)
    result.figure("RSS before (after the warm-up)", "MB").add(before)
    result.figure(f"peak RSS while {per * JOBS_THREADS:,} jobs ran", "MB").add(
        during.peak_kib / MB)
    result.figure(f"RSS {SETTLE_S:.0f} s after the last job ended", "MB").add(after)
    result.figure("jobs per second (register, report, flush, end)", "jobs/s").add(
        per * JOBS_THREADS / elapsed)
    result.notes.append(
        f"Live jobs afterwards: {status.get('jobs', -1):,.0f}; records still tracked: "
        f"{status.get('records-tracked', -1):,.0f}; "
        f"spool depth {status.get('spool-depth', -1):,.0f}.")
    ctx.log(f"    {per * JOBS_THREADS:,} jobs in {elapsed:.1f} s; RSS {before:.1f} -> "
            f"{after:.1f} MB (peak {during.peak_kib / MB:.1f})")
    result.checks.append(absolute_check(
        "RSS after the jobs ended vs before", after / before, "<=", 1.2, "ratio",
        f"VmRSS {after:.1f} MB after / {before:.1f} MB before"))
    result.checks.append(absolute_check(
        "live jobs after every job ended", status.get("jobs", -1), "==", 0, "jobs"))
