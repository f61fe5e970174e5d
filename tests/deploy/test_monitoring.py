"""deploy/monitoring, offline: the Grafana dashboard and the Prometheus alert rules.

- the dashboard is importable JSON with a data source variable, a job and an instance selector,
  panels on a grid that do not overlap, and every query filtered by both selectors;
- the rules and every dashboard query parse (promtool, Debian package prometheus: `make venv`
  unpacks its binary into the venv), the alerts fire on the series they are about and not on
  others (`promtool test rules`), each points to its entry in docs/OBSERVABILITY.md;
- every metric and label they name is served by a real `spillway serve` (its own process, on
  loopback, log-only, with a live run and an ended one); the totals that outlive the runs
  (ADDED_BY_THE_STATUS_CHANGE) are checked on their own.

The kustomize component that loads the rules and scrapes the DaemonSet:
test_monitoring_component.py.
"""
from __future__ import annotations

import json
import re
import subprocess
import urllib.request
from pathlib import Path

import grpc
import pytest
import yaml
from support import paths, serve
from support.promql import Served, grafana_to_promql, label_names, metric_names
from support.recipes import tool

ROOT = paths.ROOT
MONITORING = ROOT / "deploy" / "monitoring"
DASHBOARD = MONITORING / "spillway-dashboard.json"
RULES = MONITORING / "spillway-rules.yaml"
DOC = paths.DOCS / "OBSERVABILITY.md"
PROMTOOL_HINT = "Debian package prometheus; `make venv` unpacks it (scripts/install-promtool.sh)"

# Added by the status change (issue 45, "counts that outlive a run"): sidecar-wide totals that
# outlive the runs, read by the dashboard's total panels and by the SpillwayRunFailed alert
# (which reads outcome="failed" for a failed run); test_the_status_changes_totals_are_served
# checks a real sidecar serves each.
ADDED_BY_THE_STATUS_CHANGE = frozenset({
    "spillway_runs_ended_total",
    "spillway_sidecar_record_failures_total",
    "spillway_sidecar_record_errors_total",
    "spillway_sidecar_records_skipped_total",
    "spillway_sidecar_retries_total",
    "spillway_sidecar_errors_logged_total",
    "spillway_sidecar_records_dropped_total",
    "spillway_sidecar_dlq_records_total",
})
STATUS_CHANGE_LABELS = frozenset({"outcome"})
# Prometheus' own: the scrape's health, and the target labels it adds to every series
# (`node`: the PodMonitor's relabeling)
PROMETHEUS_METRICS = frozenset({"up"})
TARGET_LABELS = frozenset({"job", "instance", "node"})

# --- what a real sidecar serves ----------------------------------------------------------------


def _run(stub, pb, job: str, properties: dict[str, str], *, end: bool) -> None:
    """A run with one failed record, as an executor reports it; ended by its owner if asked."""
    reg = stub.RegisterJob(pb.RegisterJobRequest(job=job, run_id="run-1", properties=properties),
                           timeout=20)
    md = [("spillway-job-token", reg.job_token)]
    record = pb.FailedRecord(record_id="r0", stage=pb.STAGE_TRANSFORMATION,
                             function_name="app.f", value=b"x",
                             exception=pb.ExceptionInfo(class_name="builtins.ValueError",
                                                        class_chain=["builtins.ValueError"]))
    stub.ReportFailures(pb.ReportFailuresRequest(
        job=job, run_id="run-1", records=[record],
        task=pb.TaskIdentity(stage_id=1, partition_id=0, attempt_number=0, task_attempt_id=1)),
        timeout=10, metadata=md)
    if end:
        stub.EndJob(pb.EndJobRequest(job=job, run_id="run-1"), timeout=20, metadata=md)


@pytest.fixture(scope="module")
def served() -> Served:
    """One scrape of `spillway serve` (log-only: no Kafka) holding a live run with an error
    and having ended a failed one. The DLQ, spool and Kafka series of a sidecar without Kafka
    are announced (# TYPE) with no sample: their names count, their labels are documented."""
    from support.ports import free_port
    from spillway.v1 import sidecar_pb2 as pb
    from spillway.v1 import sidecar_pb2_grpc as pb_grpc

    port = free_port()
    proc, address = serve.spawn(["--listen", "127.0.0.1:0", "--unix-socket", ""],
                                extra_env={"SPILLWAY_METRICS_PROMETHEUS_HOST": "127.0.0.1",
                                           "SPILLWAY_METRICS_PROMETHEUS_PORT": str(port)})
    try:
        with grpc.insecure_channel(address) as channel:
            stub = pb_grpc.ErrorSidecarStub(channel)
            _run(stub, pb, "dash-live", {"errors.tolerance": "all"}, end=False)
            _run(stub, pb, "dash-failed", {"errors.tolerance": "none"}, end=True)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
            return Served(resp.read().decode())
    finally:
        serve.stop(proc)


