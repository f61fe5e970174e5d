"""While spillway's wrappers run in a Python worker, its collector's young generation is
collected every `gc_young_threshold` allocations, and the worker's own settings come back after
the last one (`spark/_collector.py`); a worker that disabled the collector, set a higher
threshold, or changed it meanwhile keeps what it set."""

from __future__ import annotations

import gc
from types import SimpleNamespace

import pytest
from spillway.spark import _collector
from spillway.spark._partitions import drive
from spillway.spark._runtime import JobSpec


@pytest.fixture(autouse=True)
def own_settings():
    """CPython's defaults before each test (and whatever the process had, after it)."""
    before, enabled = gc.get_threshold(), gc.isenabled()
    gc.set_threshold(700, 10, 10)
    gc.enable()
    _collector._scope = _collector._Scope()
    yield
    gc.set_threshold(*before)
    (gc.enable if enabled else gc.disable)()


def test_young_collections_are_rarer_while_a_wrapper_runs_and_the_workers_come_back():
    _collector.wrapper_started(20_000)
    assert gc.get_threshold() == (20_000, 10, 10)   # the older generations keep theirs
    _collector.wrapper_ended()
    assert gc.get_threshold() == (700, 10, 10)


def test_the_settings_come_back_after_the_last_of_several_wrappers():
    _collector.wrapper_started(20_000)
    _collector.wrapper_started(20_000)   # two wrappers chained in one task
    _collector.wrapper_ended()
    assert gc.get_threshold()[0] == 20_000
    _collector.wrapper_ended()
    assert gc.get_threshold()[0] == 700
    _collector.wrapper_ended()           # an unmatched end changes nothing
    assert gc.get_threshold()[0] == 700


@pytest.mark.parametrize("case", ["threshold 0", "collector disabled", "higher already"])
def test_a_worker_that_chose_its_own_collector_settings_keeps_them(case):
    threshold = 20_000
    if case == "threshold 0":
        threshold = 0
    elif case == "collector disabled":
        gc.disable()
    else:
        gc.set_threshold(50_000, 5, 5)
    before = gc.get_threshold()
    _collector.wrapper_started(threshold)
    assert gc.get_threshold() == before
    _collector.wrapper_ended()
    assert gc.get_threshold() == before
    assert gc.isenabled() == (case != "collector disabled")


def test_a_threshold_the_user_function_changed_meanwhile_is_not_set_back():
    _collector.wrapper_started(20_000)
    gc.set_threshold(1_000, 10, 10)
    _collector.wrapper_ended()
    assert gc.get_threshold() == (1_000, 10, 10)


@pytest.mark.parametrize("bad", [-1, 2.5, "20000", None])
def test_a_job_refuses_a_threshold_that_is_not_a_whole_number_of_allocations(bad):
    with pytest.raises(ValueError, match="gc_young_threshold"):
        JobSpec("job", gc_young_threshold=bad)


def _session(threshold: int):
    closed = []
    return SimpleNamespace(spec=SimpleNamespace(gc_young_threshold=threshold),
                           task=SimpleNamespace(partition_id=0),
                           close=lambda ok, error: closed.append(ok)), closed


@pytest.mark.parametrize("ends", ["exhausted", "failed", "closed early"])
def test_a_partition_runs_with_the_jobs_threshold_and_gives_it_back_however_it_ends(ends):
    session, closed = _session(12_345)
    engine = SimpleNamespace(unfinished=lambda: 0)
    seen = []

    def outputs():
        for i in range(3):
            seen.append(gc.get_threshold()[0])
            if ends == "failed" and i == 1:
                raise RuntimeError("the task failed")
            yield i

    run = drive(session, engine, outputs())
    if ends == "failed":
        with pytest.raises(RuntimeError):
            list(run)
    elif ends == "closed early":
        next(run)
        run.close()
    else:
        assert list(run) == [0, 1, 2]
    assert seen and set(seen) == {12_345}
    assert gc.get_threshold() == (700, 10, 10)
    assert closed == [ends != "failed"]
