"""spillway's main demo job (`make run`).

Starts what it needs — a Tansu Kafka-protocol broker and the spillway sidecar, each as its own
process — unless told to use existing ones, then runs a local PySpark job over generated
orders in the Kafka source schema. Some records are poison (invalid JSON), some hit a flaky
lookup that succeeds on a later attempt. It prints a summary and one DLQ record read back from
the topic with an independent Kafka client, then stops everything it started.

    python examples/demo_job.py [--bootstrap-servers HOST:PORT] [--sidecar ADDR]
                                [--master URL] [--records N] [--dlq-topic NAME]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import uuid
from contextlib import ExitStack

SOURCE_TOPIC = "orders"
POISON_EVERY = 50   # every 50th record is invalid JSON
FLAKY_EVERY = 25    # every 25th (not poison) needs a flaky lookup that fails twice


def make_rows(n: int):
    """Rows with the Spark Kafka source schema (the connector jar is not needed to build them)."""
    import datetime

    base = datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC)
    rows = []
    for i in range(n):
        if i % POISON_EVERY == 7:
            value = b'{"order_id": %d, "amount": ' % i  # truncated: invalid JSON
        else:
            value = json.dumps({"order_id": i, "amount": round(i * 1.5, 2),
                                "flaky": i % FLAKY_EVERY == 3}).encode()
        rows.append((f"order-{i}".encode(), value, SOURCE_TOPIC, i % 2, i // 2,
                     base + datetime.timedelta(seconds=i), 0,
                     [("source", b"demo")]))
    return rows


def enrich(row):
    """The user's function: parse JSON and look up a price tier (flaky for some orders)."""
    order = json.loads(row.value)
    if order.get("flaky"):
        _flaky_lookup(order["order_id"])
    tier = "high" if order["amount"] > 500 else "low"
    return (order["order_id"], float(order["amount"]), tier)


_LOOKUP_CALLS: dict[int, int] = {}


def _flaky_lookup(order_id: int) -> None:
    """Fails twice with a connection error, then succeeds (a transient dependency outage)."""
    calls = _LOOKUP_CALLS.get(order_id, 0) + 1
    _LOOKUP_CALLS[order_id] = calls
    if calls <= 2:
        raise ConnectionError(f"price service unavailable (order {order_id}, call {calls})")


