"""Bounds on every request field, checked once per call before any servicer code runs.

`check(method, request)` raises ValueError naming the field and the bound (never echoing a long
value); the RPC layer (`transport/rpc.py`) answers INVALID_ARGUMENT with it, so a refused request
changes no state. Names and ids follow `core.names`; the numeric bounds below keep every count
the sidecar sums far inside what protobuf's uint64/int64 (and a float) can carry.
"""

from __future__ import annotations

from collections.abc import Callable

from spillway.client.columns import unpack_le
from spillway.sidecar.core import names
from spillway.sidecar.core.slices import MAX_OPEN, MAX_SLICE
from spillway.v1 import sidecar_pb2 as pb

# --- bounds (docs/CONFIGURATION.md, "Request bounds") ---------------------------------------
MAX_PROPERTIES = 256
MAX_PROPERTY_KEY_CHARS = 256
MAX_PROPERTY_VALUE_CHARS = 32 * 1024
MAX_ADDRESS_CHARS = 512          # home, peer
MAX_INSTANCE_ID_CHARS = 128
MAX_RECORDS_PER_REPORT = 65_536
MAX_RECOVERED_IDS = 65_536
MAX_STAGE_COUNTS = 256
MAX_PROCESSED_PER_ENTRY = 2**40  # per FlushTask entry: ~10^12 records, far beyond one task
MAX_HOST_CHARS = 255
MAX_EXECUTOR_ID_CHARS = 256
MAX_TOPIC_CHARS = 249
MAX_TIMESTAMP_MS = 253_402_300_799_999  # 9999-12-31T23:59:59.999Z
MAX_ATTEMPT = 1_000_000
MAX_CLASS_NAME_CHARS = 1024
MAX_CLASS_CHAIN = 128
MAX_MESSAGE_CHARS = 64 * 1024
MAX_STACK_TRACE_CHARS = 256 * 1024
MAX_CAUSES = 64
MAX_CAUSE_CHARS = 16 * 1024
MAX_KAFKA_CODE_CHARS = 64
MAX_HEADERS = 1024
MAX_HEADER_KEY_CHARS = 1024
MAX_HEADER_BYTES = 4 * 1024 * 1024   # keys and values of one record's headers together
MAX_TRACEPARENT_CHARS = 256
MAX_TRACESTATE_CHARS = 512           # W3C trace-context's own limit
MAX_PAGE_SIZE = 10_000
MAX_PAGE_TOKEN_CHARS = 1024
_INT32_MAX = 2**31 - 1


def _len(field: str, value, bound: int, unit: str = "characters") -> None:
    n = len(value)
    if n > bound:
        raise ValueError(f"{field}: at most {bound} {unit} (got {n})")


def _range(field: str, value: int, lo: int, hi: int) -> None:
    if value < lo or value > hi:
        raise ValueError(f"{field}: must be in [{lo}, {hi}] (got {value})")


def _ids(field: str, ids) -> None:
    _len(field, ids, MAX_RECOVERED_IDS, "ids")
    for i, rid in enumerate(ids):
        names.check_record_id(rid, f"{field}[{i}]")


def _job(request, *, required: bool = True) -> None:
    if required or request.job:
        names.check_job_name(request.job)
    names.check_run_id(request.run_id)


def _task(t: pb.TaskIdentity) -> None:
    _range("task.stage_id", t.stage_id, 0, _INT32_MAX)
    _range("task.partition_id", t.partition_id, 0, _INT32_MAX)
    _range("task.attempt_number", t.attempt_number, 0, _INT32_MAX)
    _range("task.task_attempt_id", t.task_attempt_id, 0, 2**63 - 1)
    names.check_text("task.executor_id", t.executor_id, max_chars=MAX_EXECUTOR_ID_CHARS)
    names.check_text("task.host", t.host, max_chars=MAX_HOST_CHARS)


