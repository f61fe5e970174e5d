"""A pool of `bench.loadgen` client processes, kept alive across runs, and the aggregation of
their results (the latter pure)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .infra import BenchError
from .stats import percentile

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass(frozen=True)
class Aggregate:
    """What a set of clients achieved together in one run."""

    clients: int
    records: int
    reports: int
    errors: int
    seconds: float           # earliest start to latest end (flush included when asked)
    report_seconds: float    # earliest start to latest last report (flush excluded)
    p50_ms: float
    p99_ms: float
    max_ms: float
    dead_lettered: int
    acked: int | None
    error_samples: tuple[str, ...]
    timed_out: bool

    @property
    def rate(self) -> float:
        """Records per second over the whole window."""
        return self.records / self.seconds if self.seconds > 0 else 0.0


def aggregate(results: Sequence[dict]) -> Aggregate:
    """Combine the per-process results of one run (see `bench.loadgen.Run.go`)."""
    if not results:
        raise ValueError("results: no client results to aggregate")
    bad = [r for r in results if "error" in r]
    if bad:
        raise BenchError(f"a client process failed: {bad[0]['error']}\n"
                         f"{bad[0].get('traceback', '')}")
    t0 = min(r["t0"] for r in results)
    t1 = max(r["t1"] for r in results)
    tr = max(r["t_reported"] for r in results)
    lat_ms = [x * 1000.0 for r in results for x in r["lat_s"]]
    acks = [r["acked"] for r in results]
    samples: list[str] = []
    for r in results:
        samples += r.get("error_samples", [])
    return Aggregate(
        clients=len(results),
        records=sum(r["records"] for r in results),
        reports=sum(r["reports"] for r in results),
        errors=sum(r["errors"] for r in results),
        seconds=t1 - t0,
        report_seconds=tr - t0,
        p50_ms=percentile(lat_ms, 50) if lat_ms else 0.0,
        p99_ms=percentile(lat_ms, 99) if lat_ms else 0.0,
        max_ms=max(lat_ms) if lat_ms else 0.0,
        dead_lettered=sum(r.get("dead_lettered", 0) for r in results),
        acked=None if any(a is None for a in acks) else sum(acks),
        error_samples=tuple(samples[:3]),
        timed_out=any(r.get("timed_out") for r in results),
    )


class ClientPool:
    """``n`` loadgen processes; `run()` prepares all, starts all at once, collects all."""

    def __init__(self, n: int, *, env: dict[str, str] | None = None) -> None:
        self.n = n
        child_env = {k: v for k, v in os.environ.items() if not k.startswith("SPILLWAY_")}
        child_env.update(env or {})
        self.procs: list[subprocess.Popen] = []
        try:
            for _ in range(n):
                self.procs.append(subprocess.Popen(
                    [sys.executable, "-m", "bench.loadgen"], cwd=REPO_ROOT, env=child_env,
                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                    text=True, bufsize=1))
            for p in self.procs:
                self._read(p, 120)
        except BaseException:
            self.close()
            raise

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def _read(self, p: subprocess.Popen, timeout_s: float) -> dict:
        box: list[str] = []
        t = threading.Thread(target=lambda: box.append(p.stdout.readline()), daemon=True)
        t.start()
        t.join(timeout_s)
        if not box or not box[0]:
            raise BenchError(f"client process {p.pid} did not answer within {timeout_s:.0f}s "
                             f"(exit code {p.poll()})")
        return json.loads(box[0])

    def _send(self, p: subprocess.Popen, msg: dict) -> None:
        p.stdin.write(json.dumps(msg) + "\n")
        p.stdin.flush()

    def run(self, make_cmd: Callable[[int], dict], *, timeout_s: float = 900.0,
            on_start: Callable[[], None] | None = None) -> Aggregate:
        """Prepare every process with ``make_cmd(index)``, then start them together."""
        run_id = uuid.uuid4().hex[:8]
        for i, p in enumerate(self.procs):
            self._send(p, {"op": "prepare", "index": i, "run_id": run_id, **make_cmd(i)})
        for p in self.procs:
            reply = self._read(p, 120)
            if "error" in reply:
                raise BenchError(f"client {p.pid} could not prepare: {reply['error']}\n"
                                 f"{reply.get('traceback', '')}")
        if on_start is not None:
            on_start()
        for p in self.procs:
            self._send(p, {"op": "go"})
        return aggregate([self._read(p, timeout_s) for p in self.procs])

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                try:
                    self._send(p, {"op": "quit"})
                except (BrokenPipeError, OSError):
                    pass
        for p in self.procs:
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
        self.procs = []
