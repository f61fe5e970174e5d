"""Every exported metric is documented with its KIP name."""

from pathlib import Path

from spillway.sidecar.telemetry import METRICS

DOC = (Path(__file__).resolve().parents[2] / "docs" / "OBSERVABILITY.md").read_text()


def test_every_metric_is_in_the_mapping_table():
    for kip, (name, *_rest) in METRICS.items():
        assert f"| `{kip}` | `{name}` |" in DOC, f"{kip} -> {name} missing from OBSERVABILITY.md"
