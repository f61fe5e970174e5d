"""Writes docs/CLI.md from the `spillway` command's own parser (spillway.sidecar.cli.main).

The parser is the single source of truth: every command, option, default and help text comes
from it; tests/unit/project/test_cli_doc.py fails when the doc is stale or an option has no
help text.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from pathlib import Path

from spillway.sidecar.cli.main import build_parser

HEADER = """# Command line reference

Generated from the `spillway` command's parser by `scripts/gen_cli_doc.py`; do not edit by hand.
`spillway COMMAND --help` prints the same text.

The client commands (`status`, `job`, `dlq`) exit 0 when they did what was asked, 2 when they
could not (a refused or failed call, bad input: the message says which) and 1 where a command
documents it (e.g. `job end` of a run that is not live). How-tos: DLQ.md (tail, redrive),
OBSERVABILITY.md (status), SECURITY.md (credentials), DEPLOY.md (serve).
"""


def commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()
             ) -> Iterator[tuple[tuple[str, ...], argparse.ArgumentParser, str]]:
    """Every (sub)command under ``parser``: its words, its parser and its one-line help."""
    for action in parser._actions:   # argparse has no public walk of its subcommands
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help or "" for a in action._choices_actions}
            for name, sub in action.choices.items():
                yield (*path, name), sub, helps.get(name, "")
                yield from commands(sub, (*path, name))


def options(parser: argparse.ArgumentParser) -> Iterator[argparse.Action]:
    """The documented arguments of one command (help, version and hidden ones aside)."""
    for a in parser._actions:
        if isinstance(a, (argparse._HelpAction, argparse._SubParsersAction)):
            continue
        if a.help == argparse.SUPPRESS:
            continue
        yield a


def _flag(a: argparse.Action) -> str:
    if not a.option_strings:
        return f"`{a.metavar or a.dest.upper()}`"
    takes = a.nargs != 0
    meta = a.metavar or a.dest.upper()
    return ", ".join(f"`{o} {meta}`" if takes else f"`{o}`" for o in a.option_strings)


def _default(a: argparse.Action) -> str:
    if a.nargs == 0 or a.default in (None, argparse.SUPPRESS, False, []):
        return ""
    if a.help and "default" in a.help.lower():
        return ""
    return f" (default `{a.default}`)"


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def render() -> str:
    root = build_parser()
    root.prog = "spillway"
    out = [HEADER]
    top = [a for a in options(root)]
    out.append("## spillway\n")
    out.append("Options before the command:\n")
    out.append("| option | what |\n| --- | --- |")
    for a in top:
        out.append(f"| {_flag(a)} | {_cell(a.help or '')}{_default(a)} |")
    out.append("")
    for words, sub, summary in commands(root):
        out.append(f"## spillway {' '.join(words)}\n")
        if summary:
            out.append(f"{_cell(summary)[:1].upper()}{_cell(summary)[1:]}.\n")
        usage = " ".join(sub.format_usage().split())
        usage = usage.removeprefix("usage: ")
        out.append(f"```\n{usage}\n```\n")
        if sub.description and _cell(sub.description) != _cell(summary):
            out.append(f"{sub.description.strip()}\n")
        opts = list(options(sub))
        if opts:
            out.append("| argument | what |\n| --- | --- |")
            for a in opts:
                out.append(f"| {_flag(a)} | {_cell(a.help or '')}{_default(a)} |")
            out.append("")
    return "\n".join(out).rstrip() + "\n"


def undocumented() -> list[str]:
    """Options of any command without a help text (each must say what it does)."""
    root = build_parser()
    missing = [f"spillway {a.option_strings or a.dest}" for a in options(root) if not a.help]
    for words, sub, _ in commands(root):
        missing += [f"spillway {' '.join(words)} {'/'.join(a.option_strings) or a.dest}"
                    for a in options(sub) if not a.help]
    return missing


def main() -> int:
    target = Path(__file__).resolve().parent.parent / "docs" / "CLI.md"
    target.write_text(render())
    print(f"wrote {target}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
