"""Target 11: the failure path at cluster scale (issue 24's measurement).

N node sidecars (N = 1, 2, 4), each `spillway serve` on its own loopback address (127.0.0.2,
127.0.0.3, ...), and one home sidecar; forwarding client processes (`bench.loadgen`, the real
`SidecarClient`) register the run at the home, then at their node sidecar naming that home, and
report failed records there. Each node sends the home every report's columns (TallyFailures:
ids, payload digests, each way of failing once) and dead-letters its records locally. CPU per
record comes from each process's own counters (`bench.cpu`), read just before the clients
start and just after the last one's flush returned.

On this small machine the nodes' own work leaves the home idle most of the time, so a second
phase saturates a home: client processes stand in for node sidecars and send each report
straight to it as a node sends it (TallyFailures, with a peer token the harness makes).
"""

from __future__ import annotations

import os
import statistics
import secrets
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from spillway.client import extensions

from .. import cpu
from ..clients import Aggregate, ClientPool
from ..infra import BenchError, SidecarProcess
from ..model import Figure, TargetResult, absolute_check, fmt, ratio_check
from ..profiling import Recording, section
from ..runner import Context
from .common import alternate_runs, dlq_props, profiled
from .node_processes import NodeProcesses, run_node_processes
from .node_extensions import PRODUCE, SLOTS, ExtensionPaths, run_extension_paths
from .report_format import ReportFormats, run_report_formats

NODE_COUNTS = (1, 2, 4)
SYNC = "sync"   # (a) at the largest node count, each report waiting for the home (baseline)
CLIENTS = 4
BATCH = 1024   # records per report: an executor's default (`Job(report_batch_size=...)`)
COALESCED = 8   # (b2): reports per call, as a node serving several executors coalesces them
# issue 24's targets
HOME_US_TARGET = 2.0
HOME_RATE_TARGET = 500_000.0
NODE_US_TARGET = 15.0
# (g): a home's CPU per record with the id tables' extension at most this share of without it
ID_EXTENSION_RATIO = 0.85

SIDECAR_PROPS = {
    # several sidecars on one host: by default a sidecar dials no home but itself
    "home.allowed.addresses": "127.0.0.0/8",
    "producer.linger.ms": "20",
    "producer.batch.size": "1000000",
}


def _job_props(topic: str) -> dict[str, str]:
    """The topic is created before the run; auto-create only covers Tansu (memory storage)
    sometimes leaving a just-created topic out of a full metadata listing, which a home's
    RegisterJob would otherwise refuse as a missing topic."""
    return dlq_props(topic, **{"errors.deadletterqueue.auto.create.topics.enable": "true",
                               "errors.deadletterqueue.topic.replication.factor": "1"})


def node_listen(index: int) -> str:
    """The listen address of node sidecar ``index``: 127.0.0.2, 127.0.0.3, ... (127.0.0.1 is
    the home's), any free port."""
    if not 0 <= index <= 252:
        raise ValueError(f"index: a node on 127.0.0.2 .. 127.0.0.254 needs 0..252, got {index}")
    return f"127.0.0.{index + 2}:0"


def node_of_client(client: int, nodes: int) -> int:
    """Clients are spread round-robin over the nodes, so every node count gets the same
    offered load from the same client processes."""
    if nodes < 1:
        raise ValueError(f"nodes: must be >= 1, got {nodes}")
    if client < 0:
        raise ValueError(f"client: must be >= 0, got {client}")
    return client % nodes


@dataclass(frozen=True)
class ClusterRun:
    """What one run measured: records, the reporting window and each role's CPU seconds."""

    records: int
    report_s: float   # first report sent -> last flush returned (the home deciding)
    home_cpu_s: float
    node_cpu_s: float  # all node sidecars in use, together
    client_cpu_s: float  # all client processes, together
    broker_cpu_s: float = 0.0
    reports_per_call: float = 0.0   # held reports per confirmation call (provisional nodes)
    # the nodes' CPU seconds by thread role (`cpu.thread_role`), together
    node_threads: dict[str, float] = field(default_factory=dict)

    def per_record(self) -> dict[str, float]:
        """The run's figures: µs of CPU per record of each role, the home's decided rate and
        how busy it was (share of one core) while deciding."""
        if self.report_s <= 0:
            raise ValueError(f"report_s: the reporting window must be > 0, got {self.report_s}")
        return {
            "home_us": cpu.us_per_record(self.home_cpu_s, self.records),
            "node_us": cpu.us_per_record(self.node_cpu_s, self.records),
            "client_us": cpu.us_per_record(self.client_cpu_s, self.records),
            "broker_us": cpu.us_per_record(self.broker_cpu_s, self.records),
            "home_rate": self.records / self.report_s,
            "home_busy": self.home_cpu_s / self.report_s,
            "reports_per_call": self.reports_per_call,
        }


