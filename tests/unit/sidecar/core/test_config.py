"""Configuration: defaults, precedence, and validation messages that name the property."""

from __future__ import annotations

import pytest
from spillway.sidecar.core import config
from spillway.sidecar.core.model import Category
from spillway.sidecar.core.settings import JobSettings, job_settings
from spillway.sidecar.errors import ConfigError
from support.deciding import decisions


def settings(**props: str) -> JobSettings:
    return job_settings("j", {k: v for k, v in props.items()})


def p(**kv: str) -> dict[str, str]:
    return {k.replace("__", "."): v for k, v in kv.items()}


def test_defaults_are_kip298_fail_fast_no_retry():
    s = job_settings("j", {})
    assert s.tolerance.mode == "none"
    assert (s.retry.timeout_ms, s.retry.delay_max_ms) == (0, 60_000)
    assert not s.retry.fine_grained
    assert (s.retry.budget_ratio, s.retry.budget_min_retries, s.retry.budget_window_ms) == (
        0.2, 100, 10_000)
    c = s.circuit
    assert (c.enable, c.failure_threshold, c.min_tasks, c.window_ms, c.open_ms,
            c.success_threshold, c.max_holds) == (True, 20, 2, 10_000, 5_000, 3, 10)
    assert (s.log_enable, s.log_include_messages, s.handler_class) == (False, False, "")
    assert s.default_category is Category.DATA
    assert not s.dlq.enabled


@pytest.mark.parametrize(("props", "prop", "words"), [
    ({"errors.retry.initial.backoff.ms": "5000", "errors.retry.max.backoff.ms": "1000"},
     "errors.retry.initial.backoff.ms", "must be <= errors.retry.max.backoff.ms (5000 > 1000)"),
    ({"errors.retry.initial.backoff.ms": "90000"},
     "errors.retry.initial.backoff.ms", "errors.retry.delay.max.ms"),
    ({"errors.retry.jitter.factor": "1.5"}, "errors.retry.jitter.factor", "[0.0, 1.0]"),
    ({"errors.retry.jitter.factor": "-0.1"}, "errors.retry.jitter.factor", "[0.0, 1.0]"),
    ({"errors.retry.backoff.multiplier": "0.5"}, "errors.retry.backoff.multiplier", "[1.0"),
    ({"errors.retry.backoff.multiplier": "nan"}, "errors.retry.backoff.multiplier", "finite"),
    ({"errors.retry.max.retries": "-1"}, "errors.retry.max.retries", "[0, 1000000]"),
    ({"errors.retry.initial.backoff.ms": "-5"}, "errors.retry.initial.backoff.ms", "[0, 86400000]"),
    ({"errors.retry.max.backoff.ms": "ten"}, "errors.retry.max.backoff.ms", "integer"),
    ({"errors.retry.timeout": "-2"}, "errors.retry.timeout", "[-1, 604800000]"),
    ({"errors.retry.delay.max.ms": "0"}, "errors.retry.delay.max.ms", "[1, 86400000]"),
    ({"errors.tolerance": "some"}, "errors.tolerance", "none, all"),
    ({"errors.tolerance.max.errors": "5"}, "errors.tolerance.max.errors",
     "errors.tolerance=none fails the job on the first error"),
    ({"errors.tolerance.max.ratio": "0.1"}, "errors.tolerance.max.ratio", "errors.tolerance=all"),
    ({"errors.tolerance": "all", "errors.tolerance.max.ratio": "1.5"},
     "errors.tolerance.max.ratio", "[0.0, 1.0] or one of [-1.0]"),
    ({"errors.handler.class": "LogAndContinue"}, "errors.handler.class",
     "cannot continue under errors.tolerance=none"),
    ({"errors.handler.class": "not a class"}, "errors.handler.class", "package.module:Class"),
    ({"errors.classification.rules": "a.B=flaky"}, "errors.classification.rules",
     "unknown category 'flaky'"),
    ({"errors.classification.rules": "a.B"}, "errors.classification.rules",
     "qualified.ExceptionClass=category"),
    ({"errors.classification.default": "retry"}, "errors.classification.default",
     "invalid-configuration"),
    ({"errors.circuit.failure.threshold": "0"}, "errors.circuit.failure.threshold",
     "[1, 1000000000000]"),
    ({"errors.retry.budget.ratio": "2"}, "errors.retry.budget.ratio", "[0.0, 1.0]"),
    ({"errors.log.enable": "yes"}, "errors.log.enable", "true or false"),
    ({"errors.tolerence": "all"}, "errors.tolerence", "did you mean errors.tolerance?"),
])
def test_invalid_settings_are_rejected_naming_the_property(props, prop, words):
    with pytest.raises(ConfigError) as e:
        job_settings("j", props)
    assert e.value.property == prop
    assert str(e.value).startswith(prop + ":")
    assert words in str(e.value)


