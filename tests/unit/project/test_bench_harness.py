"""The benchmark harness's own logic: statistics, alternation order, target evaluation, report
rendering, aggregation of client results, profile reduction. Nothing here is timed."""

from __future__ import annotations

import json
import os
import sys
from collections import Counter

import pytest

from support import paths

ROOT = str(paths.ROOT)
if ROOT not in sys.path:  # `pytest` run directly rather than `python -m pytest` from the root
    sys.path.insert(0, ROOT)

from bench import report, stats  # noqa: E402
from bench.clients import aggregate  # noqa: E402
from bench.infra import BenchError  # noqa: E402
from bench.model import (  # noqa: E402
    STATUS_ERROR,
    STATUS_NOT_RUN,
    Check,
    Figure,
    ProfileSection,
    TargetResult,
    absolute_check,
    alternate,
    ratio_check,
    verdict_text,
)
from bench.profiling import (  # noqa: E402
    parse_raw,
    short_frame,
    spillway_frames,
    summarize,
    top_frames,
)
from bench.records import VALUE_SIZE, value_bytes  # noqa: E402
from bench.runner import (  # noqa: E402
    Context,
    Sizes,
    TargetSpec,
    missing_prerequisite,
    run_target,
    select,
)
from bench.workloads import poison_every, value_sql  # noqa: E402

# --- statistics ------------------------------------------------------------------------------


def test_median_odd_and_even_counts():
    assert stats.median([3, 1, 2]) == 2
    assert stats.median([4, 1, 3, 2]) == 2.5
    assert stats.median([7]) == 7


@pytest.mark.parametrize("bad", [[], [1.0, float("nan")]])
def test_median_refuses_empty_and_nan(bad):
    with pytest.raises(ValueError):
        stats.median(bad)


def test_percentile_interpolates_between_closest_ranks():
    xs = list(range(1, 101))  # 1..100
    assert stats.percentile(xs, 0) == 1
    assert stats.percentile(xs, 100) == 100
    assert stats.percentile(xs, 50) == pytest.approx(50.5)
    assert stats.percentile(xs, 99) == pytest.approx(99.01)
    assert stats.percentile([5.0], 99) == 5.0
    with pytest.raises(ValueError):
        stats.percentile(xs, 101)


def test_summary_and_spread():
    s = stats.Summary.of([10, 12, 8, 11, 9])
    assert (s.median, s.low, s.high, s.n) == (10, 8, 12, 5)
    assert s.spread == pytest.approx(0.4)


def test_ratio_and_paired_ratios():
    assert stats.ratio(3, 2) == 1.5
    with pytest.raises(ZeroDivisionError):
        stats.ratio(1, 0)
    assert stats.paired_ratios([2, 4], [1, 2]) == [2.0, 2.0]
    with pytest.raises(ValueError):
        stats.paired_ratios([1, 2], [1])


# --- alternation -------------------------------------------------------------------------------


def test_alternate_is_round_robin():
    assert alternate(["A", "B"], 3) == ["A", "B", "A", "B", "A", "B"]
    assert alternate(["A", "B", "C"], 2) == ["A", "B", "C", "A", "B", "C"]


def test_alternate_warmup_adds_one_leading_round():
    assert alternate(["base", "cand"], 2, warmup=True) == ["base", "cand"] * 3


def test_alternate_never_runs_a_variant_twice_in_a_row():
    order = alternate(["base", "cand"], 5, warmup=True)
    assert all(a != b for a, b in zip(order, order[1:]))
    assert Counter(order) == {"base": 6, "cand": 6}


@pytest.mark.parametrize("variants,runs", [([], 3), (["A", "A"], 2), (["A"], 0)])
def test_alternate_refuses_bad_arguments(variants, runs):
    with pytest.raises(ValueError):
        alternate(variants, runs)


# --- target evaluation ---------------------------------------------------------------------


def test_check_met_for_each_operator():
    assert Check("x", 0.5, ">=", 0.5).met is True
    assert Check("x", 0.49, ">=", 0.5).met is False
    assert Check("x", 1.03, "<=", 1.03).met is True
    assert Check("x", 100.0, "<", 100.0, kind="absolute").met is False
    assert Check("x", 0.0, "==", 0.0, kind="absolute").met is True
    assert Check("x", None, ">=", 1.0).met is None


def test_check_refuses_unknown_operator_and_kind():
    with pytest.raises(ValueError):
        Check("x", 1.0, "=>", 1.0)
    with pytest.raises(ValueError):
        Check("x", 1.0, ">=", 1.0, kind="percent")


