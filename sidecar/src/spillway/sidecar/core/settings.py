"""Typed, validated settings built once from raw properties (see `config.py` for the table).

Cross-property invariants are checked here, at sidecar start-up or job registration; a violation
raises ConfigError naming the property. Nothing is clamped silently.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass

from ..errors import ConfigError
from . import config, names
from .model import Category


# The status-store KIP's defaults, which every unset knob of its family takes once any knob of
# the family is set (under spillway's name or the KIP's `status.storage.retry.*` alias).
FAMILY_DEFAULTS = {
    "errors.retry.max.retries": 5,
    "errors.retry.initial.backoff.ms": 300,
    "errors.retry.max.backoff.ms": 10_000,
    "errors.retry.backoff.multiplier": 2.0,
    "errors.retry.jitter.factor": 0.25,
}


@dataclass(frozen=True, slots=True)
class RetrySettings:
    """Retry knobs. When the status-store family is in use, its five knobs are all set here
    (the unset ones at `FAMILY_DEFAULTS`, max.backoff at most errors.retry.delay.max.ms);
    when it is not, all five are None and the KIP-298 pair alone applies."""

    timeout_ms: int               # errors.retry.timeout: 0 no retry, -1 unlimited
    delay_max_ms: int             # errors.retry.delay.max.ms
    max_retries: int | None       # errors.retry.max.retries (None: family not in use)
    initial_backoff_ms: int | None
    max_backoff_ms: int | None
    multiplier: float | None
    jitter_factor: float | None
    budget_ratio: float           # -1 disables
    budget_min_retries: int
    budget_window_ms: int

    @property
    def fine_grained(self) -> bool:
        """True when any knob of the status-store KIP family is set."""
        return any(v is not None for v in (self.max_retries, self.initial_backoff_ms,
                                           self.max_backoff_ms, self.multiplier,
                                           self.jitter_factor))


@dataclass(frozen=True, slots=True)
class CircuitSettings:
    enable: bool
    failure_threshold: int
    min_tasks: int
    window_ms: int
    open_ms: int
    success_threshold: int
    max_holds: int = 10


@dataclass(frozen=True, slots=True)
class ToleranceSettings:
    mode: str                  # none | all
    max_errors: int            # -1: no count limit
    max_ratio: float           # -1: no ratio limit
    min_records: int
    window_ms: int             # 0: whole job
    per_stage: bool


@dataclass(frozen=True, slots=True)
class DlqSettings:
    topic: str                 # '' : no DLQ
    prefix: str
    context_headers: bool
    header_format: str         # connect | dlq
    copy_record: bool
    auto_create: bool
    replication_factor: int
    partitions: int
    stacktrace_max_bytes: int

    @property
    def enabled(self) -> bool:
        return bool(self.topic)


@dataclass(frozen=True, slots=True)
class JobSettings:
    job: str
    raw: Mapping[str, str]     # the effective properties, as strings (echoed to the client)
    tolerance: ToleranceSettings
    retry: RetrySettings
    circuit: CircuitSettings
    dlq: DlqSettings
    log_enable: bool
    log_include_messages: bool
    handler_class: str
    default_category: Category
    classification_rules: tuple[tuple[str, Category], ...]

    @classmethod
    def from_properties(cls, job: str, raw: Mapping[str, str],
                        explicit: Collection[str] | None = None) -> JobSettings:
        """Parse and validate the effective properties of a job.

        ``explicit`` names the properties the job set itself (None: all of them). Settings that
        contradict ``errors.tolerance=none`` are refused only when the job set them itself; a
        sidecar-wide default limit simply does not apply to a fail-fast job.
        """
        try:
            names.check_job_name(job)
        except ValueError as exc:
            raise ConfigError("job", str(exc).removeprefix("job: ")) from None
        v = config.parse(raw)
        family = _retry_family(v)
        retry = RetrySettings(
            timeout_ms=v["errors.retry.timeout"],
            delay_max_ms=v["errors.retry.delay.max.ms"],
            max_retries=family["errors.retry.max.retries"],
            initial_backoff_ms=family["errors.retry.initial.backoff.ms"],
            max_backoff_ms=family["errors.retry.max.backoff.ms"],
            multiplier=family["errors.retry.backoff.multiplier"],
            jitter_factor=family["errors.retry.jitter.factor"],
            budget_ratio=v["errors.retry.budget.ratio"],
            budget_min_retries=v["errors.retry.budget.min.retries"],
            budget_window_ms=v["errors.retry.budget.window.ms"],
        )
        _check_retry(retry)
        tolerance = ToleranceSettings(
            mode=v["errors.tolerance"],
            max_errors=v["errors.tolerance.max.errors"],
            max_ratio=v["errors.tolerance.max.ratio"],
            min_records=v["errors.tolerance.min.records"],
            window_ms=v["errors.tolerance.window.ms"],
            per_stage=v["errors.tolerance.per.stage"],
        )
        dlq = DlqSettings(
            topic=v["errors.deadletterqueue.topic.name"],
            prefix=v["errors.deadletterqueue.topic.name.prefix"],
            context_headers=v["errors.deadletterqueue.context.headers.enable"],
            header_format=v["errors.deadletterqueue.headers.format"],
            copy_record=v["errors.deadletterqueue.copy.record.enable"],
            auto_create=v["errors.deadletterqueue.auto.create.topics.enable"],
            replication_factor=v["errors.deadletterqueue.topic.replication.factor"],
            partitions=v["errors.deadletterqueue.topic.partitions"],
            stacktrace_max_bytes=v["errors.deadletterqueue.stacktrace.max.bytes"],
        )
        _check_tolerance(tolerance, v["errors.handler.class"],
                         raw.keys() if explicit is None else explicit)
        return cls(
            job=job,
            raw=dict(raw),
            tolerance=tolerance,
            retry=retry,
            circuit=CircuitSettings(
                enable=v["errors.circuit.enable"],
                failure_threshold=v["errors.circuit.failure.threshold"],
                min_tasks=v["errors.circuit.min.tasks"],
                window_ms=v["errors.circuit.window.ms"],
                open_ms=v["errors.circuit.open.ms"],
                success_threshold=v["errors.circuit.success.threshold"],
                max_holds=v["errors.circuit.max.holds"],
            ),
            dlq=dlq,
            log_enable=v["errors.log.enable"],
            log_include_messages=v["errors.log.include.messages"],
            handler_class=v["errors.handler.class"],
            default_category=Category(v["errors.classification.default"]),
            classification_rules=parse_rules(v["errors.classification.rules"]),
        )


def _retry_family(v: Mapping[str, object]) -> dict[str, object]:
    """The status-store family's five knobs: all None when none is set; otherwise the set ones
    and the KIP's defaults for the rest, except that an unset max.backoff.ms never exceeds
    errors.retry.delay.max.ms (KIP-298's "maximum delay between two consecutive retries") and
    an unset initial.backoff.ms never exceeds the max."""
    if all(v[name] is None for name in FAMILY_DEFAULTS):
        return dict.fromkeys(FAMILY_DEFAULTS)
    out = {name: (v[name] if v[name] is not None else default)
           for name, default in FAMILY_DEFAULTS.items()}
    if v["errors.retry.max.backoff.ms"] is None:
        out["errors.retry.max.backoff.ms"] = min(FAMILY_DEFAULTS["errors.retry.max.backoff.ms"],
                                                 v["errors.retry.delay.max.ms"])
    if v["errors.retry.initial.backoff.ms"] is None:     # a default never breaks the check
        out["errors.retry.initial.backoff.ms"] = min(out["errors.retry.initial.backoff.ms"],
                                                     out["errors.retry.max.backoff.ms"])
    return out


def _check_retry(retry: RetrySettings) -> None:
    """initial <= max backoff (the KIP's start-up check). Nothing is clamped."""
    if retry.initial_backoff_ms is None or retry.max_backoff_ms is None:
        return
    if retry.initial_backoff_ms > retry.max_backoff_ms:
        raise ConfigError(
            "errors.retry.initial.backoff.ms",
            f"must be <= errors.retry.max.backoff.ms ({retry.initial_backoff_ms} > "
            f"{retry.max_backoff_ms}); an unset max.backoff.ms is the status-store KIP's "
            f"10000, or errors.retry.delay.max.ms when that is lower",
        )


def _check_tolerance(t: ToleranceSettings, handler_class: str, explicit: Collection[str]) -> None:
    """Limits only mean something with errors.tolerance=all; say so instead of ignoring them."""
    if t.mode == "none":
        for prop, value, unset in (("errors.tolerance.max.errors", t.max_errors, -1),
                                   ("errors.tolerance.max.ratio", t.max_ratio, -1.0)):
            if value != unset and prop in explicit:
                raise ConfigError(prop, (
                    f"is set to {value:g} but errors.tolerance=none fails the job on the first "
                    f"error; set errors.tolerance=all to tolerate errors within this limit"))
        name = handler_class.strip().lower()
        if "errors.handler.class" in explicit and name in (
                "logandcontinue", "logandcontinueexceptionhandler", "log-and-continue"):
            raise ConfigError("errors.handler.class", (
                f"{handler_class.strip()} cannot continue under errors.tolerance=none (the first "
                f"error fails the job); set errors.tolerance=all"))
    if handler_class.strip():
        _check_handler_spec(handler_class)


def _check_handler_spec(spec: str) -> None:
    from .handlers import is_builtin, split_spec

    if not is_builtin(spec):
        split_spec(spec)


KAFKA_RULE_PREFIX = "kafka:"   # a user rule on a confluent-kafka error code, not a class


def parse_rules(text: str) -> tuple[tuple[str, Category], ...]:
    """'a.B=retriable, c.D=data' -> ((a.B, RETRIABLE), (c.D, DATA)); order kept (first wins)."""
    rules: list[tuple[str, Category]] = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        cls, sep, cat = part.partition("=")
        cls, cat = cls.strip(), cat.strip().lower()
        if not sep or not cls:
            raise ConfigError("errors.classification.rules",
                              f"each rule is qualified.ExceptionClass=category or "
                              f"kafka:ERROR_CODE=category; got {part!r}")
        if cls.lower().startswith(KAFKA_RULE_PREFIX):
            code = cls[len(KAFKA_RULE_PREFIX):].strip().upper()
            if not code or not all(c.isalnum() or c == "_" for c in code):
                raise ConfigError("errors.classification.rules",
                                  f"a Kafka rule is kafka:ERROR_CODE=category with a "
                                  f"KafkaError name such as NOT_LEADER_FOR_PARTITION; got "
                                  f"{part!r}")
            cls = KAFKA_RULE_PREFIX + code
        try:
            rules.append((cls, Category(cat)))
        except ValueError:
            raise ConfigError(
                "errors.classification.rules",
                f"unknown category {cat!r} in {part!r}; "
                f"allowed: {', '.join(config.CATEGORY_NAMES)}",
            ) from None
    return tuple(rules)


def job_settings(job: str, properties: Mapping[str, str],
                 sidecar_defaults: Mapping[str, str] | None = None) -> JobSettings:
    """Resolve a job's properties over the sidecar's job defaults, then parse and validate."""
    raw = config.resolve(explicit=properties, defaults=sidecar_defaults, scope="job")
    return JobSettings.from_properties(job, raw,
                                       explicit=frozenset(config.canonical(properties)))
