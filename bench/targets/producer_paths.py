"""Target 11 (f): what the DLQ drain's C produce loop (`dlq/_produce.c`) saves a node, against
confluent-kafka's ``produce()`` per record (the same node started with
``SPILLWAY_NO_EXTENSIONS=produce``).

One node sidecar per path (`spillway serve`, its own home), the same 4 client processes and
column reports, alternated; CPU per dead-lettered record is read from each node's own counters,
and by thread (the drain, librdkafka's threads), so the figures say what the producer path
costs a node (docs/DLQ.md).
"""

from __future__ import annotations

from spillway.client import extensions

from .. import cpu
from ..clients import ClientPool
from ..model import Figure, TargetResult, fmt, ratio_check
from ..runner import Context
from .common import alternate_variants, node_clients_run

PATHS = ("C loop", "confluent-kafka")
_LABEL = {"C loop": "the C produce loop", "confluent-kafka": "confluent-kafka's produce()"}
_ENV = {"C loop": None, "confluent-kafka": {extensions.ENV: "produce"}}
# (f): the C loop's node CPU per record at most this share of produce()'s, or it goes
THRESHOLD = 0.95


class ProducerPaths:
    def __init__(self, ctx: Context, props: dict, job_props, clients: int, batch: int,
                 per_client: int) -> None:
        self.ctx, self.job_props, self.batch, self.per_client = ctx, job_props, batch, per_client
        self.nodes = {
            how: ctx.infra.sidecar({**props, "sidecar.id": f"bench-producer-{k}"},
                                   name=f"node-producer-{k}", env=_ENV[how])
            for k, how in enumerate(PATHS)}
        self.pool = ClientPool(clients)
        ctx.infra.on_close(self.pool.close)

    def run(self, how: str, run_no: int) -> tuple[float, float, float, float]:
        """(records/s, node CPU µs per dead-lettered record, the drain thread's, librdkafka's
        threads') of one run."""
        node = self.nodes[how]
        threads0 = cpu.threads([node.pid])
        agg, before, after, _ = node_clients_run(
            self.ctx, self.pool, node.address, f"producer-{PATHS.index(how)}", self.job_props,
            self.per_client, self.batch, run_no, [node.pid], columns=True)
        roles = cpu.roles_used(threads0, cpu.threads([node.pid]))
        per = agg.records / 1e6
        return (agg.records / agg.report_seconds,
                cpu.us_per_record(cpu.cpu_used(before, after, [node.pid]), agg.records),
                roles.get("dlq-drain", 0.0) / per, roles.get("librdkafka", 0.0) / per)


def run_producer_paths(ctx: Context, result: TargetResult, paths: ProducerPaths) -> None:
    rate = {h: result.figure(f"{_LABEL[h]}: records/s dead-lettered (1 node)", "records/s")
            for h in PATHS}
    node_us = {h: result.figure(f"{_LABEL[h]}: node CPU per dead-lettered record", "µs")
               for h in PATHS}
    drain_us = {h: result.figure(f"{_LABEL[h]}: the drain thread's CPU per record", "µs")
                for h in PATHS}
    rdk_us = {h: result.figure(f"{_LABEL[h]}: librdkafka's threads' CPU per record", "µs")
              for h in PATHS}

    alternate_variants(ctx, result, PATHS, paths.run, rate, [node_us, drain_us, rdk_us],
                       label="(f) ")
    result.checks.append(ratio_check(
        "node CPU per dead-lettered record, the C produce loop vs confluent-kafka's produce()",
        node_us["C loop"], node_us["confluent-kafka"], "<=", THRESHOLD))
    result.notes.append(_reading(node_us, drain_us, rdk_us))


def _reading(node_us: dict[str, Figure], drain_us: dict[str, Figure],
             rdk_us: dict[str, Figure]) -> str:
    c, py = node_us["C loop"].median, node_us["confluent-kafka"].median
    if c is None or py is None:
        return "The producer path (f): not measured."
    return (f"The producer path (f): one node spends {fmt(c)} µs of CPU per dead-lettered "
            f"record with the C produce loop (`dlq/_produce.c`) against {fmt(py)} µs through "
            f"confluent-kafka's produce() ({c / py:.2f}×; medians, same run, alternated); its "
            f"drain thread {fmt(drain_us['C loop'].median)} against "
            f"{fmt(drain_us['confluent-kafka'].median)} µs, librdkafka's threads "
            f"{fmt(rdk_us['C loop'].median)} against {fmt(rdk_us['confluent-kafka'].median)}.")
