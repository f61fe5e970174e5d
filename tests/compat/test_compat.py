"""The compat tier: spillway's wheels in a fresh venv per combination of Python, PySpark,
protobuf, grpcio, pandas and pyarrow (requirements/compat/), each running a job through every
wrapper on that venv's Python and PySpark, against a real sidecar (this venv) and Tansu broker.

The matrix (tests/compat/venvs.py): "oldest" (the declared floors, PySpark 3.5.0, Python
3.10), "spark35-newest" (PySpark 3.5 with the newest protobuf/grpcio/OpenTelemetry) and
"newest" (PySpark 4.x and the newest of everything, with the spillway-sidecar wheel too).
"""

from __future__ import annotations

import json
import os
import subprocess
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from support.kafka import header_map, read_all

from compat.venvs import MATRIX, build_wheels, make_venv

pytestmark = [pytest.mark.compat, pytest.mark.slow, pytest.mark.integration]

JOB = Path(__file__).with_name("compat_job.py")


@pytest.fixture(scope="module")
def wheels(tmp_path_factory):
    out = tmp_path_factory.mktemp("wheels")
    build_wheels(out)
    return out


@pytest.fixture(scope="module")
def venvs(request, wheels, tmp_path_factory):
    """The selected combinations' venvs, built in the background (two at a time) so that
    installing the next one overlaps the previous one's Spark job; a test waits for its own."""
    selected = {item.callspec.params["combo"].name for item in request.session.items
                if item.module is request.module and hasattr(item, "callspec")}
    where = tmp_path_factory.mktemp("venvs")
    pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="compat-venv")
    builds = {c.name: pool.submit(make_venv, c, where, wheels) for c in MATRIX
              if c.name in selected}
    yield builds
    pool.shutdown(wait=True, cancel_futures=True)


def _dlq(broker, prefix: str, wrapper: str) -> list:
    return sorted(read_all(broker.bootstrap_servers, f"{prefix}.{wrapper}", idle_s=1.0),
                  key=lambda m: (m.key() or b"", m.value() or b""))


@pytest.mark.timeout(1200)  # a cold wheelhouse downloads and builds PySpark (~320 MB)
@pytest.mark.parametrize("combo", MATRIX, ids=[c.name for c in MATRIX])
def test_wheels_run_every_wrapper(combo, venvs, sidecar, broker, tmp_path):
    python = venvs[combo.name].result()  # a skip or failure while building is re-raised here
    prefix = f"dlq.compat-{combo.name}-{uuid.uuid4().hex[:6]}"
    out, work = tmp_path / "result.json", tmp_path / "work"
    work.mkdir()
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PYSPARK_", "SPARK_", "PYTHONPATH", "SPILLWAY_"))}
    proc = subprocess.run([str(python), str(JOB), sidecar.address, prefix, str(work), str(out)],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, f"{combo.name}:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    r = json.loads(out.read_text())
    print(f"compat {combo.name}: {r['versions']}")
    pins = dict(line.split("==") for line in combo.pins.read_text().splitlines()
                if line and not line.startswith("#"))
    for dist, version in pins.items():
        assert r["versions"][dist] == version, f"{combo.name}: {dist} {r['versions'][dist]}"

    # per row: one retry, one poison record skipped and dead-lettered with its context
    rows = r["rows"]
    assert rows["ids"] == [i for i in range(20) if i != 13]
    assert (rows["retries"], rows["skipped"], rows["dlq"], rows["processed"]) == (1, 1, 1, 20)
    [msg] = _dlq(broker, prefix, "rows")
    assert (msg.key(), msg.value()) == (b"k13", b"{not json")
    h = header_map(msg)
    assert h["origin"] == b"compat" and h["__connect.errors.offset"] == b"13"
    assert h["__connect.errors.stage"] == b"TRANSFORMATION"
    assert h["__connect.errors.exception.class.name"] == b"json.decoder.JSONDecodeError"
    assert h["spillway.record.id"] == b"orders/0/13"

    assert r["rdd"]["out"] == sorted(100 // (x - 6) for x in range(10) if x != 6)
    [msg] = _dlq(broker, prefix, "rdd")
    assert msg.value() == b"6"

    # vectorized with bisection: only the failing rows are reported
    assert r["pandas"]["ids"] == [i for i in range(60) if i not in (17, 42)]
    assert (r["pandas"]["failures"], r["pandas"]["dlq"], r["pandas"]["processed"]) == (2, 2, 60)
    assert sorted(json.loads(m.value())["id"] for m in _dlq(broker, prefix, "pandas")) == [17, 42]
    assert r["arrow"]["ids"] == [i for i in range(12) if i != 5]
    assert r["arrow"]["dlq"] == 1
    [msg] = _dlq(broker, prefix, "arrow")
    assert header_map(msg)["__connect.errors.exception.class.name"] == b"builtins.ZeroDivisionError"

    # UDF: null, and the error column
    assert r["udf"]["plain"] == [["1", 1], ["3", 3], ["x", None]]
    assert r["udf"]["good"] == 1
    assert r["udf"]["error"] == ["TRANSFORMATION", "builtins.ValueError", True]
    assert r["udf"]["dlq"] == 2 and len(_dlq(broker, prefix, "udf")) == 2

    # deserialization: converter stages, original bytes in the DLQ
    d = r["deserialize"]
    assert d["rows"] == [[i, str(i), i] for i in range(8) if i not in (2, 5)]
    assert d["columns"][-2:] == ["parsed_key", "parsed_value"]
    assert d["by_stage"] == {"KEY_CONVERTER": 1, "VALUE_CONVERTER": 1}
    msgs = _dlq(broker, prefix, "deserialize")
    assert [(m.key(), header_map(m)["__connect.errors.stage"]) for m in msgs] == [
        (b"k2", b"VALUE_CONVERTER"), (b"\xffbad-key", b"KEY_CONVERTER")]
    assert msgs[0].value() == b"[broken"

    # sink: the throttled write retried, the unwritable row dead-lettered, the rest written
    s = r["sink"]
    assert s["written"] == [i for i in range(16) if i != 9]
    assert (s["retries"], s["dlq"]) == (1, 1)
    [msg] = _dlq(broker, prefix, "sink")
    assert header_map(msg)["__connect.errors.stage"] == b"TASK_PUT"
    assert json.loads(msg.value()) == {"id": 9}

    if combo.with_sidecar:  # the sidecar's wheel installs and its command runs
        cli = python.parent / "spillway"
        proc = subprocess.run([str(cli), "serve", "--help"], capture_output=True, text=True,
                              env=env, timeout=120)
        assert proc.returncode == 0 and "--config" in proc.stdout, proc.stderr
