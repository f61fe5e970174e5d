"""Packaging promises: generated code is what the proto says; the client stays thin; the core
stays pure."""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GEN = ROOT / "client" / "src" / "spillway" / "v1"


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


def test_generated_code_is_up_to_date(tmp_path):
    subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", "-I", str(ROOT / "protos"),
         f"--python_out={tmp_path}", f"--pyi_out={tmp_path}", f"--grpc_python_out={tmp_path}",
         str(ROOT / "protos" / "spillway" / "v1" / "sidecar.proto")],
        check=True,
    )
    for name in ("sidecar_pb2.py", "sidecar_pb2.pyi", "sidecar_pb2_grpc.py"):
        fresh = (tmp_path / "spillway" / "v1" / name).read_text()
        assert (GEN / name).read_text() == fresh, f"{name} is stale: run `make protos`"


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
