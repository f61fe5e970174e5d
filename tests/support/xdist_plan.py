"""How `make test` spreads the suite over pytest-xdist workers (``-n N --dist loadgroup``).

Grouping (a worker runs a whole group; decided per test module in tests/conftest.py):

- an explicit ``pytest.mark.xdist_group(name)`` on a module or test wins (e.g. a module with its
  own JVM server fixture may name its group; a module is one group anyway);
- a module in which any test uses the ``spark`` fixture joins the group ``spark``: one local
  Spark session serves them all, on the worker `SPARK_WORKER`, which starts it right after
  collection (before any test may install an OpenTelemetry SDK provider, see conftest). One
  session, not two on two workers: on 2 cores the suite is CPU-bound and a second JVM cost
  more than the shorter lane saved (342 against 295 s, 2026-11-27);
- every other module is its own group: its module-scoped fixtures (a sidecar, a cluster, a
  set of venvs) are built once, and the session's broker once per worker.

Scheduling (`PlannedScheduling`): the longest units first (`RANK`: the standalone cluster
tier, the Spark group, the compat tier, then the end-to-end modules and groups a module named
itself, then the integration, fuzz and unit modules), the ``spark`` group always on
`SPARK_WORKER`, and a worker is handed its next group only when it reaches the last test of
its current one, so no group waits behind a long one on a busy worker while another worker
is idle.
"""

from __future__ import annotations

from collections import OrderedDict

SPARK_GROUP = "spark"
SPARK_WORKER = "gw0"

# (rank, how a group's scope name starts); the first match decides. A group a module names
# itself (it holds something heavy, e.g. its own server process) ranks with the e2e modules.
RANK: tuple[tuple[int, str], ...] = (
    (0, "tests/integration/spark/test_spark_cluster.py"),
    (1, SPARK_GROUP),
    (2, "tests/compat/"),
    (3, "tests/e2e/"),
    (4, "tests/integration/"),
    (5, "tests/fuzz/"),
    (6, "tests/unit/"),
)
NAMED_GROUP_RANK = 3


def rank(scope: str) -> int:
    for r, prefix in RANK:
        if scope == prefix or scope.startswith(prefix):
            return r
    return NAMED_GROUP_RANK


def make_scheduler(config, log):
    """The scheduler for ``--dist loadgroup`` (called from conftest's xdist hook)."""
    from xdist.scheduler import LoadGroupScheduling

    class PlannedScheduling(LoadGroupScheduling):
        def _reorder(self) -> None:
            ordered = sorted(self.workqueue.items(), key=lambda kv: rank(kv[0]))
            self.workqueue = OrderedDict(ordered)

        def _assign_work_unit(self, node) -> None:
            if getattr(self, "_ordered", False) is False:
                self._reorder()
                self._ordered = True
            scopes = list(self.workqueue)
            is_spark_worker = node.gateway.id == SPARK_WORKER
            spark_worker_alive = any(n.gateway.id == SPARK_WORKER and not n.shutting_down
                                     for n in self.nodes)
            if is_spark_worker and SPARK_GROUP in self.workqueue:
                scope = SPARK_GROUP
            else:
                others = [s for s in scopes if s != SPARK_GROUP or not spark_worker_alive]
                if not others:
                    return  # only the Spark group is left: its worker takes it
                scope = others[0]
            work_unit = self.workqueue.pop(scope)
            self.assigned_work.setdefault(node, {})[scope] = work_unit
            collection = self.registered_collections[node]
            node.send_runtest_some([collection.index(nodeid)
                                    for nodeid, done in work_unit.items() if not done])
            if not self.workqueue:  # nothing left: a worker that waited for more may end
                for other in self.nodes:
                    if other is not node and not other.shutting_down and \
                            self._pending_of(self.assigned_work[other]) <= 1:
                        other.shutdown()

        def _reschedule(self, node) -> None:
            if node.shutting_down:
                return
            if not self.workqueue:
                node.shutdown()
                return
            # a worker keeps one test back (it needs the next one to tear down right): give it
            # more only once it is on its last test
            if self._pending_of(self.assigned_work[node]) > 1:
                return
            self._assign_work_unit(node)

    return PlannedScheduling(config, log)


class Lanes:
    """Per worker, the time its groups took (the sum of their tests' setup, call and teardown),
    printed at the end of a parallel run: where the wall time goes, and which worker is the
    long pole (Spark's start-up on its worker, before the first test, is not counted)."""

    def __init__(self) -> None:
        self.busy: dict[str, dict[str, float]] = {}

    def add(self, report) -> None:
        node = getattr(report, "node", None)
        gateway = getattr(node, "gateway", None)
        if gateway is None:
            return  # not a worker's report (no xdist)
        nodeid = report.nodeid
        group = nodeid.rsplit("@", 1)[1] if "@" in nodeid else nodeid.split("::", 1)[0]
        lane = self.busy.setdefault(gateway.id, {})
        lane[group] = lane.get(group, 0.0) + report.duration

    def lines(self, top: int = 4) -> list[str]:
        out = []
        for worker, groups in sorted(self.busy.items()):
            total = sum(groups.values())
            biggest = sorted(groups.items(), key=lambda kv: -kv[1])[:top]
            shown = ", ".join(f"{g.rsplit('/', 1)[-1]} {t:.0f}s" for g, t in biggest)
            out.append(f"{worker}: {total:.0f}s in {len(groups)} groups ({shown}, ...)")
        return out


def uses_spark(item) -> bool:
    return "spark" in getattr(item, "fixturenames", ())


def runs_spark_here(session) -> bool:
    """Whether this process will run the tests that use ``spark``: the worker the plan gives
    the Spark group to, or (without xdist, or with another distribution) any process that
    collected such a test."""
    if session.config.option.collectonly or not any(uses_spark(i) for i in session.items):
        return False
    workerinput = getattr(session.config, "workerinput", None)
    # a worker sees ``dist`` as "no" (xdist resets it there) and loadgroup as ``option.loadgroup``:
    # reading ``dist`` made every worker start a Spark session it never used (~10 s of CPU each)
    if workerinput is None or not getattr(session.config.option, "loadgroup", False):
        return True
    return workerinput.get("workerid") == SPARK_WORKER