def test_ratio_check_uses_medians_and_keeps_paired_spread():
    base = Figure("bare", "s", [10.0, 11.0, 12.0])
    cand = Figure("wrapped", "s", [10.5, 11.0, 13.2])
    c = ratio_check("wrapped vs bare", cand, base, "<=", 1.03)
    assert c.value == pytest.approx(1.0)
    assert c.met is True
    assert c.spread == pytest.approx((1.0, 1.1))
    assert "median wrapped 11.0 s / median bare 11.0 s" in c.detail


def test_ratio_check_throughput_miss():
    plain = Figure("plain", "records/s", [100_000.0, 110_000.0, 90_000.0])
    e2e = Figure("e2e", "records/s", [30_000.0, 35_000.0, 25_000.0])
    c = ratio_check("rate", e2e, plain, ">=", 0.5)
    assert c.value == pytest.approx(0.3)
    assert c.met is False


def test_target_result_met_combines_checks():
    r = TargetResult("k", 1, "t")
    assert r.met is None  # nothing judged
    r.checks.append(absolute_check("errors", 0.0, "==", 0.0, "errors"))
    assert r.met is True
    r.checks.append(Check("ratio", 0.7, ">=", 0.8))
    assert r.met is False
    assert verdict_text(r) == "missed"
    skipped = TargetResult("k", 2, "t", status=STATUS_NOT_RUN, reason="spillway.spark missing")
    assert skipped.met is None
    assert verdict_text(skipped) == "not run: spillway.spark missing"


def test_figure_lookup_reuses_figures_by_name():
    r = TargetResult("k", 1, "t")
    f = r.figure("a", "s")
    assert r.figure("a", "s") is f
    assert len(r.figures) == 1


# --- report --------------------------------------------------------------------------------


def _results():
    ok = TargetResult("rpc", 2, "RPC batching", setup="How it was measured.")
    single = Figure("1 record/report", "records/s", [1000.0, 1100.0, 900.0])
    batched = Figure("256 records/report", "records/s", [60_000.0, 55_000.0, 50_000.0])
    ok.figures += [single, batched]
    ok.checks.append(ratio_check("256 vs 1", batched, single, ">=", 50.0))
    ok.checks.append(absolute_check("errors | all runs", 0.0, "==", 0.0, "errors"))
    ok.notes.append("a note")
    missed = TargetResult("memory", 7, "Memory")
    missed.figures.append(Figure("peak RSS", "MB", [250.0]))
    missed.checks.append(absolute_check("peak RSS", 250.0, "<=", 200.0, "MB"))
    missed.profiles.append(ProfileSection("sidecar", 1000, [("f (a/b.py)", 0.25)],
                                          [("g (a/c.py)", 0.5)], diagnosis="too much held"))
    absent = TargetResult("happy-path", 3, "Happy path", status=STATUS_NOT_RUN,
                          reason="spillway.spark:Job.udf does not exist yet")
    broken = TargetResult("tracing", 6, "Tracing", status=STATUS_ERROR, reason="BenchError: x")
    return [ok, missed, absent, broken]


def test_render_has_machine_summary_and_sections():
    text = report.render(_results(), {"cores": "2", "CPU": "test cpu"}, date="2026-01-01",
                         command="python -m bench --short", mode="short", seconds=90, runs=3,
                         method_notes=["ABAB"])
    assert text.startswith("# Benchmarks\n")
    assert "| cores | 2 |" in text
    assert "python -m bench --short" in text and "2026-01-01" in text
    assert "- ABAB" in text
    # summary: one row per check, with the verdict
    assert "| 2 | RPC batching | 256 vs 1: 55.0× | >= 50.0× | met |" in text
    assert "| 7 | Memory | peak RSS: 250 MB | <= 200 MB | MISSED |" in text
    assert "| 3 | Happy path | — | — | not run: spillway.spark:Job.udf does not exist yet |" \
        in text
    assert "error: BenchError: x" in text
    # sections
    assert "## 2. RPC batching — met" in text
    assert "| 1 record/report | records/s | 1,000 | 900 | 1,100 | 3 |" in text
    assert "## 7. Memory — missed" in text
    assert "Reading: too much held" in text
    assert "| 25.0% | f (a/b.py) |" in text
    # a pipe inside a cell does not break the table
    assert "errors \\| all runs" in text


