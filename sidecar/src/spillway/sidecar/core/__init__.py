"""The pure policy core: no grpc, confluent_kafka, pyspark or opentelemetry imports here.

It talks to the world through the ports in `ports.py`; the adapters that translate it live in
`spillway.sidecar.transport`. Its public face, re-exported here, is what the other packages
use (the service, the federation, the transport, the DLQ pipeline, the runtime):

- the engine: `PolicyEngine` (policy.py), `run_key`, a home's `Tally` of one report and its
  `Group`s (streaks.py), `SliceAsk` and the slice bounds (slices.py);
- values: failed records, verdicts, decisions and DLQ records (model.py); `JobSettings`,
  `DlqSettings`, `job_settings` (settings.py); `HandlerRules` (handlers.py);
- DLQ records: `DlqBuilder`, `build_dlq_record`, `new_dlq_record`, the header names and
  `valid_traceparent` (dlq_record.py); the topic rules `check_topic_name` (guardrails.py),
  `valid_topic_name`, `invalid_topic_message` (names.py);
- ports: `Clock`, `RandomSource`, `SystemClock` (ports.py); payload digests: `run_secret`,
  `payload_tag` (tolerance.py).

The property table (`config`), the request bounds (`names`), the domain values (`model`) and
the id table (`idtable`) are also used as modules: ``from spillway.sidecar.core import config``.
"""

from . import config, idtable, model, names
from .dlq_record import (
    CONNECT_PREFIX,
    DLQ_PREFIX,
    H_COPIED,
    H_JOB,
    H_PAYLOAD,
    H_RECORD_ID,
    H_REDRIVE_COUNT,
    H_RUN_ID,
    H_TIMESTAMP,
    H_TRACEPARENT,
    H_TRACESTATE,
    SPILLWAY_PREFIX,
    DlqBuilder,
    build_dlq_record,
    new_dlq_record,
    valid_traceparent,
)
from .guardrails import DEFAULT_REQUIRED_PREFIX, check_topic_name
from .handlers import HandlerResponse, HandlerRules
from .model import (
    Action,
    Category,
    Decision,
    DlqRecord,
    ExceptionInfo,
    FailedRecord,
    Header,
    JobSummary,
    Stage,
    StageRef,
    TaskIdentity,
    Verdict,
    task_key,
    task_run_prefix,
)
from .names import invalid_topic_message, valid_topic_name
from .policy import PolicyEngine, Tally, run_key
from .ports import Clock, RandomSource, SystemClock
from .settings import DlqSettings, JobSettings, job_settings
from .slices import MAX_OPEN, MAX_SLICE, SliceAsk
from .streaks import Group, Streak
from .tolerance import payload_tag, run_secret

__all__ = [
    "CONNECT_PREFIX",
    "DEFAULT_REQUIRED_PREFIX",
    "DLQ_PREFIX",
    "H_COPIED",
    "H_JOB",
    "H_PAYLOAD",
    "H_RECORD_ID",
    "H_REDRIVE_COUNT",
    "H_RUN_ID",
    "H_TIMESTAMP",
    "H_TRACEPARENT",
    "H_TRACESTATE",
    "MAX_OPEN",
    "MAX_SLICE",
    "SPILLWAY_PREFIX",
    "Action",
    "Category",
    "Clock",
    "Decision",
    "DlqBuilder",
    "DlqRecord",
    "DlqSettings",
    "ExceptionInfo",
    "FailedRecord",
    "Group",
    "HandlerResponse",
    "HandlerRules",
    "Header",
    "JobSettings",
    "JobSummary",
    "PolicyEngine",
    "RandomSource",
    "SliceAsk",
    "Stage",
    "StageRef",
    "Streak",
    "SystemClock",
    "Tally",
    "TaskIdentity",
    "Verdict",
    "build_dlq_record",
    "check_topic_name",
    "config",
    "idtable",
    "invalid_topic_message",
    "job_settings",
    "model",
    "names",
    "new_dlq_record",
    "payload_tag",
    "run_key",
    "run_secret",
    "task_key",
    "task_run_prefix",
    "valid_topic_name",
    "valid_traceparent",
]
