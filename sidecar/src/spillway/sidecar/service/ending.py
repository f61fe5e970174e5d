"""Ending a run (EndJob, idle expiry): at its home, on its nodes first (they confirm the
reports they hold while the home still has the run, confirm.py), then at the home itself; on a
node, at its home, which ends it on every node. Releasing a run waits (within the deadline) for
its held reports and its DLQ records, then drops it from the registry and the engine together.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import grpc
from spillway.sidecar.errors import JobAccessError
from spillway.sidecar.federation import siblings
from spillway.sidecar.federation.peers import HomeError, end_on_node
from spillway.sidecar.service.registry import Caller, Run, access_error, check_run_id, may_end
from spillway.sidecar.transport import convert
from spillway.v1 import sidecar_pb2 as pb

if TYPE_CHECKING:
    from spillway.sidecar.service.sidecar import Sidecar

log = logging.getLogger("spillway.sidecar")


def end_job(s: Sidecar, request: pb.EndJobRequest, *, token: str | None, caller: Caller,
            timeout_s: float) -> pb.EndJobResponse:
    """Waits (within the deadline) for the run's DLQ records, releases it here and, at its
    home, on every node sidecar that registered it."""
    job, run_id = request.job, check_run_id(request.run_id)
    if request.local_only and not caller.peer:
        raise JobAccessError("EndJob.local_only is for sidecar-to-sidecar calls only "
                             "(an authenticated peer)")
    run = s.registry.get(job, run_id)
    if run is None:
        owner = ("" if request.local_only else
                 siblings.elsewhere(s.siblings, s.advertised_address, job, run_id))
        if owner and token:  # homed at another process of this sidecar (siblings.py)
            return siblings.end_at_owner(s.local, owner, job, run_id, token, timeout_s)
        raise siblings.unknown_here(owner, job, run_id)
    if not may_end(caller, run.digest, token, local_only=request.local_only):
        raise access_error(job, run_id, token)
    deadline = time.monotonic() + timeout_s
    out = pb.EndJobResponse()
    if run.home is not None and not request.local_only:
        # ended at its home, which releases it on every node (this one included)
        try:
            answer = run.home.end(job, run_id, token=token, timeout_s=timeout_s)
            out.CopyFrom(answer)
        except HomeError as exc:
            out.unreachable.append(run.home.address)
            log.warning("job %r run %r: could not end it at its home: %s", job, run_id, exc)
        if s.registry.get(job, run_id) is not run:
            return out
    if run.home is None and not request.local_only:
        # the nodes first: while they end the run here still answers their held reports
        for node in sorted(run.nodes):
            remaining = deadline - time.monotonic()
            try:
                answer = end_on_node(s.local, node, job, run_id, token=token,
                                     timeout_s=min(max(remaining, 0.1), 10.0))
                out.summaries.extend(answer.summaries)
            except HomeError as exc:
                if exc.code == grpc.StatusCode.NOT_FOUND:
                    continue  # released there already (or it never recorded the run)
                out.unreachable.append(node)
                log.warning("job %r run %r: could not release it on node sidecar %s (it "
                            "ends there on its idle timeout): %s", job, run_id, node, exc)
    summary = release(s, run, deadline)
    if summary is not None:
        out.summaries.insert(0, summary)
    return out


def release(s: Sidecar, run: Run, deadline: float, *, expired: bool = False
            ) -> pb.JobSummary | None:
    """Release `run` here: its held reports confirmed and its DLQ records drained (within
    the deadline; not when it expired), then the registry and the engine together."""
    pending = 0
    if run.home is not None and s.confirmations is not None:
        # held reports confirmed while the home still has the run (it ends its nodes
        # first); past the deadline, or expired, they are written as they are
        s.confirmations.wait_run(run.key, 0.0 if expired else
                                 max(0.0, deadline - time.monotonic()))
    if s.pipeline is not None and not expired:  # the run stays live while it drains
        pending = s.pipeline.wait_run(run.key + "/", max(0.0, deadline - time.monotonic()))
    with s.registry.create_lock:  # never half released: registry and engine together
        if not s.registry.remove(run, expired=expired):
            return None  # released meanwhile by another EndJob or the reaper
        final = s.engine.end_job(run.key)
        if s.runstate is not None and run.home is None:
            s.runstate.drop(run.key)
    if s.pipeline is not None:  # the run is gone: no FlushTask can ask for its counts
        s.pipeline.forget_run(run.key + "/")
    if run.home is not None:
        run.home.close()
    s.trimmer.freed()
    if pending:
        log.warning("job %r run %r ended with %d DLQ record(s) not yet acknowledged by "
                    "Kafka; they stay spooled and will be delivered", run.job, run.run_id,
                    pending)
    how = "expired after %.0f s idle" % s.registry.idle_timeout_s if expired else "ended"
    log.info("job %r run %r %s", run.job, run.run_id, how)
    return convert.summary_to_pb(final, s.sidecar_id) if final is not None else None

def expire(s: Sidecar, run: Run) -> None:
    """The reaper's: a run nobody called for job.idle.timeout.ms."""
    if run.last_active >= time.monotonic() - s.registry.idle_timeout_s:
        return  # touched since it was picked
    release(s, run, time.monotonic(), expired=True)


__all__ = ["end_job", "expire", "release"]
