"""Which of spillway's C extensions a process uses: every one that was built, except those
named in ``SPILLWAY_NO_EXTENSIONS`` (comma-separated, or ``all``). Each extension has a Python
fallback with the same results; the switch lets the benchmarks run both side by side (targets
3, 4 and 11) and an operator rule one out while investigating (docs/CONFIGURATION.md)."""

from __future__ import annotations

import os

ENV = "SPILLWAY_NO_EXTENSIONS"
# sidecar/core/_idindex.c (the id tables' loops), spark/_udfcall.c (the @job.udf per-row call),
# spark/_framekey.c (a failed record's frame signature), sidecar/dlq/_produce.c (the DLQ
# drain's produce calls and delivery reports), sidecar/core/_slots.c (a node's per-record
# objects)
NAMES = frozenset({"idindex", "udfcall", "framekey", "produce", "slots"})


def enabled(name: str) -> bool:
    """Whether extension ``name`` may be used in this process (read from the environment at
    each call: callers ask once, where they choose). An unknown name in the variable is an
    error naming it, not a silent no-op."""
    if name not in NAMES:
        raise ValueError(f"unknown spillway extension {name!r} (known: {', '.join(sorted(NAMES))})")
    raw = os.environ.get(ENV, "")
    named = {n.strip() for n in raw.split(",") if n.strip()}
    unknown = named - NAMES - {"all"}
    if unknown:
        raise ValueError(f"{ENV}={raw!r} names no spillway extension: "
                         f"{', '.join(sorted(unknown))} (known: {', '.join(sorted(NAMES))}, all)")
    return not ("all" in named or name in named)
