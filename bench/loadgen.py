"""Client processes for the RPC benchmarks (targets 2, 5, 7, 8): each one is an "executor" that
reports failed records to a sidecar through the real `spillway.client.SidecarClient`.

Processes, not threads, so that the clients' own Python work is not serialized by one GIL.
The harness drives each process over stdin/stdout, one JSON object per line:

    -> {"op": "prepare", ...run settings...}   <- {"prepared": true}
    -> {"op": "go"}                            <- {"records": ..., "t0": ..., "t1": ..., ...}
    -> {"op": "quit"}

`prepare` connects (health check), registers the job when given its properties (first at the
run's home when given ``home``: a node sidecar that forwards) and builds the record template,
so that `go` only reports: the harness sends `go` to every process at once and takes the
aggregate window from the earliest t0 to the latest t1 (CLOCK_MONOTONIC is shared by all
processes of the machine). With ``peer_token_file`` a process stands in for a node sidecar:
its reports go straight to the home as a node sends them (TallyFailures).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
import traceback

from .records import SOURCE_TOPIC, key_bytes, poison_exception, value_bytes


def _template(value_size: int):
    from spillway.client import report

    return report.failed_record(
        "template", "TRANSFORMATION", poison_exception(0),
        function_name="bench.workloads.parse_order", source=(SOURCE_TOPIC, 0, 0),
        key=key_bytes(0), value=value_bytes(0, value_size), timestamp_ms=1763700000000)


def _failure_template(value_size: int):
    from spillway.client import columns

    return columns.failure(
        "template", "TRANSFORMATION", poison_exception(0),
        function_name="bench.workloads.parse_order", source=(SOURCE_TOPIC, 0, 0),
        key=key_bytes(0), value=value_bytes(0, value_size), timestamp_ms=1763700000000)


class Run:
    def __init__(self, cmd: dict) -> None:
        from spillway.client import SidecarClient
        from spillway.v1 import sidecar_pb2 as pb

        self.pb = pb
        self.cmd = cmd
        self.job = cmd["job"]
        self.records = int(cmd["records"])
        self.batch = int(cmd["batch"])
        self.flush = bool(cmd.get("flush", False))
        self.deadline_s = float(cmd.get("deadline_s", 600))
        self.index = int(cmd.get("index", 0))
        self.prefix = f"{cmd.get('run_id', 'r')}-{self.index}"
        self.client = SidecarClient(cmd["target"], timeout_s=float(cmd.get("timeout_s", 60)))
        self.client.health()  # connect before the clock starts
        if cmd.get("props") is not None:
            # every client of a pool reports for one run of the job: the same run id and a
            # token they all present (the first registration adopts it)
            from spillway.client.runs import JobRun, JobToken

            run = JobRun(self.job, "bench", JobToken(f"bench-token-{self.job}"))
            if cmd.get("home_registered"):
                # the run was registered at its home by the harness, as a driver in its own
                # process: this executor registers only at its node, naming that home
                home = cmd["home_registered"]
                self.job = self.client.register_job(run, cmd["props"], home=home["home"],
                                                    home_instance_id=home["home_instance_id"])
            elif cmd.get("home"):
                # a cluster: the run is registered at its home first (as the driver does), then
                # at this executor's node sidecar naming that home, which forwards each report
                # to it (decide_only) and dead-letters locally
                home = SidecarClient(cmd["home"], timeout_s=float(cmd.get("timeout_s", 60)))
                try:
                    reg = home.register_job(run, cmd["props"])
                finally:
                    home.close()
                self.job = self.client.register_job(reg.run(), cmd["props"], home=reg.home,
                                                    home_instance_id=reg.home_instance_id)
            else:
                self.job = self.client.register_job(run, cmd["props"])
        run_no = int(cmd.get("run_no", 1))
        self.task = pb.TaskIdentity(stage_id=run_no, partition_id=self.index, attempt_number=0,
                                    task_attempt_id=run_no * 100_000 + self.index,
                                    executor_id=str(self.index), host=socket.gethostname())
        self.tpl = _template(int(cmd.get("value_size", 200)))
        # as the Spark integration reports (columns, to a sidecar that takes them), unless the
        # run compares against FailedRecord messages
        self.ftpl = _failure_template(int(cmd.get("value_size", 200))) \
            if cmd.get("columns", True) else None
        self.decide = None
        if cmd.get("peer_token_file"):
            self.decide = self._decide_only(cmd["target"], cmd["peer_token_file"])

    def _decide_only(self, target: str, token_file: str):
        """Stand in for node sidecars: each report goes straight to the home as a node sends it
        (TallyFailures: ids, payload digests keyed by the run, one group, with the peer
        token), so the home is loaded without a node's own work."""
        import types

        import grpc

        from spillway.client.columns import DEAD_LETTER
        from spillway.sidecar.core.tolerance import payload_tag, run_secret
        from spillway.v1 import sidecar_pb2_grpc

        with open(token_file, encoding="utf-8") as fh:
            peer = fh.read().split()[0]
        mb = 64 * 1024 * 1024
        stub = sidecar_pb2_grpc.ErrorSidecarStub(grpc.insecure_channel(target, options=[
            ("grpc.max_send_message_length", mb), ("grpc.max_receive_message_length", mb)]))
        metadata = [("spillway-peer-token", peer), *self.job.metadata()]
        timeout = float(self.cmd.get("timeout_s", 60))
        secret = run_secret(self.job.job_token.reveal())
        tpl = self.tpl
        exc = self.pb.ExceptionInfo()
        exc.CopyFrom(tpl.exception)
        exc.ClearField("stack_trace")

        def decide(recs: list) -> list:
            req = self.pb.TallyRequest(job=self.job.job, run_id=self.job.run_id)
            report = req.reports.add(
                task=self.task, record_ids=[r.record_id for r in recs],
                payload_digests=b"".join(payload_tag(r.key, r.value, secret).to_bytes(8, "little")
                                         for r in recs))
            report.groups.add(count=len(recs), stage=tpl.stage, function_name=tpl.function_name,
                              exception=exc)
            v = stub.TallyFailures(req, timeout=timeout, metadata=metadata).reports[0]
            return [types.SimpleNamespace(action=a, dead_lettered=False,
                                          dead_letter=bool(f & DEAD_LETTER))
                    for a, f in zip(v.actions, v.flags, strict=True)]
        return decide

    def _batch(self, start: int, n: int) -> list:
        if self.ftpl is not None:
            t, prefix, part = self.ftpl, self.prefix, self.index
            topic = t.source[0]
            return [t.derive(f"{prefix}-{i}", (topic, part, i)) for i in range(start, start + n)]
        pb, tpl, prefix = self.pb, self.tpl, self.prefix
        out = []
        for i in range(start, start + n):
            r = pb.FailedRecord()
            r.CopyFrom(tpl)
            r.record_id = f"{prefix}-{i}"
            r.source.partition = self.index
            r.source.offset = i
            out.append(r)
        return out

    def go(self) -> dict:
        pb = self.pb
        lat: list[float] = []
        errors = 0
        error_samples: list[str] = []
        actions: dict[str, int] = {}
        dead_lettered = 0
        sent = 0
        acked = None
        t0 = time.monotonic()
        deadline = t0 + self.deadline_s
        while sent < self.records and time.monotonic() < deadline:
            n = min(self.batch, self.records - sent)
            recs = self._batch(sent, n)
            s = time.perf_counter()
            try:
                verdicts = (self.decide(recs) if self.decide is not None
                            else self.client.report_failures(self.job, self.task, recs))
            except Exception as exc:  # noqa: BLE001 - counted and reported, never hidden
                errors += 1
                if len(error_samples) < 3:
                    error_samples.append(f"{type(exc).__name__}: {exc}"[:300])
                if errors > 50:
                    break
                continue
            lat.append(time.perf_counter() - s)
            for v in verdicts:
                name = pb.Action.Name(v.action)
                actions[name] = actions.get(name, 0) + 1
                dead_lettered += v.dead_lettered or v.dead_letter  # the latter: decide_only
            sent += n
        t_reported = time.monotonic()
        if self.flush:
            try:
                acked = self.client.flush_task(self.job, self.task, {"TRANSFORMATION": sent},
                                               timeout_s=max(1.0, deadline - time.monotonic()))
            except Exception as exc:  # noqa: BLE001
                errors += 1
                error_samples.append(f"flush: {type(exc).__name__}: {exc}"[:300])
        t1 = time.monotonic()
        return {"records": sent, "reports": len(lat), "errors": errors,
                "error_samples": error_samples, "actions": actions,
                "dead_lettered": dead_lettered, "acked": acked, "t0": t0,
                "t_reported": t_reported, "t1": t1, "lat_s": lat,
                "timed_out": sent < self.records}


def main() -> int:
    out = sys.stdout
    out.write(json.dumps({"ready": True, "pid": os.getpid()}) + "\n")
    out.flush()
    run: Run | None = None
    for line in sys.stdin:
        line = line.strip()
        if not line:
            continue
        cmd = json.loads(line)
        op = cmd.get("op")
        try:
            if op == "prepare":
                run = Run(cmd)
                reply = {"prepared": True}
            elif op == "go":
                if run is None:
                    raise RuntimeError("go before prepare")
                reply = run.go()
            elif op == "quit":
                break
            else:
                raise ValueError(f"unknown op {op!r}")
        except Exception as exc:  # noqa: BLE001 - reported to the harness
            reply = {"error": f"{type(exc).__name__}: {exc}",
                     "traceback": traceback.format_exc()[-2000:]}
        out.write(json.dumps(reply) + "\n")
        out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
