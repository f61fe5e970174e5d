"""The executor side of the compat tier: run by a compat venv's Python (its own PySpark, protobuf,
grpcio, pandas, pyarrow and the spillway wheels), against the sidecar and broker the outer test
started. Imports nothing from the repository: only what the wheels installed.

    python compat_job.py SIDECAR_ADDRESS TOPIC_PREFIX WORK_DIR OUT_JSON

Runs every wrapper once (per row, pandas and Arrow batches with bisection, UDF, deserialization,
sink), each with its own job and DLQ topic ``TOPIC_PREFIX.<wrapper>``, checks the outputs and
asserts the flush barrier (the summary read right after each action already counts the DLQ
records as acknowledged by Kafka); writes what the outer test checks in the DLQ topics.
"""

from __future__ import annotations

import json
import os
import sys
import uuid


def _props(topic: str) -> dict:
    return {
        "errors.tolerance": "all",
        "errors.deadletterqueue.topic.name": topic,
        "errors.deadletterqueue.context.headers.enable": "true",
        "errors.deadletterqueue.auto.create.topics.enable": "true",
        "errors.deadletterqueue.topic.replication.factor": "1",
        "errors.retry.timeout": "30000",
        "errors.retry.initial.backoff.ms": "50",
    }


def kafka_rows(n, poison=None, topic="orders"):
    import datetime as dt

    poison = poison or {}
    ts = dt.datetime(2024, 5, 1, 12, 0, 0)
    return [(f"k{i}".encode(), poison.get(i, json.dumps({"id": i, "amount": i * 1.5}).encode()),
             topic, 0, i, ts, 0, [("origin", b"compat"), ("seq", str(i).encode())])
            for i in range(n)]


def _bump(path: str) -> int:
    n = int(open(path).read()) + 1 if os.path.exists(path) else 1
    with open(path, "w") as fh:
        fh.write(str(n))
    return n


