"""Target 4, what the executors' frame signature extension (`spark/_framekey.c`) saves: a
failed record described for its report (`columns.failure`, what the verdict loop does per
failed record) with the C frame signature against the client's Python one, in this process,
alternated.

The executors look each failed record's exception up by (class, message, frame signature) to
reuse the description of an alike failure; the signature walks the traceback's frames. Run in
one process rather than in Spark: the extension is chosen once per Python worker, and the
workers of one Spark session cannot be given another environment between runs.
"""

from __future__ import annotations

import time

from ..model import Figure, TargetResult, fmt, ratio_check
from ..runner import Context
from ..workloads import parse_order
from .common import alternate_runs

# the C version's describing at most this share of the Python one's
RATIO = 0.9


def _failures(n: int) -> list[BaseException]:
    """``n`` JSONDecodeErrors raised by `parse_order` on truncated orders, with tracebacks."""
    out = []
    for i in range(n):
        try:
            parse_order(b'{"order_id": %d, "amount": ' % i + b"x" * 120)
        except ValueError as exc:
            out.append(exc)
    return out


def _described(excs: list[BaseException], key) -> float:
    """µs of this thread's CPU per failed record described with frame signature ``key``."""
    from spillway.client import columns
    from spillway.v1 import sidecar_pb2 as pb

    columns.use_frame_key(key)
    stage = pb.STAGE_TRANSFORMATION
    t0 = time.thread_time()
    for i, exc in enumerate(excs):
        columns.failure(f"r{i}", stage, exc, function_name="bench.parse_order",
                        value=b"v" * 200, payload="stage-input")
    return (time.thread_time() - t0) / len(excs) * 1e6


def run_failure_key(ctx: Context, result: TargetResult) -> None:
    from spillway.client import columns

    try:
        from spillway.spark._framekey import frame_key as native
    except ImportError:
        result.notes.append("The frame signature's C extension (spark/_framekey.c) was not "
                            "built here: not compared.")
        return
    n = 2_000 if ctx.short else 50_000
    excs = _failures(n)
    with_c = result.figure("describing a failed record, C frame signature", "µs")
    without = result.figure("describing a failed record, Python frame signature", "µs")
    try:
        alternate_runs(ctx, result, {with_c.name: lambda _r: _described(excs, native),
                                     without.name: lambda _r: _described(excs, None)},
                       {with_c.name: with_c, without.name: without}, warmup=True)
    finally:
        columns.use_frame_key(native)   # as the executors run it
    result.checks.append(ratio_check(
        "describing a failed record: frame signature's C extension vs Python", with_c,
        without, "<=", RATIO))
    result.notes.append(_reading(with_c, without, n))


def _reading(with_c: Figure, without: Figure, n: int) -> str:
    c, p = with_c.median, without.median
    if not (c and p):
        return "The frame signature's C extension: not measured."
    return (f"What the frame signature's C extension (`spark/_framekey.c`, `framekey`) saves the "
            f"executors: describing a failed record for its report (`columns.failure`, "
            f"{n:,} JSONDecodeErrors of `parse_order`, in the harness's process, alternated) "
            f"takes {fmt(c)} µs with it and {fmt(p)} µs with the client's Python frame "
            f"signature ({p - c:+.2f} µs a failed record saved, {c / p:.3f}x).")
