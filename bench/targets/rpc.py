"""Target 2 (RPC batching; sidecar vs a bare echo server) and target 8 (many executors)."""

from __future__ import annotations

import uuid
from pathlib import Path

from ..clients import Aggregate, ClientPool
from ..infra import BenchError
from ..model import TargetResult, absolute_check, fmt, ratio_check
from ..runner import Context
from .common import POLICY_ONLY, alternate_runs, dlq_props, profiled, start_listening

BATCH = 256
ECHO_CLIENTS = 4
FEW, MANY = 4, 32


def _checked(agg: Aggregate, what: str) -> Aggregate:
    if agg.errors or agg.timed_out:
        raise BenchError(f"{what}: {agg.errors} client error(s), timed out={agg.timed_out}: "
                         f"{'; '.join(agg.error_samples)}")
    return agg


def run_rpc(ctx: Context, result: TargetResult) -> None:
    sz = ctx.sizes
    result.setup = (
        "Client processes (`bench.loadgen`, the real `SidecarClient`) report failed records "
        "(200-byte values, a real JSONDecodeError with its stack trace, Kafka coordinates) to the "
        "sidecar, started as its own process by `spillway serve`. The job tolerates every error "
        "without a DLQ topic (`errors.tolerance=all`), so this is the RPC and policy path alone; "
        "a fresh job per run. (a) one client, 1 vs 256 records per ReportFailures; (b) "
        f"{ECHO_CLIENTS} client processes at {BATCH} records per report, the sidecar vs a bare "
        "echo server of the same service (`bench.echo`: same server options and 32-thread pool, "
        "a servicer that answers SKIP and does nothing else).")
    sidecar = ctx.infra.sidecar(name="rpc")
    _, echo_addr = start_listening(ctx, "bench.echo", "the echo server")

    one = ClientPool(1)
    ctx.infra.on_close(one.close)
    f_single = result.figure("1 record/report", "records/s")
    f_batched = result.figure(f"{BATCH} records/report", "records/s")
    lat_single = result.figure("latency at 1 record/report, p50", "ms")
    lat_batched = result.figure(f"latency at {BATCH} records/report, p50", "ms")

    def run_single(batch: int, records: int, lat_fig):
        def go(run_no: int) -> float:
            job = f"bench-rpc-{uuid.uuid4().hex[:8]}"
            agg = _checked(one.run(lambda i: {"target": sidecar.address, "job": job,
                                              "props": POLICY_ONLY, "records": records,
                                              "batch": batch, "run_no": run_no}), "rpc")
            return agg.rate, {lat_fig: agg.p50_ms}
        return go

    f_echo_single = result.figure("echo server, 1 record/report (gRPC floor, informational)",
                                  "records/s")
    f_echo_batched = result.figure(
        f"echo server, {BATCH} records/report (informational)", "records/s")

    def run_echo(batch: int, records: int):
        def go(run_no: int) -> float:
            agg = _checked(one.run(lambda i: {"target": echo_addr, "job": "bench-echo",
                                              "props": POLICY_ONLY, "records": records,
                                              "batch": batch, "run_no": run_no}), "echo")
            return agg.rate
        return go

    alternate_runs(ctx, result, {
        f_single.name: run_single(1, sz.rpc_single, lat_single),
        f_batched.name: run_single(BATCH, sz.rpc_batched, lat_batched),
        f_echo_single.name: run_echo(1, sz.rpc_single),
        f_echo_batched.name: run_echo(BATCH, sz.rpc_batched),
    }, {f.name: f for f in (f_single, f_batched, f_echo_single, f_echo_batched)},
        warmup=True, label="(a) ")
    result.checks.append(ratio_check(f"(a) {BATCH} vs 1 record per report", f_batched, f_single,
                                     ">=", 50.0))

    pool = ClientPool(ECHO_CLIENTS)
    ctx.infra.on_close(pool.close)
    f_echo = result.figure(f"echo server, {ECHO_CLIENTS} clients", "records/s")
    f_side = result.figure(f"sidecar, {ECHO_CLIENTS} clients", "records/s")

    def run_pool(target: str):
        def go(run_no: int) -> float:
            job = f"bench-rpc-{uuid.uuid4().hex[:8]}"
            agg = _checked(pool.run(lambda i: {"target": target, "job": job,
                                               "props": POLICY_ONLY,
                                               "records": sz.rpc_per_client, "batch": BATCH,
                                               "run_no": run_no}), "rpc")
            return agg.rate
        return go

    alternate_runs(ctx, result, {f_echo.name: run_pool(echo_addr),
                                 f_side.name: run_pool(sidecar.address)},
                   {f_echo.name: f_echo, f_side.name: f_side}, warmup=True, label="(b) ")
    result.checks.append(ratio_check("(b) sidecar vs bare echo server", f_side, f_echo,
                                     ">=", 0.8))
    result.notes.append(
        f"At 1 record per report the rate is one round trip per record: p50 "
        f"{fmt(lat_single.summary.median)} ms client-observed; the bare echo server does "
        f"{fmt(f_echo_single.summary.median)} records/s at 1 record per report (the floor of a "
        f"synchronous grpcio unary call on this machine) and "
        f"{fmt(f_echo_batched.summary.median)} at {BATCH}: the sidecar's batched rate is bounded "
        "by its per-record work, not by the RPC.")

    _run_tls(ctx, result, sidecar, one)

    if ctx.sizes.profile and result.met is False:
        if result.checks[0].met is False:
            job = f"bench-rpc-{uuid.uuid4().hex[:8]}"
            profiled(ctx, result, "sidecar process, 1 record per report (a)",
                     [sidecar.pid], lambda: one.run(lambda i: {
                         "target": sidecar.address, "job": job, "props": POLICY_ONLY,
                         "records": sz.rpc_single, "batch": 1}), label="rpc-single-sidecar")
            job = f"bench-rpc-{uuid.uuid4().hex[:8]}"
            profiled(ctx, result, "client process, 1 record per report (a)",
                     one.pids, lambda: one.run(lambda i: {
                         "target": sidecar.address, "job": job, "props": POLICY_ONLY,
                         "records": sz.rpc_single, "batch": 1}), label="rpc-single-client")
            job = f"bench-rpc-{uuid.uuid4().hex[:8]}"
            profiled(ctx, result, f"sidecar process, {BATCH} records per report (a)",
                     [sidecar.pid], lambda: one.run(lambda i: {
                         "target": sidecar.address, "job": job, "props": POLICY_ONLY,
                         "records": sz.rpc_batched, "batch": BATCH}),
                     label="rpc-batched-sidecar")
        if result.checks[1].met is False:
            job = f"bench-rpc-{uuid.uuid4().hex[:8]}"
            profiled(ctx, result, f"sidecar process, {ECHO_CLIENTS} clients (b)",
                     [sidecar.pid], lambda: pool.run(lambda i: {
                         "target": sidecar.address, "job": job, "props": POLICY_ONLY,
                         "records": sz.rpc_per_client, "batch": BATCH}),
                     label="rpc-pool-sidecar")


