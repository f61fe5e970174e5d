"""What a benchmark target produces and how it is judged (pure: no I/O, no timing).

- a `Figure` is one measured quantity over repeated runs (absolute numbers: reported, never
  asserted);
- a `Check` compares a value — usually the ratio of two figures' medians — with the target's
  threshold and says whether it is met;
- a `TargetResult` gathers a target's figures, checks, notes and profiles, or says why the
  target was not run.

Alternation: `alternate()` gives the run order of several variants, round-robin (ABAB…, or
ABCABC… for three), so slow drift of a shared, noisy machine hits every variant alike.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from .stats import Summary, paired_ratios, ratio

OPS: dict[str, Callable[[float, float], bool]] = {
    ">=": operator.ge,
    "<=": operator.le,
    "<": operator.lt,
    ">": operator.gt,
    "==": operator.eq,
}

STATUS_MEASURED = "measured"
STATUS_NOT_RUN = "not run"
STATUS_ERROR = "error"


def alternate(variants: Sequence[str], runs: int, *, warmup: bool = False) -> list[str]:
    """Run order: ``runs`` rounds of every variant in turn (ABAB… ), optionally preceded by
    one warm-up round (whose results the caller discards)."""
    if runs < 1:
        raise ValueError(f"runs: must be >= 1, got {runs}")
    if not variants:
        raise ValueError("variants: at least one variant is needed")
    if len(set(variants)) != len(variants):
        raise ValueError(f"variants: names must be distinct, got {list(variants)}")
    rounds = runs + (1 if warmup else 0)
    return [v for _ in range(rounds) for v in variants]


@dataclass(eq=False)
class Figure:
    """One measured quantity over repeated runs (hashable by identity)."""

    name: str
    unit: str
    values: list[float] = field(default_factory=list)
    note: str = ""

    def add(self, value: float) -> None:
        self.values.append(float(value))

    @property
    def summary(self) -> Summary:
        return Summary.of(self.values)

    @property
    def median(self) -> float | None:
        """The values' median; None before any value (a variant that did not run)."""
        return self.summary.median if self.values else None


@dataclass(frozen=True)
class Check:
    """``value op threshold``: e.g. ratio 0.62 >= 0.5 (met)."""

    name: str
    value: float | None
    op: str
    threshold: float
    kind: str = "ratio"  # ratio | absolute
    unit: str = ""
    detail: str = ""     # how the value was obtained (e.g. the two figures' medians)
    spread: tuple[float, float] | None = None  # min–max of the paired run ratios

    def __post_init__(self) -> None:
        if self.op not in OPS:
            raise ValueError(f"op: must be one of {', '.join(OPS)}, got {self.op!r}")
        if self.kind not in ("ratio", "absolute"):
            raise ValueError(f"kind: must be ratio or absolute, got {self.kind!r}")

    @property
    def met(self) -> bool | None:
        """True/False; None when there is no value (the measurement did not happen)."""
        if self.value is None:
            return None
        return OPS[self.op](self.value, self.threshold)

    @property
    def target_text(self) -> str:
        unit = f" {self.unit}" if self.unit and self.kind == "absolute" else ""
        x = "×" if self.kind == "ratio" else ""
        return f"{self.op} {_num(self.threshold)}{x}{unit}"


def ratio_check(name: str, candidate: Figure, baseline: Figure, op: str, threshold: float,
                *, paired: bool = True) -> Check:
    """Ratio of the medians of two figures (candidate / baseline), judged by ``op threshold``.

    With ``paired``, the spread of the run-by-run ratios of the alternated runs is kept too.
    """
    c, b = candidate.summary.median, baseline.summary.median
    value = ratio(c, b)
    spread = None
    if paired and len(candidate.values) == len(baseline.values) and candidate.values:
        try:
            pr = paired_ratios(candidate.values, baseline.values)
        except ZeroDivisionError:
            pr = []
        if pr:
            spread = (min(pr), max(pr))
    detail = (f"median {candidate.name} {_num(c)} {candidate.unit} / median {baseline.name} "
              f"{_num(b)} {baseline.unit}")
    return Check(name, value, op, threshold, "ratio", detail=detail, spread=spread)


def absolute_check(name: str, value: float | None, op: str, threshold: float, unit: str,
                   detail: str = "") -> Check:
    return Check(name, value, op, threshold, "absolute", unit=unit, detail=detail)


@dataclass(frozen=True)
class ProfileSection:
    """Top frames of a py-spy profile of one process (or process tree) during one run."""

    title: str
    samples: int
    self_frames: list[tuple[str, float]]       # (frame, share of samples) by own time
    inclusive_frames: list[tuple[str, float]]  # (frame, share) anywhere on the stack
    diagnosis: str = ""


@dataclass
class TargetResult:
    key: str
    number: int
    title: str
    status: str = STATUS_MEASURED
    reason: str = ""   # for not run / error
    setup: str = ""    # what was measured, in a sentence or two
    figures: list[Figure] = field(default_factory=list)
    checks: list[Check] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    profiles: list[ProfileSection] = field(default_factory=list)
    seconds: float = 0.0
    measured: str = ""  # when and how: "2026-11-21 05:45 UTC, full run"
    machine: str = ""   # what other processes did meanwhile (bench.load)
    disturbed: bool = False   # they took enough to make it not comparable with an idle run

    @property
    def met(self) -> bool | None:
        """All checks met → True; any missed → False; nothing judged → None."""
        if self.status != STATUS_MEASURED or not self.checks:
            return None
        states = [c.met for c in self.checks]
        if any(s is False for s in states):
            return False
        if any(s is None for s in states):
            return None
        return True

    def figure(self, name: str, unit: str, note: str = "") -> Figure:
        for f in self.figures:
            if f.name == name:
                return f
        f = Figure(name, unit, note=note)
        self.figures.append(f)
        return f


def verdict_text(result: TargetResult) -> str:
    if result.status == STATUS_NOT_RUN:
        return f"not run: {result.reason}"
    if result.status == STATUS_ERROR:
        return f"error: {result.reason}"
    met = result.met
    if met is None:
        return "not judged"
    return "met" if met else "missed"


def _num(x: float) -> str:
    """Compact human formatting: 3 significant digits below 100, thousands separators above."""
    if x != x:  # NaN
        return "nan"
    ax = abs(x)
    if ax >= 100:
        return f"{x:,.0f}"
    if ax >= 10:
        return f"{x:.1f}"
    if ax >= 1:
        return f"{x:.2f}"
    if ax == 0:
        return "0"
    return f"{x:.3g}"


fmt = _num


def result_to_dict(r: TargetResult) -> dict:
    """A JSON-ready form of a result (the report embeds it, so that a later ``--only`` run can
    replace some targets and keep the others)."""
    return dataclasses.asdict(r)


def result_from_dict(d: dict) -> TargetResult:
    r = TargetResult(**{k: v for k, v in d.items()
                        if k not in ("figures", "checks", "profiles")})
    r.figures = [Figure(**f) for f in d.get("figures", [])]
    r.checks = [Check(**{**c, "spread": tuple(c["spread"]) if c.get("spread") else None})
                for c in d.get("checks", [])]
    r.profiles = [ProfileSection(p["title"], p["samples"],
                                 [tuple(x) for x in p["self_frames"]],
                                 [tuple(x) for x in p["inclusive_frames"]], p.get("diagnosis", ""))
                  for p in d.get("profiles", [])]
    return r
