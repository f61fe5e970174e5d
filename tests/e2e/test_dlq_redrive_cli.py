"""`spillway dlq create-topic` and `spillway dlq redrive` run as their own processes, as an
operator runs them, against the Tansu broker; dead letters written by `spillway serve` (its own
process) as a DataFrame stage over non-Kafka data writes them: the stage's input (a row as
JSON, ``spillway.payload=stage-input``), no source coordinates, context headers off (the
default).

- create-topic: the operator's prefix rule (from the sidecar's configuration file or
  environment), the replication factor against the broker count, KIP-1191's opt-in set;
- redrive --create-target: the same rules; a missing target's error names the flag;
- stage inputs, to a topic that exists: refused with one line saying why and naming
  --allow-stage-input, exit 1 (it sent nothing), sent with the flag; to a target the redrive
  creates (nobody's source): sent;
- progress: the total from the watermarks, running counts with an ETA, the final counts.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import uuid

import pytest
from spillway.client import SidecarClient, report
from spillway.v1 import sidecar_pb2 as pb
from support import serve
from support.kafka import create_topic, read_all, topic_config

pytestmark = pytest.mark.e2e

OPT_IN = "errors.deadletterqueue.group.enable"
TASK = pb.TaskIdentity(stage_id=3, partition_id=0, attempt_number=0, task_attempt_id=9)


def spillway(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "spillway.sidecar.cli", *argv],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})})


def partitions(bootstrap: str, topic: str) -> int | None:
    from confluent_kafka.admin import AdminClient

    meta = AdminClient({"bootstrap.servers": bootstrap}).list_topics(timeout=10).topics.get(topic)
    return None if meta is None or meta.error is not None else len(meta.partitions)


@pytest.fixture(scope="module")
def dead_letters(broker, tmp_path_factory):
    """A DLQ topic holding 30 dead letters of a DataFrame stage (udf over non-Kafka rows), as
    `spillway serve` wrote them."""
    topic = f"dlq.udf-{uuid.uuid4().hex[:8]}"
    create_topic(broker.bootstrap_servers, topic)
    proc, address = serve.spawn(
        ["--listen", "127.0.0.1:0", "--bootstrap-servers", broker.bootstrap_servers,
         "--set", f"spool.dir={tmp_path_factory.mktemp('spool')}"],
        stderr=subprocess.DEVNULL)
    client = SidecarClient(address)
    try:
        run = client.register_job(f"udf-{uuid.uuid4().hex[:6]}", {
            "errors.tolerance": "all", "errors.deadletterqueue.topic.name": topic})

        def failure(i):
            try:
                raise ValueError(f"bad amount in row {i}")
            except ValueError as exc:
                return report.failed_record(
                    f"row-{i}", "TRANSFORMATION", exc, function_name="etl.parse_amount",
                    key=None, value=json.dumps({"id": i, "amount": "x"}),
                    payload="stage-input")

        # the last one alone: Tansu's high watermark is its last batch's first offset + 1,
        # so a last batch of one record makes the watermarks' total exact
        for batch in (range(29), range(29, 30)):
            verdicts = client.report_failures(run, TASK, [failure(i) for i in batch])
            assert all(v.dead_lettered for v in verdicts)
            client.flush_task(run, TASK)
        client.end_job(run)
    finally:
        client.close()
        serve.stop(proc)
    assert len(read_all(broker.bootstrap_servers, topic, idle_s=0.5)) == 30
    return topic


# --- create-topic --------------------------------------------------------------------------


def test_create_topic_makes_an_opted_in_dlq_topic_within_the_operators_rules(broker, tmp_path):
    bs = broker.bootstrap_servers
    name = f"dlq.made-{uuid.uuid4().hex[:8]}"
    out = spillway("dlq", "create-topic", "--bootstrap-servers", bs, "--topic", name,
                   "--partitions", "3", "--replication-factor", "1")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == (f"created the DLQ topic {name!r} (3 partition(s), "
                                  f"replication factor 1) with {OPT_IN}=true")
    assert partitions(bs, name) == 3
    assert topic_config(bs, name) == {OPT_IN: "true"}

    again = spillway("dlq", "create-topic", "--bootstrap-servers", bs, "--topic", name,
                     "--replication-factor", "1")
    assert again.returncode == 2
    assert again.stderr.strip() == (
        f"spillway dlq create-topic: the topic {name!r} exists already; its {OPT_IN} is true "
        f"(--if-not-exists accepts it)")
    ok = spillway("dlq", "create-topic", "--bootstrap-servers", bs, "--topic", name,
                  "--replication-factor", "1", "--if-not-exists")
    assert ok.returncode == 0 and "exists already" in ok.stdout

    # an existing topic its administrator did not opt in is no DLQ topic, even if it exists
    off = f"dlq.off-{uuid.uuid4().hex[:8]}"
    create_topic(bs, off, config={OPT_IN: "false"})
    refused = spillway("dlq", "create-topic", "--bootstrap-servers", bs, "--topic", off,
                       "--if-not-exists")
    assert refused.returncode == 2
    assert f"--topic: the topic {off!r} is not enabled as a DLQ topic" in refused.stderr


def test_create_topic_refuses_what_the_operator_or_the_cluster_would_not_allow(broker,
                                                                               tmp_path):
    bs = broker.bootstrap_servers
    name = f"dlq.rf-{uuid.uuid4().hex[:8]}"
    out = spillway("dlq", "create-topic", "--bootstrap-servers", bs, "--topic", name)
    assert out.returncode == 2                      # the default replication factor, 3
    assert out.stderr.strip() == (
        f"spillway dlq create-topic: --replication-factor: is 3 but the cluster at {bs} has "
        f"only 1 broker(s), so the topic {name!r} cannot be created; set --replication-factor "
        f"to at most 1")
    assert partitions(bs, name) is None

    outside = f"orders-{uuid.uuid4().hex[:8]}"
    out = spillway("dlq", "create-topic", "--bootstrap-servers", bs, "--topic", outside,
                   "--replication-factor", "1")
    assert out.returncode == 2
    assert out.stderr.strip() == (
        f"spillway dlq create-topic: --topic: {outside!r} does not start with 'dlq.', the "
        f"operator's prefix for the topics spillway creates (dlq.topic.required.prefix); name "
        f"one that does")
    assert partitions(bs, outside) is None

    # the operator's rule as the sidecar reads it: its configuration file, then the environment
    conf = tmp_path / "sidecar.properties"
    conf.write_text("dlq.topic.required.prefix=team-a.\n")
    team = f"team-a.{uuid.uuid4().hex[:8]}"
    out = spillway("dlq", "create-topic", "--bootstrap-servers", bs, "--topic", team,
                   "--replication-factor", "1", "--config", str(conf))
    assert out.returncode == 0, out.stderr
    out = spillway("dlq", "create-topic", "--bootstrap-servers", bs, "--topic", name,
                   "--replication-factor", "1", env={"SPILLWAY_CONFIG": str(conf)})
    assert out.returncode == 2 and "does not start with 'team-a.'" in out.stderr
    out = spillway("dlq", "create-topic", "--bootstrap-servers", bs, "--topic", name,
                   "--replication-factor", "1",
                   env={"SPILLWAY_CONFIG": str(conf), "SPILLWAY_DLQ_TOPIC_REQUIRED_PREFIX": ""})
    assert out.returncode == 0, out.stderr


# --- redrive --------------------------------------------------------------------------------


def test_a_missing_target_names_create_target_which_creates_it_under_the_rules(
        broker, dead_letters):
    bs = broker.bootstrap_servers
    target = f"dlq.retry-{uuid.uuid4().hex[:8]}"
    base = ["dlq", "redrive", "--bootstrap-servers", bs, "--topic", dead_letters, "--target",
            target, "--idle-ms", "500", "--no-ledger", "--allow-stage-input"]
    out = spillway(*base)
    assert out.returncode == 2
    assert out.stderr.strip() == (
        f"spillway dlq redrive: redrive target topic {target!r} does not exist: create it, or "
        f"add --create-target (with --partitions and --replication-factor) to have this "
        f"redrive create it")

    out = spillway(*base, "--create-target")            # replication factor 3, one broker
    assert out.returncode == 2
    assert (f"--replication-factor: is 3 but the cluster at {bs} has only 1 broker(s), so the "
            f"topic {target!r} cannot be created") in out.stderr
    outside = spillway(*base[:7], "orders-retry", *base[8:], "--create-target",
                       "--replication-factor", "1")
    assert outside.returncode == 2
    assert "--target: 'orders-retry' does not start with 'dlq.'" in outside.stderr
    assert partitions(bs, target) is None and partitions(bs, "orders-retry") is None
    # the prefix bounds what spillway creates, not where it may send: an existing target is used
    existing = f"orders-{uuid.uuid4().hex[:8]}"
    create_topic(bs, existing)
    used = spillway(*base[:7], existing, *base[8:], "--create-target", "--dry-run")
    assert used.returncode == 0, used.stderr
    assert "would create" not in used.stdout and "would redrive=30 " in used.stdout

    dry = spillway(*base, "--create-target", "--replication-factor", "1", "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert dry.stdout.startswith(f"would create the target topic {target!r} (1 partition(s), "
                                 f"replication factor 1)\n")
    assert partitions(bs, target) is None

    out = spillway(*base, "--create-target", "--partitions", "2", "--replication-factor", "1")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"created the target topic {target!r} (2 partition(s), "
                                 f"replication factor 1)\n")
    assert out.stdout.strip().splitlines()[-1].startswith("scanned=30 matched=30 redriven=30 ")
    assert partitions(bs, target) == 2
    assert topic_config(bs, target) == {}       # a retry topic, not a DLQ: no KIP-1191 opt-in
    assert len(read_all(bs, target, idle_s=0.5)) == 30


def test_stage_inputs_are_refused_in_one_line_naming_the_flag_which_sends_them(
        broker, dead_letters):
    """To a topic that exists (made by the operator before): spillway cannot tell it is not
    where those rows came from, so it sends nothing without --allow-stage-input, and says so."""
    bs = broker.bootstrap_servers
    target = f"dlq.reprocess-{uuid.uuid4().hex[:8]}"
    create_topic(bs, target)
    base = ["dlq", "redrive", "--bootstrap-servers", bs, "--topic", dead_letters, "--target",
            target, "--idle-ms", "500",
            "--ledger-topic", f"{target}.ledger"]   # its own: the module's tests share the DLQ
    out = spillway(*base)
    assert out.returncode == 1, out.stdout + out.stderr          # it sent nothing
    lines = out.stdout.strip().splitlines()
    assert lines[0].endswith(
        ": its key/value are a stage's input (spillway.payload=stage-input, e.g. a transformed "
        "row), not a record as read, and it was dead-lettered without context headers: its "
        f"source topic is unknown, so spillway cannot tell that {target!r} is not it "
        "(--allow-stage-input sends it)")
    why = (f"sent nothing: refused 30 of 30 matching record(s): 30 stage input of unknown "
           f"source (dead-lettered without context headers: spillway cannot tell that "
           f"{target!r} is not their source topic): their key/value are a stage's input (e.g. "
           f"a transformed row), not records as read; --allow-stage-input sends them")
    assert lines[-2] == why
    assert lines[-1].startswith("scanned=30 matched=30 redriven=0 ")
    assert f"spillway dlq redrive: {why}\n" in out.stderr
    assert read_all(bs, target, idle_s=0.5) == []

    out = spillway(*base, "--allow-stage-input")
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.strip().splitlines()[-1].startswith("scanned=30 matched=30 redriven=30 ")
    sent = read_all(bs, target, idle_s=0.5)
    assert sorted(json.loads(m.value())["id"] for m in sent) == list(range(30))
    assert all(dict(m.headers())["spillway.redrive.count"] == b"1" for m in sent)


def test_stage_inputs_go_to_a_target_the_redrive_creates(broker, dead_letters):
    """A topic made by this very run cannot be where those rows were read."""
    bs = broker.bootstrap_servers
    target = f"dlq.fresh-{uuid.uuid4().hex[:8]}"
    out = spillway("dlq", "redrive", "--bootstrap-servers", bs, "--topic", dead_letters,
                   "--target", target, "--idle-ms", "500", "--create-target",
                   "--replication-factor", "1", "--no-ledger")
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.strip().splitlines()[-1] == (
        "scanned=30 matched=30 redriven=30 skipped (loop protection)=0 skipped (context-only)=0 "
        "skipped (stage input)=0 skipped (already redriven)=0 skipped (resolved)=0 failed=0")
    assert len(read_all(bs, target, idle_s=0.5)) == 30


def test_progress_shows_the_total_an_eta_and_the_final_counts(broker, dead_letters):
    bs = broker.bootstrap_servers
    target = f"dlq.slow-{uuid.uuid4().hex[:8]}"
    out = spillway("dlq", "redrive", "--bootstrap-servers", bs, "--topic", dead_letters,
                   "--target", target, "--idle-ms", "500", "--create-target",
                   "--replication-factor", "1", "--allow-stage-input", "--no-ledger",
                   "--rate", "10/s")
    assert out.returncode == 0, out.stderr
    err = out.stderr
    total = re.search(rf"redrive: (\d+) record\(s\) to scan in '{dead_letters}' "
                      rf"\(its watermarks\)", err)
    assert total and total.group(1) == "30", err
    running = re.findall(r"redrive progress: scanned (\d+)/(\d+) \((\d+)%\), matched=\d+ "
                         r"redriven=\d+ refused=0 failed=0, \d+s elapsed, ETA (\d+)s", err)
    assert running, err                       # 30 records at 10/s: about 3 s, a line every 2 s
    scanned, of, pct, eta = map(int, running[0])
    assert 0 < scanned < 30 and of == 30 and pct == round(100 * scanned / 30) and eta >= 0
    final = re.search(r"redrive done in [\d.]+s: scanned=30 matched=30 redriven=30 ", err)
    assert final, err


def test_a_short_run_prints_its_total_and_final_counts(broker, dead_letters):
    bs = broker.bootstrap_servers
    target = f"dlq.fast-{uuid.uuid4().hex[:8]}"
    out = spillway("dlq", "redrive", "--bootstrap-servers", bs, "--topic", dead_letters,
                   "--target", target, "--idle-ms", "300", "--create-target",
                   "--replication-factor", "1", "--allow-stage-input", "--dry-run", "--no-ledger")
    assert out.returncode == 0, out.stderr
    assert "record(s) to scan in" in out.stderr
    assert re.search(r"redrive done in [\d.]+s: scanned=30 matched=30 would redrive=30 ",
                     out.stderr), out.stderr
