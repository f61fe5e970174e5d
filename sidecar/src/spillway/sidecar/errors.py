"""spillway sidecar exceptions. Foreign errors are mapped at the boundary with `raise X from exc`.

    SpillwayError
    ├── ConfigError                 a property is missing, malformed or out of range (names it)
    ├── JobError
    │   ├── UnknownJobError         a report names a job that was never registered
    │   └── JobConflictError        a live job re-registered with a different policy
    ├── DlqError
    │   ├── TopicGuardrailError     a DLQ topic name or auto-create rule was refused
    │   ├── KafkaUnreachableError   the sidecar's Kafka did not answer a check (names it)
    │   ├── BackpressureError       the spool is at its high-water mark: retry later
    │   └── FlushTimeoutError       a flush barrier's deadline passed before Kafka acknowledged
    └── HandlerError                a user handler raised (KIP-1033: fails the job)
"""

from __future__ import annotations


class SpillwayError(Exception):
    """Root of every error the sidecar raises on purpose."""


class ConfigError(SpillwayError, ValueError):
    def __init__(self, prop: str, message: str) -> None:
        self.property = prop
        super().__init__(f"{prop}: {message}")


class JobError(SpillwayError):
    pass


class UnknownJobError(JobError, KeyError):
    def __init__(self, job: str) -> None:
        self.job = job
        super().__init__(job)

    def __str__(self) -> str:
        return f"job {self.job!r} is not registered with this sidecar (call RegisterJob first)"


class JobConflictError(JobError):
    pass


class DlqError(SpillwayError):
    pass


class KafkaUnreachableError(DlqError):
    """The sidecar's Kafka did not answer (or refused) a check a request needed: the sidecar
    itself is up, its Kafka is the problem."""

    def __init__(self, servers: str, cause: str) -> None:
        self.servers = servers
        super().__init__(
            f"the sidecar's Kafka at {servers} is unreachable or refused the DLQ topic check: "
            f"{cause}. The sidecar is up; check its bootstrap.servers and that those brokers "
            f"are reachable from the sidecar's host")


class TopicGuardrailError(DlqError, ConfigError):
    def __init__(self, prop: str, message: str) -> None:
        ConfigError.__init__(self, prop, message)


class BackpressureError(DlqError):
    pass


class FlushTimeoutError(DlqError, TimeoutError):
    pass


class HandlerError(SpillwayError):
    pass
