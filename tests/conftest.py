"""Shared fixtures: a real Tansu broker process and a real local Spark session.

Layout: a directory per tier (unit, integration, e2e, fuzz, compat); within unit and
integration, a directory per package a module exercises (``client/``, ``spark/``,
``sidecar/<role>/`` as in spillway/sidecar, and ``unit/project/`` for the repository-wide
checks: lint, packaging, docs, compose, Kubernetes, import cycles, the bench harness). Helpers
more than one module uses live in ``support/``; a file under the repository is found through
``support.paths.ROOT``, never by a module's depth. Modules are imported by basename (pytest's
default import mode, no ``__init__.py``), so a test module's basename is unique in the suite.

Both are started once per test process (as pyspark.testing does) and stopped at its end; under
pytest-xdist (`make test`: ``-n N --dist loadgroup``) that is once per worker, each worker with
its own broker, ports (all picked free on loopback), temporary directories and processes.

How tests are grouped on workers (tests/support/xdist_plan.py has the schedule):

- a module whose tests use the ``spark`` fixture joins the group ``spark`` (one local Spark
  session, on one worker, started right after collection);
- any other module is a group of its own (its module-scoped fixtures are built once), unless
  it names one itself with ``pytestmark = pytest.mark.xdist_group("name")``;
so a new module needs nothing to run in parallel: a module that starts its own heavy process in
a module- or session-scoped fixture (a Spark Connect server, a cluster) already runs on one
worker.

Everything runs on loopback: SPARK_LOCAL_IP is pinned here for every Spark this process or its
children start. With CI set (.ci/run), a skipped test fails: CI never skips a tier silently.
"""

from __future__ import annotations

import os
import sys
import tempfile
import uuid

import pytest
from hypothesis import HealthCheck, settings

sys.path.insert(0, os.path.dirname(__file__))

from support import xdist_plan  # noqa: E402
from support.ci import in_ci  # noqa: E402
from support.spark import pin_loopback, quick_jvms  # noqa: E402

pin_loopback()  # before any Spark, here or in a subprocess: the driver binds to 127.0.0.1
# task attempts' crumbs (spillway.spark._isolation) of this test process and the Spark workers
# it starts, away from the machine's own directory
os.environ.setdefault("SPILLWAY_CRUMB_DIR", tempfile.mkdtemp(prefix="spillway-crumbs-"))
quick_jvms()    # short-lived test JVMs: client JIT, serial GC (support/spark.py)
# Spark's Python workers import the installed pyspark, not its bytecode-less zip
# (support/sitepath/sitecustomize.py); a process that sets its own PYTHONPATH goes without
os.environ["PYTHONPATH"] = os.pathsep.join(
    filter(None, [os.path.join(os.path.dirname(__file__), "support", "sitepath"),
                  os.environ.get("PYTHONPATH")]))

# Hypothesis: no per-example deadline and no "too slow" health check. Both time the example on
# the wall clock (200 ms by default), which a loaded 2-core machine running four workers and
# their JVMs exceeds now and then: the test then fails as Flaky/DeadlineExceeded with nothing
# wrong in the code. Speed is the benchmark harness's business (CONVENTIONS.md, Tests).
settings.register_profile("spillway", deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("spillway")


@pytest.fixture(scope="session")
def broker(tmp_path_factory):
    from spillway.sidecar.runtime.embedded import EmbeddedBroker

    log = tmp_path_factory.mktemp("tansu") / "tansu.log"
    b = EmbeddedBroker(log_path=str(log)).start()
    yield b
    b.stop()


@pytest.fixture
def unreachable():
    """A loopback address that refuses connections throughout the test (support/net.py)."""
    from support.net import nothing_listening

    with nothing_listening() as address:
        yield address


@pytest.fixture
def topic_name():
    """A fresh DLQ-prefixed topic name per test."""
    return f"dlq.test-{uuid.uuid4().hex[:10]}"


def pytest_configure(config):
    if not hasattr(config, "workerinput"):  # once, in the controller, before any worker starts
        from support.bytecode import precompile

        precompile()


# --- grouping for pytest-xdist ----------------------------------------------------------------


@pytest.hookimpl(tryfirst=True)  # before xdist turns the marks into node ids
def pytest_collection_modifyitems(config, items):
    spark_modules = {getattr(item, "module", None) for item in items if xdist_plan.uses_spark(item)}
    for item in items:
        if item.get_closest_marker("xdist_group") is not None:
            continue
        group = (xdist_plan.SPARK_GROUP if getattr(item, "module", None) in spark_modules
                 else item.nodeid.split("::", 1)[0])
        item.add_marker(pytest.mark.xdist_group(group))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") == "loadgroup":
        return xdist_plan.make_scheduler(config, log)
    return None


_lanes = xdist_plan.Lanes()


def pytest_runtest_logreport(report):
    _lanes.add(report)


def pytest_terminal_summary(terminalreporter):
    lines = _lanes.lines()
    if lines:
        terminalreporter.write_sep("=", "time in tests per worker (tests/support/xdist_plan.py)")
        for line in lines:
            terminalreporter.write_line(line)


@pytest.hookimpl(trylast=True)  # after xdist reports the collection: the others start now
def pytest_collection_finish(session):
    """Start the session's Spark (if this process runs a test that needs it) before any test
    installs an OpenTelemetry SDK provider in this process: pyspark launches its JVM with a
    preexec_fn, so the provider's at-fork handler runs in the forked child, where its thread
    pool can crash the launcher in a process full of gRPC threads (seen as
    JAVA_GATEWAY_EXITED mid-suite). Under xdist only the Spark group's worker starts one."""
    if xdist_plan.runs_spark_here(session):
        from support.spark import local_spark

        local_spark()   # the `spark` fixture gets this session (getOrCreate) and stops it


@pytest.fixture(scope="session")
def spark():
    from support.spark import local_spark

    session = local_spark()
    yield session
    session.stop()


# --- CI: nothing skipped silently -----------------------------------------------------------


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if in_ci() and report.skipped and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr
        report.outcome = "failed"
        report.longrepr = (f"skipped under CI={os.environ.get('CI')}, which runs every tier: "
                           f"{reason}")


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield
    report = outcome.get_result()
    if in_ci() and report.skipped:  # a whole module skipped at import
        report.outcome = "failed"
        report.longrepr = (f"{collector.nodeid} skipped under CI={os.environ.get('CI')}, "
                           f"which runs every tier: {report.longrepr}")


@pytest.fixture(scope="module")
def sidecar_props():
    """Extra sidecar properties for a module's `sidecar`; override in the module to change."""
    return {}


@pytest.fixture(scope="module")
def sidecar(broker, tmp_path_factory, sidecar_props):
    """A real sidecar (gRPC server, policy engine, DLQ pipeline to the Tansu broker), one per
    test module, on a free loopback port."""
    from spillway.sidecar.server import start_server

    running = start_server({
        "listen.address": "127.0.0.1:0",
        "bootstrap.servers": broker.bootstrap_servers,
        "spool.dir": str(tmp_path_factory.mktemp("spool")),
        "producer.linger.ms": "5",
        **sidecar_props,
    })
    yield running
    running.stop(1.0)
