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
"""

from __future__ import annotations

import logging
import os
import sys
import threading

log = logging.getLogger("spillway.sidecar")

# A normal exit (atexit handlers, idle worker threads joined) takes well under this.
EXIT_WAIT_S = 0.5


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
