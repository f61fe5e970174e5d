"""Sidecar to sidecar: dialling a job's home (and, from the home, its node sidecars).

A job has one home sidecar, which decides for every node. `Home` is a gRPC client adapter:
the service hands it plain values (`service.values`) and gets plain values back; the messages
are built and read here. A node sidecar dials its home:
- only at an address the operator allows (``home.allowed.addresses``; this sidecar's own address
  always): anything else is refused with PERMISSION_DENIED naming it, before any DNS lookup;
- with this sidecar's own TLS material (its certificate as the client certificate, its CA bundle
  to verify the home) when TLS is configured, and the peer token (``spillway-peer-token``);
- checking who answers: the driver names the home by its advertised address and its instance id
  (RegisterJobResponse.home / home_instance_id). Reaching another instance, or this very sidecar
  for a job homed elsewhere (every node on the loopback default), is FAILED_PRECONDITION: a
  job-wide limit must never silently become a per-node one.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from operator import attrgetter

import grpc
from spillway.sidecar.core.model import Decision, TaskIdentity
from spillway.sidecar.errors import SpillwayError
from spillway.sidecar.federation.coalesce import GroupCall, GroupCallTimeout
from spillway.sidecar.federation.node_slices import SliceGrant
from spillway.sidecar.service.values import Ended, Flush, Registered, Report, RunSummary
from spillway.sidecar.transport import columns, convert, listeners, security, tally
from spillway.v1 import sidecar_pb2 as pb
from spillway.v1 import sidecar_pb2_grpc as pb_grpc

log = logging.getLogger("spillway.sidecar")

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
# one TallyFailures call carries at most this (`transport/validate.py` bounds what a home takes)
MAX_TALLY_REPORTS = 64
MAX_TALLY_RECORDS = 16_384
_MESSAGE = attrgetter("message")   # a reported record's message (`convert.PbFailedRecord`)


class HomeError(SpillwayError):
    """The job's home (or a node) sidecar refused, could not be reached or is not who it should
    be; carries the status to relay."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        self.code = code
        super().__init__(message)


@dataclass(frozen=True)
class LocalSidecar:
    """What dialling another sidecar needs of this one (`service.identity.Identity.local`)."""

    instance_id: str
    addresses: frozenset[str]  # its advertised and listen addresses (those set)
    security: security.SecurityConfig | None = None
    # the other processes behind its address (sidecar.processes): dialled as any home is, and
    # allowed as its own addresses are
    siblings: frozenset[str] = frozenset()


def check_allowed(me: LocalSidecar, address: str, what: str = "home") -> None:
    """PERMISSION_DENIED unless `address` may be dialled (string match, nothing resolved)."""
    cfg = me.security or security.load_config({})
    if not listeners.home_allowed(address, cfg, me.addresses | me.siblings):
        allowed = ", ".join(cfg.home_allowed) or "none but its own addresses (the default)"
        raise HomeError(grpc.StatusCode.PERMISSION_DENIED,
                        f"{what} address {address!r} is not in this sidecar's "
                        f"home.allowed.addresses ({allowed}); an operator adds the cluster's "
                        "sidecar addresses there")


