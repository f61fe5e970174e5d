"""End to end: the demo job exactly as `make run` runs it — Tansu and the sidecar as their own
processes, a real local Spark job — checked against the DLQ topic read by an independent client."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from support.kafka import read_all

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.e2e]

TRACEPARENT = r"^00-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$"


def _run_demo(tmp_path, *extra):
    out = tmp_path / "summary.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "demo_job.py"), "--records", "400",
         "--json-summary", str(out), *extra],
        capture_output=True, text=True, timeout=240, cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text()), proc.stdout


def test_demo_job_against_existing_broker_matches_dlq_topic(tmp_path, broker):
    """`make run ARGS="--bootstrap-servers ..."`: the printed summary matches the topic exactly."""
    import re

    sys.path.insert(0, str(ROOT / "examples"))
    from demo_job import FLAKY_EVERY, POISON_EVERY

    topic = "dlq.e2e-demo"
    summary, stdout = _run_demo(tmp_path, "--bootstrap-servers", broker.bootstrap_servers,
                                "--dlq-topic", topic)
    n = 400
    poison = {i for i in range(n) if i % POISON_EVERY == 7}
    flaky = {i for i in range(n) if i % FLAKY_EVERY == 3 and i not in poison}
    assert summary["records_in"] == n
    assert summary["succeeded"] == n - len(poison)
    assert summary["dead_lettered"] == len(poison)
    assert summary["failed"] == 0
    # every flaky record failed twice, then succeeded: two retries each, none dead-lettered
    assert summary["retries"] == 2 * len(flaky)

    records = [m for m in read_all(broker.bootstrap_servers, topic)
               if dict(m.headers()).get("spillway.job") == summary["job"].encode()]
    assert len(records) == summary["dlq_records_read_back"] == len(poison)
    keys = sorted(m.key() for m in records)
    assert keys == sorted(f"order-{i}".encode() for i in poison)  # each exactly once
    for m in records:
        h = dict(m.headers())
        i = int(m.key().decode().split("-")[1])
        assert m.value() == b'{"order_id": %d, "amount": ' % i  # original bytes
        assert h["source"] == b"demo"                          # original header copied
        assert h["__connect.errors.topic"] == b"orders"
        assert h["__connect.errors.partition"] == str(i % 2).encode()
        assert h["__connect.errors.offset"] == str(i // 2).encode()
        assert h["__connect.errors.connector.name"] == summary["job"].encode()
        assert h["__connect.errors.stage"] == b"TRANSFORMATION"
        assert h["__connect.errors.class.name"].endswith(b"enrich")
        assert h["__connect.errors.exception.class.name"] == b"json.decoder.JSONDecodeError"
        assert h["__connect.errors.exception.message"]
        assert b"Traceback" in h["__connect.errors.exception.stacktrace"]
        assert re.match(r"^\d+\.\d+$", h["__connect.errors.task.id"].decode())
        assert re.match(TRACEPARENT, h["traceparent"].decode())
    assert "dead-lettered" in stdout and "__connect.errors.exception.class.name" in stdout


def test_tolerance_none_fails_the_job_naming_stage_and_exception(tmp_path, broker):
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "demo_job.py"), "--records", "100",
         "--bootstrap-servers", broker.bootstrap_servers, "--dlq-topic", "dlq.e2e-none",
         "--set", "errors.tolerance=none"],
        capture_output=True, text=True, timeout=240, cwd=ROOT,
    )
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    # The demo stops Spark before printing its reason, so the reason is its last line; a
    # worker of a cancelled task may still print after it (it is another process), so the
    # check takes the demo's own last line.
    lines = [ln for ln in proc.stderr.strip().splitlines() if " FAILED: " in ln]
    assert lines, proc.stderr[-3000:]
    last = lines[-1]
    assert last.startswith("job spillway-demo-"), last
    assert "TRANSFORMATION" in last and "JSONDecodeError" in last, last
