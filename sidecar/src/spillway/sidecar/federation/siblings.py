"""Which process of a several-process sidecar (``sidecar.processes``, processes.py) is a new
run's home.

A driver's connection may land on any process, and so may a second registration of one run
(another Job object, a driver process that lost its connection): were each process to home a
run it does not know, one run could get two homes, each with its own error limit. So a run's
home is decided by its name, not by where its registration landed: the process
``owner(job, run id)`` of the siblings (a stable digest, the same in every process and after a
restart, which keeps a restarted process the home of the runs it resumes). A registration
without a home that lands elsewhere is forwarded there as it is (the caller's job token, this
process's peer credentials) and its answer returned: the client pins to the owner's port.
Nothing is recorded on the process that forwarded it.

A driver's summary or EndJob of a run this process does not know goes to the owner the same
way when the caller presents the run's job token (a driver older than the client pin, or one
whose connection was made again); without one (an operator's credential is not passed on) the
NOT_FOUND names the process to ask.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from spillway.sidecar.errors import UnknownJobError
from spillway.sidecar.federation.peers import Home, LocalSidecar
from spillway.sidecar.service.values import Ended, Registered, Registration, RunSummary


def owner(siblings: Sequence[str], job: str, run_id: str) -> str:
    """The advertised address of the process that homes (job, run_id)."""
    digest = hashlib.blake2b(f"{job}\0{run_id}".encode(), digest_size=8).digest()
    return siblings[int.from_bytes(digest, "little") % len(siblings)]


def elsewhere(siblings: Sequence[str], me: str, job: str, run_id: str) -> str:
    """The owning process of (job, run_id) when that is not this one, else ''."""
    if not siblings:
        return ""
    found = owner(siblings, job, run_id)
    return "" if found == me else found


def unknown_here(owner_address: str, job: str, run_id: str) -> UnknownJobError:
    return UnknownJobError(job, run_id, hint=(
        f"; this sidecar is one of several processes (sidecar.processes), and the run would be "
        f"homed at process {owner_address}: ask it there" if owner_address else ""))


@contextmanager
def _owner(me: LocalSidecar, address: str) -> Iterator[Home]:
    """The owning process, dialled as any home is (HomeError relays its answer)."""
    remote = Home.connect(address, me)
    remote.role = "the process that homes this run"
    try:
        yield remote
    finally:
        remote.close()


def register_at_owner(me: LocalSidecar, address: str, request: Registration,
                      token: str | None, timeout_s: float) -> Registered:
    """The home-less registration, made at the owning process."""
    with _owner(me, address) as remote:
        return remote.register(request.job, request.run_id, request.properties, token=token,
                               timeout_s=timeout_s)


def summary_at_owner(me: LocalSidecar, address: str, job: str, run_id: str, token: str,
                     timeout_s: float) -> RunSummary:
    with _owner(me, address) as remote:
        return remote.summary(job, run_id, token=token, timeout_s=timeout_s)


def end_at_owner(me: LocalSidecar, address: str, job: str, run_id: str, token: str,
                 timeout_s: float) -> Ended:
    with _owner(me, address) as remote:
        return remote.end(job, run_id, token=token, timeout_s=timeout_s)
