"""What Spark Connect support rests on, off Spark: the micro-batch id from Spark's property or
from the job tag `batch_scope` sets, the end-of-task hook that sends a UDF's counts, and the
run id / foreach_partition checks on a Connect-shaped session (stand-ins for pyspark's
TaskContext and session classes; the real thing runs in
tests/integration/spark/test_spark_connect.py).
"""

from __future__ import annotations

import os
import types

import pytest

from spillway.spark import _compat, _task_end, _taskinfo


class Props:
    def __init__(self, **props):
        self.props = props

    def getLocalProperty(self, key):
        return self.props.get(key)


@pytest.mark.parametrize("props, expected", [
    ({}, None),
    ({"streaming.sql.batchId": "7"}, "7"),
    # Spark's own property wins over a tag
    ({"streaming.sql.batchId": "7", "spark.job.tags": "spillway-batch-9"}, "7"),
    # Spark Connect's session tag: its prefix, then ours
    ({"spark.job.tags": "SparkConnect_OperationTag_User__Session_abc_Operation_1,"
                        "SparkConnect_SessionTag_User__Session_abc_Tag_spillway-batch-12,"
                        "spark-session-x-execution-root-id-5"}, "12"),
    # classic 4.x: the session's managed tag
    ({"spark.job.tags": "spark-session-u-thread-t-spillway-batch-3"}, "3"),
    # look-alikes are not ours
    ({"spark.job.tags": "myspillway-batch-4,spillway-batch-x,spillway-batch-5-b"}, None),
])
def test_the_micro_batch_id_comes_from_spark_or_from_the_batch_tag(monkeypatch, props, expected):
    monkeypatch.setattr(_taskinfo, "_task_context", lambda: Props(**props))
    assert _taskinfo.current_batch_id() == expected


def test_no_task_no_batch(monkeypatch):
    monkeypatch.setattr(_taskinfo, "_task_context", lambda: None)
    assert _taskinfo.current_batch_id() is None


class TaggedSession:
    def __init__(self):
        self.tags: list[str] = []
        self.seen: list[list[str]] = []

    def addTag(self, tag):  # noqa: N802 - pyspark's name
        assert "," not in tag
        self.tags.append(tag)

    def removeTag(self, tag):  # noqa: N802
        self.tags.remove(tag)


def test_batch_scope_tags_the_block_only_even_when_it_fails():
    session = TaggedSession()
    with _taskinfo.batch_scope(session, 4):
        assert session.tags == ["spillway-batch-4"]
    assert session.tags == []
    with pytest.raises(RuntimeError), _taskinfo.batch_scope(session, 5):
        raise RuntimeError("write failed")
    assert session.tags == []


def test_batch_scope_without_tags_runs_the_block_as_it_is():
    ran = []
    with _taskinfo.batch_scope(object(), 4):  # classic 3.5: no addTag
        ran.append(1)
    assert ran == [1]


def test_a_task_end_runs_the_hooks_once_per_task(monkeypatch):
    from pyspark import TaskContext

    monkeypatch.setattr(_task_end, "_task_end_pid", None)
    monkeypatch.setattr(_task_end, "_task_end_hooks", [])
    monkeypatch.setattr(TaskContext, "_setTaskContext", TaskContext.__dict__["_setTaskContext"])
    monkeypatch.setattr(TaskContext, "_taskContext", None)
    ended = []
    assert _task_end.at_task_end(lambda: ended.append("a"))
    assert _task_end._task_end_pid == os.getpid()
    TaskContext._setTaskContext(types.SimpleNamespace())   # a task starts
    assert ended == []
    TaskContext._setTaskContext(None)                       # pyspark's worker ends it
    TaskContext._setTaskContext(None)                       # a second reset is no task end
    assert ended == ["a"]


def test_a_failing_hook_never_fails_the_task(monkeypatch, caplog):
    from pyspark import TaskContext

    monkeypatch.setattr(_task_end, "_task_end_pid", None)
    monkeypatch.setattr(_task_end, "_task_end_hooks", [])
    monkeypatch.setattr(TaskContext, "_setTaskContext", TaskContext.__dict__["_setTaskContext"])
    monkeypatch.setattr(TaskContext, "_taskContext", None)
    ran = []

    def broken():
        raise OSError("sidecar gone")

    _task_end.at_task_end(broken)
    _task_end.at_task_end(lambda: ran.append(1))
    TaskContext._setTaskContext(types.SimpleNamespace())
    TaskContext._setTaskContext(None)
    assert ran == [1] and "sidecar gone" in caplog.text


ConnectSession = type("SparkSession", (), {"__module__": "pyspark.sql.connect.session"})


def test_a_connect_session_is_one_run(monkeypatch):
    session = ConnectSession()
    session.session_id = "0f1e"
    monkeypatch.setattr(_compat, "_active_session", lambda: session)
    assert _compat.active_run_id() == "connect-0f1e"
    monkeypatch.setattr(_compat, "_active_session", lambda: None)
    assert _compat.active_run_id() is None


def test_foreach_partition_over_connect_names_the_spark_version(monkeypatch):
    frame = type("DataFrame", (), {"__module__": "pyspark.sql.connect.dataframe"})()
    monkeypatch.setattr(_compat, "pyspark_version", lambda: "3.5.3")
    with pytest.raises(_compat.UnsupportedOnThisSparkError, match=r"Spark 4\.0.*PySpark 3\.5\.3"):
        _compat.check_foreach_partition(frame)
    _compat.check_foreach_partition(object())          # classic: nothing to check
    monkeypatch.setattr(_compat, "pyspark_version", lambda: "4.0.1")
    _compat.check_foreach_partition(frame)
