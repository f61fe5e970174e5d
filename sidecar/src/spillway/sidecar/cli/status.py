"""`spillway status`: a sidecar's counters, the totals that outlive its runs, the runs that
ended (the last ``status.ended.runs.max``) and the live ones (docs/OBSERVABILITY.md).

    spillway status [--sidecar ADDR] [--json] [--timeout S] [credentials]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable

from spillway.sidecar.cli.operator import cannot_see
from spillway.v1 import sidecar_pb2 as pb


def to_dict(message) -> dict:
    """A message as JSON-ready data with every field, zeros and false included (a reader of
    ``--json`` finds each key the text output shows)."""
    from google.protobuf.json_format import MessageToDict

    return MessageToDict(message, always_print_fields_with_no_presence=True)


def counts_line(s: pb.JobSummary) -> str:
    return (f"processed={s.records_processed} failures={s.total_record_failures} "
            f"errors={s.total_record_errors} skipped={s.total_records_skipped} "
            f"retries={s.total_retries} errors-logged={s.total_errors_logged} "
            f"dropped={s.dropped_records} dlq-written={s.dlq_records_written}")


def _when(ms: int) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ms / 1000)) if ms else "-"


def _show(value: float) -> int | float:
    return int(value) if float(value).is_integer() else round(value, 3)


def render(status: pb.SidecarStatus, target: str) -> list[str]:
    """The text output, line by line."""
    out = [f"sidecar {status.sidecar_id} (spillway {status.version}) at {target}",
           "counters (the runs' KIP-298 counts: live runs only; the totals below add the "
           "ended runs):"]
    width = max((len(k) for k in status.counters), default=10)
    for name in sorted(status.counters):
        out.append(f"  {name:<{width}}  {_show(status.counters[name]):>14}")
    if status.HasField("totals"):
        t = status.totals
        ended = " ".join(f"{k}={t.runs_ended[k]}" for k in sorted(t.runs_ended))
        out.append(f"totals since {_when(t.since_ms)} (live and ended runs):")
        for name, value in (("runs-ended", ended or "0"),
                            ("records-processed", t.records_processed),
                            ("total-record-failures", t.total_record_failures),
                            ("total-record-errors", t.total_record_errors),
                            ("total-records-skipped", t.total_records_skipped),
                            ("total-retries", t.total_retries),
                            ("total-errors-logged", t.total_errors_logged),
                            ("dropped-records", t.dropped_records),
                            ("dlq-records-written", t.dlq_records_written)):
            out.append(f"  {name:<21}  {value:>14}")
    if status.ended_runs:
        out.append(f"ended runs: {len(status.ended_runs)} shown, newest first")
    for r in status.ended_runs:
        s = r.summary
        why = f": {s.failure_reason}" if s.failure_reason else ""
        node = f", a node's copy (home {r.home})" if r.home else ""
        out.append(f"ended {s.job}: {r.outcome}{why} (run {s.run_id}{node}; "
                   f"{_when(r.started_ms)} to {_when(r.ended_ms)})")
        out.append("  " + counts_line(s))
    failed = [j for j in status.jobs if j.failed]
    if status.jobs:
        out.append(f"jobs: {len(status.jobs)} shown, {len(failed)} failed"
                   + (f" ({', '.join(j.job for j in failed[:10])}"
                      f"{', ...' if len(failed) > 10 else ''})" if failed else ""))
    for job in failed + [j for j in status.jobs if not j.failed]:  # failed ones first
        state = f"FAILED: {job.failure_reason}" if job.failed else "running"
        out.append(f"job {job.job}: {state} (run {job.run_id})")
        out.append("  " + counts_line(job))
    return out


def all_pages(client, job: str = "") -> pb.SidecarStatus:
    """GetStatus's first page with the runs of every later page appended (counters, totals,
    ended runs and the sidecar's identity come from the first)."""
    status = client.status(job)
    token = status.next_page_token
    while token:
        page = client.status(job, page_token=token)
        status.jobs.extend(page.jobs)
        token = page.next_page_token
    status.next_page_token = ""
    return status


def hidden_runs(status: pb.SidecarStatus, job: str) -> int:
    """Live runs (of ``job``) the sidecar did not show this caller; from the counters when the
    sidecar predates ``jobs_hidden`` (all jobs only)."""
    if status.jobs_hidden or job:
        return status.jobs_hidden
    return max(0, int(status.counters.get("jobs", 0)) - status.jobs_total)


def cmd_status(args: argparse.Namespace, make_client: Callable) -> int:
    client = make_client(args)
    status = all_pages(client)  # every run, a page at a time
    if args.json:
        print(json.dumps(to_dict(status), indent=2, sort_keys=True))
    else:
        print("\n".join(render(status, client.target)))
    hidden = hidden_runs(status, "")
    if hidden:   # the counters and totals are whole: a note, not a failure
        print(f"spillway: {hidden} live run(s) not shown: " + cannot_see(args),
              file=sys.stderr)
    return 0


def add_status_command(sub, add_security_args: Callable, make_client: Callable) -> None:
    st = sub.add_parser("status", help="counters of a running sidecar, the totals that "
                                       "outlive its runs, its ended and live runs")
    st.add_argument("--sidecar", help="address (default $SPILLWAY_SIDECAR_ADDRESS or "
                                      "127.0.0.1:50051)")
    st.add_argument("--timeout", type=float, default=5.0,
                    help="deadline of each call to the sidecar, seconds")
    st.add_argument("--json", action="store_true",
                    help="print the sidecar's answer (SidecarStatus: counters, totals, "
                         "ended_runs, jobs) as JSON, every field included")
    add_security_args(st)
    st.set_defaults(func=lambda a: cmd_status(a, make_client))
