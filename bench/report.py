"""Render the benchmark results as docs/BENCHMARKS.md (pure: strings in, a string out)."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence

from .model import (
    STATUS_MEASURED,
    Check,
    Figure,
    ProfileSection,
    TargetResult,
    fmt,
    result_from_dict,
    result_to_dict,
    verdict_text,
)

HEADER = "# Benchmarks"
_EMBED = re.compile(r"<!-- bench-results\n(.*?)\n-->", re.S)


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _table(head: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    out = ["| " + " | ".join(_cell(h) for h in head) + " |",
           "|" + "|".join(" --- " for _ in head) + "|"]
    out += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return out


def _met_text(check: Check) -> str:
    met = check.met
    return "not measured" if met is None else ("**met**" if met else "**missed**")


def _value_text(check: Check) -> str:
    if check.value is None:
        return "—"
    if check.kind == "ratio":
        return f"{fmt(check.value)}×"
    unit = f" {check.unit}" if check.unit else ""
    return f"{fmt(check.value)}{unit}"


def _figure_row(f: Figure) -> list[str]:
    if not f.values:
        return [f.name, f.unit, "—", "—", "—", "0"]
    s = f.summary
    name = f"{f.name} ({f.note})" if f.note else f.name
    return [name, f.unit, fmt(s.median), fmt(s.low), fmt(s.high), str(s.n)]


def _check_row(c: Check) -> list[str]:
    spread = f"{fmt(c.spread[0])}–{fmt(c.spread[1])}×" if c.spread else "—"
    return [c.name, _value_text(c), c.target_text, _met_text(c), spread, c.detail]


def _profile_lines(p: ProfileSection) -> list[str]:
    out = [f"**Profile: {p.title}** ({p.samples} samples, py-spy)", ""]
    if p.diagnosis:
        out += [f"Reading: {p.diagnosis}", ""]
    out += _table(["own time", "frame"], [[f"{share:.1%}", frame]
                                          for frame, share in p.self_frames])
    out.append("")
    if p.inclusive_frames:
        out += _table(["on stack", "frame"], [[f"{share:.1%}", frame]
                                              for frame, share in p.inclusive_frames])
        out.append("")
    return out


def summary_rows(results: Sequence[TargetResult]) -> list[list[str]]:
    rows = []
    for r in results:
        if r.status != STATUS_MEASURED or not r.checks:
            rows.append([str(r.number), r.title, "—", "—", verdict_text(r)])
            continue
        for i, c in enumerate(r.checks):
            met = c.met
            state = "not measured" if met is None else ("met" if met else "MISSED")
            rows.append([str(r.number) if i == 0 else "", r.title if i == 0 else "",
                         f"{c.name}: {_value_text(c)}", c.target_text, state])
    return rows


def render(results: Sequence[TargetResult], machine: Mapping[str, str], *, date: str,
           command: str, mode: str, seconds: float, runs: int,
           method_notes: Sequence[str] = ()) -> str:
    lines = [
        HEADER,
        "",
        f"Written by the benchmark harness (`{command}`, {mode} run, {runs} measured runs per "
        f"variant) on {date}, in {seconds / 60:.1f} min. Do not edit by hand: run "
        "`make bench` (full) or `make bench-short` again.",
        "",
        "Absolute figures describe this machine at this moment and are reported, never "
        "asserted; the targets are ratios measured in the same run (and a few absolute "
        "bounds), so they carry over between machines far better than the figures do.",
        "",
        "## Machine",
        "",
    ]
    lines += _table(["", ""], [[k, v] for k, v in machine.items()])
    lines += ["", "## Method", ""]
    lines += [f"- {n}" for n in method_notes]
    lines += ["", "## Summary", ""]
    lines += _table(["#", "target", "measured", "target", "result"], summary_rows(results))
    lines.append("")
    for r in results:
        lines += [f"## {r.number}. {r.title} — {verdict_text(r)}", ""]
        if r.measured:
            lines += [f"_Measured {r.measured}._", ""]
        if r.machine:
            flag = (" **Disturbed: not comparable with a run on an idle machine.**"
                    if r.disturbed else "")
            lines += [f"_While it ran: {r.machine}._{flag}", ""]
        if r.setup:
            lines += [r.setup, ""]
        if r.status != STATUS_MEASURED:
            lines += [f"Not measured: {r.reason}", ""]
            if r.notes:
                lines += [f"- {n}" for n in r.notes] + [""]
            continue
        if r.figures:
            lines += _table(["figure", "unit", "median", "min", "max", "runs"],
                            [_figure_row(f) for f in r.figures])
            lines.append("")
        if r.checks:
            lines += _table(["check", "measured", "target", "result",
                             "run-by-run ratio range", "from"],
                            [_check_row(c) for c in r.checks])
            lines.append("")
        if r.notes:
            lines += [f"- {n}" for n in r.notes] + [""]
        for p in r.profiles:
            lines += _profile_lines(p)
        lines += [f"_Target took {r.seconds:.0f} s._", ""]
    payload = json.dumps([result_to_dict(r) for r in results], separators=(",", ":"))
    lines += ["<!-- bench-results", payload.replace("--", "\\u002d\\u002d"), "-->"]
    return "\n".join(lines).rstrip() + "\n"


def embedded_results(text: str) -> list[TargetResult]:
    """The results a rendered report carries (empty when it carries none or is unreadable)."""
    m = _EMBED.search(text)
    if not m:
        return []
    try:
        return [result_from_dict(d) for d in json.loads(m.group(1))]
    except (ValueError, TypeError, KeyError):
        return []


def merge(previous: Sequence[TargetResult], current: Sequence[TargetResult]
          ) -> list[TargetResult]:
    """Targets of ``current`` replace the same targets of ``previous``; the others stay."""
    by_key = {r.key: r for r in previous}
    by_key.update({r.key: r for r in current})
    return sorted(by_key.values(), key=lambda r: r.number)
