"""The DLQ ledger's format: what redrive and reprocess resolved, one resolution record per DLQ
record, in a topic beside the DLQ (``<dlq topic>.ledger`` by default, compacted).

Kafka cannot delete a single record, so a DLQ record that was dealt with stays in the DLQ; the
ledger says it was. Its key is `ledger_key`: a digest of the DLQ record's identity (job, run
id, record id, key and value; its DLQ coordinates when it has no record id), so that a record
written twice into the DLQ (a sidecar that re-sent it after a crash) has one key, and two
different records that share a record id have two. Its value is JSON (`encode`):

- ``redriven``: ``spillway dlq redrive`` published it to ``target`` and Kafka acknowledged it;
- ``reprocessed``: `Job.reprocess` ran it through the fixed function and it succeeded;
- ``superseded``: `Job.reprocess` ran it, it failed again and was dead-lettered again as
  ``new_record_id`` (that new DLQ record carries it on, unresolved).

Shared by the sidecar's tools (redrive) and spillway-spark (read_dlq, reprocess): pure, no Kafka.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

LEDGER_SUFFIX = ".ledger"
FORMAT_VERSION = 1
RESOLUTIONS = ("redriven", "reprocessed", "superseded")

# Headers `Job.reprocess` puts on the rows it hands to the fixed function (and that a failure
# dead-lettered again therefore carries): the DLQ record it came from, its DLQ topic, what its
# key/value are, and its trace context (a link, never a parent).
H_REDRIVE_FROM = "spillway.redrive.from"
H_REDRIVE_DLQ = "spillway.redrive.dlq"
H_REDRIVE_PAYLOAD = "spillway.redrive.payload"
H_REDRIVE_LINK = "spillway.redrive.link"

# A value larger than this is not a resolution (a stray record in the ledger topic).
MAX_VALUE_BYTES = 16 * 1024


def ledger_topic(dlq_topic: str) -> str:
    return dlq_topic + LEDGER_SUFFIX


def _field(data: bytes | None) -> bytes:
    # length-prefixed, so that no two different inputs hash alike; None differs from b""
    if data is None:
        return b"\xff\xff\xff\xff"
    return len(data).to_bytes(4, "big") + data


def ledger_key(job: str | None, run_id: str | None, record_id: str | None, key: bytes | None,
               value: bytes | None, *, topic: str, partition: int, offset: int) -> str:
    """The ledger key of a DLQ record: 32 hex digits."""
    h = hashlib.sha256()
    if record_id:
        for part in (job or "", run_id or "", record_id):
            h.update(_field(part.encode("utf-8", "surrogatepass")))
    else:  # no id to go by: this copy in the DLQ is the record
        h.update(_field(f"@{topic}/{partition}/{offset}".encode("utf-8", "surrogatepass")))
    h.update(_field(key))
    h.update(_field(value))
    return h.hexdigest()[:32]


@dataclass(frozen=True, slots=True)
class Resolution:
    resolution: str            # one of RESOLUTIONS
    at_ms: int                 # when it was resolved
    by: str                    # "spillway dlq redrive" or "reprocess <job>"
    job: str = ""              # the DLQ record's job, run id and record id, for people
    run_id: str = ""
    record_id: str = ""
    dlq: str = ""              # where the DLQ record was: topic[partition]@offset
    target: str = ""           # redriven: the topic it went to
    new_record_id: str = ""    # superseded: the id it was dead-lettered again under
    run: str = ""              # reprocess: the run that resolved it

    def __post_init__(self) -> None:
        if self.resolution not in RESOLUTIONS:
            raise ValueError(f"resolution: expected one of {RESOLUTIONS}, "
                             f"got {self.resolution!r}")


def encode(r: Resolution) -> bytes:
    body = {"v": FORMAT_VERSION, "resolution": r.resolution, "at": r.at_ms, "by": r.by}
    for name in ("job", "run_id", "record_id", "dlq", "target", "new_record_id", "run"):
        v = getattr(r, name)
        if v:
            body[name] = v
    return json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def decode(data: bytes | None) -> Resolution | None:
    """A resolution, or None for anything that is not one (a tombstone, a stray record, a
    newer format version): such records are not resolutions and are ignored."""
    if not data or len(data) > MAX_VALUE_BYTES:
        return None
    try:
        body = json.loads(data)
    except (UnicodeDecodeError, ValueError):
        return None
    if not isinstance(body, dict) or body.get("v") != FORMAT_VERSION:
        return None
    kind, at = body.get("resolution"), body.get("at")
    if kind not in RESOLUTIONS or not isinstance(at, int) or isinstance(at, bool):
        return None
    text = {k: body.get(k) if isinstance(body.get(k), str) else ""
            for k in ("by", "job", "run_id", "record_id", "dlq", "target", "new_record_id",
                      "run")}
    return Resolution(kind, at, **text)


class LedgerError(Exception):
    """The ledger topic cannot be used (created, read or written)."""


def ensure_topic(kafka: Any, conf: dict, topic: str, partitions: int,
                 timeout_s: float = 10.0) -> bool:
    """Create the ledger topic (compacted: the latest resolution per key is all it needs) when
    it does not exist; True when this call created it. `kafka` is the caller's
    ``confluent_kafka`` module (with ``confluent_kafka.admin`` imported): this package does not
    depend on it. LedgerError when it cannot."""
    AdminClient, NewTopic = kafka.admin.AdminClient, kafka.admin.NewTopic
    KafkaError, KafkaException = kafka.KafkaError, kafka.KafkaException

    admin = AdminClient({k: v for k, v in conf.items() if k not in ("logger", "log_level")})
    try:
        md = admin.list_topics(timeout=timeout_s)
    except KafkaException as exc:
        raise LedgerError(f"cannot read the cluster's metadata: {exc}") from exc
    meta = md.topics.get(topic)
    if meta is not None and meta.error is None:
        return False
    rf = min(3, max(1, len(md.brokers)))
    futures = admin.create_topics(
        [NewTopic(topic, num_partitions=max(1, partitions), replication_factor=rf,
                  config={"cleanup.policy": "compact"})],
        operation_timeout=timeout_s, request_timeout=timeout_s)
    try:
        futures[topic].result(timeout_s)
    except KafkaException as exc:
        err = exc.args[0] if exc.args else None
        if isinstance(err, KafkaError) and err.code() == KafkaError.TOPIC_ALREADY_EXISTS:
            return False
        raise LedgerError(f"the ledger topic {topic!r} does not exist and creating it failed "
                          f"({exc}); create it (cleanup.policy=compact)") from exc
    except TimeoutError as exc:
        raise LedgerError(f"creating the ledger topic {topic!r} did not finish within "
                          f"{timeout_s:g}s") from exc
    return True


def describe(r: Resolution) -> str:
    """One line for people: what resolved it and when."""
    what = {"redriven": f"redriven to {r.target!r}" if r.target else "redriven",
            "reprocessed": "reprocessed successfully",
            "superseded": (f"failed again in reprocess and was dead-lettered as "
                           f"{r.new_record_id!r}" if r.new_record_id
                           else "failed again in reprocess and was dead-lettered again")}
    return f"{what[r.resolution]} by {r.by or '?'} at {r.at_ms}"
