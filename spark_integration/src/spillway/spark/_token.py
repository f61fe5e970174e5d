"""How a run's job token reaches the executors without being in any plan: a Spark file.

A Spark plan (the pickled wrapper functions, classic or Connect) can end up in logs: the
Connect server logs an execution's whole plan at INFO when its session ends before the client
released it, and classic Spark prints closures in task serialization errors. So the plan
carries a `TokenFile` (the name of a Spark file and a digest of the token), never the token:

- the driver writes the token to a private file (directory ``0700``, file ``0600``) whose name
  comes from the job and run (hashed) and a random suffix, never from the token, and adds it to
  the session's files: ``SparkSession.addArtifacts(path, file=True)`` on Spark Connect (session
  scoped: the server keeps the content, it does not log it), ``SparkContext.addFile(path)`` on
  classic Spark (the driver's file server; Spark copies it into each executor's work
  directory). Once per driver process, session and token (`ship`): a notebook cell run again,
  several wrappers or several runs in one session reuse or add their own files, never a second
  file under one name (Spark Connect refuses an artifact name again with other content);
- an executor reads it once per Python worker process (`TokenFile.load`, cached) from
  ``SparkFiles``' directory of the task (the Connect session's own directory on Spark Connect),
  and checks its digest: a file that does not hold the run's token is an error naming the file,
  never a token sent to the sidecar.

`JobToken` refuses to be pickled (`spillway.client.runs`): a plan built around this module
fails on the driver, loudly, instead of shipping the token. Streaming queries over Spark
Connect, which no session file reaches, carry an `EscrowedToken` instead: the executors claim
the token from their sidecar, where the driver escrowed it (`_ship` decides).
"""

from __future__ import annotations

import atexit
import hashlib
import hmac
import os
import secrets
import shutil
import tempfile
import threading
from dataclasses import dataclass
from typing import Any, Protocol

from spillway.client.runs import JobToken

PREFIX = "spillway-jobtoken-"
_DIGEST_CONTEXT = b"spillway token file v1\0"


class TokenFileError(RuntimeError):
    """The run's job token file cannot be read on this executor, or does not hold the token."""


def token_digest(token: JobToken) -> str:
    """What a plan carries to check the file against: SHA-256 of the (256-bit random) token in a
    context of its own, so it never equals the digest the sidecar keeps of it."""
    return hashlib.sha256(_DIGEST_CONTEXT + token.reveal().encode()).hexdigest()


@dataclass(frozen=True)
class TokenFile:
    """Where an executor finds the run's job token: a Spark file's name and the token's digest."""

    name: str
    digest: str

    def __repr__(self) -> str:
        return f"TokenFile({self.name!r})"

    def load(self) -> JobToken:
        """The token, read once per process (then from memory: never per row or per task)."""
        key = (self.name, self.digest)
        token = _loaded.get(key)
        if token is None:
            token = _loaded[key] = _read(self)
        return token


_loaded: dict[tuple[str, str], JobToken] = {}


@dataclass(frozen=True)
class EscrowedToken:
    """Where an executor of a streaming query over Spark Connect gets the run's token: its
    micro-batches run without the session's files, so the driver escrows the token with the
    run's home (RegisterJob.token_escrow) and each executor process claims it once from its
    node's sidecar (`claim`), which asks the home. The plan carries only the token's digest,
    to check what the sidecar answered."""

    digest: str

    def __repr__(self) -> str:
        return "EscrowedToken()"

    def load(self) -> JobToken | None:
        """The token this process claimed; None before its first task registered the run
        (`_runtime.TaskRun` then claims it)."""
        return _claimed.get(self.digest)

    def accept(self, token: JobToken | None) -> JobToken:
        """``token`` as the sidecar answered a claim, checked against the plan's digest."""
        if token is None or not hmac.compare_digest(token_digest(token), self.digest):
            raise TokenFileError("the job token the sidecar answered a claim with is not this "
                                 "run's (its digest differs)")
        _claimed[self.digest] = token
        return token


_claimed: dict[str, JobToken] = {}


def claim_client(client: Any) -> Any:
    """The client to claim an escrowed token with: one that presents the node token (the
    executor's, when it has one), else, for a sidecar on this host, this user's local
    credential as the admin token. Without either the sidecar refuses the claim, naming both."""
    import dataclasses

    from spillway.client import ADMIN_TOKEN_KEY, SidecarClient, localcred

    if client.security.token_file:
        return client
    file = localcred.for_target(client.target)
    if not file:
        return client
    return SidecarClient(client.target, timeout_s=client.timeout_s,
                         security=dataclasses.replace(client.security, token_file=file,
                                                      token_key=ADMIN_TOKEN_KEY))


