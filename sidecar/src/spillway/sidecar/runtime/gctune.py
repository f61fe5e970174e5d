"""The cyclic garbage collector's settings for a long-running sidecar process.

CPython collects its youngest generation every 700 container allocations and, every 10 of those,
the next one. A sidecar dead-lettering a poison flood allocates a handful of containers per
record (protobuf wrappers, header tuples, DLQ records, the spool's and the drain's bookkeeping),
so the collector ran about 28 times per 1,000 records and, every 100 young collections, walked
every object the process holds (gRPC, protobuf, OpenTelemetry, the dedup window). Almost none
of it is cyclic garbage: those walks cost about a third of the CPU of the DLQ path (measured
in-process: 6.4 -> 4.4 CPU seconds per 100k records, issue 14) for nothing.

`tune()` (called once the server is built): everything allocated by start-up (modules, the
servicer, the pipeline) moves to the permanent generation (`gc.freeze()`: never walked again),
and the young generation is collected every 20,000 allocations. Cyclic garbage (an exception
with its traceback, say) is still collected, later; reference counting frees everything else at
once, so memory does not grow.
"""

from __future__ import annotations

import gc

YOUNG_THRESHOLD = 20_000  # container allocations between young collections (CPython: 700)
OLDER_THRESHOLDS = (20, 20)  # collections of the younger generation per older one (CPython: 10, 10)


def tune() -> None:
    """Freeze what start-up allocated and collect the young generation less often."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(YOUNG_THRESHOLD, *OLDER_THRESHOLDS)
