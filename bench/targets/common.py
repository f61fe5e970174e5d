"""Helpers shared by the targets: alternated runs, job properties, profiling of a run."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from ..model import Figure, TargetResult, alternate
from ..profiling import Recording, section
from ..runner import Context


def dlq_props(topic: str, **extra: str) -> dict[str, str]:
    """A job that tolerates every error and dead-letters it to ``topic``."""
    return {"errors.tolerance": "all", "errors.deadletterqueue.topic.name": topic, **extra}


POLICY_ONLY = {"errors.tolerance": "all"}


Run = Callable[[int], "float | tuple[float, dict[Figure, float]]"]


def alternate_runs(ctx: Context, result: TargetResult, variants: Mapping[str, Run],
                   figures: Mapping[str, Figure], *, warmup: bool = False,
                   label: str = "") -> None:
    """Run the variants in ABAB… order (``ctx.sizes.runs`` rounds, plus an unmeasured warm-up
    round when asked), adding each run's value to its variant's figure. A variant may return
    ``(value, {figure: value})`` to record secondary figures of the same run (e.g. latency)."""
    names = list(variants)
    order = alternate(names, ctx.sizes.runs, warmup=warmup)
    skip = len(names) if warmup else 0
    for i, name in enumerate(order):
        run_no = i // len(names)
        out = variants[name](run_no)
        value, extras = out if isinstance(out, tuple) else (out, {})
        tag = "warm-up" if i < skip else f"run {run_no - (1 if warmup else 0) + 1}"
        more = "".join(f", {f.name} {v:,.3f}" for f, v in extras.items())
        ctx.log(f"    {label}{name} {tag}: {value:,.3f} {figures[name].unit}{more}")
        if i >= skip:
            figures[name].add(value)
            for fig, v in extras.items():
                fig.add(v)


def profiled(ctx: Context, result: TargetResult, title: str, pids: Sequence[int],
             run: Callable[[], object], *, subprocesses: bool = False, diagnosis: str = "",
             label: str = "profile") -> object:
    """Run ``run()`` once more under py-spy (processes ``pids``) and add its top frames."""
    rec = Recording(pids, ctx.profile_dir or ctx.infra.workdir, label,
                    subprocesses=subprocesses)
    try:
        out = run()
    finally:
        stacks = rec.stop()
    if rec.errors and not stacks:
        result.notes.append(f"profile of {title} failed: {'; '.join(rec.errors)}")
        return out
    result.profiles.append(section(title, stacks, diagnosis))
    return out