@dataclass
class _Figs:
    rate: Figure
    home_us: Figure
    node_us: Figure
    client_us: Figure
    broker_us: Figure
    busy: Figure
    per_call: Figure | None   # provisional nodes only


def _figures(result: TargetResult, n: int, sync: bool = False, limited: bool = False
             ) -> _Figs:
    nodes = f"{n} node{'s' if n > 1 else ''}" + (", each report waiting for its home"
                                                 if sync else "")
    if limited:
        nodes += ", an error limit (budget slices)"
    return _Figs(
        rate=result.figure(f"{nodes}: records/s decided by the home", "records/s"),
        home_us=result.figure(f"{nodes}: home CPU per forwarded record", "µs"),
        node_us=result.figure(f"{nodes}: node sidecar CPU per dead-lettered record", "µs"),
        client_us=result.figure(f"{nodes}: client CPU per failed record", "µs"),
        broker_us=result.figure(f"{nodes}: broker (Tansu) CPU per DLQ record", "µs"),
        busy=result.figure(f"{nodes}: home busy while deciding", "cores"),

        per_call=None if sync else result.figure(f"{nodes}: held reports per confirmation call",
                                                 "reports"))


class _Cluster:
    def __init__(self, ctx: Context, per_client: int) -> None:
        self.ctx = ctx
        self.per_client = per_client
        # started together: each start is mostly a Python interpreter importing grpc and
        # confluent_kafka, and the short run should not wait for them one by one
        with ThreadPoolExecutor(max(NODE_COUNTS) + 1) as ex:
            home = ex.submit(ctx.infra.sidecar, SIDECAR_PROPS, name="cluster-home")
            nodes = [ex.submit(ctx.infra.sidecar,
                               {**SIDECAR_PROPS, "sidecar.id": f"bench-node-{i}"},
                               name=f"cluster-node{i}", listen=node_listen(i))
                     for i in range(max(NODE_COUNTS))]
            # the baseline: the same nodes, each report waiting for its home's answer
            sync = [ex.submit(ctx.infra.sidecar,
                              {**SIDECAR_PROPS, "sidecar.id": f"bench-sync-node-{i}",
                               "home.confirm.async": "false"},
                              name=f"cluster-sync-node{i}",
                              listen=node_listen(max(NODE_COUNTS) + i))
                    for i in range(max(NODE_COUNTS))]
            self.home = home.result()
            self.nodes: list[SidecarProcess] = [f.result() for f in nodes]
            self.sync_nodes: list[SidecarProcess] = [f.result() for f in sync]
        self.pool = ClientPool(CLIENTS)
        ctx.infra.on_close(self.pool.close)

    def run(self, n: int, run_no: int, *, sync: bool = False, limit: int = -1) -> ClusterRun:
        """``limit``: errors.tolerance.max.errors of the run (-1: none)."""
        ctx = self.ctx
        nodes = (self.sync_nodes if sync else self.nodes)[:n]
        props = _job_props(ctx.infra.fresh_topic("cluster"))
        if limit >= 0:
            props["errors.tolerance.max.errors"] = str(limit)
        job = f"bench-cluster-{uuid.uuid4().hex[:8]}"
        broker = ctx.infra.broker_pid()
        pids = [self.home.pid, *(s.pid for s in nodes), *self.pool.pids, *([broker] if broker
                                                                           else [])]
        before: dict[int, float] = {}
        node_pids = [s.pid for s in nodes]
        threads0: dict = {}

        def start() -> None:
            before.update(cpu.snapshot(pids))
            threads0.update(cpu.threads(node_pids))

        confirmed0 = _confirm_counts(nodes)   # read outside the CPU window
        agg = self.pool.run(lambda i: {
            "target": nodes[node_of_client(i, n)].address, "home": self.home.address,
            "job": job, "props": props, "records": self.per_client, "batch": BATCH,
            "flush": True, "run_no": run_no}, on_start=start)
        after = cpu.snapshot(pids)
        node_threads = cpu.roles_used(threads0, cpu.threads(node_pids))
        reports, calls = (a - b for a, b in zip(_confirm_counts(nodes), confirmed0, strict=True))
        self._check(agg, job)
        return ClusterRun(   # the window ends at the last flush: held reports confirmed by then
            reports_per_call=reports / calls if calls else 0.0, node_threads=node_threads,
            records=agg.records, report_s=agg.seconds,
            home_cpu_s=cpu.cpu_used(before, after, [self.home.pid]),
            node_cpu_s=cpu.cpu_used(before, after, [s.pid for s in nodes]),
            client_cpu_s=cpu.cpu_used(before, after, self.pool.pids),
            broker_cpu_s=cpu.cpu_used(before, after, [broker]) if broker else 0.0)

    def _check(self, agg: Aggregate, job: str) -> None:
        """Every record was decided by the home, dead-lettered by its node and acknowledged;
        the run is then ended at the home (which releases it on the nodes), outside the window."""
        if agg.errors or agg.timed_out:
            raise BenchError(f"cluster run: {agg.errors} client error(s), timed out="
                             f"{agg.timed_out}: {'; '.join(agg.error_samples)}")
        if agg.dead_lettered != agg.records or agg.acked != agg.records:
            raise BenchError(f"cluster run: {agg.records} records reported, "
                             f"{agg.dead_lettered} dead-lettered, {agg.acked} acknowledged")
        _end_at_home(self.home.address, job, agg.records)


