"""`spillway dlq tail` and `spillway dlq redrive` against a real Tansu broker, through the
argparse wiring the main CLI uses."""

from __future__ import annotations

import argparse
import io
import threading
import time
from collections import Counter

import pytest
from spillway.sidecar.cli.dlq import add_dlq_commands
from spillway.sidecar.core.dlq_record import build_dlq_record
from spillway.sidecar.core.model import (
    Action,
    Category,
    ExceptionInfo,
    FailedRecord,
    SourceCoordinates,
    Stage,
    StageRef,
    TaskIdentity,
    Verdict,
)
from spillway.sidecar.core.settings import job_settings
from spillway.sidecar.dlq import DlqPipeline
from spillway.sidecar.dlq.tools import tail
from support.kafka import FreezableBroker, create_topic, read_all

pytestmark = pytest.mark.integration

T0 = 1_700_000_000_000  # 2023-11-14T22:13:20Z
TASK = TaskIdentity(stage_id=1, partition_id=0, attempt_number=0, task_attempt_id=5)


def cli(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="spillway")
    add_dlq_commands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(list(argv))
    return args.func(args)


def failed(rid: str, stage: Stage, exc: str, *, value: bytes, headers=()) -> FailedRecord:
    return FailedRecord(record_id=rid, stage=StageRef(stage),
                        exception=ExceptionInfo(exc, message=f"{exc} for {rid}",
                                                stack_trace="Traceback:\n  line 1\n  line 2"),
                        function_name="etl.step", source=SourceCoordinates("orders", 0, 7),
                        key=rid.encode(), value=value, headers=(("app", b"1"),) + headers)


def dead_letter(bootstrap: str, topic: str, tmp_path, items) -> None:
    """items: (job, FailedRecord, now_ms, extra settings)."""
    p = DlqPipeline(bootstrap, spool_dir=str(tmp_path / "spool")).start()
    try:
        for job, rec, now_ms, extra in items:
            s = job_settings(job, {"errors.deadletterqueue.topic.name": topic,
                                   "errors.deadletterqueue.context.headers.enable": "true",
                                   **extra})
            v = Verdict(rec.record_id, Action.SKIP, Category.DATA, "data error", attempt=1)
            p.submit([build_dlq_record(s, rec, v, TASK, now_ms=now_ms, sidecar_id="s")])
        assert p.force_flush(20)
    finally:
        p.shutdown(5)


@pytest.fixture
def dlq_topic(broker, topic_name, tmp_path):
    create_topic(broker.bootstrap_servers, topic_name)
    items = []
    for i in range(4):
        items.append(("orders", failed(f"o{i}", Stage.TRANSFORMATION, "builtins.ValueError",
                                       value=f'{{"n": {i}}}'.encode()), T0 + i * 1000, {}))
    for i in range(2):
        items.append(("orders", failed(f"d{i}", Stage.DESERIALIZATION, "json.JSONDecodeError",
                                       value=b"\x00\x01\x02\xff"), T0 + 10_000 + i, {}))
    items.append(("billing", failed("b0", Stage.TRANSFORMATION, "builtins.ValueError",
                                    value=b"bill"), T0 + 20_000,
                  {"errors.deadletterqueue.headers.format": "dlq"}))
    items.append(("orders", failed("c0", Stage.TRANSFORMATION, "builtins.ValueError",
                                   value=b"secret"), T0 + 30_000,
                  {"errors.deadletterqueue.copy.record.enable": "false"}))
    dead_letter(broker.bootstrap_servers, topic_name, tmp_path, items)
    return topic_name