def _exception(e: pb.ExceptionInfo, where: str) -> None:
    _len(f"{where}.class_name", e.class_name, MAX_CLASS_NAME_CHARS)
    chain = e.class_chain
    if chain:
        _len(f"{where}.class_chain", chain, MAX_CLASS_CHAIN, "entries")
        for i, c in enumerate(chain):
            _len(f"{where}.class_chain[{i}]", c, MAX_CLASS_NAME_CHARS)
    _len(f"{where}.message", e.message, MAX_MESSAGE_CHARS)
    _len(f"{where}.stack_trace", e.stack_trace, MAX_STACK_TRACE_CHARS)
    causes = e.causes
    if causes:
        _len(f"{where}.causes", causes, MAX_CAUSES, "entries")
        for i, c in enumerate(causes):
            _len(f"{where}.causes[{i}]", c, MAX_CAUSE_CHARS)
    _len(f"{where}.kafka_error_code", e.kafka_error_code, MAX_KAFKA_CODE_CHARS)
    if e.HasField("grpc_status_code"):
        _range(f"{where}.grpc_status_code", e.grpc_status_code, 0, 16)
    if e.HasField("http_status_code"):
        _range(f"{where}.http_status_code", e.http_status_code, 0, 999)


def _printable(text: str) -> bool:
    return text.isascii() and text.isprintable()


def _exception_ok(e: pb.ExceptionInfo) -> bool:
    """The common case of `_exception`, without building a field name per check. Reading a
    repeated string field decodes every element, so the chain and causes are bounded through
    the message's encoded size when it is small enough to prove them in bounds."""
    cn, msg, st = len(e.class_name), len(e.message), len(e.stack_trace)
    if (cn > MAX_CLASS_NAME_CHARS or msg > MAX_MESSAGE_CHARS or st > MAX_STACK_TRACE_CHARS
            or len(e.kafka_error_code) > MAX_KAFKA_CODE_CHARS):
        return False
    chain, causes = e.class_chain, e.causes
    if len(chain) > MAX_CLASS_CHAIN or len(causes) > MAX_CAUSES:
        return False
    # every other string is at most (encoded size - the three texts' characters) bytes long
    if (chain or causes) and e.ByteSize() - cn - msg - st > MAX_CLASS_NAME_CHARS:
        if any(len(c) > MAX_CLASS_NAME_CHARS for c in chain) or any(
                len(c) > MAX_CAUSE_CHARS for c in causes):
            return False
    has = e.HasField
    return ((not has("grpc_status_code") or 0 <= e.grpc_status_code <= 16)
            and (not has("http_status_code") or 0 <= e.http_status_code <= 999))


def _record_ok(r: pb.FailedRecord) -> bool:
    """The common case of `_record_checked` (a well-formed record) at a fraction of its cost:
    reports carry thousands of records, and only a failing one needs its field named."""
    rid = r.record_id
    if not 0 < len(rid) <= names.MAX_RECORD_ID_BYTES // 4:  # 256 chars always fit 1024 bytes
        return False
    cs = r.custom_stage
    if cs and not (len(cs) <= names.MAX_CUSTOM_STAGE_CHARS and _printable(cs)):
        return False
    fn = r.function_name
    if fn and not (len(fn) <= names.MAX_FUNCTION_NAME_CHARS and _printable(fn)):
        return False
    if (r.attempt > MAX_ATTEMPT or len(r.traceparent) > MAX_TRACEPARENT_CHARS
            or len(r.tracestate) > MAX_TRACESTATE_CHARS):
        return False
    has = r.HasField
    if has("source"):
        src = r.source
        if len(src.topic) > MAX_TOPIC_CHARS or src.partition < -1 or src.offset < -1:
            return False
    if has("timestamp_ms") and not -1 <= r.timestamp_ms <= MAX_TIMESTAMP_MS:
        return False
    headers = r.headers
    if headers:
        if len(headers) > MAX_HEADERS:
            return False
        total = 0
        for h in headers:
            k = h.key
            if len(k) > MAX_HEADER_KEY_CHARS:
                return False
            total += len(k) + len(h.value)
        if total > MAX_HEADER_BYTES:
            return False
    return True


def _records(records) -> None:
    prev = None
    for i, r in enumerate(records):
        ok = _record_ok(r)
        if ok and r.HasField("exception"):
            e = r.exception
            # a batch's records mostly share one exception: compared, not checked again
            if prev is None or e != prev:
                ok = _exception_ok(e)
                prev = e
        if not ok:
            _record_checked(r, i)  # names the field (and accepts what the fast path doubted)


