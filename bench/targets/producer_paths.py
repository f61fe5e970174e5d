"""Target 11 (f): one node sidecar producing through spillway's native producer against one
producing through confluent-kafka's ``produce()`` (``producer.native=false``).

Two node sidecars (`spillway serve`, each its own home), the same 4 client processes and the
same column reports, alternated run by run; CPU per dead-lettered record is read from each
node's own counters, so the figure says what the producer path costs a node with everything
else equal (docs/DLQ.md, "The native producer").
"""

from __future__ import annotations

from .. import cpu
from ..clients import ClientPool
from ..model import Figure, TargetResult, fmt
from ..runner import Context
from .common import alternate_variants, node_clients_run

PATHS = ("native", "confluent-kafka")
_LABEL = {"native": "native producer", "confluent-kafka": "confluent-kafka's produce()"}


class ProducerPaths:
    def __init__(self, ctx: Context, props: dict, job_props, clients: int, batch: int,
                 per_client: int) -> None:
        self.ctx, self.job_props, self.batch, self.per_client = ctx, job_props, batch, per_client
        self.nodes = {
            how: ctx.infra.sidecar({**props, "sidecar.id": f"bench-producer-{k}",
                                    "producer.native": "true" if how == "native" else "false"},
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


def _reading(node_us: dict[str, Figure]) -> str:
    med = {h: f.median for h, f in node_us.items()}
    if any(v is None for v in med.values()):
        return "The producer path (f): not measured."
    a, b = med["native"], med["confluent-kafka"]
    return (f"The producer path (f): one node producing through spillway's native producer "
            f"spends {fmt(a)} µs of CPU per dead-lettered record against {fmt(b)} µs through "
            f"confluent-kafka's produce() ({a / b:.2f}×, {b - a:.1f} µs less; same clients "
            f"and reports, alternated): a batch of records is one call into librdkafka, and "
            f"delivery reports are stored in C, with no Python work per record.")