@dataclass
class Home:
    """Another sidecar (a job's home, or a node sidecar seen from the home): a gRPC stub with
    deadlines; calls carry the peer token and, when job-scoped, the run's job token."""

    address: str
    channel: grpc.Channel
    stub: pb_grpc.ErrorSidecarStub
    peer_token: security.TokenFile | None = None
    instance: str = ""  # its instance id, once resolve_home has checked it
    role: str = "the job's home sidecar"
    tally_supported: bool = True  # False once it answered TallyFailures UNIMPLEMENTED (older)
    # per run: its reports in flight to the home and those gathering for the next call
    _tallies: dict[tuple[str, str], GroupCall] = field(default_factory=dict)
    # this sidecar's own certificate, as a TLS client: a renewed one (cert-manager's csi-driver
    # rewrites it days before it expires) is dialled with from the next call on
    tls: listeners.TlsFiles | None = None
    _tls_stamp: tuple | None = None
    _tls_checked: float = 0.0
    _swap: threading.Lock = field(default_factory=threading.Lock)
    _retired: list[grpc.Channel] = field(default_factory=list)  # closed with this Home

    @classmethod
    def connect(cls, address: str, me: LocalSidecar | None = None) -> Home:
        cfg = me.security if me is not None else None
        tls = cfg.tls if cfg is not None else None
        stamp = listeners.tls_stamps(tls) if tls is not None else None
        channel = _dial(address, tls)
        return cls(address, channel, pb_grpc.ErrorSidecarStub(channel),
                   cfg.peer_token if cfg is not None else None, tls=tls, _tls_stamp=stamp,
                   _tls_checked=time.monotonic())

    def _stub(self) -> pb_grpc.ErrorSidecarStub:
        """The stub to call with: a new channel once this sidecar's TLS files changed (looked
        at once a second at most; calls in flight on the old channel finish on it)."""
        if self.tls is None or time.monotonic() - self._tls_checked < _TLS_RECHECK_S:
            return self.stub
        with self._swap:
            self._tls_checked = time.monotonic()
            try:
                stamp = listeners.tls_stamps(self.tls)
                if stamp != self._tls_stamp:
                    self._retired.append(self.channel)
                    self.channel = _dial(self.address, self.tls)
                    self.stub = pb_grpc.ErrorSidecarStub(self.channel)
                    self._tls_stamp = stamp
                    log.info("dialling %s with this sidecar's renewed TLS certificate",
                             self.address)
            except (OSError, HomeError) as exc:   # mid-rotation: the current channel stays
                log.warning("TLS files changed but cannot be read (%s); dialling %s with the "
                            "previous certificate", exc, self.address)
            return self.stub

    def _call(self, what: str, request, timeout_s: float, token: str | None = None):
        fn = getattr(self._stub(), what)
        metadata = []
        if self.peer_token is not None:
            metadata.append((security.PEER_TOKEN_KEY, self.peer_token.current().reveal()))
        if token:
            metadata.append((security.JOB_TOKEN_KEY, token))
        try:
            return fn(request, timeout=max(timeout_s, 0.1), metadata=metadata or None)
        except grpc.RpcError as exc:
            code = exc.code()
            hint = ""
            if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                code = grpc.StatusCode.UNAVAILABLE
            elif code == grpc.StatusCode.UNAUTHENTICATED:
                # the caller's own credentials were fine: the sidecars are misconfigured
                code = grpc.StatusCode.FAILED_PRECONDITION
                hint = (" - it does not recognise this sidecar as a peer: give every sidecar "
                        "the same auth.peer.token.file, or mutual TLS certificates named in "
                        "auth.peer.identities")
            raise HomeError(code, f"{what} at {self.role} {self.address} failed "
                                  f"({exc.code().name}): {exc.details()}{hint}") from exc

    def status(self, timeout_s: float) -> pb.SidecarStatus:
        return self._call("GetStatus", pb.GetStatusRequest(page_size=1),
                          timeout_s)

    def instance_id(self, timeout_s: float) -> str:
        return self.status(timeout_s).instance_id

    def register(self, job: str, run_id: str = "", properties: Mapping[str, str] | None = None,
                 *, token: str | None = None, peer: str = "", timeout_s: float = 15.0,
                 token_escrow: bool = False, claim_token: bool = False) -> Registered:
        return convert.registered_from_pb(self._call("RegisterJob", pb.RegisterJobRequest(
                job=job, run_id=run_id, properties=dict(properties or {}), peer=peer,
                token_escrow=token_escrow, claim_token=claim_token),
            timeout_s, token))

    def report(self, report: Report, timeout_s: float, *,
               token: str | None = None) -> list[Decision]:
        """The whole report, decided by the home (decide_only): its records as they were
        reported, a columnar report's as messages (the home may predate columns)."""
        fwd = pb.ReportFailuresRequest(
            job=report.job, run_id=report.run_id, task=convert.task_pb(report.task),
            recovered_record_ids=report.recovered_ids,
            undo_dead_letter_record_ids=report.undo_ids, decide_only=True)
        records = report.records
        if records and isinstance(records[0], convert.PbFailedRecord):
            fwd.records.extend(map(_MESSAGE, records))
        elif records:
            fwd.records.extend(columns.as_messages(records))
        resp = self._call("ReportFailures", fwd, timeout_s, token)
        return [Decision(convert.verdict_from_pb(v), dead_letter=v.dead_letter)
                for v in resp.verdicts]

    def tally(self, job: str, run_id: str, task: TaskIdentity, records, digests: bytes,
              timeout_s: float, *, token: str | None = None, claim: int = 0,
              slices: tuple[int, list] | None = None
              ) -> tuple[list, SliceGrant | None] | None:
        """A report decided by the home from its columns (`transport/tally.py`): (decision,
        logged, rule) per record, and the budget slice granted with them; None from a home
        that predates TallyFailures (the caller then sends the whole report). Reports of
        concurrent callers go together in one call (`coalesce.GroupCall`). ``slices``: (size
        wanted, [(closed slice, records answered under it)]) for a run whose error budget is
        sliced (docs/POLICY.md, "Budget slices")."""
        group = self._tallies.get((job, run_id))
        if group is None:
            group = self._tallies.setdefault((job, run_id), GroupCall(
                lambda items, t: self._send_tallies(job, run_id, items, t),
                max_items=MAX_TALLY_REPORTS, max_weight=MAX_TALLY_RECORDS))
        report = tally.tally_report(convert.task_pb(task), records, digests)
        report.claim = claim
        if slices is not None:
            report.want_slice = slices[0]
            for sid, used in slices[1]:
                report.closed_slices.add(id=sid, used=used)
        try:
            return group.call((report, token), weight=len(records), timeout_s=timeout_s)
        except GroupCallTimeout as exc:
            raise HomeError(grpc.StatusCode.UNAVAILABLE,
                            f"TallyFailures at {self.role} {self.address}: {exc} (the home "
                            "is slow to answer this run's earlier reports)") from exc

    def confirm(self, job: str, run_id: str, reports: list[pb.TallyReport], timeout_s: float,
                *, token: str | None) -> list:
        """Held reports (each with its claim) confirmed in one call: (decision, logged, rule)
        per record of each (HomeError UNIMPLEMENTED from a home that predates TallyFailures)."""
        out = self._send_tallies(job, run_id, [(r, token) for r in reports], timeout_s)
        if reports and out[0] is None:
            raise HomeError(grpc.StatusCode.UNIMPLEMENTED,
                            f"{self.role} {self.address} does not know TallyFailures")
        return [outcomes for outcomes, _ in out]

    def _send_tallies(self, job: str, run_id: str, items, timeout_s: float) -> list:
        if not self.tally_supported:
            return [None] * len(items)
        req = pb.TallyRequest(job=job, run_id=run_id, reports=[report for report, _ in items])
        try:
            resp = self._call("TallyFailures", req, timeout_s,
                              items[0][1])
        except HomeError as exc:
            if exc.code != grpc.StatusCode.UNIMPLEMENTED:
                raise
            self.tally_supported = False
            log.info("%s %s does not know TallyFailures (an older version): reports of its "
                     "runs are forwarded whole", self.role, self.address)
            return [None] * len(items)
        if len(resp.reports) != len(items):
            raise HomeError(grpc.StatusCode.FAILED_PRECONDITION,
                            f"TallyFailures at {self.role} {self.address}: answered "
                            f"{len(resp.reports)} of {len(items)} reports")
        try:
            return [(tally.tally_outcomes(v, report.record_ids),
                     SliceGrant(v.grant.id, v.grant.size, v.grant.lease_ms)
                     if v.HasField("grant") else None)
                    for v, (report, _) in zip(resp.reports, items, strict=True)]
        except ValueError as exc:
            raise HomeError(grpc.StatusCode.FAILED_PRECONDITION,
                            f"TallyFailures at {self.role} {self.address}: {exc}") from exc

    def undo_dead_letters(self, job: str, run_id: str, task: TaskIdentity,
                          record_ids: list[str], timeout_s: float, *,
                          token: str | None = None) -> None:
        """Tell the home these ids' DLQ records were not spooled here (see
        `service.reporting.Reporting.report`)."""
        fwd = pb.ReportFailuresRequest(job=job, run_id=run_id, task=convert.task_pb(task),
                                       decide_only=True,
                                       undo_dead_letter_record_ids=record_ids)
        self._call("ReportFailures", fwd, timeout_s, token)

    def progress(self, flush: Flush, timeout_s: float, *, token: str | None = None) -> None:
        stage_pb = convert.STAGE_TO_PB
        fwd = pb.FlushTaskRequest(
            job=flush.job, run_id=flush.run_id, task=convert.task_pb(flush.task),
            processed=[pb.StageCount(stage=stage_pb[ref.stage], custom_stage=ref.custom,
                                     records=n) for ref, n in flush.processed.items()],
            recovered_record_ids=flush.recovered_ids, progress_only=True)
        self._call("FlushTask", fwd, timeout_s, token)

    def summary(self, job: str, run_id: str, *, token: str | None,
                timeout_s: float) -> RunSummary:
        return convert.summary_from_pb(self._call("GetJobSummary", pb.GetJobSummaryRequest(
                job=job, run_id=run_id), timeout_s, token))

    def end(self, job: str, run_id: str, *, token: str | None, timeout_s: float,
            local_only: bool = False) -> Ended:
        return convert.ended_from_pb(self._call("EndJob", pb.EndJobRequest(
                job=job, run_id=run_id, local_only=local_only), timeout_s, token))

    def close(self) -> None:
        for channel in (*self._retired, self.channel):
            channel.close()