def _tls_material(workdir: str) -> dict[str, str]:
    """A test CA, the sidecar's certificate (127.0.0.1), a client certificate and a node token,
    generated with `cryptography` (the helper the tests use)."""
    from tests.support.tls import Ca, write_token

    base = Path(workdir) / f"tls-{uuid.uuid4().hex[:6]}"
    ca = Ca.create(base / "ca")
    server = ca.issue(base / "server", "bench-sidecar")
    client = ca.issue(base / "client", "bench-executor", dns=("bench-executor",), ips=())
    token = write_token(base / "node.token", uuid.uuid4().hex)
    return {"ca": str(ca.path), "server_cert": str(server.cert),
            "server_key": str(server.key), "client_cert": str(client.cert),
            "client_key": str(client.key), "token": str(token)}


def _run_tls(ctx: Context, result: TargetResult, plain, plain_pool: ClientPool) -> None:
    """(c) the same client and reports over mutual TLS with a node token vs plaintext."""
    sz = ctx.sizes
    tls = _tls_material(ctx.infra.workdir)
    secure = ctx.infra.sidecar(name="rpc-tls", props={
        "tls.cert.file": tls["server_cert"], "tls.key.file": tls["server_key"],
        "tls.ca.file": tls["ca"], "auth.token.file": tls["token"]})
    pool = ClientPool(1, env={"SPILLWAY_TLS_CA_FILE": tls["ca"],
                              "SPILLWAY_TLS_CERT_FILE": tls["client_cert"],
                              "SPILLWAY_TLS_KEY_FILE": tls["client_key"],
                              "SPILLWAY_TOKEN_FILE": tls["token"]})
    ctx.infra.on_close(pool.close)
    result.setup += (
        f" (c) one client at 1 and at {BATCH} records per report, to a sidecar serving "
        "mutual TLS with a node token (test certificates, ECDSA P-256) vs the plaintext "
        "loopback sidecar, alternated in the same run.")
    figs = {}

    def variant(name: str, target: str, p: ClientPool, batch: int, records: int):
        fig = figs[name] = result.figure(name, "records/s")

        def go(run_no: int) -> float:
            job = f"bench-rpc-{uuid.uuid4().hex[:8]}"
            return _checked(p.run(lambda i: {"target": target, "job": job,
                                             "props": POLICY_ONLY, "records": records,
                                             "batch": batch, "run_no": run_no}), name).rate
        return fig.name, go

    variants = dict([
        variant("plaintext, 1 record/report", plain.address, plain_pool, 1, sz.rpc_single),
        variant("mTLS + token, 1 record/report", secure.address, pool, 1, sz.rpc_single),
        variant(f"plaintext, {BATCH} records/report", plain.address, plain_pool, BATCH,
                sz.rpc_batched),
        variant(f"mTLS + token, {BATCH} records/report", secure.address, pool, BATCH,
                sz.rpc_batched),
    ])
    alternate_runs(ctx, result, variants, figs, warmup=True, label="(c) ")
    tls_b, plain_b = (figs[f"mTLS + token, {BATCH} records/report"],
                      figs[f"plaintext, {BATCH} records/report"])
    tls_1, plain_1 = (figs["mTLS + token, 1 record/report"],
                      figs["plaintext, 1 record/report"])
    result.checks.append(ratio_check(
        f"(c) mTLS + token vs plaintext, {BATCH} records per report", tls_b, plain_b, ">=", 0.8))
    result.notes.append(
        f"Transport security costs: at 1 record per report mTLS + token does "
        f"{fmt(tls_1.summary.median)} records/s vs {fmt(plain_1.summary.median)} in plaintext; "
        f"at {BATCH} per report {fmt(tls_b.summary.median)} vs {fmt(plain_b.summary.median)} "
        "(one TLS connection per client process, kept open: the handshake is not measured).")


