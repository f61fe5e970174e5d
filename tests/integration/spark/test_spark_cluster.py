"""One sidecar per node on a real Spark standalone cluster started from the pyspark wheel's own
scripts: one master, two workers, each worker with its own sidecar in its environment.

Secured as docs/SECURITY.md describes: every sidecar serves mutual TLS and requires the node
token; executors and the driver reach their node's sidecar with a client certificate and the
token (SPILLWAY_TLS_* / SPILLWAY_TOKEN_FILE in the worker's environment); node sidecars forward
to the job's home over mutual TLS, recognised as peers by their certificates."""

from __future__ import annotations

import dataclasses
import json
import os
import queue
import subprocess
import sys
import textwrap
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from support.ports import free_port
from support.kafka import read_all
from support.tls import Ca, write_token

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _spark_class() -> str:
    import pyspark

    return str(Path(pyspark.__file__).parent / "bin" / "spark-class")


def _alive_workers(webui: int) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{webui}/json/", timeout=2) as r:
            return sum(w["state"] == "ALIVE" for w in json.load(r)["workers"])
    except (OSError, ValueError):   # not up yet: a starting master may answer an empty page
        return 0


def _pki(tmp: Path, names) -> tuple[dict[str, dict[str, str]], dict[str, str]]:
    """Test certificates (cryptography): each sidecar's security properties, and the Spark
    side's environment (the executors' client certificate and the node token)."""
    ca = Ca.create(tmp / "ca")
    token = write_token(tmp / "node.token", "cluster-node-token")
    client = ca.issue(tmp / "executor", "spark-executor", dns=("spark-executor",), ips=())
    sidecars = {}
    for n in names:  # each names localhost/127.0.0.1 (dialled) and the shared peer name
        leaf = ca.issue(tmp / n, n, dns=("localhost", "spillway-sidecar"))
        sidecars[n] = {"tls.cert.file": str(leaf.cert), "tls.key.file": str(leaf.key),
                       "tls.ca.file": str(ca.path), "auth.token.file": str(token),
                       "auth.peer.identities": "spillway-sidecar"}
    spark_env = {"SPILLWAY_TLS_CA_FILE": str(ca.path), "SPILLWAY_TLS_CERT_FILE": str(client.cert),
                 "SPILLWAY_TLS_KEY_FILE": str(client.key), "SPILLWAY_TOKEN_FILE": str(token)}
    return sidecars, spark_env


@pytest.fixture(scope="module")
def cluster(broker, tmp_path_factory):
    """Two sidecars ("node-a", "node-b"), a master and two single-core workers; mutual TLS and
    node tokens everywhere."""
    from spillway.sidecar.server import start_server

    tmp = tmp_path_factory.mktemp("cluster")
    names = ("node-a", "node-b")
    secure, spark_env = _pki(tmp, names)
    sidecars = {n: start_server({
        "listen.address": "127.0.0.1:0", "bootstrap.servers": broker.bootstrap_servers,
        "spool.dir": str(tmp / f"spool-{n}"), "producer.linger.ms": "5", "sidecar.id": n,
        # homes are dialled only when allow-listed (the other node's sidecar is on loopback)
        "home.allowed.addresses": "127.0.0.0/8",
        **secure[n]}) for n in names}
    port, webui = free_port(), free_port()
    # executors inherit the worker's environment: TLS and token
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable, "SPARK_NO_DAEMONIZE": "1",
           "SPARK_LOCAL_IP": "127.0.0.1", **spark_env}
    procs = [subprocess.Popen(
        [_spark_class(), "org.apache.spark.deploy.master.Master", "--host", "127.0.0.1",
         "--port", str(port), "--webui-port", str(webui)],
        stdout=open(tmp / "master.log", "wb"), stderr=subprocess.STDOUT, env=env)]
    # two loopback hosts: Spark never runs a speculative copy on the host of the original
    for host, (name, sc) in zip(("127.0.0.1", "127.0.0.2"), sidecars.items()):
        procs.append(subprocess.Popen(
            [_spark_class(), "org.apache.spark.deploy.worker.Worker",
             f"spark://127.0.0.1:{port}", "--host", host, "--cores", "1",
             "--memory", "1g", "--webui-port", str(free_port()),
             "--work-dir", str(tmp / f"work-{name}")],
            stdout=open(tmp / f"worker-{name}.log", "wb"), stderr=subprocess.STDOUT,
            env={**env, "SPILLWAY_SIDECAR_ADDRESS": sc.address,  # this node's sidecar
                 "SPARK_LOCAL_IP": host}))  # the worker and its executors on its loopback
    deadline = time.monotonic() + 90
    while _alive_workers(webui) < 2:
        if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
            for p in procs:
                p.kill()
            pytest.fail("standalone cluster did not start: " +
                        (tmp / "master.log").read_text()[-2000:])
        time.sleep(0.5)
    yield f"spark://127.0.0.1:{port}", sidecars, spark_env
    for p in procs:
        p.terminate()
    for p in procs:
        try:
            p.wait(20)
        except subprocess.TimeoutExpired:
            p.kill()
    for sc in sidecars.values():
        sc.stop(1.0)