def _record_checked(r: pb.FailedRecord, i: int) -> None:
    where = f"records[{i}]"
    names.check_record_id(r.record_id, f"{where}.record_id")
    if r.custom_stage:
        names.check_custom_stage(r.custom_stage, f"{where}.custom_stage")
    if r.function_name:
        names.check_function_name(r.function_name, f"{where}.function_name")
    if r.HasField("source"):
        s = r.source
        _len(f"{where}.source.topic", s.topic, MAX_TOPIC_CHARS)
        _range(f"{where}.source.partition", s.partition, -1, _INT32_MAX)
        _range(f"{where}.source.offset", s.offset, -1, 2**63 - 1)
    headers = r.headers
    if headers:
        _len(f"{where}.headers", headers, MAX_HEADERS, "headers")
        total = 0
        for j, h in enumerate(headers):
            _len(f"{where}.headers[{j}].key", h.key, MAX_HEADER_KEY_CHARS)
            total += len(h.key) + len(h.value)
        if total > MAX_HEADER_BYTES:
            raise ValueError(f"{where}.headers: at most {MAX_HEADER_BYTES} bytes of keys and "
                             f"values together (got {total})")
    if r.HasField("timestamp_ms"):
        _range(f"{where}.timestamp_ms", r.timestamp_ms, -1, MAX_TIMESTAMP_MS)
    if r.attempt > MAX_ATTEMPT:
        raise ValueError(f"{where}.attempt: must be in [0, {MAX_ATTEMPT}] (got {r.attempt})")
    _len(f"{where}.traceparent", r.traceparent, MAX_TRACEPARENT_CHARS)
    _len(f"{where}.tracestate", r.tracestate, MAX_TRACESTATE_CHARS)
    if r.HasField("exception"):
        _exception(r.exception, f"{where}.exception")


def register_job(req: pb.RegisterJobRequest) -> None:
    _job(req)
    props = req.properties
    _len("properties", props, MAX_PROPERTIES, "properties")
    for k, v in props.items():
        if len(k) > MAX_PROPERTY_KEY_CHARS:
            raise ValueError(f"properties: a key is longer than {MAX_PROPERTY_KEY_CHARS} "
                             f"characters ({len(k)}, starting {k[:40]!r})")
        _len(f"properties[{k}]", v, MAX_PROPERTY_VALUE_CHARS)
    _len("home", req.home, MAX_ADDRESS_CHARS)
    _len("peer", req.peer, MAX_ADDRESS_CHARS)
    _len("home_instance_id", req.home_instance_id, MAX_INSTANCE_ID_CHARS)
    if req.token_escrow and req.claim_token:
        raise ValueError("token_escrow and claim_token: a driver escrows the run's token, an "
                         "executor claims it; one request does one or the other")


def report_failures(req: pb.ReportFailuresRequest) -> None:
    _job(req)
    _task(req.task)
    records = req.records
    _len("records", records, MAX_RECORDS_PER_REPORT, "records")
    _records(records)
    if req.HasField("columns"):
        if records:
            raise ValueError("columns: a report sends records or columns, not both")
        _columns(req.columns)
    _ids("recovered_record_ids", req.recovered_record_ids)
    _ids("undo_dead_letter_record_ids", req.undo_dead_letter_record_ids)


def _way_of_failing(kind, at: str) -> None:
    """What a FailureKind and a TallyGroup share: names within bounds, an exception."""
    if kind.custom_stage:
        names.check_custom_stage(kind.custom_stage, f"{at}.custom_stage")
    if kind.function_name:
        names.check_function_name(kind.function_name, f"{at}.function_name")
    if not kind.HasField("exception"):
        raise ValueError(f"{at}.exception: required")


def _column(field: str, data: bytes, width: int, n: int, code: str):
    """A packed column: empty, or ``width`` bytes per record; its values."""
    if data and len(data) != width * n:
        raise ValueError(f"{field}: {width} bytes per record ({width * n}) or none, got "
                         f"{len(data)}")
    return unpack_le(code, data) if data else ()


def _index(field: str, data: bytes, n: int, size: int, *, zero_is_none: bool) -> None:
    ix = _column(field, data, 4, n, "I")
    if ix and max(ix) > (size if zero_is_none else size - 1):
        raise ValueError(f"{field}: an index past its table of {size} "
                         f"(got {max(ix)}{', 0 meaning none' if zero_is_none else ''})")


