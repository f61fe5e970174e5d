"""One run of a job, as the client names it: the job, the run id and the run's job token.

The job token is the run's credential (issued by the home sidecar on the run's first
RegisterJob). It travels in the ``spillway-job-token`` call metadata of every job-scoped call,
never in a message, and is held in `JobToken`, whose repr hides it and which refuses to be
pickled: a pickled object can end up in logs (Spark logs plans and closures), so no code path
may ship the token by accident. spillway.spark hands it to executors as a Spark file
(`spillway.spark._token`), never inside a plan.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

JOB_TOKEN_METADATA = "spillway-job-token"


_NOT_PICKLED = (
    "a JobToken cannot be pickled: a pickled object can end up in logs (Spark logs plans and "
    "closures), which would hand the run's token to their readers. spillway.spark ships it to "
    "executors as a Spark file (spillway.spark._token); elsewhere pass it explicitly "
    "(JobToken.reveal()) over a channel that keeps it secret")


class JobToken:
    """A secret string whose repr and str never show it (``.reveal()`` does)."""

    __slots__ = ("_value",)

    def __init__(self, value: str) -> None:
        if not isinstance(value, str) or not value:
            raise ValueError("job token: expected a non-empty string")
        self._value = value

    def reveal(self) -> str:
        return self._value

    def __repr__(self) -> str:
        return "JobToken('**********')"

    __str__ = __repr__

    def __eq__(self, other: object) -> bool:
        return isinstance(other, JobToken) and other._value == self._value

    def __hash__(self) -> int:
        return hash(self._value)

    def __reduce_ex__(self, protocol: object) -> object:
        raise TypeError(_NOT_PICKLED)

    def __reduce__(self) -> object:
        raise TypeError(_NOT_PICKLED)

    def __copy__(self) -> JobToken:  # immutable: copying (dataclasses, copy) is the object
        return self

    def __deepcopy__(self, memo: object) -> JobToken:
        return self


def new_run_id() -> str:
    """A run id when there is no Spark application id to use."""
    return uuid.uuid4().hex


@dataclass(frozen=True)
class JobRun:
    """Names one run of a job on every job-scoped call; ``job_token`` proves the caller may."""

    job: str
    run_id: str = ""
    job_token: JobToken | None = None

    def metadata(self) -> list[tuple[str, str]]:
        return [(JOB_TOKEN_METADATA, self.job_token.reveal())] if self.job_token else []


@dataclass(frozen=True, eq=False)
class Registration(JobRun, Mapping):
    """RegisterJob's answer: the run (with its token), the run's home sidecar and the policy in
    force. Reads as the mapping of effective properties too, as `register_job` used to return
    (``reg["errors.tolerance"]``, ``dict(reg)``)."""

    home: str = ""
    home_instance_id: str = ""
    effective_properties: Mapping[str, str] = field(default_factory=dict)

    def __getitem__(self, key: str) -> str:
        return self.effective_properties[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.effective_properties)

    def __len__(self) -> int:
        return len(self.effective_properties)

    def run(self) -> JobRun:
        return JobRun(self.job, self.run_id, self.job_token)

    # neither Mapping's equality (the properties only) nor JobRun's: a registration is itself
    __eq__ = object.__eq__
    __hash__ = object.__hash__


def as_run(job: str | JobRun, run_id: str = "", job_token: str | JobToken | None = None
           ) -> JobRun:
    """A `JobRun` from either a run or a job name (plus run id and token)."""
    if isinstance(job, JobRun):
        return job
    if isinstance(job_token, str):
        job_token = JobToken(job_token) if job_token else None
    return JobRun(job, run_id, job_token)
