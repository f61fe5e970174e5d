"""py-spy profiles of benchmark processes, reduced to their top frames.

`record()` samples running processes (without pausing them: ``--nonblocking``) for a while in
the background; `top_frames()` turns py-spy's raw (collapsed-stack) output into the frames that
took the most samples by own time and anywhere on the stack. The raw files are kept in the
harness's work directory while it runs.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections import Counter
from collections.abc import Sequence

from .model import ProfileSection

_FRAME = re.compile(r"^(?P<func>.*?) \((?P<file>[^()]*?)(?::(?P<line>\d+))?\)$")


def py_spy() -> str | None:
    """The py-spy executable next to this interpreter, or on PATH."""
    here = os.path.join(os.path.dirname(sys.executable), "py-spy")
    if os.path.exists(here):
        return here
    return shutil.which("py-spy")


def short_frame(frame: str) -> str:
    """``func (path/to/pkg/mod.py:123)`` -> ``func (pkg/mod.py)``: lines merged, paths cut to
    the last two components (site-packages noise removed)."""
    m = _FRAME.match(frame.strip())
    if not m:
        return frame.strip()
    parts = m.group("file").replace("\\", "/").split("/")
    return f"{m.group('func')} ({'/'.join(parts[-2:])})"


def parse_raw(text: str) -> Counter:
    """py-spy ``--format raw`` (one ``frame;frame;...;leaf count`` per line) as stack counts."""
    stacks: Counter = Counter()
    for line in text.splitlines():
        line = line.rstrip()
        if not line:
            continue
        stack, _, count = line.rpartition(" ")
        try:
            n = int(count)
        except ValueError:
            continue
        if stack:
            stacks[stack] += n
    return stacks


def top_frames(stacks: Counter, n: int = 12, *, skip: Sequence[str] = ()
               ) -> tuple[int, list[tuple[str, float]], list[tuple[str, float]]]:
    """(samples, top own-time frames, top on-stack frames), shares of all samples.

    A frame on the stack several times (recursion) counts once per sample for the inclusive
    view. Frames whose short form contains one of ``skip`` are left out of the inclusive view
    (thread bootstrap frames that are on every stack say nothing).
    """
    total = sum(stacks.values())
    own: Counter = Counter()
    incl: Counter = Counter()
    for stack, count in stacks.items():
        # py-spy --subprocesses roots each stack at a "process PID:cmdline" pseudo-frame
        frames = [short_frame(f) for f in stack.split(";") if f and not f.startswith("process ")]
        if not frames:
            continue
        own[frames[-1]] += count
        for f in set(frames):
            incl[f] += count
    if not total:
        return 0, [], []
    default_skip = ("_bootstrap", "_bootstrap_inner", "run (threading.py)", "<module>",
                    "_worker (thread.py)", "_run_module_as_main", "_run_code")
    skips = tuple(skip) + default_skip
    top_own = [(f, c / total) for f, c in own.most_common(n)]
    top_incl = [(f, c / total) for f, c in incl.most_common(n + 20)
                if not any(s in f for s in skips)][:n]
    return total, top_own, top_incl


class Recording:
    """py-spy recording one or more processes in the background."""

    def __init__(self, pids: Sequence[int], out_dir: str, label: str, *, duration_s: int = 600,
                 rate: int = 100, subprocesses: bool = False) -> None:
        self.files: list[str] = []
        self.procs: list[subprocess.Popen] = []
        self.errors: list[str] = []
        exe = py_spy()
        if exe is None:
            self.errors.append("py-spy is not installed (pip install py-spy)")
            return
        os.makedirs(out_dir, exist_ok=True)
        for pid in pids:
            path = os.path.join(out_dir, f"{label}-{pid}.txt")
            cmd = [exe, "record", "--pid", str(pid), "--format", "raw", "--output", path,
                   "--rate", str(rate), "--duration", str(duration_s), "--nonblocking"]
            if subprocesses:
                cmd.append("--subprocesses")
            self.procs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL,
                                               stderr=subprocess.PIPE, text=True))
            self.files.append(path)

    def stop(self) -> Counter:
        """Stop sampling (SIGINT makes py-spy write its output) and merge the stacks."""
        import signal

        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGINT)
        for p in self.procs:
            try:
                _, err = p.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                _, err = p.communicate()
            if p.returncode not in (0, None, -2) and err:
                self.errors.append(err.strip().splitlines()[-1][:200])
        stacks: Counter = Counter()
        for path in self.files:
            try:
                with open(path, encoding="utf-8", errors="replace") as fh:
                    stacks.update(parse_raw(fh.read()))
            except OSError:
                continue
        return stacks


#: How py-spy names spillway's files: relative to the ``spillway`` namespace package
#: (``spark/_engine.py``, ``sidecar/core/policy.py``, ``client/report.py``), or in full.
SPILLWAY_PREFIXES = ("spark/", "sidecar/", "client/", "spillway/")


def is_spillway(frame: str) -> bool:
    """A frame of spillway's own code (client, sidecar, Spark wrappers), by its file path;
    the generated protobuf modules (``spillway/v1``) are not spillway's logic."""
    m = _FRAME.match(frame.strip())
    path = (m.group("file") if m else frame).replace("\\", "/")
    if "spillway/v1/" in path or path.startswith("v1/"):
        return False
    return "/spillway/" in path or path.startswith(SPILLWAY_PREFIXES)


def spillway_frames(stacks: Counter, n: int = 6) -> list[tuple[str, float]]:
    """Each sample charged to the innermost spillway frame on its stack (that frame's own
    work plus the library calls it makes: json, traceback, sqlite3, grpc...), top ``n``."""
    total = sum(stacks.values())
    charged: Counter = Counter()
    for stack, count in stacks.items():
        inner = next((f for f in reversed(stack.split(";")) if f and is_spillway(f)), None)
        if inner is not None:
            charged[short_frame(inner)] += count
    ranked = sorted(charged, key=lambda f: (-charged[f], f))[:n]
    return [(f, charged[f] / total) for f in ranked] if total else []


def summarize(stacks: Counter) -> str:
    """A one-line reading of a profile: which spillway code the samples are spent under."""
    frames = spillway_frames(stacks)
    if not frames:
        return "no spillway frame was sampled (the time is outside spillway's code)"
    covered = sum(share for _, share in spillway_frames(stacks, n=10_000))
    return (f"{covered:.0%} of the samples run under spillway code; charged to the innermost "
            "spillway frame (its own work plus the library calls it makes): " + ", ".join(
                f"`{f}` {share:.0%}" for f, share in frames))


def section(title: str, stacks: Counter, diagnosis: str = "", n: int = 12) -> ProfileSection:
    total, own, incl = top_frames(stacks, n)
    reading = summarize(stacks)
    return ProfileSection(title=title, samples=total, self_frames=own, inclusive_frames=incl,
                          diagnosis=f"{diagnosis} {reading}".strip() if diagnosis else reading)
