"""Writes docs/CONFIGURATION.md from the property table in spillway.sidecar.core.config.

The table is the single source of truth; tests/unit/project/test_config_doc.py fails when the
doc is stale.
"""

from __future__ import annotations

import sys
from pathlib import Path

from spillway.sidecar.core import config

HEADER = """# Configuration

Generated from `spillway.sidecar.core.config` by `scripts/gen_config_doc.py`; do not edit by hand.

Every property can be given, highest precedence first, as a flag (`spillway serve --set
key=value`; per job: the `properties` of RegisterJob, i.e. `spillway.spark.Job(name, {...})`),
as an environment variable (`SPILLWAY_` + the name upper-cased, dots as underscores, e.g.
`SPILLWAY_ERRORS_TOLERANCE=all`), in the sidecar's Java-properties file (`--config`), or left at
its default. Job properties set on the sidecar are defaults for every job registered with it.
Invalid values stop start-up (or refuse the job) with a message naming the property.

DLQ producer settings for librdkafka pass through as `producer.kafka.<librdkafka key>`
(environment: `SPILLWAY_PRODUCER_KAFKA_<KEY>`); they also serve the sidecar's DLQ topic check
and Kafka health check. A value may be a reference to a secret, in Kafka's config-provider
syntax: `${directory:/dir:file}`, `${file:/path.properties:key}`, `${env:NAME}`; a secret given
literally on `--set` is refused. Kafka authentication (SASL/SCRAM, SASL/PLAIN, MSK IAM with
`producer.kafka.sasl.oauthbearer.method=aws-msk-iam`, mTLS): docs/SECURITY.md.
"""


ALIASES_HEADER = """
## Other KIPs' names

Accepted wherever a property is (RegisterJob, flags, environment, file) and read as the
property they name; effective properties and messages use spillway's name. Setting both names
in one place to different values is refused, naming both (the same value twice is fine).

| alias | property | environment |
|---|---|---|"""

ALIASES_FOOTER = """
*The status-store family*: once any of its five knobs is set (under either name), every unset
one takes that KIP's default: `max.retries` 5, `initial.backoff.ms` 300, `max.backoff.ms` 10000,
`backoff.multiplier` 2.0, `jitter.factor` 0.25, and its formula shapes the delays. So a shape
knob alone retries 5 times, as the KIP says, instead of enabling nothing. *Deliberate
differences from that KIP*: an unset `max.backoff.ms` is lowered to `errors.retry.delay.max.ms`
when that is lower (KIP-298 calls it the maximum delay between two retries), and an unset
`initial.backoff.ms` is lowered to the cap, so a default never fails the KIP's start-up check
`initial <= max`; `errors.retry.timeout`, when positive, still bounds the retry time as well
(whichever bound is reached first ends the retries)."""


def _range(p) -> str:
    rng = getattr(p.parse, "range", None)
    if rng is None:
        return ""
    lo, hi, extra = rng
    also = "".join(f" or {x:g}" for x in extra)
    return f" (range {lo:,} to {hi:,}{also})".replace(",", " ") if hi is not None else ""


GUARDRAILS = """
## Operator guardrails

Sidecar-only properties a job can neither set (RegisterJob refuses them as unknown job
properties) nor loosen:

- `errors.handler.allowed.classes`, `errors.handler.timeout.ms`, `errors.handler.pool.size`:
  which user handler classes a job may name (nothing else is imported) and how long one may
  run on its own small thread pool before it counts as a handler crash (docs/POLICY.md,
  "User handlers are operator-owned code");
- `dlq.topic.required.prefix`, `dlq.topic.auto.create.allow`: every DLQ topic name starts with
  the operator's prefix (a job's `errors.deadletterqueue.topic.name.prefix` may only narrow it)
  and whether jobs may have DLQ topics created (docs/DLQ.md, "Topic guardrails")."""

BOUNDS_HEADER = """
## Request bounds

Every request field is checked before any servicer code runs (`transport/validate.py`,
`core/names.py`); a field over its bound is refused with INVALID_ARGUMENT naming the field and
the bound (never repeating a long value), and the request changes nothing. An undecodable
request answers INVALID_ARGUMENT `request is not a valid spillway.v1.<Message>: ...`. Error
details are at most 1024 characters, without control characters. Every numeric property above
has a range and is refused outside it, naming the property. Job summaries saturate at the
largest uint64 rather than fail. The client cuts exception messages, stack traces (keeping
their end) and cause chains to these bounds before sending.

A job name is used exactly as given on every call (RegisterJob, ReportFailures, FlushTask,
GetJobSummary, EndJob, GetStatus's filter): 1 to 200 printable characters and at most 255
UTF-8 bytes (it fits a Kafka header), no control, format or line-separator characters, and no
leading or trailing whitespace (refused, not trimmed, so a job never registers under one
spelling and reports under another). `spillway.spark.Job` refuses the same names on the
driver with the same message.

| field | bound |
|---|---|"""


