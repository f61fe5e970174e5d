"""The suite's own scheduling (tests/conftest.py, tests/support/xdist_plan.py): only the worker
the plan gives the Spark group to starts a Spark session after collection."""

from __future__ import annotations

from types import SimpleNamespace

from support import paths, xdist_plan


def _session(*, worker: str | None, loadgroup: bool, spark_tests: bool = True):
    option = SimpleNamespace(collectonly=False, loadgroup=loadgroup,
                             dist="no" if worker else ("loadgroup" if loadgroup else "no"))
    config = SimpleNamespace(option=option, getvalue=lambda name: getattr(option, name))
    if worker is not None:
        config.workerinput = {"workerid": worker}
    items = [SimpleNamespace(fixturenames=("spark",) if spark_tests else ("broker",))]
    return SimpleNamespace(config=config, items=items)


def test_only_the_spark_worker_starts_a_session_under_loadgroup():
    # xdist sets a worker's ``dist`` to "no": the decision must not read it
    assert xdist_plan.runs_spark_here(_session(worker=xdist_plan.SPARK_WORKER, loadgroup=True))
    for other in ("gw1", "gw2", "gw3"):
        assert not xdist_plan.runs_spark_here(_session(worker=other, loadgroup=True))


def test_without_loadgroup_or_xdist_any_process_with_a_spark_test_starts_one():
    assert xdist_plan.runs_spark_here(_session(worker=None, loadgroup=False))
    assert xdist_plan.runs_spark_here(_session(worker="gw2", loadgroup=False))
    assert not xdist_plan.runs_spark_here(_session(worker=None, loadgroup=False,
                                                  spark_tests=False))


def test_the_spark_group_goes_first_and_to_its_worker():
    assert xdist_plan.rank(xdist_plan.SPARK_GROUP) < xdist_plan.rank("tests/e2e/test_cli.py")
    assert xdist_plan.rank("tests/integration/spark/test_spark_cluster.py") == 0


def test_every_tier_and_module_the_plan_ranks_is_there():
    # a test module moved to another directory would silently lose its place in the order
    for _, prefix in xdist_plan.RANK:
        if prefix != xdist_plan.SPARK_GROUP:
            assert (paths.ROOT / prefix).exists(), prefix