DRIVER = textwrap.dedent("""
    import json, os, sys
    from pyspark.sql import SparkSession
    from spillway.spark import Job

    # one application for the tests that share its settings: a job per line on stdin
    spark = (SparkSession.builder.master(sys.argv[1]).appName("cluster-jobs")
             .config("spark.driver.host", "127.0.0.1")
             .config("spark.driver.bindAddress", "127.0.0.1")
             .config("spark.ui.enabled", "false").config("spark.executor.memory", "512m")
             .config("spark.executor.cores", "1").config("spark.cores.max", "2")
             .config("spark.task.maxFailures", "1").getOrCreate())

    def parse(x):
        if x % 5 == 0:  # poison: name the sidecar this executor's node gave it
            raise ValueError("bad row %d via %s" % (x, os.environ["SPILLWAY_SIDECAR_ADDRESS"]))
        return x

    for line in sys.stdin:
        home, topic, name, props = json.loads(line)
        try:
            job = Job(name, props, sidecar=home)
            job.register()
            rdd = spark.sparkContext.parallelize(range(60), 12)
            out = {"ok": True, "count": job.map_partitions(rdd, parse).count()}
        except Exception as exc:
            out = {"ok": False, "error": Job.failure_message(exc)}
        print("RESULT " + json.dumps(out), flush=True)
    spark.stop()
""")


class Driver:
    """One driver process (one Spark application, its executors and their Python workers
    started once) running the jobs of the tests that need no other Spark settings."""

    def __init__(self, tmp: Path, master: str, spark_env: dict[str, str]) -> None:
        script = tmp / "driver.py"
        script.write_text(DRIVER)
        self.log = tmp / "driver.log"
        self.proc = subprocess.Popen(
            [sys.executable, str(script), master], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=open(self.log, "wb"), text=True,
            env={**os.environ, "PYSPARK_PYTHON": sys.executable,
                 "SPARK_LOCAL_IP": "127.0.0.1", **spark_env})
        self.results: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            if line.startswith("RESULT "):
                self.results.put(line[len("RESULT "):])
        self.results.put(None)  # the driver ended

    def run(self, home, topic, name, props, timeout_s: float = 300) -> dict:
        self.proc.stdin.write(json.dumps([home, topic, name, props]) + "\n")
        self.proc.stdin.flush()
        try:
            line = self.results.get(timeout=timeout_s)
        except queue.Empty:
            line = None
        assert line is not None, self.log.read_text()[-4000:]
        return json.loads(line)

    def stop(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="module")
def driver(cluster, tmp_path_factory):
    master, _, spark_env = cluster
    d = Driver(tmp_path_factory.mktemp("driver"), master, spark_env)
    yield d
    d.stop()


