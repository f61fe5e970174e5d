"""A user function run in a child process, so that a record that kills the process running it
(a signal such as SIGSEGV, ``os._exit``, the OOM killer) or outlasts ``errors.record.timeout.ms``
takes down only that child, and becomes a failure of its record: `WorkerCrashError` (category
crash) or `RecordTimeoutError` (category timeout), reported and decided like any other.

A `Guard` forks one helper process on its first call (and again after a helper died) and sends
it each call's arguments over a pipe; the helper runs the function and sends the result back.
Nothing is shared but what the fork copied: the helper's side effects on Python state stay in
it (accumulators and caches too). A call whose function raised in the helper runs again here,
in this process, so that its exception (type, traceback, hints) is the real one, as an
unguarded call's; so does a call whose arguments or result cannot be pickled.

How the helper died is the error's message (the signal and its name, or the exit status); the
Python stack it died in, written by `faulthandler` in the helper (on a fatal signal, or asked
for with SIGUSR2 just before a helper past the time limit is killed), is added as a note.

Guards run where a task attempt is known to be at risk (`_isolation`): the retry of an attempt
whose worker died. A record costs a round trip between two processes there (a few
microseconds), nothing anywhere else.
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import os
import pickle
import select
import signal
import struct
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from typing import Any

from spillway.client.markers import RecordTimeoutError, WorkerCrashError

log = logging.getLogger("spillway.spark")

_HEADER = struct.Struct("<cQ")      # status, body length
_OK, _RAISED, _UNSENDABLE, _CALL = b"o", b"r", b"u", b"c"
#: How long a helper past its time limit gets to write its Python stack before it is killed.
STACK_GRACE_S = 0.2
#: How long a helper that was told to stop gets before it is killed.
CLOSE_GRACE_S = 1.0
#: The stack note is cut to this many characters (it lands in a DLQ header).
MAX_STACK_CHARS = 6000
_PR_SET_PDEATHSIG = 1
#: This process's ends of its helpers' pipes: a helper forked later closes them, so that each
#: helper sees the end of its own pipe as soon as its parent closes it.
_parent_fds: set[int] = set()


def signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def death_message(status: int) -> tuple[str, int | None, int | None]:
    """(what happened, signal, exit status) for a ``waitpid`` status."""
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        return f"killed by signal {sig} ({signal_name(sig)})", sig, None
    if os.WIFEXITED(status):
        code = os.WEXITSTATUS(status)
        return f"exited with status {code}", None, code
    return f"ended with wait status {status}", None, None


class Guard:
    """``fn(*args)`` run in a helper process; one call at a time (a task's loop thread).

    ``timeout_ms`` (0: none) bounds each call; ``what`` names the work in messages."""

    def __init__(self, fn: Callable[..., Any], *, timeout_ms: int = 0,
                 what: str = "the record") -> None:
        self.fn = fn
        self.timeout_ms = timeout_ms
        self.what = what
        self._helper: _Helper | None = None
        self.calls = self.deaths = 0

    def __call__(self, *args: Any) -> Any:
        try:
            data = pickle.dumps(args, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception:  # noqa: BLE001 - arguments only this process can hold: run them here
            return self.fn(*args)
        self.calls += 1
        for tries in (1, 2):  # a helper found dead before the call reached it: once more
            helper = self._helper
            if helper is None or helper.pid != _helper_pid(helper):
                try:
                    helper = self._helper = _Helper(self.fn)
                except (OSError, AttributeError) as exc:  # no fork here, or no resources
                    _cannot_fork(exc)
                    break
            try:
                status, body = helper.call(data, self.timeout_ms / 1000.0)
            except _HelperGone as gone:
                self._drop()
                if tries == 1:
                    continue
                self.deaths += 1  # two helpers died taking this record in: it kills them
                raise self._crash(gone.died) from None
            except _Died as died:
                self._drop()
                self.deaths += 1
                raise self._crash(died) from None
            except _TimedOut as late:
                self._drop()
                self.deaths += 1
                raise self._timeout(late) from None
            if status == _OK:
                return pickle.loads(body)  # noqa: S301 - our own child's answer
            return self.fn(*args)  # it raised there (or its result cannot travel): here
        return self.fn(*args)  # no helper would start: unguarded, as without isolation

    def _crash(self, died: _Died) -> WorkerCrashError:
        exc = WorkerCrashError(
            f"the Python process running {self.what} died: {died.how}",
            signal=died.signal, exit_status=died.exit_status)
        _note_stack(exc, died.stack, "when it died")
        return exc

    def _timeout(self, late: _TimedOut) -> RecordTimeoutError:
        exc = RecordTimeoutError(
            f"{self.what} ran past errors.record.timeout.ms={self.timeout_ms} "
            f"({late.elapsed_s * 1000:.0f} ms); its process was stopped",
            timeout_ms=self.timeout_ms)
        _note_stack(exc, late.stack, "when it was stopped")
        return exc

    def _drop(self) -> None:
        helper, self._helper = self._helper, None
        if helper is not None:
            helper.close()

    def close(self) -> None:
        """Stop the helper (it finishes no call: none is running)."""
        self._drop()


def _cannot_fork(exc: BaseException) -> None:
    global _fork_failures
    _fork_failures += 1
    if _fork_failures == 1 or _fork_failures % 1000 == 0:
        log.warning("spillway: cannot start a helper process to guard a record (%s): records "
                     "run in the worker, unguarded (%d time(s))", exc, _fork_failures)


_fork_failures = 0


def _helper_pid(helper: _Helper) -> int:
    """The helper's pid while it belongs to this process (a forked copy of a Guard starts its
    own helper)."""
    return helper.pid if helper.owner == os.getpid() else -1


def _note_stack(exc: BaseException, stack: str, when: str) -> None:
    stack = stack.strip()
    if stack and hasattr(exc, "add_note"):
        if len(stack) > MAX_STACK_CHARS:
            stack = "...\n" + stack[-MAX_STACK_CHARS:]
        exc.add_note(f"(spillway: the Python stack of that process {when})\n{stack}")


class _HelperGone(Exception):
    """The helper died before the call reached it whole."""

    def __init__(self, died: _Died) -> None:
        super().__init__(died.how)
        self.died = died


class _Died(Exception):
    def __init__(self, how: str, sig: int | None, exit_status: int | None, stack: str) -> None:
        super().__init__(how)
        self.how, self.signal, self.exit_status, self.stack = how, sig, exit_status, stack


class _TimedOut(Exception):
    def __init__(self, elapsed_s: float, stack: str) -> None:
        super().__init__(f"{elapsed_s:.3f} s")
        self.elapsed_s, self.stack = elapsed_s, stack


class _Helper:
    """One forked child serving calls of ``fn`` over two pipes."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.owner = os.getpid()
        self.stack = tempfile.TemporaryFile()  # faulthandler's output in the child
        req_r, req_w = os.pipe()
        res_r, res_w = os.pipe()
        _flush_std()  # what this process buffered is written once, by this process
        try:
            with warnings.catch_warnings():  # 3.12+: "use of fork() may lead to deadlocks":
                warnings.simplefilter("ignore", DeprecationWarning)  # the child runs no other
                pid = os.fork()                                      # thread's work (_serve)
        except BaseException:
            for fd in (req_r, req_w, res_r, res_w):
                os.close(fd)
            self.stack.close()
            raise
        if pid == 0:
            code = 0
            try:
                for fd in (req_w, res_r, *_parent_fds):
                    with contextlib.suppress(OSError):
                        os.close(fd)
                _parent_fds.clear()
                code = _serve(fn, req_r, res_w, self.stack.fileno(), self.owner)
            finally:
                os._exit(code)  # never the parent's atexit hooks, buffers or finalizers
        os.close(req_r)
        os.close(res_w)
        self.pid, self.req, self.res = pid, req_w, res_r
        self.reader = _Reader(res_r)
        _parent_fds.update((req_w, res_r))
        self.closed = False

    def call(self, data: bytes, timeout_s: float) -> tuple[bytes, bytes]:
        started = time.monotonic()
        try:
            _write_all(self.req, _HEADER.pack(_CALL, len(data)) + data)
        except BrokenPipeError:
            raise _HelperGone(self._died()) from None
        if timeout_s > 0:
            left = timeout_s - (time.monotonic() - started)
            if not _readable(self.res, left):
                raise _TimedOut(time.monotonic() - started, self._stop_for_stack())
        answer = self.reader.message()
        if answer is None:
            raise self._died()
        return answer

    def _died(self) -> _Died:
        status = self._reap(block=True)
        how, sig, code = death_message(status)
        return _Died(how, sig, code, self._stack_text())

    def _stop_for_stack(self) -> str:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGUSR2)  # faulthandler writes every thread's stack
        deadline = time.monotonic() + STACK_GRACE_S
        while time.monotonic() < deadline and self._reap(block=False) is None:
            time.sleep(0.01)
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)
        self._reap(block=True)
        return self._stack_text()

    def _reap(self, block: bool) -> int | None:
        try:
            pid, status = os.waitpid(self.pid, 0 if block else os.WNOHANG)
        except ChildProcessError:
            return 0
        if pid == 0:
            return None
        return status

    def _stack_text(self) -> str:
        try:
            self.stack.seek(0)
            return own_frames(self.stack.read().decode("utf-8", "replace"))
        except OSError:
            return ""

    def close(self) -> None:
        if self.closed or self.owner != os.getpid():
            return
        self.closed = True
        for fd in (self.req, self.res):
            _parent_fds.discard(fd)
            with contextlib.suppress(OSError):
                os.close(fd)
        deadline = time.monotonic() + CLOSE_GRACE_S
        while self._reap(block=False) is None:
            if time.monotonic() >= deadline:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.pid, signal.SIGKILL)
                self._reap(block=True)
                break
            time.sleep(0.005)
        self.stack.close()


