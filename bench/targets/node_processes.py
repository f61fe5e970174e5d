"""Target 11 (d): one node sidecar of 2 processes (`sidecar.processes=2`) against one process.

The same 4 client processes report to the node's one address; the run is registered there by
the harness first (as a driver in its own process: the clients do not share its pin), so each
client's connection lands on either process, and reports reaching the process that is not the
run's home are tallied with it (TallyFailures) as a node's are. CPU is every process of the
node together (the supervisor included), per dead-lettered record; the scaling figure is what
k processes on k free cores would reach at that cost, since on this 2-core machine the clients
and the broker share the cores with the node.
"""

from __future__ import annotations

from .. import cpu
from ..clients import ClientPool
from ..infra import BenchError
from ..model import Figure, TargetResult, fmt
from ..runner import Context
from .common import alternate_variants, node_clients_run

PROCESSES = (1, 2)


class NodeProcesses:
    def __init__(self, ctx: Context, props: dict, job_props, clients: int, batch: int,
                 per_client: int) -> None:
        self.ctx, self.job_props, self.batch, self.per_client = ctx, job_props, batch, per_client
        self.nodes = {p: ctx.infra.sidecar({**props, "sidecar.processes": str(p),
                                            "sidecar.id": f"bench-procs-{p}"},
                                           name=f"node-{p}-processes")
                      for p in PROCESSES}
        self.pool = ClientPool(clients)
        ctx.infra.on_close(self.pool.close)

    def run(self, p: int, run_no: int) -> tuple[float, float]:
        """(records/s, node CPU µs per dead-lettered record) of one run."""
        node = self.nodes[p]
        agg, before, after, summary = node_clients_run(
            self.ctx, self.pool, node.address, f"procs-{p}", self.job_props, self.per_client,
            self.batch, run_no, [node.pid, *cpu.children(node.pid)])
        if summary.total_record_errors != agg.records:
            raise BenchError(f"node of {p} processes: the home counted "
                             f"{summary.total_record_errors} of {agg.records} records")
        return (agg.records / agg.report_seconds,
                cpu.us_per_record(cpu.cpu_used(before, after), agg.records))


def run_node_processes(ctx: Context, result: TargetResult, node: NodeProcesses) -> None:
    rate = {p: result.figure(f"node of {p} process{'es' if p > 1 else ''}: records/s "
                             "dead-lettered", "records/s") for p in PROCESSES}
    us = {p: result.figure(f"node of {p} process{'es' if p > 1 else ''}: CPU per "
                           "dead-lettered record (all its processes)", "µs") for p in PROCESSES}

    alternate_variants(ctx, result, PROCESSES, node.run, rate, [us], label="(d) ")
    result.notes.append(_reading(rate, us))


def _reading(rate: dict[int, Figure], us: dict[int, Figure]) -> str:
    med = {p: f.median for p, f in us.items()}
    rates = {p: f.median for p, f in rate.items()}
    if None in med.values() or None in rates.values():
        return "Several processes per node (d): not measured."
    one, two = med[1], med[2]
    return (f"Several processes per node (d): a node of 2 processes spends {fmt(two)} µs of "
            f"CPU per dead-lettered record against {fmt(one)} µs for one process "
            f"({two / one:.2f}×: the reports that reach the process that is not their run's "
            f"home take one more call, TallyFailures, on the node). Measured rates here "
            f"({fmt(rates[2])} vs {fmt(rates[1])} records/s) share 2 cores with the clients "
            f"and the broker; on free cores, k processes would reach about k × "
            f"{fmt(1e6 / two)} records/s (1 core / {fmt(two)} µs each) against "
            f"{fmt(1e6 / one)} records/s for one process, until Kafka or the disk is the "
            "limit.")