def test_render_without_results_is_still_a_document():
    text = report.render([], {}, date="d", command="c", mode="full", seconds=0, runs=5)
    assert "## Summary" in text
    assert text.endswith("\n")


# --- client aggregation ------------------------------------------------------------------------


def _client(t0, t1, records, lat, errors=0, acked=None):
    return {"records": records, "reports": len(lat), "errors": errors, "error_samples": [],
            "actions": {"ACTION_SKIP": records}, "dead_lettered": 0, "acked": acked,
            "t0": t0, "t_reported": t1 - 0.1, "t1": t1, "lat_s": lat, "timed_out": False}


def test_aggregate_takes_the_whole_window_and_all_latencies():
    agg = aggregate([_client(10.0, 12.0, 1000, [0.010] * 99 + [0.100], acked=1000),
                     _client(10.5, 13.0, 1000, [0.010] * 100, acked=1000)])
    assert agg.records == 2000
    assert agg.seconds == pytest.approx(3.0)
    assert agg.rate == pytest.approx(2000 / 3.0)
    assert agg.p50_ms == pytest.approx(10.0)
    assert agg.max_ms == pytest.approx(100.0)
    assert agg.acked == 2000
    assert agg.reports == 200


def test_aggregate_unknown_acks_and_failed_clients():
    agg = aggregate([_client(0, 1, 10, [0.1]), _client(0, 1, 10, [0.1], acked=10)])
    assert agg.acked is None
    with pytest.raises(BenchError, match="boom"):
        aggregate([{"error": "boom"}])
    with pytest.raises(ValueError):
        aggregate([])


# --- profiles ------------------------------------------------------------------------------


RAW = """\
<module> (bench.py:1);main (/x/site-packages/app/server.py:10);decide (/x/app/core/policy.py:20) 30
<module> (bench.py:1);main (/x/site-packages/app/server.py:10);commit (/x/app/dlq/spool.py:5) 60
<module> (bench.py:1);main (/x/site-packages/app/server.py:12) 10
garbage line
"""


def test_parse_raw_and_top_frames():
    stacks = parse_raw(RAW)
    assert sum(stacks.values()) == 100
    total, own, incl = top_frames(stacks, 3)
    assert total == 100
    assert own[0] == ("commit (dlq/spool.py)", 0.6)
    assert ("decide (core/policy.py)", 0.3) in own
    assert incl[0] == ("main (app/server.py)", 1.0)  # lines merged, <module> skipped
    assert all("<module>" not in f for f, _ in incl)


def test_spillway_frames_and_summary():
    stacks = parse_raw(
        "run (/x/threading.py:1);report (/r/sidecar/src/spillway/sidecar/server.py:9);"
        "decide (/r/sidecar/src/spillway/sidecar/core/policy.py:3) 3\n"
        "run (/x/threading.py:1);_status (/x/site-packages/grpc/_server.py:5) 1\n"
        "run (/x/threading.py:1);Parse (/r/client/src/spillway/v1/sidecar_pb2.py:5) 1\n")
    assert spillway_frames(stacks) == [("decide (core/policy.py)", 0.6)]
    assert "60% of the samples run under spillway code" in summarize(stacks)
    assert "`decide (core/policy.py)` 60%" in summarize(stacks)
    assert "no spillway frame" in summarize(parse_raw("f (/x/grpc/a.py:1) 5"))
    # py-spy's own short paths, relative to the spillway namespace package
    relative = parse_raw('process 7:"python -m pyspark.daemon";main (worker.py:1);'
                         "Engine.run_rows (spark/_engine.py:210) 4\n"
                         "main (worker.py:1);loads (json/__init__.py:3) 1\n")
    assert spillway_frames(relative) == [("Engine.run_rows (spark/_engine.py)", 0.8)]
    total, own, incl = top_frames(relative)
    assert all(not f.startswith("process ") for f, _ in own + incl)


def test_short_frame_cuts_paths_and_lines():
    assert (short_frame("run (/usr/lib/python3.11/threading.py:982)")
            == "run (python3.11/threading.py)")
    assert short_frame("weird") == "weird"


def test_top_frames_of_nothing():
    assert top_frames(Counter()) == (0, [], [])


# --- runner ------------------------------------------------------------------------------------


def _spec(key, number, run=lambda ctx, r: None, requires=()):
    return TargetSpec(key, number, key.title(), run, requires)


