"""Several sidecar processes behind one address (``sidecar.processes=2``, `spillway serve` as its
own process): connections spread over both, a run keeps one home whose limit and
one-dead-letter-per-record rule hold across them, a process killed with SIGKILL is started again
and resumes, clients follow their run's process, and the supervisor's end ends them all."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid

import grpc
import pytest
from spillway.client import SidecarClient, _pins
from spillway.client.runs import JobRun, JobToken
from spillway.v1 import sidecar_pb2 as pb
from spillway.v1 import sidecar_pb2_grpc as pb_grpc
from support import serve
from support.records import value_errors
from support.kafka import read_all

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

TASK = pb.TaskIdentity(stage_id=1, partition_id=0, task_attempt_id=1)


_records = value_errors


def _children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid and fields[0] != "Z":
                out.append(int(entry))
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _fresh_stub(address: str) -> tuple[grpc.Channel, pb_grpc.ErrorSidecarStub]:
    """A stub on a connection of its own (a channel would otherwise share one)."""
    ch = grpc.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])
    return ch, pb_grpc.ErrorSidecarStub(ch)


def _instance(stub) -> tuple[str, str]:
    st = stub.GetStatus(pb.GetStatusRequest(), timeout=10)
    return st.instance_id, st.advertised_address


def _stub_on(address: str, want_instance: str, *, other: bool = False):
    """A fresh connection to `address` that landed on (or, with `other`, off) an instance."""
    for _ in range(200):
        ch, stub = _fresh_stub(address)
        inst, _ = _instance(stub)
        if (inst == want_instance) != other:
            return ch, stub
        ch.close()
    raise AssertionError("the kernel never spread a connection there")


def _wait_serving(address: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        ch, stub = _fresh_stub(address)
        try:
            _instance(stub)
            return
        except grpc.RpcError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
        finally:
            ch.close()


@pytest.fixture(scope="module")
def node(broker, tmp_path_factory):
    spool = tmp_path_factory.mktemp("processes")
    err = open(spool / "stderr.log", "w")
    proc, address = serve.spawn(
        ["--listen", "127.0.0.1:0", "--bootstrap-servers", broker.bootstrap_servers,
         "--set", f"spool.dir={spool}", "--set", "producer.linger.ms=5",
         "--set", "sidecar.processes=2", "--set", "sidecar.id=node"],
        stderr=err)
    yield proc, address, spool
    serve.stop(proc, 30)
    err.close()


def test_connections_spread_over_both_processes_each_at_its_own_port(node):
    proc, address, spool = node
    seen = {}
    for _ in range(40):
        ch, stub = _fresh_stub(address)
        inst, advertised = _instance(stub)
        seen[inst] = advertised
        ch.close()
    assert len(seen) == 2, seen
    ports = sorted(int(a.rpartition(":")[2]) for a in seen.values())
    assert str(address.rpartition(":")[2]) not in {str(p) for p in ports}
    for inst, advertised in seen.items():  # its own port reaches that process only
        ch, stub = _fresh_stub(advertised)
        assert _instance(stub) == (inst, advertised)
        ch.close()
    assert sorted(os.listdir(spool)) == ["process-0", "process-1", "stderr.log"]
    assert len(_children(proc.pid)) == 2


def test_one_run_over_both_processes_keeps_its_limit_and_one_dead_letter_per_record(broker,
                                                                                    node):
    _, address, _ = node
    topic = f"dlq.processes-{uuid.uuid4().hex[:8]}"
    props = {"errors.tolerance": "all", "errors.tolerance.max.errors": "5",
             "errors.deadletterqueue.topic.name": topic,
             "errors.deadletterqueue.auto.create.topics.enable": "true",
             "errors.deadletterqueue.topic.replication.factor": "1"}
    driver = SidecarClient(address)
    run = driver.register_job("two-processes", props)
    assert run.home.endswith(f":{_pins.lookup(address, run.job, run.run_id).rpartition(':')[2]}")
    home_ch, at_home = _stub_on(address, run.home_instance_id)
    node_ch, at_node = _stub_on(address, run.home_instance_id, other=True)
    token = [("spillway-job-token", run.job_token.reveal())]
    reg = at_node.RegisterJob(pb.RegisterJobRequest(
        job=run.job, run_id=run.run_id, properties=props, home=run.home,
        home_instance_id=run.home_instance_id), metadata=token, timeout=10)
    assert reg.home == run.home and reg.process_port != 0
    assert reg.process_port != int(run.home.rpartition(":")[2])

    def report(stub, *ids):
        return list(stub.ReportFailures(pb.ReportFailuresRequest(
            job=run.job, run_id=run.run_id, task=TASK, records=_records(*ids)),
            metadata=token, timeout=30).verdicts)

    assert [v.action for v in report(at_node, "r0", "r1")] == [pb.ACTION_SKIP] * 2
    assert [v.action for v in report(at_home, "r2", "r3")] == [pb.ACTION_SKIP] * 2
    (v,) = report(at_home, "r1")  # dead-lettered by the other process already
    assert v.action == pb.ACTION_SKIP and "already in the DLQ" in v.reason
    (v,) = report(at_node, "r4")  # the 5th error: within the limit
    assert v.action == pb.ACTION_SKIP and v.dead_lettered
    (v,) = report(at_home, "r5")  # the 6th: over it, whichever process it reaches
    assert v.action == pb.ACTION_FAIL and v.job_failed
    assert "errors.tolerance.max.errors=5" in v.reason
    for stub in (at_node, at_home):
        stub.FlushTask(pb.FlushTaskRequest(job=run.job, run_id=run.run_id, task=TASK),
                       metadata=token, timeout=30)
    driver.close()  # a new connection may land on either process: the pin finds the home
    answer = driver.end_job(run, timeout_s=30)
    assert answer.summaries[0].total_record_errors == 6
    assert not answer.unreachable
    values = sorted(m.value() for m in read_all(broker.bootstrap_servers, topic))
    assert values == [b"value of r%d" % i for i in range(5)]
    home_ch.close()
    node_ch.close()


def test_a_run_has_one_home_whichever_process_its_registrations_reach(node):
    _, address, _ = node
    seen = {}
    while len(seen) < 2:  # a connection on each process
        ch, stub = _fresh_stub(address)
        inst, advertised = _instance(stub)
        if inst in seen:
            ch.close()
        else:
            seen[inst] = (ch, stub, advertised)
    (ch_a, a, addr_a), (ch_b, b, addr_b) = seen.values()
    for i in range(8):
        first, second = (a, b) if i % 2 else (b, a)
        reg = first.RegisterJob(pb.RegisterJobRequest(job=f"one-home-{i}", run_id=f"r{i}"),
                                timeout=10)
        token = [("spillway-job-token", reg.job_token)]
        again = second.RegisterJob(pb.RegisterJobRequest(job=f"one-home-{i}", run_id=f"r{i}"),
                                   metadata=token, timeout=10)
        assert (again.home, again.home_instance_id) == (reg.home, reg.home_instance_id)
        assert reg.process_port == again.process_port == int(reg.home.rpartition(":")[2])
        # no token: refused by the home, wherever the call lands
        with pytest.raises(grpc.RpcError) as refused:
            second.RegisterJob(pb.RegisterJobRequest(job=f"one-home-{i}", run_id=f"r{i}"),
                               timeout=10)
        assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
        # the process that forwarded it recorded nothing
        other = addr_b if reg.home == addr_a else addr_a
        hch, hstub = _fresh_stub(reg.home)
        assert len(hstub.GetStatus(pb.GetStatusRequest(job=f"one-home-{i}"), metadata=token,
                                   timeout=10).jobs) == 1
        hch.close()
        och, ostub = _fresh_stub(other)
        assert not ostub.GetStatus(pb.GetStatusRequest(job=f"one-home-{i}"), metadata=token,
                                   timeout=10).jobs
        och.close()
        SidecarClient(reg.home).end_job(
            JobRun(f"one-home-{i}", f"r{i}", JobToken(reg.job_token)), timeout_s=10)
    ch_a.close()
    ch_b.close()


def test_a_drivers_summary_and_end_reach_the_home_from_the_other_process(node):
    _, address, _ = node
    driver = SidecarClient(address)
    run = driver.register_job("elsewhere", {})
    ch, other = _stub_on(address, run.home_instance_id, other=True)
    token = [("spillway-job-token", run.job_token.reveal())]
    req = pb.GetJobSummaryRequest(job=run.job, run_id=run.run_id)
    assert other.GetJobSummary(req, metadata=token, timeout=10).job == run.job
    for md, code in (([("spillway-job-token", "not-the-token")],
                      grpc.StatusCode.PERMISSION_DENIED),
                     (None, grpc.StatusCode.NOT_FOUND)):
        with pytest.raises(grpc.RpcError) as refused:
            other.GetJobSummary(req, metadata=md, timeout=10)
        assert refused.value.code() == code
        with pytest.raises(grpc.RpcError) as refused:
            other.EndJob(pb.EndJobRequest(job=run.job, run_id=run.run_id), metadata=md,
                         timeout=10)
        assert refused.value.code() == code
    assert f"would be homed at process {run.home}" in refused.value.details()
    assert driver.job_summary(run).job == run.job  # refused calls ended nothing
    answer = other.EndJob(pb.EndJobRequest(job=run.job, run_id=run.run_id), metadata=token,
                          timeout=10)
    assert answer.summaries[0].job == run.job
    with pytest.raises(grpc.RpcError) as gone:
        other.GetJobSummary(req, metadata=token, timeout=10)
    assert gone.value.code() == grpc.StatusCode.NOT_FOUND
    ch.close()


def test_the_driver_reaches_the_runs_home_whatever_connection_it_gets(node):
    _, address, _ = node
    for i in range(6):  # unpinned, each would miss the home with one chance in two
        driver = SidecarClient(address)
        run = driver.register_job(f"pinned-{i}", {})
        driver.close()
        assert driver.job_summary(run).job == run.job
        driver.end_job(run, timeout_s=10)
        assert _pins.lookup(address, run.job, run.run_id) == address  # forgotten once ended


def test_a_process_killed_is_started_again_on_its_port_and_resumes_its_runs(node):
    proc, address, _ = node
    driver = SidecarClient(address)
    run = driver.register_job("survives", {"errors.tolerance": "all",
                                           "errors.tolerance.max.errors": "3"})
    driver.report_failures(run, TASK, _records("a", "b"))
    home_port = int(run.home.rpartition(":")[2])
    victims = [pid for pid in _children(proc.pid)
               if f'"port": {home_port},' in open(f"/proc/{pid}/cmdline").read()]
    assert len(victims) == 1, victims
    os.kill(victims[0], signal.SIGKILL)
    time.sleep(0.5)
    _wait_serving(run.home)
    assert proc.poll() is None
    assert len(_children(proc.pid)) == 2
    # registered again (as spillway.spark does on NOT_FOUND): at its process, which resumes it
    run = driver.register_job(run, {"errors.tolerance": "all",
                                    "errors.tolerance.max.errors": "3"})
    assert int(run.home.rpartition(":")[2]) == home_port
    summary = driver.job_summary(run)
    assert summary.total_record_errors == 2 and not summary.failed
    (v,) = driver.report_failures(run, TASK, _records("c"))
    assert v.action == pb.ACTION_SKIP
    (v,) = driver.report_failures(run, TASK, _records("d"))
    assert v.action == pb.ACTION_FAIL and "errors.tolerance.max.errors=3" in v.reason
    driver.end_job(run, timeout_s=10)


def _serve(args, tmp_path):
    return subprocess.run(
        [sys.executable, "-m", "spillway.sidecar.cli", "serve", "--listen", "127.0.0.1:0",
         "--set", f"spool.dir={tmp_path}", "--set", "sidecar.processes=2", *args],
        capture_output=True, text=True, timeout=60)


def test_what_processes_cannot_share_is_refused_naming_it(tmp_path):
    done = _serve(["--unix-socket", str(tmp_path / "s.sock")], tmp_path)
    assert done.returncode == 2
    assert "listen.unix.socket" in done.stderr and "several processes" in done.stderr
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        port = taken.getsockname()[1]
        done = _serve(["--set", f"sidecar.processes.port.base={port}"], tmp_path)
    assert done.returncode == 2
    assert "sidecar.processes.port.base" in done.stderr and f"127.0.0.1:{port}" in done.stderr
    done = _serve(["--set", "sidecar.processes=65"], tmp_path)
    assert done.returncode == 2 and "sidecar.processes" in done.stderr


def test_the_supervisors_end_ends_every_process(tmp_path):
    for sig in (signal.SIGTERM, signal.SIGKILL):
        proc, address = serve.spawn(["--listen", "127.0.0.1:0", "--set",
                                     f"spool.dir={tmp_path / sig.name}",
                                     "--set", "sidecar.processes=2"],
                                    stderr=subprocess.DEVNULL)
        kids = _children(proc.pid)
        assert len(kids) == 2
        os.kill(proc.pid, sig)
        assert proc.wait(30) == (0 if sig is signal.SIGTERM else -signal.SIGKILL)
        deadline = time.monotonic() + 20
        while any(_alive(k) for k in kids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(_alive(k) for k in kids), sig


def test_a_restart_with_another_process_count_keeps_what_the_old_spools_hold(broker, tmp_path):
    """Records spooled by two processes and not yet written (a long linger, then SIGKILL) would
    sit in spool.dir/process-i where a single process never looks: that start is refused,
    naming them, and a start with two processes again writes every one of them."""
    topic = f"dlq.strand-{uuid.uuid4().hex[:8]}"
    props = {"errors.tolerance": "all", "errors.deadletterqueue.topic.name": topic,
             "errors.deadletterqueue.auto.create.topics.enable": "true",
             "errors.deadletterqueue.topic.replication.factor": "1"}

    def start(processes: int, linger_ms: int):
        return serve.spawn(["--listen", "127.0.0.1:0", "--bootstrap-servers",
                            broker.bootstrap_servers, "--set", f"spool.dir={tmp_path}",
                            "--set", f"producer.linger.ms={linger_ms}",
                            "--set", f"sidecar.processes={processes}"],
                           stderr=subprocess.DEVNULL)

    proc, address = start(2, 600_000)
    ids = []
    for n in range(6):   # fresh connections land on either process
        ch, stub = _fresh_stub(address)
        reg = stub.RegisterJob(pb.RegisterJobRequest(job=f"strand{n}", run_id="r",
                                                     properties=props), timeout=30)
        ch.close()
        ch, stub = _fresh_stub(f"127.0.0.1:{reg.process_port}")
        batch = [f"s{n}-{i}" for i in range(3)]
        verdicts = stub.ReportFailures(pb.ReportFailuresRequest(
            job=f"strand{n}", run_id="r", task=TASK, records=_records(*batch)),
            metadata=[("spillway-job-token", reg.job_token)], timeout=30).verdicts
        assert all(v.dead_lettered for v in verdicts)
        ids += batch
        ch.close()
    for kid in _children(proc.pid):
        os.kill(kid, signal.SIGKILL)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(30)
    used = sorted(d for d in os.listdir(tmp_path) if d.startswith("process-"))
    assert used == ["process-0", "process-1"]

    done = subprocess.run(
        [sys.executable, "-m", "spillway.sidecar.cli", "serve", "--listen", "127.0.0.1:0",
         "--bootstrap-servers", broker.bootstrap_servers, "--set", f"spool.dir={tmp_path}"],
        capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert "DLQ record(s) not yet written to Kafka" in done.stderr
    assert "only a start with sidecar.processes=2 or more" in done.stderr
    assert not read_all(broker.bootstrap_servers, topic, idle_s=0.5)

    proc, _ = start(2, 5)
    try:
        deadline = time.monotonic() + 60
        got = []
        while len(got) < len(ids) and time.monotonic() < deadline:
            got = read_all(broker.bootstrap_servers, topic, idle_s=0.5)
        assert sorted(m.value() for m in got) == sorted(b"value of " + i.encode()
                                                        for i in ids)
    finally:
        serve.stop(proc, 30)
