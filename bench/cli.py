"""Command line of the harness: ``python -m bench [--short] [--only NAME[,NAME]] ...``."""

from __future__ import annotations

import argparse
import datetime
import os
import signal
import sys
import time
import warnings

from . import load, machine, report
from .infra import Infra
from .runner import Context, Sizes, run_target, select

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_OUTPUT = os.path.join(REPO_ROOT, "docs", "BENCHMARKS.md")

METHOD = [
    "One Tansu broker (Kafka protocol, memory storage) per target, started fresh when the "
    "target starts and stopped with its sidecars when it ends; a fresh topic and a "
    "fresh job name per measurement. Sidecars run as their own processes, started with "
    "`python -m spillway.sidecar.cli.main serve --listen 127.0.0.1:0 ...` as a user starts them. "
    "Client load comes from separate processes (`bench.loadgen`, the real `SidecarClient`), "
    "never threads of the harness. Spark is one local[2] session.",
    "Baseline and candidate runs alternate (ABAB…, after one unmeasured warm-up round) so that "
    "drift of this shared machine hits both alike. Figures are medians with min–max over the "
    "runs; a ratio is the ratio of the medians, and the range of the run-by-run ratios of the "
    "alternated pairs shows how noisy it was.",
    "Everything shares 2 cores: broker, sidecar, Spark's JVM and Python workers, client "
    "processes. Absolute rates are therefore low and noisy; the ratios compare like with like "
    "on the same machine in the same minutes.",
    "A missed target is profiled with py-spy (one more candidate run, `--nonblocking`, 100 Hz); "
    "'own time' is the share of samples in which a frame was the innermost one, 'on stack' the "
    "share in which it was anywhere on the stack (samples are per thread, idle threads "
    "excluded; a thread blocked on a lock, a syscall or the GIL is not idle to py-spy, so a "
    "frame that waits, e.g. for a group commit or a blocking call to the home, shows as its "
    "own time: read the tables for where threads are, CPU figures for what they cost).",
]


def _log(msg: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} {msg}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    from .targets import TARGETS

    names = ", ".join(f"{t.number}={t.key}" for t in TARGETS)
    ap = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    ap.add_argument("--short", action="store_true",
                    help="small sizes and 3 runs per variant (CI); no profiles")
    ap.add_argument("--only", help=f"comma-separated targets by name or number: {names}")
    ap.add_argument("--runs", type=int, help="measured runs per variant (default 5, short 3)")
    ap.add_argument("--profile", choices=("auto", "always", "never"), default="auto",
                    help="py-spy profiles of missed targets (auto: full runs only)")
    ap.add_argument("--output", default=DEFAULT_OUTPUT,
                    help="where to write the report (default docs/BENCHMARKS.md)")
    ap.add_argument("--no-merge", action="store_true",
                    help="with --only: write only the chosen targets (default: keep the other "
                         "targets' results of the same mode from the existing report)")
    ap.add_argument("--keep-workdir", action="store_true",
                    help="keep logs, spools and raw profiles in the work directory")
    ap.add_argument("--allow-busy", action="store_true",
                    help="run a full run even where other processes keep the machine busy; "
                         "the report then says it is not comparable")
    args = ap.parse_args(argv)
    # pyspark 4.3 warns about pandas 3 on every vectorized plan; the harness's output is its log.
    warnings.filterwarnings("ignore", category=FutureWarning, module="pyspark")

    try:
        specs = select(TARGETS, args.only)
    except ValueError as exc:
        ap.error(str(exc))
    sizes = Sizes.short() if args.short else Sizes.full()
    if args.runs is not None:
        if args.runs < 1:
            ap.error("--runs: must be >= 1")
        sizes = Sizes(**{**sizes.__dict__, "runs": args.runs})
    if args.profile != "auto":
        sizes = Sizes(**{**sizes.__dict__, "profile": args.profile == "always"})

    # A SIGTERM stops the run like Ctrl-C, so that everything started is stopped.
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    started = time.monotonic()
    date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    info = machine.describe()
    busy = load.sample()
    info["other processes at start"] = busy.text()
    if busy.cores > load.IDLE_CORES:
        if not args.short and not args.allow_busy:
            _log(f"bench: the machine is busy ({busy.text()}; a full run needs at most "
                 f"{load.IDLE_CORES} cores used by others): its ratios would not be comparable. "
                 "Stop what runs beside it, or pass --allow-busy (the report then says so).")
            return 2
        info["comparable"] = ("NO: the machine was busy at start (--allow-busy or a short "
                              "run); ratios are not comparable with a run on an idle machine")
    infra = Infra(keep_workdir=args.keep_workdir)
    ctx = Context(infra=infra, sizes=sizes, short=args.short, log=_log,
                  profile_dir=os.path.join(infra.workdir, "profiles"))
    _log(f"bench: {'short' if args.short else 'full'} run of "
         f"{', '.join(s.key for s in specs)}; work dir {infra.workdir}")
    mode = "short" if args.short else "full"
    results = []
    try:
        for spec in specs:
            result = run_target(spec, ctx)
            result.measured = f"{date}, {mode} run"
            results.append(result)
    except KeyboardInterrupt:
        _log("bench: interrupted; stopping what was started")
        return 130
    finally:
        infra.close()
    command = "python -m bench" + (" --short" if args.short else "") + (
        f" --only {args.only}" if args.only else "")
    notes = list(METHOD)
    if args.only and not args.no_merge and os.path.exists(args.output):
        with open(args.output, encoding="utf-8") as fh:
            previous = [r for r in report.embedded_results(fh.read())
                        if r.measured.endswith(f"{mode} run")]
        kept = [r for r in previous if r.key not in {s.key for s in specs}]
        if kept:
            results = report.merge(previous, results)
            notes.append("This run measured only " + ", ".join(
                f"{s.number}" for s in specs) + "; targets " + ", ".join(
                f"{r.number}" for r in kept) + " are carried over from earlier " + mode +
                " runs of the harness (each target says when it was measured).")
    text = report.render(results, info, date=date, command=command, mode=mode,
                         seconds=time.monotonic() - started, runs=sizes.runs,
                         method_notes=notes)
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    with open(args.output, "w", encoding="utf-8") as fh:
        fh.write(text)
    _log(f"bench: wrote {args.output}")
    for r in results:
        from .model import verdict_text

        _log(f"  {r.number}. {r.title}: {verdict_text(r)}")
    return 0
