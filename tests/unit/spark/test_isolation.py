"""Crash and hang isolation, without Spark: the guard's helper process (`_guard`), the task
attempts' crumbs (`_isolation`) and the watchdog (`_watchdog`), each with real processes."""

from __future__ import annotations

import ctypes
import os
import signal
import time

import pytest
from spillway.client.markers import RecordTimeoutError, WorkerCrashError
from spillway.spark import _guard, _isolation, _watchdog
from spillway.spark._guard import Guard, own_frames
from spillway.spark._isolation import Crumbs, Earlier, TaskIsolation


def record(x):
    if x == "segfault":
        ctypes.string_at(0)
    if x == "exit":
        os._exit(3)
    if x == "sys.exit":
        raise SystemExit(4)
    if x == "hang":
        time.sleep(60)
    if x == "bad":
        raise ValueError(f"bad {x}")
    if x == "pid":
        return os.getpid()
    if x == "unpicklable":
        return lambda: os.getpid()
    return x.upper()


def children() -> list[int]:
    with open(f"/proc/{os.getpid()}/task/{os.getpid()}/children") as f:
        return [int(p) for p in f.read().split()]


@pytest.fixture
def guard():
    g = Guard(record, timeout_ms=1000)
    yield g
    g.close()


def test_a_record_runs_in_a_helper_and_its_result_comes_back(guard):
    assert guard("ok") == "OK"
    assert guard("pid") != os.getpid()    # it ran in the helper


def test_a_segfault_kills_only_the_helper_and_says_how(guard):
    with pytest.raises(WorkerCrashError) as e:
        guard("segfault")
    assert e.value.signal == signal.SIGSEGV and e.value.exit_status is None
    assert "killed by signal 11 (SIGSEGV)" in str(e.value)
    note = "\n".join(e.value.__notes__)
    assert "Segmentation fault" in note and "in record" in note and "in string_at" in note
    assert "_serve" not in note               # the frames it inherited from this process: cut
    assert guard("ok") == "OK"                # a new helper serves the next record


@pytest.mark.parametrize(("arg", "status"), [("exit", 3), ("sys.exit", 4)])
def test_an_exit_kills_only_the_helper_and_says_with_what_status(guard, arg, status):
    with pytest.raises(WorkerCrashError, match=f"exited with status {status}") as e:
        guard(arg)
    assert e.value.exit_status == status and e.value.signal is None


def test_a_record_past_the_timeout_is_stopped_with_its_stack(guard):
    started = time.monotonic()
    with pytest.raises(RecordTimeoutError, match=r"errors.record.timeout.ms=1000") as e:
        guard("hang")
    assert 1.0 <= time.monotonic() - started < 10
    assert e.value.timeout_ms == 1000
    assert "in record" in "\n".join(e.value.__notes__)   # where it hung
    assert guard("ok") == "OK"


def test_a_helper_killed_between_records_is_replaced_without_blaming_the_next(guard):
    guard("ok")
    os.kill(guard._helper.pid, signal.SIGKILL)  # noqa: SLF001 - e.g. the OOM killer, idle
    time.sleep(0.2)
    assert guard("ok") == "OK" and guard.deaths == 0


def test_a_record_that_raised_in_the_helper_raises_its_own_error_here(guard):
    with pytest.raises(ValueError, match="bad bad") as e:
        guard("bad")
    assert e.value.__traceback__ is not None   # a real traceback, from this process


def test_a_result_that_cannot_travel_is_computed_here(guard):
    fn = guard("unpicklable")
    assert fn() == os.getpid()


def test_arguments_that_cannot_travel_run_here_unguarded():
    g = Guard(lambda f: f(), timeout_ms=0)
    try:
        assert g(lambda: os.getpid()) == os.getpid()
        assert g.calls == 0
    finally:
        g.close()


def test_close_stops_the_helper():
    g = Guard(record)
    g("ok")
    helper = g._helper.pid  # noqa: SLF001 - the process the test checks is gone
    assert helper in children()
    g.close()
    assert helper not in children()


def test_own_frames_cut_what_the_helper_inherited():
    dump = (f"Fatal Python error: Segmentation fault\n\nCurrent thread 0x1 (most recent call "
            f"first):\n  File \"/x/user.py\", line 3 in parse\n"
            f"  File \"/y/{os.path.basename(_guard.__file__)}\", line 9 in _serve\n"
            f"  File \"/y/pyspark/worker.py\", line 1 in main\n\nExtension modules: grpc\n")
    assert own_frames(dump) == ("Fatal Python error: Segmentation fault\n\nCurrent thread 0x1 "
                                "(most recent call first):\n  File \"/x/user.py\", line 3 in "
                                "parse")


# --- crumbs --------------------------------------------------------------------------------------


def dead_pid() -> int:
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    return pid


@pytest.fixture
def crumbs(tmp_path):
    return Crumbs(str(tmp_path / "crumbs"))


def test_a_first_attempt_runs_unguarded_and_a_success_leaves_nothing(crumbs):
    crumb = crumbs.begin("task", 0)
    assert open(crumb.path).read().split()[:2] == ["running", str(os.getpid())]
    crumb.end(True)
    assert os.listdir(crumbs.directory) == []