def _confirm_counts(nodes: list[SidecarProcess]) -> tuple[float, float]:
    """(held reports confirmed, confirmation calls) of `nodes` together, from their status."""
    from spillway.client import SidecarClient

    reports = calls = 0.0
    for node in nodes:
        with SidecarClient(node.address, timeout_s=10) as c:
            counters = c.status(page_size=1).counters
        reports += counters.get("held-reports-confirmed", 0.0)
        calls += counters.get("home-confirm-calls", 0.0)
    return reports, calls


def _token_files(workdir: str) -> tuple[str, str]:
    """A node token and a peer token for the saturated home, each in a file of this user only."""
    base = os.path.join(workdir, f"cluster-tokens-{uuid.uuid4().hex[:6]}")
    os.makedirs(base, mode=0o700)
    paths = []
    for name in ("node.token", "peer.token"):
        path = os.path.join(base, name)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(secrets.token_hex(32) + "\n")
        paths.append(path)
    return paths[0], paths[1]


class _Saturated:
    """A home loaded by stand-in nodes: tallies straight from client processes."""

    def __init__(self, ctx: Context, per_client: int, *,
                 env: dict[str, str] | None = None) -> None:
        self.ctx = ctx
        self.per_client = per_client
        self.node_token, self.peer_token = _token_files(ctx.infra.workdir)
        self.home = ctx.infra.sidecar({**SIDECAR_PROPS, "auth.token.file": self.node_token,
                                       "auth.peer.token.file": self.peer_token},
                                      name="cluster-saturated-home", env=env)
        self.pool = ClientPool(CLIENTS, env={"SPILLWAY_TOKEN_FILE": self.node_token})
        ctx.infra.on_close(self.pool.close)

    def run(self, run_no: int, batch: int = BATCH,
            per_client: int | None = None) -> tuple[float, float, float]:
        """(records/s decided, home µs per record, home busy in cores) of one run."""
        topic = self.ctx.infra.fresh_topic("cluster-sat")
        job = f"bench-cluster-sat-{uuid.uuid4().hex[:8]}"
        before: dict[int, float] = {}
        agg = self.pool.run(lambda i: {
            "target": self.home.address, "job": job, "props": _job_props(topic),
            "records": per_client or self.per_client, "batch": batch,
            "peer_token_file": self.peer_token,
            "run_no": run_no}, on_start=lambda: before.update(cpu.snapshot([self.home.pid])))
        after = cpu.snapshot([self.home.pid])
        if agg.errors or agg.timed_out or agg.dead_lettered != agg.records:
            raise BenchError(f"saturated home: {agg.errors} client error(s), timed out="
                             f"{agg.timed_out}, {agg.dead_lettered} of {agg.records} answered "
                             f"'dead-letter': {'; '.join(agg.error_samples)}")
        _end_at_home(self.home.address, job, agg.records, token_file=self.node_token)
        m = ClusterRun(records=agg.records, report_s=agg.report_seconds,
                       home_cpu_s=cpu.cpu_used(before, after), node_cpu_s=0.0,
                       client_cpu_s=0.0).per_record()
        return m["home_rate"], m["home_us"], m["home_busy"]


