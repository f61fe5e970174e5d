"""kill -9 of `spillway serve` during a gRPC burst of dead-lettered records, several times over,
then a count of what reached the DLQ topic: lost (must be none) and duplicated records.

Used by tests/e2e/test_sidecar_crash.py and, to measure duplicates per 100k records, runnable on
its own (starts its own Tansu broker):

    .venv/bin/python tests/support/sidecar_crash.py --total 100000 --kills 3 --rounds 3
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass

import grpc
from spillway.v1 import sidecar_pb2 as pb
from spillway.v1 import sidecar_pb2_grpc as pb_grpc

try:
    from support import serve
except ImportError:  # run as a script: tests/support is sys.path[0]
    import serve  # type: ignore[no-redef]

BATCH = 500


@dataclass
class CrashRun:
    total: int
    kills: int
    killed_at: list[int]   # acknowledged records when each kill -9 happened
    lost: int
    duplicates: int

    @property
    def per_100k(self) -> float:
        return self.duplicates * 100_000 / self.total


def _serve(bootstrap: str, spool_dir: str):
    return serve.spawn(["--listen", "127.0.0.1:0", "--bootstrap-servers", bootstrap,
                        "--set", f"spool.dir={spool_dir}"], stderr=subprocess.DEVNULL)


RUN = "app-crash-0001"
_token: list[tuple[str, str]] = []  # the run's job token metadata, once registered


def _register(stub, topic: str) -> None:
    # after a restart the sidecar has forgotten the run: the executors' token is adopted
    reg = stub.RegisterJob(pb.RegisterJobRequest(job="crash", run_id=RUN, properties={
        "errors.tolerance": "all", "errors.deadletterqueue.topic.name": topic}), timeout=20,
        metadata=_token or None)
    _token[:] = [("spillway-job-token", reg.job_token)]


def _batch(start: int, end: int):
    return [pb.FailedRecord(
        record_id=f"id-{i}", stage=pb.STAGE_TRANSFORMATION, function_name="app.f",
        key=f"id-{i}".encode(), value=b"x" * 200,
        exception=pb.ExceptionInfo(class_name="builtins.ValueError",
                                   class_chain=["builtins.ValueError"]))
        for i in range(start, end)]


def run(bootstrap: str, topic: str, spool_dir: str, *, total: int, kills: int,
        clients: int = 8) -> CrashRun:
    """Report `total` records in batches of 500 from `clients` concurrent callers (executors),
    kill -9 the sidecar after every total/(kills+1) acknowledged ones and restart it over the
    same spool; batches not acknowledged are reported again after the restart. Returns what
    the DLQ topic holds."""
    from support.kafka import create_topic, read_all

    create_topic(bootstrap, topic)
    acked: set[str] = set()
    todo = list(range(0, total, BATCH))[::-1]   # batch starts, popped from the end
    lock = threading.Lock()
    killed_at: list[int] = []
    proc, address = _serve(bootstrap, spool_dir)
    try:
        for attempt in range(kills + 1):
            last = attempt == kills
            target = total if last else (attempt + 1) * total // (kills + 1)
            stop = threading.Event()

            def burst(stub, n, attempt=attempt, stop=stop):
                task = pb.TaskIdentity(stage_id=1, partition_id=n, attempt_number=attempt,
                                       task_attempt_id=attempt * 1000 + n)
                while not stop.is_set():
                    with lock:
                        if not todo:
                            return
                        start = todo.pop()
                    try:
                        out = stub.ReportFailures(pb.ReportFailuresRequest(
                            job="crash", run_id=RUN, task=task,
                            records=_batch(start, min(total, start + BATCH))), timeout=30,
                            metadata=_token)
                    except grpc.RpcError:  # the sidecar died under us: not acknowledged
                        with lock:
                            todo.append(start)
                        return
                    with lock:
                        acked.update(v.record_id for v in out.verdicts if v.dead_lettered)

            with grpc.insecure_channel(address) as ch:
                stub = pb_grpc.ErrorSidecarStub(ch)
                _register(stub, topic)
                threads = [threading.Thread(target=burst, args=(stub, n))
                           for n in range(clients)]
                for t in threads:
                    t.start()
                if last:
                    for t in threads:
                        t.join(600)
                    deadline = time.monotonic() + 120
                    while time.monotonic() < deadline:  # recovered records drain too
                        status = stub.GetStatus(pb.GetStatusRequest(), timeout=5)
                        if status.counters["spool-depth"] == 0:
                            break
                        time.sleep(0.5)
                    break
                deadline = time.monotonic() + 120
                while (len(acked) < target and any(t.is_alive() for t in threads)
                       and time.monotonic() < deadline):
                    time.sleep(0.002)
                os.kill(proc.pid, signal.SIGKILL)  # mid-burst: reports in flight, drain busy
                proc.wait(10)
                stop.set()
                for t in threads:
                    t.join(30)
            killed_at.append(len(acked))
            proc, address = _serve(bootstrap, spool_dir)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)
    counts = Counter(m.key().decode() for m in read_all(bootstrap, topic, idle_s=3,
                                                         timeout_s=300))
    lost = len(acked - set(counts))
    return CrashRun(total=total, kills=kills, killed_at=killed_at, lost=lost,
                    duplicates=sum(n - 1 for n in counts.values()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--total", type=int, default=100_000)
    ap.add_argument("--kills", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--clients", type=int, default=8)
    args = ap.parse_args()
    import tempfile
    import uuid

    from spillway.sidecar.runtime.embedded import EmbeddedBroker

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    broker = EmbeddedBroker().start()
    try:
        runs = []
        for r in range(args.rounds):
            with tempfile.TemporaryDirectory() as tmp:
                run_ = run(broker.bootstrap_servers, f"dlq.crash-{uuid.uuid4().hex[:8]}",
                           os.path.join(tmp, "spool"), total=args.total, kills=args.kills,
                           clients=args.clients)
            runs.append(run_)
            print(f"round {r + 1}: {run_.total} records, {run_.kills} kills at "
                  f"{run_.killed_at}: lost {run_.lost}, duplicates {run_.duplicates} "
                  f"({run_.per_100k:.0f} per 100k)", flush=True)
        dups = sum(x.duplicates for x in runs)
        recs = sum(x.total for x in runs)
        kills = sum(x.kills for x in runs)
        print(f"total: {dups} duplicates in {recs} records over {kills} kills: "
              f"{dups * 100_000 / recs:.0f} per 100k records, {dups / kills:.0f} per kill")
    finally:
        broker.stop()


if __name__ == "__main__":
    main()