def test_an_attempt_whose_process_died_running_puts_the_next_at_risk(crumbs):
    os.makedirs(crumbs.directory, exist_ok=True)
    with open(os.path.join(crumbs.directory, "task.0"), "w") as f:
        f.write(f"running {dead_pid()} 1\n")
    earlier = crumbs.earlier("task", 1)
    assert earlier == Earlier(died=(0,)) and earlier.at_risk
    assert "attempt(s) 0 died on this node" in earlier.describe()


def test_an_attempt_the_watchdog_stopped_is_a_death_past_the_timeout(crumbs):
    os.makedirs(crumbs.directory, exist_ok=True)
    with open(os.path.join(crumbs.directory, "task.0"), "w") as f:
        f.write(f"timeout {dead_pid()} 1\n")
    earlier = crumbs.earlier("task", 1)
    assert earlier.died == (0,) and earlier.timed_out == (0,)
    assert "stopped past errors.record.timeout.ms" in earlier.describe()


def test_an_attempt_that_failed_alive_or_still_runs_is_no_risk(crumbs):
    crumbs.begin("task", 0).end(False)          # a FAIL verdict: its process lived
    assert open(os.path.join(crumbs.directory, "task.0")).read().startswith("ended ")
    with open(os.path.join(crumbs.directory, "task.1"), "w") as f:
        f.write(f"running {os.getppid()} {_isolation.process_start(os.getppid())}\n")
    assert crumbs.earlier("task", 2) == Earlier()   # attempt 1: a speculative copy, alive


def test_a_reused_pid_is_no_proof_of_life(crumbs):
    os.makedirs(crumbs.directory, exist_ok=True)
    with open(os.path.join(crumbs.directory, "task.0"), "w") as f:
        f.write(f"running {os.getppid()} 1\n")       # the pid lives, but started at another time
    assert crumbs.earlier("task", 1).died == (0,)


def test_an_attempt_that_left_no_crumb_here_puts_the_next_at_risk(crumbs):
    crumbs.begin("task", 1).end(False)
    assert crumbs.earlier("task", 2) == Earlier(unknown=(0,))


def test_a_success_takes_the_earlier_attempts_crumbs_away(crumbs):
    crumbs.begin("task", 0).end(False)
    crumbs.begin("task", 1).end(True)
    assert os.listdir(crumbs.directory) == []


def test_stale_crumbs_are_pruned_once(crumbs):
    os.makedirs(crumbs.directory)
    stale = os.path.join(crumbs.directory, "old.0")
    open(stale, "w").close()
    os.utime(stale, (1, 1))
    crumbs.begin("task", 0)
    assert os.listdir(crumbs.directory) == ["task.0"]


def test_an_unusable_directory_makes_no_crumb_and_fails_nothing(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert Crumbs(str(blocker / "crumbs")).begin("task", 0) is None


def test_a_task_at_risk_wraps_its_functions_in_guards(crumbs):
    iso = TaskIsolation(None, Earlier(died=(0,)), timeout_ms=0)
    g = iso.wrap(record)
    try:
        assert isinstance(g, Guard) and g("pid") != os.getpid()
    finally:
        iso.end(True)
    assert g._helper is None  # noqa: SLF001 - ended: its helper is stopped
    plain = TaskIsolation(None, Earlier())
    assert plain.wrap(record) is record and not plain.wraps


# --- the watchdog ---------------------------------------------------------------------------------


def in_worker(body) -> tuple[int, float]:
    """Run ``body()`` in a forked "worker" (the watchdog kills its worker, never pytest);
    its wait status and how long it lived."""
    started = time.monotonic()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            _watchdog._watchdog = None   # noqa: SLF001 - this worker's own
            body()
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return status, time.monotonic() - started


def test_the_watchdog_kills_a_worker_whose_record_outlasts_the_timeout(tmp_path):
    crumb = tmp_path / "task.0"

    def body():
        dog = _watchdog.watchdog()
        dog.arm(str(crumb), "timeout 1 2\n", 300)
        dog.timed(lambda: time.sleep(30))()

    status, lived = in_worker(body)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    assert lived < 10
    assert crumb.read_text() == "timeout 1 2\n"


def test_the_watchdog_counts_only_records_own_time(tmp_path):
    crumb = tmp_path / "task.0"

    def body():
        dog = _watchdog.watchdog()
        dog.arm(str(crumb), "timeout 1 2\n", 300)
        step = dog.timed(lambda s: time.sleep(s))
        for _ in range(3):
            step(0.1)          # each record within the limit
            time.sleep(0.5)    # between records (Spark's I/O): never counted
        dog.disarm()
        step(0.6)              # disarmed: not watched

    status, _ = in_worker(body)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    assert not crumb.exists()


def test_where_no_helper_can_start_records_run_unguarded(monkeypatch, caplog):
    def no_fork():
        raise OSError(11, "Resource temporarily unavailable")

    monkeypatch.setattr(_guard.os, "fork", no_fork)
    g = Guard(record)
    assert g("pid") == os.getpid()
    assert "records run in the worker, unguarded" in caplog.text
