"""Packaging promises: generated code is what the proto says and imports under old runtimes; the
client stays thin; the core stays pure; the distributions declare ranges, not pins, and every
pin file installs inside them."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version
from support import paths

ROOT = paths.ROOT
GEN = ROOT / "client" / "src" / "spillway" / "v1"
DISTS = ("client", "sidecar", "spark_integration")

# The supported ranges, as README.md and docs/DEPLOY.md state them (tests/compat runs their ends).
RANGES = {
    "client": {"grpcio": ">=1.56,<2", "protobuf": ">=3.20.3,<8",
               "opentelemetry-api": ">=1.27,<2"},
    "spark_integration": {"pyspark": ">=3.5,<5", "spillway-client": ">=0.1.0,<0.2",
                          "opentelemetry-sdk": ">=1.27,<2"},
}


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
            if node.module.startswith("opentelemetry.sdk"):
                names.add("opentelemetry.sdk")
    return names


def _meta(dist: str) -> dict:
    return tomllib.loads((ROOT / dist / "pyproject.toml").read_text())["project"]


def _requirements(dist: str, extra: str | None = None) -> list[Requirement]:
    meta = _meta(dist)
    deps = list(meta["dependencies"])
    if extra:
        deps += meta["optional-dependencies"][extra]
    return [Requirement(d) for d in deps]


def _pins(path: Path) -> dict[str, Version]:
    pins = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            pins[re.sub(r"[-_.]+", "-", name).lower()] = Version(version)
    return pins


def test_generated_code_is_up_to_date(tmp_path):
    # the same script and pinned generator as `make protos`, writing elsewhere
    subprocess.run([str(ROOT / "scripts" / "gen_protos.sh")], check=True,
                   env={**os.environ, "OUT": str(tmp_path)}, capture_output=True)
    for name in ("sidecar_pb2.py", "sidecar_pb2.pyi", "sidecar_pb2_grpc.py"):
        fresh = (tmp_path / "spillway" / "v1" / name).read_text()
        assert (GEN / name).read_text() == fresh, f"{name} is stale: run `make protos`"


def test_generated_code_accepts_old_runtimes():
    # protoc >= 26 emits a runtime check refusing older protobuf; grpcio-tools >= 1.63 one
    # refusing older grpcio, and >= 1.62 a keyword older grpcio lacks.
    pb2 = (GEN / "sidecar_pb2.py").read_text()
    grpc_pb2 = (GEN / "sidecar_pb2_grpc.py").read_text()
    assert "ValidateProtobufRuntimeVersion" not in pb2
    assert "GRPC_GENERATED_VERSION" not in grpc_pb2
    assert "_registered_method" not in grpc_pb2
    tools = _pins(ROOT / "requirements" / "protos.txt")["grpcio-tools"]
    assert tools < Version("1.62"), f"requirements/protos.txt: grpcio-tools=={tools}"


@pytest.mark.parametrize("dist", DISTS)
def test_distributions_declare_ranges_not_pins(dist):
    for req in _requirements(dist):
        specs = list(req.specifier)
        assert specs, f"{dist}: {req} has no lower bound"
        assert all(s.operator not in ("==", "===", "~=") for s in specs), \
            f"{dist}: {req} is a pin (pins belong in requirements/)"
        assert any(s.operator == ">=" for s in specs), f"{dist}: {req} has no lower bound"


def test_stated_ranges():
    for dist, ranges in RANGES.items():
        declared = {r.name: str(r.specifier) for r in _requirements(dist)}
        for name, spec in ranges.items():
            assert name in declared, f"{dist} does not depend on {name}"
            assert Requirement(f"{name}{declared[name]}").specifier == \
                Requirement(f"{name}{spec}").specifier, f"{dist}: {name}{declared[name]}"
    assert _meta("client")["requires-python"] == ">=3.10"
    assert _meta("spark_integration")["requires-python"] == ">=3.10"
    # the docs users read state the same ranges
    for doc in ("README.md", "docs/DEPLOY.md"):
        text = (ROOT / doc).read_text()
        for name, spec in {**RANGES["client"], "pyspark": ">=3.5,<5"}.items():
            assert f"{name}{spec}" in text, f"{doc} does not state {name}{spec}"


@pytest.mark.parametrize("lock, dists", [
    ("requirements/dev.txt", [("client", None), ("sidecar", "embedded"),
                              ("spark_integration", "pandas")]),
    ("requirements/sidecar.txt", [("client", None), ("sidecar", None)]),
    ("deploy/spark-requirements.txt", [("client", None), ("spark_integration", "pandas")]),
])
def test_pins_lie_inside_the_declared_ranges(lock, dists):
    pins = _pins(ROOT / lock)
    for dist, extra in dists:
        for req in _requirements(dist, extra):
            name = re.sub(r"[-_.]+", "-", req.name).lower()
            if name in pins:
                assert req.specifier.contains(pins[name], prereleases=True), \
                    f"{lock}: {name}=={pins[name]} is outside {dist}'s {req}"


def test_client_distribution_needs_only_grpc_protobuf_and_otel_api():
    meta = tomllib.loads((ROOT / "client" / "pyproject.toml").read_text())
    deps = {d.split(">")[0].split("=")[0].split("[")[0].strip()
            for d in meta["project"]["dependencies"]}
    assert deps == {"grpcio", "protobuf", "opentelemetry-api"}
    forbidden = {"confluent_kafka", "pyspark", "opentelemetry.sdk", "pandas", "pyarrow"}
    for path in (ROOT / "client" / "src").rglob("*.py"):
        assert not (_imports(path) & forbidden), f"{path} imports {_imports(path) & forbidden}"


def test_policy_core_imports_no_adapter_library():
    forbidden = {"grpc", "confluent_kafka", "pyspark", "opentelemetry", "google"}
    core = ROOT / "sidecar" / "src" / "spillway" / "sidecar" / "core"
    files = list(core.rglob("*.py"))
    assert files
    for path in files:
        assert not (_imports(path) & forbidden), f"{path} imports {_imports(path) & forbidden}"


def test_installed_packages_have_distinctive_names():
    import spillway.client
    import spillway.sidecar
    import spillway.spark

    for mod in (spillway.client, spillway.sidecar, spillway.spark):
        assert mod.__name__.startswith("spillway.")


def test_compat_oldest_set_is_the_declared_floors():
    """tests/compat's "oldest" combination installs exactly the lower bounds we declare."""
    oldest = _pins(ROOT / "requirements" / "compat" / "oldest.txt")
    floors = {}
    for dist, extra in (("client", None), ("spark_integration", "pandas")):
        for req in _requirements(dist, extra):
            for spec in req.specifier:
                if spec.operator == ">=" and not req.name.startswith("spillway"):
                    floors[req.name] = Version(spec.version)
    assert floors and set(floors) <= set(oldest), set(floors) - set(oldest)
    for name, floor in floors.items():
        assert oldest[name] == floor, f"compat oldest pins {name}=={oldest[name]}, floor {floor}"
    for path in (ROOT / "requirements" / "compat").glob("*.txt"):
        pyspark = _pins(path)["pyspark"]
        assert Version("3.5") <= pyspark < Version("5"), f"{path.name}: pyspark {pyspark}"


def test_a_spark_worker_running_a_wrapper_imports_none_of_the_drivers_api():
    """`spillway.spark`'s driver API (Job, the DLQ reader, the native deserializer) is imported
    when first used: a Python worker imports the package to run a wrapper, once per process."""
    import sys

    code = ("import sys, spillway.spark._partitions, spillway.spark._udf\n"
            "print(sorted(m for m in ('spillway.spark.job', 'spillway.spark._dlq_reader', "
            "'spillway.spark._native') if m in sys.modules))\n"
            "import spillway.spark as s\n"
            "print(all(hasattr(s, n) for n in s.__all__), s.Job.__module__)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.split("\n")
    assert out[0] == "[]" and out[1] == "True spillway.spark.job"
