"""Job runs on this sidecar: which are live, who may touch them, how many, and when they end.

A job's state is scoped to one run of it: the key is (job, run_id), run_id being the Spark
application id. A new run of the same name starts from nothing (tolerance counts, retry
schedules, remembered record ids, policy); two runs of one name may be live at once and share
nothing.

The job credential: the run's home issues a job token (`new_token`) on the run's first
RegisterJob and keeps only its SHA-256 digest. Every later call for the run must present the
token in the ``spillway-job-token`` metadata; it is checked in constant time (`token_matches`)
before anything else happens, so a refused call changes no state. A node sidecar (the run homed
elsewhere) records the run, with the digest of the token its home accepted, only once the home
has accepted the registration.

Refusals: a run that does not exist here answers NOT_FOUND (whether the caller holds a token or
not: run existence is not a secret, job names and Spark application ids are not credentials, and
NOT_FOUND is what tells an executor to register again after a sidecar restart); a run that
exists answers PERMISSION_DENIED to a caller without its token.

The decisions are plain functions over values (`may_use`, `may_see`, `may_end`) so they are
tested without gRPC; `Registry` is the thread-safe table with the live-run bound
(``jobs.max.live``) and the idle reaper (``job.idle.timeout.ms``).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import logging
import secrets
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from spillway.sidecar.core import names
from spillway.sidecar.errors import (
    ConfigError,
    JobAccessError,
    LiveRunsExhaustedError,
    UnknownJobError,
)

log = logging.getLogger("spillway.sidecar.service.registry")

#: The call metadata key that carries a run's job token.
JOB_TOKEN_METADATA = "spillway-job-token"

MAX_TOKEN_CHARS = 256
#: Node sidecars remembered per run at its home (for EndJob's fan-out).
MAX_NODES_PER_RUN = 4096

DEFAULT_PAGE_SIZE = 100
MAX_PAGE_SIZE = 1000


# --- values and pure decisions -----------------------------------------------------------------


class Caller(Protocol):
    """Who is calling, as authenticated at the edge (`security.Caller`), handed in by the
    servicer with each call."""

    admin: bool
    peer: bool
    authenticated: bool
    identity: str


def check_run_id(run_id: str) -> str:
    """Required here (a run's state is keyed by it); the characters are `names.check_run_id`'s
    (Spark application ids and uuid hex fit)."""
    if not run_id:
        raise ConfigError("run_id", "required: the run of the job (the Spark application id); "
                                    "clients older than spillway.v1 run ids must be upgraded")
    try:
        names.check_run_id(run_id)
    except ValueError as exc:
        raise ConfigError("run_id", str(exc).removeprefix("run_id: ")) from None
    return run_id


def new_token() -> str:
    return secrets.token_urlsafe(32)


def token_digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).digest()


def token_matches(digest: bytes, presented: str | None) -> bool:
    """Constant time in the token's content; a missing token never matches."""
    if not presented or len(presented) > MAX_TOKEN_CHARS:
        return False
    return hmac.compare_digest(digest, token_digest(presented))


def may_use(digest: bytes, presented: str | None) -> bool:
    """Register again, report, flush, read the summary: the run's token only."""
    return token_matches(digest, presented)


def may_see(caller: Caller, digest: bytes, presented: str | None) -> bool:
    """List a run in GetStatus: operators and peer sidecars see every run, others their own."""
    return caller.admin or caller.peer or token_matches(digest, presented)


def may_end(caller: Caller, digest: bytes, presented: str | None, *, local_only: bool) -> bool:
    """EndJob: the run's token; an operator (``spillway job end``); a peer sidecar releasing
    the run locally on behalf of its home (local_only)."""
    if token_matches(digest, presented):
        return True
    return caller.admin or (local_only and caller.peer)


def access_error(job: str, run_id: str, presented: str | None) -> JobAccessError:
    what = "wrong" if presented else "missing"
    return JobAccessError(
        f"job {job!r} run {run_id!r}: the job token is {what} ({JOB_TOKEN_METADATA} metadata); "
        f"only the run's driver and its executors hold it")


# --- paging ------------------------------------------------------------------------------------


def encode_page_token(job: str, run_id: str) -> str:
    raw = json.dumps([job, run_id], separators=(",", ":")).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_page_token(token: str) -> tuple[str, str]:
    try:
        raw = base64.urlsafe_b64decode(token + "=" * (-len(token) % 4))
        job, run_id = json.loads(raw)
        if isinstance(job, str) and isinstance(run_id, str):
            return job, run_id
    except (ValueError, TypeError):
        pass
    raise ConfigError("page_token", "not a page token from this sidecar's GetStatus "
                                    "(pass SidecarStatus.next_page_token as it was)")


def page_size(requested: int) -> int:
    if requested < 0:
        raise ConfigError("page_size", f"must be >= 0, got {requested}")
    return DEFAULT_PAGE_SIZE if requested == 0 else min(requested, MAX_PAGE_SIZE)


# --- the table ---------------------------------------------------------------------------------


@dataclass(eq=False)
class Run:
    """One live run on this sidecar."""

    job: str
    run_id: str
    key: str                 # the engine's key (`policy.run_key`)
    digest: bytes            # of the job token
    home: Any = None         # peers.Home when the run is homed at another sidecar
    home_instance_id: str = ""
    nodes: set[str] = field(default_factory=set)   # at the home: node sidecars of the run
    created: float = 0.0
    last_active: float = 0.0
    started: float = 0.0     # wall clock, seconds since the Unix epoch (what status shows)
    # at the home, when the driver escrowed it (RegisterJob.token_escrow): the run's token,
    # handed to its executors that claim it; in memory only, gone with the run
    escrow: str | None = field(default=None, repr=False)

    @property
    def home_address(self) -> str:
        return getattr(self.home, "address", "") if self.home is not None else ""

    def __repr__(self) -> str:  # never the digest
        return f"Run({self.job!r}, {self.run_id!r}, home={self.home_address!r})"


class Registry:
    """The live runs of this sidecar. Thread-safe; the decisions about one call are taken by
    the caller (`server.Sidecar`) with the functions above."""

    def __init__(self, *, max_live: int, idle_timeout_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_live = max_live
        self.idle_timeout_s = idle_timeout_s
        self._clock = clock
        self._lock = threading.Lock()
        self._runs: dict[tuple[str, str], Run] = {}
        # serialises the creation of runs (rare), so the bound and the engine's table agree
        self.create_lock = threading.Lock()
        self.expired = 0
        self.ended = 0
        self._stop = threading.Event()
        self._reaper: threading.Thread | None = None

    def __len__(self) -> int:
        with self._lock:
            return len(self._runs)

    def get(self, job: str, run_id: str) -> Run | None:
        with self._lock:
            return self._runs.get((job, run_id))

    def run_for(self, job: str, run_id: str, token: str | None) -> Run:
        """The live run, once the caller proved it holds its token (else nothing happens)."""
        run = self.get(job, run_id)
        if run is None:
            raise UnknownJobError(job, run_id)
        if not may_use(run.digest, token):
            raise access_error(job, run_id, token)
        self.touch(run)
        return run

    def runs(self, job: str = "") -> list[Run]:
        """Live runs (of ``job`` when given), ordered by (job, run_id)."""
        with self._lock:
            runs = [r for r in self._runs.values() if not job or r.job == job]
        runs.sort(key=lambda r: (r.job, r.run_id))
        return runs

    def add(self, run: Run) -> Run:
        """Call under `create_lock`, after checking `check_room`."""
        now = self._clock()
        run.created = run.last_active = now
        run.started = time.time()
        with self._lock:
            self._runs[(run.job, run.run_id)] = run
        return run

    def check_room(self) -> None:
        with self._lock:
            live = len(self._runs)
        if live >= self.max_live:
            raise LiveRunsExhaustedError(
                f"this sidecar already has {live} live job runs (jobs.max.live={self.max_live}); "
                f"end finished runs (Job.close(), `spillway job end`) or raise jobs.max.live")

    def touch(self, run: Run) -> None:
        run.last_active = self._clock()

    def add_node(self, run: Run, address: str) -> None:
        with self._lock:
            if address in run.nodes or len(run.nodes) >= MAX_NODES_PER_RUN:
                return
            run.nodes.add(address)

    def remove(self, run: Run, *, expired: bool = False) -> bool:
        with self._lock:
            if self._runs.get((run.job, run.run_id)) is not run:
                return False
            del self._runs[(run.job, run.run_id)]
            if expired:
                self.expired += 1
            else:
                self.ended += 1
            return True

    def idle(self) -> list[Run]:
        """Runs with no call for longer than the idle timeout."""
        cutoff = self._clock() - self.idle_timeout_s
        with self._lock:
            return [r for r in self._runs.values() if r.last_active < cutoff]

    # --- the reaper ------------------------------------------------------------------------

    def start_reaper(self, expire: Callable[[Run], None]) -> None:
        """Ends idle runs with ``expire(run)`` (which releases and counts them)."""
        if self._reaper is not None:
            return
        period = min(max(self.idle_timeout_s / 4, 0.05), 30.0)

        def loop() -> None:
            while not self._stop.wait(period):
                for run in self.idle():
                    try:
                        expire(run)
                    except Exception:  # noqa: BLE001 - the reaper must keep running
                        log.exception("could not expire job %r run %r", run.job, run.run_id)

        self._reaper = threading.Thread(target=loop, name="spillway-reaper", daemon=True)
        self._reaper.start()

    def stop(self) -> None:
        self._stop.set()
        if self._reaper is not None:
            self._reaper.join(timeout=5)


class Owned(Protocol):
    """A run, live or ended: the digest of its job token."""

    @property
    def digest(self) -> bytes: ...


OwnedT = TypeVar("OwnedT", bound=Owned)


def visible(runs: Iterable[OwnedT], caller: Caller, presented: str | None) -> list[OwnedT]:
    """The runs `caller` may list (`may_see`), the presented token digested once."""
    if caller.admin or caller.peer:
        return list(runs)
    if not presented or len(presented) > MAX_TOKEN_CHARS:
        return []
    digest = token_digest(presented)
    return [r for r in runs if hmac.compare_digest(r.digest, digest)]


__all__ = [
    "JOB_TOKEN_METADATA", "Caller", "Registry", "Run", "access_error", "check_run_id",
    "decode_page_token", "encode_page_token", "may_end", "may_see", "may_use", "new_token",
    "page_size", "token_digest", "token_matches", "visible",
]