def own_frames(dump: str) -> str:
    """faulthandler's dump without the frames the helper inherited from its parent (every
    frame from the helper's loop down, most recent call first) or its list of extensions."""
    out, skipping = [], False
    for line in dump.splitlines():
        if not line.strip():
            skipping = False
        elif skipping or line.startswith("Extension modules:"):
            continue
        elif line.lstrip().startswith("File ") and line.endswith(f" in {_serve.__name__}") \
                and _THIS_FILE in line:
            skipping = True
            continue
        out.append(line)
    return "\n".join(out).strip()


_THIS_FILE = os.path.basename(__file__)


# --- the helper's side -------------------------------------------------------------------------


def _serve(fn: Callable[..., Any], req: int, res: int, stack_fd: int, parent: int) -> int:
    """The helper's loop: a call's arguments in, its result (or that it raised) out, until the
    parent closes the pipe. Returns the exit status."""
    _die_with_parent(parent)
    faulthandler.enable(file=stack_fd, all_threads=False)
    if hasattr(faulthandler, "register"):
        faulthandler.register(signal.SIGUSR2, file=stack_fd, all_threads=True)
    calls = _Reader(req)
    while True:
        call = calls.message()
        if call is None:
            return 0
        try:
            args = pickle.loads(call[1])  # noqa: S301 - our own parent's call
            out = fn(*args)
        except SystemExit as exc:   # sys.exit() in the record: the process ends, as it would
            code = exc.code if isinstance(exc.code, int) else 1
            return code
        except BaseException:  # noqa: BLE001 - raised: the parent runs it to see the error
            _write_all(res, _HEADER.pack(_RAISED, 0))
            continue
        try:
            data = pickle.dumps(out, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception:  # noqa: BLE001 - a result that cannot travel: the parent runs it
            _write_all(res, _HEADER.pack(_UNSENDABLE, 0))
            continue
        _flush_std()  # the record's prints, before its process may be stopped unflushed
        _write_all(res, _HEADER.pack(_OK, len(data)) + data)


def _flush_std() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()


def _die_with_parent(parent: int) -> None:
    """The helper must not outlive the worker that forked it: a helper holding the worker's
    sockets would keep Spark waiting for a worker that is gone."""
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):  # pragma: no cover - no prctl: the EOF check stays
            pass
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(0)


