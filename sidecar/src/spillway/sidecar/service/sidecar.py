"""The application service's face: one sidecar's collaborators, built once by
`runtime.bootstrap` and frozen, independent of how it is served.

`Sidecar` only delegates: RegisterJob to `registration.Registrar`; reports and flushes to
`reporting.Reporting` (a run homed elsewhere through `federation.tallying.NodeTally`, held
reports through `federation.confirm.Confirmations`); TallyFailures at a run's home to
`federation.tallying.HomeTally`; EndJob and idle expiry to `ending.Ending`; summaries, status
and counters to `status.Status`. Each takes and returns plain values (`values.py`) and is
handed the caller (`registry.Caller`) the transport authenticated.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from spillway.sidecar.core.policy import PolicyEngine
from spillway.sidecar.federation.confirm import Confirmations
from spillway.sidecar.federation.node_slices import SliceGrant
from spillway.sidecar.federation.tallying import HomeTally, TallyIn
from spillway.sidecar.observability.health import KafkaWatch
from spillway.sidecar.observability.telemetry import Telemetry
from spillway.sidecar.runtime.memtune import Trimmer
from spillway.sidecar.service.admission import Admission
from spillway.sidecar.service.ending import Ending
from spillway.sidecar.service.identity import Identity
from spillway.sidecar.service.registration import Registrar
from spillway.sidecar.service.registry import Caller, Registry, Run
from spillway.sidecar.service.reporting import Reporting
from spillway.sidecar.service.runstate import RunStore
from spillway.sidecar.service.status import Status
from spillway.sidecar.service.values import (
    Answer,
    Ended,
    Flush,
    Registered,
    Registration,
    Report,
    RunSummary,
    StatusPage,
    StatusQuery,
)

if TYPE_CHECKING:
    from spillway.sidecar.dlq import DlqPipeline


@dataclass(frozen=True, eq=False)
class Sidecar:
    """The sidecar's parts, wired once (`runtime.bootstrap.build_sidecar`)."""

    identity: Identity
    props: Mapping[str, object]
    engine: PolicyEngine
    registry: Registry
    pipeline: DlqPipeline | None   # with bootstrap.servers
    runstate: RunStore | None
    telemetry: Telemetry
    admission: Admission | None      # backpressure gate, with a DLQ pipeline
    kafka: KafkaWatch | None         # the Kafka check, with bootstrap.servers
    confirmations: Confirmations | None   # a node's held reports, with a spool that holds
    trimmer: Trimmer
    registrar: Registrar
    reporting: Reporting
    home_tally: HomeTally
    ending: Ending
    status: Status
    flush_timeout_s: float

    @property
    def sidecar_id(self) -> str:
        return self.identity.sidecar_id

    @property
    def instance_id(self) -> str:
        return self.identity.instance_id

    def register_job(self, request: Registration, *, token: str | None, caller: Caller,
                     timeout_s: float = 15.0) -> Registered:
        return self.registrar.register(request, token=token, caller=caller,
                                       timeout_s=timeout_s)

    def report(self, report: Report, *, caller: Caller, timeout_s: float,
               token: str | None = None) -> list[Answer]:
        return self.reporting.report(report, caller=caller, timeout_s=timeout_s, token=token)

    def flush(self, flush: Flush, *, caller: Caller, timeout_s: float,
              token: str | None = None) -> int:
        return self.reporting.flush(flush, caller=caller, timeout_s=timeout_s, token=token)

    def tally(self, job: str, run_id: str, reports: Sequence[TallyIn], *, token: str | None,
              caller: Caller) -> list[tuple[list, SliceGrant | None]]:
        return self.home_tally.tally(job, run_id, reports, token=token, caller=caller)

    def job_summary(self, job: str, run_id: str, *, token: str | None) -> RunSummary:
        return self.status.job_summary(job, run_id, token=token)

    def status_page(self, query: StatusQuery, *, caller: Caller,
                    token: str | None = None) -> StatusPage:
        return self.status.page(query, caller=caller, token=token)

    def sidewide_counters(self) -> dict[str, float]:
        return self.status.counters()

    def end_job(self, job: str, run_id: str, *, local_only: bool = False, token: str | None,
                caller: Caller, timeout_s: float) -> Ended:
        return self.ending.end_job(job, run_id, local_only=local_only, token=token,
                                   caller=caller, timeout_s=timeout_s)

    def expire(self, run: Run) -> None:
        """The reaper's: a run nobody called for job.idle.timeout.ms."""
        self.ending.expire(run)


__all__ = ["Sidecar"]
