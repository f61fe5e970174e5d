#!/usr/bin/env bash
# Rebuilds the generated protobuf/gRPC code. The only way generated code changes: never edit
# client/src/spillway/v1/ by hand. The generator is the old grpcio-tools pinned in
# requirements/protos.txt, installed into its own venv (.venv-protos/, rebuilt when that file
# changes) so the output imports under the oldest protobuf/grpcio runtimes the client declares.
# OUT=dir writes the tree (spillway/v1/...) under another directory (the staleness test uses it).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
out=${OUT:-client/src}
gen=${PROTOS_VENV:-.venv-protos}
pins=requirements/protos.txt
stamp="$gen/.installed"
if ! { [ -f "$stamp" ] && cmp -s "$stamp" "$pins"; }; then
  rm -rf "$gen"
  "$PY" -m venv "$gen"
  "$gen/bin/pip" install -q --disable-pip-version-check -r "$pins"
  cp "$pins" "$stamp"
fi
mkdir -p "$out/spillway/v1"
rm -f "$out"/spillway/v1/*_pb2*.py "$out"/spillway/v1/*_pb2*.pyi
"$gen/bin/python" -m grpc_tools.protoc -I protos \
  --python_out="$out" --pyi_out="$out" --grpc_python_out="$out" \
  protos/spillway/v1/sidecar.proto
echo "generated: $(ls "$out"/spillway/v1)"
