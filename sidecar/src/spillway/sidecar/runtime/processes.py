"""Several sidecar processes behind one address (``sidecar.processes``): a node's failure path
on more than one core.

One sidecar process decides, spools and produces under one GIL (bench target 11: about 60 µs of
CPU per dead-lettered record, so one core tops out near 16k records/s). On a big node
``sidecar.processes=N`` runs N of them behind ``listen.address``, as grpc's multiprocessing
example does (Linux SO_REUSEPORT: the kernel spreads new connections over the processes):

- ``spillway serve`` becomes a supervisor. It binds, and never listens on, the shared address
  and the N process ports with SO_REUSEPORT, so that no other OS user can take a port while a
  process restarts; then it starts N ``spillway serve`` processes and prints one listening line
  once all of them serve.
- Process i listens on the shared address and on its own process port, which it advertises. A
  run keeps one home: the process a driver registered it with (``host:port_i``). The others
  reach it there as any node sidecar reaches a home (TallyFailures), so every job-wide limit and
  the one-dead-letter-per-record rule hold as they do across nodes; the process ports of its
  siblings are among a process's own addresses for ``home.allowed.addresses``.
- RegisterJobResponse.process_port pins a client's later calls for the run to the process that
  answered (`spillway.client` does this): the task's flush barrier waits on the spool that
  holds its records, and the driver's EndJob reaches the run's home even after its connection
  was made again (a new connection may land on any process).
- Each process has its own spool and run state (``spool.dir/process-i``), ``sidecar.id``
  (``id/i``) and Prometheus port (``metrics.prometheus.port + i``).
- A process that exits is started again (after 1 s, doubling to 30 s while it keeps failing)
  on the same ports and spool: it recovers its spooled records and its runs. SIGTERM or SIGINT
  stops them all, each with its own shutdown grace; the supervisor's death stops them too
  (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass

from spillway.sidecar.errors import ConfigError
from spillway.sidecar.runtime import stranded
from spillway.sidecar.transport import listeners

log = logging.getLogger("spillway.sidecar.runtime.processes")

_LISTENING = re.compile(r"listening on (\S+)")
RESTART_FIRST_S = 1.0
RESTART_MAX_S = 30.0
STABLE_S = 60.0  # a process that served this long restarts after RESTART_FIRST_S again


@dataclass(frozen=True)
class ProcessRole:
    """What one process of several needs to know (passed by the supervisor, ``--process-role``)."""

    index: int
    count: int
    listen: str                 # the shared address (host:port, the port resolved)
    port: int                   # this process's own port, on the listen host
    advertised: str             # what it advertises: the advertised host and `port`
    siblings: tuple[str, ...]   # every process's advertised address (its own included)
    parent_pid: int

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> ProcessRole:
        d = json.loads(text)
        d["siblings"] = tuple(d["siblings"])
        return cls(**d)

    def process_address(self) -> str:
        host, _ = listeners.split_host_port(self.listen)
        return _join(host, self.port)


def _join(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def die_with_parent(parent_pid: int) -> None:
    """SIGTERM this process when the supervisor dies (Linux), and now if it already has."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the supervisor refused to start already
        pass
    if os.getppid() != parent_pid:
        os.kill(os.getpid(), signal.SIGTERM)


# --- the supervisor ---------------------------------------------------------------------------