def _end_at_home(address: str, job: str, records: int, *, token_file: str | None = None) -> None:
    """The home counted every record (it decided them), then the run is ended there (which
    releases it on the nodes too), outside the measured window."""
    from spillway.client import SidecarClient
    from spillway.client.runs import JobRun, JobToken

    run = JobRun(job, "bench", JobToken(f"bench-token-{job}"))  # as bench.loadgen names it
    home = SidecarClient(address, timeout_s=60, token_file=token_file)
    try:
        decided = home.job_summary(run).total_record_errors
        home.end_job(run)
    finally:
        home.close()
    if decided != records:
        raise BenchError(f"cluster run: the home counted {decided} of {records} records: "
                         "not every report reached it")


def run_cluster(ctx: Context, result: TargetResult) -> None:
    per_client = 1_280 if ctx.short else 12_800
    result.setup = (
        f"(a) One home sidecar (127.0.0.1) and N = {', '.join(map(str, NODE_COUNTS))} node "
        "sidecars, each `spillway serve` as its own process on its own loopback address "
        "(127.0.0.2, 127.0.0.3, ...), all with `home.allowed.addresses=127.0.0.0/8` and the spool "
        f"on. {CLIENTS} client processes (`bench.loadgen`, the real `SidecarClient`), spread "
        "round-robin over the N nodes, register a fresh run of the job (dead-lettering to a "
        "fresh topic, `errors.tolerance=all`) at the home, then at their node naming that home, "
        f"and report {per_client:,} failed records each ({BATCH} per report: 200-byte values, "
        "one real JSONDecodeError with its stack trace), then call the flush barrier. Each node "
        "answers a report at once (provisional verdicts: nothing but the records' identity "
        "decides them under this policy; with an error limit, within a slice of the run's error "
        "budget the home granted it), holds its DLQ records in its spool and confirms them "
        "with the home in the background, several reports a call (TallyFailures: record ids, "
        "8-byte payload digests, each way of failing once, the node's claim; no payloads or "
        "stack traces), then releases the records the home calls new to Tansu. The baseline, "
        f"alternated with them: the largest N with errors.tolerance.max.errors set (twice the "
        "records: never reached; the nodes answer within budget slices), and "
        f"{max(NODE_COUNTS)} other node sidecars with "
        "`home.confirm.async=false`, where each report waits for the home's answer (its "
        "reports coalesced only while a call is in flight). CPU is read from each "
        "process's /proc/<pid>/stat (utime + stime, all threads) just before the clients start "
        "and after the last flush returned; per record "
        "= CPU / records. The home's rate = records / (first report sent → last flush "
        "returned: held reports are confirmed by then); 'home busy' = its CPU seconds / that "
        "window (1.0 = one core). Variants "
        "alternate run by run (ABCABC…, after a warm-up round); a fresh run per measurement, "
        "ended at the home afterwards (where its record count is checked). (b) Saturation: "
        f"the nodes' own work leaves the home mostly idle on this 2-core machine, so {CLIENTS} "
        f"client processes stand in for nodes and send {per_client * 2:,} records each, "
        f"{BATCH} per report, straight to a home as a node sends them (TallyFailures, with a "
        "peer token the harness made); the home's rate and CPU are measured the same way. "
        "Checks are at the largest node count of (a). The 500k records/s target is judged on "
        "the projected ceiling of one home (1 core / its CPU per forwarded record): a measured "
        "rate here is bounded by 2 shared cores that also run the clients (and in (a) the "
        "nodes and the broker), so it is reported beside it with how busy the home was. (c) "
        "Per call: the same stand-ins send 1 record per call, "
        f"{200 if ctx.short else 1_000:,} calls each; the home's CPU per call is what a call "
        "costs whatever it carries. (b2) Coalesced: the same stand-ins send "
        f"{COALESCED * BATCH:,} records per call (what a node sends when {COALESCED} reports "
        "of its executors arrive while its last call to the home is in flight; a node "
        "coalesces up to 64 reports and 16,384 records a call). (d) Several processes per "
        "node: one node sidecar with `sidecar.processes=2` against one with a single "
        "process (alternated); the harness registers the run at the node's address (as a "
        f"driver in its own process), the same {CLIENTS} clients register at that address "
        "naming the home it answered and report "
        f"{per_client:,} records each; connections land on either process, and reports "
        "reaching the process that is not the run's home are tallied with it. CPU is all the "
        "node's processes together (its supervisor included) per dead-lettered record. (e) "
        "Report formats: one node sidecar, the same clients and records reported as columns "
        "(RecordColumns, what spillway.spark sends a sidecar that takes them; also what (a) "
        "and (d) send) or as one FailedRecord message per record (older clients), alternated; "
        "CPU of the node and of the clients per dead-lettered record. (f) The producer path: "
        "one node sidecar whose drain hands its records to librdkafka in one C call a batch "
        "(`dlq/_produce.c`) and one started with `SPILLWAY_NO_EXTENSIONS=produce` "
        "(confluent-kafka's produce() per record), the same clients and column reports, "
        "alternated; the node's CPU per dead-lettered record, and its drain thread's and "
        "librdkafka's threads'. (g) The id tables' C "
        "extension: (b2)'s saturating tallies to its home and to a second home started with "
        "`SPILLWAY_NO_EXTENSIONS=idindex` (the same loops in Python), alternated; the home's "
        "CPU per decided record with and without. (h) Per-record objects: (f)'s setting with "
        "one node whose report views, DLQ records, their headers and the drain's entries are "
        "made column-wise in C (`core/_slots.c`) and one started with "
        "`SPILLWAY_NO_EXTENSIONS=slots` (their Python constructors), alternated; the node's "
        "CPU per dead-lettered record, and its call threads', spool writer's and drain's.")
    cluster = _Cluster(ctx, per_client)
    figs = {n: _figures(result, n) for n in NODE_COUNTS}
    top = max(NODE_COUNTS)
    sync_figs = _figures(result, top, sync=True)
    # a limit the run never reaches: what its reports cost while slices answer them
    limit = 2 * CLIENTS * per_client
    lim_figs = _figures(result, top, limited=True)

    by_thread: list[dict[str, float]] = []   # the largest node count's runs (not warm-up)

    def variant(n: int, sync: bool = False, limited: bool = False):
        def go(run_no: int):
            f = sync_figs if sync else lim_figs if limited else figs[n]
            one = cluster.run(n, run_no, sync=sync, limit=limit if limited else -1)
            m = one.per_record()
            if n == top and not (sync or limited) and run_no >= 1:
                by_thread.append({role: cpu.us_per_record(s, one.records)
                                  for role, s in one.node_threads.items()})
            extra = {} if sync else {f.per_call: m["reports_per_call"]}
            return m["home_rate"], {f.home_us: m["home_us"], f.node_us: m["node_us"],
                                    f.client_us: m["client_us"], f.broker_us: m["broker_us"],
                                    f.busy: m["home_busy"], **extra}
        return go

    variants = {figs[n].rate.name: variant(n) for n in NODE_COUNTS}
    variants[sync_figs.rate.name] = variant(top, sync=True)
    variants[lim_figs.rate.name] = variant(top, limited=True)
    rates = {figs[n].rate.name: figs[n].rate for n in NODE_COUNTS}
    rates[sync_figs.rate.name] = sync_figs.rate
    rates[lim_figs.rate.name] = lim_figs.rate
    alternate_runs(ctx, result, variants, rates, warmup=True, label="(a) ")
    result.notes.append(_provisional_reading(figs[top], sync_figs, top))
    result.notes.append(_sliced_reading(lim_figs, figs[top], sync_figs, top, limit))
    result.notes.append(_threads_reading(by_thread, figs[top].node_us.median, top))

    sat = _Saturated(ctx, per_client * 2)
    who = f"home saturated by {CLIENTS} stand-in nodes (TallyFailures)"
    sat_rate = result.figure(f"{who}: records/s decided", "records/s")
    sat_us = result.figure(f"{who}: home CPU per decided record", "µs")
    sat_busy = result.figure(f"{who}: home busy", "cores")

    def saturated(run_no: int):
        rate, us, busy = sat.run(run_no)
        return rate, {sat_us: us, sat_busy: busy}

    alternate_runs(ctx, result, {sat_rate.name: saturated}, {sat_rate.name: sat_rate},
                   warmup=True, label="(b) ")

    # (c) what a call costs the home whatever it carries: the same stand-ins, 1 record a call
    calls = 200 if ctx.short else 1_000
    one = f"home answering {CLIENTS} stand-in nodes 1 record per call (TallyFailures)"
    call_rate = result.figure(f"{one}: calls/s", "calls/s")
    call_us = result.figure(f"{one}: home CPU per call", "µs")

    def per_call(run_no: int):
        rate, us, _ = sat.run(run_no, batch=1, per_client=calls)
        return rate, {call_us: us}

    alternate_runs(ctx, result, {call_rate.name: per_call}, {call_rate.name: call_rate},
                   warmup=True, label="(c) ")
    # (b2) what a node serving several executors sends: their reports coalesced in one call
    big = COALESCED * BATCH
    big_who = f"home saturated by {CLIENTS} stand-in nodes, {big:,} records a call"
    big_rate = result.figure(f"{big_who}: records/s decided", "records/s")
    big_us = result.figure(f"{big_who}: home CPU per decided record", "µs")

    def coalesced(run_no: int):
        rate, us, _ = sat.run(run_no, batch=big)
        return rate, {big_us: us}

    alternate_runs(ctx, result, {big_rate.name: coalesced}, {big_rate.name: big_rate},
                   warmup=True, label="(b2) ")
    _judge(result, figs, sat_rate, sat_busy)
    result.notes.append(_per_call_reading(call_us, sat_us, big_us))
    # (g) the id tables' C extension against their Python loops, in two saturated homes
    run_id_extension(ctx, result, sat, _Saturated(
        ctx, per_client * 2, env={extensions.ENV: "idindex"}))
    # (d) one node of 2 processes against one process (processes.py)
    run_node_processes(ctx, result, NodeProcesses(ctx, SIDECAR_PROPS, _job_props, CLIENTS,
                                                  BATCH, per_client))
    # (e) one node fed columns against FailedRecord messages (report_format.py)
    run_report_formats(ctx, result, ReportFormats(ctx, SIDECAR_PROPS, _job_props, CLIENTS,
                                                  BATCH, per_client))
    # (f) the C produce loop against confluent-kafka's produce(), (h) per-record objects made
    # in C against their constructors (node_extensions.py)
    for ext in (PRODUCE, SLOTS):
        run_extension_paths(ctx, result, ExtensionPaths(ctx, ext, SIDECAR_PROPS, _job_props,
                                                        CLIENTS, BATCH, per_client))
    if ctx.sizes.profile and result.met is False:
        _profile(ctx, result, cluster)