def _bounds() -> list[str]:
    from spillway.sidecar.core import names as n
    from spillway.sidecar.transport import validate as v

    rows = [
        ("job", f"{n.MAX_JOB_NAME_CHARS} characters, {n.MAX_JOB_NAME_BYTES} UTF-8 bytes"),
        ("run_id", f"{n.MAX_RUN_ID_CHARS} characters from `[A-Za-z0-9._:@+=-]`"),
        ("record_id, recovered_record_ids[i]", f"1 to {n.MAX_RECORD_ID_BYTES} UTF-8 bytes"),
        ("custom_stage", f"{n.MAX_CUSTOM_STAGE_CHARS} printable characters"),
        ("function_name", f"{n.MAX_FUNCTION_NAME_CHARS} printable characters"),
        ("properties", f"{v.MAX_PROPERTIES} entries; keys {v.MAX_PROPERTY_KEY_CHARS}, "
                       f"values {v.MAX_PROPERTY_VALUE_CHARS} characters"),
        ("home, peer / home_instance_id", f"{v.MAX_ADDRESS_CHARS} / "
                                          f"{v.MAX_INSTANCE_ID_CHARS} characters"),
        ("records (per report)", f"{v.MAX_RECORDS_PER_REPORT} records"),
        ("recovered_record_ids, undo_dead_letter_record_ids", f"{v.MAX_RECOVERED_IDS} ids each"),
        ("processed", f"{v.MAX_STAGE_COUNTS} entries, each 0 to {v.MAX_PROCESSED_PER_ENTRY} "
                      f"records per call"),
        ("task.stage_id, partition_id, attempt_number", "0 to 2^31-1"),
        ("task.task_attempt_id", "0 to 2^63-1"),
        ("task.host / executor_id", f"{v.MAX_HOST_CHARS} / {v.MAX_EXECUTOR_ID_CHARS} "
                                    f"printable characters"),
        ("source.topic", f"{v.MAX_TOPIC_CHARS} characters"),
        ("source.partition / offset", "-1 to 2^31-1 / -1 to 2^63-1"),
        ("timestamp_ms", f"-1 to {v.MAX_TIMESTAMP_MS} (9999-12-31)"),
        ("attempt", f"0 to {v.MAX_ATTEMPT}"),
        ("headers", f"{v.MAX_HEADERS} per record, keys {v.MAX_HEADER_KEY_CHARS} characters, "
                    f"{v.MAX_HEADER_BYTES} bytes of keys and values together"),
        ("traceparent / tracestate", f"{v.MAX_TRACEPARENT_CHARS} / {v.MAX_TRACESTATE_CHARS} "
                                     f"characters"),
        ("exception.class_name, class_chain[i]", f"{v.MAX_CLASS_NAME_CHARS} characters; "
                                                 f"{v.MAX_CLASS_CHAIN} entries"),
        ("exception.message", f"{v.MAX_MESSAGE_CHARS} characters"),
        ("exception.stack_trace", f"{v.MAX_STACK_TRACE_CHARS} characters"),
        ("exception.causes", f"{v.MAX_CAUSES} entries of {v.MAX_CAUSE_CHARS} characters"),
        ("exception.kafka_error_code", f"{v.MAX_KAFKA_CODE_CHARS} characters"),
        ("exception.grpc_status_code / http_status_code", "0 to 16 / 0 to 999"),
        ("GetStatus page_size / page_token", f"0 to {v.MAX_PAGE_SIZE} / "
                                             f"{v.MAX_PAGE_TOKEN_CHARS} characters"),
    ]
    return [f"| `{f}` | {b} |" if "," not in f and "/" not in f and "(" not in f
            else f"| {f} | {b} |" for f, b in rows]


def render() -> str:
    out = [HEADER]
    for title, job in (("Job properties", True), ("Sidecar properties", False)):
        out.append(f"\n## {title}\n\n| property | default | environment | meaning |\n"
                   "|---|---|---|---|")
        for p in config.PROPERTIES.values():
            if p.job is job:
                default = f"`{p.default}`" if p.default != "" else "(unset)"
                out.append(f"| `{p.name}` | {default} | `{config.env_name(p.name)}` | "
                           f"{p.doc.replace('|', '/')}{_range(p)} |")
    out.append(ALIASES_HEADER)
    for alias, name in config.ALIASES.items():
        out.append(f"| `{alias}` | `{name}` | `{config.env_name(alias)}` |")
    out.append(ALIASES_FOOTER)
    out.append(GUARDRAILS)
    out.append(BOUNDS_HEADER)
    out.extend(_bounds())
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    target = Path(__file__).resolve().parents[1] / "docs" / "CONFIGURATION.md"
    if "--check" in sys.argv:
        sys.exit(0 if target.read_text() == render() else 1)
    target.write_text(render())
    print(f"wrote {target}")
