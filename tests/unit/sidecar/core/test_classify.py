"""KIP-1050 classification: the tables, and which source wins."""

from __future__ import annotations

import pytest
from spillway.sidecar.core.classify import BUILTIN_RULES, Classifier, chain_of, qualify
from spillway.sidecar.core.model import Category, ExceptionInfo

R, RR, AB, AR, IC, D = (Category.RETRIABLE, Category.REFRESH_RETRIABLE, Category.ABORTABLE,
                        Category.APPLICATION_RECOVERABLE, Category.INVALID_CONFIGURATION,
                        Category.DATA)

DEFAULT = Classifier.build((), D)


def exc(cls: str, *chain: str, **kw) -> ExceptionInfo:
    return ExceptionInfo(class_name=cls, class_chain=(cls, *chain, "builtins.BaseException"), **kw)


@pytest.mark.parametrize(("info", "category"), [
    (exc("builtins.ConnectionError", "builtins.OSError", "builtins.Exception"), R),
    (exc("builtins.ConnectionResetError", "builtins.ConnectionError", "builtins.OSError"), R),
    (exc("builtins.TimeoutError", "builtins.OSError"), R),
    (exc("socket.timeout"), R),
    (exc("builtins.BrokenPipeError", "builtins.ConnectionError"), R),
    # a subclass we have never heard of, found through its ancestor in the chain
    (exc("mydb.DbConnectionLost", "builtins.ConnectionError", "builtins.OSError"), R),
    (exc("requests.exceptions.ReadTimeout", "requests.exceptions.Timeout",
         "requests.exceptions.RequestException", "builtins.OSError"), R),
    (exc("builtins.PermissionError", "builtins.OSError"), IC),
    (exc("botocore.exceptions.NoCredentialsError", "botocore.exceptions.BotoCoreError"), IC),
    (exc("org.apache.kafka.common.errors.TopicAuthorizationException",
         "org.apache.kafka.common.errors.AuthorizationException"), IC),
    (exc("builtins.ModuleNotFoundError", "builtins.ImportError"), IC),
    (exc("builtins.ValueError", "builtins.Exception"), D),
    (exc("builtins.KeyError", "builtins.LookupError"), D),
    (exc("builtins.TypeError"), D),
    (exc("builtins.UnicodeDecodeError", "builtins.UnicodeError", "builtins.ValueError"), D),
    (exc("json.decoder.JSONDecodeError", "builtins.ValueError"), D),
    (exc("org.apache.kafka.common.errors.NotLeaderOrFollowerException",
         "org.apache.kafka.common.errors.InvalidMetadataException"), RR),
    (exc("org.apache.kafka.common.errors.TransactionAbortableException"), AB),
    (exc("builtins.MemoryError"), AR),
    # bare builtin names are accepted as well as qualified ones
    (ExceptionInfo("ConnectionRefusedError", ("ConnectionRefusedError", "ConnectionError")), R),
    (ExceptionInfo("ValueError"), D),
])
def test_builtin_class_rules(info, category):
    assert DEFAULT.classify(info).category is category


@pytest.mark.parametrize(("code", "category"), [
    (14, R), (4, R), (8, R), (10, R),   # UNAVAILABLE DEADLINE_EXCEEDED RESOURCE_EXHAUSTED ABORTED
    (16, IC), (7, IC),                          # UNAUTHENTICATED PERMISSION_DENIED
    (3, D), (11, D),                            # INVALID_ARGUMENT OUT_OF_RANGE
])
def test_grpc_status_codes(code, category):
    c = DEFAULT.classify(exc("grpc._channel._InactiveRpcError", "grpc.RpcError",
                             grpc_status_code=code))
    assert c.category is category
    assert c.rule.startswith("gRPC status ")


@pytest.mark.parametrize(("status", "category"), [
    (429, R), (502, R), (503, R), (504, R), (500, R), (599, R), (408, R),
    (401, IC), (403, IC),
    (400, D), (422, D), (404, D),
])
def test_http_status(status, category):
    # requests.HTTPError is an OSError by ancestry: the status must win over the class
    info = exc("requests.exceptions.HTTPError", "requests.exceptions.RequestException",
               "builtins.OSError", http_status_code=status)
    assert DEFAULT.classify(info).category is category


def test_unlisted_http_4xx_falls_through_to_class_rules():
    info = exc("x.Http", "builtins.ConnectionError", http_status_code=418)
    assert DEFAULT.classify(info).category is R


@pytest.mark.parametrize(("flags", "category"), [
    ({"kafka_retriable": True}, R),
    ({"kafka_fatal": True}, AR),
    ({"kafka_txn_requires_abort": True}, AB),
    ({"kafka_txn_requires_abort": True, "kafka_retriable": True}, AB),
    ({"kafka_fatal": True, "kafka_retriable": True}, AR),
    ({"kafka_retriable": False}, AR),            # no flag set: KafkaException's class rule
])
def test_confluent_kafka_flags(flags, category):
    info = exc("cimpl.KafkaException", "builtins.Exception", **flags)
    assert DEFAULT.classify(info).category is category


def test_marker_category_beats_codes_and_class_rules():
    info = exc("builtins.ValueError", marker_category=R, grpc_status_code=3)
    c = DEFAULT.classify(info)
    assert c.category is R and c.rule == "marker class retriable"


def test_user_rules_win_over_everything_and_match_ancestors():
    clf = Classifier.build((("builtins.OSError", D), ("ValueError", R)), D)
    # ancestor in the chain matches a user rule before the built-in ConnectionError rule
    c = clf.classify(exc("builtins.ConnectionError", "builtins.OSError", marker_category=AB,
                         grpc_status_code=14))
    assert c.category is D and c.rule == "user rule builtins.OSError=data"
    assert clf.classify(exc("json.decoder.JSONDecodeError", "builtins.ValueError")).category is R


def test_user_rules_most_specific_class_first_then_rule_order():
    clf = Classifier.build((("builtins.OSError", D), ("builtins.ConnectionError", R),
                            ("builtins.ConnectionError", IC)), D)
    c = clf.classify(exc("builtins.ConnectionResetError", "builtins.ConnectionError",
                         "builtins.OSError"))
    assert c.category is R     # ConnectionError is more specific than OSError; first rule wins


@pytest.mark.parametrize("default", list(Category))
def test_unknown_exceptions_get_the_configured_default(default):
    c = Classifier.build((), default).classify(exc("acme.WeirdThing", "builtins.Exception"))
    assert c.category is default
    assert f"errors.classification.default={default.value}" in c.rule


def test_empty_exception_info_gets_the_default():
    assert DEFAULT.classify(ExceptionInfo("")).category is D


def test_chain_is_qualified_and_deduplicated():
    assert chain_of(ExceptionInfo("ValueError", ("ValueError", "builtins.Exception", ""))) == (
        "builtins.ValueError", "builtins.Exception")
    assert qualify("a.b.C") == "a.b.C"


def test_builtin_table_keys_are_qualified():
    assert all("." in k for k in BUILTIN_RULES)