def run_id_extension(ctx: Context, result: TargetResult, native: _Saturated,
                     python: _Saturated) -> None:
    """(g): what `core/_idindex.c` saves a home: the same saturating tallies to a home with
    the extension and to one started with ``SPILLWAY_NO_EXTENSIONS=idindex``, alternated."""
    who = f"home saturated by {CLIENTS} stand-in nodes, {COALESCED * BATCH:,} records a call"
    figs = {
        "c": (result.figure(f"{who}, id tables in C: records/s decided", "records/s"),
              result.figure(f"{who}, id tables in C: home CPU per decided record", "µs")),
        "py": (result.figure(f"{who}, id tables in Python: records/s decided", "records/s"),
               result.figure(f"{who}, id tables in Python: home CPU per decided record",
                             "µs")),
    }

    def variant(home: _Saturated, key: str):
        def go(run_no: int):
            # coalesced calls: the records' own work, not the call's, is most of the home's
            rate, us, _ = home.run(run_no, batch=COALESCED * BATCH)
            return rate, {figs[key][1]: us}
        return go

    alternate_runs(ctx, result, {figs["c"][0].name: variant(native, "c"),
                                 figs["py"][0].name: variant(python, "py")},
                   {figs["c"][0].name: figs["c"][0], figs["py"][0].name: figs["py"][0]},
                   warmup=True, label="(g) ")
    c_us, py_us = figs["c"][1], figs["py"][1]
    result.checks.append(ratio_check("home CPU per decided record, id tables' C extension vs "
                                     "their Python loops", c_us, py_us, "<=",
                                     ID_EXTENSION_RATIO))
    if c_us.median and py_us.median:
        result.notes.append(
            f"(g) The id tables' C extension (`core/_idindex.c`) saves a saturated home "
            f"{fmt(py_us.median - c_us.median)} µs of CPU per decided record: "
            f"{fmt(c_us.median)} µs with it, {fmt(py_us.median)} µs with their Python loops "
            f"({c_us.median / py_us.median:.2f}x; medians, same run, alternated).")


