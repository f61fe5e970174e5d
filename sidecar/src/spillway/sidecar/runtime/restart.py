"""`spillway serve` re-executes itself for what only an interpreter's start sets: glibc's malloc
(memtune.py) and the hash seed its run states are kept under (service/runstate.py).

At most once, with both, and before the server's imports: every pass imports the command line
(about 0.4 s of CPU) and the server's imports cost 0.2 s more, so a start that re-executed for
each reason, after those imports, spent about a second of CPU on passes that served nothing.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping

log = logging.getLogger("spillway.sidecar")

HASH_SEED = "PYTHONHASHSEED"


def reexec(updates: Mapping[str, str]) -> None:
    """Replace this process with the same command line, ``updates`` set in its environment
    (they are also the loop guard: the new process finds them set and goes on). Returns when
    there is nothing to update, or when the interpreter's command line is unknown: the process
    then goes on as it is, with a line saying what that costs."""
    if not updates:
        return
    orig = list(getattr(sys, "orig_argv", []) or [])
    if not orig or not sys.executable:
        if HASH_SEED in updates:
            log.warning("the command line is unknown: cannot pin the hash seed; a restart will "
                        "not resume runs")
        else:
            log.debug("allocator: the interpreter's command line is unknown, staying on "
                      "pymalloc")
        return
    previous = {key: os.environ.get(key) for key in updates}
    os.environ.update(updates)
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        # argv[0] as sys.executable: a bare "python" would be looked up on PATH again and
        # could leave the virtualenv
        os.execv(sys.executable, [sys.executable, *orig[1:]])
    except OSError as exc:  # pragma: no cover - the interpreter that runs us can run again
        for key, value in previous.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        log.warning("cannot re-execute (%s): staying on this interpreter's allocator and hash "
                    "seed", exc)