def test_select_by_name_and_number_in_report_order():
    specs = [_spec("a", 1), _spec("b", 2), _spec("c", 3)]
    assert [s.key for s in select(specs, None)] == ["a", "b", "c"]
    assert [s.key for s in select(specs, "3,a")] == ["a", "c"]
    assert [s.key for s in select(specs, "b,2")] == ["b"]
    with pytest.raises(ValueError, match="unknown target 'z'"):
        select(specs, "z")


def test_missing_prerequisite_names_what_is_missing():
    assert missing_prerequisite(["json", "json:loads"]) is None
    assert "no_such_module_xyz is not importable" in missing_prerequisite(
        ["no_such_module_xyz"])
    assert missing_prerequisite(["json:nope.deeper"]) == "json:nope.deeper does not exist yet"


class _Ended:
    """An Infra stand-in that counts the targets it was told ended."""

    def __init__(self) -> None:
        self.ended = 0

    def end_target(self) -> None:
        self.ended += 1


def _ctx():
    return Context(infra=_Ended(), sizes=Sizes.short(), short=True, log=lambda m: None)


def test_run_target_reports_not_run_instead_of_crashing():
    r = run_target(_spec("a", 1, requires=("no_such_module_xyz",)), _ctx())
    assert r.status == STATUS_NOT_RUN
    assert "no_such_module_xyz" in r.reason


def test_run_target_isolates_a_failing_target():
    def boom(ctx, result):
        raise BenchError("the sidecar did not start\nlog follows")

    ctx = _ctx()
    r = run_target(_spec("a", 1, run=boom), ctx)
    assert ctx.infra.ended == 1   # what it started stops with it, the broker too
    assert r.status == STATUS_ERROR
    assert r.reason == "BenchError: the sidecar did not start"
    assert any("traceback" in n for n in r.notes)


def test_sizes_short_is_smaller_than_full():
    full, short = Sizes.full(), Sizes.short()
    assert full.runs >= 5 and full.happy_rows >= 5_000_000 and full.memory_records == 1_000_000
    for name, value in short.__dict__.items():
        if isinstance(value, int) and not isinstance(value, bool):
            assert value <= getattr(full, name), name


# --- workloads -----------------------------------------------------------------------------


def test_poison_every():
    assert poison_every(1) == 100
    assert poison_every(10) == 10
    assert poison_every(100) == 1
    assert poison_every(0) == 0
    with pytest.raises(ValueError):
        poison_every(3)


def test_value_sql_shapes():
    assert "CASE WHEN id % 10 = 0" in value_sql(10)
    assert "CASE" not in value_sql(0) and "CASE" not in value_sql(1)


def test_values_are_200_bytes_of_poison():
    v = value_bytes(12345)
    assert len(v) == VALUE_SIZE
    with pytest.raises(json.JSONDecodeError):
        json.loads(v)


# --- merging reports -------------------------------------------------------------------------


def test_report_embeds_results_that_round_trip():
    results = _results()
    results[0].measured = "2026-01-01 00:00 UTC, full run"
    results[0].notes.append("a -- dashed note")  # '--' must not end the HTML comment early
    text = report.render(results, {}, date="d", command="c", mode="full", seconds=1, runs=5)
    back = report.embedded_results(text)
    assert [r.key for r in back] == [r.key for r in results]
    assert back[0].measured == "2026-01-01 00:00 UTC, full run"
    assert back[0].checks[0].value == results[0].checks[0].value
    assert back[0].checks[0].spread == results[0].checks[0].spread
    assert back[0].figures[1].values == results[0].figures[1].values
    assert back[1].profiles[0].self_frames == [("f (a/b.py)", 0.25)]
    assert "a -- dashed note" in back[0].notes
    assert "_Measured 2026-01-01 00:00 UTC, full run._" in text


def test_embedded_results_of_a_report_without_them():
    assert report.embedded_results("# Benchmarks\n") == []
    assert report.embedded_results("<!-- bench-results\nnot json\n-->") == []


def test_merge_replaces_only_the_rerun_targets():
    old = _results()
    new = [TargetResult("memory", 7, "Memory", measured="later")]
    merged = report.merge(old, new)
    assert [r.number for r in merged] == [2, 3, 6, 7]
    assert next(r for r in merged if r.number == 7).measured == "later"


# --- peers (issue 14) ------------------------------------------------------------------------


def test_peer_producer_is_what_a_careful_user_configures():
    from bench.peers import producer_conf

    conf = producer_conf("h:9092", linger_ms=20, batch_size=1_000_000)
    assert conf["enable.idempotence"] is True and conf["acks"] == "all"
    assert (conf["linger.ms"], conf["batch.size"]) == (20, 1_000_000)


