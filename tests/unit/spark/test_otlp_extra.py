"""Executors' tracing is installable: `spillway-spark[otlp]` declares the OTLP/gRPC exporter (a
range, like every dependency), docs/OBSERVABILITY.md says to install it, and an executor with
OTEL_EXPORTER_OTLP_ENDPOINT set but no exporter says so in one line, once, instead of Python's
"No module named 'opentelemetry.exporter'"."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib

from packaging.requirements import Requirement
from packaging.version import Version
from support import paths

ROOT = paths.ROOT


def _extra(name: str) -> list[Requirement]:
    meta = tomllib.loads((ROOT / "spark_integration" / "pyproject.toml").read_text())["project"]
    return [Requirement(r) for r in meta["optional-dependencies"][name]]


def _sdk_range() -> Requirement:
    meta = tomllib.loads((ROOT / "spark_integration" / "pyproject.toml").read_text())["project"]
    [sdk] = [Requirement(r) for r in meta["dependencies"] if r.startswith("opentelemetry-sdk")]
    return sdk


def test_the_otlp_extra_declares_the_grpc_exporter_as_a_range():
    [req] = _extra("otlp")
    assert req.name == "opentelemetry-exporter-otlp-proto-grpc"
    ops = {s.operator for s in req.specifier}
    assert ops == {">=", "<"}, f"{req}: a range, not a pin"
    # the exporter is released in lockstep with the SDK: the same range
    assert req.specifier == _sdk_range().specifier


def test_the_spark_image_pin_lies_inside_the_extra():
    pins = {}
    for line in (ROOT / "deploy" / "spark-requirements.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            pins[name.lower()] = Version(version)
    [req] = _extra("otlp")
    assert req.specifier.contains(pins[req.name])


def test_observability_doc_tells_how_to_install_it():
    doc = (ROOT / "docs" / "OBSERVABILITY.md").read_text()
    assert "pip install 'spillway-spark[otlp]'" in doc
    assert "OTEL_EXPORTER_OTLP_ENDPOINT" in doc


_NO_EXPORTER = r"""
import logging, os, sys
sys.modules["opentelemetry.exporter"] = None   # as on an executor without the package
from spillway.spark import _tracing
_tracing.ensure_provider()
_tracing._state["pid"] = None                  # a fork: the provider is set up again
_tracing.ensure_provider()
print("exporting", _tracing._state["exporting"])
"""


def test_a_missing_exporter_is_one_clear_line_once():
    clean = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    out = subprocess.run([sys.executable, "-c", _NO_EXPORTER], capture_output=True, text=True,
                         check=False,
                         env={**clean, "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:1"},
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["exporting", "False"]
    lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, out.stderr
    assert re.fullmatch(r"spillway: OTEL_EXPORTER_OTLP_ENDPOINT is set but this Python has no "
                        r"OTLP/grpc span exporter, so executor spans are not exported: "
                        r"pip install 'spillway-spark\[otlp\]'", lines[0]), lines[0]
    assert "No module named" not in out.stderr
