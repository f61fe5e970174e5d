"""Reading PromQL and a Prometheus scrape without a Prometheus: the metric and label names an
expression reads (tests/deploy/test_monitoring.py checks each is served), a Grafana query made
plain PromQL, and the names and labels a scrape of `/metrics` shows."""

from __future__ import annotations

import re

from prometheus_client.parser import text_string_to_metric_families

PROMQL_WORDS = frozenset({"and", "or", "unless", "bool", "offset", "by", "without", "on",
                          "ignoring", "group_left", "group_right", "inf", "nan"})


class Served:
    """What one scrape of `/metrics` shows: its sample names (every family announced, with or
    without samples) and the label names of its samples."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.names: set[str] = set()     # sample names: a histogram's _bucket, _count, _sum
        self.labels: set[str] = set()
        types = dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M))
        for family, kind in types.items():
            self.names |= ({family + s for s in ("_bucket", "_count", "_sum")}
                           if kind == "histogram" else {family})
        for fam in text_string_to_metric_families(text):
            for sample in fam.samples:
                self.labels |= set(sample.labels) - {"le"}
        # a run's `job` label: Prometheus keeps it as exported_job beside the target's job
        if "job" in self.labels:
            self.labels.add("exported_job")


_GRAFANA_VARS = {"$__rate_interval": "5m", "$__interval": "1m", "$__range": "1h",
                 "$job": "spillway-sidecar", "$instance": "10.0.0.1:9464"}


def grafana_to_promql(expr: str) -> str:
    """A dashboard query as Prometheus receives it: Grafana's variables given values."""
    for var, value in sorted(_GRAFANA_VARS.items(), key=lambda kv: -len(kv[0])):
        expr = expr.replace(var, value)
    assert "$" not in expr, f"a variable the dashboard does not define: {expr}"
    return expr


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads: its identifiers that are not functions,
    keywords, label names (in matchers and in by/without/on/ignoring/group_* lists) or
    durations."""
    s = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)          # string literals
    s = re.sub(r"\{[^}]*\}", " ", s)                        # label matchers
    s = re.sub(r"\[[^\]]*\]", " ", s)                       # ranges
    s = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", s)
    names = set()
    for m in re.finditer(r"(?<![\w.])([a-zA-Z_:][a-zA-Z0-9_:]*)(\s*\()?", s):
        if not m.group(2) and m.group(1).lower() not in PROMQL_WORDS:
            names.add(m.group(1))
    return names


def label_names(expr: str) -> set[str]:
    """The label names an expression matches on or groups by."""
    s = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    out = set(re.findall(r"([a-zA-Z_]\w*)\s*(?:=~|!~|!=|=)\s*\"", s))
    for group in re.findall(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)",
                            s):
        out |= {g.strip() for g in group.split(",") if g.strip()}
    return out