def _files_root() -> str:
    from pyspark import SparkFiles

    if not getattr(SparkFiles, "_is_running_on_worker", False):
        raise TokenFileError(
            "the run's job token is read from the Spark task's files, on executors: this "
            "process runs no Spark task (on the driver, pass the Job, not its plan)")
    return SparkFiles.getRootDirectory()


def _read(ref: TokenFile) -> JobToken:
    path = os.path.join(_files_root(), ref.name)
    try:
        with open(path, encoding="utf-8") as f:
            value = f.read()
    except OSError as exc:
        raise TokenFileError(
            f"the run's job token file {ref.name!r} is not among this task's Spark files "
            f"({exc.strerror}): the driver adds it to the session (spark.addArtifacts on Spark "
            f"Connect, SparkContext.addFile on classic Spark) when it builds the wrapper; a "
            f"plan made in another session cannot be run in this one") from None
    token = JobToken(value) if value else None
    if token is None or not hmac.compare_digest(token_digest(token), ref.digest):
        raise TokenFileError(f"the Spark file {ref.name!r} does not hold this run's job token "
                             f"(its digest differs): the file was replaced or another run's")
    return token


# --- driver side ---------------------------------------------------------------------------


class SessionFiles(Protocol):
    """A Spark session's files, as the driver adds to them (`spark_files` picks the adapter)."""

    #: The session (Connect) or application (classic) the files belong to.
    key: str
    #: Whether Spark reads the local file after `add` returns (classic), or has its content.
    keep_local: bool

    def add(self, path: str) -> None:
        """Ship the file at ``path`` to this session's executors, under its base name."""


class ConnectFiles:
    """A Spark Connect session's artifacts: uploaded now, the local file can go at once."""

    keep_local = False

    def __init__(self, session: Any, session_id: str) -> None:
        self._session = session
        self.key = f"connect:{session_id}"

    def add(self, path: str) -> None:
        self._session.addArtifacts(path, file=True)


class ClassicFiles:
    """A classic SparkContext's files: served from the local path for the application's life."""

    keep_local = True

    def __init__(self, sc: Any) -> None:
        self._sc = sc
        self.key = f"classic:{sc.applicationId}"

    def add(self, path: str) -> None:
        self._sc.addFile(path)


def spark_files(session: Any) -> SessionFiles:
    """The files of a SparkSession (classic or Connect) or SparkContext."""
    from ._compat import connect_session_id, is_connect

    if is_connect(session):
        sid = connect_session_id(session)
        if not sid:
            raise TokenFileError("this Spark Connect session has no session id to ship the "
                                 "run's job token to")
        return ConnectFiles(session, sid)
    sc = session if hasattr(session, "addFile") else session.sparkContext
    return ClassicFiles(sc)


_shipped: dict[tuple[str, str, str, str], TokenFile] = {}
_ship_lock = threading.Lock()
_local_dir: str | None = None


def _private_dir() -> str:
    """This process's directory for token files (``0700``), removed at exit."""
    global _local_dir
    if _local_dir is None or not os.path.isdir(_local_dir):
        _local_dir = tempfile.mkdtemp(prefix="spillway-tokens-")  # 0700
        atexit.register(shutil.rmtree, _local_dir, True)
    return _local_dir


def file_name(job: str, run_id: str) -> str:
    """The job and run, hashed (names and ids stay out of file names), and a random suffix."""
    run = hashlib.sha256(f"{job}\0{run_id}".encode()).hexdigest()[:16]
    return f"{PREFIX}{run}-{secrets.token_hex(4)}"


def ship(files: SessionFiles, job: str, run_id: str, token: JobToken) -> TokenFile:
    """The `TokenFile` of this run's token in this session, added to it the first time."""
    digest = token_digest(token)
    key = (files.key, job, run_id, digest)
    with _ship_lock:
        known = _shipped.get(key)
        if known is not None:
            return known
        ref = TokenFile(file_name(job, run_id), digest)
        path = os.path.join(_private_dir(), ref.name)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(token.reveal())
            files.add(path)
        except BaseException:
            os.unlink(path)
            raise
        if not files.keep_local:
            os.unlink(path)
        _shipped[key] = ref
        return ref
