"""The platform recipes of deploy/ run as their platform runs them, into a temporary root.

`build_bundle` makes what an operator uploads (deploy/platform/make-bundle.sh: the scripts and a
wheelhouse of the three spillway wheels built from this checkout plus the pinned dependencies).
The third-party wheels come from a cache kept across runs (``$SPILLWAY_DEPLOY_WHEELHOUSE``,
default ``~/.cache/spillway/deploy-wheelhouse``), filled with `pip download` only when building
offline from it fails; under ``CI=true`` a cache that cannot be filled fails the run.

`Node` is one node's temporary root (``SPILLWAY_ROOT``: every path a recipe writes is under
it), with the processes the recipe started there (found through /proc, by the root's path on
their command line) and a way to stop them.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from support.ci import in_ci

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
MAKE_BUNDLE = DEPLOY / "platform" / "make-bundle.sh"
RECIPE_TIMEOUT_S = 240


def wheel_cache() -> Path:
    path = Path(os.environ.get("SPILLWAY_DEPLOY_WHEELHOUSE")
                or Path.home() / ".cache" / "spillway" / "deploy-wheelhouse")
    path.mkdir(parents=True, exist_ok=True)
    return path


@contextlib.contextmanager
def _locked(directory: Path):
    with open(directory / ".lock", "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=RECIPE_TIMEOUT_S, **kw)


def build_bundle(out: Path) -> Path:
    """make-bundle.sh into ``out``, offline from the cache (filled first when it lacks a
    wheel); the build backends are this venv's (requirements/dev.txt pins them)."""
    cache = wheel_cache()
    env = {**os.environ, "PYTHON": sys.executable}
    offline = ["--no-index", "--find-links", str(cache), "--no-build-isolation"]
    with _locked(cache):
        proc = _run(["bash", str(MAKE_BUNDLE), str(out), "--", *offline], env=env)
        if proc.returncode != 0:
            fill = _run([sys.executable, "-m", "pip", "download", "-q",
                         "--disable-pip-version-check", "--only-binary=:all:", "--dest",
                         str(cache), "-r", str(ROOT / "requirements" / "sidecar.txt")])
            if fill.returncode != 0:
                why = f"cannot fill the wheel cache {cache}:\n{fill.stderr[-2000:]}"
                if in_ci():
                    pytest.fail(why)
                pytest.skip(why)
            proc = _run(["bash", str(MAKE_BUNDLE), str(out), "--", *offline], env=env)
    assert proc.returncode == 0, f"make-bundle.sh failed:\n{proc.stdout}\n{proc.stderr}"
    return out