_TLS_RECHECK_S = 1.0
_OPTIONS = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES)]


def _dial(address: str, tls: listeners.TlsFiles | None) -> grpc.Channel:
    if tls is None:
        return grpc.insecure_channel(address, options=_OPTIONS)
    try:
        creds = listeners.client_channel_credentials(tls)
    except SpillwayError as exc:
        raise HomeError(grpc.StatusCode.UNAVAILABLE,
                        f"cannot dial {address} over TLS: {exc}") from exc
    return grpc.secure_channel(address, creds, options=_OPTIONS)


def _not_me(home: str, home_instance_id: str, me: str) -> HomeError:
    return HomeError(
        grpc.StatusCode.FAILED_PRECONDITION,
        f"the job's home is instance {home_instance_id} but HOME {home} reaches this sidecar "
        f"(instance {me}): set advertised.address on every sidecar to a routable address "
        "(each node's own loopback address names itself, so job-wide limits would become "
        "per-node ones)")


def resolve_home(me: LocalSidecar, home: str, home_instance_id: str,
                 timeout_s: float) -> Home | None:
    """The job's home at `home` (None: this sidecar is the home). Refused: an address not
    allowed (PERMISSION_DENIED), a home that is another instance than `home_instance_id` or
    this sidecar for a job homed elsewhere (FAILED_PRECONDITION), an unreachable one
    (UNAVAILABLE)."""
    mine = me.instance_id
    if home in me.addresses:
        if home_instance_id and home_instance_id != mine:
            raise _not_me(home, home_instance_id, mine)
        return None
    check_allowed(me, home)
    remote = Home.connect(home, me)
    try:
        found = remote.instance_id(timeout_s)
    except BaseException:
        remote.close()
        raise
    if found == mine:
        remote.close()
        if home_instance_id and home_instance_id != mine:
            raise _not_me(home, home_instance_id, mine)
        return None
    if home_instance_id and found != home_instance_id:
        remote.close()
        raise HomeError(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"HOME {home} reaches sidecar instance {found}, not the job's home instance "
            f"{home_instance_id} that the driver registered the job with: the address names "
            "another sidecar (set advertised.address on every sidecar to a routable, unique "
            "address)")
    remote.instance = found
    return remote


def end_on_node(me: LocalSidecar, node: str, job: str, run_id: str, *, token: str | None,
                timeout_s: float) -> Ended:
    """EndJob(local_only) on a node sidecar that registered the run (from its home)."""
    check_allowed(me, node, "node sidecar")
    remote = Home.connect(node, me)
    remote.role = "the node sidecar"
    try:
        return remote.end(job, run_id, token=token, timeout_s=timeout_s, local_only=True)
    finally:
        remote.close()


__all__ = ["Home", "HomeError", "LocalSidecar", "resolve_home", "end_on_node", "check_allowed"]
