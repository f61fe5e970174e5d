"""Telling a DataFrame from anything else never imports Spark Connect: without its extras,
pyspark.sql.connect calls sys.exit(0) on import when __main__ has no __file__ (python -c, a
pytest-xdist worker), which ended such a program with success on any RDD or misuse."""

from __future__ import annotations

import subprocess
import sys
import types

from spillway.spark._inputs import is_dataframe

MISUSE = """
from spillway.spark import Job
try:
    Job("misuse", {"errors.tolerance": "all"}, sidecar="127.0.0.1:1").map_partitions([1], str)
except TypeError as exc:
    print("refused:", exc)
else:
    print("accepted")
"""


def test_a_program_without_a_main_file_gets_the_misuse_error_not_an_exit():
    proc = subprocess.run([sys.executable, "-c", MISUSE], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "refused: map_partitions: data: expected a pyspark DataFrame or RDD" in proc.stdout, (
        proc.stdout + proc.stderr)


def test_a_connect_dataframe_is_recognised_once_its_module_is_loaded(monkeypatch):
    class ConnectDataFrame:
        pass

    module = types.ModuleType("pyspark.sql.connect.dataframe")
    module.DataFrame = ConnectDataFrame
    monkeypatch.setitem(sys.modules, "pyspark.sql.connect.dataframe", module)
    assert is_dataframe(ConnectDataFrame())
    assert not is_dataframe([1])
    monkeypatch.delitem(sys.modules, "pyspark.sql.connect.dataframe")
    assert not is_dataframe(ConnectDataFrame())
