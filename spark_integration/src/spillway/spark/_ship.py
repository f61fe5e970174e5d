"""Driver side of the run's job token: the spec a wrapper hands to executors, its `JobToken`
replaced by where executors find it (`_token`): the Spark file of the session that runs the
wrapper, or, for a streaming query over Spark Connect, the token's digest: its executors claim
the token from their sidecar, where the driver escrowed it (`_token.EscrowedToken`)."""

from __future__ import annotations

import dataclasses
from typing import Any

from spillway.client.runs import JobToken

from ._compat import active_session, is_connect
from ._runtime import JobSpec
from ._token import EscrowedToken, SessionFiles, TokenFileError, ship, spark_files, token_digest

def session_files(data: Any) -> SessionFiles:
    """The files of the Spark session that runs ``data`` (a DataFrame or RDD; None: the active
    session), where the run's job token goes."""
    if data is None:
        session = active_session()
        if session is None:
            raise TokenFileError(
                "no active SparkSession: the run's job token reaches executors as a file of "
                "the session that runs the wrapper; start the session (SparkSession.builder"
                "...getOrCreate()) before making a job.udf or job.foreach_batch")
        return spark_files(session)
    from pyspark import RDD

    return spark_files(data.context if isinstance(data, RDD) else data.sparkSession)


def streaming_over_connect(data: Any, streaming: bool) -> bool:
    """Whether ``data`` (None: the active session) is a streaming query over Spark Connect,
    whose micro-batches run without the session's artifacts (seen on Spark 4.3)."""
    session = active_session() if data is None else data
    if session is None or not is_connect(session):
        return False
    return streaming or bool(data is not None and getattr(data, "isStreaming", False))


def shipped_spec(spec: JobSpec, data: Any, *, streaming: bool = False) -> JobSpec:
    """``spec`` as executors get it: its token replaced by the Spark file that holds it in the
    session of ``data`` (None: the active session), added there once per session and token; a
    streaming query over Spark Connect (``data.isStreaming``, or ``streaming``) gets an
    `_token.EscrowedToken` (the caller escrowed the token with the run's home first: `Job`).
    A spec without a `JobToken` is returned as it is (a copy of a `Job` unpickled on a Connect
    server holds no token)."""
    token = spec.job_token
    if not isinstance(token, JobToken):
        return spec
    if streaming_over_connect(data, streaming):
        return dataclasses.replace(spec, job_token=EscrowedToken(token_digest(token)))
    return dataclasses.replace(
        spec, job_token=ship(session_files(data), spec.name, spec.run_id, token))
