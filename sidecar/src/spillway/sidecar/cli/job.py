"""`spillway job list|end|forget`: the operator's view of job runs (see docs/DEPLOY.md).

    spillway job list [--job NAME] [--sidecar ADDR] [--json]
    spillway job end NAME [--run RUN_ID] [--sidecar ADDR] [--timeout S]
    spillway job forget NAME --run RUN_ID [--spool-dir DIR]

`list` and `end` page through GetStatus (every run, whatever their number) and need an operator's
credential (``--admin-token-file`` or ``$SPILLWAY_ADMIN_TOKEN_FILE``; the local credential of
the sidecar's OS user for a sidecar on this host with none configured, cli/operator.py): an
operator sees and may end every run; any other caller sees only the runs whose job token it
holds, so where the sidecar has live runs this caller may not see, both say so, name the
credential that would, and exit 2.
`forget` works on the sidecar's spool directory itself (the state file is its owner's only).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable

import grpc

from spillway.sidecar.cli.operator import cannot_see
from spillway.sidecar.cli.status import all_pages, hidden_runs, to_dict
from spillway.v1 import sidecar_pb2 as pb


def _row(s: pb.JobSummary) -> str:
    state = "FAILED" if s.failed else "running"
    return (f"{s.job}\t{s.run_id}\t{state}\tprocessed={s.records_processed}\t"
            f"failures={s.total_record_failures}\terrors={s.total_record_errors}\t"
            f"skipped={s.total_records_skipped}\tdlq-written={s.dlq_records_written}")


def cmd_job_list(args: argparse.Namespace, make_client: Callable) -> int:
    client = make_client(args)
    status = all_pages(client, args.job or "")
    runs = list(status.jobs)
    if args.json:
        print(json.dumps([to_dict(s) for s in runs], indent=2, sort_keys=True))
    else:
        print(f"{len(runs)} live run(s) on {client.target}")
        for s in runs:
            print(_row(s))
    hidden = hidden_runs(status, args.job or "")
    if hidden:
        print(f"spillway: {hidden} live run(s) on {client.target} not shown: "
              + cannot_see(args), file=sys.stderr)
        return 2
    return 0


def cmd_job_end(args: argparse.Namespace, make_client: Callable) -> int:
    from spillway.client import SidecarAuthError
    from spillway.client.runs import JobRun

    client = make_client(args)
    hidden = 0
    if args.run:
        run_ids = [args.run]
    else:
        status = all_pages(client, args.name)
        run_ids = [s.run_id for s in status.jobs if s.job == args.name]
        hidden = hidden_runs(status, args.name)
    if not run_ids and not hidden:
        print(f"spillway: job {args.name!r} has no live run on {client.target}")
        return 1
    for run_id in run_ids:
        try:
            answer = client.end_job(JobRun(args.name, run_id), timeout_s=args.end_timeout)
        except SidecarAuthError as exc:
            if exc.code is not grpc.StatusCode.PERMISSION_DENIED:
                raise
            print(f"spillway: {exc}\nspillway: job {args.name!r} run {run_id!r} not ended: "
                  + cannot_see(args), file=sys.stderr)
            return 2
        print(f"ended job {args.name} run {run_id}")
        for s in answer.summaries:
            print("  " + _row(s) + f"\tsidecar={s.sidecar_id}")
        for node in answer.unreachable:
            print(f"  node sidecar {node} unreachable: it ends the run on its idle timeout")
    if hidden:
        print(f"spillway: {hidden} live run(s) of job {args.name!r} on {client.target} not "
              "shown and not ended: " + cannot_see(args), file=sys.stderr)
        return 2
    return 0


def cmd_job_forget(args: argparse.Namespace) -> int:
    """Drop the state a sidecar kept for a run whose kept state cannot be read (its
    RegisterJob answers DATA_LOSS naming this command); works on the spool directory, not
    through the sidecar, since the run is not registered there."""
    from spillway.sidecar.core.jobstate import run_key
    from spillway.sidecar.dlq import default_spool_dir
    from spillway.sidecar.service.runstate import forget

    directory = args.spool_dir or default_spool_dir()
    if forget(directory, run_key(args.name, args.run)):
        print(f"dropped the state kept for job {args.name} run {args.run} in {directory}: "
              "registered again, the run starts afresh")
        return 0
    print(f"spillway: no state is kept for job {args.name!r} run {args.run!r} in {directory}")
    return 1


def add_job_commands(sub, add_security_args: Callable, make_client: Callable) -> None:
    j = sub.add_parser("job", help="list, end or forget job runs (operator)")
    jsub = j.add_subparsers(dest="job_command", required=True)

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--sidecar", help="address (default $SPILLWAY_SIDECAR_ADDRESS or "
                                         "127.0.0.1:50051)")
        p.add_argument("--timeout", type=float, default=10.0, help="per call, seconds")
        add_security_args(p)

    ls = jsub.add_parser("list", help="the live runs, every page")
    ls.add_argument("--job", help="only this job's runs")
    ls.add_argument("--json", action="store_true",
                    help="print the runs as JSON: a list of JobSummary, every field "
                         "included (zeros and false too)")
    common(ls)
    ls.set_defaults(func=lambda a: cmd_job_list(a, make_client))

    end = jsub.add_parser("end", help="end a job's run (default: every live run of NAME), "
                                      "releasing its state at its home and on its nodes")
    end.add_argument("name", help="the job name")
    end.add_argument("--run", help="the run id (the Spark application id)")
    end.add_argument("--end-timeout", type=float, default=60.0,
                     help="how long the sidecar may wait for the run's DLQ records, seconds")
    common(end)
    end.set_defaults(func=lambda a: cmd_job_end(a, make_client))

    fg = jsub.add_parser("forget", help="drop the state a sidecar kept for a run before a "
                                        "restart (when it cannot be read: RegisterJob answers "
                                        "DATA_LOSS)")
    fg.add_argument("name", help="the job name")
    fg.add_argument("--run", required=True, help="the run id (the Spark application id)")
    fg.add_argument("--spool-dir", help="the sidecar's spool.dir (default: the per-user one)")
    fg.set_defaults(func=cmd_job_forget)
