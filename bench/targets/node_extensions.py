"""Target 11 (f) and (h): what a node's C extensions save it, each against the same node started
with the extension turned off (``SPILLWAY_NO_EXTENSIONS=<name>``): (f) the DLQ drain's produce
loop (`dlq/_produce.c`) against confluent-kafka's ``produce()`` per record, (h) the per-record
objects made column-wise (`core/_slots.c`) against their Python constructors.

One node sidecar per variant (`spillway serve`, its own home), the same 4 client processes and
column reports, alternated; CPU per dead-lettered record is read from each node's own counters,
and by thread (the roles the extension works in), so the figures say what the extension saves a
node (docs/DLQ.md).
"""

from __future__ import annotations

from dataclasses import dataclass

from spillway.client import extensions

from .. import cpu
from ..clients import ClientPool
from ..model import Figure, TargetResult, fmt, ratio_check
from ..runner import Context
from .common import alternate_variants, node_clients_run

# (f), (h): the node's CPU per record with the extension at most this share of without it, or
# it goes (the house rule: an extension stays where the harness shows what it saves)
THRESHOLD = 0.95
ON, OFF = "on", "off"


@dataclass(frozen=True)
class Extension:
    """One extension's comparison: its name in SPILLWAY_NO_EXTENSIONS, the variants' labels,
    the thread roles (`cpu.thread_role`) read beside the node's total, and the check's name."""

    letter: str
    name: str
    source: str
    labels: dict[str, str]
    roles: dict[str, str]     # role -> how the reading names it
    check: str


PRODUCE = Extension(
    "f", "produce", "dlq/_produce.c",
    {ON: "the C produce loop", OFF: "confluent-kafka's produce()"},
    {"dlq-drain": "the drain thread", "librdkafka": "librdkafka's threads"},
    "node CPU per dead-lettered record, the C produce loop vs confluent-kafka's produce()")
SLOTS = Extension(
    "h", "slots", "core/_slots.c",
    {ON: "per-record objects made in C", OFF: "per-record objects' Python constructors"},
    {"rpc_N": "the call threads", "spool-writer": "the spool's writer",
     "dlq-drain": "the drain thread"},
    "node CPU per dead-lettered record, per-record objects made in C vs their constructors")


class ExtensionPaths:
    """A node with the extension and one without it, and the clients that load them."""

    def __init__(self, ctx: Context, ext: Extension, props: dict, job_props, clients: int,
                 batch: int, per_client: int) -> None:
        self.ctx, self.ext, self.job_props = ctx, ext, job_props
        self.batch, self.per_client = batch, per_client
        self.nodes = {
            how: ctx.infra.sidecar({**props, "sidecar.id": f"bench-{ext.name}-{how}"},
                                   name=f"node-{ext.name}-{how}",
                                   env=None if how == ON else {extensions.ENV: ext.name})
            for how in (ON, OFF)}
        self.pool = ClientPool(clients)
        ctx.infra.on_close(self.pool.close)

    def run(self, how: str, run_no: int) -> tuple[float, ...]:
        """(records/s, node CPU µs per dead-lettered record, then each role's) of one run."""
        node = self.nodes[how]
        threads0 = cpu.threads([node.pid])
        agg, before, after, _ = node_clients_run(
            self.ctx, self.pool, node.address, f"{self.ext.name}-{how}", self.job_props,
            self.per_client, self.batch, run_no, [node.pid], columns=True)
        roles = cpu.roles_used(threads0, cpu.threads([node.pid]))
        per = agg.records / 1e6
        return (agg.records / agg.report_seconds,
                cpu.us_per_record(cpu.cpu_used(before, after, [node.pid]), agg.records),
                *(roles.get(role, 0.0) / per for role in self.ext.roles))


def run_extension_paths(ctx: Context, result: TargetResult, paths: ExtensionPaths) -> None:
    ext = paths.ext
    label = ext.labels
    rate = {h: result.figure(f"{label[h]}: records/s dead-lettered (1 node)", "records/s")
            for h in (ON, OFF)}
    node_us = {h: result.figure(f"{label[h]}: node CPU per dead-lettered record", "µs")
               for h in (ON, OFF)}
    role_us = [{h: result.figure(f"{label[h]}: {what}' CPU per record" if what.endswith("s")
                                 else f"{label[h]}: {what}'s CPU per record", "µs")
                for h in (ON, OFF)} for what in ext.roles.values()]
    alternate_variants(ctx, result, (ON, OFF), paths.run, rate, [node_us, *role_us],
                       label=f"({ext.letter}) ")
    result.checks.append(ratio_check(ext.check, node_us[ON], node_us[OFF], "<=", THRESHOLD))
    result.notes.append(_reading(ext, node_us, role_us))


def _reading(ext: Extension, node_us: dict[str, Figure], role_us: list[dict[str, Figure]]
             ) -> str:
    on, off = node_us[ON].median, node_us[OFF].median
    name = f"({ext.letter}) `{ext.source}`"
    if on is None or off is None:
        return f"{name}: not measured."
    roles = ", ".join(f"{what} {fmt(r[ON].median)} against {fmt(r[OFF].median)}"
                      for what, r in zip(ext.roles.values(), role_us))
    return (f"{name}: one node spends {fmt(on)} µs of CPU per dead-lettered record with "
            f"{ext.labels[ON]} against {fmt(off)} µs with {ext.labels[OFF]} "
            f"(`SPILLWAY_NO_EXTENSIONS={ext.name}`; {on / off:.2f}×; medians, same run, "
            f"alternated); {roles}.")
