"""The benchmark targets (issue 7; 9 from issue 12; 10 and the peers from issue 14; 11 from
issue 24), in the order the report lists them."""

from __future__ import annotations

from ..runner import TargetSpec
from . import cluster, deser, dlq, memory, rpc, spark_jobs

SPARK = ("pyspark", "spillway.spark:Job")

TARGETS: tuple[TargetSpec, ...] = (
    TargetSpec("dlq-rate", 1, "End-to-end dead-letter rate", dlq.run_dlq_rate,
               requires=(*SPARK, "spillway.spark:Job.map_partitions",
                         "spillway.sidecar.dlq.pipeline:DlqPipeline")),
    TargetSpec("rpc", 2, "RPC batching and sidecar vs bare echo server", rpc.run_rpc,
               requires=("spillway.client:SidecarClient", "spillway.sidecar.server")),
    TargetSpec("happy-path", 3, "Happy-path overhead of the wrappers", spark_jobs.run_happy,
               requires=SPARK),
    TargetSpec("error-path", 4, "Error-path cost", spark_jobs.run_error_path,
               requires=(*SPARK, "spillway.spark:Job.map_partitions")),
    TargetSpec("durability", 5, "Durability cost (spool on vs off)", dlq.run_durability,
               requires=("spillway.client:SidecarClient",
                         "spillway.sidecar.dlq.pipeline:DlqPipeline")),
    TargetSpec("tracing", 6, "Tracing cost", dlq.run_tracing,
               requires=(*SPARK, "spillway.spark:Job.map_partitions", "opentelemetry.sdk.trace")),
    TargetSpec("memory", 7, "Sidecar memory with a full spool during a broker outage",
               memory.run_memory,
               requires=("spillway.client:SidecarClient",
                         "spillway.sidecar.dlq.pipeline:DlqPipeline")),
    TargetSpec("many-clients", 8, "Many executors: 32 vs 4 concurrent clients", rpc.run_many,
               requires=("spillway.client:SidecarClient",
                         "spillway.sidecar.dlq.pipeline:DlqPipeline")),
    TargetSpec("jobs-memory", 9, "Sidecar memory after 10,000 jobs ran and ended",
               memory.run_jobs_memory,
               requires=("spillway.client:SidecarClient.end_job",
                         "spillway.sidecar.dlq.pipeline:DlqPipeline")),
    # The native fast path is a mode of job.deserialize (value="json"): the target probes for
    # it once Spark is up and reports "not run" without it.
    TargetSpec("native-deser", 10, "Native deserialization vs Spark's PERMISSIVE parse",
               deser.run_native_deser,
               requires=(*SPARK, "spillway.spark:Job.deserialize", "confluent_kafka")),
    TargetSpec("cluster", 11, "Cluster scale: N node sidecars forwarding to one home",
               cluster.run_cluster,
               requires=("spillway.client:SidecarClient",
                         "spillway.sidecar.dlq.pipeline:DlqPipeline")),
)