def test_peer_error_headers_carry_error_and_coordinates():
    from bench.peers import error_headers

    h = dict(error_headers("json.decoder.JSONDecodeError", "x" * 5000, "orders", 3, 42))
    assert h == {"error.class": b"json.decoder.JSONDecodeError", "error.message": b"x" * 1000,
                 "source.topic": b"orders", "source.partition": b"3", "source.offset": b"42"}
    assert [k for k, _ in error_headers("E", "m")] == ["error.class", "error.message"]


def test_peer_clean_partitions_need_no_producer():
    pa = pytest.importorskip("pyarrow")
    from bench.peers import kafka_batches, values_partition
    from bench.workloads import OUT_NAMES, parse_order

    good = [b'{"order_id": %d, "amount": 2.0}' % i for i in range(3)]
    # An unreachable broker: a producer built for a clean partition would fail the flush.
    conf = {"bootstrap.servers": "127.0.0.1:1"}
    assert list(values_partition(conf, "t", parse_order, iter(good))) == [
        (i, pytest.approx(2.2)) for i in range(3)]
    batch = pa.RecordBatch.from_pydict({"key": [b"k"] * 3, "value": good, "topic": ["o"] * 3,
                                        "partition": [0] * 3, "offset": [0, 1, 2]})
    out = list(kafka_batches(conf, "t", parse_order, OUT_NAMES, iter([batch])))
    assert out[0].column_names == OUT_NAMES and out[0].column("order_id").to_pylist() == [0, 1, 2]


def test_peer_b_schema_adds_the_corrupt_record_column():
    from bench.peers import CORRUPT_COLUMN, json_schema_with_corrupt

    assert json_schema_with_corrupt("a long") == f"a long, {CORRUPT_COLUMN} string"


def test_native_probe_says_why_the_fast_path_is_absent():
    from bench.targets.deser import native_missing

    class Before:  # job.deserialize before the native fast path: value must be a function
        def deserialize(self, df, *, value, value_type):
            raise TypeError("value: expected a function, got str")

    class After:
        def deserialize(self, df, *, value, value_type):
            return df

    assert "does not exist yet" in native_missing(Before(), object())
    assert "expected a function" in native_missing(Before(), object())
    assert native_missing(After(), object()) is None


def test_target_10_is_listed_after_the_others():
    from bench.targets import TARGETS

    assert [t.number for t in TARGETS] == list(range(1, 12))
    assert select(TARGETS, "native-deser")[0].number == 10


# --- CPU per record (target 11) ----------------------------------------------------------------

# /proc/<pid>/stat of a process whose command name holds a space and a parenthesis
STAT = ("4242 (spillway (serve) x) S 1 4242 4242 0 -1 4194560 2000 0 0 0 "
        "250 75 0 0 20 0 33 0 123456 1000000 5000 18446744073709551615 0 0 0 0 0 0 0 0 0 0 0")


def test_parse_stat_cpu_counts_fields_after_the_command_name():
    from bench.cpu import parse_stat_cpu

    assert parse_stat_cpu(STAT, 100) == pytest.approx(3.25)  # (250 + 75) ticks / 100
    assert parse_stat_cpu(STAT, 250) == pytest.approx(1.3)


@pytest.mark.parametrize("text", ["", "4242 spillway S 1 2", "4242 (x) S 1 2 3",
                                  STAT.replace(" 250 75 ", " 250 ab ")])
def test_parse_stat_cpu_refuses_what_is_not_a_stat_line(text):
    from bench.cpu import parse_stat_cpu

    with pytest.raises(ValueError, match="stat"):
        parse_stat_cpu(text, 100)


def test_cpu_seconds_reads_this_process_own_counters():
    from bench.cpu import cpu_seconds, snapshot

    before = snapshot([os.getpid()])[os.getpid()]
    sum(i * i for i in range(200_000))  # burn a little CPU: the counter cannot go back
    assert cpu_seconds(os.getpid()) >= before >= 0.0


def test_cpu_used_sums_the_chosen_processes_and_refuses_gaps():
    from bench.cpu import cpu_used

    before, after = {1: 1.0, 2: 2.0, 3: 0.5}, {1: 1.5, 2: 2.25, 3: 0.5}
    assert cpu_used(before, after) == pytest.approx(0.75)
    assert cpu_used(before, after, [2]) == pytest.approx(0.25)
    with pytest.raises(ValueError, match="process 4"):
        cpu_used(before, after, [4])
    with pytest.raises(ValueError, match="went back"):
        cpu_used({1: 2.0}, {1: 1.0})


