"""Target 11 (e): one node sidecar fed the same failures as columns and as FailedRecord messages.

The same 4 client processes report to one node sidecar (`spillway serve`, its own home), each
run as RecordColumns (what `spillway.spark` sends a sidecar that takes them) or as one message
per record (what older clients send), alternated run by run. CPU per dead-lettered record is
read for the node and for the clients together from their own counters, and the request bytes
per record from the encoded reports, so the figures say what the columnar contract saves on
each side of the wire.
"""

from __future__ import annotations

from .. import cpu
from ..clients import ClientPool
from ..model import Figure, TargetResult, fmt
from ..runner import Context
from .common import alternate_variants, node_clients_run

FORMATS = ("columns", "messages")


class ReportFormats:
    def __init__(self, ctx: Context, props: dict, job_props, clients: int, batch: int,
                 per_client: int) -> None:
        self.ctx, self.job_props, self.batch, self.per_client = ctx, job_props, batch, per_client
        self.node = ctx.infra.sidecar({**props, "sidecar.id": "bench-formats"},
                                      name="node-formats")
        self.pool = ClientPool(clients)
        ctx.infra.on_close(self.pool.close)

    def run(self, how: str, run_no: int) -> tuple[float, float, float]:
        """(records/s, node CPU µs, clients' CPU µs) per dead-lettered record of one run."""
        node = self.node
        agg, before, after, _ = node_clients_run(
            self.ctx, self.pool, node.address, f"formats-{how}", self.job_props,
            self.per_client, self.batch, run_no, [node.pid, *self.pool.pids],
            columns=how == "columns")
        return (agg.records / agg.report_seconds,
                cpu.us_per_record(cpu.cpu_used(before, after, [node.pid]), agg.records),
                cpu.us_per_record(cpu.cpu_used(before, after, self.pool.pids), agg.records))


def request_bytes(batch: int) -> dict[str, float]:
    """Bytes on the wire per record of one report of ``batch`` records failing alike, as the
    bench clients build it (`bench.loadgen`'s templates)."""
    from bench.loadgen import _failure_template
    from spillway.client import columns
    from spillway.v1 import sidecar_pb2 as pb

    t = _failure_template(200)
    fs = [t.derive(f"r-{i}", (t.source[0], 0, i)) for i in range(batch)]
    return {"columns": pb.ReportFailuresRequest(columns=columns.encode(fs)).ByteSize() / batch,
            "messages": pb.ReportFailuresRequest(
                records=[f.to_pb() for f in fs]).ByteSize() / batch}


def run_report_formats(ctx: Context, result: TargetResult, formats: ReportFormats) -> None:
    label = {"columns": "reports as columns", "messages": "reports as messages"}
    rate = {h: result.figure(f"{label[h]}: records/s dead-lettered (1 node)", "records/s")
            for h in FORMATS}
    node_us = {h: result.figure(f"{label[h]}: node CPU per dead-lettered record", "µs")
               for h in FORMATS}
    client_us = {h: result.figure(f"{label[h]}: clients' CPU per failed record", "µs")
                 for h in FORMATS}

    alternate_variants(ctx, result, FORMATS, formats.run, rate, [node_us, client_us],
                       label="(e) ")
    result.notes.append(_reading(node_us, client_us, request_bytes(formats.batch),
                                 formats.batch))


def _reading(node_us: dict[str, Figure], client_us: dict[str, Figure],
             wire: dict[str, float], batch: int) -> str:
    med = {k: {h: f.median for h, f in d.items()}
           for k, d in (("node", node_us), ("client", client_us))}
    if any(v is None for d in med.values() for v in d.values()):
        return "Reports as columns (e): not measured."
    n, c = med["node"], med["client"]
    return (f"Reports as columns (e): {batch} records failing alike per report take "
            f"{fmt(wire['columns'])} bytes per record as columns against "
            f"{fmt(wire['messages'])} as messages ({wire['messages'] / wire['columns']:.1f}× "
            f"fewer: the exception and its stack trace cross once per report). The node spends "
            f"{fmt(n['columns'])} µs of CPU per dead-lettered record on columns against "
            f"{fmt(n['messages'])} µs on messages ({n['columns'] / n['messages']:.2f}×); the "
            f"clients {fmt(c['columns'])} against {fmt(c['messages'])} µs "
            f"({c['columns'] / c['messages']:.2f}×). What stays is the node's per-record work "
            "after decoding: deciding, the DLQ record, the spool and the producer call.")