def test_tail_from_the_beginning_prints_one_readable_block_per_record(broker, dlq_topic, capsys):
    assert cli("dlq", "tail", "--bootstrap-servers", broker.bootstrap_servers, "--topic",
               dlq_topic, "--from-beginning", "--idle-ms", "400") == 0
    out = capsys.readouterr().out
    blocks = out.split("── ")[1:]
    assert len(blocks) == 8
    first = blocks[0]
    assert first.startswith(f"{dlq_topic} [0] @")
    assert "key:   o0\n" in first
    assert 'value: {"n": 0}\n' in first
    assert "  __connect.errors.stage: TRANSFORMATION\n" in first
    assert "  __connect.errors.exception.class.name: builtins.ValueError\n" in first
    assert "  spillway.record.id: o0\n" in first
    assert "  app: 1\n" in first
    # a multi-line stack trace stays readable, indented under its header
    assert "  __connect.errors.exception.stacktrace: Traceback:\n        line 1\n" in first
    binary = next(b for b in blocks if "key:   d0" in b)
    assert "value: hex:000102ff\n" in binary
    context_only = next(b for b in blocks if "spillway.record.id: c0" in b)
    assert "value: (null)" in context_only and "spillway.record.copied: false" in context_only


def test_tail_shows_the_newest_records_and_honours_max(broker, dlq_topic, capsys):
    assert cli("dlq", "tail", "--bootstrap-servers", broker.bootstrap_servers, "--topic",
               dlq_topic, "--max", "2", "--idle-ms", "400") == 0
    out = capsys.readouterr().out
    assert out.count("── ") == 2
    assert "spillway.record.id: b0" in out and "spillway.record.id: c0" in out
    assert cli("dlq", "tail", "--bootstrap-servers", broker.bootstrap_servers, "--topic",
               dlq_topic, "--from-beginning", "--max", "3", "--max-bytes", "4",
               "--idle-ms", "400") == 0
    out = capsys.readouterr().out
    assert out.count("── ") == 3
    assert 'value: {"n" …(+4 bytes)' in out


def test_tail_of_a_missing_topic_is_a_clean_error(broker, capsys):
    assert cli("dlq", "tail", "--bootstrap-servers", broker.bootstrap_servers, "--topic",
               "dlq.does-not-exist", "--idle-ms", "200") == 2
    assert "topic 'dlq.does-not-exist' does not exist" in capsys.readouterr().err


def test_redrive_dry_run_changes_nothing(broker, dlq_topic, capsys):
    target = dlq_topic + ".target"
    create_topic(broker.bootstrap_servers, target)
    assert cli("dlq", "redrive", "--bootstrap-servers", broker.bootstrap_servers, "--topic",
               dlq_topic, "--target", target, "--stage", "TRANSFORMATION", "--dry-run",
               "--idle-ms", "400") == 0
    out = capsys.readouterr().out
    assert out.count("would redrive ") == 5
    assert "skip " in out and "record c0: context-only" in out
    assert out.strip().splitlines()[-1] == (
        "scanned=8 matched=6 would redrive=5 skipped (loop protection)=0 "
        "skipped (context-only)=1 skipped (stage input)=0 skipped (already redriven)=0 "
        "skipped (resolved)=0 failed=0")
    assert read_all(broker.bootstrap_servers, target, idle_s=0.5) == []


