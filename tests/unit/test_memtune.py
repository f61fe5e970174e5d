"""When `spillway serve` re-executes itself on glibc's malloc (memtune.py)."""

from __future__ import annotations

import sys

import pytest

from spillway.sidecar import memtune


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
    monkeypatch.setattr(memtune, "wanted", lambda environ=None: True)
    monkeypatch.setattr(memtune.sys, "orig_argv", [])
    called = []
    monkeypatch.setattr(memtune.os, "execv", lambda *a: called.append(a))
    memtune.reexec_on_system_malloc()
    assert called == []


def test_reexec_keeps_the_command_line_and_the_interpreter(monkeypatch):
    environ = {k: v for k, v in memtune.os.environ.items() if k != "PYTHONMALLOC"}
    monkeypatch.setattr(memtune.os, "environ", environ)
    monkeypatch.setattr(memtune, "wanted", lambda environ=None: True)
    monkeypatch.setattr(memtune.sys, "orig_argv", ["python", "-m", "spillway.sidecar.cli",
                                                   "serve", "--listen", "127.0.0.1:0"])
    called = []
    monkeypatch.setattr(memtune.os, "execv", lambda path, argv: called.append((path, argv)))
    memtune.reexec_on_system_malloc()
    assert called == [(sys.executable, [sys.executable, "-m", "spillway.sidecar.cli", "serve",
                                        "--listen", "127.0.0.1:0"])]
    assert environ["PYTHONMALLOC"] == "malloc"  # the loop guard


def test_main_called_by_a_host_program_never_reexecutes(monkeypatch):
    from spillway.sidecar import cli

    args = cli.build_parser().parse_args(["serve", "--listen", "127.0.0.1:0"])
    assert getattr(args, "own_command_line", False) is False
