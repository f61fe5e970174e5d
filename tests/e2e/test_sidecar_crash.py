"""kill -9 of the sidecar process itself (`spillway serve`) twice during a burst of 100,000
dead-lettered records reported over gRPC by 8 concurrent callers; restarts over the same spool
deliver everything the sidecar had acknowledged (a SKIP verdict with dead_lettered=true), and
replay little that Kafka already had (docs/DLQ.md states the bound and the measured figure)."""

from __future__ import annotations

import pytest
from support.sidecar_crash import run

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

KILLS = 2
# Per kill, what may be written twice: the records in flight (producer.max.inflight.bytes,
# 1 MiB by default; these records take ~840 bytes spooled, so 800 is a safe divisor) and the
# acknowledged records not yet settled in the spool (at most 1,000: the drain's delete_batch).
BOUND_PER_KILL = 1024 * 1024 // 800 + 1_000


<<<<<<< HEAD
def _serve(bootstrap, spool_dir):
    proc = subprocess.Popen(
        [sys.executable, "-m", "spillway.sidecar.cli", "--log-level", "WARNING", "serve",
         "--listen", "127.0.0.1:0", "--bootstrap-servers", bootstrap,
         "--set", f"spool.dir={spool_dir}"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    m = re.search(r"listening on (\S+)", proc.stdout.readline())
    assert m, "sidecar did not start"
    return proc, m.group(1)


RUN = "app-crash-0001"
_token: list[tuple[str, str]] = []  # the run's job token metadata, once registered


def _register(stub, topic):
    # after the restart the sidecar has forgotten the run: the executor's token is adopted
    reg = stub.RegisterJob(pb.RegisterJobRequest(job="crash", run_id=RUN, properties={
        "errors.tolerance": "all", "errors.deadletterqueue.topic.name": topic}), timeout=20,
        metadata=_token or None)
    _token[:] = [("spillway-job-token", reg.job_token)]


def _batch(start, end):
    return [pb.FailedRecord(
        record_id=f"id-{i}", stage=pb.STAGE_TRANSFORMATION, function_name="app.f",
        key=f"id-{i}".encode(), value=b"x" * 200,
        exception=pb.ExceptionInfo(class_name="builtins.ValueError",
                                   class_chain=["builtins.ValueError"]))
        for i in range(start, end)]


def _report(stub, start, end, acked, task):
    out = stub.ReportFailures(pb.ReportFailuresRequest(job="crash", run_id=RUN, task=task,
                                                       records=_batch(start, end)), timeout=30,
                              metadata=_token)
    acked.update(v.record_id for v in out.verdicts if v.dead_lettered)


def test_kill_9_of_the_sidecar_loses_no_acknowledged_record(broker, tmp_path, topic_name):
    create_topic(broker.bootstrap_servers, topic_name)
    spool = tmp_path / "spool"
    proc, address = _serve(broker.bootstrap_servers, spool)
    acked: set[str] = set()
    sent_upto = 0
    stop = threading.Event()
    task = pb.TaskIdentity(stage_id=1, partition_id=0, task_attempt_id=1)

    def burst(stub):
        nonlocal sent_upto
        try:
            while sent_upto < TOTAL and not stop.is_set():
                _report(stub, sent_upto, min(TOTAL, sent_upto + BATCH), acked, task)
                sent_upto = min(TOTAL, sent_upto + BATCH)
        except grpc.RpcError:
            pass  # the sidecar died under us: this batch was not acknowledged

    try:
        with grpc.insecure_channel(address) as ch:
            stub = pb_grpc.ErrorSidecarStub(ch)
            _register(stub, topic_name)
            t = threading.Thread(target=burst, args=(stub,))
            t.start()
            deadline = time.monotonic() + 120
            while len(acked) < 30_000 and t.is_alive() and time.monotonic() < deadline:
                time.sleep(0.01)
            os.kill(proc.pid, signal.SIGKILL)  # mid-burst: reports in flight, spool not drained
            proc.wait(10)
            stop.set()
            t.join(30)
        killed_at = len(acked)
        assert 30_000 <= killed_at < TOTAL

        # restart over the same spool; the burst goes on from the first unacknowledged batch
        proc, address = _serve(broker.bootstrap_servers, spool)
        with grpc.insecure_channel(address) as ch:
            stub = pb_grpc.ErrorSidecarStub(ch)
            _register(stub, topic_name)
            task2 = pb.TaskIdentity(stage_id=1, partition_id=0, attempt_number=1,
                                    task_attempt_id=2)
            for start in range(sent_upto, TOTAL, BATCH):
                _report(stub, start, min(TOTAL, start + BATCH), acked, task2)
            stub.FlushTask(pb.FlushTaskRequest(job="crash", run_id=RUN, task=task2), timeout=120,
                           metadata=_token)
            # the records recovered from the spool drain too
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                status = stub.GetStatus(pb.GetStatusRequest(), timeout=5)
                if status.counters["spool-depth"] == 0:
                    break
                time.sleep(0.5)
        assert len(acked) == TOTAL
        counts = Counter(m.key().decode() for m in read_all(broker.bootstrap_servers,
                                                            topic_name, idle_s=3))
        lost = acked - set(counts)
        assert not lost, f"{len(lost)} acknowledged records lost, e.g. {sorted(lost)[:5]}"
        duplicates = sum(n - 1 for n in counts.values())
        assert duplicates <= MAX_IN_FLIGHT
        print(f"killed after {killed_at} acknowledged; {duplicates} duplicates after restart")
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)
=======
def test_kill_9_of_the_sidecar_loses_nothing_and_replays_at_most_the_in_flight_window(
        broker, tmp_path, topic_name):
    result = run(broker.bootstrap_servers, topic_name, str(tmp_path / "spool"),
                 total=100_000, kills=KILLS)
    assert len(result.killed_at) == KILLS
    assert all(0 < k < result.total for k in result.killed_at)   # killed mid-burst each time
    assert result.lost == 0
    assert result.duplicates <= KILLS * BOUND_PER_KILL, result
    print(f"\n{result}: {result.per_100k:.0f} duplicates per 100k records")
>>>>>>> 20eeb08 (Fewer duplicates after kill -9: the spool persists acknowledgements of part of a batch row as settled index ranges (same transaction as the row deletes, synchronous=NORMAL), the drain settles every 50 ms / 1,000 acks, producer.max.inflight.bytes (1 MiB, was 4 MiB fixed) bounds what is in flight; measured with tests/support/sidecar_crash.py (8 callers, 100k records, 3 kills, 3 rounds): ~570 duplicates per kill, 1,723 per 100k (was ~5,000 per kill); e2e test asserts no loss and the stated bound. Tansu accepts but does not honour transactions (documented). read_dlq: a DLQ topic as a DataFrame read from the executors with confluent-kafka (spillway-spark[kafka]), one Spark partition per Kafka partition, ends read not trusted from the watermark, typed context columns, job/stage/exception/time filters; examples/dlq_top_causes.py)
