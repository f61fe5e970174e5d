#!/usr/bin/env bash
# Build the bundle the platform recipes install from (docs/DEPLOY.md, "Platform recipes"):
#
#   deploy/platform/make-bundle.sh OUT [--python-version 3.11] [--executor-python-version 3.12]...
#       [-- PIP_OPTION...]
#
# OUT/ gets the recipes (spillway-node.sh, spillway.service, spillway.env, databricks-init.sh,
# emr-bootstrap.sh, dataproc-init.sh) and OUT/wheelhouse/: the three spillway wheels built from
# this checkout, every dependency of the sidecar at the pins of requirements/sidecar.txt (for
# --python-version, default 3.11) and the executors' dependencies (spillway-client's and
# opentelemetry-sdk, for each --executor-python-version; default: the sidecar's), all for
# glibc 2.28+ Linux on x86-64 (ARCH=aarch64 for ARM nodes), and constraints.txt (the pins
# the installer applies). Options after `--` go to pip (e.g. --no-index --find-links DIR to
# build offline from a directory of wheels). The C extensions are built here: run this on the
# OS and CPU of the nodes (docs/DEPLOY.md, "Installing on executors").
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
python="${PYTHON:-python3}"
arch="${ARCH:-x86_64}"
# pip matches each tag exactly: the glibc 2.28 tag and the older ones wheels still carry
platforms=(--platform "manylinux_2_28_$arch" --platform "manylinux2014_$arch" \
           --platform "manylinux1_$arch")
[ $# -ge 1 ] || { sed -n '2,17p' "${BASH_SOURCE[0]}" >&2; exit 2; }
out="$1"; shift
sidecar_py=3.11
executor_pys=()
while [ $# -gt 0 ]; do
  case "$1" in
    --python-version) sidecar_py="$2"; shift 2 ;;
    --executor-python-version) executor_pys+=("$2"); shift 2 ;;
    --) shift; break ;;
    *) echo "make-bundle.sh: unknown option $1" >&2; exit 2 ;;
  esac
done
[ ${#executor_pys[@]} -gt 0 ] || executor_pys=("$sidecar_py")
pip_opts=("$@")

mkdir -p "$out/wheelhouse"
install -m 0755 "$repo/deploy/platform/spillway-node.sh" "$out/spillway-node.sh"
install -m 0644 "$repo/deploy/systemd/spillway.service" "$repo/deploy/systemd/spillway.env" "$out/"
install -m 0755 "$repo/deploy/databricks/init.sh" "$out/databricks-init.sh"
install -m 0755 "$repo/deploy/emr/bootstrap.sh" "$out/emr-bootstrap.sh"
install -m 0755 "$repo/deploy/dataproc/init.sh" "$out/dataproc-init.sh"
install -m 0644 "$repo/deploy/emr/configurations.json" "$out/emr-configurations.json"

wh="$out/wheelhouse"
rm -f "$wh"/spillway_*.whl
"$python" -m pip wheel -q --disable-pip-version-check --no-deps --wheel-dir "$wh" \
  "${pip_opts[@]}" "$repo/client" "$repo/sidecar" "$repo/spark_integration"
version() { basename "$1" | cut -d- -f2; }
{
  grep -v '^#' "$repo/requirements/sidecar.txt"
  for dist in spillway_client spillway_sidecar spillway_spark; do
    whl="$(ls "$wh"/"$dist"-*.whl)"
    echo "${dist//_/-}==$(version "$whl")"
  done
} >"$wh/constraints.txt"

download() {  # PYTHON_VERSION REQUIREMENT...
  local pyver="$1"; shift
  "$python" -m pip download -q --disable-pip-version-check --only-binary=:all: \
    "${platforms[@]}" --python-version "$pyver" --dest "$wh" --find-links "$wh" \
    "${pip_opts[@]}" "$@"
}
download "$sidecar_py" -r "$repo/requirements/sidecar.txt"
for pyver in "${executor_pys[@]}"; do
  download "$pyver" "spillway-client==$(version "$(ls "$wh"/spillway_client-*.whl)")" \
    'opentelemetry-sdk>=1.27,<2'
done
echo "make-bundle.sh: $out ($(find "$wh" -name '*.whl' | wc -l) wheels)"
