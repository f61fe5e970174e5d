"""Target 11 (f): one node sidecar producing its DLQ records through confluent-kafka's
``produce()``, the DLQ producer's one path.

One node sidecar (`spillway serve`, its own home), 4 client processes and column reports; CPU
per dead-lettered record is read from the node's own counters, so the figure says what the
producer path costs a node (docs/DLQ.md). Spillway's own librdkafka binding, once compared here
side by side, was removed: it spent 0.98× of this path's CPU per record (docs/BENCHMARKS.md).
"""

from __future__ import annotations

from .. import cpu
from ..clients import ClientPool
from ..model import Figure, TargetResult, fmt
from ..runner import Context
from .common import alternate_variants, node_clients_run

PATHS = ("confluent-kafka",)
_LABEL = {"confluent-kafka": "confluent-kafka's produce()"}
# Why (f) has one side (docs/BENCHMARKS.md keeps this note in each report)
REMOVED = ("Spillway's own librdkafka producer (`dlq/_rdkafka.c`, `producer.native`) was "
           "removed: target 11 (f), run on an idle machine, measured a node at 24.6 µs of CPU "
           "per dead-lettered record with it against 25.2 µs through confluent-kafka's "
           "`produce()` (0.98×, within noise), too little for a hand-written binding to earn "
           "its place. Target 11 (f) now measures the `produce()` path alone.")


class ProducerPaths:
    def __init__(self, ctx: Context, props: dict, job_props, clients: int, batch: int,
                 per_client: int) -> None:
        self.ctx, self.job_props, self.batch, self.per_client = ctx, job_props, batch, per_client
        self.nodes = {
            how: ctx.infra.sidecar({**props, "sidecar.id": f"bench-producer-{k}"},
                                   name=f"node-producer-{k}")
            for k, how in enumerate(PATHS)}
        self.pool = ClientPool(clients)
        ctx.infra.on_close(self.pool.close)

    def run(self, how: str, run_no: int) -> tuple[float, float]:
        """(records/s, node CPU µs per dead-lettered record) of one run."""
        node = self.nodes[how]
        agg, before, after, _ = node_clients_run(
            self.ctx, self.pool, node.address, f"producer-{PATHS.index(how)}", self.job_props,
            self.per_client, self.batch, run_no, [node.pid], columns=True)
        return (agg.records / agg.report_seconds,
                cpu.us_per_record(cpu.cpu_used(before, after, [node.pid]), agg.records))


def run_producer_paths(ctx: Context, result: TargetResult, paths: ProducerPaths) -> None:
    rate = {h: result.figure(f"{_LABEL[h]}: records/s dead-lettered (1 node)", "records/s")
            for h in PATHS}
    node_us = {h: result.figure(f"{_LABEL[h]}: node CPU per dead-lettered record", "µs")
               for h in PATHS}

    alternate_variants(ctx, result, PATHS, paths.run, rate, [node_us], label="(f) ")
    result.notes.append(_reading(node_us))
    result.notes.append(REMOVED)


def _reading(node_us: dict[str, Figure]) -> str:
    us = node_us["confluent-kafka"].median
    if us is None:
        return "The producer path (f): not measured."
    return (f"The producer path (f): one node producing through confluent-kafka's produce() "
            f"spends {fmt(us)} µs of CPU per dead-lettered record (clients' reports as "
            f"columns).")