def test_redrive_republishes_originals_and_protects_against_loops(broker, dlq_topic, tmp_path,
                                                                  capsys):
    target = dlq_topic + ".target"
    create_topic(broker.bootstrap_servers, target)
    assert cli("dlq", "redrive", "--bootstrap-servers", broker.bootstrap_servers, "--topic",
               dlq_topic, "--target", target, "--job", "orders", "--exception-class",
               "ValueError", "--until", "2023-11-14T22:13:22Z", "--rate", "200/s",
               "--idle-ms", "400") == 0
    out = capsys.readouterr().out
    assert out.strip().splitlines()[-1] == (
        "scanned=8 matched=2 redriven=2 skipped (loop protection)=0 "
        "skipped (context-only)=0 skipped (stage input)=0 skipped (already redriven)=0 "
        "skipped (resolved)=0 failed=0")
    msgs = read_all(broker.bootstrap_servers, target, idle_s=0.5)
    assert sorted(m.key() for m in msgs) == [b"o0", b"o1"]
    m = next(m for m in msgs if m.key() == b"o1")
    assert m.value() == b'{"n": 1}'
    assert m.headers() == [("app", b"1"), ("spillway.redrive.count", b"1")]

    # the redriven record fails again and comes back to the DLQ with its redrive count
    again = FailedRecord(record_id="o1-again", stage=StageRef(Stage.TRANSFORMATION),
                         exception=ExceptionInfo("builtins.ValueError", message="still bad"),
                         key=m.key(), value=m.value(), headers=tuple(m.headers()))
    dead_letter(broker.bootstrap_servers, dlq_topic, tmp_path / "2",
                [("orders", again, T0 + 40_000, {})])
    # it sent nothing it was asked to send: exit 1, and one line says why
    assert cli("dlq", "redrive", "--bootstrap-servers", broker.bootstrap_servers, "--topic",
               dlq_topic, "--target", target, "--since", "2023-11-14T22:14:00",
               "--max-redrives", "1", "--idle-ms", "400") == 1
    captured = capsys.readouterr()
    out = captured.out
    assert "record o1-again: redriven 1 times already (--max-redrives 1)" in out
    why = ("sent nothing: refused 1 of 1 matching record(s): 1 at the loop protection's "
           "limit (redriven 1 or more times already; --max-redrives raises it)")
    assert out.strip().splitlines()[-2] == why
    assert f"spillway dlq redrive: {why}\n" in captured.err
    assert out.strip().splitlines()[-1] == (
        "scanned=9 matched=1 redriven=0 skipped (loop protection)=1 "
        "skipped (context-only)=0 skipped (stage input)=0 skipped (already redriven)=0 "
        "skipped (resolved)=0 failed=0")
    assert cli("dlq", "redrive", "--bootstrap-servers", broker.bootstrap_servers, "--topic",
               dlq_topic, "--target", target, "--since", "2023-11-14T22:14:00",
               "--max-redrives", "2", "--idle-ms", "400") == 0
    capsys.readouterr()
    msgs = read_all(broker.bootstrap_servers, target, idle_s=0.5)
    counts = Counter(dict(m.headers())["spillway.redrive.count"] for m in msgs)
    assert counts == {b"1": 2, b"2": 1}


def test_redrive_sends_only_source_payloads_to_their_source_topic_and_each_id_once(
        broker, topic_name, tmp_path, capsys):
    source = topic_name + ".source"
    create_topic(broker.bootstrap_servers, topic_name)
    create_topic(broker.bootstrap_servers, source)

    def rec(rid, stage, payload):
        r = failed(rid, stage, "builtins.ValueError", value=f"v-{rid}".encode())
        return FailedRecord(**{**{f: getattr(r, f) for f in r.__slots__},
                               "source": SourceCoordinates(source, 0, 1), "payload": payload})

    items = [("orders", rec("raw", Stage.VALUE_CONVERTER, "source"), T0, {}),
             ("orders", rec("row", Stage.SINK, "stage-input"), T0, {})]
    dead_letter(broker.bootstrap_servers, topic_name, tmp_path, items)
    dead_letter(broker.bootstrap_servers, topic_name, tmp_path / "again",  # a duplicate
                [("orders", rec("raw", Stage.VALUE_CONVERTER, "source"), T0, {})])
    base = ["dlq", "redrive", "--bootstrap-servers", broker.bootstrap_servers, "--topic",
            topic_name, "--target", source, "--idle-ms", "400"]
    assert cli(*base) == 0
    captured = capsys.readouterr()
    assert (f"record row: its key/value are a stage's input (spillway.payload=stage-input, "
            f"e.g. a transformed row), not a record as read, and {source!r} is its source "
            f"topic (--allow-stage-input sends it)\n") in captured.out
    assert "record raw: already redriven in this run" in captured.out
    lines = captured.out.strip().splitlines()
    assert lines[-2] == (
        f"refused 1 of 3 matching record(s): 1 stage input whose source topic is "
        f"{source!r}: their key/value are a stage's input (e.g. a transformed row), not "
        f"records as read; --allow-stage-input sends them")
    assert lines[-1] == (
        "scanned=3 matched=3 redriven=1 skipped (loop protection)=0 skipped (context-only)=0 "
        "skipped (stage input)=1 skipped (already redriven)=1 skipped (resolved)=0 "
        "failed=0")
    assert "redrive done in " in captured.err          # progress on stderr
    assert "s: scanned=3 matched=3 redriven=1 " in captured.err
    assert [m.key() for m in read_all(broker.bootstrap_servers, source, idle_s=0.5)] == [b"raw"]
    # told to, it sends the transformed row to the source topic too
    assert cli(*base, "--allow-stage-input", "--job", "orders", "--stage", "TASK_PUT") == 0
    capsys.readouterr()
    assert sorted(m.key() for m in read_all(broker.bootstrap_servers, source, idle_s=0.5)) == [
        b"raw", b"row"]