def _judge(result: TargetResult, figs: dict[int, _Figs], sat_rate: Figure,
           sat_busy: Figure) -> None:
    n = max(figs)
    f = figs[n]
    home_us, node_us = f.home_us.median, f.node_us.median
    ceiling = cpu.per_core_ceiling(home_us) if home_us else None
    result.checks.append(absolute_check(
        f"home CPU per forwarded record ({n} nodes)", home_us, "<=", HOME_US_TARGET, "µs",
        f"median of the home's CPU seconds / records over {len(f.home_us.values)} runs"))
    result.checks.append(absolute_check(
        f"one home: failed records/s, projected ceiling ({n} nodes)", ceiling, ">=",
        HOME_RATE_TARGET, "records/s",
        f"1 core / median home CPU per forwarded record {fmt(home_us or 0)} µs; measured "
        f"saturated (b): {fmt(sat_rate.median or 0)} records/s with the home busy "
        f"{fmt(sat_busy.median or 0)} cores; behind {n} real nodes (a): "
        f"{fmt(f.rate.median or 0)} records/s, home busy {fmt(f.busy.median or 0)}"))
    result.checks.append(absolute_check(
        f"node sidecar CPU per dead-lettered record ({n} nodes)", node_us, "<=",
        NODE_US_TARGET, "µs", f"median of the {n} nodes' CPU seconds together / records"))
    result.notes.append(_reading(figs))