def test_the_promql_readers_see_what_they_look_for():
    expr = ('histogram_quantile(0.99, sum by (le, instance) (rate(a_bucket{job=~"x", '
            'instance!="y"}[5m]))) / on(job) group_left(node) b_total offset 5m > bool 1 '
            'or count(up == 0) or vector(0)')
    assert metric_names(expr) == {"a_bucket", "b_total", "up"}
    assert label_names(expr) == {"le", "instance", "job", "node"}


# --- the dashboard -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def _panels(dashboard: dict) -> list[dict]:
    out = []
    for p in dashboard["panels"]:
        out.append(p)
        out.extend(p.get("panels", []))   # a collapsed row holds its panels
    return out


def _queries(dashboard: dict) -> list[tuple[str, str]]:
    """(where, expression) of every panel query."""
    return [(f"panel {p['id']} {p['title']!r} {t['refId']}", t["expr"])
            for p in _panels(dashboard) for t in p.get("targets", [])]


def test_the_dashboard_is_an_importable_grafana_dashboard(dashboard):
    assert dashboard.get("id") is None                    # the importing Grafana assigns it
    assert dashboard["uid"] and re.fullmatch(r"[a-zA-Z0-9_-]{1,40}", dashboard["uid"])
    assert dashboard["title"] and isinstance(dashboard["schemaVersion"], int)
    assert dashboard["schemaVersion"] >= 36              # Grafana 9 and later
    assert "__inputs" not in dashboard                   # no data source to pick at import
    assert dashboard["time"]["from"] and dashboard["time"]["to"]
    panels = _panels(dashboard)
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "panel ids repeat"
    assert {p["type"] for p in panels} <= {"row", "stat", "timeseries", "gauge", "bargauge",
                                           "table", "text"}
    taken: dict[tuple[int, int], int] = {}
    for p in panels:
        g = p["gridPos"]
        assert all(isinstance(g[k], int) for k in "hwxy"), p["title"]
        assert g["x"] >= 0 and g["w"] > 0 and g["x"] + g["w"] <= 24, p["title"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in taken, f"{p['title']!r} overlaps panel {taken[(x, y)]}"
                taken[(x, y)] = p["id"]
        if p["type"] != "row":
            assert p["title"] and p.get("description"), p["id"]
            assert p["targets"], p["title"]
    rows = [p["title"] for p in panels if p["type"] == "row"]
    for area in ("Health", "Errors", "Dead letters", "Spool", "Backpressure", "Home calls"):
        assert area in rows, area


def test_the_dashboard_has_a_datasource_variable_and_job_and_instance_selectors(dashboard):
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    ds = variables["datasource"]
    assert ds["type"] == "datasource" and ds["query"] == "prometheus"
    for name, label in (("job", "job"), ("instance", "instance")):
        v = variables[name]
        assert v["type"] == "query" and v["multi"] and v["includeAll"]
        assert v["datasource"]["uid"] == "${datasource}"
        assert re.fullmatch(rf"label_values\((.+), {label}\)", v["query"]), v["query"]
    assert '$job' in variables["instance"]["query"]      # the instances of the chosen jobs
    # every panel and query reads the chosen data source, never a fixed one
    for p in _panels(dashboard):
        if p["type"] != "row":
            assert p["datasource"]["uid"] == "${datasource}", p["title"]
            assert all(t["datasource"]["uid"] == "${datasource}" for t in p["targets"])
    # and every series it reads is narrowed to the chosen jobs and instances
    for where, expr in _queries(dashboard):
        selectors = re.findall(r"\b[a-z_:][a-z0-9_:]*\{([^}]*)\}", expr)
        bare = [n for n in metric_names(expr) if not re.search(rf"\b{n}\{{", expr)]
        assert selectors and not bare, f"{where}: a series read without the selectors: {expr}"
        for sel in selectors:
            assert 'job=~"$job"' in sel and 'instance=~"$instance"' in sel, (where, expr)


def _variable_selectors(dashboard: dict) -> list[tuple[str, str]]:
    out = []
    for v in dashboard["templating"]["list"]:
        if v["type"] == "query":
            [selector] = re.findall(r"label_values\((.+), \w+\)", v["query"])
            out.append((f"variable {v['name']}", selector))
    return out


def test_the_dashboard_shows_what_an_operator_watches(dashboard):
    read = set().union(*(metric_names(e) for _, e in _queries(dashboard)))
    for name in ("up", "spillway_kafka_reachable", "spillway_backpressure",
                 "spillway_records_refused_total", "spillway_spool_records",
                 "spillway_spool_records_limit", "spillway_spool_size_bytes",
                 "spillway_spool_size_limit_bytes", "spillway_home_confirm_calls_total",
                 "spillway_dlq_write_failures_total", "spillway_verdict_duration_seconds_bucket",
                 "spillway_record_errors_total"):
        assert name in read, name
    # every total that outlives the runs has a panel
    assert ADDED_BY_THE_STATUS_CHANGE <= read, sorted(ADDED_BY_THE_STATUS_CHANGE - read)


# --- the rules ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def rules() -> list[dict]:
    return [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]


def _alerts(rules) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for r in rules:
        out.setdefault(r["alert"], []).append(r)
    return out


def test_the_rules_alert_on_what_the_issue_names(rules):
    alerts = _alerts(rules)
    assert {"SpillwaySidecarDown", "SpillwayRunFailed", "SpillwaySpoolNearHighWater",
            "SpillwayKafkaUnreachable", "SpillwayRefusingReports"} <= set(alerts)
    assert all("alert" in r for r in rules)              # alerts only, no recording rules


def test_every_alert_says_what_happened_and_points_to_its_runbook(rules):
    doc = DOC.read_text()
    anchors = {re.sub(r"[^a-z0-9 -]", "", h.strip().lower()).replace(" ", "-")
               for h in re.findall(r"^#+ (.+)$", doc, re.M)}
    for r in rules:
        ann, labels = r["annotations"], r["labels"]
        assert labels["severity"] in ("warning", "critical"), r["alert"]
        assert ann["summary"] and len(ann["description"]) > 60, r["alert"]
        page, _, anchor = ann["runbook_url"].partition("#")
        assert page == "docs/OBSERVABILITY.md" and anchor in anchors, (r["alert"], anchor)
        assert anchor == r["alert"].lower()              # each alert its own entry


def test_the_rules_pass_promtool():
    promtool = tool("promtool", PROMTOOL_HINT)
    out = subprocess.run([promtool, "check", "rules", "--lint=all", "--lint-fatal", str(RULES)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def test_every_dashboard_query_parses(dashboard, tmp_path):
    """promtool parses them as the expressions of recording rules (Grafana's variables given
    values); the variables' selectors too."""
    promtool = tool("promtool", PROMTOOL_HINT)
    queries = _queries(dashboard) + _variable_selectors(dashboard)
    rules = [{"record": f"dashboard:query_{i}", "expr": grafana_to_promql(expr)}
             for i, (_, expr) in enumerate(queries)]
    path = tmp_path / "dashboard-queries.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    out = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"SUCCESS: {len(rules)} rules found" in out.stdout
    # the check has teeth: a broken query is refused
    path.write_text(yaml.safe_dump({"groups": [{"name": "d", "rules": [
        {"record": "dashboard:broken", "expr": "sum(rate(spillway_jobs[5m])"}]}]}))
    out = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode != 0


# promtool test rules: series (expanding notation, one value a minute) and the alerts expected
# at a time. Annotations are compared too, so the cases run on the rules without them; one
# alert's annotations are checked rendered (test_an_alerts_annotations_render).
INSTANCE = {"job": "spillway-sidecar", "instance": "10.0.0.1:9464"}


def _series(name: str, values: str, **labels: str) -> dict:
    lab = {**INSTANCE, **labels}
    return {"series": name + "{" + ",".join(f'{k}="{v}"' for k, v in sorted(lab.items())) + "}",
            "values": values}


def _expect(alert: str, at: str, *firing: dict) -> dict:
    return {"eval_time": at, "alertname": alert,
            "exp_alerts": [{"exp_labels": labels} for labels in firing]}


FIRING_CASES = [
    # a sidecar that stops answering: down after 5 minutes, not before
    ([_series("up", "1 1 0x10")],
     [_expect("SpillwaySidecarDown", "5m"),
      _expect("SpillwaySidecarDown", "8m", {**INSTANCE, "severity": "critical"})]),
    ([_series("up", "1x10", job="other", instance="10.0.0.9:9100"), _series("up", "1x10")],
     [_expect("SpillwaySidecarDown", "10m")]),
    # a run that ended failed, even one too short to be seen live; a run that ended well: no
    ([_series("spillway_runs_ended_total", "0 0 1 1 1", outcome="failed"),
      _series("spillway_runs_ended_total", "0 3 6 9 12", outcome="succeeded")],
     [_expect("SpillwayRunFailed", "1m"),
      _expect("SpillwayRunFailed", "3m", {**INSTANCE, "outcome": "failed",
                                         "severity": "warning"})]),
    ([_series("spillway_jobs_failed", "0 0 2 2")],
     [_expect("SpillwayRunFailing", "1m"),
      _expect("SpillwayRunFailing", "2m", {**INSTANCE, "severity": "warning"})]),
    # the spool above 80 % of either mark for 5 minutes; 50 % of both: no
    ([_series("spillway_spool_records", "850x10"),
      _series("spillway_spool_records_limit", "1000x10"),
      _series("spillway_spool_size_bytes", "10x10"),
      _series("spillway_spool_size_limit_bytes", "100x10")],
     [_expect("SpillwaySpoolNearHighWater", "4m"),
      _expect("SpillwaySpoolNearHighWater", "6m", {**INSTANCE, "severity": "warning"})]),
    ([_series("spillway_spool_records", "100x10"),
      _series("spillway_spool_records_limit", "1000x10"),
      _series("spillway_spool_size_bytes", "90x10"),
      _series("spillway_spool_size_limit_bytes", "100x10")],
     [_expect("SpillwaySpoolNearHighWater", "6m", {**INSTANCE, "severity": "warning"})]),
    ([_series("spillway_spool_records", "500x10"),
      _series("spillway_spool_records_limit", "1000x10"),
      _series("spillway_spool_size_bytes", "50x10"),
      _series("spillway_spool_size_limit_bytes", "100x10")],
     [_expect("SpillwaySpoolNearHighWater", "10m")]),
    # Kafka unreachable for 5 minutes
    ([_series("spillway_kafka_reachable", "1 0x10")],
     [_expect("SpillwayKafkaUnreachable", "4m"),
      _expect("SpillwayKafkaUnreachable", "7m", {**INSTANCE, "severity": "warning"})]),
    # refusing reports: backpressure now, or refusals between two scrapes
    ([_series("spillway_backpressure", "0 1x5"), _series("spillway_records_refused_total", "0x6")],
     [_expect("SpillwayRefusingReports", "3m", {**INSTANCE, "severity": "critical"})]),
    ([_series("spillway_backpressure", "0x10"),
      _series("spillway_records_refused_total", "0 0 500 500 500 500")],
     [_expect("SpillwayRefusingReports", "1m"),
      _expect("SpillwayRefusingReports", "4m", {**INSTANCE, "severity": "critical"})]),
    ([_series("spillway_backpressure", "0x10"), _series("spillway_records_refused_total", "0x10")],
     [_expect("SpillwayRefusingReports", "10m")]),
    ([_series("spillway_dlq_rejected_total", "0 0 2 2")],
     [_expect("SpillwayDeadLettersRejected", "1m"),
      _expect("SpillwayDeadLettersRejected", "3m", {**INSTANCE, "severity": "warning"})]),
]


def _promtool_test(tmp_path: Path, rules_doc: dict, tests: list[dict]) -> str:
    promtool = tool("promtool", PROMTOOL_HINT)
    rules_path = tmp_path / "rules.yaml"
    rules_path.write_text(yaml.safe_dump(rules_doc))
    test_path = tmp_path / "rules.test.yaml"
    test_path.write_text(yaml.safe_dump({"rule_files": [str(rules_path)],
                                         "evaluation_interval": "1m", "tests": tests}))
    out = subprocess.run([promtool, "test", "rules", str(test_path)], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def test_the_alerts_fire_on_what_they_are_about_and_not_on_the_rest(tmp_path):
    doc = yaml.safe_load(RULES.read_text())
    for group in doc["groups"]:
        for rule in group["rules"]:
            del rule["annotations"]
    tests = [{"interval": "1m", "input_series": series, "alert_rule_test": expected}
             for series, expected in FIRING_CASES]
    _promtool_test(tmp_path, doc, tests)
    # every alert has a case in which it fires
    fired = {e["alertname"] for _, expected in FIRING_CASES for e in expected
             if e["exp_alerts"]}
    assert fired == {r["alert"] for g in doc["groups"] for r in g["rules"]}


def test_an_alerts_annotations_render(tmp_path, rules):
    """The templates as Prometheus expands them: the instance, the fill as a percentage."""
    [rule] = _alerts(rules)["SpillwaySpoolNearHighWater"]
    instance = INSTANCE["instance"]
    expected = {k: v.replace("{{ $labels.instance }}", instance)
                .replace("{{ $value | humanizePercentage }}", "85%")
                for k, v in rule["annotations"].items()}
    assert "85%" in expected["summary"]
    series, _ = FIRING_CASES[4]
    _promtool_test(tmp_path, yaml.safe_load(RULES.read_text()), [{
        "interval": "1m", "input_series": series, "alert_rule_test": [{
            "eval_time": "6m", "alertname": "SpillwaySpoolNearHighWater", "exp_alerts": [{
                "exp_labels": {**INSTANCE, "severity": "warning"},
                "exp_annotations": expected}]}]}])


# --- every name exists -------------------------------------------------------------------------


def _named(dashboard, rules) -> list[tuple[str, str]]:
    return (_queries(dashboard) + _variable_selectors(dashboard)
            + [(f"alert {r['alert']}", r["expr"]) for r in rules])


def test_every_metric_named_is_served_by_a_real_sidecar(served, dashboard, rules):
    known = served.names | PROMETHEUS_METRICS
    for where, expr in _named(dashboard, rules):
        unknown = metric_names(expr) - known
        assert not unknown, f"{where}: not served by spillway serve: {sorted(unknown)}"


def test_every_label_named_is_served_by_a_real_sidecar(served, dashboard, rules):
    known = served.labels | TARGET_LABELS
    for where, expr in _named(dashboard, rules):
        unknown = label_names(expr) - known - {"le"}
        assert not unknown, f"{where}: labels no series has: {sorted(unknown)}"
    legends = {m for p in _panels(dashboard) for t in p.get("targets", [])
               for m in re.findall(r"\{\{\s*(\w+)\s*\}\}", t.get("legendFormat", ""))}
    templated = {m for r in rules for v in r["annotations"].values()
                 for m in re.findall(r"\$labels\.(\w+)", v)}
    assert legends | templated <= known, sorted((legends | templated) - known)


def test_the_served_metrics_pass_promtools_lint(served):
    promtool = tool("promtool", PROMTOOL_HINT)
    out = subprocess.run([promtool, "check", "metrics"], input=served.text,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def test_the_sidecar_served_the_runs_it_was_given(served):
    """The scrape the name checks read holds per-run series (a live run's) and counted the
    ended run: the checks above see a real sidecar's full set, not an idle one's."""
    assert 'spillway_record_errors_total{job="dash-live"' in served.text
    assert "spillway_jobs_ended_total 1" in served.text
    assert "spillway_spool_records_limit" in served.names     # announced without Kafka too


def test_the_status_changes_totals_are_served(served):
    present = ADDED_BY_THE_STATUS_CHANGE & served.names
    assert present == ADDED_BY_THE_STATUS_CHANGE, sorted(ADDED_BY_THE_STATUS_CHANGE - present)
    assert STATUS_CHANGE_LABELS <= served.labels
    # the failed run this scrape's sidecar ended, under the outcome SpillwayRunFailed reads
    assert re.search(r'^spillway_runs_ended_total\{[^}]*outcome="failed"[^}]*\} 1(\.0)?$',
                     served.text, re.M), served.text


def test_the_docs_tell_how_to_use_all_three():
    doc = DOC.read_text()
    for needle in ("deploy/monitoring/spillway-dashboard.json", "spillway-rules.yaml",
                   "rule_files", "components/monitoring", "gen-prometheusrule.sh",
                   "exported_job", "job_name: spillway-sidecar"):
        assert needle in doc, needle