def _props(topic, **extra):
    return {"errors.tolerance": "all", "errors.deadletterqueue.topic.name": topic,
            "errors.deadletterqueue.context.headers.enable": "true",
            "errors.deadletterqueue.auto.create.topics.enable": "true",
            "errors.deadletterqueue.topic.replication.factor": "1", **extra}


SPECULATIVE_DRIVER = textwrap.dedent("""
    import json, sys, time
    from pyspark import TaskContext
    from pyspark.sql import SparkSession
    from spillway.spark import Job

    master, home, topic, name, props = sys.argv[1:6]
    spark = (SparkSession.builder.master(master).appName(name)
             .config("spark.driver.host", "127.0.0.1")
             .config("spark.driver.bindAddress", "127.0.0.1")
             .config("spark.ui.enabled", "false").config("spark.executor.memory", "512m")
             .config("spark.executor.cores", "1").config("spark.cores.max", "2")
             .config("spark.task.maxFailures", "4")
             .config("spark.speculation", "true").config("spark.speculation.interval", "100ms")
             .config("spark.speculation.quantile", "0.5")
             .config("spark.speculation.multiplier", "1.5")
             .config("spark.speculation.minTaskRuntime", "500ms")
             .config("spark.speculation.efficiency.enabled", "false").getOrCreate())
    job = Job(name, json.loads(props), sidecar=home)
    job.register()

    def parse(x):
        if x % 5 == 0:
            raise ValueError("bad row %d" % x)
        return x

    def after_flush(rows):
        rows = list(rows)  # the wrapped partition ran to its end: reported and flushed
        ctx = TaskContext.get()
        if ctx.attemptNumber() == 0 and ctx.partitionId() == 0:
            raise RuntimeError("task fails after its records were dead-lettered")
        if ctx.attemptNumber() == 0 and ctx.partitionId() == 1:
            time.sleep(20)  # a straggler: Spark starts a speculative copy on the other node
        return [(ctx.partitionId(), ctx.attemptNumber(), len(rows))]

    rdd = spark.sparkContext.parallelize(range(40), 4)
    out = job.map_partitions(rdd, parse).mapPartitions(after_flush).collect()
    print("RESULT " + json.dumps({"ok": True, "parts": sorted(out)}))
    spark.stop()
""")


def test_retried_and_speculative_tasks_leave_one_dead_letter_per_record(
        cluster, broker, tmp_path, topic_name):
    """First in the module: its own application (speculation on, task retries) needs the
    cluster's two cores, which the shared `driver` application holds once started."""
    master, sidecars, spark_env = cluster
    script = tmp_path / "driver.py"
    script.write_text(SPECULATIVE_DRIVER)
    proc = subprocess.run([sys.executable, str(script), master, sidecars["node-a"].address,
                           topic_name, "cluster-once", json.dumps(_props(topic_name))],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYSPARK_PYTHON": sys.executable,
                               "SPARK_LOCAL_IP": "127.0.0.1", **spark_env})
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert lines, proc.stdout[-2000:] + proc.stderr[-4000:]
    parts = json.loads(lines[-1][len("RESULT "):])["parts"]
    # partition 0 ran again after failing; partition 1's speculative copy won the race
    assert [p for p, _, _ in parts] == [0, 1, 2, 3] and all(n == 8 for _, _, n in parts)
    attempts = {p: a for p, a, _ in parts}
    assert attempts[0] >= 1 and attempts[1] >= 1, parts
    records = read_all(broker.bootstrap_servers, topic_name)
    ids = [dict(m.headers())["spillway.record.id"].decode() for m in records]
    # 8 poison rows, each reported by two attempts or more: exactly one DLQ record each
    assert len(ids) == 8 and len(set(ids)) == 8, sorted(ids)
    assert sorted(int(m.value()) for m in records) == list(range(0, 40, 5))


