"""Provisional verdicts between `spillway serve` processes (docs/POLICY.md, "Provisional
verdicts"): a node answers its executors while the run's home is frozen (SIGSTOP), holds the
DLQ records in its spool, and after kill -9 and a restart confirms them with the home once the
run registers again: each record reaches the DLQ topic once and is counted once."""

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
from support.records import value_errors

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

TASK = pb.TaskIdentity(stage_id=1, partition_id=0, task_attempt_id=1)


def _spawn(broker, spool, name):
    return serve.spawn(["--listen", "127.0.0.1:0", "--bootstrap-servers",
                        broker.bootstrap_servers, "--set", f"spool.dir={spool}",
                        "--set", "producer.linger.ms=5", "--set", f"sidecar.id={name}",
                        "--set", "home.allowed.addresses=127.0.0.0/8"],
                       stderr=subprocess.DEVNULL)


def test_a_node_answers_while_its_home_is_frozen_and_a_kill_loses_nothing(broker, tmp_path):
    topic = f"dlq.prov-e2e-{uuid.uuid4().hex[:8]}"
    props = {"errors.tolerance": "all", "errors.deadletterqueue.topic.name": topic,
             "errors.deadletterqueue.auto.create.topics.enable": "true",
             "errors.deadletterqueue.topic.replication.factor": "1"}
    ids = [f"p{i:03d}" for i in range(120)]
    home, home_addr = _spawn(broker, tmp_path / "home", "prov-home")
    try:
        with SidecarClient(home_addr) as hc:
            reg = hc.register_job("prov-e2e", props)
        run = reg.run()
        node, node_addr = _spawn(broker, tmp_path / "node", "prov-node")
        try:
            with SidecarClient(node_addr, timeout_s=10) as nc:
                nc.register_job(run, props, home=reg.home,
                                home_instance_id=reg.home_instance_id)
                os.kill(home.pid, signal.SIGSTOP)   # the home answers nothing from here
                try:
                    started = time.monotonic()
                    verdicts = nc.report_failures(run, TASK, value_errors(*ids))
                    answered_in = time.monotonic() - started
                finally:
                    os.kill(node.pid, signal.SIGKILL)
                    node.wait()
                    os.kill(home.pid, signal.SIGCONT)
            # answered without the home, before any record was confirmed
            assert [v.action for v in verdicts] == [pb.ACTION_SKIP] * len(ids)
            assert all(v.dead_lettered for v in verdicts) and answered_in < 10
            assert read_all(broker.bootstrap_servers, topic, idle_s=0.5, timeout_s=5) == []

            node, node_addr = _spawn(broker, tmp_path / "node", "prov-node")
            with SidecarClient(node_addr, timeout_s=30) as nc:
                # the executor registers again (as it does on NOT_FOUND): the held rows are
                # confirmed with the home, then produced
                nc.register_job(run, props, home=reg.home,
                                home_instance_id=reg.home_instance_id)
                got: list[str] = []
                deadline = time.monotonic() + 60
                while len(got) < len(ids) and time.monotonic() < deadline:
                    got = [dict(m.headers())["spillway.record.id"].decode()
                           for m in read_all(broker.bootstrap_servers, topic, idle_s=0.5)]
                assert sorted(got) == ids            # each once
                # a re-report after all that: already in the DLQ, not written again
                again = nc.report_failures(run, pb.TaskIdentity(stage_id=1, partition_id=0,
                                                                task_attempt_id=2),
                                           value_errors(*ids[:5]))
                assert all(v.action == pb.ACTION_SKIP for v in again)
                nc.flush_task(run, pb.TaskIdentity(stage_id=1, partition_id=0,
                                                   task_attempt_id=2), timeout_s=30)
            with SidecarClient(home_addr) as hc:
                summary = hc.job_summary(run)
                assert summary.total_record_errors == len(ids)   # counted once
                hc.end_job(run)
            got = [dict(m.headers())["spillway.record.id"].decode()
                   for m in read_all(broker.bootstrap_servers, topic, idle_s=0.5)]
            assert sorted(got) == ids
        finally:
            if node.poll() is None:
                serve.stop(node)
    finally:
        if home.poll() is None:
            os.kill(home.pid, signal.SIGCONT)
            serve.stop(home)


