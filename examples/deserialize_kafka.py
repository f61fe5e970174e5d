"""Stages KEY_CONVERTER / VALUE_CONVERTER: `Job.deserialize` on Spark's Kafka source schema.

Works the same on `spark.readStream.format("kafka")...load()`. The original key, value, headers
and coordinates stay on every row, so a record failing later still reaches the DLQ as it was.

    python examples/deserialize_kafka.py    # with a sidecar at $SPILLWAY_SIDECAR_ADDRESS
"""

from __future__ import annotations

import json

from spillway.spark import KAFKA_SOURCE_SCHEMA, Job


def decode_key(raw: bytes | None) -> str | None:
    return raw.decode("ascii") if raw is not None else None    # b"\xff..." -> KEY_CONVERTER


def decode_value(raw: bytes | None) -> dict:
    return json.loads(raw)                                      # b"{oops" -> VALUE_CONVERTER


def run(spark, job: Job):
    import datetime

    ts = datetime.datetime(2026, 1, 1)
    data = [(b"\xffbad" if i == 2 else f"k{i}".encode(),
             b"{oops" if i == 5 else json.dumps({"id": i}).encode(),
             "orders", 0, i, ts, 0, []) for i in range(8)]
    df = spark.createDataFrame(data, KAFKA_SOURCE_SCHEMA)
    return job.deserialize(df, key=decode_key, key_type="string",
                           value=decode_value, value_type="struct<id:int>")


if __name__ == "__main__":
    import os
    import sys

    from pyspark.sql import SparkSession

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    spark = SparkSession.builder.master("local[2]").getOrCreate()
    with Job("example-deserialize", {"errors.tolerance": "all"}) as job:   # ends the run after
        run(spark, job).select("offset", "parsed_key", "parsed_value.id").show()
        print(job.summary().by_stage)   # {'KEY_CONVERTER': 1, 'VALUE_CONVERTER': 1}
