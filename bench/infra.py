"""What the benchmarks run against: a Tansu broker per target, sidecar processes started
through the CLI the way a user starts them, fresh topics, RSS readings, the local Spark session.

A target's broker, sidecars and closers stop when it ends (`Infra.end_target`, which the runner
calls); everything, Spark too, by `Infra.close()` (the harness calls it in a finally).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field

SIDECAR_START_TIMEOUT_S = 60.0


class BenchError(Exception):
    """A benchmark could not be carried out (a process did not start, a run failed)."""


def rss_kib(pid: int) -> int:
    """VmRSS of a process in KiB, from /proc/<pid>/status (0 when it has exited)."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        return 0
    return 0


def proc_status(pid: int, fields: tuple[str, ...] = ("VmRSS", "RssAnon", "RssFile",
                                                      "RssShmem", "Threads")) -> dict[str, int]:
    """Selected numeric fields of /proc/<pid>/status (memory ones in KiB)."""
    out: dict[str, int] = {}
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as fh:
            for line in fh:
                name, _, rest = line.partition(":")
                if name in fields:
                    try:
                        out[name] = int(rest.split()[0])
                    except (ValueError, IndexError):
                        continue
    except OSError:
        pass
    return out


def child_pids(pid: int) -> list[int]:
    """Direct children of ``pid`` (from /proc/<pid>/task/*/children)."""
    out: list[int] = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{tid}/children", encoding="ascii") as fh:
                    out += [int(x) for x in fh.read().split()]
            except OSError:
                continue
    except OSError:
        return []
    return out


def descendants(pid: int) -> list[int]:
    seen: list[int] = []
    todo = [pid]
    while todo:
        p = todo.pop()
        for c in child_pids(p):
            if c not in seen:
                seen.append(c)
                todo.append(c)
    return seen


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return fh.read().replace(b"\0", b" ").decode("utf-8", "replace").strip()
    except OSError:
        return ""


class RssSampler:
    """Samples a process's VmRSS every ``interval_s`` on a thread; keeps the peak."""

    def __init__(self, pid: int, interval_s: float = 0.1) -> None:
        self.pid = pid
        self.interval_s = interval_s
        self.peak_kib = 0
        self.last_kib = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            kib = rss_kib(self.pid)
            self.last_kib = kib
            self.peak_kib = max(self.peak_kib, kib)
            self._stop.wait(self.interval_s)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(2)


@dataclass
class SidecarProcess:
    """`spillway serve` as its own process."""

    proc: subprocess.Popen
    address: str
    props: dict[str, str]
    log_path: str
    workdir: str

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout_s: float = 20.0) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        if self.proc.stdout:
            self.proc.stdout.close()

    def log_tail(self, n: int = 20) -> str:
        try:
            with open(self.log_path, encoding="utf-8", errors="replace") as fh:
                return "".join(fh.readlines()[-n:])
        except OSError:
            return ""


def start_sidecar(bootstrap: str | None, workdir: str, props: Mapping[str, str] | None = None,
                  *, env: Mapping[str, str] | None = None, name: str = "sidecar",
                  log_level: str = "WARNING", listen: str = "127.0.0.1:0") -> SidecarProcess:
    """Run ``python -m spillway.sidecar.cli.main serve --listen 127.0.0.1:0`` (or ``listen``, e.g.
    another loopback address for a cluster on one host) and wait for its
    ``spillway sidecar listening on ADDR`` line."""
    os.makedirs(workdir, exist_ok=True)
    props = dict(props or {})
    props.setdefault("spool.dir", os.path.join(workdir, f"{name}-spool"))
    cmd = [sys.executable, "-m", "spillway.sidecar.cli", "--log-level", log_level, "serve",
           "--listen", listen]
    if bootstrap:
        cmd += ["--bootstrap-servers", bootstrap]
    for k, v in props.items():
        cmd += ["--set", f"{k}={v}"]
    log_path = os.path.join(workdir, f"{name}.log")
    child_env = {k: v for k, v in os.environ.items() if not k.startswith("SPILLWAY_")}
    child_env.update(env or {})
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log,
                                stdin=subprocess.DEVNULL, text=True, env=child_env)
    line_box: list[str] = []
    reader = threading.Thread(target=lambda: line_box.append(proc.stdout.readline()),
                              daemon=True)
    reader.start()
    reader.join(SIDECAR_START_TIMEOUT_S)
    line = line_box[0] if line_box else ""
    m = re.search(r"listening on (\S+)", line)
    if not m:
        proc.kill()
        proc.wait(5)
        tail = ""
        try:
            with open(log_path, encoding="utf-8", errors="replace") as fh:
                tail = fh.read()[-2000:]
        except OSError:
            pass
        raise BenchError(f"sidecar {name} did not start (stdout {line!r}); log: {tail}")
    return SidecarProcess(proc, m.group(1), props, log_path, workdir)


