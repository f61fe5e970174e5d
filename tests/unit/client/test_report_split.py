"""A report larger than the sidecar's whole spool: the client sends it again in halves
(spillway.client._split), and the sidecar's FAILED_PRECONDITION wording maps to
ReportTooLargeError, not to a job conflict or to backpressure."""

from __future__ import annotations

import grpc
import pytest
from spillway.client import ReportTooLargeError, SidecarBackpressureError
from spillway.client._split import send_splitting
from spillway.client.errors import JobConflictError, map_rpc_error
from spillway.sidecar.errors import ReportTooLargeError as SidecarTooLarge
from spillway.sidecar.service.admission import Admission
from spillway.v1 import sidecar_pb2 as pb

# the sidecar's own message for a report that cannot fit (built by the real admission gate)
try:
    Admission(type("S", (), {"max_records": 2, "max_bytes": 10**9})()).admit(3, 0)
except SidecarTooLarge as exc:
    SIDECAR_DETAILS = str(exc)


class _RpcError(grpc.RpcError):
    def __init__(self, code, details):
        self._code, self._details = code, details

    def code(self):
        return self._code

    def details(self):
        return self._details


def _rec(i):
    return pb.FailedRecord(record_id=f"r{i}")


class Sidecar:
    """Admits reports of at most `limit` records; answers one verdict id per record."""

    def __init__(self, limit):
        self.limit = limit
        self.calls: list[tuple[list[str], list[str]]] = []

    def send(self, records, recovered):
        self.calls.append(([r.record_id for r in records], list(recovered)))
        if len(records) > self.limit:
            raise map_rpc_error(_RpcError(grpc.StatusCode.FAILED_PRECONDITION, SIDECAR_DETAILS),
                                method="ReportFailures", target="t")
        return [f"v-{r.record_id}" for r in records]


def test_the_sidecars_wording_maps_to_report_too_large():
    assert "spool.max.records=2" in SIDECAR_DETAILS and "Split it" in SIDECAR_DETAILS
    err = map_rpc_error(_RpcError(grpc.StatusCode.FAILED_PRECONDITION, SIDECAR_DETAILS),
                        method="ReportFailures", target="t")
    assert isinstance(err, ReportTooLargeError)
    assert not isinstance(err, SidecarBackpressureError)  # retrying it unchanged never helps
    assert err.code is grpc.StatusCode.FAILED_PRECONDITION
    other = map_rpc_error(_RpcError(grpc.StatusCode.FAILED_PRECONDITION, "other policy"),
                          method="RegisterJob", target="t")
    assert isinstance(other, JobConflictError)


def test_halves_are_sent_until_each_fits_verdicts_in_record_order():
    sidecar = Sidecar(limit=2)
    out = send_splitting(sidecar.send, [_rec(i) for i in range(7)], ["done-1", "done-2"])
    assert out == [f"v-r{i}" for i in range(7)]
    sent = [ids for ids, _ in sidecar.calls if len(ids) <= 2]
    assert [i for ids in sent for i in ids] == [f"r{i}" for i in range(7)]  # each once
    # 7 -> 3 + 4 -> (1 + 2) + (2 + 2)
    assert [len(ids) for ids, _ in sidecar.calls] == [7, 3, 1, 2, 4, 2, 2]
    # the recovered ids reach the sidecar once, with the first piece it admits
    admitted = [rec for ids, rec in sidecar.calls if len(ids) <= 2]
    assert admitted[0] == ["done-1", "done-2"] and not any(admitted[1:])


def test_a_report_that_fits_is_sent_once():
    sidecar = Sidecar(limit=10)
    assert send_splitting(sidecar.send, [_rec(0), _rec(1)], []) == ["v-r0", "v-r1"]
    assert len(sidecar.calls) == 1


def test_a_single_record_that_does_not_fit_names_the_record():
    sidecar = Sidecar(limit=0)
    with pytest.raises(ReportTooLargeError, match=r"record 'r0' alone .*spool\.max\.records"):
        send_splitting(sidecar.send, [_rec(0), _rec(1)], [])
    assert [len(ids) for ids, _ in sidecar.calls] == [2, 1]  # stops at the first single record


def test_other_errors_are_not_split():
    def busy(records, recovered):
        raise map_rpc_error(_RpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, "spool full"),
                            method="ReportFailures", target="t")

    with pytest.raises(SidecarBackpressureError):
        send_splitting(busy, [_rec(0), _rec(1)], [])