def _reserve(host: str, port: int, prop: str) -> socket.socket:
    """Bind (no listen) host:port with SO_REUSEPORT: the port stays this user's."""
    infos = socket.getaddrinfo(host.strip("[]") or "0.0.0.0", port, type=socket.SOCK_STREAM)
    family, _, _, _, addr = infos[0]
    s = socket.socket(family, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        s.bind(addr)
    except OSError as exc:
        s.close()
        raise ConfigError(prop, f"cannot listen on {_join(host, port)}: "
                                f"{exc.strerror or exc} (another sidecar?)") from None
    return s


def check_supported(props: Mapping[str, object]) -> None:
    """ConfigError naming what stops several processes from sharing this configuration."""
    if not hasattr(socket, "SO_REUSEPORT") or not sys.platform.startswith("linux"):
        raise ConfigError("sidecar.processes", "several processes need Linux (SO_REUSEPORT)")
    if not props.get("listen.address"):
        raise ConfigError("sidecar.processes", "several processes share a TCP listen.address; "
                                               "none is set")
    if props.get("listen.unix.socket"):
        raise ConfigError("listen.unix.socket", "a Unix socket cannot be shared by several "
                                                "processes (sidecar.processes > 1): unset one")


@dataclass
class _Child:
    role: ProcessRole
    argv: list[str]
    proc: subprocess.Popen | None = None
    ready: threading.Event | None = None
    started_at: float = 0.0
    delay_s: float = RESTART_FIRST_S


class Supervisor:
    """Starts the processes, restarts one that exits, stops them all on a signal."""

    def __init__(self, children: list[_Child], reserved: list[socket.socket],
                 grace_s: float) -> None:
        self.children = children
        self.reserved = reserved
        self.grace_s = grace_s

    def _spawn(self, child: _Child) -> None:
        child.ready = threading.Event()
        child.started_at = time.monotonic()
        child.proc = subprocess.Popen(child.argv, stdout=subprocess.PIPE, text=True)
        threading.Thread(target=self._read, args=(child.proc, child.ready),
                         name=f"spillway-process-{child.role.index}", daemon=True).start()

    @staticmethod
    def _read(proc: subprocess.Popen, ready: threading.Event) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            if not ready.is_set() and _LISTENING.search(line):
                ready.set()
                continue
            sys.stdout.write(line)  # a process prints nothing else; pass on what it does
            sys.stdout.flush()

    def start(self, timeout_s: float = 120.0) -> None:
        """Every process serving, or ConfigError naming the one that did not start (its own
        message is on stderr already); the caller stops the others."""
        for child in self.children:
            self._spawn(child)
        deadline = time.monotonic() + timeout_s
        for child in self.children:
            while not child.ready.wait(0.1):
                if child.proc.poll() is not None or time.monotonic() > deadline:
                    raise ConfigError("sidecar.processes",
                                      f"process {child.role.index} did not start (exit code "
                                      f"{child.proc.returncode}; its error is above)")

    def watch(self, done: threading.Event) -> None:
        """Until `done`: start again each process that exited."""
        due: dict[int, float] = {}
        while not done.wait(0.2):
            now = time.monotonic()
            for child in self.children:
                i = child.role.index
                if child.proc.poll() is None:
                    continue
                if i not in due:
                    if now - child.started_at > STABLE_S:
                        child.delay_s = RESTART_FIRST_S
                    log.warning("sidecar process %d (pid %d) exited with code %s; starting it "
                                "again in %.0f s", i, child.proc.pid, child.proc.returncode,
                                child.delay_s)
                    due[i] = now + child.delay_s
                    child.delay_s = min(child.delay_s * 2, RESTART_MAX_S)
                elif now >= due[i]:
                    del due[i]
                    self._spawn(child)

    def stop(self) -> None:
        live = [c.proc for c in self.children if c.proc is not None and c.proc.poll() is None]
        for p in live:
            p.terminate()
        deadline = time.monotonic() + self.grace_s + 5.0
        for p in live:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("sidecar process pid %d did not stop in time: killed", p.pid)
                p.kill()
                p.wait()
        for s in self.reserved:
            s.close()


def plan(argv: list[str], raw: Mapping[str, str], props: Mapping[str, object],
         ) -> tuple[list[_Child], list[socket.socket], str]:
    """The processes' roles and command lines, with their ports reserved."""
    from spillway.sidecar.dlq import default_spool_dir

    check_supported(props)
    n = int(props["sidecar.processes"])
    host, given = listeners.split_host_port(str(props["listen.address"]))
    reserved = [_reserve(host, int(given), "listen.address")]
    port = reserved[0].getsockname()[1]  # the given one, or a free one for port 0
    listen = _join(host, port)
    base = int(props["sidecar.processes.port.base"])
    if not base and int(given):  # port 0 (tests): free process ports too
        base = port + 1
    ports = []
    for i in range(n):
        s = _reserve(host, base + i if base else 0, "sidecar.processes.port.base")
        reserved.append(s)
        ports.append(s.getsockname()[1])
    shared = []  # every process serves these too, with SO_REUSEPORT
    if props.get("health.listen.address"):
        h, p = listeners.split_host_port(str(props["health.listen.address"]))
        reserved.append(_reserve(h, int(p), "health.listen.address"))
        shared += ["--set", f"health.listen.address={_join(h, reserved[-1].getsockname()[1])}"]
    adv = str(props.get("advertised.address") or "")
    adv_host = (listeners.split_host_port(adv)[0] if adv
                else listeners.split_host_port(listeners.default_advertised(listen))[0])
    siblings = tuple(_join(adv_host, p) for p in ports)
    spool = str(props.get("spool.dir") or default_spool_dir({**raw, "listen.address": listen}))
    try:  # another process count's directories must hold nothing (stranded.py)
        stranded.check(spool, props)
    except BaseException:
        for s in reserved:
            s.close()
        raise
    ident = str(props.get("sidecar.id") or socket.gethostname())
    children = []
    for i, p in enumerate(ports):
        role = ProcessRole(index=i, count=n, listen=listen, port=p, advertised=siblings[i],
                           siblings=siblings, parent_pid=os.getpid())
        extra = ["--listen", listen, "--process-role", role.to_json(), *shared,
                 "--set", f"spool.dir={os.path.join(spool, f'process-{i}')}",
                 "--set", f"sidecar.id={ident}/{i}"]
        metrics = int(props.get("metrics.prometheus.port") or 0)
        if metrics:
            extra += ["--set", f"metrics.prometheus.port={metrics + i}"]
        children.append(_Child(role, [sys.executable, "-m", "spillway.sidecar.cli", *argv,
                                      *extra]))
    return children, reserved, listen


def supervise(args: argparse.Namespace, raw: Mapping[str, str], props: Mapping[str, object]
              ) -> int:
    """`spillway serve` with sidecar.processes > 1: returns the exit code."""
    children, reserved, listen = plan(list(args.argv), raw, props)
    # each process stops within its own grace (shutdown.py); this waits that long and a margin
    sup = Supervisor(children, reserved, int(props["shutdown.grace.ms"]) / 1000)
    done = threading.Event()

    def _stop(signum, _frame):
        log.info("signal %s: stopping %d sidecar processes", signum, len(children))
        done.set()

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    try:
        sup.start()
        processes = ", ".join(c.role.advertised for c in children)
        print(f"spillway sidecar listening on {listen} ({len(children)} processes: "
              f"{processes})", flush=True)
        sup.watch(done)
    finally:
        sup.stop()  # the processes started, and the reserved ports
    return 0
