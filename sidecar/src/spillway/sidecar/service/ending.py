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
from spillway.sidecar.core.policy import PolicyEngine
from spillway.sidecar.errors import JobAccessError
from spillway.sidecar.federation import siblings
from spillway.sidecar.federation.confirm import Confirmations
from spillway.sidecar.federation.peers import HomeError, end_on_node
from spillway.sidecar.runtime.memtune import Trimmer
from spillway.sidecar.service.ended import EndedRuns
from spillway.sidecar.service.identity import Identity
from spillway.sidecar.service.registry import (
    Caller,
    Registry,
    Run,
    access_error,
    check_run_id,
    may_end,
)
from spillway.sidecar.service.runstate import RunStore
from spillway.sidecar.service.values import Ended, RunSummary

if TYPE_CHECKING:
    from spillway.sidecar.dlq import DlqPipeline

log = logging.getLogger("spillway.sidecar")


class Ending:
    """EndJob and the reaper's expiry, over the live runs, the engine, the ended runs (a run's
    final summary kept, its counts added to the totals), the runs' durable state, the DLQ
    pipeline (its records drained first), a node's confirmations (its held reports confirmed
    first) and the heap trimmer (ended runs' memory handed back)."""

    def __init__(self, *, identity: Identity, registry: Registry, engine: PolicyEngine,
                 ended: EndedRuns, runstate: RunStore | None,
                 pipeline: DlqPipeline | None, confirmations: Confirmations | None,
                 trimmer: Trimmer) -> None:
        self._me = identity
        self._registry = registry
        self._engine = engine
        self._ended = ended
        self._runstate = runstate
        self._pipeline = pipeline
        self._confirmations = confirmations
        self._trimmer = trimmer

    def end_job(self, job: str, run_id: str, *, local_only: bool, token: str | None,
                caller: Caller, timeout_s: float) -> Ended:
        """Waits (within the deadline) for the run's DLQ records, releases it here and, at its
        home, on every node sidecar that registered it. ``local_only``: the home releasing
        the run on this node (a peer's call)."""
        run_id = check_run_id(run_id)
        if local_only and not caller.peer:
            raise JobAccessError("EndJob.local_only is for sidecar-to-sidecar calls only "
                                 "(an authenticated peer)")
        me, registry = self._me, self._registry
        run = registry.get(job, run_id)
        if run is None:
            owner = "" if local_only else me.owner_elsewhere(job, run_id)
            if owner and token:  # homed at another process of this sidecar (siblings.py)
                return siblings.end_at_owner(me.local, owner, job, run_id, token, timeout_s)
            raise siblings.unknown_here(owner, job, run_id)
        if not may_end(caller, run.digest, token, local_only=local_only):
            raise access_error(job, run_id, token)
        deadline = time.monotonic() + timeout_s
        out = Ended()
        if run.home is not None and not local_only:
            # ended at its home, which releases it on every node (this one included)
            try:
                out = run.home.end(job, run_id, token=token, timeout_s=timeout_s)
            except HomeError as exc:
                out.unreachable.append(run.home.address)
                log.warning("job %r run %r: could not end it at its home: %s", job, run_id, exc)
            if registry.get(job, run_id) is not run:
                return out
        if run.home is None and not local_only:
            # the nodes first: while they end the run here still answers their held reports
            for node in sorted(run.nodes):
                remaining = deadline - time.monotonic()
                try:
                    answer = end_on_node(me.local, node, job, run_id, token=token,
                                         timeout_s=min(max(remaining, 0.1), 10.0))
                    out.summaries.extend(answer.summaries)
                except HomeError as exc:
                    if exc.code == grpc.StatusCode.NOT_FOUND:
                        continue  # released there already (or it never recorded the run)
                    out.unreachable.append(node)
                    log.warning("job %r run %r: could not release it on node sidecar %s (it "
                                "ends there on its idle timeout): %s", job, run_id, node, exc)
        summary = self.release(run, deadline)
        if summary is not None:
            out.summaries.insert(0, summary)
        return out

    def release(self, run: Run, deadline: float, *, expired: bool = False
                ) -> RunSummary | None:
        """Release `run` here: its held reports confirmed and its DLQ records drained (within
        the deadline; not when it expired), then the registry and the engine together."""
        pending = 0
        pipeline, registry = self._pipeline, self._registry
        if run.home is not None and self._confirmations is not None:
            # held reports confirmed while the home still has the run (it ends its nodes
            # first); past the deadline, or expired, they are written as they are
            self._confirmations.wait_run(run.key, 0.0 if expired else
                                         max(0.0, deadline - time.monotonic()))
        if pipeline is not None and not expired:  # the run stays live while it drains
            pending = pipeline.wait_run(run.key + "/", max(0.0, deadline - time.monotonic()))
        with registry.create_lock:  # never half released: registry and engine together
            if not registry.remove(run, expired=expired):
                return None  # released meanwhile by another EndJob or the reaper
            # out of the engine and into the ended runs as one step for the totals' readers
            final = self._ended.record(lambda: self._engine.end_job(run.key), key=run.key,
                                       expired=expired, started=run.started,
                                       home=run.home_address, digest=run.digest)
            if self._runstate is not None and run.home is None:
                self._runstate.drop(run.key)
        if pipeline is not None:  # the run is gone: no FlushTask can ask for its counts
            pipeline.forget_run(run.key + "/")
        if run.home is not None:
            run.home.close()
        self._trimmer.freed()
        if pending:
            log.warning("job %r run %r ended with %d DLQ record(s) not yet acknowledged by "
                        "Kafka; they stay spooled and will be delivered", run.job, run.run_id,
                        pending)
        how = "expired after %.0f s idle" % registry.idle_timeout_s if expired else "ended"
        log.info("job %r run %r %s", run.job, run.run_id, how)
        return RunSummary(final, self._me.sidecar_id) if final is not None else None

    def expire(self, run: Run) -> None:
        """The reaper's: a run nobody called for job.idle.timeout.ms."""
        if run.last_active >= time.monotonic() - self._registry.idle_timeout_s:
            return  # touched since it was picked
        self.release(run, time.monotonic(), expired=True)


__all__ = ["Ending"]
