"""Every exported metric is documented with its KIP name."""


from spillway.sidecar.observability.telemetry import METRICS
from support import paths
from support.deciding import decisions

DOC = (paths.DOCS / "OBSERVABILITY.md").read_text()


def test_every_metric_is_in_the_mapping_table():
    for kip, (name, *_rest) in METRICS.items():
        assert f"| `{kip}` | `{name}` |" in DOC, f"{kip} -> {name} missing from OBSERVABILITY.md"


def test_prometheus_names_follow_the_otel_rules():
    from spillway.sidecar.observability.telemetry import prometheus_name

    assert prometheus_name("spillway.record.failures", "counter", "{failure}") == \
        "spillway_record_failures_total"
    assert prometheus_name("spillway.last_error.timestamp", "gauge", "s") == \
        "spillway_last_error_timestamp_seconds"
    assert prometheus_name("spillway.spool.size", "gauge", "By") == "spillway_spool_size_bytes"
    for _kip, (name, kind, unit, _desc) in METRICS.items():
        prom = prometheus_name(name, kind, unit)
        assert f"| `{prom}` | {kind} |" in DOC, f"{prom} missing from OBSERVABILITY.md"


def _engine_with_failures():
    from spillway.sidecar.core.model import (
        ExceptionInfo,
        FailedRecord,
        Stage,
        StageRef,
        TaskIdentity,
    )
    from spillway.sidecar.core.policy import PolicyEngine
    from support.fakes import FakeClock, FakeRng

    eng = PolicyEngine(clock=FakeClock(), rng=FakeRng())
    exc = ExceptionInfo("builtins.ValueError", ("builtins.ValueError",), "bad")
    eng.register_job("j", {"errors.tolerance": "all", "errors.log.enable": "false"})
    for p in range(3):
        decisions(eng, "j", TaskIdentity(stage_id=1, partition_id=p, attempt_number=0,
                                     task_attempt_id=p),
                   [FailedRecord(record_id=f"r{p}", stage=StageRef(Stage.TRANSFORMATION),
                                 exception=exc)])
    return eng


def test_rows_have_no_task_label_unless_asked_for():
    eng = _engine_with_failures()
    rows = [r for r in eng.metric_rows() if r[0] == "total-record-failures"]
    assert rows == [("total-record-failures", {"job": "j", "stage": "TRANSFORMATION"}, 3)]
    by_task = [r for r in eng.metric_rows(task_label=True) if r[0] == "total-record-failures"]
    assert sorted(r[1]["task"] for r in by_task) == ["1.0", "1.1", "1.2"]
    assert sum(r[2] for r in by_task) == 3


def test_render_is_the_prometheus_text_format():
    from prometheus_client.parser import text_string_to_metric_families
    from spillway.sidecar.observability.prometheus import render
    from spillway.sidecar.observability.telemetry import Telemetry

    eng = _engine_with_failures()
    tel = Telemetry()
    tel.add_source(eng.metric_rows)
    tel.record_verdict_duration(0.0003)
    tel.record_verdict_duration(20.0)
    fams = {f.name: f for f in text_string_to_metric_families(render(tel))}
    assert [s.value for s in fams["spillway_record_failures"].samples] == [3.0]
    hist = {s.labels.get("le"): s.value for s in fams["spillway_verdict_duration_seconds"].samples
            if s.name.endswith("_bucket")}
    assert hist["0.00025"] == 0 and hist["0.0005"] == 1 and hist["10.0"] == 1
    assert hist["+Inf"] == 2


def test_otlp_instruments_carry_the_same_rows_and_second_buckets():
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    from spillway.sidecar.observability.telemetry import (
        VERDICT_DURATION_BOUNDARIES,
        Telemetry,
        register_instruments,
    )

    reader = InMemoryMetricReader()
    meter = MeterProvider(metric_readers=[reader]).get_meter("t")
    tel = Telemetry()
    tel.add_source(_engine_with_failures().metric_rows)
    register_instruments(meter, tel)
    tel.verdict_duration = meter.create_histogram(
        "spillway.verdict.duration", unit="s",
        explicit_bucket_boundaries_advisory=list(VERDICT_DURATION_BOUNDARIES))
    tel.record_verdict_duration(0.002)
    data = reader.get_metrics_data()
    points = {m.name: m.data.data_points for rm in data.resource_metrics
              for sm in rm.scope_metrics for m in sm.metrics}
    [failures] = points["spillway.record.failures"]
    assert failures.value == 3 and dict(failures.attributes) == {"job": "j",
                                                                 "stage": "TRANSFORMATION"}
    [hist] = points["spillway.verdict.duration"]
    assert tuple(hist.explicit_bounds) == VERDICT_DURATION_BOUNDARIES
    assert hist.bucket_counts[VERDICT_DURATION_BOUNDARIES.index(0.0025)] == 1
