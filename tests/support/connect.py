"""A local Spark Connect server as its own process, started from the pyspark wheel, and a
client session to it: the shape Databricks serverless and standard clusters (and Spark 4's
``spark.api.mode=connect``) give a job.

The server is ``spark-submit --class org.apache.spark.sql.connect.service.SparkConnectServer``
(what ``sbin/start-connect-server.sh --wait`` runs, without its pid and log files in the wheel's
directory) on a free loopback port, with ``local[N]`` executors whose Python workers run this
interpreter (``PYSPARK_PYTHON``: spillway is importable there) and find the sidecar through
``$SPILLWAY_SIDECAR_ADDRESS`` in the server's environment: the server's executors, not the
client, talk to the sidecar. `ConnectServer.stop` ends the server's process group (the JVM and
its Python workers).

pyspark marks the whole client process as "Spark Connect" once a remote session exists
(``SPARK_CONNECT_MODE_ENABLED``: ``pyspark.sql.functions`` then build Connect columns), so
`connect_session` hands the mode back when it ends: classic tests run in the same pytest
process afterwards.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

from spillway.sidecar.runtime.embedded import listens
from support.ports import free_port

SERVER_CLASS = "org.apache.spark.sql.connect.service.SparkConnectServer"
_MODE_ENV = ("SPARK_CONNECT_MODE_ENABLED", "SPARK_REMOTE")


def _listens_in_group(port: int, pgid: int) -> bool:
    """Whether the socket listening on ``port`` belongs to a process of the process group
    ``pgid``. Where /proc cannot tell, yes."""
    told = False
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.getpgid(int(pid)) != pgid:
                continue
        except OSError:
            continue
        held = listens(int(pid), port)
        if held:
            return True
        told = told or held is not None
    return not told


def spark_home() -> Path:
    import pyspark

    return Path(pyspark.__file__).resolve().parent


class ConnectServer:
    """One Spark Connect server process: `start` waits until its gRPC port answers."""

    def __init__(self, workdir: Path, *, env: Mapping[str, str] | None = None, cores: int = 2,
                 conf: Mapping[str, str] | None = None, start_timeout_s: float = 180.0,
                 task_attempts: int = 1) -> None:
        self.workdir = Path(workdir)
        self.port = free_port()
        self.cores = cores
        self.task_attempts = task_attempts   # local[N] tries a task once; local[N,F] F times
        self.extra_env = dict(env or {})
        self.conf = dict(conf or {})
        self.start_timeout_s = start_timeout_s
        self.log_path = self.workdir / "connect-server.log"
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"sc://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        conf = {
            "spark.connect.grpc.binding.address": "127.0.0.1",
            "spark.connect.grpc.binding.port": str(self.port),
            "spark.driver.host": "127.0.0.1",
            "spark.driver.bindAddress": "127.0.0.1",
            "spark.ui.enabled": "false",
            "spark.ui.showConsoleProgress": "false",
            "spark.sql.shuffle.partitions": "4",
            "spark.driver.memory": "1g",
            "spark.python.worker.reuse": "true",
            **self.conf,
        }
        master = (f"local[{self.cores},{self.task_attempts}]" if self.task_attempts > 1
                  else f"local[{self.cores}]")
        cmd = [str(spark_home() / "bin" / "spark-submit"), "--class", SERVER_CLASS,
               "--name", "spillway-tests-connect", "--master", master]
        for k, v in conf.items():
            cmd += ["--conf", f"{k}={v}"]
        return cmd

    def environment(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in _MODE_ENV}
        env.update({
            "SPARK_HOME": str(spark_home()),
            "SPARK_LOCAL_IP": "127.0.0.1",
            "SPARK_CONNECT_MODE": "0",           # what start-connect-server.sh sets
            "PYSPARK_PYTHON": sys.executable,    # executors import spillway from this venv
            "PYSPARK_DRIVER_PYTHON": sys.executable,
            **self.extra_env,
        })
        return env

    def start(self, attempts: int = 3) -> ConnectServer:
        """Start the server and wait until it listens. Its port is picked free here but bound
        by the JVM seconds later, and another process of a parallel run (a sidecar, a broker,
        a Spark driver binding port 0) may be given it meanwhile: then the port answers but not
        from this server, or this server cannot bind it. Either way it starts again on another
        port (up to ``attempts`` times) instead of the tests talking to that other process."""
        for attempt in range(1, attempts + 1):
            if self._start_once(last=attempt == attempts):
                return self
            self.port = free_port()
        raise AssertionError("unreachable")  # _start_once(last=True) returns True or raises

    def _start_once(self, *, last: bool) -> bool:
        self.workdir.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")
        try:
            # its own process group: `stop` ends the JVM and the Python workers it forked
            self.proc = subprocess.Popen(self.command(), cwd=self.workdir, env=self.environment(),
                                         stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                         start_new_session=True)
        finally:
            log.close()
        deadline = time.monotonic() + self.start_timeout_s
        while True:
            if self.proc.poll() is not None:
                if not last and "Address already in use" in self.log_tail():
                    return False   # another process took the port first
                raise RuntimeError(f"the Spark Connect server exited with {self.proc.returncode}"
                                   f" before listening; its log:\n{self.log_tail()}")
            with contextlib.suppress(OSError), socket.create_connection(
                    ("127.0.0.1", self.port), timeout=1.0):
                if _listens_in_group(self.port, self.proc.pid):
                    return True
                if last:
                    self.stop()
                    raise RuntimeError(f"127.0.0.1:{self.port} answers, but not from the Spark "
                                       f"Connect server started on it (another process has it)")
                self.stop()
                return False
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the Spark Connect server did not listen on "
                                   f"127.0.0.1:{self.port} within {self.start_timeout_s:.0f} s; "
                                   f"its log:\n{self.log_tail()}")
            time.sleep(0.5)

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self, timeout_s: float = 30.0) -> None:
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        # the JVM's Python workers leave when it goes; make sure none outlives the group
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)


@contextlib.contextmanager
def connect_session(server: ConnectServer) -> Iterator:
    """``SparkSession.builder.remote(server.url).getOrCreate()``, stopped at the end, with
    pyspark's process-wide Connect mode handed back (see the module docstring).

    Built with the Connect builder itself: ``pyspark.sql.SparkSession.builder.remote`` refuses
    (SESSION_ALREADY_EXIST) while the classic session of the other test modules runs in this
    process; the mode it would set is set here."""
    from pyspark.sql.connect.session import SparkSession as ConnectSession

    before = {k: os.environ.get(k) for k in _MODE_ENV}
    os.environ["SPARK_CONNECT_MODE_ENABLED"] = "1"  # pyspark.sql.functions build Connect columns
    try:
        session = ConnectSession.builder.remote(server.url).getOrCreate()
    except BaseException:
        _restore(before)
        raise
    try:
        yield session
    finally:
        try:
            session.stop()
        finally:
            _restore(before)


def _restore(env: Mapping[str, str | None]) -> None:
    for k, v in env.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@contextlib.contextmanager
def running_connect_server(workdir: Path, **kw) -> Iterator[ConnectServer]:
    server = ConnectServer(workdir, **kw).start()
    try:
        yield server
    finally:
        server.stop()


# Spark's foreachBatch runner waits for its Python process on a loopback port picked by the
# kernel (PythonWorkerFactory.createSimpleWorker) and reads a length-prefixed secret from the
# first connection. A gRPC client of another test of the same parallel run, still retrying an
# address whose sidecar has stopped, may be given that very port: its HTTP/2 preface ("PRI ")
# read as a length asks the JVM for 1.3 GB ("Java heap space", seen once in CI). Nothing of
# the query started; the next start gets another port.
_START_RETRIED = ("failed to connect back", "Java heap space")


def start_stream(writer, attempts: int = 3):
    """``writer.start()``, tried again when the server's foreachBatch runner did not start:
    its Python process did not connect back within Spark's fixed 10 s (PythonWorkerFactory;
    an import of pyspark's Connect client can take longer on a loaded machine, seen on this
    2-core one), or another process reached the port it waited on (`_START_RETRIED`). Any
    other error is raised at once."""
    for attempt in range(1, attempts + 1):
        try:
            return writer.start()
        except Exception as exc:  # noqa: BLE001 - only the known start-up failures are retried
            if not any(m in str(exc) for m in _START_RETRIED) or attempt == attempts:
                raise