# --- pipes -------------------------------------------------------------------------------------


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


class _Reader:
    """One end of a pipe, read a message at a time: a header and a small body usually arrive
    in one read (one system call per message, not two)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.buf = bytearray()

    def take(self, n: int) -> bytes | None:
        """``n`` bytes, or None at end of file (the other side is gone)."""
        buf = self.buf
        while len(buf) < n:
            chunk = os.read(self.fd, max(1 << 16, n - len(buf)))
            if not chunk:
                return None
            buf += chunk
        out = bytes(buf[:n])
        del buf[:n]
        return out

    def message(self) -> tuple[bytes, bytes] | None:
        """(status, body) of the next message, or None at end of file."""
        head = self.take(_HEADER.size)
        if head is None:
            return None
        status, n = _HEADER.unpack(head)
        body = self.take(n)
        return None if body is None else (status, body)


def _readable(fd: int, timeout_s: float) -> bool:
    """Whether ``fd`` has data (or end of file) within ``timeout_s``."""
    deadline = time.monotonic() + max(0.0, timeout_s)
    poller = select.poll()
    poller.register(fd, select.POLLIN | select.POLLHUP | select.POLLERR)
    while True:
        left = deadline - time.monotonic()
        try:
            if poller.poll(max(0, int(left * 1000))):
                return True
        except InterruptedError:  # pragma: no cover - PEP 475 retries; kept for old kernels
            pass
        if time.monotonic() >= deadline:
            return False