def test_us_per_record_and_the_one_core_ceiling():
    from bench.cpu import per_core_ceiling, us_per_record

    assert us_per_record(0.5, 25_000) == pytest.approx(20.0)
    assert per_core_ceiling(20.0) == pytest.approx(50_000.0)
    assert per_core_ceiling(2.0) == pytest.approx(500_000.0)  # issue 24's home target
    with pytest.raises(ValueError, match="records"):
        us_per_record(1.0, 0)
    with pytest.raises(ValueError, match="us"):
        per_core_ceiling(0.0)


def test_cluster_nodes_listen_on_their_own_loopback_address():
    from bench.targets.cluster import node_listen

    assert [node_listen(i) for i in range(3)] == ["127.0.0.2:0", "127.0.0.3:0", "127.0.0.4:0"]
    with pytest.raises(ValueError, match="index"):
        node_listen(253)


def test_cluster_clients_spread_round_robin_over_the_nodes():
    from bench.targets.cluster import node_of_client

    assert [node_of_client(c, 2) for c in range(4)] == [0, 1, 0, 1]
    assert [node_of_client(c, 1) for c in range(4)] == [0, 0, 0, 0]
    assert [node_of_client(c, 4) for c in range(4)] == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="nodes"):
        node_of_client(0, 0)


def test_cluster_run_figures_per_record_and_home_busy_share():
    from bench.targets.cluster import ClusterRun

    run = ClusterRun(records=50_000, report_s=5.0, home_cpu_s=1.25, node_cpu_s=4.0,
                     client_cpu_s=1.0, broker_cpu_s=0.25)
    m = run.per_record()
    assert m["home_us"] == pytest.approx(25.0) and m["node_us"] == pytest.approx(80.0)
    assert m["client_us"] == pytest.approx(20.0) and m["broker_us"] == pytest.approx(5.0)
    assert m["home_rate"] == pytest.approx(10_000.0)
    assert m["home_busy"] == pytest.approx(0.25)  # a quarter of one core while deciding
    with pytest.raises(ValueError, match="report_s"):
        ClusterRun(records=1, report_s=0.0, home_cpu_s=0, node_cpu_s=0,
                   client_cpu_s=0).per_record()