def test_redrive_of_the_dlq_dlq_format_strips_its_context_headers(broker, dlq_topic, capsys):
    target = dlq_topic + ".target"
    create_topic(broker.bootstrap_servers, target)
    assert cli("dlq", "redrive", "--bootstrap-servers", broker.bootstrap_servers, "--topic",
               dlq_topic, "--target", target, "--job", "billing", "--idle-ms", "400") == 0
    capsys.readouterr()
    (m,) = read_all(broker.bootstrap_servers, target, idle_s=0.5)
    assert m.headers() == [("app", b"1"), ("spillway.redrive.count", b"1")]


def test_redrive_refuses_bad_input(broker, dlq_topic, capsys):
    base = ["dlq", "redrive", "--bootstrap-servers", broker.bootstrap_servers, "--topic",
            dlq_topic]
    assert cli(*base, "--target", dlq_topic) == 2
    assert "must not be the DLQ topic itself" in capsys.readouterr().err
    assert cli(*base, "--target", "dlq.missing-target") == 2
    assert "redrive target topic 'dlq.missing-target' does not exist" in capsys.readouterr().err
    assert cli(*base, "--target", "x", "--since", "yesterday") == 2
    assert "not an ISO 8601 time: 'yesterday'" in capsys.readouterr().err
    assert cli(*base, "--target", "x", "--rate", "fast") == 2
    assert "not a rate: 'fast'" in capsys.readouterr().err


def test_tail_follow_prints_new_records_as_they_arrive(broker, dlq_topic, tmp_path):
    out = io.StringIO()
    done = threading.Event()

    def run() -> None:
        tail(broker.bootstrap_servers, dlq_topic, follow=True, max_records=10, out=out)
        done.set()

    threading.Thread(target=run, daemon=True).start()
    deadline = time.monotonic() + 10
    while out.getvalue().count("── ") < 8 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert out.getvalue().count("── ") == 8 and not done.is_set()  # waiting for more
    dead_letter(broker.bootstrap_servers, dlq_topic, tmp_path / "more",
                [("orders", failed(f"n{i}", Stage.SINK, "io.Timeout", value=b"x"), T0, {})
                 for i in range(2)])
    assert done.wait(10)
    assert "spillway.record.id: n1" in out.getvalue()


TP = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


@pytest.fixture
def ten_dead_letters(broker, topic_name, tmp_path):
    """Ten records dead-lettered to `topic_name`; the name of an empty topic to redrive to."""
    create_topic(broker.bootstrap_servers, topic_name)
    target = topic_name + ".target"
    create_topic(broker.bootstrap_servers, target)
    items = [("orders", failed(f"o{i}", Stage.TRANSFORMATION, "builtins.ValueError",
                               value=f"v{i}".encode()), T0 + i, {}) for i in range(10)]
    dead_letter(broker.bootstrap_servers, topic_name, tmp_path, items)
    return target


