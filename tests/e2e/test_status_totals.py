"""Counts that outlive a run (issue 45), end to end: `spillway serve` and Tansu as their own
processes, three short demo jobs (each its own Spark application, a real local Spark, one after
the other in one driver process) that dead-letter some records and end, then `spillway status`
(text and --json) as the operator runs it and a scrape of the Prometheus endpoint: the runs are
gone, their counts are not."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import urllib.request

import pytest

from support import paths, serve
from support.kafka import read_all
from support.promql import Served

# the three runs are the first test's set-up: bounded together, not each by the default 300 s
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

RECORDS = (100, 150, 200)   # every 50th record, from the 8th, is poison: 2, 3 and 4 dead letters
TOPIC = "dlq.e2e-status-totals"


@pytest.fixture(scope="module")
def ran(broker, tmp_path_factory):
    """The sidecar (log in its work directory), after three demo runs ended on it; yields its
    address, the operator's environment, the Prometheus port and the demos' summaries."""
    from support.ports import free_port

    work = tmp_path_factory.mktemp("status-totals")
    env = {**os.environ, "XDG_STATE_HOME": str(work / "state"), "GRPC_VERBOSITY": "NONE"}
    port = free_port()
    with open(work / "sidecar.log", "w") as log:
        proc, address = serve.spawn(
            ["--listen", "127.0.0.1:0", "--bootstrap-servers", broker.bootstrap_servers,
             "--set", f"spool.dir={work / 'spool'}",
             "--set", "metrics.prometheus.host=127.0.0.1",
             "--set", f"metrics.prometheus.port={port}"], env=env, stderr=log)
    try:
        # One driver runs the demo's main() once per run: each run its own SparkContext (its
        # own Spark application) in one JVM, not a JVM and its start-up per run (~40 CPU s
        # under the suite's load, with two runs' worth of them the fixture passed 300 s).
        outs = [work / f"summary-{n}.json" for n in RECORDS]
        runs = [["--records", str(n), "--sidecar", address, "--bootstrap-servers",
                 broker.bootstrap_servers, "--dlq-topic", TOPIC, "--json-summary", str(out)]
                for n, out in zip(RECORDS, outs)]
        driver = ("import json, sys; from support.spark import load_example; "
                  "demo = load_example('demo_job'); "
                  "sys.exit(next((rc for rc in map(demo.main, json.loads(sys.argv[1])) if rc), 0))")
        demo = subprocess.run([sys.executable, "-c", driver, json.dumps(runs)],
                              capture_output=True, text=True, timeout=540, cwd=paths.ROOT,
                              env={**env, "PYTHONPATH": os.pathsep.join(
                                  [str(paths.ROOT / "tests"), env.get("PYTHONPATH", "")])})
        assert demo.returncode == 0, demo.stdout[-3000:] + demo.stderr[-3000:]
        summaries = [json.loads(out.read_text()) for out in outs]
        yield address, env, port, summaries
    finally:
        serve.stop(proc)


def _cli(env, *args):
    out = subprocess.run([sys.executable, "-m", "spillway.sidecar.cli", *args],
                         capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_the_three_runs_dead_lettered_what_they_said(ran, broker):
    _, _, _, summaries = ran
    assert [s["dead_lettered"] for s in summaries] == [2, 3, 4]
    jobs = {s["job"].encode() for s in summaries}
    written = [m for m in read_all(broker.bootstrap_servers, TOPIC)
               if dict(m.headers()).get("spillway.job") in jobs]
    assert len(written) == 9


def test_status_shows_the_totals_and_the_ended_runs_after_the_runs_are_gone(ran):
    address, env, _, summaries = ran
    text = _cli(env, "status", "--sidecar", address)
    totals = dict(re.findall(r"^  (\S+)\s+(\d+)$", text.split("totals since", 1)[1]
                             .split("ended runs:", 1)[0], re.M))
    assert int(totals["dlq-records-written"]) == 9
    assert int(totals["total-records-skipped"]) == 9
    assert int(totals["total-retries"]) == sum(s["retries"] for s in summaries) > 0
    assert re.search(r"^  runs-ended\s+completed=3 expired=0 failed=0$", text, re.M), text
    # the live runs' counts are empty: every run ended
    assert re.search(r"^  total-records-skipped\s+0$", text.split("totals since")[0], re.M)
    assert re.search(r"^  jobs\s+0$", text, re.M)
    assert "ended runs: 3 shown, newest first" in text
    for s in summaries:
        line = re.search(rf"^ended {s['job']}: completed \(run .+\)\n  (.+)$", text, re.M)
        assert line, text
        assert f"dlq-written={s['dead_lettered']}" in line.group(1)

    status = json.loads(_cli(env, "status", "--sidecar", address, "--json"))
    t = status["totals"]
    assert int(t["dlqRecordsWritten"]) == 9 and int(t["totalRecordsSkipped"]) == 9
    assert int(t["totalRetries"]) == sum(s["retries"] for s in summaries)
    assert {k: int(v) for k, v in t["runsEnded"].items()} == {"completed": 3, "expired": 0,
                                                               "failed": 0}
    ended = {r["summary"]["job"]: r for r in status["endedRuns"]}
    assert [r["summary"]["job"] for r in status["endedRuns"]] == \
        [s["job"] for s in reversed(summaries)]                     # newest first
    for s in summaries:
        r = ended[s["job"]]
        assert r["outcome"] == "completed"
        assert int(r["summary"]["dlqRecordsWritten"]) == s["dead_lettered"]
        assert int(r["summary"]["totalRetries"]) == s["retries"]
        assert int(r["startedMs"]) <= int(r["endedMs"])
    assert status["jobs"] == [] and status["jobsHidden"] == 0
    assert status["counters"]["total-records-skipped"] == 0         # live runs only


def test_prometheus_serves_the_totals_and_no_ended_runs_series(ran):
    _, _, port, summaries = ran
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        scrape = Served(resp.read().decode())

    def value(series: str) -> float:
        m = re.search(rf"^{re.escape(series)} (\S+)$", scrape.text, re.M)
        assert m, f"{series} not served"
        return float(m.group(1))

    assert value("spillway_sidecar_dlq_records_total") == 9
    assert value("spillway_sidecar_records_skipped_total") == 9
    assert value("spillway_sidecar_retries_total") == sum(s["retries"] for s in summaries)
    assert value('spillway_runs_ended_total{outcome="completed"}') == 3
    assert value('spillway_runs_ended_total{outcome="failed"}') == 0
    # per-job series still end with their run
    for s in summaries:
        assert f'job="{s["job"]}"' not in scrape.text