def _reading(figs: dict[int, _Figs]) -> str:
    """Where the CPU of one failed record goes, per node count, in one sentence."""
    parts = []
    for n, f in sorted(figs.items()):
        vals = [x.median for x in (f.client_us, f.node_us, f.home_us, f.broker_us)]
        if None in vals:
            continue
        c, nd, h, b = vals
        parts.append(f"{n} node{'s' if n > 1 else ''}: client {fmt(c)} + node {fmt(nd)} + "
                     f"home {fmt(h)} + broker {fmt(b)} = {fmt(c + nd + h + b)} µs "
                     f"(home {h / (c + nd + h + b):.0%})")
    top = figs[max(figs)]
    home_us = top.home_us.median
    need = (f" A cluster failing at {fmt(HOME_RATE_TARGET)} records/s would need "
            f"{fmt(HOME_RATE_TARGET * home_us / 1e6)} cores of home work at today's cost."
            if home_us else "")
    return ("CPU per failed record, medians, by role (the client figure includes building "
            "each record, a columns.Failure, from a template, not formatting a new exception: "
            "target 4 measures the executor side in Spark): " + "; ".join(parts) + "." + need)


def _threads_reading(runs: list[dict[str, float]], node_us: float | None, n: int) -> str:
    """Where the nodes' CPU goes, by thread (the median of each role over the runs), and what
    would close the gap to the node target."""
    if not runs or node_us is None:
        return "The nodes' CPU by thread: not measured."
    roles = sorted({r for run in runs for r in run},
                   key=lambda r: -statistics.median(run.get(r, 0.0) for run in runs))
    med = {r: statistics.median(run.get(r, 0.0) for run in runs) for r in roles}
    shown = [r for r in roles if med[r] >= 0.3]
    rest = sum(med[r] for r in roles if r not in shown)
    parts = [f"{r} {fmt(med[r])}" for r in shown] + ([f"others {fmt(rest)}"] if rest else [])
    return (f"Where the {n} nodes' CPU goes, by thread as the OS names it (µs per dead-lettered "
            f"record, medians of the {len(runs)} runs; `cpu.thread_role`): " + ", ".join(parts)
            + f" (together {fmt(sum(med.values()))}; the node figure, from the processes' own "
            f"counters, {fmt(node_us)}). `rpc_N` decides each report, builds its DLQ records "
            "and spools them (held until the home confirms), `spool-writer` writes them to "
            "SQLite once (held; a release of the whole report reads the held row in place), "
            "`dlq-drain` produces them (one C call a produce request's worth, (f)) and settles "
            "the acknowledged ones, librdkafka sends them (one request at a time, its broker "
            "thread asleep meanwhile: docs/design/failure-path.md, round eleven). Toward "
            f"{fmt(NODE_US_TARGET)} µs: the report kept as one unit from the wire to the "
            "producer, with no Python object per record (the DLQ records, the hand-off's "
            "entries, the per-task counts).")