@pytest.mark.parametrize("props", [
    {"errors.retry.initial.backoff.ms": "1000", "errors.retry.max.backoff.ms": "1000"},
    {"errors.retry.jitter.factor": "0"},
    {"errors.retry.jitter.factor": "1"},
    {"errors.retry.backoff.multiplier": "1"},
    {"errors.retry.max.retries": "0"},
    {"errors.retry.initial.backoff.ms": "0"},
    {"errors.tolerance": "all", "errors.tolerance.max.errors": "0"},
    {"errors.tolerance": "all", "errors.handler.class": "LogAndContinue"},
    {"errors.handler.class": "LogAndFail"},
    {"errors.handler.class": "my.pkg:Handler"},
    {"errors.handler.class": "my.pkg.Handler"},
])
def test_valid_edge_values_are_accepted_unchanged(props):
    s = job_settings("j", props)
    for k, v in props.items():
        assert s.raw[k] == v


def test_finer_family_values_are_kept_not_clamped():
    s = settings(**p(errors__retry__max__retries="7", errors__retry__initial__backoff__ms="10",
                     errors__retry__max__backoff__ms="20", errors__retry__backoff__multiplier="3",
                     errors__retry__jitter__factor="1"))
    r = s.retry
    assert (r.max_retries, r.initial_backoff_ms, r.max_backoff_ms, r.multiplier,
            r.jitter_factor) == (7, 10, 20, 3.0, 1.0)
    assert r.fine_grained


def test_classification_rules_parse_in_order():
    s = settings(**{"errors.classification.rules":
                    " a.B = Retriable , ValueError=refresh-retriable ,,"})
    assert s.classification_rules == (("a.B", Category.RETRIABLE),
                                      ("ValueError", Category.REFRESH_RETRIABLE))


def test_precedence_explicit_over_env_over_file_over_default():
    raw = config.resolve(
        explicit={"errors.tolerance": "all"},
        env={config.env_name("errors.tolerance"): "none",
             config.env_name("errors.retry.timeout"): "7"},
        file={"errors.tolerance": "none", "errors.retry.timeout": "3",
              "errors.log.enable": "true"},
        scope="sidecar")
    assert raw["errors.tolerance"] == "all"
    assert raw["errors.retry.timeout"] == "7"
    assert raw["errors.log.enable"] == "true"
    assert raw["errors.retry.delay.max.ms"] == "60000"


def test_sidecar_only_properties_are_refused_for_a_job():
    with pytest.raises(ConfigError) as e:
        job_settings("j", {"spool.dir": "/tmp/x"})
    assert e.value.property == "spool.dir"


def test_job_defaults_layer_sits_under_the_jobs_properties():
    s = job_settings("j", {"errors.retry.timeout": "5"},
                     sidecar_defaults={"errors.retry.timeout": "9", "errors.tolerance": "all"})
    assert (s.retry.timeout_ms, s.tolerance.mode) == (5, "all")


def test_every_property_has_a_doc_and_a_parseable_default():
    for prop in config.PROPERTIES.values():
        assert prop.doc
        prop.parse(prop.name, prop.default)


def test_job_name_is_required():
    with pytest.raises(ConfigError) as e:
        job_settings(" ", {})
    assert e.value.property == "job"


def test_a_default_limit_from_the_sidecar_does_not_break_a_fail_fast_job():
    defaults = {"errors.tolerance.max.errors": "100", "errors.handler.class": "LogAndContinue"}
    s = job_settings("j", {"errors.tolerance": "none"}, sidecar_defaults=defaults)
    assert s.tolerance.mode == "none" and s.tolerance.max_errors == 100
    with pytest.raises(ConfigError) as e:      # but the job's own contradiction is refused
        job_settings("j", {"errors.tolerance.max.errors": "5"}, sidecar_defaults=defaults)
    assert e.value.property == "errors.tolerance.max.errors"


def test_fail_fast_job_under_a_continue_default_still_fails_on_the_first_error():
    from spillway.sidecar.core.model import (
        Action,
        ExceptionInfo,
        FailedRecord,
        Stage,
        StageRef,
        TaskIdentity,
    )
    from spillway.sidecar.core.policy import PolicyEngine
    from support.fakes import FakeClock, FakeRng

    e = PolicyEngine(clock=FakeClock(start_ms=0.0, wall_start_ms=0), rng=FakeRng(0.0),
                     job_defaults={"errors.handler.class": "LogAndContinue"})
    e.register_job("j", {"errors.tolerance": "none"})
    v = decisions(e, "j", TaskIdentity(), [FailedRecord("r", StageRef(Stage.SINK),
                                                    ExceptionInfo("ValueError"))])[0].verdict
    assert v.action is Action.FAIL and v.job_failed and "errors.tolerance=none" in v.reason


