"""Soak: one sidecar process serving many short jobs for a while, failures throughout, some jobs
ended by their driver, others abandoned to the idle timeout. Afterwards its live state and its
memory are back down, and every record it dead-lettered is in the DLQ topic."""

from __future__ import annotations

import os
import signal
import subprocess
import time
import uuid

import pytest
from spillway.client import SidecarClient
from spillway.v1 import sidecar_pb2 as pb
from support import serve
from support.kafka import read_all

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ROUNDS = 20
JOBS_PER_ROUND = 12
RECORDS_PER_JOB = 40       # of which every 4th fails as a data error -> dead-lettered
IDLE_TIMEOUT_MS = 1500


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def _spawn(broker, tmp_path):
    return serve.spawn(
        ["--listen", "127.0.0.1:0", "--bootstrap-servers", broker.bootstrap_servers,
         "--set", f"spool.dir={tmp_path / 'spool'}",
         "--set", f"job.idle.timeout.ms={IDLE_TIMEOUT_MS}", "--set", "producer.linger.ms=5"],
        env={k: v for k, v in os.environ.items() if not k.startswith("SPILLWAY_")})


def _records(job: str, n: int) -> list[pb.FailedRecord]:
    out = []
    for i in range(n):
        data_error = i % 4 == 0
        exc = (pb.ExceptionInfo(class_name="builtins.ValueError",
                                class_chain=["builtins.ValueError"], message=f"bad {i}")
               if data_error else
               pb.ExceptionInfo(class_name="builtins.ConnectionError",
                                class_chain=["builtins.ConnectionError", "builtins.OSError"],
                                message="reset"))
        out.append(pb.FailedRecord(record_id=f"r{i}", stage=pb.STAGE_TRANSFORMATION,
                                   function_name="soak.f", key=f"{job}/r{i}".encode(),
                                   value=b"x" * 200, exception=exc))
    return out


def _round(client: SidecarClient, topic: str, r: int, dead: set[bytes]) -> None:
    props = {"errors.tolerance": "all", "errors.deadletterqueue.topic.name": topic,
             "errors.deadletterqueue.auto.create.topics.enable": "true",
             "errors.deadletterqueue.topic.replication.factor": "1",
             "errors.retry.timeout": "600000"}   # transient failures: RETRY, tracked
    for k in range(JOBS_PER_ROUND):
        job = f"soak-{r}-{k}-{uuid.uuid4().hex[:6]}"
        run = client.register_job(job, props)
        task = pb.TaskIdentity(stage_id=1, partition_id=k, task_attempt_id=(r + 1) * 1000 + k)
        records = _records(job, RECORDS_PER_JOB)
        verdicts = client.report_failures(run, task, records)
        for rec, v in zip(records, verdicts, strict=True):
            if v.dead_lettered:
                dead.add(rec.key)
        client.flush_task(run, task, {pb.STAGE_TRANSFORMATION: 100}, timeout_s=30)
        if k % 2 == 0:   # the driver ends half of the jobs; the others are abandoned
            client.end_job(run)


def test_many_short_jobs_leave_no_state_no_memory_and_lose_nothing(broker, tmp_path,
                                                                   topic_name):
    proc, address = _spawn(broker, tmp_path)
    client = SidecarClient(address, timeout_s=30)
    dead: set[bytes] = set()
    try:
        _round(client, topic_name, -1, dead)         # warm-up: imports, caches, the topic
        time.sleep(IDLE_TIMEOUT_MS / 1000 * 3)
        rss_before = _rss_mb(proc.pid)
        for r in range(ROUNDS):
            _round(client, topic_name, r, dead)
        rss_peak = _rss_mb(proc.pid)
        live = client.status()
        # the abandoned jobs are still live, holding the retry schedules of their transient
        # failures, until their idle timeout
        assert live.counters["jobs"] > 0 and live.counters["records-tracked"] > 0
        # every abandoned job ends on its own after the idle timeout
        deadline = time.monotonic() + 60
        while True:
            status = client.status()
            if status.jobs_total == 0 and status.counters["jobs"] == 0:
                break
            assert time.monotonic() < deadline, (
                f"jobs still live: jobs_total={status.jobs_total} "
                f"counters[jobs]={status.counters['jobs']}")
            time.sleep(0.5)
        assert status.counters["spool-depth"] == 0
        assert status.counters["records-tracked"] == 0
        time.sleep(3)   # the drain's idle housekeeping (memory handed back)
        rss_after = _rss_mb(proc.pid)
        # generous: state released, memory back near where it was before the jobs
        assert rss_after <= rss_before * 1.25 + 15, (rss_before, rss_peak, rss_after)
        # the data errors (every 4th record) are dead-lettered; the transient ones get RETRY
        assert len(dead) == (ROUNDS + 1) * JOBS_PER_ROUND * (RECORDS_PER_JOB // 4)
        keys = {m.key() for m in read_all(broker.bootstrap_servers, topic_name)}
        assert dead <= keys, f"{len(dead - keys)} dead-lettered records missing from the DLQ"
    finally:
        client.close()
        proc.send_signal(signal.SIGTERM)
        try:
            proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