def bare_python(path: Path) -> Path:
    """A venv without pip standing in for a cluster's Python (the recipe installs into it
    with the sidecar venv's pip)."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True,
                   timeout=60)
    return path / "bin" / "python"


def base_env(**extra: str) -> dict[str, str]:
    """A root shell's environment: PATH and the like, none of this test run's SPILLWAY_*."""
    keep = ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR", "USER", "LOGNAME")
    env = {k: os.environ[k] for k in keep if k in os.environ}
    return {**env, **extra}


class Node:
    """One node's temporary root and what the recipe started in it."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def path(self, absolute: str) -> Path:
        return self.root / absolute.lstrip("/")

    @property
    def socket_address(self) -> str:
        return f"unix://{self.path('/run/spillway/sidecar.sock')}"

    def processes(self, what: str) -> list[int]:
        """Pids whose command line holds ``what`` and this root (serve / supervise)."""
        out = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                argv = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            words = [a.decode(errors="replace") for a in argv if a]
            if what in words and any(str(self.root) in w for w in words):
                out.append(int(entry.name))
        return sorted(out)

    def sidecars(self) -> list[int]:
        return self.processes("serve")

    def supervisors(self) -> list[int]:
        return self.processes("supervise")

    def run(self, argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
        """The recipe as a platform runs it, SIGHUP ignored as under nohup (init and bootstrap
        scripts often are): everything it starts inherits that, and must work all the same."""
        # a shell that ignores SIGHUP, then execs the recipe (no preexec_fn: Python code
        # between fork and exec runs gRPC's fork handlers in a process full of its threads)
        proc = _run(["bash", "-c", 'trap "" HUP; exec "$@"', "bash", *argv],
                    env={**env, "SPILLWAY_ROOT": str(self.root)})
        assert proc.returncode == 0, f"{argv[0]} failed ({proc.returncode}):\n{proc.stderr}"
        return proc

    def stop(self) -> None:
        """The recipe's own stop (SIGTERM to the restart loop, which stops the sidecar), then
        whatever is left, by pid."""
        script = self.path("/opt/spillway/libexec/spillway-node.sh")
        if script.exists():
            _run(["bash", str(script), "stop"],
                 env=base_env(SPILLWAY_ROOT=str(self.root)))
        for pid in self.supervisors() + self.sidecars():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def wait_gone(self, timeout_s: float = 30.0) -> list[int]:
        deadline = time.monotonic() + timeout_s
        while (left := self.supervisors() + self.sidecars()) and time.monotonic() < deadline:
            time.sleep(0.1)
        return left


def tool(name: str, hint: str) -> str:
    """A command the tests need: this venv's bin first (pip-installed tools), then PATH."""
    found = shutil.which(name, path=os.pathsep.join(
        [os.path.dirname(sys.executable), os.environ.get("PATH", "")]))
    if not found:
        pytest.skip(f"{name} not found ({hint})")
    return found


# what an executor does first: reach its node's sidecar with the environment its platform gave it
EXECUTOR_PROBE = """
from spillway.client import SidecarClient
client = SidecarClient(timeout_s=10)
print(client.target, client.health(), client.status().sidecar_id)
"""


def probe_from_executor(python, env: dict[str, str], *, source: str | None = None) -> list[str]:
    """Run EXECUTOR_PROBE with the executors' Python: with ``env`` (a YARN container's
    environment) or after sourcing ``source`` (a spark-env.sh, as a Spark worker does)."""
    base = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/root")}
    if source:
        argv = ["bash", "-c", f'. "{source}" && exec "{python}" -c "$0"', EXECUTOR_PROBE]
    else:
        argv = [str(python), "-c", EXECUTOR_PROBE]
    proc = subprocess.run(argv, env={**base, **env}, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.split()


def assert_serving_once(node: Node) -> int:
    """One restart loop and one sidecar in this root, SERVING on its socket; the sidecar's pid."""
    from spillway.client import SidecarClient

    assert len(node.supervisors()) == 1, node.supervisors()
    sidecars = node.sidecars()
    assert len(sidecars) == 1, sidecars
    client = SidecarClient(node.socket_address, timeout_s=10)
    try:
        assert client.health() == "SERVING"
    finally:
        client.close()
    return sidecars[0]


def assert_second_run_changes_nothing(node: Node, run, files: tuple[str, ...],
                                      once: tuple[tuple[str, str], ...] = ()):
    """A recipe run again: it reinstalls nothing, rewrites none of ``files`` (bytes and mtime),
    leaves each (file, line) of ``once`` there once, and keeps the same sidecar; its result."""
    paths = [node.path(p) for p in files]
    before = [(f.read_bytes(), f.stat().st_mtime_ns) for f in paths]
    pid = assert_serving_once(node)
    again = run()
    assert "already has these wheels" in again.stderr and "already running" in again.stderr
    assert [(f.read_bytes(), f.stat().st_mtime_ns) for f in paths] == before
    for path, line in once:
        assert node.path(path).read_text().count(line) == 1, (path, line)
    assert assert_serving_once(node) == pid  # the same sidecar, not a second one
    return again


def properties(path) -> dict[str, str]:
    out = {}
    for line in path.read_text().splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            out[key] = value
    return out


def executor_env_from_spark_defaults(path) -> dict[str, str]:
    """What YARN gives an executor's container: the spark.executorEnv.* of spark-defaults.conf."""
    out = {}
    for line in path.read_text().splitlines():
        if line.startswith("spark.executorEnv."):
            key, value = line.split(None, 1)
            out[key.removeprefix("spark.executorEnv.")] = value
    return out
