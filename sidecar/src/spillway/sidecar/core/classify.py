"""KIP-1050 classification: which category a reported exception belongs to, as tables.

Precedence (first match wins; the verdict's reason names the rule that matched):

1. user rules, ``errors.classification.rules``: ``kafka:ERROR_CODE=category`` on the reported
   confluent-kafka error code first (the most specific), then ``qualified.Class=category``
   matched against the reported class and every ancestor in ``class_chain``, most specific
   class first;
2. ``ExceptionInfo.marker_category``: the executor saw one of spillway's marker classes
   (``RetriableError`` …), which the user raised on purpose, or spillway's own
   ``WorkerCrashError`` / ``RecordTimeoutError`` for a record that killed its Python worker or
   outlasted ``errors.record.timeout.ms`` (categories crash / timeout: a user rule on those
   classes says otherwise);
3. confluent-kafka errors (``KAFKA_ERROR_CODES``, KIP-1050 for librdkafka's codes), in this
   order: a code the table calls invalid-configuration; then the error's flags ``fatal`` →
   application-recoverable (the client instance is unusable whatever the code) and
   ``txn_requires_abort`` → abortable (KIP-1050: in a transaction, retriable errors become
   abortable); then the code's own category; then, for a code the table does not know, the
   ``retriable`` flag → retriable. A Kafka error none of these decides falls through (its class,
   ``KafkaException``, is application-recoverable: KIP-1050's safe default for unknown errors);
4. the gRPC status code (``_GRPC_CODES``);
5. the HTTP status (``_HTTP_CODES``, then any other 5xx → retriable);
6. built-in class rules (``BUILTIN_RULES``), matched along the chain, most specific first;
7. ``errors.classification.default`` (default ``data``).

Codes (3–5) come before class names (6) because they are more precise: an HTTP 400 raised as
``requests.HTTPError`` is an ``OSError`` by ancestry, yet a data error. The default is ``data``
because KIP-298 tolerates any exception in a stage: an unknown error is skipped or fails the job
according to ``errors.tolerance``, and is never retried blindly. (KIP-1050 suggests
application-recoverable for unknown *client* errors; a Spark task restart rarely fixes an
unknown record-level error, so we do not default to it. Set the property to choose otherwise.)

Names: a class is matched by its qualified name (``json.decoder.JSONDecodeError``); builtins
may be given bare (``ValueError``) or qualified (``builtins.ValueError``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from .model import Category, ExceptionInfo

R = Category.RETRIABLE
RR = Category.REFRESH_RETRIABLE
AB = Category.ABORTABLE
AR = Category.APPLICATION_RECOVERABLE
IC = Category.INVALID_CONFIGURATION
D = Category.DATA


def _table(groups: Iterable[tuple[Category, tuple[str, ...]]]) -> Mapping[str, Category]:
    out: dict[str, Category] = {}
    for category, names in groups:
        for name in names:
            key = qualify(name)
            if key in out:
                raise ValueError(f"duplicate classification rule for {key}")
            out[key] = category
    return MappingProxyType(out)


def qualify(name: str) -> str:
    """'ValueError' -> 'builtins.ValueError'; qualified names are kept."""
    name = name.strip()
    return name if "." in name else f"builtins.{name}"


BUILTIN_RULES: Mapping[str, Category] = _table([
    (R, (
        "ConnectionError", "ConnectionResetError", "ConnectionRefusedError",
        "ConnectionAbortedError", "BrokenPipeError", "TimeoutError", "socket.timeout",
        "socket.gaierror", "ssl.SSLZeroReturnError", "ssl.SSLEOFError",
        "http.client.RemoteDisconnected", "http.client.IncompleteRead",
        "urllib3.exceptions.ProtocolError", "urllib3.exceptions.TimeoutError",
        "urllib3.exceptions.NewConnectionError", "urllib3.exceptions.MaxRetryError",
        "requests.exceptions.ConnectionError", "requests.exceptions.Timeout",
        "requests.exceptions.ChunkedEncodingError",
        "httpx.TransportError", "httpx.TimeoutException", "httpx.NetworkError",
        "aiohttp.client_exceptions.ClientConnectionError",
        "aiohttp.client_exceptions.ServerTimeoutError",
        "botocore.exceptions.EndpointConnectionError",
        "botocore.exceptions.ConnectTimeoutError", "botocore.exceptions.ReadTimeoutError",
        "botocore.exceptions.ConnectionClosedError",
        "redis.exceptions.ConnectionError", "redis.exceptions.TimeoutError",
        "py4j.protocol.Py4JNetworkError",
        "org.apache.kafka.common.errors.RetriableException",
        "org.apache.kafka.connect.errors.RetriableException",
        "org.apache.kafka.common.errors.TimeoutException",
    )),
    (RR, (
        "org.apache.kafka.common.errors.RefreshRetriableException",
        "org.apache.kafka.common.errors.InvalidMetadataException",
        "org.apache.kafka.common.errors.UnknownTopicOrPartitionException",
        "org.apache.kafka.common.errors.NotLeaderOrFollowerException",
        "org.apache.kafka.common.errors.NotCoordinatorException",
        "org.apache.kafka.common.errors.CoordinatorNotAvailableException",
        "botocore.exceptions.TokenRetrievalError",
    )),
    (AB, (
        "org.apache.kafka.common.errors.TransactionAbortableException",
    )),
    (AR, (
        "MemoryError",
        "org.apache.kafka.common.errors.ApplicationRecoverableException",
        "org.apache.kafka.common.errors.ProducerFencedException",
        "org.apache.kafka.common.errors.InvalidProducerEpochException",
        "org.apache.kafka.common.KafkaException",
        "confluent_kafka.error.KafkaException", "cimpl.KafkaException",
    )),
    (IC, (
        "PermissionError", "ImportError", "ModuleNotFoundError",
        "ssl.SSLCertVerificationError",
        "botocore.exceptions.NoCredentialsError", "botocore.exceptions.PartialCredentialsError",
        "google.auth.exceptions.DefaultCredentialsError",
        "psycopg2.errors.InsufficientPrivilege", "psycopg2.errors.InvalidPassword",
        "org.apache.kafka.common.errors.InvalidConfigurationException",
        "org.apache.kafka.common.errors.AuthenticationException",
        "org.apache.kafka.common.errors.AuthorizationException",
        "org.apache.kafka.common.errors.SaslAuthenticationException",
        "org.apache.kafka.common.errors.UnsupportedVersionException",
    )),
    (D, (
        "ValueError", "KeyError", "IndexError", "TypeError", "AttributeError",
        "UnicodeError", "UnicodeDecodeError", "UnicodeEncodeError",
        "ArithmeticError", "ZeroDivisionError", "OverflowError", "RecursionError",
        "json.decoder.JSONDecodeError", "orjson.JSONDecodeError", "struct.error",
        "binascii.Error", "csv.Error", "xml.etree.ElementTree.ParseError",
        "decimal.InvalidOperation", "pydantic_core._pydantic_core.ValidationError",
        "pydantic.ValidationError", "jsonschema.exceptions.ValidationError",
        "pyarrow.lib.ArrowInvalid", "pyarrow.lib.ArrowTypeError",
        "org.apache.kafka.common.errors.SerializationException",
        "org.apache.kafka.common.errors.RecordTooLargeException",
        "org.apache.kafka.connect.errors.DataException",
    )),
])

# KIP-1050's categories for librdkafka's error codes (``confluent_kafka.KafkaError.name()``),
# by the Java exception each code maps to in the KIP's table. Codes the KIP leaves out of scope
# (OUT_OF_ORDER_SEQUENCE_NUMBER, UNKNOWN_PRODUCER_ID) are absent: the error's flags decide.
_KAFKA_CODE_GROUPS: tuple[tuple[Category, tuple[str, ...]], ...] = (
    (RR, (  # InvalidMetadataException / coordinator errors: refresh metadata, then retry
        "NOT_LEADER_FOR_PARTITION", "UNKNOWN_TOPIC_OR_PART", "LEADER_NOT_AVAILABLE",
        "FENCED_LEADER_EPOCH", "UNKNOWN_LEADER_EPOCH", "REPLICA_NOT_AVAILABLE",
        "PREFERRED_LEADER_NOT_AVAILABLE", "KAFKA_STORAGE_ERROR", "UNKNOWN_TOPIC_ID",
        "INCONSISTENT_TOPIC_ID", "LISTENER_NOT_FOUND", "NOT_COORDINATOR",
        "COORDINATOR_NOT_AVAILABLE", "REBOOTSTRAP_REQUIRED",
        "_UNKNOWN_PARTITION", "_UNKNOWN_TOPIC", "_WAIT_COORD", "_NODE_UPDATE",
    )),
    (R, (   # RetriableException: retry after a backoff
        "_TRANSPORT", "_MSG_TIMED_OUT", "_TIMED_OUT", "_TIMED_OUT_QUEUE", "_ALL_BROKERS_DOWN",
        "_RESOLVE", "_QUEUE_FULL", "_RETRY", "_WAIT_CACHE", "_PREV_IN_PROGRESS", "_ISR_INSUFF",
        "_UNKNOWN_BROKER", "REQUEST_TIMED_OUT", "NETWORK_EXCEPTION", "BROKER_NOT_AVAILABLE",
        "NOT_ENOUGH_REPLICAS", "NOT_ENOUGH_REPLICAS_AFTER_APPEND", "INVALID_MSG",
        "COORDINATOR_LOAD_IN_PROGRESS", "CONCURRENT_TRANSACTIONS", "NOT_CONTROLLER",
        "OFFSET_NOT_AVAILABLE", "THROTTLING_QUOTA_EXCEEDED", "UNSTABLE_OFFSET_COMMIT",
        "FETCH_SESSION_ID_NOT_FOUND", "INVALID_FETCH_SESSION_EPOCH",
    )),
    (AB, (  # TransactionAbortableException; InvalidTxnState on the produce path
        "TRANSACTION_ABORTABLE", "INVALID_TXN_STATE",
    )),
    (AR, (  # fencing and generation errors: only a new client (a task restart) recovers
        "PRODUCER_FENCED", "INVALID_PRODUCER_EPOCH", "INVALID_PRODUCER_ID_MAPPING", "_FENCED",
        "TRANSACTION_COORDINATOR_FENCED", "FENCED_INSTANCE_ID", "UNKNOWN_MEMBER_ID",
        "ILLEGAL_GENERATION", "_FATAL",
    )),
    (IC, (  # authentication, authorization, unsupported or invalid settings and limits
        "TOPIC_AUTHORIZATION_FAILED", "GROUP_AUTHORIZATION_FAILED",
        "CLUSTER_AUTHORIZATION_FAILED", "TRANSACTIONAL_ID_AUTHORIZATION_FAILED",
        "DELEGATION_TOKEN_AUTHORIZATION_FAILED", "SASL_AUTHENTICATION_FAILED",
        "ILLEGAL_SASL_STATE", "UNSUPPORTED_SASL_MECHANISM", "UNACCEPTABLE_CREDENTIAL",
        "SECURITY_DISABLED", "_AUTHENTICATION", "_SSL", "UNSUPPORTED_VERSION",
        "UNSUPPORTED_FOR_MESSAGE_FORMAT", "UNSUPPORTED_COMPRESSION_TYPE", "INVALID_RECORD",
        "INVALID_REQUIRED_ACKS", "MSG_SIZE_TOO_LARGE", "RECORD_LIST_TOO_LARGE",
        "INVALID_MSG_SIZE", "TOPIC_EXCEPTION", "INVALID_CONFIG", "INVALID_TRANSACTION_TIMEOUT",
        "INVALID_PRINCIPAL_TYPE", "_INVALID_ARG", "_NOT_CONFIGURED", "_UNSUPPORTED_FEATURE",
        "_NOT_IMPLEMENTED", "_UNKNOWN_PROTOCOL",
    )),
    (D, (   # this record's own bytes: spillway's addition (KIP-1050 covers client errors only)
        "_KEY_SERIALIZATION", "_VALUE_SERIALIZATION", "_KEY_DESERIALIZATION",
        "_VALUE_DESERIALIZATION", "_BAD_MSG",
    )),
)


def _code_table(groups) -> Mapping[str, Category]:
    out: dict[str, Category] = {}
    for category, names in groups:
        for name in names:
            if name in out:
                raise ValueError(f"duplicate Kafka error code {name}")
            out[name] = category
    return MappingProxyType(out)


KAFKA_ERROR_CODES: Mapping[str, Category] = _code_table(_KAFKA_CODE_GROUPS)

KAFKA_RULE = "kafka:"   # user rules on a Kafka error code (settings.parse_rules)
MAX_CACHED = 4096  # distinct (class chain, flags, codes) remembered per job

# grpc.StatusCode numeric values (grpc is never imported by the core).
GRPC_STATUS_NAMES: Mapping[int, str] = MappingProxyType({
    0: "OK", 1: "CANCELLED", 2: "UNKNOWN", 3: "INVALID_ARGUMENT", 4: "DEADLINE_EXCEEDED",
    5: "NOT_FOUND", 6: "ALREADY_EXISTS", 7: "PERMISSION_DENIED", 8: "RESOURCE_EXHAUSTED",
    9: "FAILED_PRECONDITION", 10: "ABORTED", 11: "OUT_OF_RANGE", 12: "UNIMPLEMENTED",
    13: "INTERNAL", 14: "UNAVAILABLE", 15: "DATA_LOSS", 16: "UNAUTHENTICATED",
})

_GRPC_CODES: Mapping[int, Category] = MappingProxyType({
    14: R,   # UNAVAILABLE
    4: R,    # DEADLINE_EXCEEDED
    8: R,    # RESOURCE_EXHAUSTED
    10: R,   # ABORTED
    13: R,   # INTERNAL (google api_core retries it too)
    16: IC,  # UNAUTHENTICATED
    7: IC,   # PERMISSION_DENIED
    12: IC,  # UNIMPLEMENTED: wrong endpoint or version
    3: D,    # INVALID_ARGUMENT
    11: D,   # OUT_OF_RANGE
    5: D,    # NOT_FOUND
    6: D,    # ALREADY_EXISTS
    9: D,    # FAILED_PRECONDITION
})

_HTTP_CODES: Mapping[int, Category] = MappingProxyType({
    408: R, 425: R, 429: R, 500: R, 502: R, 503: R, 504: R,
    401: IC, 403: IC, 405: IC, 407: IC,
    400: D, 404: D, 409: D, 410: D, 413: D, 415: D, 422: D,
})


@dataclass(frozen=True, slots=True)
class Classification:
    category: Category
    rule: str        # the rule that matched, for the verdict's reason

    def describe(self) -> str:
        return f"{self.category.value} ({self.rule})"


def chain_of(exc: ExceptionInfo) -> tuple[str, ...]:
    """The class and its ancestors, most specific first, qualified, without duplicates."""
    seen: dict[str, None] = {}
    for name in (exc.class_name, *exc.class_chain):
        if name and name.strip():
            seen.setdefault(qualify(name), None)
    return tuple(seen)


def _match_chain(chain: tuple[str, ...],
                 table: Mapping[str, Category]) -> tuple[str, Category] | None:
    for name in chain:
        category = table.get(name)
        if category is not None:
            return name, category
    return None


@dataclass(frozen=True, slots=True)
class Classifier:
    """One job's classification: its user rules over the built-in tables, then its default."""

    user_rules: Mapping[str, Category]
    default: Category = Category.DATA
    user_codes: Mapping[str, Category] = field(default_factory=dict)   # kafka:CODE rules
    # Answers by everything a classification reads (never the message): a batch of records
    # failing the same way is classified once. Bounded; cleared when full.
    _cache: dict = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def build(cls, rules: Iterable[tuple[str, Category]], default: Category) -> Classifier:
        table: dict[str, Category] = {}
        codes: dict[str, Category] = {}
        for name, category in rules:
            if name.startswith(KAFKA_RULE):
                codes.setdefault(name[len(KAFKA_RULE):], category)   # first rule wins
            else:
                table.setdefault(qualify(name), category)   # first rule for a class wins
        return cls(MappingProxyType(table), default, MappingProxyType(codes))

    def classify(self, exc: ExceptionInfo) -> Classification:
        key = (exc.class_name, exc.class_chain, exc.marker_category, exc.kafka_txn_requires_abort,
               exc.kafka_fatal, exc.kafka_retriable, exc.kafka_error_code, exc.grpc_status_code,
               exc.http_status_code)
        cache = self._cache
        hit = cache.get(key)
        if hit is None:
            hit = self._classify(exc)
            if len(cache) >= MAX_CACHED:
                cache.clear()
            cache[key] = hit
        return hit

    def _classify(self, exc: ExceptionInfo) -> Classification:
        code = exc.kafka_error_code
        if code and code in self.user_codes:
            category = self.user_codes[code]
            return Classification(category, f"user rule kafka:{code}={category.value}")
        chain = chain_of(exc)
        hit = _match_chain(chain, self.user_rules)
        if hit is not None:
            return Classification(hit[1], f"user rule {hit[0]}={hit[1].value}")
        if exc.marker_category is not None:
            return Classification(exc.marker_category,
                                  f"marker class {exc.marker_category.value}")
        hit = _classify_kafka(exc)
        if hit is not None:
            return hit
        code = exc.grpc_status_code
        if code is not None and code in _GRPC_CODES:
            return Classification(_GRPC_CODES[code],
                                  f"gRPC status {GRPC_STATUS_NAMES.get(code, code)}")
        http = exc.http_status_code
        if http is not None:
            if http in _HTTP_CODES:
                return Classification(_HTTP_CODES[http], f"HTTP {http}")
            if 500 <= http <= 599:
                return Classification(R, f"HTTP {http} (5xx)")
        hit = _match_chain(chain, BUILTIN_RULES)
        if hit is not None:
            return Classification(hit[1], f"built-in rule {hit[0]}")
        return Classification(
            self.default, f"no rule matched; errors.classification.default={self.default.value}")


def _classify_kafka(exc: ExceptionInfo) -> Classification | None:
    """Step 3 of the module docstring: a confluent-kafka error's code and flags."""
    code = exc.kafka_error_code
    category = KAFKA_ERROR_CODES.get(code) if code else None
    if category is IC:
        return Classification(IC, f"Kafka error code {code}")
    if exc.kafka_fatal:
        return Classification(AR, f"Kafka error{' ' + code if code else ''}: fatal")
    if exc.kafka_txn_requires_abort:
        return Classification(AB, f"Kafka error{' ' + code if code else ''}: "
                                  f"transaction requires abort")
    if category is not None:
        return Classification(category, f"Kafka error code {code}")
    if exc.kafka_retriable:
        return Classification(R, f"Kafka error{' ' + code if code else ''}: retriable")
    return None
