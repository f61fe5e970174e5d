"""Runs the selected targets, isolating each one: a target whose prerequisites are not importable
reports "not run: <why>", a target that fails reports "error: <why>", and the others go on."""

from __future__ import annotations

import importlib
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from . import load
from .infra import Infra
from .model import STATUS_ERROR, STATUS_NOT_RUN, TargetResult


@dataclass(frozen=True)
class Sizes:
    """How much work each target does: full run or --short (CI)."""

    runs: int
    dlq_records: int              # 1: records dead-lettered per run
    rpc_single: int               # 2: records at 1 record per report
    rpc_batched: int              # 2: records at 256 per report
    rpc_per_client: int           # 2: records per client in the echo comparison
    happy_rows: int               # 3
    error_rows: int               # 4
    durability_per_client: int    # 5
    tracing_records: int          # 6
    memory_records: int           # 7
    many_total: int               # 8: records per run, split over the clients
    jobs_closed: int              # 9: short jobs run and ended
    deser_rows: int               # 10: Kafka-shaped rows deserialized per run
    profile: bool                 # profile missed targets with py-spy

    @classmethod
    def full(cls) -> Sizes:
        return cls(runs=5, dlq_records=60_000, rpc_single=3_000, rpc_batched=100_000,
                   rpc_per_client=25_000, happy_rows=5_000_000, error_rows=1_000_000,
                   durability_per_client=20_000, tracing_records=90_000,
                   memory_records=1_000_000, many_total=128_000, jobs_closed=10_000,
                   deser_rows=500_000,
                   profile=True)

    @classmethod
    def short(cls) -> Sizes:
        return cls(runs=3, dlq_records=6_000, rpc_single=600, rpc_batched=12_800,
                   rpc_per_client=3_000, happy_rows=120_000, error_rows=40_000,
                   durability_per_client=2_000, tracing_records=3_000,
                   memory_records=50_000, many_total=20_480, jobs_closed=1_000,
                   deser_rows=100_000,
                   profile=False)


@dataclass
class Context:
    infra: Infra
    sizes: Sizes
    short: bool
    log: Callable[[str], None]
    profile_dir: str = ""
    extra: dict = field(default_factory=dict)


@dataclass(frozen=True)
class TargetSpec:
    key: str
    number: int
    title: str
    run: Callable[[Context, TargetResult], None]
    requires: tuple[str, ...] = ()  # "module" or "module:attr.path"


def missing_prerequisite(requires: Sequence[str]) -> str | None:
    """Why a target cannot run (the first missing module or attribute), or None."""
    for req in requires:
        module, _, attrs = req.partition(":")
        try:
            obj = importlib.import_module(module)
        except Exception as exc:  # noqa: BLE001 - any import failure means "not yet"
            return f"{module} is not importable ({type(exc).__name__}: {exc})"
        for part in filter(None, attrs.split(".")):
            if not hasattr(obj, part):
                return f"{module}:{attrs} does not exist yet"
            obj = getattr(obj, part)
    return None


def select(specs: Sequence[TargetSpec], only: str | None) -> list[TargetSpec]:
    """``--only`` takes names or numbers, comma-separated; unknown ones are an error."""
    if not only:
        return list(specs)
    wanted = [w.strip() for w in only.split(",") if w.strip()]
    by_key = {s.key: s for s in specs}
    by_num = {str(s.number): s for s in specs}
    out: list[TargetSpec] = []
    for w in wanted:
        spec = by_key.get(w) or by_num.get(w)
        if spec is None:
            names = ", ".join(f"{s.number}={s.key}" for s in specs)
            raise ValueError(f"--only: unknown target {w!r}; choose from {names}")
        if spec not in out:
            out.append(spec)
    return sorted(out, key=lambda s: s.number)


def run_target(spec: TargetSpec, ctx: Context) -> TargetResult:
    result = TargetResult(spec.key, spec.number, spec.title)
    why = missing_prerequisite(spec.requires)
    if why is not None:
        result.status, result.reason = STATUS_NOT_RUN, why
        ctx.log(f"[{spec.number}] {spec.key}: not run: {why}")
        return result
    ctx.log(f"[{spec.number}] {spec.key}: running")
    t0 = time.monotonic()
    watch = load.Watch()
    try:
        spec.run(ctx, result)
    except Exception as exc:  # noqa: BLE001 - one target's failure must not stop the others
        result.status = STATUS_ERROR
        result.reason = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        tb = traceback.format_exc()
        result.notes.append("traceback (last lines): " + " / ".join(
            line.strip() for line in tb.strip().splitlines()[-6:]))
        ctx.log(f"[{spec.number}] {spec.key}: ERROR\n{tb}")
    result.seconds = time.monotonic() - t0
    busy = watch.stop()
    ctx.infra.end_target()
    result.machine = busy.text()
    result.disturbed = busy.cores > load.DISTURBED_CORES
    if result.disturbed:
        ctx.log(f"[{spec.number}] {spec.key}: disturbed: {busy.text()}")
    return result
