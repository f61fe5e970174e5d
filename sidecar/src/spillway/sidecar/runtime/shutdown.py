"""Leaving the process once the graceful stop is over, even if a call is still running.

`RunningSidecar.stop` returns within ``shutdown.grace.ms``: in-flight calls had the grace, the
DLQ pipeline's last flush what was left of it, and what Kafka did not acknowledge is in the
durable spool. A call can still be running after that: gRPC has cancelled it, but its handler
thread sits in a blocking library call with a longer timeout of its own (a RegisterJob's topic
check against a Kafka that does not answer, a call to a peer sidecar). Python's exit waits for
such threads (concurrent.futures joins its workers at exit), so the process would outlive its
grace period by that timeout (measured: 14.1 s for a 3 s grace, a RegisterJob in flight and the
broker frozen). Nothing those threads do can matter any more (their callers were answered), so
once exiting has had `EXIT_WAIT_S` the process leaves without them, saying so.

So that all of this fits in the grace period, the stop itself gets the grace less
`EXIT_RESERVE_S` (`stop_budget_s`): the watchdog's wait and the process's own teardown.
"""

from __future__ import annotations

import logging
import os
import sys
import threading

log = logging.getLogger("spillway.sidecar")

# A normal exit (atexit handlers, idle worker threads joined) takes well under this.
EXIT_WAIT_S = 0.5
# What the stop leaves of shutdown.grace.ms for leaving the process: the watchdog's wait and
# the interpreter's teardown (measured 0.01-0.06 s here).
EXIT_RESERVE_S = EXIT_WAIT_S + 0.25


def stop_budget_s(grace_ms: int) -> float:
    """The time `RunningSidecar.stop` may take for a grace period of `grace_ms`."""
    return max(0.0, grace_ms / 1000 - EXIT_RESERVE_S)


def _leave(code: int) -> None:
    # the call handlers (gRPC's pool: Python's exit joins them even where they are daemons)
    busy = sorted(t.name for t in threading.enumerate()
                  if t is not threading.current_thread() and t is not threading.main_thread()
                  and t.is_alive())
    log.warning("exiting without waiting for threads still running after the graceful stop "
                "(calls whose Kafka or peer did not answer in time; they were cancelled): %s",
                ", ".join(busy[:8]) or "none")
    for handler in logging.getLogger().handlers:
        handler.flush()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def exit_watchdog(code: int = 0, wait_s: float = EXIT_WAIT_S) -> threading.Timer:
    """Arm a daemon timer that ends the process `wait_s` from now unless it has exited by
    then; call it right after the graceful stop, before returning from main."""
    timer = threading.Timer(wait_s, _leave, args=(code,))
    timer.daemon = True
    timer.name = "spillway-exit-watchdog"
    timer.start()
    return timer