# --- other KIPs' names (aliases) ------------------------------------------------------------

def test_status_store_kip_names_are_aliases_with_the_kips_defaults():
    s = job_settings("j", {"status.storage.retry.initial.backoff.ms": "200"})
    r = s.retry
    assert (r.max_retries, r.initial_backoff_ms, r.max_backoff_ms, r.multiplier,
            r.jitter_factor) == (5, 200, 10_000, 2.0, 0.25)
    assert s.raw["errors.retry.initial.backoff.ms"] == "200"      # echoed by its canonical name
    assert "status.storage.retry.initial.backoff.ms" not in s.raw
    every = job_settings("j", {"status.storage.retry.max.retries": "7",
                               "status.storage.retry.initial.backoff.ms": "100",
                               "status.storage.retry.max.backoff.ms": "2000",
                               "status.storage.retry.backoff.multiplier": "3",
                               "status.storage.retry.jitter.factor": "0.5"}).retry
    assert (every.max_retries, every.initial_backoff_ms, every.max_backoff_ms, every.multiplier,
            every.jitter_factor) == (7, 100, 2000, 3.0, 0.5)
    # the family not in use: KIP-298's pair alone (no retry by default)
    plain = job_settings("j", {}).retry
    assert plain.max_retries is None and not plain.fine_grained


def test_an_unset_max_backoff_never_exceeds_kip298s_delay_max():
    r = job_settings("j", {"errors.retry.max.retries": "3",
                           "errors.retry.delay.max.ms": "100"}).retry
    assert (r.max_backoff_ms, r.initial_backoff_ms) == (100, 100)


def test_processing_exception_handler_is_kip1033s_name_for_the_handler():
    s = job_settings("j", {"errors.tolerance": "all",
                           "processing.exception.handler": "LogAndFail"})
    assert s.handler_class == "LogAndFail"
    # and it counts as set by the job for the tolerance checks
    with pytest.raises(ConfigError, match="cannot continue under errors.tolerance=none"):
        job_settings("j", {"processing.exception.handler": "LogAndContinue"})


@pytest.mark.parametrize(("props", "named"), [
    ({"status.storage.retry.max.retries": "4", "errors.retry.max.retries": "3"},
     ("status.storage.retry.max.retries", "errors.retry.max.retries")),
    ({"errors.handler.class": "LogAndFail", "processing.exception.handler": "LogAndContinue"},
     ("errors.handler.class", "processing.exception.handler")),
])
def test_an_alias_and_its_canonical_name_set_differently_are_refused_naming_both(props, named):
    with pytest.raises(ConfigError) as e:
        job_settings("j", {"errors.tolerance": "all", **props})
    assert all(name in str(e.value) for name in named)
    # the same value twice is no conflict
    same = {k: list(props.values())[0] for k in props}
    job_settings("j", {"errors.tolerance": "all", **same})


def test_aliases_in_the_environment_and_files():
    from spillway.sidecar.core import config

    raw = config.resolve(env={"SPILLWAY_STATUS_STORAGE_RETRY_MAX_RETRIES": "9"},
                         file={"processing.exception.handler": "LogAndFail"})
    assert (raw["errors.retry.max.retries"], raw["errors.handler.class"]) == ("9", "LogAndFail")
    with pytest.raises(ConfigError, match="errors.retry.max.retries"):
        config.resolve(env={"SPILLWAY_STATUS_STORAGE_RETRY_MAX_RETRIES": "9",
                            "SPILLWAY_ERRORS_RETRY_MAX_RETRIES": "2"})


def test_listen_address_must_be_host_and_port():
    from spillway.sidecar.core.config import p_listen

    assert p_listen("listen.address", " 127.0.0.1:0 ") == "127.0.0.1:0"
    assert p_listen("listen.address", "[::1]:50051") == "[::1]:50051"
    assert p_listen("listen.address", "") == ""
    for bad in ("localhost", "::1:50051", "h:-1", "h:65536", "h:", ":1"):
        with pytest.raises(ConfigError, match="listen.address"):
            p_listen("listen.address", bad)


def test_unknown_environment_variables_get_a_did_you_mean():
    from spillway.sidecar.core.config import unknown_environment

    msgs = unknown_environment({"SPILLWAY_ERRORS_TOLERENCE": "all",
                                "SPILLWAY_ERRORS_TOLERANCE": "x", "SPILLWAY_SIDECAR_ADDRESS": "a",
                                "SPILLWAY_PRODUCER_KAFKA_ACKS": "1", "HOME": "/root"})
    assert msgs == ["SPILLWAY_ERRORS_TOLERENCE: unknown environment variable, ignored (did you "
                    "mean SPILLWAY_ERRORS_TOLERANCE?)"]