def _columns(c: pb.RecordColumns) -> None:
    """A columnar report (`transport/columns.py`): the bounds of a record's fields, and columns
    that agree: one entry per record (or none), indexes inside their tables, tables no longer
    than the report."""
    ids = c.record_ids
    n = len(ids)
    _len("columns.record_ids", ids, MAX_RECORDS_PER_REPORT, "records")
    limit = names.MAX_RECORD_ID_BYTES // 4   # 256 chars always fit 1024 bytes
    for i, rid in enumerate(ids):
        if not 0 < len(rid) <= limit:
            names.check_record_id(rid, f"columns.record_ids[{i}]")
    kinds = c.kinds
    if n and not kinds:
        raise ValueError("columns.kinds: at least one way of failing with records")
    for field, table in (("kinds", kinds), ("topics", c.topics),
                         ("traceparents", c.traceparents)):
        _len(f"columns.{field}", table, n, "entries (one per record at most)")
    for k, kind in enumerate(kinds):
        at = f"columns.kinds[{k}]"
        _way_of_failing(kind, at)
        _exception(kind.exception, f"{at}.exception")
    _index("columns.kind_index", c.kind_index, n, len(kinds), zero_is_none=False)
    for field, values in (("keys", c.keys), ("values", c.values)):
        if values and len(values) != n:
            raise ValueError(f"columns.{field}: one per record ({n}) or none, got {len(values)}")
    if c.absent and len(c.absent) != n:
        raise ValueError(f"columns.absent: 1 byte per record ({n}) or none, got "
                         f"{len(c.absent)}")
    for t, topic in enumerate(c.topics):
        if not topic:
            raise ValueError(f"columns.topics[{t}]: required (a source topic's name)")
        _len(f"columns.topics[{t}]", topic, MAX_TOPIC_CHARS)
    _index("columns.topic_index", c.topic_index, n, len(c.topics), zero_is_none=True)
    if bool(c.topic_index) != bool(c.partitions) or bool(c.topic_index) != bool(c.offsets):
        raise ValueError("columns.partitions, columns.offsets: sent with topic_index, and only "
                         "with it")
    partitions = _column("columns.partitions", c.partitions, 4, n, "i")
    if partitions and min(partitions) < -1:
        raise ValueError(f"columns.partitions: must be >= -1 (got {min(partitions)})")
    offsets = _column("columns.offsets", c.offsets, 8, n, "q")
    if offsets and min(offsets) < -1:
        raise ValueError(f"columns.offsets: must be >= -1 (got {min(offsets)})")
    stamps = _column("columns.timestamps_ms", c.timestamps_ms, 8, n, "q")
    if stamps and not (-1 <= min(stamps) and max(stamps) <= MAX_TIMESTAMP_MS):
        raise ValueError(f"columns.timestamps_ms: must be in [-1, {MAX_TIMESTAMP_MS}]")
    attempts = _column("columns.attempts", c.attempts, 4, n, "I")
    if attempts and max(attempts) > MAX_ATTEMPT:
        raise ValueError(f"columns.attempts: must be in [0, {MAX_ATTEMPT}] "
                         f"(got {max(attempts)})")
    if c.tracestates and len(c.tracestates) != len(c.traceparents):
        raise ValueError(f"columns.tracestates: one per traceparent ({len(c.traceparents)}) "
                         f"or none, got {len(c.tracestates)}")
    for t, (parent, state) in enumerate(zip(c.traceparents, c.tracestates or [""] * n)):
        _len(f"columns.traceparents[{t}]", parent, MAX_TRACEPARENT_CHARS)
        _len(f"columns.tracestates[{t}]", state, MAX_TRACESTATE_CHARS)
    _index("columns.trace_index", c.trace_index, n, len(c.traceparents), zero_is_none=True)
    _column_headers(c, n)


def _column_headers(c: pb.RecordColumns, n: int) -> None:
    counts = _column("columns.header_counts", c.header_counts, 4, n, "I")
    headers = c.headers
    if sum(counts) != len(headers):
        raise ValueError(f"columns.header_counts: add up to {sum(counts)}, not to the "
                         f"{len(headers)} headers")
    at = 0
    for i, count in enumerate(counts):
        if not count:
            continue
        where = f"columns.headers of record {i}"
        _len(where, range(count), MAX_HEADERS, "headers")
        total = 0
        for h in headers[at:at + count]:
            _len(f"{where}: a key", h.key, MAX_HEADER_KEY_CHARS)
            total += len(h.key) + len(h.value)
        if total > MAX_HEADER_BYTES:
            raise ValueError(f"{where}: at most {MAX_HEADER_BYTES} bytes of keys and values "
                             f"together (got {total})")
        at += count