def main(address: str, prefix: str, work: str, out_path: str) -> None:
    import pyspark
    from pyspark.sql import Row, SparkSession
    from spillway.spark import KAFKA_SOURCE_SCHEMA, Job, RetriableError

    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["SPARK_LOCAL_IP"] = "127.0.0.1"  # loopback only (the driver and its executors)
    spark = (SparkSession.builder.master("local[2]").appName("spillway-compat")
             .config("spark.driver.host", "127.0.0.1")
             .config("spark.driver.bindAddress", "127.0.0.1")
             .config("spark.ui.enabled", "false")
             .config("spark.sql.shuffle.partitions", "2")
             .config("spark.driver.memory", "768m")
             .config("spark.sql.execution.arrow.pyspark.enabled", "true")
             .config("spark.python.worker.reuse", "true")
             .getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    result: dict = {"versions": _versions(pyspark)}

    def job(wrapper: str):
        j = Job(f"compat-{wrapper}-{uuid.uuid4().hex[:6]}", _props(f"{prefix}.{wrapper}"),
                sidecar=address)
        j.register()
        return j

    def record(wrapper, j, **extra):
        # Read right after the action: the flush barrier makes these exact already.
        s = j.summary()
        result[wrapper] = {"retries": s.total_retries, "skipped": s.total_records_skipped,
                           "dlq": s.dlq_records_written, "failures": s.total_record_failures,
                           "processed": s.records_processed, "by_stage": dict(s.by_stage),
                           **extra}

    # per row: a transient failure retried once, a poison record dead-lettered
    j = job("rows")
    marker = os.path.join(work, "rows-failed-once")

    def parse(row):
        if row.offset == 7 and not os.path.exists(marker):
            open(marker, "w").close()
            raise RetriableError("inventory service busy")
        doc = json.loads(row.value)
        return Row(id=doc["id"], amount=float(doc["amount"]))

    df = spark.createDataFrame(kafka_rows(20, poison={13: b"{not json"}), KAFKA_SOURCE_SCHEMA)
    out = j.map_partitions(df, parse, schema="id int, amount double")
    record("rows", j, ids=sorted(r.id for r in out.collect()))

    # per row on an RDD
    j = job("rdd")
    got = j.map_partitions(spark.sparkContext.parallelize(range(10), 2),
                           lambda x: 100 // (x - 6), name="divide").collect()
    record("rdd", j, out=sorted(got))

    # vectorized: pandas batches, failing rows isolated by bisection
    j = job("pandas")
    bad = {17, 42}

    def score(pdf):
        hit = set(int(i) for i in pdf["id"]) & bad
        if hit:
            raise ValueError(f"cannot score {sorted(hit)}")
        return pdf.assign(score=pdf["id"] * 0.5)

    out = j.map_in_pandas(spark.range(0, 60, numPartitions=2), score, "id long, score double")
    record("pandas", j, ids=sorted(r.id for r in out.collect()))

    # vectorized: Arrow batches
    j = job("arrow")

    def halve(batch):
        import pyarrow.compute as pc

        if pc.any(pc.equal(batch.column("id"), 5)).as_py():
            raise ZeroDivisionError("row 5")
        return batch

    out = j.map_in_arrow(spark.range(0, 12, numPartitions=2), halve, "id long")
    record("arrow", j, ids=sorted(r.id for r in out.collect()))

    # UDF: null for a failure, or the error column
    j = job("udf")

    @j.udf("int")
    def parse_int(s):
        return int(s)

    @j.udf("int", error_column=True, name="parse_int_err")
    def parse_int_err(s):
        return int(s)

    sdf = spark.createDataFrame([("1",), ("x",), ("3",)], "s string").coalesce(1)
    plain = sorted((r.s, r.n) for r in sdf.select("s", parse_int("s").alias("n")).collect())
    errs = {r.s: r.r for r in sdf.select("s", parse_int_err("s").alias("r")).collect()}
    e = errs["x"].error
    record("udf", j, plain=[list(p) for p in plain], good=errs["1"].value,
           error=[e.stage, e.exception_class, e.dead_lettered] if e else None)

    # deserialization: a bad key and a bad value, each with its converter stage
    j = job("deserialize")
    rows = kafka_rows(8, poison={2: b"[broken"})
    rows[5] = (b"\xffbad-key",) + rows[5][1:]

    def decode_key(b):
        k = b.decode("ascii")
        return k[1:] if k.startswith("k") else k

    def decode_value(b):
        return json.loads(b)

    out = j.deserialize(spark.createDataFrame(rows, KAFKA_SOURCE_SCHEMA), key=decode_key,
                        key_type="string", value=decode_value,
                        value_type="struct<id:int,amount:double>")
    got = sorted((r.offset, r.parsed_key, r.id) for r in
                 out.select("offset", "parsed_key", "parsed_value.id").collect())
    record("deserialize", j, rows=[list(g) for g in got], columns=out.columns)

    # sink: a transient write retried, an unwritable row dead-lettered, the rest written once
    j = job("sink")
    sink_dir, sink_marker = os.path.join(work, "sink"), os.path.join(work, "sink-failed")
    os.makedirs(sink_dir)

    def write(rows):
        for r in rows:
            if r.id == 9:
                raise ValueError("row 9 rejected by the sink")
            if r.id == 4 and _bump(sink_marker) <= 3:
                raise RetriableError("sink throttled")
        for r in rows:
            with open(os.path.join(sink_dir, str(r.id)), "w") as fh:
                fh.write(str(r.id))

    j.foreach_partition(spark.range(0, 16, numPartitions=2), write, batch_size=4)
    record("sink", j, written=sorted(int(n) for n in os.listdir(sink_dir)))

    spark.stop()
    with open(out_path, "w") as fh:
        json.dump(result, fh)


def _versions(pyspark) -> dict:
    import platform

    from importlib.metadata import version

    out = {"python": platform.python_version(), "pyspark": pyspark.__version__}
    for dist in ("protobuf", "grpcio", "pandas", "pyarrow", "numpy", "opentelemetry-api",
                 "opentelemetry-sdk", "spillway-client", "spillway-spark"):
        out[dist] = version(dist)
    return out


if __name__ == "__main__":
    main(*sys.argv[1:5])