def test_a_second_redrive_of_the_same_range_adds_nothing(broker, topic_name, ten_dead_letters,
                                                          capsys):
    """The ledger: the first run records each acknowledged record, the second skips them all;
    --no-ledger sends them again (and says nothing to the ledger)."""
    from spillway.client.dlq_ledger import decode

    target = ten_dead_letters
    base = ["dlq", "redrive", "--bootstrap-servers", broker.bootstrap_servers, "--topic",
            topic_name, "--target", target, "--idle-ms", "400", "--allow-stage-input"]
    assert cli(*base) == 0
    assert "redriven=10 " in capsys.readouterr().out
    assert cli(*base) == 0
    out = capsys.readouterr().out
    assert out.strip().splitlines()[-1].startswith("scanned=10 matched=10 redriven=0 ")
    assert "skipped (resolved)=10 " in out
    assert "record o3: redriven to " in out and "(ledger)" in out
    assert len(read_all(broker.bootstrap_servers, target, idle_s=0.5)) == 10
    ledger = read_all(broker.bootstrap_servers, topic_name + ".ledger", idle_s=0.5)
    got = [decode(m.value()) for m in ledger]
    assert len(got) == 10 and {r.resolution for r in got} == {"redriven"}
    assert {r.record_id for r in got} == {f"o{i}" for i in range(10)}
    assert all(r.target == target and r.by == "spillway dlq redrive" for r in got)
    # a dry run reads the ledger too
    assert cli(*base, "--dry-run") == 0
    assert "would redrive=0 " in capsys.readouterr().out
    assert cli(*base, "--no-ledger") == 0
    assert "redriven=10 " in capsys.readouterr().out
    assert len(read_all(broker.bootstrap_servers, target, idle_s=0.5)) == 20
    assert len(read_all(broker.bootstrap_servers, topic_name + ".ledger", idle_s=0.5)) == 10


def test_a_redriven_record_starts_a_new_trace_linked_to_the_dead_letter(broker, topic_name,
                                                                      tmp_path):
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from spillway.sidecar.dlq.redrive import redrive

    create_topic(broker.bootstrap_servers, topic_name)
    target = topic_name + ".target"
    create_topic(broker.bootstrap_servers, target)
    rec = failed("t0", Stage.TRANSFORMATION, "builtins.ValueError", value=b"v")
    rec = FailedRecord(**{**{f: getattr(rec, f) for f in rec.__slots__}, "traceparent": TP})
    dead_letter(broker.bootstrap_servers, topic_name, tmp_path, [("orders", rec, T0, {})])
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    summary = redrive(broker.bootstrap_servers, topic_name, target, idle_s=0.4,
                      out=io.StringIO(), allow_stage_input=True,
                      tracer=provider.get_tracer("test"))
    assert summary.redriven == 1
    (m,) = read_all(broker.bootstrap_servers, target, idle_s=0.5)
    h = dict(m.headers())
    (span,) = exporter.get_finished_spans()
    assert span.name == f"redrive {target}" and span.parent is None
    new = h["traceparent"].decode()
    assert TP.split("-")[1] not in new                        # not the old trace
    assert new.split("-")[1] == format(span.context.trace_id, "032x")
    (link,) = span.links
    assert format(link.context.trace_id, "032x") == TP.split("-")[1]
    assert h["spillway.redrive.link"] == TP.encode()          # for the consumer to link too


def test_redrive_with_an_uncreatable_ledger_is_a_clean_error(broker, dlq_topic, capsys):
    target = dlq_topic + ".target"
    create_topic(broker.bootstrap_servers, target)
    base = ["dlq", "redrive", "--bootstrap-servers", broker.bootstrap_servers, "--topic",
            dlq_topic, "--target", target, "--idle-ms", "400"]
    assert cli(*base, "--ledger-topic", dlq_topic) == 2
    assert "the ledger topic must be neither the DLQ topic nor the target" in \
        capsys.readouterr().err
    assert cli(*base, "--ledger-topic", "bad topic name!") == 2
    err = capsys.readouterr().err
    assert "ledger topic: " in err and "'bad topic name!'" in err and "--no-ledger" in err


