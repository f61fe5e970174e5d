"""A Prometheus scrape of a sidecar that has served 10,000 failing jobs (docs/OBSERVABILITY.md).

    .venv/bin/python -m bench.scrape [--jobs 10000] [--scrapes 5]

An in-process sidecar (no Kafka, default properties: no task label), N jobs registered over
gRPC, each reporting failures from two partitions of one stage (one of the jobs' tolerance
exceeded: `none`), then timed scrapes of /metrics over HTTP. Prints the median and range.
"""

from __future__ import annotations

import argparse
import statistics
import time
import urllib.request

import grpc
from spillway.sidecar.runtime.embedded import free_port
from spillway.sidecar.server import start_server
from spillway.v1 import sidecar_pb2 as pb
from spillway.v1 import sidecar_pb2_grpc as pb_grpc


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.scrape", description=__doc__.split("\n")[0])
    ap.add_argument("--jobs", type=int, default=10_000)
    ap.add_argument("--scrapes", type=int, default=5)
    args = ap.parse_args(argv)
    port = free_port()
    running = start_server({"listen.address": "127.0.0.1:0",
                            "metrics.prometheus.port": str(port),
                            "jobs.max.live": str(max(1000, args.jobs))})
    try:
        with grpc.insecure_channel(running.address) as ch:
            stub = pb_grpc.ErrorSidecarStub(ch)
            exc = pb.ExceptionInfo(class_name="builtins.ValueError",
                                   class_chain=["builtins.ValueError"], message="bad")
            t0 = time.perf_counter()
            for i in range(args.jobs):
                job = f"scrape-job-{i:05d}"
                tolerance = "none" if i % 2 else "all"
                reg = stub.RegisterJob(pb.RegisterJobRequest(
                    job=job, run_id="local-1", properties={"errors.tolerance": tolerance,
                                                           "errors.log.enable": "false"}),
                    timeout=10)
                md = [("spillway-job-token", reg.job_token)]
                for p in range(2):
                    task = pb.TaskIdentity(stage_id=1, partition_id=p, task_attempt_id=p)
                    stub.ReportFailures(pb.ReportFailuresRequest(
                        job=job, run_id="local-1", task=task, records=[pb.FailedRecord(
                            record_id=f"r{p}", stage=pb.STAGE_TRANSFORMATION, exception=exc)]),
                        timeout=10, metadata=md)
            print(f"{args.jobs:,} jobs registered and failing in {time.perf_counter() - t0:.1f} s")
        times, cpu, size = [], [], 0
        for _ in range(args.scrapes):
            t0, c0 = time.perf_counter(), time.process_time()
            body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=60).read()
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)  # this process: the sidecar and the scraper
            size = len(body)
        lines = body.count(b"\n")
        print(f"scrape: {lines:,} lines, {size / 1e6:.1f} MB; median "
              f"{statistics.median(times) * 1000:.0f} ms (range {min(times) * 1000:.0f}-"
              f"{max(times) * 1000:.0f} ms over {len(times)} scrapes); CPU per scrape (sidecar "
              f"and scraper) median {statistics.median(cpu) * 1000:.0f} ms")
    finally:
        running.stop(1.0)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
