from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Iterable as _Iterable, Mapping as _Mapping, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Stage(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = []
    STAGE_UNSPECIFIED: _ClassVar[Stage]
    STAGE_DESERIALIZATION: _ClassVar[Stage]
    STAGE_KEY_CONVERTER: _ClassVar[Stage]
    STAGE_VALUE_CONVERTER: _ClassVar[Stage]
    STAGE_HEADER_CONVERTER: _ClassVar[Stage]
    STAGE_TRANSFORMATION: _ClassVar[Stage]
    STAGE_SINK: _ClassVar[Stage]
    STAGE_PRODUCE: _ClassVar[Stage]
    STAGE_CUSTOM: _ClassVar[Stage]

class Category(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = []
    CATEGORY_UNSPECIFIED: _ClassVar[Category]
    CATEGORY_RETRIABLE: _ClassVar[Category]
    CATEGORY_REFRESH_RETRIABLE: _ClassVar[Category]
    CATEGORY_ABORTABLE: _ClassVar[Category]
    CATEGORY_APPLICATION_RECOVERABLE: _ClassVar[Category]
    CATEGORY_INVALID_CONFIGURATION: _ClassVar[Category]
    CATEGORY_DATA: _ClassVar[Category]
    CATEGORY_CRASH: _ClassVar[Category]
    CATEGORY_TIMEOUT: _ClassVar[Category]

class Payload(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = []
    PAYLOAD_UNSPECIFIED: _ClassVar[Payload]
    PAYLOAD_SOURCE: _ClassVar[Payload]
    PAYLOAD_STAGE_INPUT: _ClassVar[Payload]

class Action(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = []
    ACTION_UNSPECIFIED: _ClassVar[Action]
    ACTION_RETRY: _ClassVar[Action]
    ACTION_SKIP: _ClassVar[Action]
    ACTION_FAIL: _ClassVar[Action]
STAGE_UNSPECIFIED: Stage
STAGE_DESERIALIZATION: Stage
STAGE_KEY_CONVERTER: Stage
STAGE_VALUE_CONVERTER: Stage
STAGE_HEADER_CONVERTER: Stage
STAGE_TRANSFORMATION: Stage
STAGE_SINK: Stage
STAGE_PRODUCE: Stage
STAGE_CUSTOM: Stage
CATEGORY_UNSPECIFIED: Category
CATEGORY_RETRIABLE: Category
CATEGORY_REFRESH_RETRIABLE: Category
CATEGORY_ABORTABLE: Category
CATEGORY_APPLICATION_RECOVERABLE: Category
CATEGORY_INVALID_CONFIGURATION: Category
CATEGORY_DATA: Category
CATEGORY_CRASH: Category
CATEGORY_TIMEOUT: Category
PAYLOAD_UNSPECIFIED: Payload
PAYLOAD_SOURCE: Payload
PAYLOAD_STAGE_INPUT: Payload
ACTION_UNSPECIFIED: Action
ACTION_RETRY: Action
ACTION_SKIP: Action
ACTION_FAIL: Action

class RegisterJobRequest(_message.Message):
    __slots__ = ["job", "properties", "home", "run_id", "home_instance_id", "peer", "token_escrow", "claim_token"]
    class PropertiesEntry(_message.Message):
        __slots__ = ["key", "value"]
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    JOB_FIELD_NUMBER: _ClassVar[int]
    PROPERTIES_FIELD_NUMBER: _ClassVar[int]
    HOME_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    HOME_INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    PEER_FIELD_NUMBER: _ClassVar[int]
    TOKEN_ESCROW_FIELD_NUMBER: _ClassVar[int]
    CLAIM_TOKEN_FIELD_NUMBER: _ClassVar[int]
    job: str
    properties: _containers.ScalarMap[str, str]
    home: str
    run_id: str
    home_instance_id: str
    peer: str
    token_escrow: bool
    claim_token: bool
    def __init__(self, job: _Optional[str] = ..., properties: _Optional[_Mapping[str, str]] = ..., home: _Optional[str] = ..., run_id: _Optional[str] = ..., home_instance_id: _Optional[str] = ..., peer: _Optional[str] = ..., token_escrow: bool = ..., claim_token: bool = ...) -> None: ...

class RegisterJobResponse(_message.Message):
    __slots__ = ["job", "effective_properties", "run_id", "job_token", "home", "home_instance_id", "process_port", "report_columns"]
    class EffectivePropertiesEntry(_message.Message):
        __slots__ = ["key", "value"]
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    JOB_FIELD_NUMBER: _ClassVar[int]
    EFFECTIVE_PROPERTIES_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    JOB_TOKEN_FIELD_NUMBER: _ClassVar[int]
    HOME_FIELD_NUMBER: _ClassVar[int]
    HOME_INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    PROCESS_PORT_FIELD_NUMBER: _ClassVar[int]
    REPORT_COLUMNS_FIELD_NUMBER: _ClassVar[int]
    job: str
    effective_properties: _containers.ScalarMap[str, str]
    run_id: str
    job_token: str
    home: str
    home_instance_id: str
    process_port: int
    report_columns: bool
    def __init__(self, job: _Optional[str] = ..., effective_properties: _Optional[_Mapping[str, str]] = ..., run_id: _Optional[str] = ..., job_token: _Optional[str] = ..., home: _Optional[str] = ..., home_instance_id: _Optional[str] = ..., process_port: _Optional[int] = ..., report_columns: bool = ...) -> None: ...

class SourceCoordinates(_message.Message):
    __slots__ = ["topic", "partition", "offset"]
    TOPIC_FIELD_NUMBER: _ClassVar[int]
    PARTITION_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    topic: str
    partition: int
    offset: int
    def __init__(self, topic: _Optional[str] = ..., partition: _Optional[int] = ..., offset: _Optional[int] = ...) -> None: ...

class Header(_message.Message):
    __slots__ = ["key", "value"]
    KEY_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    key: str
    value: bytes
    def __init__(self, key: _Optional[str] = ..., value: _Optional[bytes] = ...) -> None: ...

class TaskIdentity(_message.Message):
    __slots__ = ["stage_id", "partition_id", "attempt_number", "task_attempt_id", "executor_id", "host"]
    STAGE_ID_FIELD_NUMBER: _ClassVar[int]
    PARTITION_ID_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_NUMBER_FIELD_NUMBER: _ClassVar[int]
    TASK_ATTEMPT_ID_FIELD_NUMBER: _ClassVar[int]
    EXECUTOR_ID_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    stage_id: int
    partition_id: int
    attempt_number: int
    task_attempt_id: int
    executor_id: str
    host: str
    def __init__(self, stage_id: _Optional[int] = ..., partition_id: _Optional[int] = ..., attempt_number: _Optional[int] = ..., task_attempt_id: _Optional[int] = ..., executor_id: _Optional[str] = ..., host: _Optional[str] = ...) -> None: ...

class ExceptionInfo(_message.Message):
    __slots__ = ["class_name", "class_chain", "message", "stack_trace", "grpc_status_code", "http_status_code", "kafka_retriable", "kafka_fatal", "kafka_txn_requires_abort", "marker_category", "causes", "kafka_error_code"]
    CLASS_NAME_FIELD_NUMBER: _ClassVar[int]
    CLASS_CHAIN_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    STACK_TRACE_FIELD_NUMBER: _ClassVar[int]
    GRPC_STATUS_CODE_FIELD_NUMBER: _ClassVar[int]
    HTTP_STATUS_CODE_FIELD_NUMBER: _ClassVar[int]
    KAFKA_RETRIABLE_FIELD_NUMBER: _ClassVar[int]
    KAFKA_FATAL_FIELD_NUMBER: _ClassVar[int]
    KAFKA_TXN_REQUIRES_ABORT_FIELD_NUMBER: _ClassVar[int]
    MARKER_CATEGORY_FIELD_NUMBER: _ClassVar[int]
    CAUSES_FIELD_NUMBER: _ClassVar[int]
    KAFKA_ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    class_name: str
    class_chain: _containers.RepeatedScalarFieldContainer[str]
    message: str
    stack_trace: str
    grpc_status_code: int
    http_status_code: int
    kafka_retriable: bool
    kafka_fatal: bool
    kafka_txn_requires_abort: bool
    marker_category: Category
    causes: _containers.RepeatedScalarFieldContainer[str]
    kafka_error_code: str
    def __init__(self, class_name: _Optional[str] = ..., class_chain: _Optional[_Iterable[str]] = ..., message: _Optional[str] = ..., stack_trace: _Optional[str] = ..., grpc_status_code: _Optional[int] = ..., http_status_code: _Optional[int] = ..., kafka_retriable: bool = ..., kafka_fatal: bool = ..., kafka_txn_requires_abort: bool = ..., marker_category: _Optional[_Union[Category, str]] = ..., causes: _Optional[_Iterable[str]] = ..., kafka_error_code: _Optional[str] = ...) -> None: ...

class FailedRecord(_message.Message):
    __slots__ = ["record_id", "stage", "custom_stage", "function_name", "source", "key", "value", "headers", "timestamp_ms", "exception", "attempt", "traceparent", "tracestate", "payload"]
    RECORD_ID_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    CUSTOM_STAGE_FIELD_NUMBER: _ClassVar[int]
    FUNCTION_NAME_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    HEADERS_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_MS_FIELD_NUMBER: _ClassVar[int]
    EXCEPTION_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    TRACESTATE_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    record_id: str
    stage: Stage
    custom_stage: str
    function_name: str
    source: SourceCoordinates
    key: bytes
    value: bytes
    headers: _containers.RepeatedCompositeFieldContainer[Header]
    timestamp_ms: int
    exception: ExceptionInfo
    attempt: int
    traceparent: str
    tracestate: str
    payload: Payload
    def __init__(self, record_id: _Optional[str] = ..., stage: _Optional[_Union[Stage, str]] = ..., custom_stage: _Optional[str] = ..., function_name: _Optional[str] = ..., source: _Optional[_Union[SourceCoordinates, _Mapping]] = ..., key: _Optional[bytes] = ..., value: _Optional[bytes] = ..., headers: _Optional[_Iterable[_Union[Header, _Mapping]]] = ..., timestamp_ms: _Optional[int] = ..., exception: _Optional[_Union[ExceptionInfo, _Mapping]] = ..., attempt: _Optional[int] = ..., traceparent: _Optional[str] = ..., tracestate: _Optional[str] = ..., payload: _Optional[_Union[Payload, str]] = ...) -> None: ...

class ReportFailuresRequest(_message.Message):
    __slots__ = ["job", "task", "records", "recovered_record_ids", "decide_only", "run_id", "undo_dead_letter_record_ids", "columns", "verdict_columns"]
    JOB_FIELD_NUMBER: _ClassVar[int]
    TASK_FIELD_NUMBER: _ClassVar[int]
    RECORDS_FIELD_NUMBER: _ClassVar[int]
    RECOVERED_RECORD_IDS_FIELD_NUMBER: _ClassVar[int]
    DECIDE_ONLY_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    UNDO_DEAD_LETTER_RECORD_IDS_FIELD_NUMBER: _ClassVar[int]
    COLUMNS_FIELD_NUMBER: _ClassVar[int]
    VERDICT_COLUMNS_FIELD_NUMBER: _ClassVar[int]
    job: str
    task: TaskIdentity
    records: _containers.RepeatedCompositeFieldContainer[FailedRecord]
    recovered_record_ids: _containers.RepeatedScalarFieldContainer[str]
    decide_only: bool
    run_id: str
    undo_dead_letter_record_ids: _containers.RepeatedScalarFieldContainer[str]
    columns: RecordColumns
    verdict_columns: bool
    def __init__(self, job: _Optional[str] = ..., task: _Optional[_Union[TaskIdentity, _Mapping]] = ..., records: _Optional[_Iterable[_Union[FailedRecord, _Mapping]]] = ..., recovered_record_ids: _Optional[_Iterable[str]] = ..., decide_only: bool = ..., run_id: _Optional[str] = ..., undo_dead_letter_record_ids: _Optional[_Iterable[str]] = ..., columns: _Optional[_Union[RecordColumns, _Mapping]] = ..., verdict_columns: bool = ...) -> None: ...

class FailureKind(_message.Message):
    __slots__ = ["stage", "custom_stage", "function_name", "exception", "payload"]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    CUSTOM_STAGE_FIELD_NUMBER: _ClassVar[int]
    FUNCTION_NAME_FIELD_NUMBER: _ClassVar[int]
    EXCEPTION_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    stage: Stage
    custom_stage: str
    function_name: str
    exception: ExceptionInfo
    payload: Payload
    def __init__(self, stage: _Optional[_Union[Stage, str]] = ..., custom_stage: _Optional[str] = ..., function_name: _Optional[str] = ..., exception: _Optional[_Union[ExceptionInfo, _Mapping]] = ..., payload: _Optional[_Union[Payload, str]] = ...) -> None: ...

class RecordColumns(_message.Message):
    __slots__ = ["record_ids", "kinds", "kind_index", "keys", "values", "absent", "topics", "topic_index", "partitions", "offsets", "timestamps_ms", "attempts", "traceparents", "tracestates", "trace_index", "headers", "header_counts"]
    RECORD_IDS_FIELD_NUMBER: _ClassVar[int]
    KINDS_FIELD_NUMBER: _ClassVar[int]
    KIND_INDEX_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    ABSENT_FIELD_NUMBER: _ClassVar[int]
    TOPICS_FIELD_NUMBER: _ClassVar[int]
    TOPIC_INDEX_FIELD_NUMBER: _ClassVar[int]
    PARTITIONS_FIELD_NUMBER: _ClassVar[int]
    OFFSETS_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMPS_MS_FIELD_NUMBER: _ClassVar[int]
    ATTEMPTS_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENTS_FIELD_NUMBER: _ClassVar[int]
    TRACESTATES_FIELD_NUMBER: _ClassVar[int]
    TRACE_INDEX_FIELD_NUMBER: _ClassVar[int]
    HEADERS_FIELD_NUMBER: _ClassVar[int]
    HEADER_COUNTS_FIELD_NUMBER: _ClassVar[int]
    record_ids: _containers.RepeatedScalarFieldContainer[str]
    kinds: _containers.RepeatedCompositeFieldContainer[FailureKind]
    kind_index: bytes
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    values: _containers.RepeatedScalarFieldContainer[bytes]
    absent: bytes
    topics: _containers.RepeatedScalarFieldContainer[str]
    topic_index: bytes
    partitions: bytes
    offsets: bytes
    timestamps_ms: bytes
    attempts: bytes
    traceparents: _containers.RepeatedScalarFieldContainer[str]
    tracestates: _containers.RepeatedScalarFieldContainer[str]
    trace_index: bytes
    headers: _containers.RepeatedCompositeFieldContainer[Header]
    header_counts: bytes
    def __init__(self, record_ids: _Optional[_Iterable[str]] = ..., kinds: _Optional[_Iterable[_Union[FailureKind, _Mapping]]] = ..., kind_index: _Optional[bytes] = ..., keys: _Optional[_Iterable[bytes]] = ..., values: _Optional[_Iterable[bytes]] = ..., absent: _Optional[bytes] = ..., topics: _Optional[_Iterable[str]] = ..., topic_index: _Optional[bytes] = ..., partitions: _Optional[bytes] = ..., offsets: _Optional[bytes] = ..., timestamps_ms: _Optional[bytes] = ..., attempts: _Optional[bytes] = ..., traceparents: _Optional[_Iterable[str]] = ..., tracestates: _Optional[_Iterable[str]] = ..., trace_index: _Optional[bytes] = ..., headers: _Optional[_Iterable[_Union[Header, _Mapping]]] = ..., header_counts: _Optional[bytes] = ...) -> None: ...

class Verdict(_message.Message):
    __slots__ = ["record_id", "action", "retry_delay_ms", "category", "reason", "dead_lettered", "attempt", "job_failed", "dead_letter", "retry_budget_exhausted"]
    RECORD_ID_FIELD_NUMBER: _ClassVar[int]
    ACTION_FIELD_NUMBER: _ClassVar[int]
    RETRY_DELAY_MS_FIELD_NUMBER: _ClassVar[int]
    CATEGORY_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    DEAD_LETTERED_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    JOB_FAILED_FIELD_NUMBER: _ClassVar[int]
    DEAD_LETTER_FIELD_NUMBER: _ClassVar[int]
    RETRY_BUDGET_EXHAUSTED_FIELD_NUMBER: _ClassVar[int]
    record_id: str
    action: Action
    retry_delay_ms: int
    category: Category
    reason: str
    dead_lettered: bool
    attempt: int
    job_failed: bool
    dead_letter: bool
    retry_budget_exhausted: bool
    def __init__(self, record_id: _Optional[str] = ..., action: _Optional[_Union[Action, str]] = ..., retry_delay_ms: _Optional[int] = ..., category: _Optional[_Union[Category, str]] = ..., reason: _Optional[str] = ..., dead_lettered: bool = ..., attempt: _Optional[int] = ..., job_failed: bool = ..., dead_letter: bool = ..., retry_budget_exhausted: bool = ...) -> None: ...

class ReportFailuresResponse(_message.Message):
    __slots__ = ["verdicts", "columns"]
    VERDICTS_FIELD_NUMBER: _ClassVar[int]
    COLUMNS_FIELD_NUMBER: _ClassVar[int]
    verdicts: _containers.RepeatedCompositeFieldContainer[Verdict]
    columns: TallyVerdicts
    def __init__(self, verdicts: _Optional[_Iterable[_Union[Verdict, _Mapping]]] = ..., columns: _Optional[_Union[TallyVerdicts, _Mapping]] = ...) -> None: ...

class TallyGroup(_message.Message):
    __slots__ = ["count", "stage", "custom_stage", "function_name", "exception"]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    CUSTOM_STAGE_FIELD_NUMBER: _ClassVar[int]
    FUNCTION_NAME_FIELD_NUMBER: _ClassVar[int]
    EXCEPTION_FIELD_NUMBER: _ClassVar[int]
    count: int
    stage: Stage
    custom_stage: str
    function_name: str
    exception: ExceptionInfo
    def __init__(self, count: _Optional[int] = ..., stage: _Optional[_Union[Stage, str]] = ..., custom_stage: _Optional[str] = ..., function_name: _Optional[str] = ..., exception: _Optional[_Union[ExceptionInfo, _Mapping]] = ...) -> None: ...

class TallyReport(_message.Message):
    __slots__ = ["task", "record_ids", "payload_digests", "groups", "claim", "slice", "want_slice", "closed_slices"]
    TASK_FIELD_NUMBER: _ClassVar[int]
    RECORD_IDS_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_DIGESTS_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    CLAIM_FIELD_NUMBER: _ClassVar[int]
    SLICE_FIELD_NUMBER: _ClassVar[int]
    WANT_SLICE_FIELD_NUMBER: _ClassVar[int]
    CLOSED_SLICES_FIELD_NUMBER: _ClassVar[int]
    task: TaskIdentity
    record_ids: _containers.RepeatedScalarFieldContainer[str]
    payload_digests: bytes
    groups: _containers.RepeatedCompositeFieldContainer[TallyGroup]
    claim: int
    slice: int
    want_slice: int
    closed_slices: _containers.RepeatedCompositeFieldContainer[SliceUse]
    def __init__(self, task: _Optional[_Union[TaskIdentity, _Mapping]] = ..., record_ids: _Optional[_Iterable[str]] = ..., payload_digests: _Optional[bytes] = ..., groups: _Optional[_Iterable[_Union[TallyGroup, _Mapping]]] = ..., claim: _Optional[int] = ..., slice: _Optional[int] = ..., want_slice: _Optional[int] = ..., closed_slices: _Optional[_Iterable[_Union[SliceUse, _Mapping]]] = ...) -> None: ...

class BudgetSlice(_message.Message):
    __slots__ = ["id", "size", "lease_ms"]
    ID_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    id: int
    size: int
    lease_ms: int
    def __init__(self, id: _Optional[int] = ..., size: _Optional[int] = ..., lease_ms: _Optional[int] = ...) -> None: ...

class SliceUse(_message.Message):
    __slots__ = ["id", "used"]
    ID_FIELD_NUMBER: _ClassVar[int]
    USED_FIELD_NUMBER: _ClassVar[int]
    id: int
    used: int
    def __init__(self, id: _Optional[int] = ..., used: _Optional[int] = ...) -> None: ...

class TallyRequest(_message.Message):
    __slots__ = ["job", "run_id", "reports"]
    JOB_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    REPORTS_FIELD_NUMBER: _ClassVar[int]
    job: str
    run_id: str
    reports: _containers.RepeatedCompositeFieldContainer[TallyReport]
    def __init__(self, job: _Optional[str] = ..., run_id: _Optional[str] = ..., reports: _Optional[_Iterable[_Union[TallyReport, _Mapping]]] = ...) -> None: ...

class TallyVerdicts(_message.Message):
    __slots__ = ["actions", "categories", "flags", "attempts", "retry_delays_ms", "reasons", "reason_index", "rules", "rule_index", "grant"]
    ACTIONS_FIELD_NUMBER: _ClassVar[int]
    CATEGORIES_FIELD_NUMBER: _ClassVar[int]
    FLAGS_FIELD_NUMBER: _ClassVar[int]
    ATTEMPTS_FIELD_NUMBER: _ClassVar[int]
    RETRY_DELAYS_MS_FIELD_NUMBER: _ClassVar[int]
    REASONS_FIELD_NUMBER: _ClassVar[int]
    REASON_INDEX_FIELD_NUMBER: _ClassVar[int]
    RULES_FIELD_NUMBER: _ClassVar[int]
    RULE_INDEX_FIELD_NUMBER: _ClassVar[int]
    GRANT_FIELD_NUMBER: _ClassVar[int]
    actions: bytes
    categories: bytes
    flags: bytes
    attempts: bytes
    retry_delays_ms: bytes
    reasons: _containers.RepeatedScalarFieldContainer[str]
    reason_index: bytes
    rules: _containers.RepeatedScalarFieldContainer[str]
    rule_index: bytes
    grant: BudgetSlice
    def __init__(self, actions: _Optional[bytes] = ..., categories: _Optional[bytes] = ..., flags: _Optional[bytes] = ..., attempts: _Optional[bytes] = ..., retry_delays_ms: _Optional[bytes] = ..., reasons: _Optional[_Iterable[str]] = ..., reason_index: _Optional[bytes] = ..., rules: _Optional[_Iterable[str]] = ..., rule_index: _Optional[bytes] = ..., grant: _Optional[_Union[BudgetSlice, _Mapping]] = ...) -> None: ...

class TallyResponse(_message.Message):
    __slots__ = ["reports"]
    REPORTS_FIELD_NUMBER: _ClassVar[int]
    reports: _containers.RepeatedCompositeFieldContainer[TallyVerdicts]
    def __init__(self, reports: _Optional[_Iterable[_Union[TallyVerdicts, _Mapping]]] = ...) -> None: ...

class StageCount(_message.Message):
    __slots__ = ["stage", "custom_stage", "records"]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    CUSTOM_STAGE_FIELD_NUMBER: _ClassVar[int]
    RECORDS_FIELD_NUMBER: _ClassVar[int]
    stage: Stage
    custom_stage: str
    records: int
    def __init__(self, stage: _Optional[_Union[Stage, str]] = ..., custom_stage: _Optional[str] = ..., records: _Optional[int] = ...) -> None: ...

class FlushTaskRequest(_message.Message):
    __slots__ = ["job", "task", "processed", "recovered_record_ids", "progress_only", "run_id"]
    JOB_FIELD_NUMBER: _ClassVar[int]
    TASK_FIELD_NUMBER: _ClassVar[int]
    PROCESSED_FIELD_NUMBER: _ClassVar[int]
    RECOVERED_RECORD_IDS_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_ONLY_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    job: str
    task: TaskIdentity
    processed: _containers.RepeatedCompositeFieldContainer[StageCount]
    recovered_record_ids: _containers.RepeatedScalarFieldContainer[str]
    progress_only: bool
    run_id: str
    def __init__(self, job: _Optional[str] = ..., task: _Optional[_Union[TaskIdentity, _Mapping]] = ..., processed: _Optional[_Iterable[_Union[StageCount, _Mapping]]] = ..., recovered_record_ids: _Optional[_Iterable[str]] = ..., progress_only: bool = ..., run_id: _Optional[str] = ...) -> None: ...

class FlushTaskResponse(_message.Message):
    __slots__ = ["dlq_records_acknowledged"]
    DLQ_RECORDS_ACKNOWLEDGED_FIELD_NUMBER: _ClassVar[int]
    dlq_records_acknowledged: int
    def __init__(self, dlq_records_acknowledged: _Optional[int] = ...) -> None: ...

class GetJobSummaryRequest(_message.Message):
    __slots__ = ["job", "run_id"]
    JOB_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    job: str
    run_id: str
    def __init__(self, job: _Optional[str] = ..., run_id: _Optional[str] = ...) -> None: ...

class CountEntry(_message.Message):
    __slots__ = ["key", "count"]
    KEY_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    key: str
    count: int
    def __init__(self, key: _Optional[str] = ..., count: _Optional[int] = ...) -> None: ...

class JobSummary(_message.Message):
    __slots__ = ["job", "failed", "failure_reason", "records_processed", "total_record_failures", "total_record_errors", "total_records_skipped", "total_retries", "total_errors_logged", "dlq_records_written", "last_error_timestamp_ms", "by_stage", "by_category", "by_exception_class", "sidecar_id", "dropped_records", "run_id", "records_refused", "retry_budget_exhausted", "record_id_collisions"]
    JOB_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    FAILURE_REASON_FIELD_NUMBER: _ClassVar[int]
    RECORDS_PROCESSED_FIELD_NUMBER: _ClassVar[int]
    TOTAL_RECORD_FAILURES_FIELD_NUMBER: _ClassVar[int]
    TOTAL_RECORD_ERRORS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_RECORDS_SKIPPED_FIELD_NUMBER: _ClassVar[int]
    TOTAL_RETRIES_FIELD_NUMBER: _ClassVar[int]
    TOTAL_ERRORS_LOGGED_FIELD_NUMBER: _ClassVar[int]
    DLQ_RECORDS_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    LAST_ERROR_TIMESTAMP_MS_FIELD_NUMBER: _ClassVar[int]
    BY_STAGE_FIELD_NUMBER: _ClassVar[int]
    BY_CATEGORY_FIELD_NUMBER: _ClassVar[int]
    BY_EXCEPTION_CLASS_FIELD_NUMBER: _ClassVar[int]
    SIDECAR_ID_FIELD_NUMBER: _ClassVar[int]
    DROPPED_RECORDS_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    RECORDS_REFUSED_FIELD_NUMBER: _ClassVar[int]
    RETRY_BUDGET_EXHAUSTED_FIELD_NUMBER: _ClassVar[int]
    RECORD_ID_COLLISIONS_FIELD_NUMBER: _ClassVar[int]
    job: str
    failed: bool
    failure_reason: str
    records_processed: int
    total_record_failures: int
    total_record_errors: int
    total_records_skipped: int
    total_retries: int
    total_errors_logged: int
    dlq_records_written: int
    last_error_timestamp_ms: int
    by_stage: _containers.RepeatedCompositeFieldContainer[CountEntry]
    by_category: _containers.RepeatedCompositeFieldContainer[CountEntry]
    by_exception_class: _containers.RepeatedCompositeFieldContainer[CountEntry]
    sidecar_id: str
    dropped_records: int
    run_id: str
    records_refused: int
    retry_budget_exhausted: int
    record_id_collisions: int
    def __init__(self, job: _Optional[str] = ..., failed: bool = ..., failure_reason: _Optional[str] = ..., records_processed: _Optional[int] = ..., total_record_failures: _Optional[int] = ..., total_record_errors: _Optional[int] = ..., total_records_skipped: _Optional[int] = ..., total_retries: _Optional[int] = ..., total_errors_logged: _Optional[int] = ..., dlq_records_written: _Optional[int] = ..., last_error_timestamp_ms: _Optional[int] = ..., by_stage: _Optional[_Iterable[_Union[CountEntry, _Mapping]]] = ..., by_category: _Optional[_Iterable[_Union[CountEntry, _Mapping]]] = ..., by_exception_class: _Optional[_Iterable[_Union[CountEntry, _Mapping]]] = ..., sidecar_id: _Optional[str] = ..., dropped_records: _Optional[int] = ..., run_id: _Optional[str] = ..., records_refused: _Optional[int] = ..., retry_budget_exhausted: _Optional[int] = ..., record_id_collisions: _Optional[int] = ...) -> None: ...

class GetStatusRequest(_message.Message):
    __slots__ = ["job", "page_size", "page_token"]
    JOB_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    job: str
    page_size: int
    page_token: str
    def __init__(self, job: _Optional[str] = ..., page_size: _Optional[int] = ..., page_token: _Optional[str] = ...) -> None: ...

class SidecarStatus(_message.Message):
    __slots__ = ["sidecar_id", "version", "counters", "jobs", "instance_id", "next_page_token", "jobs_total", "advertised_address", "totals", "ended_runs", "jobs_hidden"]
    class CountersEntry(_message.Message):
        __slots__ = ["key", "value"]
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    SIDECAR_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    COUNTERS_FIELD_NUMBER: _ClassVar[int]
    JOBS_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    JOBS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    ADVERTISED_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    TOTALS_FIELD_NUMBER: _ClassVar[int]
    ENDED_RUNS_FIELD_NUMBER: _ClassVar[int]
    JOBS_HIDDEN_FIELD_NUMBER: _ClassVar[int]
    sidecar_id: str
    version: str
    counters: _containers.ScalarMap[str, float]
    jobs: _containers.RepeatedCompositeFieldContainer[JobSummary]
    instance_id: str
    next_page_token: str
    jobs_total: int
    advertised_address: str
    totals: SidecarTotals
    ended_runs: _containers.RepeatedCompositeFieldContainer[EndedRun]
    jobs_hidden: int
    def __init__(self, sidecar_id: _Optional[str] = ..., version: _Optional[str] = ..., counters: _Optional[_Mapping[str, float]] = ..., jobs: _Optional[_Iterable[_Union[JobSummary, _Mapping]]] = ..., instance_id: _Optional[str] = ..., next_page_token: _Optional[str] = ..., jobs_total: _Optional[int] = ..., advertised_address: _Optional[str] = ..., totals: _Optional[_Union[SidecarTotals, _Mapping]] = ..., ended_runs: _Optional[_Iterable[_Union[EndedRun, _Mapping]]] = ..., jobs_hidden: _Optional[int] = ...) -> None: ...

class SidecarTotals(_message.Message):
    __slots__ = ["records_processed", "total_record_failures", "total_record_errors", "total_records_skipped", "total_retries", "total_errors_logged", "dropped_records", "dlq_records_written", "runs_ended", "since_ms"]
    class RunsEndedEntry(_message.Message):
        __slots__ = ["key", "value"]
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    RECORDS_PROCESSED_FIELD_NUMBER: _ClassVar[int]
    TOTAL_RECORD_FAILURES_FIELD_NUMBER: _ClassVar[int]
    TOTAL_RECORD_ERRORS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_RECORDS_SKIPPED_FIELD_NUMBER: _ClassVar[int]
    TOTAL_RETRIES_FIELD_NUMBER: _ClassVar[int]
    TOTAL_ERRORS_LOGGED_FIELD_NUMBER: _ClassVar[int]
    DROPPED_RECORDS_FIELD_NUMBER: _ClassVar[int]
    DLQ_RECORDS_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    RUNS_ENDED_FIELD_NUMBER: _ClassVar[int]
    SINCE_MS_FIELD_NUMBER: _ClassVar[int]
    records_processed: int
    total_record_failures: int
    total_record_errors: int
    total_records_skipped: int
    total_retries: int
    total_errors_logged: int
    dropped_records: int
    dlq_records_written: int
    runs_ended: _containers.ScalarMap[str, int]
    since_ms: int
    def __init__(self, records_processed: _Optional[int] = ..., total_record_failures: _Optional[int] = ..., total_record_errors: _Optional[int] = ..., total_records_skipped: _Optional[int] = ..., total_retries: _Optional[int] = ..., total_errors_logged: _Optional[int] = ..., dropped_records: _Optional[int] = ..., dlq_records_written: _Optional[int] = ..., runs_ended: _Optional[_Mapping[str, int]] = ..., since_ms: _Optional[int] = ...) -> None: ...

class EndedRun(_message.Message):
    __slots__ = ["summary", "outcome", "started_ms", "ended_ms", "home"]
    SUMMARY_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    STARTED_MS_FIELD_NUMBER: _ClassVar[int]
    ENDED_MS_FIELD_NUMBER: _ClassVar[int]
    HOME_FIELD_NUMBER: _ClassVar[int]
    summary: JobSummary
    outcome: str
    started_ms: int
    ended_ms: int
    home: str
    def __init__(self, summary: _Optional[_Union[JobSummary, _Mapping]] = ..., outcome: _Optional[str] = ..., started_ms: _Optional[int] = ..., ended_ms: _Optional[int] = ..., home: _Optional[str] = ...) -> None: ...

class EndJobRequest(_message.Message):
    __slots__ = ["job", "run_id", "local_only"]
    JOB_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    LOCAL_ONLY_FIELD_NUMBER: _ClassVar[int]
    job: str
    run_id: str
    local_only: bool
    def __init__(self, job: _Optional[str] = ..., run_id: _Optional[str] = ..., local_only: bool = ...) -> None: ...

class EndJobResponse(_message.Message):
    __slots__ = ["summaries", "unreachable"]
    SUMMARIES_FIELD_NUMBER: _ClassVar[int]
    UNREACHABLE_FIELD_NUMBER: _ClassVar[int]
    summaries: _containers.RepeatedCompositeFieldContainer[JobSummary]
    unreachable: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, summaries: _Optional[_Iterable[_Union[JobSummary, _Mapping]]] = ..., unreachable: _Optional[_Iterable[str]] = ...) -> None: ...
