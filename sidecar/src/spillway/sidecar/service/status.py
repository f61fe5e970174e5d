"""What a sidecar tells about itself and its runs: the sidecar-wide counters and the totals
that outlive the runs (GetStatus and the metrics read the same numbers), a run's summary
(GetJobSummary), and the runs a caller may see, live and ended (GetStatus; the transport cuts
them to a page that fits one message, `convert.status_to_pb`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from spillway.sidecar import __version__
from spillway.sidecar.core.model import JobSummary
from spillway.sidecar.core.policy import PolicyEngine
from spillway.sidecar.errors import UnknownJobError
from spillway.sidecar.federation import siblings
from spillway.sidecar.federation.confirm import Confirmations
from spillway.sidecar.observability.health import KafkaWatch
from spillway.sidecar.service.admission import Admission
from spillway.sidecar.service.ended import EndedRuns, Totals
from spillway.sidecar.service.identity import Identity
from spillway.sidecar.service.registry import (
    Caller,
    Registry,
    Run,
    check_run_id,
    decode_page_token,
    page_size,
    visible,
)
from spillway.sidecar.service.values import RunSummary, StatusPage, StatusQuery

if TYPE_CHECKING:
    from spillway.sidecar.dlq import DlqPipeline


class Status:
    """Counters and summaries, over the engine, the live runs, the ended runs and what else
    counts: the DLQ pipeline, a node's confirmations, the Kafka check, the backpressure gate."""

    def __init__(self, *, identity: Identity, engine: PolicyEngine, registry: Registry,
                 ended: EndedRuns, pipeline: DlqPipeline | None,
                 confirmations: Confirmations | None, kafka: KafkaWatch | None,
                 admission: Admission | None) -> None:
        self._me = identity
        self._engine = engine
        self._registry = registry
        self._ended = ended
        self._pipeline = pipeline
        self._confirmations = confirmations
        self._kafka = kafka
        self._admission = admission

    def counters(self) -> dict[str, float]:
        """The sidecar-wide counters (engine, runs, DLQ pipeline, health) by name."""
        return self.snapshot()[0]

    def snapshot(self) -> tuple[dict[str, float], Totals]:
        """The sidecar-wide counters and the totals, from one reading of the live runs (no
        run leaves meanwhile: its counts are in the one or in the other, `EndedRuns`)."""
        with self._ended.reading():
            live = self._engine.counters()
            totals = self._ended.totals(live)
        counters = dict(live)
        counters["jobs-expired"] = float(self._registry.expired)
        counters["jobs-ended"] = float(self._registry.ended)
        if self._pipeline is not None:
            counters.update(self._pipeline.stats())
        if self._confirmations is not None:
            counters.update(self._confirmations.stats())
        if self._kafka is not None:
            counters["kafka-reachable"] = float(self._kafka.reachable)
        gate = self._admission
        counters["records-refused"] = float(gate.refused_records if gate else 0)
        counters["backpressure"] = float(bool(gate and gate.refusing()))
        return counters, totals

    def job_summary(self, job: str, run_id: str, *, token: str | None) -> RunSummary:
        """GetJobSummary: here, or at the process of this sidecar that homes the run."""
        run_id = check_run_id(run_id)
        if self._registry.get(job, run_id) is None:
            me = self._me
            owner = me.owner_elsewhere(job, run_id)
            if owner and token:  # homed at another process of this sidecar (siblings.py)
                return siblings.summary_at_owner(me.local, owner, job, run_id, token, 10.0)
            raise siblings.unknown_here(owner, job, run_id)
        run = self._registry.run_for(job, run_id, token)
        return RunSummary(self._engine.summary(run.key), self._me.sidecar_id)

    def page(self, query: StatusQuery, *, caller: Caller, token: str | None) -> StatusPage:
        """Counters, and the runs the caller may see (by job name, then run id) after the
        page token."""
        size = page_size(query.page_size)
        after = decode_page_token(query.page_token) if query.page_token else None
        live = self._registry.runs(query.job)
        runs = visible(live, caller, token)
        me = self._me
        total = len(runs)
        counters, totals = self.snapshot()
        ended = []
        if after is None:   # the first page only: the later ones carry more live runs
            ended = [r for r in visible(self._ended.runs(), caller, token)
                     if not query.job or r.summary.job == query.job]
        else:
            runs = [r for r in runs if (r.job, r.run_id) > after]
        return StatusPage(
            sidecar_id=me.sidecar_id, version=__version__, counters=counters,
            instance_id=me.instance_id, advertised_address=me.advertised_address,
            jobs_total=total, size=size,
            last=(runs[-1].job, runs[-1].run_id) if runs else None,
            summaries=self._summaries(runs), totals=totals, ended=ended,
            jobs_hidden=len(live) - total)

    def _summaries(self, runs: list[Run]) -> Iterator[tuple[tuple[str, str], JobSummary]]:
        for run in runs:
            try:
                summary = self._engine.summary(run.key)
            except UnknownJobError:  # ended meanwhile
                continue
            yield (run.job, run.run_id), summary


__all__ = ["Status"]
