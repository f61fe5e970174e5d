"""Two real sidecars by hand (a run's home and its nodes), for the provisional-verdict and
budget-slice tests: start them, register a run, report, flush."""

from __future__ import annotations

import threading
import time
import uuid

from spillway.v1 import sidecar_pb2 as pb
from support.records import json_error
from support.rpc import md, stub  # part of this module's vocabulary for its tests


def start(broker, spool, sid):
    from spillway.sidecar.server import start_server

    return start_server({
        "listen.address": "127.0.0.1:0", "bootstrap.servers": broker.bootstrap_servers,
        "spool.dir": str(spool), "producer.linger.ms": "5", "sidecar.id": sid,
        "home.allowed.addresses": "127.0.0.0/8"})


def record(rid, value=b"{bad", exc=None):
    return pb.FailedRecord(record_id=rid, stage=pb.STAGE_TRANSFORMATION,
                           function_name="app.parse", key=rid.encode(), value=value,
                           exception=exc or json_error())


def task(n):
    return pb.TaskIdentity(stage_id=1, partition_id=n, task_attempt_id=100 + n)


def register(home, nodes, props):
    """A run homed at `home`, registered on each of `nodes` too: (job, token, topic)."""
    job = f"prov-{uuid.uuid4().hex[:8]}"
    topic = f"dlq.{job}"
    props = {"errors.tolerance": "all", "errors.deadletterqueue.topic.name": topic,
             "errors.deadletterqueue.auto.create.topics.enable": "true",
             "errors.deadletterqueue.topic.replication.factor": "1", **props}
    reg = stub(home).RegisterJob(pb.RegisterJobRequest(job=job, run_id="r", properties=props),
                                  timeout=20)
    for n in nodes:
        stub(n).RegisterJob(pb.RegisterJobRequest(
            job=job, run_id="r", properties=props, home=reg.home,
            home_instance_id=reg.home_instance_id), timeout=20, metadata=md(reg.job_token))
    return job, reg.job_token, topic, props


def report(s, job, token, task, records):
    return stub(s).ReportFailures(pb.ReportFailuresRequest(
        job=job, run_id="r", task=task, records=records), timeout=30, metadata=md(token))


def flush(s, job, token, task, timeout=30):
    return stub(s).FlushTask(pb.FlushTaskRequest(job=job, run_id="r", task=task),
                              timeout=timeout, metadata=md(token)).dlq_records_acknowledged


def summary(home, job, token):
    return stub(home).GetJobSummary(pb.GetJobSummaryRequest(job=job, run_id="r"), timeout=10,
                                     metadata=md(token))


def register_again(home, node, job, token, props):
    """After a node's restart: the run registered again at its home and at the node (as an
    executor does on NOT_FOUND); returns once the node holds nothing (or 20 s passed)."""
    reg = stub(home).RegisterJob(pb.RegisterJobRequest(job=job, run_id="r", properties=props),
                                  timeout=10, metadata=md(token))
    stub(node).RegisterJob(pb.RegisterJobRequest(
        job=job, run_id="r", properties=props, home=reg.home,
        home_instance_id=reg.home_instance_id), timeout=20, metadata=md(token))
    until_nothing_held(node)


def until_nothing_held(node, timeout_s=20.0):
    deadline = time.monotonic() + timeout_s
    while node.sidecar.pipeline.store.held_count() and time.monotonic() < deadline:
        time.sleep(0.05)


class Gate:
    """Holds a node's confirmation calls for one run until opened (the home still answers
    everything else)."""

    def __init__(self, node, job):
        self.open = threading.Event()
        self.calls = 0
        run = node.sidecar.registry.get(job, "r")
        real = run.home.confirm

        def confirm(*a, **kw):
            self.calls += 1
            self.open.wait(30)
            return real(*a, **kw)
        run.home.confirm = confirm