def start_sidecar(bootstrap: str, workdir: str, stack: ExitStack) -> str:
    """Run `spillway serve` as its own process on a free loopback port; return its address."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "spillway.sidecar.cli", "--log-level", "WARNING", "serve",
         "--listen", "127.0.0.1:0", "--bootstrap-servers", bootstrap,
         "--set", f"spool.dir={os.path.join(workdir, 'spool')}"],
        stdout=subprocess.PIPE, stderr=open(os.path.join(workdir, "sidecar.log"), "wb"),
        text=True,
    )
    stack.callback(_stop_process, proc)
    line = proc.stdout.readline()
    match = re.search(r"listening on (\S+)", line)
    if not match:
        raise SystemExit(f"sidecar did not start (see {workdir}/sidecar.log): {line!r}")
    return match.group(1)


def _stop_process(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()


def read_dlq(bootstrap: str, topic: str, job: str, idle_s: float = 2.0):
    """This run's records of the DLQ topic, read with a plain confluent-kafka consumer."""
    from confluent_kafka import Consumer, TopicPartition

    c = Consumer({"bootstrap.servers": bootstrap, "group.id": f"demo-{uuid.uuid4().hex}",
                  "enable.auto.commit": False})
    try:
        parts = c.list_topics(topic, timeout=10).topics[topic].partitions
        c.assign([TopicPartition(topic, p, 0) for p in parts])
        out, last = [], time.monotonic()
        while time.monotonic() - last < idle_s:
            msgs = c.consume(500, 0.2)
            for m in msgs:
                if not m.error() and dict(m.headers() or []).get("spillway.job") == job.encode():
                    out.append(m)
            if msgs:
                last = time.monotonic()
        return out
    finally:
        c.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bootstrap-servers", help="an existing Kafka (default: embedded Tansu)")
    ap.add_argument("--sidecar", help="an existing sidecar (default: start one)")
    ap.add_argument("--master", default="local[2]", help="Spark master URL")
    ap.add_argument("--records", type=int, default=1000)
    ap.add_argument("--dlq-topic", default="dlq.spillway-demo")
    ap.add_argument("--json-summary", help="also write the summary as JSON to this path")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override a job property, e.g. --set errors.tolerance=none")
    args = ap.parse_args(argv)

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    started = time.monotonic()
    with ExitStack() as stack, tempfile.TemporaryDirectory(prefix="spillway-demo-") as workdir:
        bootstrap = args.bootstrap_servers
        if not bootstrap:
            from spillway.sidecar.runtime.embedded import EmbeddedBroker

            broker = EmbeddedBroker(log_path=os.path.join(workdir, "tansu.log")).start()
            stack.callback(broker.stop)
            bootstrap = broker.bootstrap_servers
            print(f"started Tansu broker on {bootstrap}")
        sidecar = args.sidecar or start_sidecar(bootstrap, workdir, stack)
        print(f"sidecar at {sidecar}")

        from pyspark.sql import SparkSession
        from pyspark.sql import types as T
        from spillway.spark import Job

        if args.master.startswith("local"):
            # Local executors live on this node: its sidecar is theirs. On a cluster each
            # worker's own SPILLWAY_SIDECAR_ADDRESS (one sidecar per node) is left alone.
            os.environ["SPILLWAY_SIDECAR_ADDRESS"] = sidecar
            # loopback only: Spark would otherwise pick the machine's interface address for
            # its driver when the host name resolves to 127.0.0.1 ("using ... instead")
            os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
        quiet = os.path.join(os.path.dirname(os.path.abspath(__file__)), "log4j2-quiet.properties")
        builder = SparkSession.builder
        if args.master.startswith("local"):
            builder = (builder.config("spark.driver.host", "127.0.0.1")
                       .config("spark.driver.bindAddress", "127.0.0.1"))
        spark = (builder.master(args.master).appName("spillway-demo")
                 .config("spark.ui.enabled", "false")
                 .config("spark.ui.showConsoleProgress", "false")
                 .config("spark.driver.extraJavaOptions", f"-Dlog4j2.configurationFile={quiet}")
                 .getOrCreate())
        stack.callback(spark.stop)
        spark.sparkContext.setLogLevel("ERROR")

        job_name = f"spillway-demo-{uuid.uuid4().hex[:8]}"
        job = Job(job_name, {
            "errors.tolerance": "all",
            "errors.retry.timeout": "30000",
            "errors.retry.delay.max.ms": "2000",
            # Every flaky record needs two retries (its lookup succeeds on the third call): the
            # default retry budget defers retries under load, it never drops them
            # (docs/POLICY.md), so no override is needed.
            "errors.log.enable": "true",
            "errors.deadletterqueue.topic.name": args.dlq_topic,
            "errors.deadletterqueue.context.headers.enable": "true",
            "errors.deadletterqueue.auto.create.topics.enable": "true",
            "errors.deadletterqueue.topic.replication.factor": "1",
            **dict(kv.split("=", 1) for kv in args.set),
        }, sidecar=sidecar)
        job.register()

        kafka_schema = T.StructType([
            T.StructField("key", T.BinaryType()), T.StructField("value", T.BinaryType()),
            T.StructField("topic", T.StringType()), T.StructField("partition", T.IntegerType()),
            T.StructField("offset", T.LongType()), T.StructField("timestamp", T.TimestampType()),
            T.StructField("timestampType", T.IntegerType()),
            T.StructField("headers", T.ArrayType(T.StructType([
                T.StructField("key", T.StringType()), T.StructField("value", T.BinaryType())]))),
        ])
        out_schema = T.StructType([
            T.StructField("order_id", T.LongType()), T.StructField("amount", T.DoubleType()),
            T.StructField("tier", T.StringType()),
        ])
        source = spark.createDataFrame(make_rows(args.records), kafka_schema).repartition(4)
        result = job.map_partitions(source, enrich, schema=out_schema)
        try:
            succeeded = result.count()
        except Exception as exc:  # the job failed by policy (e.g. errors.tolerance=none)
            message = job.failure_message(exc)
            job.close()
            # Spark's cancelled tasks still write to this stderr (a Python worker's
            # BrokenPipeError, say) until the session stops: stop it first so the reason is
            # the last thing printed.
            spark.stop()
            print(f"\njob {job_name} FAILED: {message}", file=sys.stderr, flush=True)
            return 1

        # ends the run: waits for its dead letters, releases its state on every sidecar and
        # answers the final counts
        summary = job.close()
        dlq = read_dlq(bootstrap, args.dlq_topic, job_name)
        report = {
            "job": job_name,
            "records_in": args.records,
            "succeeded": succeeded,
            "retries": summary.total_retries,
            "dead_lettered": summary.dlq_records_written,
            "failed": summary.total_record_errors - summary.total_records_skipped,
            "dlq_records_read_back": len(dlq),
            "dlq_topic": args.dlq_topic,
            "seconds": round(time.monotonic() - started, 1),
        }
        print()
        print(f"spillway demo job {job_name}")
        print(f"  records in      {report['records_in']:>6}")
        print(f"  succeeded       {report['succeeded']:>6}")
        print(f"  retries         {report['retries']:>6}   (transient lookup failures, "
              "all recovered)")
        print(f"  dead-lettered   {report['dead_lettered']:>6}   -> {args.dlq_topic}")
        print(f"  failed          {report['failed']:>6}")
        print(f"  DLQ read back   {report['dlq_records_read_back']:>6}   (independent consumer)")
        if dlq:
            m = dlq[0]
            print(f"\none DLQ record ({m.topic()} partition {m.partition()} "
                  f"offset {m.offset()}):")
            print(f"  key   {m.key()!r}")
            print(f"  value {m.value()!r}")
            for k, v in m.headers() or []:
                text = v.decode("utf-8", "replace") if v is not None else None
                if text and len(text) > 100:
                    text = text[:100] + f"... ({len(v)} bytes)"
                print(f"  {k} = {text}")
        print(f"\ndone in {report['seconds']} s")
        if args.json_summary:
            with open(args.json_summary, "w") as fh:
                json.dump(report, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
