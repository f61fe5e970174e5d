"""The end of a Spark task in a PySpark worker process: a UDF sees no partition end of its own.

pyspark's worker resets the task context (``TaskContext._setTaskContext(None)``) once a task's
rows are all processed and before it reports the task done to the JVM (Spark 3.5 and 4.x,
classic and Connect servers alike). `at_task_end` wraps that reset, so a UDF's processed counts
are sent while its task is still running, not parked in a worker that may exit before its next
task: the job's summary read after the action counts every row.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable

log = logging.getLogger("spillway.spark")

_task_end_lock = threading.Lock()
_task_end_hooks: list[Callable[[], None]] = []
_task_end_pid: int | None = None


def at_task_end(hook: Callable[[], None]) -> bool:
    """Run ``hook()`` in this worker process whenever a Spark task it ran ends; returns whether
    the process can tell (False when pyspark's layout lacks the hook point: then counts wait
    for the next task, as parked counts do). A failing hook is logged, never fails the task."""
    global _task_end_pid
    with _task_end_lock:
        if _task_end_pid != os.getpid():  # a forked child installs (and owns) its own
            _task_end_hooks.clear()
            _task_end_pid = os.getpid() if _install_task_end() else None
        if _task_end_pid is None:
            return False
        if hook not in _task_end_hooks:
            _task_end_hooks.append(hook)
        return True


def _install_task_end() -> bool:
    try:
        from pyspark import TaskContext
    except ImportError:  # pragma: no cover - spillway.spark requires pyspark
        return False
    current = TaskContext.__dict__.get("_setTaskContext")
    if getattr(getattr(current, "__func__", None), "_spillway_task_end", False):
        return True
    if not isinstance(current, classmethod):
        return False
    original = current.__func__

    def _setTaskContext(cls, taskContext):  # noqa: N802, N803 - pyspark's names
        ended = TaskContext._taskContext
        original(cls, taskContext)
        if ended is not None and taskContext is None:
            _run_task_end_hooks()

    _setTaskContext._spillway_task_end = True  # type: ignore[attr-defined]
    TaskContext._setTaskContext = classmethod(_setTaskContext)
    return True


def _run_task_end_hooks() -> None:
    with _task_end_lock:
        hooks = list(_task_end_hooks) if _task_end_pid == os.getpid() else []
    for hook in hooks:
        try:
            hook()
        except Exception as exc:  # noqa: BLE001 - the task's rows are done; never fail it here
            log.warning("spillway: a task-end hook failed (its counts stay parked for the "
                        "next call): %s", exc)