def test_the_broker_is_started_once_when_many_threads_ask_for_it(monkeypatch, tmp_path):
    import threading
    import time

    from spillway.sidecar.runtime import embedded

    from bench import infra

    started = []

    class OneBroker:
        def __init__(self, log_path=None):
            self.log_path = log_path

        def start(self):
            time.sleep(0.05)  # a real start takes a while: every thread asks meanwhile
            started.append(self)
            return self

    monkeypatch.setattr(embedded, "EmbeddedBroker", OneBroker)
    box = infra.Infra(workdir=str(tmp_path))
    seen = []
    threads = [threading.Thread(target=lambda: seen.append(box.broker)) for _ in range(5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(started) == 1 and all(b is started[0] for b in seen)


def test_a_target_ends_with_its_closers_and_broker_and_the_next_gets_a_fresh_one(
        monkeypatch, tmp_path):
    from spillway.sidecar.runtime import embedded

    from bench import infra

    events = []

    class Broker:
        def __init__(self, log_path=None):
            events.append("start")

        def start(self):
            return self

        def resume(self):
            pass

        def stop(self):
            events.append("stop")

    monkeypatch.setattr(embedded, "EmbeddedBroker", Broker)
    box = infra.Infra(workdir=str(tmp_path), keep_workdir=True)
    first = box.broker
    box.on_close(lambda: events.append("closer"))
    box.end_target()
    assert events == ["start", "closer", "stop"]
    assert box.broker is not first and events[-1] == "start"
    box.end_target()
    box.close()                       # nothing left to stop twice
    assert events == ["start", "closer", "stop", "start", "stop"]


def test_cpu_children_are_the_live_child_processes(tmp_path):
    import subprocess
    import sys

    from bench import cpu

    kids = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
            for _ in range(2)]
    try:
        assert set(p.pid for p in kids) <= set(cpu.children(os.getpid()))
    finally:
        for p in kids:
            p.kill()
            p.wait()
    assert not set(p.pid for p in kids) & set(cpu.children(os.getpid()))


def test_the_executor_side_is_the_median_of_the_rounds_own_differences():
    """Target 4's reading: alternated rounds share the machine's moment, so the executor side
    is the median of each round's difference, not the difference of the medians."""
    from bench.targets.spark_jobs import _executor_reading

    r = TargetResult("k", 4, "t")
    bare, peer, cand, side = (r.figure(n, "µs") for n in ("bare", "peer", "cand", "side"))
    for b, p, c, s in ((10, 11, 12, 40), (50, 50, 55, 41), (30, 33, 45, 42)):
        bare.add(b), peer.add(p), cand.add(c), side.add(s)
    text = _executor_reading(10.0, bare, peer, cand, side)
    assert "costs 5.0 µs above catch-and-drop" in text      # diffs 2, 5, 15 (medians: 15)
    assert "dead-lettering (a) 1.0 µs" in text and "spends 41.0 µs" in text


def test_the_process_tree_counts_a_childs_cpu_and_its_reaped_children():
    """bench.proctree: a child's CPU is the harness's own, not "other" (nothing timed: only that
    the tree's CPU grows by at least what the child reports for itself)."""
    import subprocess

    from bench import proctree

    tree = proctree.TreeCpu(lambda: (os.getpid(),), interval_s=0.05).start()
    child = subprocess.run([sys.executable, "-c", "import os,time\nt=time.process_time()\n"
                            "while time.process_time()-t<0.3: pass\nprint(sum(os.times()[:2]))"],
                           capture_output=True, text=True, check=True)
    assert tree.stop() >= float(child.stdout) - 0.02


def test_a_worker_its_parent_does_not_wait_for_keeps_its_cpu_in_the_tree():
    """As a PySpark daemon's: SIGCHLD ignored, the kernel reaps the worker and its CPU reaches
    no counter; the tree read on a thread keeps it (the end-only reading lost it: a negative
    "CPU per row" in bench target 3)."""
    import subprocess

    from bench import proctree

    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.4: pass"
    daemon = subprocess.Popen([sys.executable, "-c", (
        "import signal, subprocess, sys, time\n"
        "signal.signal(signal.SIGCHLD, signal.SIG_IGN)\n"
        "sys.stdin.readline()\n"     # the worker starts after the tree's first reading
        f"p = subprocess.Popen([sys.executable, '-c', {burn!r}])\n"
        # with SIGCHLD ignored, wait() returns once the kernel reaped the worker (ECHILD)
        "p.wait()\nprint('gone', flush=True)\ntime.sleep(30)")],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        tree = proctree.TreeCpu(lambda: (daemon.pid,), interval_s=0.05).start()
        daemon.stdin.write("go\n")
        daemon.stdin.flush()
        assert daemon.stdout.readline().strip() == "gone"
        assert proctree.ignores_sigchld(daemon.pid)
        assert 0.3 <= tree.stop() < 1.0
    finally:
        daemon.kill()
        daemon.wait()


def _st(ppid, start, own, reaped=0):
    from bench.proctree import Stat
    return Stat(ppid, start, own, reaped)


def test_the_tally_of_a_tree_counts_each_process_once():
    """Made-up readings: a waited-for child that exits is counted once (its last reading is
    already in the parent's reaped CPU); one the kernel reaped keeps its last reading; one that
    existed at the baseline counts from there; a pid reused by another process is another."""
    from bench.proctree import Tally

    t = Tally()
    never = lambda pid: False     # noqa: E731 - no parent ignores SIGCHLD
    t.scan([1], {1: _st(0, 10, 100), 2: _st(1, 20, 50), 9: _st(0, 5, 999)}, never,
           baseline=True)
    t.scan([1], {1: _st(0, 10, 110), 2: _st(1, 20, 70), 3: _st(1, 30, 5)}, never)
    assert t.ticks() == 10 + 20 + 5
    # 2 exits, waited for: parent's reaped CPU gets its whole 75 (50 before the baseline)
    t.scan([1], {1: _st(0, 10, 120, 75), 3: _st(1, 30, 8)}, never)
    assert t.ticks() == 20 + 25 + 8                  # 1: +20, 2: 70-50 then 75-70, 3: 8
    # pid 3 reused by a new process of the tree, after the old one was kernel-reaped
    t.scan([1], {1: _st(0, 10, 120, 75), 3: _st(1, 40, 4)}, lambda pid: True)
    assert t.ticks() == 20 + 25 + 8 + 4


def test_a_stat_line_with_parentheses_in_the_command_name_is_read():
    from bench.proctree import parse_stat

    fields = " ".join(["S", "77"] + ["0"] * 9 + ["5", "6", "7", "8"] + ["0"] * 4 + ["123"]
                      + ["0"] * 20)
    st = parse_stat(f"4242 (a) (b) {fields}\n")
    assert (st.ppid, st.own, st.reaped, st.start) == (77, 11, 15, 123)
    with pytest.raises(ValueError, match="stat"):
        parse_stat("4242 (x) S 1 2 3")


def test_a_full_run_on_a_busy_machine_is_refused_unless_allowed(monkeypatch, capsys):
    from bench import cli, load

    monkeypatch.setattr(load, "sample", lambda *a: load.Busy(5.0, 5.0, 1.5, 1.6))
    assert cli.main(["--only", "1"]) == 2
    err = capsys.readouterr().err
    assert "busy" in err and "--allow-busy" in err and "1.00 cores" in err


def test_the_cluster_target_reports_as_an_executor_does_by_default():
    """Target 11's clients send reports of the size an executor's Job sends by default."""
    import inspect

    from bench.targets import cluster
    from spillway.spark import Job

    assert cluster.BATCH == inspect.signature(Job).parameters["report_batch_size"].default


@pytest.mark.parametrize("comm, role", [
    ("rpc_0", "rpc_N"), ("rpc_12", "rpc_N"), ("confirm-call_3", "confirm-call_N"),
    ("dlq-drain", "dlq-drain"), ("spool-writer", "spool-writer"), ("handler-2", "handler-N"),
    ("rdk:broker111", "librdkafka"), ("rdk:main", "librdkafka"), ("event_engine", "gRPC"),
    ("lifeguard", "gRPC"), ("Thread-1 (_serv", "gRPC"), ("python", "python"),
])
def test_a_threads_role_is_its_os_name_with_pools_and_libraries_together(comm, role):
    from bench import cpu

    assert cpu.thread_role(comm) == role


def test_roles_used_counts_new_threads_from_zero_and_sums_a_pool():
    from bench import cpu

    before = {(1, 10): ("rpc_N", 1.0), (1, 11): ("rpc_N", 2.0), (1, 12): ("dlq-drain", 5.0),
              (1, 13): ("gone", 9.0)}
    after = {(1, 10): ("rpc_N", 1.5), (1, 11): ("rpc_N", 2.25), (1, 12): ("dlq-drain", 5.0),
             (1, 14): ("rpc_N", 0.5), (2, 10): ("spool-writer", 0.75)}
    assert cpu.roles_used(before, after) == {"rpc_N": 1.25, "spool-writer": 0.75}


def test_the_threads_reading_names_each_role_by_its_median_and_what_would_close_the_gap():
    from bench.targets.cluster import _threads_reading

    runs = [{"dlq-drain": 6.0, "rpc_N": 6.5, "librdkafka": 3.0, "trim": 0.1},
            {"dlq-drain": 7.0, "rpc_N": 5.5, "librdkafka": 2.0},
            {"dlq-drain": 6.5, "rpc_N": 6.0, "librdkafka": 2.5, "trim": 0.1}]
    text = _threads_reading(runs, 15.5, 4)
    assert "dlq-drain 6.50, rpc_N 6.00, librdkafka 2.50, others 0.1 " in text
    assert "(together 15.1;" in text and "medians of the 3 runs" in text
    assert "the report kept as one unit" in text and "SQLite once" in text
    assert _threads_reading([], 15.5, 4) == "The nodes' CPU by thread: not measured."


def test_the_executor_check_compares_each_variant_above_catch_and_drop_round_by_round():
    from bench.model import Figure
    from bench.targets.spark_jobs import _executor_check

    def fig(name, values):
        f = Figure(name, "µs")
        for v in values:
            f.add(v)
        return f

    bare = fig("bare", [26.0, 27.0, 30.0])
    peer = fig("peer", [33.0, 34.0, 37.5])       # 7.0, 7.0, 7.5 above: median 7.0
    cand = fig("cand", [39.0, 41.5, 42.0])       # 13.0, 14.5, 12.0 above: median 13.0
    check = _executor_check(10.0, bare, peer, cand)
    assert check.value == pytest.approx(6.0) and check.met is False
    assert check.threshold == 5.0 and check.unit == "µs"
    assert "spillway 13.0 µs − (a) 7.0 µs" in check.detail
    assert _executor_check(10.0, bare, peer, fig("none", [])).met is None
