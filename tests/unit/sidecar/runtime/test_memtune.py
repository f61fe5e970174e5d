"""When `spillway serve` re-executes itself on glibc's malloc (memtune.py)."""

from __future__ import annotations

import os
import sys
import time

import pytest
from spillway.sidecar.runtime import memtune, restart
from support.fakes import FakeClock


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc: Linux only")
def test_wanted_on_glibc_when_no_allocator_was_chosen():
    assert memtune.wanted({}) is True
    assert memtune.wanted({"PYTHONMALLOC": "pymalloc"}) is False
    assert memtune.wanted({"PYTHONMALLOC": "malloc"}) is False  # the re-executed process


def test_not_wanted_off_linux(monkeypatch):
    monkeypatch.setattr(memtune.sys, "platform", "darwin")
    assert memtune.wanted({}) is False


def test_no_reexec_without_the_interpreters_command_line(monkeypatch):
    monkeypatch.delenv("PYTHONMALLOC", raising=False)
    monkeypatch.setattr(restart.sys, "orig_argv", [])
    called = []
    monkeypatch.setattr(restart.os, "execv", lambda *a: called.append(a))
    restart.reexec({"PYTHONMALLOC": "malloc"})
    assert called == []
    assert "PYTHONMALLOC" not in restart.os.environ


def test_reexec_keeps_the_command_line_and_the_interpreter(monkeypatch):
    environ = {k: v for k, v in restart.os.environ.items()
               if k not in ("PYTHONMALLOC", "PYTHONHASHSEED")}
    monkeypatch.setattr(restart.os, "environ", environ)
    monkeypatch.setattr(restart.sys, "orig_argv", ["python", "-m", "spillway.sidecar.cli",
                                                    "serve", "--listen", "127.0.0.1:0"])
    called = []
    monkeypatch.setattr(restart.os, "execv", lambda path, argv: called.append((path, argv)))
    restart.reexec({})  # nothing to change: no exec
    restart.reexec({"PYTHONMALLOC": "malloc", "PYTHONHASHSEED": "7"})
    assert called == [(sys.executable, [sys.executable, "-m", "spillway.sidecar.cli", "serve",
                                        "--listen", "127.0.0.1:0"])]
    # the loop guard: the new process finds them set
    assert (environ["PYTHONMALLOC"], environ["PYTHONHASHSEED"]) == ("malloc", "7")


def test_main_called_by_a_host_program_never_reexecutes(monkeypatch):
    from spillway.sidecar.cli import main as cli

    seen = []
    monkeypatch.setattr(cli, "cmd_serve", lambda args: seen.append(args.own_command_line) or 0)
    assert cli.main(["serve", "--listen", "127.0.0.1:0"]) == 0  # a host program's argv
    monkeypatch.setattr(cli.sys, "argv", ["spillway", "serve", "--listen", "127.0.0.1:0"])
    assert cli.main() == 0  # the process's own command line
    assert seen == [False, True]


_BEFORE_EXEC = (
    "import os, sys\n"
    "from spillway.sidecar.cli import main as cli\n"
    "from spillway.sidecar.runtime import memtune\n"
    "def execv(*a):\n"
    "    heavy = [m for m in ('spillway.sidecar.server', 'spillway.sidecar.service.servicer', "
    "'opentelemetry.sdk.trace') if m in sys.modules]\n"
    "    print('exec', heavy, os.environ.get('PYTHONMALLOC'), "
    "os.environ.get('PYTHONHASHSEED') is not None); sys.exit(0)\n"
    "os.execv = execv\n"
    "memtune.wanted = lambda environ=None: True\n"
    "sys.argv = ['spillway', 'serve'] + sys.argv[1:]\n"
    "cli.main()\n")


@pytest.mark.parametrize("flags, seed", [
    (["--listen", "127.0.0.1:0"], False),  # no run states kept: glibc's malloc only
    (["--listen", "127.0.0.1:0", "--bootstrap-servers", "127.0.0.1:9", "--set",
      "spool.dir={tmp}"], True),
])
def test_serve_reexecutes_once_before_the_servers_imports(flags, seed, tmp_path):
    """The process that re-executes pays for the command line's parser and for finding the
    spool's hash seed, not for the server: one exec carries both the allocator and the seed
    (the server's imports were ~0.2 s of CPU, and a second exec ~0.6 s more, per start)."""
    import subprocess

    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONMALLOC", "PYTHONHASHSEED")}
    argv = [f.format(tmp=tmp_path / "spool") for f in flags]
    out = subprocess.run([sys.executable, "-c", _BEFORE_EXEC, *argv], capture_output=True,
                         text=True, timeout=60, env=env)
    assert out.stdout.strip() == f"exec [] malloc {seed}", out.stdout + out.stderr
    if seed:
        assert (tmp_path / "spool" / "hashseed").stat().st_mode & 0o777 == 0o600


def _wait_for(pred, timeout_s=5.0):
    end = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.01)


def test_trimmer_trims_once_after_a_burst_of_ended_runs():
    # the trimmer's clock is the test's: a busy machine that runs this thread late cannot
    # stretch the burst past the quiet period (its real waits only bound how often it looks)
    clock = FakeClock()
    calls = []
    t = memtune.Trimmer(threshold=3, quiet_s=0.2, release=lambda: calls.append(clock.monotonic()),
                        clock=clock.monotonic)
    try:
        start = clock.monotonic()
        for _ in range(10):  # a burst: one trim after it, none per call
            t.freed()
            clock.advance(10)
            time.sleep(0.01)
        last = clock.monotonic()
        time.sleep(0.3)
        assert calls == []  # 10 ms after the burst: not quiet yet, whatever the real time
        clock.advance(300)
        _wait_for(lambda: calls)
        time.sleep(0.3)
        assert len(calls) == 1 and calls[0] >= last + 0.15 > start
        t.freed()  # below the threshold: nothing to hand back
        clock.advance(400)
        time.sleep(0.4)
        assert len(calls) == 1
        t.freed(2)
        clock.advance(300)
        _wait_for(lambda: len(calls) == 2)
        assert t.trims == 2
    finally:
        t.stop()


def test_trimmer_stop_ends_its_thread_and_ignores_later_frees():
    calls = []
    t = memtune.Trimmer(threshold=1, quiet_s=10.0, release=lambda: calls.append(1))
    t.freed()
    thread = t._thread
    t.stop()
    assert thread is not None and not thread.is_alive()
    t.freed()
    assert calls == [] and t._thread is thread