def run_many(ctx: Context, result: TargetResult) -> None:
    sz = ctx.sizes
    result.setup = (
        f"{FEW} vs {MANY} client processes (the real `SidecarClient`, one process per "
        f"'executor', each its own task attempt) report {sz.many_total:,} failed records in all "
        f"per run, {BATCH} per report, split evenly, all started at once; each then calls the "
        "flush barrier (FlushTask). The job dead-letters to a fresh topic per run; the sidecar "
        "(its own process, spool on) writes it to Tansu. Aggregate rate = records / (first "
        "start → last flush returned). Latency is per ReportFailures call, client-observed.")
    sidecar = ctx.infra.sidecar(name="many")
    few = ClientPool(FEW)
    ctx.infra.on_close(few.close)
    many = ClientPool(MANY)
    ctx.infra.on_close(many.close)
    f_few = result.figure(f"{FEW} clients, aggregate", "records/s")
    f_many = result.figure(f"{MANY} clients, aggregate", "records/s")
    p99_few = result.figure(f"{FEW} clients, ReportFailures p99", "ms")
    p99_many = result.figure(f"{MANY} clients, ReportFailures p99", "ms")
    p50_many = result.figure(f"{MANY} clients, ReportFailures p50", "ms")
    errors = {"n": 0, "samples": []}

    def go_with(pool: ClientPool, n: int, p99_fig, p50_fig=None):
        def go(run_no: int) -> float:
            topic = ctx.infra.fresh_topic("many")
            job = f"bench-many-{uuid.uuid4().hex[:8]}"
            per = sz.many_total // n
            agg = pool.run(lambda i: {"target": sidecar.address, "job": job,
                                      "props": dlq_props(topic), "records": per,
                                      "batch": BATCH, "flush": True, "run_no": run_no})
            errors["n"] += agg.errors + (1 if agg.timed_out else 0)
            errors["samples"] += list(agg.error_samples)
            if agg.acked is not None and agg.acked != agg.records:
                errors["n"] += 1
                errors["samples"].append(f"flush acknowledged {agg.acked} of {agg.records}")
            extras = {p99_fig: agg.p99_ms}
            if p50_fig is not None:
                extras[p50_fig] = agg.p50_ms
            return agg.rate, extras
        return go

    alternate_runs(ctx, result, {f_few.name: go_with(few, FEW, p99_few),
                                 f_many.name: go_with(many, MANY, p99_many, p50_many)},
                   {f_few.name: f_few, f_many.name: f_many}, warmup=True)
    result.checks.append(ratio_check(f"{MANY} vs {FEW} clients, aggregate rate", f_many, f_few,
                                     ">=", 0.8))
    result.checks.append(absolute_check("client errors (all runs, both variants)",
                                        float(errors["n"]), "==", 0.0, "errors",
                                        "; ".join(errors["samples"][:3])))
    result.notes.append(
        f"p99 ReportFailures latency with {MANY} clients: median over runs "
        f"{fmt(p99_many.summary.median)} ms (p50 {fmt(p50_many.summary.median)} ms); "
        f"with {FEW}: {fmt(p99_few.summary.median)} ms.")
    if ctx.sizes.profile and result.checks[0].met is False:
        topic = ctx.infra.fresh_topic("many")
        job = f"bench-many-{uuid.uuid4().hex[:8]}"
        profiled(ctx, result, f"sidecar process, {MANY} clients", [sidecar.pid],
                 lambda: many.run(lambda i: {"target": sidecar.address, "job": job,
                                             "props": dlq_props(topic),
                                             "records": sz.many_total // MANY, "batch": BATCH,
                                             "flush": True}), label="many-sidecar")