def _provisional_reading(prov: _Figs, sync: _Figs, n: int) -> str:
    """What answering provisionally saves, against the same nodes waiting for their home."""
    vals = [x.median for x in (prov.home_us, sync.home_us, prov.node_us, sync.node_us,
                                 prov.client_us, sync.client_us)]
    if None in vals:
        return "Provisional verdicts against waiting for the home: not measured."
    ph, sh, pn, sn, pc, sc = vals
    return (f"Provisional verdicts ({n} nodes, same run, alternated): the home spends "
            f"{fmt(ph)} µs per record where it spent {fmt(sh)} µs with each report waiting for "
            f"it ({ph / sh:.2f}x: held reports go to it many a call); a node {fmt(pn)} µs "
            f"against {fmt(sn)} ({pn / sn:.2f}x; both hold each report's DLQ records before "
            f"the home answers, and release them after); a client {fmt(pc)} against "
            f"{fmt(sc)} µs.")


def _sliced_reading(lim: _Figs, free: _Figs, sync: _Figs, n: int, limit: int) -> str:
    """What a run with an error limit costs now that its nodes answer within budget slices."""
    vals = [x.median for x in (lim.home_us, free.home_us, sync.home_us, lim.node_us,
                                 free.node_us)]
    if None in vals:
        return "A run with an error limit (budget slices): not measured."
    lh, fh, sh, ln, fn = vals
    return (f"A run with errors.tolerance.max.errors={limit:,} ({n} nodes, never reached; "
            f"same run, alternated): its nodes answer within slices of its error budget, and "
            f"the home spends {fmt(lh)} µs per record against {fmt(fh)} µs without a limit "
            f"and {fmt(sh)} µs with each report waiting for it (before budget slices every "
            f"report of a limited run waited); a node {fmt(ln)} against {fmt(fn)} µs.")


def _per_call_reading(call_us: Figure, sat_us: Figure, big_us: Figure) -> str:
    """The home's CPU per record split into its per-call part and its per-record part, and
    what it comes to when reports are coalesced."""
    per_call, per_record = call_us.median, sat_us.median
    if per_call is None or per_record is None:
        return "Per-call cost: not measured."
    share = per_call / BATCH
    out = (f"The home's CPU per record at {BATCH} records a call (b) is "
           f"{fmt(per_record)} µs: {fmt(share)} µs of it is the call itself ((c): "
           f"{fmt(per_call)} µs per call whatever it carries, / {BATCH}) and "
           f"{fmt(max(per_record - share, 0.0))} µs the records' own work (decoding the "
           "columns, deciding, journaling, encoding the verdicts).")
    big = big_us.median
    if big:
        out += (f" At {COALESCED * BATCH:,} records a call (b2: what a node sends when "
                f"{COALESCED} reports of its executors arrive while its last call is in "
                f"flight) it is {fmt(big)} µs: one home would decide about "
                f"{fmt(cpu.per_core_ceiling(big))} records/s per core.")
    return out


def _profile(ctx: Context, result: TargetResult, cluster: _Cluster) -> None:
    """One more run at the largest node count with py-spy on the home and on node 0."""
    n = max(NODE_COUNTS)
    node = Recording([cluster.nodes[0].pid], ctx.profile_dir or ctx.infra.workdir,
                     "cluster-node0")
    try:
        profiled(ctx, result, f"home sidecar, {n} nodes forwarding", [cluster.home.pid],
                 lambda: cluster.run(n, 99), label="cluster-home")
    finally:
        stacks = node.stop()
    if stacks:
        result.profiles.append(section("node sidecar 0 during the same run", stacks))

