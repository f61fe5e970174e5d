"""`spillway serve` as its own process, as the e2e tiers drive it: start, read the one
"listening on ADDR" line it prints, stop with SIGTERM (SIGKILL after a grace period)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Mapping, Sequence

_LISTENING = re.compile(r"listening on (\S+)")


def spawn(args: Sequence[str], *, env: Mapping[str, str] | None = None,
          extra_env: Mapping[str, str] | None = None, log_level: str = "WARNING",
          stderr=subprocess.PIPE) -> tuple[subprocess.Popen, str]:
    """Start `spillway serve ARGS`; returns the process and the address it listens on.

    ``env``: the whole environment (default: this process's); ``extra_env`` is laid over it.
    A long-running sidecar that logs a lot should get ``stderr=subprocess.DEVNULL`` so a full
    pipe cannot block it."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "spillway.sidecar.cli", "--log-level", log_level, "serve",
         *args],
        stdout=subprocess.PIPE, stderr=stderr, text=True,
        env={**(os.environ if env is None else env), **(extra_env or {})})
    line = proc.stdout.readline()
    m = _LISTENING.search(line)
    if not m:
        proc.kill()
        err = proc.communicate()[1] if stderr is subprocess.PIPE else ""
        raise AssertionError(f"no listening line: {line!r} {(err or '')[-2000:]}")
    return proc, m.group(1)


def stop(proc: subprocess.Popen, timeout_s: float = 15.0) -> None:
    proc.terminate()
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
