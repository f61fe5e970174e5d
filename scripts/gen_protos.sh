#!/usr/bin/env bash
# Rebuilds the generated protobuf/gRPC code. The only way generated code changes: never edit
# client/src/spillway/v1/ by hand. grpcio-tools is pinned in requirements/dev.txt.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
out=client/src
rm -f "$out"/spillway/v1/*_pb2*.py "$out"/spillway/v1/*_pb2*.pyi
"$PY" -m grpc_tools.protoc -I protos \
  --python_out="$out" --pyi_out="$out" --grpc_python_out="$out" \
  protos/spillway/v1/sidecar.proto
echo "generated: $(ls "$out"/spillway/v1)"
