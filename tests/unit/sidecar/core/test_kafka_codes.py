"""KIP-1050 for confluent-kafka errors: each librdkafka code the sidecar knows, from a real
``confluent_kafka.KafkaError`` raised the way an application raises it, through the client's
report building, the sidecar's protobuf conversion and its classifier."""

from __future__ import annotations

import pytest
from confluent_kafka import KafkaError, KafkaException
from spillway.client import report
from spillway.sidecar.core.classify import KAFKA_ERROR_CODES, Classifier
from spillway.sidecar.core.model import Category
from spillway.sidecar.transport import convert
from spillway.v1 import sidecar_pb2 as pb

R, RR, AB = Category.RETRIABLE, Category.REFRESH_RETRIABLE, Category.ABORTABLE
AR, IC, D = Category.APPLICATION_RECOVERABLE, Category.INVALID_CONFIGURATION, Category.DATA

# Written from the KIP's table (Java exception -> category), not read from the module.
EXPECTED = {
    # refresh metadata, then retry (InvalidMetadataException, coordinator errors)
    "NOT_LEADER_FOR_PARTITION": RR, "UNKNOWN_TOPIC_OR_PART": RR, "LEADER_NOT_AVAILABLE": RR,
    "FENCED_LEADER_EPOCH": RR, "UNKNOWN_LEADER_EPOCH": RR, "REPLICA_NOT_AVAILABLE": RR,
    "PREFERRED_LEADER_NOT_AVAILABLE": RR, "KAFKA_STORAGE_ERROR": RR, "UNKNOWN_TOPIC_ID": RR,
    "INCONSISTENT_TOPIC_ID": RR, "LISTENER_NOT_FOUND": RR, "NOT_COORDINATOR": RR,
    "COORDINATOR_NOT_AVAILABLE": RR, "REBOOTSTRAP_REQUIRED": RR, "_UNKNOWN_PARTITION": RR,
    "_UNKNOWN_TOPIC": RR, "_WAIT_COORD": RR, "_NODE_UPDATE": RR,
    # retriable
    "_TRANSPORT": R, "_MSG_TIMED_OUT": R, "_TIMED_OUT": R, "_TIMED_OUT_QUEUE": R,
    "_ALL_BROKERS_DOWN": R, "_RESOLVE": R, "_QUEUE_FULL": R, "_RETRY": R, "_WAIT_CACHE": R,
    "_PREV_IN_PROGRESS": R, "_ISR_INSUFF": R, "_UNKNOWN_BROKER": R, "REQUEST_TIMED_OUT": R,
    "NETWORK_EXCEPTION": R, "BROKER_NOT_AVAILABLE": R, "NOT_ENOUGH_REPLICAS": R,
    "NOT_ENOUGH_REPLICAS_AFTER_APPEND": R, "INVALID_MSG": R, "COORDINATOR_LOAD_IN_PROGRESS": R,
    "CONCURRENT_TRANSACTIONS": R, "NOT_CONTROLLER": R, "OFFSET_NOT_AVAILABLE": R,
    "THROTTLING_QUOTA_EXCEEDED": R, "UNSTABLE_OFFSET_COMMIT": R,
    "FETCH_SESSION_ID_NOT_FOUND": R, "INVALID_FETCH_SESSION_EPOCH": R,
    # abortable
    "TRANSACTION_ABORTABLE": AB, "INVALID_TXN_STATE": AB,
    # application-recoverable
    "PRODUCER_FENCED": AR, "INVALID_PRODUCER_EPOCH": AR, "INVALID_PRODUCER_ID_MAPPING": AR,
    "_FENCED": AR, "TRANSACTION_COORDINATOR_FENCED": AR, "FENCED_INSTANCE_ID": AR,
    "UNKNOWN_MEMBER_ID": AR, "ILLEGAL_GENERATION": AR, "_FATAL": AR,
    # invalid configuration
    "TOPIC_AUTHORIZATION_FAILED": IC, "GROUP_AUTHORIZATION_FAILED": IC,
    "CLUSTER_AUTHORIZATION_FAILED": IC, "TRANSACTIONAL_ID_AUTHORIZATION_FAILED": IC,
    "DELEGATION_TOKEN_AUTHORIZATION_FAILED": IC, "SASL_AUTHENTICATION_FAILED": IC,
    "ILLEGAL_SASL_STATE": IC, "UNSUPPORTED_SASL_MECHANISM": IC, "UNACCEPTABLE_CREDENTIAL": IC,
    "SECURITY_DISABLED": IC, "_AUTHENTICATION": IC, "_SSL": IC, "UNSUPPORTED_VERSION": IC,
    "UNSUPPORTED_FOR_MESSAGE_FORMAT": IC, "UNSUPPORTED_COMPRESSION_TYPE": IC,
    "INVALID_RECORD": IC, "INVALID_REQUIRED_ACKS": IC, "MSG_SIZE_TOO_LARGE": IC,
    "RECORD_LIST_TOO_LARGE": IC, "INVALID_MSG_SIZE": IC, "TOPIC_EXCEPTION": IC,
    "INVALID_CONFIG": IC, "INVALID_TRANSACTION_TIMEOUT": IC, "INVALID_PRINCIPAL_TYPE": IC,
    "_INVALID_ARG": IC, "_NOT_CONFIGURED": IC, "_UNSUPPORTED_FEATURE": IC,
    "_NOT_IMPLEMENTED": IC, "_UNKNOWN_PROTOCOL": IC,
    # data: the record's own bytes
    "_KEY_SERIALIZATION": D, "_VALUE_SERIALIZATION": D, "_KEY_DESERIALIZATION": D,
    "_VALUE_DESERIALIZATION": D, "_BAD_MSG": D,
}