@dataclass
class Infra:
    """The processes shared by the targets of one harness run."""

    workdir: str = field(default_factory=lambda: tempfile.mkdtemp(prefix="spillway-bench-"))
    keep_workdir: bool = False
    _broker: object | None = None
    _sidecars: list[SidecarProcess] = field(default_factory=list)
    _spark: object | None = None
    _closers: list = field(default_factory=list)
    _broker_lock: threading.Lock = field(default_factory=threading.Lock)

    # --- broker -------------------------------------------------------------------------------

    @property
    def broker(self):
        # under a lock: target 11 starts its sidecars from several threads, and each used to
        # start a broker of its own (all but one leaked, and measured as the wrong one)
        with self._broker_lock:
            if self._broker is None:
                from spillway.sidecar.runtime.embedded import EmbeddedBroker

                self._broker = EmbeddedBroker(
                    log_path=os.path.join(self.workdir, "tansu.log")).start()
            return self._broker

    @property
    def bootstrap(self) -> str:
        return self.broker.bootstrap_servers

    def broker_pid(self) -> int:
        proc = getattr(self.broker, "_proc", None)
        return proc.pid if proc is not None else 0

    def fresh_topic(self, label: str, partitions: int = 1) -> str:
        """A new DLQ-prefixed topic, created now (outside any timed window)."""
        from confluent_kafka.admin import AdminClient, NewTopic

        name = f"dlq.bench-{label}-{uuid.uuid4().hex[:8]}"
        admin = AdminClient({"bootstrap.servers": self.bootstrap})
        for fut in admin.create_topics([NewTopic(name, num_partitions=partitions,
                                                 replication_factor=1)]).values():
            fut.result(30)
        return name

    def topic_records(self, topic: str, expect: int, idle_s: float = 5.0) -> int:
        """Records readable in ``topic``: read from the start (assign(), no group) until
        ``expect`` were seen or nothing came for ``idle_s`` (Tansu's high watermark can lag
        the records it stores, so they are counted, not inferred from offsets)."""
        import time

        from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

        c = Consumer({"bootstrap.servers": self.bootstrap, "group.id": "bench-count",
                      "enable.auto.commit": False, "enable.partition.eof": False})
        try:
            parts = c.list_topics(topic, timeout=30).topics[topic].partitions
            c.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in parts])
            seen = 0
            last = time.monotonic()
            while seen < expect and time.monotonic() - last < idle_s:
                got = [m for m in c.consume(10_000, 0.5) if m.error() is None]
                if got:
                    seen += len(got)
                    last = time.monotonic()
            return seen
        finally:
            c.close()

    # --- sidecars -----------------------------------------------------------------------------

    def sidecar(self, props: Mapping[str, str] | None = None, *, name: str = "sidecar",
                kafka: bool = True, env: Mapping[str, str] | None = None,
                listen: str = "127.0.0.1:0") -> SidecarProcess:
        s = start_sidecar(self.bootstrap if kafka else None, self.workdir, props, env=env,
                          name=f"{name}-{uuid.uuid4().hex[:6]}", listen=listen)
        self._sidecars.append(s)
        return s

    def stop_sidecar(self, s: SidecarProcess) -> None:
        s.stop()
        if s in self._sidecars:
            self._sidecars.remove(s)

    # --- spark --------------------------------------------------------------------------------

    @property
    def spark(self):
        if self._spark is None:
            from pyspark.sql import SparkSession

            os.environ["PYSPARK_PYTHON"] = sys.executable
            os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
            for k in [k for k in os.environ if k.startswith("SPILLWAY_")]:
                del os.environ[k]  # executors use the job's own sidecar address
            os.environ["SPARK_LOCAL_IP"] = "127.0.0.1"  # loopback only, driver and executors
            self._spark = (
                SparkSession.builder.master("local[2]")
                .appName("spillway-bench")
                .config("spark.ui.enabled", "false")
                .config("spark.ui.showConsoleProgress", "false")
                .config("spark.driver.host", "127.0.0.1")
                .config("spark.driver.bindAddress", "127.0.0.1")
                .config("spark.driver.memory", "3g")
                .config("spark.sql.shuffle.partitions", "4")
                .config("spark.sql.execution.arrow.pyspark.enabled", "true")
                .config("spark.python.worker.reuse", "true")
                .config("spark.sql.adaptive.enabled", "false")
                .getOrCreate())
            self._spark.sparkContext.setLogLevel("ERROR")
        return self._spark

    def spark_started(self) -> bool:
        return self._spark is not None

    def on_close(self, fn) -> None:
        self._closers.append(fn)

    # --- teardown -----------------------------------------------------------------------------

    def end_target(self) -> None:
        """Stop what one target started: its closers, its sidecars and the broker, so that no
        target runs beside an earlier one's idle sidecars or on a broker holding its records
        (Tansu keeps them all in memory). Spark stays: a JVM started again per target would
        cost each Spark target a warm-up."""
        self._close_target()
        self._stop_broker()

    def _close_target(self) -> None:
        closers, self._closers = self._closers, []
        for fn in reversed(closers):
            try:
                fn()
            except Exception:  # noqa: BLE001 - best effort teardown
                pass
        for s in list(self._sidecars):
            try:
                s.stop()
            except Exception:  # noqa: BLE001
                pass
        self._sidecars.clear()

    def _stop_broker(self) -> None:
        with self._broker_lock:
            broker, self._broker = self._broker, None
        if broker is not None:
            try:
                broker.resume()
                broker.stop()
            except Exception:  # noqa: BLE001
                pass

    def close(self) -> None:
        self._close_target()
        if self._spark is not None:
            try:
                self._spark.stop()
            except Exception:  # noqa: BLE001
                pass
            self._spark = None
        self._stop_broker()
        if not self.keep_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)
