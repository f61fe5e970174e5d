"""Helpers shared by the targets: alternated runs, job properties, profiling of a run."""

from __future__ import annotations

import re
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping, Sequence

from ..clients import REPO_ROOT
from ..infra import BenchError
from ..model import Figure, TargetResult, alternate
from ..profiling import Recording, section
from ..runner import Context


def dlq_props(topic: str, **extra: str) -> dict[str, str]:
    """A job that tolerates every error and dead-letters it to ``topic``."""
    return {"errors.tolerance": "all", "errors.deadletterqueue.topic.name": topic, **extra}


POLICY_ONLY = {"errors.tolerance": "all"}


def start_listening(ctx: Context, module: str, what: str) -> tuple[subprocess.Popen, str]:
    """``python -m <module> --listen 127.0.0.1:0`` as its own process (the echo server, the
    OTLP sink), stopped when the harness closes: (process, the address it printed)."""
    proc = subprocess.Popen([sys.executable, "-m", module, "--listen", "127.0.0.1:0"],
                            cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            stdin=subprocess.DEVNULL, text=True)
    box: list[str] = []
    t = threading.Thread(target=lambda: box.append(proc.stdout.readline()), daemon=True)
    t.start()
    t.join(60)
    m = re.search(r"listening on (\S+)", box[0] if box else "")
    if not m:
        proc.kill()
        raise BenchError(f"{what} did not start")

    def stop() -> None:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()

    ctx.infra.on_close(stop)
    return proc, m.group(1)


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


def alternate_variants(ctx: Context, result: TargetResult, keys: Sequence, run: Callable,
                       rate: Mapping, extras: Sequence[Mapping], *, label: str) -> None:
    """`alternate_runs` (with a warm-up round) over variants ``keys``, where ``run(key,
    run_no)`` returns (rate, *more): ``rate[key]`` is the variant's figure, ``extras[i][key]``
    the figure of its i-th further value."""
    def variant(key):
        def go(run_no: int):
            first, *more = run(key, run_no)
            return first, {figs[key]: v for figs, v in zip(extras, more, strict=True)}
        return go

    alternate_runs(ctx, result, {rate[k].name: variant(k) for k in keys},
                   {rate[k].name: rate[k] for k in keys}, warmup=True, label=label)


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


def node_clients_run(ctx: Context, pool, address: str, label: str, job_props,
                     per_client: int, batch: int, run_no: int, pids: Sequence[int],
                     **extra) -> tuple:
    """One run of ``pool``'s clients against the node sidecar at ``address``: the harness
    registers a fresh run of a fresh job there (as a driver in its own process), the clients
    register naming the home it answered, report ``per_client`` records each in reports of
    ``batch`` (``extra``: more loadgen settings) and flush; every record must be acknowledged.
    Returns (aggregate, CPU of ``pids`` before, after, the driver's summary of the run); the
    run is ended."""
    import uuid

    from spillway.client import SidecarClient
    from spillway.client.runs import JobRun, JobToken

    from .. import cpu
    from ..infra import BenchError

    topic = ctx.infra.fresh_topic(label)
    job = f"bench-{label}-{uuid.uuid4().hex[:8]}"
    props = job_props(topic)
    run = JobRun(job, "bench", JobToken(f"bench-token-{job}"))  # as bench.loadgen names it
    driver = SidecarClient(address, timeout_s=60)
    reg = driver.register_job(run, props)
    before: dict[int, float] = {}
    agg = pool.run(lambda i: {
        "target": address, "job": job, "props": props,
        "home_registered": {"home": reg.home, "home_instance_id": reg.home_instance_id},
        "records": per_client, "batch": batch, "flush": True, "run_no": run_no, **extra},
        on_start=lambda: before.update(cpu.snapshot(pids)))
    after = cpu.snapshot(pids)
    try:
        if agg.errors or agg.timed_out or agg.acked != agg.records:
            raise BenchError(f"{label}: {agg.errors} client error(s), timed out="
                             f"{agg.timed_out}, {agg.acked} of {agg.records} acknowledged: "
                             f"{'; '.join(agg.error_samples)}")
        summary = driver.job_summary(reg.run())
        driver.end_job(reg.run())
    finally:
        driver.close()
    return agg, before, after, summary