def _classify(exc: BaseException):
    """Client report -> wire bytes -> sidecar conversion -> the job's classifier."""
    sent = report.failed_record("orders/0/1", "PRODUCE", exc)
    wire = pb.FailedRecord.FromString(sent.SerializeToString())
    rec = convert.failed_records([wire])[0]
    return wire.exception, Classifier.build((), Category.DATA).classify(rec.exception)


def _raised(err: KafkaError, wrap: bool = False) -> BaseException:
    try:
        try:
            raise KafkaException(err)
        except KafkaException as kexc:
            if wrap:
                raise RuntimeError("sink write failed") from kexc
            raise
    except Exception as exc:  # noqa: BLE001
        return exc


def test_every_mapped_code_has_an_expected_category_here():
    assert set(EXPECTED) == set(KAFKA_ERROR_CODES)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_each_code_from_a_real_kafka_error(name):
    err = KafkaError(getattr(KafkaError, name))
    assert err.name() == name
    sent, cls = _classify(_raised(err))
    assert sent.kafka_error_code == name
    assert cls.category is EXPECTED[name], cls.rule
    assert name in cls.rule


@pytest.mark.parametrize("name", ["NOT_LEADER_FOR_PARTITION", "TOPIC_AUTHORIZATION_FAILED"])
def test_a_kafka_error_nested_in_the_cause_chain_is_found(name):
    sent, cls = _classify(_raised(KafkaError(getattr(KafkaError, name)), wrap=True))
    assert sent.class_name == "builtins.RuntimeError"
    assert (sent.kafka_error_code, cls.category) == (name, EXPECTED[name])


def test_a_kafka_error_value_carried_by_another_exception():
    exc = ValueError(KafkaError(KafkaError._MSG_TIMED_OUT))   # e.g. raise X(msg.error())
    sent, cls = _classify(exc)
    assert (sent.kafka_error_code, cls.category) == ("_MSG_TIMED_OUT", R)


def test_flags_override_a_non_configuration_code():
    # in a transaction, a retriable error must abort it (KIP-1050)
    _, cls = _classify(_raised(KafkaError(KafkaError._MSG_TIMED_OUT, txn_requires_abort=True)))
    assert cls.category is AB
    # a fatal error leaves the client unusable, whatever its code
    _, cls = _classify(_raised(KafkaError(KafkaError.NOT_LEADER_FOR_PARTITION, fatal=True)))
    assert cls.category is AR
    # ... but a configuration error stays one: restarting does not fix it
    _, cls = _classify(_raised(KafkaError(KafkaError.TRANSACTIONAL_ID_AUTHORIZATION_FAILED,
                                          fatal=True)))
    assert cls.category is IC


def test_unknown_codes_fall_back_to_the_flags_then_the_safe_default():
    code = KafkaError.OUT_OF_ORDER_SEQUENCE_NUMBER         # out of KIP-1050's scope
    assert "OUT_OF_ORDER_SEQUENCE_NUMBER" not in KAFKA_ERROR_CODES
    _, cls = _classify(_raised(KafkaError(code, retriable=True)))
    assert cls.category is R
    _, cls = _classify(_raised(KafkaError(code)))
    assert cls.category is AR        # KafkaException's class rule: KIP-1050's unknown default


def test_a_user_rule_still_wins_over_the_code_table():
    sent = report.failed_record("r", "PRODUCE", _raised(KafkaError(KafkaError.MSG_SIZE_TOO_LARGE)))
    rec = convert.failed_records([sent])[0]
    c = Classifier.build((("cimpl.KafkaException", D), ("confluent_kafka.error.KafkaException", D)),
                         Category.DATA)
    assert c.classify(rec.exception).category is D


def test_a_user_rule_on_a_kafka_code_overrides_the_table():
    from spillway.sidecar.core.settings import job_settings

    s = job_settings("j", {"errors.classification.rules":
                           "kafka:msg_size_too_large=data, cimpl.KafkaException=retriable"})
    c = Classifier.build(s.classification_rules, s.default_category)
    sent = report.failed_record("r", "PRODUCE", _raised(KafkaError(KafkaError.MSG_SIZE_TOO_LARGE)))
    cls = c.classify(convert.failed_records([sent])[0].exception)
    assert (cls.category, cls.rule) == (D, "user rule kafka:MSG_SIZE_TOO_LARGE=data")
    # the code rule is more specific than the class rule; other codes meet the class rule
    other = report.failed_record("r", "PRODUCE", _raised(KafkaError(KafkaError._SSL)))
    assert c.classify(convert.failed_records([other])[0].exception).category is R


@pytest.mark.parametrize("rule", ["kafka:=data", "kafka:NOT A CODE=data", "kafka:X=nope"])
def test_bad_kafka_rules_are_refused_naming_the_property(rule):
    from spillway.sidecar.core.settings import job_settings
    from spillway.sidecar.errors import ConfigError

    with pytest.raises(ConfigError, match="errors.classification.rules"):
        job_settings("j", {"errors.classification.rules": rule})
