"""docs/CONFIGURATION.md is generated from the property table and must match it."""

import runpy

from support import paths

ROOT = paths.ROOT


def test_configuration_doc_matches_the_property_table():
    render = runpy.run_path(str(ROOT / "scripts" / "gen_config_doc.py"))["render"]
    assert (ROOT / "docs" / "CONFIGURATION.md").read_text() == render(), (
        "docs/CONFIGURATION.md is stale: run `.venv/bin/python scripts/gen_config_doc.py`")