MAX_TALLY_REPORTS = 256
MAX_CLOSED_SLICES = MAX_OPEN   # a run's open slices at most


def tally_failures(req: pb.TallyRequest) -> None:
    """A node's tally (`transport/tally.py`): the same bounds as reports' records, all of them
    together at most a report's, and columns that agree: one payload digest per id, groups of
    at least one record adding up to them."""
    _job(req)
    reports = req.reports
    _len("reports", reports, MAX_TALLY_REPORTS, "reports")
    total = 0
    for i, report in enumerate(reports):
        total += len(report.record_ids)
        if total > MAX_RECORDS_PER_REPORT:
            raise ValueError(f"reports: at most {MAX_RECORDS_PER_REPORT} record ids together "
                             f"(got {total} by reports[{i}])")
        _tally_report(report, f"reports[{i}]")


def _tally_report(report: pb.TallyReport, where: str) -> None:
    _task(report.task)
    ids = report.record_ids
    n = len(ids)
    limit = names.MAX_RECORD_ID_BYTES // 4   # 256 chars always fit 1024 bytes
    for i, rid in enumerate(ids):
        if not 0 < len(rid) <= limit:
            names.check_record_id(rid, f"{where}.record_ids[{i}]")
    _len(f"{where}.closed_slices", report.closed_slices, MAX_CLOSED_SLICES, "closed slices")
    _range(f"{where}.want_slice", report.want_slice, 0, MAX_SLICE)
    if len(report.payload_digests) != 8 * n:
        raise ValueError(f"{where}.payload_digests: 8 bytes per record id ({8 * n}), got "
                         f"{len(report.payload_digests)}")
    groups = report.groups
    _len(f"{where}.groups", groups, max(n, 1), "groups")
    total = 0
    prev = None
    for g, group in enumerate(groups):
        at = f"{where}.groups[{g}]"
        if group.count < 1:
            raise ValueError(f"{at}.count: at least 1 (got {group.count})")
        total += group.count
        _way_of_failing(group, at)
        e = group.exception
        if e.stack_trace:
            raise ValueError(f"{at}.exception.stack_trace: not sent to a home (got "
                             f"{len(e.stack_trace)} characters)")
        if prev is None or e != prev:
            _exception(e, f"{at}.exception")
            prev = e
    if total != n:
        raise ValueError(f"{where}.groups: their counts add up to {total}, not to the {n} "
                         "record ids")


def flush_task(req: pb.FlushTaskRequest) -> None:
    _job(req)
    _task(req.task)
    processed = req.processed
    _len("processed", processed, MAX_STAGE_COUNTS, "entries")
    for i, sc in enumerate(processed):
        if sc.records > MAX_PROCESSED_PER_ENTRY:
            raise ValueError(f"processed[{i}].records: must be in [0, {MAX_PROCESSED_PER_ENTRY}]"
                             f" per call (got {sc.records})")
        if sc.custom_stage:
            names.check_custom_stage(sc.custom_stage, f"processed[{i}].custom_stage")
    _ids("recovered_record_ids", req.recovered_record_ids)


def job_summary(req: pb.GetJobSummaryRequest) -> None:
    _job(req)


def status(req: pb.GetStatusRequest) -> None:
    if req.job:
        names.check_job_name(req.job)
    _range("page_size", req.page_size, 0, MAX_PAGE_SIZE)
    _len("page_token", req.page_token, MAX_PAGE_TOKEN_CHARS)


def end_job(req: pb.EndJobRequest) -> None:
    _job(req)


CHECKS: dict[str, Callable] = {
    "RegisterJob": register_job,
    "ReportFailures": report_failures,
    "FlushTask": flush_task,
    "GetJobSummary": job_summary,
    "GetStatus": status,
    "EndJob": end_job,
    "TallyFailures": tally_failures,
}


def check(method: str, request) -> None:
    """Raise ValueError naming the first field of `request` that is out of bounds."""
    fn = CHECKS.get(method)
    if fn is not None:
        fn(request)
