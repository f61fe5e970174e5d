"""Stack traces of failed records (`report.failed_record`), formatted once per place of
failure.

``traceback.format_exception`` is expensive (linecache checks, and on 3.11+ an ``ast.parse`` of
each frame's source line for the caret anchors): far more than the user function that failed.
Records fail over and over at the same few places, so the frames part of a trace is formatted
once per *frame signature* — the code objects and instruction offsets (``tb_lasti``, which fix
the line and the caret columns) of the traceback — and kept in a bounded LRU. Only the
exception's own lines ("Type: message", notes) are formatted per failure. The text is the same
as ``traceback.format_exception``'s (tests compare them); exception groups and SyntaxErrors
(whose text depends on more than the frames) are formatted the standard way, uncached.
"""

from __future__ import annotations

import builtins
import threading
import traceback
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

#: Frame signatures whose formatted frames are kept (least recently used dropped first).
STACK_CACHE_SIZE = 1024

_CAUSE_MESSAGE = "\nThe above exception was the direct cause of the following exception:\n\n"
_CONTEXT_MESSAGE = ("\nDuring handling of the above exception, another exception "
                    "occurred:\n\n")
_TRACEBACK_HEADER = "Traceback (most recent call last):\n"


class StackCache:
    """A bounded LRU of formatted frames by frame signature; safe to share between threads."""

    def __init__(self, maxsize: int = STACK_CACHE_SIZE) -> None:
        if maxsize < 1:
            raise ValueError(f"maxsize: must be >= 1, got {maxsize}")
        self.maxsize = maxsize
        self._entries: OrderedDict[tuple, tuple[tuple, str]] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self.hits = self.misses = 0

    def frames(self, tb: Any) -> str:
        """The formatted frames of traceback ``tb`` (what follows "Traceback (most recent call
        last):"), formatted once per frame signature."""
        sig, codes = frame_signature(tb)
        # ids are unique among live objects only: an entry holds its code objects, so they stay
        # alive and no other code object can have their ids while the entry is kept; a matching
        # signature therefore names the same code objects
        with self._lock:
            entry = self._entries.get(sig)
            if entry is not None:
                self._entries.move_to_end(sig)
                self.hits += 1
                return entry[1]
        text = "".join(traceback.format_tb(tb))
        with self._lock:
            self.misses += 1
            self._entries[sig] = (codes, text)
            self._entries.move_to_end(sig)
            while len(self._entries) > self.maxsize:
                self._entries.popitem(last=False)
        return text


def frame_signature(tb: Any) -> tuple[tuple, tuple]:
    """(signature, code objects) of traceback ``tb``: its frames' code object ids and
    instruction offsets (which fix its formatted text), and the code objects, which a cache
    keyed by the signature holds so that no other code object can take their ids."""
    key: list = []
    codes: list = []
    append, keep = key.append, codes.append
    t = tb
    while t is not None:
        code = t.tb_frame.f_code
        keep(code)
        append(id(code))
        append(t.tb_lasti)
        t = t.tb_next
    return tuple(key), tuple(codes)


def frame_key(tb: Any) -> tuple:
    """`frame_signature`'s signature alone (a lookup keyed by it needs no code objects: an
    entry that matches holds its own)."""
    key: list = []
    while tb is not None:
        key += (id(tb.tb_frame.f_code), tb.tb_lasti)
        tb = tb.tb_next
    return tuple(key)


#: The process's cache, used by `format_stack_trace`.
stack_cache = StackCache()


def _safe_str(value: Any, what: str) -> str:
    try:
        return str(value)
    except Exception:  # noqa: BLE001 - as traceback does
        return f"<{what} str() failed>"


def _exception_only(exc: BaseException) -> str:
    """``traceback.format_exception_only(exc)`` for an exception that is neither a SyntaxError
    nor a group, without formatting its chain (which that function's constructor would do)."""
    cls = type(exc)
    stype = cls.__qualname__
    smod = cls.__module__
    if smod not in ("__main__", "builtins"):
        if not isinstance(smod, str):
            smod = "<unknown>"
        stype = smod + "." + stype
    value = _safe_str(exc, "exception")
    lines = [f"{stype}: {value}\n" if value else f"{stype}\n"]
    try:
        notes = getattr(exc, "__notes__", None)
    except Exception:  # noqa: BLE001 - let traceback deal with it
        return ""
    if isinstance(notes, Sequence):
        for note in notes:
            lines.extend(line + "\n" for line in _safe_str(note, "note").split("\n"))
    elif notes is not None:
        try:
            lines.append(f"{notes!r}\n")
        except Exception:  # noqa: BLE001 - as traceback does
            lines.append("<__notes__ repr() failed>\n")
    return "".join(lines)


#: Formatted the standard way: their text depends on more than the frames. (Exception groups
#: exist from Python 3.11; the client also runs on 3.10.)
UNCACHED = (SyntaxError,) + tuple(
    t for t in (getattr(builtins, "BaseExceptionGroup", None),) if t is not None)


def format_stack_trace(exc: BaseException) -> str:
    """``"".join(traceback.format_exception(exc))``, with each traceback's frames formatted once
    per frame signature (see `StackCache`)."""
    if exc.__cause__ is None and (exc.__suppress_context__ or exc.__context__ is None) \
            and not isinstance(exc, UNCACHED):
        # the common case, one exception and no chain to print (a suppressed context is not
        # printed, whatever it is)
        only = _exception_only(exc)
        if only:
            tb = exc.__traceback__
            return _TRACEBACK_HEADER + stack_cache.frames(tb) + only if tb is not None else only
    # the exceptions traceback.TracebackException would link, in its order (LIFO, first seen)
    seen = {id(exc)}
    links: dict[int, tuple[BaseException | None, BaseException | None]] = {}
    queue = [exc]
    while queue:
        e = queue.pop()
        if isinstance(e, UNCACHED):
            return "".join(traceback.format_exception(exc))
        cause = e.__cause__
        if cause is not None and id(cause) not in seen:
            seen.add(id(cause))
        else:
            cause = None
        context = e.__context__
        if context is not None and id(context) not in seen:
            seen.add(id(context))
        else:
            context = None
        links[id(e)] = (cause, context)
        if cause is not None:
            queue.append(cause)
        if context is not None:
            queue.append(context)
    chain: list[tuple[str, BaseException]] = []
    cur: BaseException | None = exc
    msg = ""
    while cur is not None:
        chain.append((msg, cur))
        cause, context = links[id(cur)]
        if cause is not None:
            msg, cur = _CAUSE_MESSAGE, cause
        elif context is not None and not cur.__suppress_context__:
            msg, cur = _CONTEXT_MESSAGE, context
        else:
            cur = None
    out: list[str] = []
    for i in range(len(chain) - 1, -1, -1):
        msg, e = chain[i]
        only = _exception_only(e)
        if not only:
            return "".join(traceback.format_exception(exc))
        tb = e.__traceback__
        if tb is not None:
            out.append(_TRACEBACK_HEADER)
            out.append(stack_cache.frames(tb))
        out.append(only)
        if msg:
            out.append(msg)
    return "".join(out)
