"""Every numeric property's exact range, written out here independently of the property table
(sidecar/src/spillway/sidecar/core/config.py): both bounds accepted, the next value past each
refused with a ConfigError naming the property, and the extra values a range allows (-1: no
limit) accepted while their neighbours are refused.

A widened (or narrowed) bound in the table fails here, not only in the generated
docs/CONFIGURATION.md going stale. A new numeric property fails
`test_every_ranged_property_is_listed` until its range is written down below."""

from __future__ import annotations

import math

import pytest
from spillway.sidecar.core import config
from spillway.sidecar.errors import ConfigError

DAY_MS = 86_400_000
WEEK_MS = 604_800_000
COUNT = 1_000_000_000_000   # records, thresholds
MILLION = 1_000_000         # retries, holds, tasks, runs

#: name -> (lowest, highest, extra accepted values, integer?, unset "" accepted?)
RANGES: dict[str, tuple[float, float, tuple[float, ...], bool, bool]] = {
    "errors.tolerance.max.errors": (-1, COUNT, (), True, False),
    "errors.tolerance.max.ratio": (0.0, 1.0, (-1.0,), False, False),
    "errors.tolerance.min.records": (0, COUNT, (), True, False),
    "errors.tolerance.window.ms": (0, WEEK_MS, (), True, False),
    "errors.retry.timeout": (-1, WEEK_MS, (), True, False),
    "errors.record.timeout.ms": (0, DAY_MS, (), True, False),
    "errors.retry.delay.max.ms": (1, DAY_MS, (), True, False),
    "errors.retry.max.retries": (0, MILLION, (), True, True),
    "errors.retry.initial.backoff.ms": (0, DAY_MS, (), True, True),
    "errors.retry.max.backoff.ms": (0, DAY_MS, (), True, True),
    "errors.retry.backoff.multiplier": (1.0, 100.0, (), False, True),
    "errors.retry.jitter.factor": (0.0, 1.0, (), False, True),
    "errors.retry.budget.ratio": (0.0, 1.0, (-1.0,), False, False),
    "errors.retry.budget.min.retries": (1, COUNT, (), True, False),
    "errors.retry.budget.window.ms": (1, DAY_MS, (), True, False),
    "errors.circuit.failure.threshold": (1, COUNT, (), True, False),
    "errors.circuit.min.tasks": (1, MILLION, (), True, False),
    "errors.circuit.window.ms": (1, DAY_MS, (), True, False),
    "errors.circuit.open.ms": (1, DAY_MS, (), True, False),
    "errors.circuit.success.threshold": (1, MILLION, (), True, False),
    "errors.circuit.max.holds": (0, MILLION, (), True, False),
    "errors.handler.timeout.ms": (1, 600_000, (), True, False),
    "errors.handler.pool.size": (1, 64, (), True, False),
    "errors.deadletterqueue.topic.replication.factor": (1, 32_767, (), True, False),
    "errors.deadletterqueue.topic.partitions": (1, 100_000, (), True, False),
    "errors.deadletterqueue.stacktrace.max.bytes": (0, 1_048_576, (), True, False),
    "spool.max.bytes": (1, 1_125_899_906_842_624, (), True, False),   # 1 PiB
    "spool.max.records": (1, COUNT, (), True, False),
    "spool.low.water.percent": (0, 100, (), True, False),
    "kafka.check.interval.ms": (1000, DAY_MS, (), True, False),
    "producer.linger.ms": (0, 900_000, (), True, False),
    "home.confirm.linger.ms": (0, 60_000, (), True, False),
    "producer.batch.size": (1, 2_147_483_647, (), True, False),
    "producer.max.inflight.bytes": (1024, 2_147_483_647, (), True, False),
    "flush.timeout.ms": (1, DAY_MS, (), True, False),
    "metrics.prometheus.port": (0, 65_535, (), True, False),
    "sidecar.processes": (1, 64, (), True, False),
    "sidecar.processes.port.base": (0, 65_535, (), True, False),
    "shutdown.grace.ms": (0, 3_600_000, (), True, False),
    "jobs.max.live": (1, MILLION, (), True, False),
    "job.idle.timeout.ms": (1000, 30 * DAY_MS, (), True, False),
    "status.ended.runs.max": (0, 10_000, (), True, False),
}


def _text(v: float, integer: bool) -> str:
    return str(int(v)) if integer else repr(float(v))


def _parse(name: str, raw: str):
    return config.parse({name: raw})[name]


def _refused(name: str, raw: str) -> None:
    with pytest.raises(ConfigError) as err:
        _parse(name, raw)
    assert name in str(err.value), str(err.value)


def test_every_ranged_property_is_listed():
    ranged = {n for n, p in config.PROPERTIES.items() if hasattr(p.parse, "range")}
    assert ranged == set(RANGES), (
        f"not listed here: {sorted(ranged - set(RANGES))}; "
        f"no longer ranged: {sorted(set(RANGES) - ranged)}")


@pytest.mark.parametrize("name", sorted(RANGES))
def test_both_bounds_are_accepted_and_the_next_value_past_each_is_refused(name):
    lo, hi, extra, integer, optional = RANGES[name]
    assert _parse(name, _text(lo, integer)) == lo
    assert _parse(name, _text(hi, integer)) == hi
    if integer:
        below, above = lo - 1, hi + 1
    else:  # the nearest floats outside the range
        below, above = math.nextafter(lo, -math.inf), math.nextafter(hi, math.inf)
    for past in (below, above):
        if past not in extra:
            _refused(name, _text(past, integer))
    _refused(name, _text(hi * 2 + 1, integer))
    for v in extra:  # the "no limit" values, and not their neighbours
        assert _parse(name, _text(v, integer)) == v
        for near in ((v - 1, v + 1) if integer else (v - 0.5, v + 0.5)):
            if not lo <= near <= hi and near not in extra:
                _refused(name, _text(near, integer))
    if optional:
        assert _parse(name, "") is None
    else:
        _refused(name, "")
    if integer:
        _refused(name, _text(lo, False) + "5")  # not an integer


@pytest.mark.parametrize("name", ["listen.address", "health.listen.address"])
def test_listen_ports_range_over_0_to_65535(name):
    for port in (0, 65535):
        assert _parse(name, f"127.0.0.1:{port}") == f"127.0.0.1:{port}"
    for port in ("-1", "65536"):
        _refused(name, f"127.0.0.1:{port}")


def test_socket_mode_ranges_over_0000_to_0777():
    assert _parse("listen.unix.socket.mode", "0000") == 0
    assert _parse("listen.unix.socket.mode", "0777") == 0o777
    for bad in ("1000", "-1", "0778"):
        _refused("listen.unix.socket.mode", bad)
