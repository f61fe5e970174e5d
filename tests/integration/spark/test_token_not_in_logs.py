"""No run's job token in what Spark ships or logs (issue 44): a short client program
(tests/support/token_job.py) runs a job with failures in its own process, on classic Spark
under spark-submit (Spark's default logging for an application: INFO, driver and executors in
one log, plus the event log) and as a Spark Connect client of a server started with Spark's
default logging, ending its session before it released an execution (the server then logs
that execution's plan), and running a streaming query, whose executors claim the token the
driver escrowed with the run's home (no session file reaches them). The job still
dead-letters its failures with exact counts; the token occurs nowhere in the pickled functions
or plans, nor in any log line.

The token is read from the 0600 file the program wrote; the logs are searched whole."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support import paths
from support.connect import running_connect_server, spark_home

pytestmark = [pytest.mark.integration, pytest.mark.slow]

PROGRAM = paths.ROOT / "tests" / "support" / "token_job.py"


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("SPARK_CONNECT_MODE_ENABLED", "SPARK_REMOTE", "SPILLWAY_SIDECAR_ADDRESS")}
    env.update(SPARK_LOCAL_IP="127.0.0.1", PYSPARK_PYTHON=sys.executable,
               PYSPARK_DRIVER_PYTHON=sys.executable, SPARK_HOME=str(spark_home()), **extra)
    return env


def _run(cmd: list[str], log: Path, env: dict[str, str]) -> None:
    with open(log, "wb") as out:
        proc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, timeout=600)
    assert proc.returncode == 0, log.read_text(errors="replace")[-4000:]


def _hits(token: str, *paths: Path) -> int:
    return sum(p.read_bytes().count(token.encode()) for p in paths)


def test_a_classic_job_ships_and_logs_no_token(sidecar, broker, topic_name, tmp_path):
    events = tmp_path / "events"
    events.mkdir()
    log = tmp_path / "spark-submit.log"
    _run([str(spark_home() / "bin" / "spark-submit"), "--master", "local[2]",
          "--conf", "spark.ui.enabled=false", "--conf", "spark.driver.host=127.0.0.1",
          "--conf", "spark.eventLog.enabled=true", "--conf", f"spark.eventLog.dir={events}",
          "--conf", "spark.python.worker.reuse=true",
          str(PROGRAM), "classic", "-", sidecar.address, topic_name, str(tmp_path)],
         log, _env())
    token = (tmp_path / "token").read_text()
    result = json.loads((tmp_path / "result.json").read_text())
    # the job as before: each wrapper's 3 failures skipped and dead-lettered, the rest kept
    assert (result["parsed"], result["udf_nulls"], result["rdd"]) == (27, 3, 27)
    assert (result["failures"], result["skipped"], result["dlq"]) == (9, 9, 9)
    assert result["shipped"] == 2 and result["token_in_shipped"] == 0
    text = log.read_text(errors="replace")
    assert " INFO " in text and "Added file" in text and "spillway-jobtoken-" in text
    event_logs = [p for p in events.rglob("*") if p.is_file()]
    assert event_logs
    assert _hits(token, log, *event_logs) == 0


def test_a_connect_client_leaves_no_token_in_the_servers_log(sidecar, broker, topic_name,
                                                             tmp_path):
    workdir = tmp_path / "server"
    with running_connect_server(workdir, env={"SPILLWAY_SIDECAR_ADDRESS": sidecar.address}
                                ) as server:
        _run([sys.executable, str(PROGRAM), "connect", server.url, sidecar.address,
              topic_name, str(tmp_path)], tmp_path / "client.log", _env())
        deadline = time.monotonic() + 60   # the server removes the session it was told to end
        while "removed in removeSession" not in server.log_path.read_text(errors="replace") \
                and time.monotonic() < deadline:
            time.sleep(0.5)
    token = (tmp_path / "token").read_text()
    result = json.loads((tmp_path / "result.json").read_text())
    assert (result["parsed"], result["udf_nulls"], result["first"]) == (27, 3, True)
    assert (result["failures"], result["skipped"], result["dlq"]) == (6, 6, 6)
    assert result["stream_failures"] >= 4     # the streaming query's executors claimed it
    assert result["shipped"] == 3 and result["token_in_shipped"] == 0
    text = server.log_path.read_text(errors="replace")
    # Spark's default logging, and the scenario: an execution's plan logged at INFO
    assert " INFO " in text and "removed in removeSession" in text
    assert _hits(token, server.log_path, tmp_path / "client.log") == 0