def test_a_limit_answered_under_budget_slices_stays_exact_across_a_home_killed(broker,
                                                                             tmp_path):
    """errors.tolerance.max.errors=50: a node answers within a slice of the budget, its home is
    killed with kill -9 and restarted on its spool (same address), the run registers again; 70
    distinct errors in all give a failed run and exactly 50 records in the topic, once each."""
    limit = 50
    topic = f"dlq.slice-e2e-{uuid.uuid4().hex[:8]}"
    props = {"errors.tolerance": "all", "errors.tolerance.max.errors": str(limit),
             "errors.deadletterqueue.topic.name": topic,
             "errors.deadletterqueue.auto.create.topics.enable": "true",
             "errors.deadletterqueue.topic.replication.factor": "1"}
    home, home_addr = _spawn(broker, tmp_path / "home", "slice-home")
    node, node_addr = _spawn(broker, tmp_path / "node", "slice-node")
    try:
        with SidecarClient(home_addr) as hc:
            reg = hc.register_job("slice-e2e", props)
        run = reg.run()
        failed_flushes = 0

        def task(k):
            return pb.TaskIdentity(stage_id=1, partition_id=k, task_attempt_id=100 + k)

        def report_and_flush(nc, k):
            nonlocal failed_flushes
            verdicts = nc.report_failures(run, task(k), value_errors(
                *[f"s{k:02d}-{i}" for i in range(10)]))
            try:
                nc.flush_task(run, task(k), timeout_s=30)
            except Exception as exc:  # noqa: BLE001 - a record the home found past the limit
                assert "answered record" in str(exc), exc
                failed_flushes += 1
            return verdicts

        with SidecarClient(node_addr, timeout_s=30) as nc:
            nc.register_job(run, props, home=reg.home, home_instance_id=reg.home_instance_id)
            for k in range(3):   # 30 errors: the first waits and is granted a slice
                report_and_flush(nc, k)
            held = nc.status(page_size=1).counters
            assert held["budget-slices-granted"] >= 1 and held["slice-records-answered"] >= 10
            os.kill(home.pid, signal.SIGKILL)
            home.wait()
            home, _ = _spawn_at(broker, tmp_path / "home", "slice-home", home_addr)
            with SidecarClient(home_addr) as hc:
                again = hc.register_job(run, props)   # as an executor does on NOT_FOUND
            nc.register_job(run, props, home=again.home,
                            home_instance_id=again.home_instance_id)
            answers = [report_and_flush(nc, k) for k in range(3, 7)]   # 40 more
        got = [dict(m.headers())["spillway.record.id"].decode()
               for m in read_all(broker.bootstrap_servers, topic, idle_s=0.5)]
        assert len(got) == len(set(got)) == limit
        with SidecarClient(home_addr) as hc:
            summary = hc.job_summary(run)
        assert summary.failed and f"max.errors={limit}" in summary.failure_reason
        fails = sum(v.action == pb.ACTION_FAIL for a in answers for v in a)
        assert fails + failed_flushes >= 1
    finally:
        for p in (node, home):
            if p.poll() is None:
                serve.stop(p)


def _spawn_at(broker, spool, name, address):
    return serve.spawn(["--listen", address, "--bootstrap-servers",
                        broker.bootstrap_servers, "--set", f"spool.dir={spool}",
                        "--set", "producer.linger.ms=5", "--set", f"sidecar.id={name}",
                        "--set", "home.allowed.addresses=127.0.0.0/8"],
                       stderr=subprocess.DEVNULL)