# --- the first answer -------------------------------------------------------------------------


@pytest.fixture
def frozen_at_assign(tmp_path, monkeypatch):
    """A broker of its own holding 20 records over 2 partitions, and ``freeze(s)``: the next
    `read_topic` finds it frozen from the moment it assigns its partitions, for ``s`` seconds."""
    from spillway.sidecar.dlq import tools

    topic = "dlq.slow-first-answer"
    b = FreezableBroker(str(tmp_path / "tansu.log"), topic,
                        [{"value": b"v%d" % i, "key": b"%d" % i} for i in range(20)])
    try:
        yield b.bootstrap, topic, lambda s: b.freeze_reads(tools, monkeypatch, s)
    finally:
        b.close()


def test_a_slow_first_answer_is_not_read_as_an_empty_topic(frozen_at_assign):
    """The idle period counts from the broker's answers: a first fetch slower than it still
    reads every record (it once ended such a read empty, and a redrive would have sent nothing,
    or read its ledger as empty and sent again what it had resolved)."""
    from spillway.sidecar.dlq.tools import read_topic

    bootstrap, topic, freeze = frozen_at_assign
    freeze(1.5)
    got = list(read_topic(bootstrap, topic, idle_s=0.3, timeout_s=20))
    assert sorted(int(m.key) for m in got) == list(range(20))


def test_a_partition_the_broker_never_answers_is_an_error_naming_it(frozen_at_assign):
    from spillway.sidecar.dlq.tools import read_topic
    from spillway.sidecar.errors import DlqError

    bootstrap, topic, freeze = frozen_at_assign
    freeze(30)
    began = time.monotonic()
    with pytest.raises(DlqError, match=r"reading 'dlq.slow-first-answer': the broker did not "
                                       r"answer for partition\(s\) 0, 1 within 1s"):
        list(read_topic(bootstrap, topic, idle_s=0.3, timeout_s=1))
    assert time.monotonic() - began < 15


def test_a_read_that_fails_part_way_settles_what_was_sent_then_fails(
        broker, topic_name, ten_dead_letters, capsys, monkeypatch):
    """The DLQ topic's read fails after three records went out (here: an error raised by the
    read itself after its third record): those three are acknowledged and in the ledger (a
    later redrive skips them), the summary says so, and the command fails naming the error."""
    from spillway.sidecar.dlq import redrive as redrive_module
    from spillway.sidecar.errors import DlqError

    target = ten_dead_letters
    real = redrive_module.read_topic

    def failing(bootstrap, topic, **kw):
        if topic != topic_name:          # the ledger is read as it is
            yield from real(bootstrap, topic, **kw)
            return
        for i, msg in enumerate(real(bootstrap, topic, **kw)):
            if i == 3:
                raise DlqError(f"reading {topic!r}: the broker did not answer for "
                               f"partition(s) 0 within 10s")
            yield msg

    monkeypatch.setattr(redrive_module, "read_topic", failing)
    base = ["dlq", "redrive", "--bootstrap-servers", broker.bootstrap_servers, "--topic",
            topic_name, "--target", target, "--idle-ms", "400", "--allow-stage-input"]
    assert cli(*base) == 2
    out, err = capsys.readouterr()
    assert out.strip().splitlines()[-1].startswith("scanned=3 matched=3 redriven=3 ")
    assert err.strip().endswith("the broker did not answer for partition(s) 0 within 10s")
    assert len(read_all(broker.bootstrap_servers, target, idle_s=0.5)) == 3
    assert len(read_all(broker.bootstrap_servers, topic_name + ".ledger", idle_s=0.5)) == 3
    monkeypatch.setattr(redrive_module, "read_topic", real)
    assert cli(*base) == 0
    assert "redriven=7 skipped (loop protection)=0" in capsys.readouterr().out
