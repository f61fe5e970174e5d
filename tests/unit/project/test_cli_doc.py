"""docs/CLI.md is generated from the `spillway` command's parser and must match it."""

import runpy

from support import paths

ROOT = paths.ROOT


def _gen():
    return runpy.run_path(str(ROOT / "scripts" / "gen_cli_doc.py"))


def test_the_cli_reference_matches_the_parser():
    assert (ROOT / "docs" / "CLI.md").read_text() == _gen()["render"](), (
        "docs/CLI.md is stale: run `.venv/bin/python scripts/gen_cli_doc.py`")


def test_every_option_of_every_command_says_what_it_does():
    assert _gen()["undocumented"]() == []
