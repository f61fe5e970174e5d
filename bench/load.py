"""How busy the machine is besides the harness: a full run refused on a busy machine, and for
each target the load and the CPU other processes took while it ran.

Everything of a run (broker, sidecars, Spark's JVM and workers, client processes) descends from
the harness, so "other" CPU is the machine's busy time (/proc/stat) less the harness's process
tree's, exited processes included (`proctree.TreeCpu`). On 2 cores a job beside the harness
takes from the processes measured and halves a ratio; a figure measured so is reported as not
comparable with an idle run."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from . import proctree

_TICK = os.sysconf("SC_CLK_TCK")
# a full run starts only where others used at most this much CPU (cores) over the sample
IDLE_CORES = 0.25
IDLE_SAMPLE_S = 5.0
# a target during which others used more than this share of one core is marked disturbed
DISTURBED_CORES = 0.10


def _busy_ticks() -> int:
    """The machine's busy CPU time, in clock ticks (all CPUs; idle and iowait excluded)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
    return user + nice + system + irq + softirq + steal


def _load1() -> float:
    try:
        return os.getloadavg()[0]
    except OSError:
        return float("nan")


@dataclass(frozen=True)
class Busy:
    """What other processes did over a span: CPU seconds, the span, the 1-min load at both ends."""

    other_cpu_s: float
    seconds: float
    load_start: float
    load_end: float

    @property
    def cores(self) -> float:
        return self.other_cpu_s / self.seconds if self.seconds > 0 else 0.0

    def text(self) -> str:
        return (f"other processes used {self.other_cpu_s:.1f} CPU-s over {self.seconds:.0f} s "
                f"({self.cores:.2f} cores); 1-min load {self.load_start:.2f} at start, "
                f"{self.load_end:.2f} at end")


class Watch:
    """Started before a span, `stop` after it: the `Busy` of the span."""

    def __init__(self) -> None:
        self._t = time.monotonic()
        self._busy = _busy_ticks()
        self._own = proctree.TreeCpu(lambda: (os.getpid(),), interval_s=0.5).start()
        self._load = _load1()

    def stop(self) -> Busy:
        own_s = self._own.stop()
        busy = _busy_ticks()
        other = max(0.0, (busy - self._busy) / _TICK - own_s)
        return Busy(other, time.monotonic() - self._t, self._load, _load1())


def sample(seconds: float = IDLE_SAMPLE_S) -> Busy:
    """What other processes use now (the harness has started nothing yet)."""
    w = Watch()
    time.sleep(seconds)
    return w.stop()