def test_each_executor_reports_to_its_own_nodes_sidecar(cluster, driver, broker, topic_name):
    _, sidecars, _ = cluster
    confirmed = sidecars["node-b"].sidecar.confirmations.stats()["held-reports-confirmed"]
    out = driver.run(sidecars["node-a"].address, topic_name, "cluster-nodes", _props(topic_name))
    assert out == {"ok": True, "count": 48}
    # node b answered its executors at once and confirmed their dead letters with the home
    # (docs/POLICY.md, "Provisional verdicts"); each task's flush waited for that
    assert sidecars["node-b"].sidecar.confirmations.stats()["held-reports-confirmed"] > confirmed
    records = read_all(broker.bootstrap_servers, topic_name)
    assert len(records) == 12
    by_sidecar = {n: 0 for n in sidecars}
    for m in records:
        h = dict(m.headers())
        writer = h["spillway.sidecar"].decode()
        # the executor's own environment named the sidecar that dead-lettered its record
        assert h["__connect.errors.exception.message"].decode().endswith(
            "via " + sidecars[writer].address)
        by_sidecar[writer] += 1
    assert all(by_sidecar.values()), by_sidecar  # both nodes' executors did work
    runs = sidecars["node-b"].sidecar.registry.runs("cluster-nodes")
    assert runs and all(r.home is not None for r in runs)  # node b deferred to the home


def test_the_cluster_sidecars_refuse_plaintext_and_missing_tokens(cluster):
    """What the job above went through: TLS only, and the node token on every call."""
    import grpc
    from spillway.client import SidecarAuthError, SidecarClient
    from spillway.client.errors import SidecarUnavailableError

    _, sidecars, spark_env = cluster
    address = sidecars["node-b"].address
    with pytest.raises(SidecarUnavailableError):
        SidecarClient(address, timeout_s=5, tls_ca_file="", token_file="").status()
    with pytest.raises(SidecarAuthError) as err:
        SidecarClient(address, timeout_s=10, tls_ca_file=spark_env["SPILLWAY_TLS_CA_FILE"],
                      tls_cert_file=spark_env["SPILLWAY_TLS_CERT_FILE"],
                      tls_key_file=spark_env["SPILLWAY_TLS_KEY_FILE"], token_file="").status()
    assert err.value.code == grpc.StatusCode.UNAUTHENTICATED


def test_job_wide_tolerance_limit_holds_across_both_nodes(cluster, driver, topic_name):
    _, sidecars, _ = cluster
    # 12 poison rows over two nodes: neither node alone exceeds 8, the job as a whole does
    out = driver.run(sidecars["node-a"].address, topic_name, "cluster-limit",
                     _props(topic_name, **{"errors.tolerance.max.errors": "8"}))
    assert not out["ok"]
    assert "errors.tolerance.max.errors=8" in out["error"] and "9 errors" in out["error"], out


def test_a_home_address_that_reaches_another_sidecar_fails_the_job_naming_it(
        cluster, driver, topic_name):
    """The loopback default on every node, on one host: node-a advertises an address that,
    dialled from node-b, reaches node-b itself (as 127.0.0.1:50051 would on a real cluster).
    Executors must not decide per node: their sidecars refuse the home, naming both instances
    and advertised.address, and the job fails with that message."""
    _, sidecars, _ = cluster
    home = sidecars["node-a"].sidecar
    # what node-a's RegisterJob answers as the run's home (its Registrar's identity; the
    # facade is frozen): node-b's address
    saved = home.registrar._me
    home.registrar._me = dataclasses.replace(home.identity,
                                             advertised_address=sidecars["node-b"].address)
    try:
        # no error limit: node-a's executors, deciding at their home, must not end the job
        # first (with a limit they could, had they reached it before node-b's first report)
        out = driver.run(sidecars["node-a"].address, topic_name, "cluster-loopback",
                         _props(topic_name))
    finally:
        home.registrar._me = saved
    assert not out["ok"], out
    assert "advertised.address" in out["error"], out
    assert home.instance_id in out["error"], out
    # no node decided anything for it on its own
    assert not sidecars["node-b"].sidecar.registry.runs("cluster-loopback")
