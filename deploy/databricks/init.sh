#!/bin/bash
# spillway on a Databricks classic cluster: a cluster-scoped init script (dedicated or standard
# access mode; not serverless). It runs as root on the driver and on every worker, before Spark
# starts (docs/DEPLOY.md, "Databricks (classic clusters)").
#
# Upload a bundle (deploy/platform/make-bundle.sh) to a Unity Catalog volume and point the
# cluster at it, in the cluster's environment variables (spark_env_vars):
#   SPILLWAY_DEPLOY_DIR=/Volumes/<catalog>/<schema>/<volume>/spillway
#   SPILLWAY_BOOTSTRAP_SERVERS=<kafka bootstrap servers>
# and add <that directory>/init.sh as the cluster's init script. The directory holds this file,
# spillway-node.sh (the shared installer, sourced from there: an init script is one file, and
# only an init script stored in the volume may read the volume's other files), spillway.env,
# spillway.service and wheelhouse/. Optional settings: deploy/platform/spillway-node.sh.
#
# Dedicated access mode: executors run on the node, they use the Unix socket
# /run/spillway/sidecar.sock. Standard access mode sandboxes UDFs: set SPILLWAY_TLS_DIR
# (a directory of the volume with the TLS material) and SPILLWAY_EXECUTOR_TRANSPORT=node, so
# they dial this node's address with TLS.
set -euo pipefail

: "${SPILLWAY_DEPLOY_DIR:?set SPILLWAY_DEPLOY_DIR (the volume directory holding spillway-node.sh and wheelhouse/) in the cluster environment variables}"
R="${SPILLWAY_ROOT:-}"

# the wheels are read from a local copy: the volume's FUSE mount is slow for pip's many reads
export SPILLWAY_WHEELHOUSE="${SPILLWAY_WHEELHOUSE:-$R/local_disk0/tmp/spillway-wheelhouse}"
if [ "$SPILLWAY_WHEELHOUSE" != "$SPILLWAY_DEPLOY_DIR/wheelhouse" ]; then
  rm -rf "$SPILLWAY_WHEELHOUSE"   # a copy of the volume's, exactly (no wheel of an older bundle)
  mkdir -p "$SPILLWAY_WHEELHOUSE"
  cp "$SPILLWAY_DEPLOY_DIR"/wheelhouse/* "$SPILLWAY_WHEELHOUSE"/
fi
# the cluster's Python (Databricks Runtime 15.4 LTS and later: 3.11+) runs the sidecar's venv,
# and is the executors' Python
export SPILLWAY_PYTHON="${SPILLWAY_PYTHON:-/databricks/python3/bin/python3}"
export SPILLWAY_SPARK_PYTHON="${SPILLWAY_SPARK_PYTHON-/databricks/python3/bin/python3}"
export SPILLWAY_NODE_ADDRESS="${SPILLWAY_NODE_ADDRESS:-${DB_CONTAINER_IP:-}}"
if [ "${DB_IS_DRIVER:-}" = TRUE ]; then role=driver; else role=worker; fi
export SPILLWAY_SIDECAR_ID="${SPILLWAY_SIDECAR_ID:-${DB_CLUSTER_ID:-databricks}-$role-${DB_CONTAINER_IP:-$(hostname)}}"
# init scripts run inside the Spark container, not under systemd: the installer's restart loop
# supervises the sidecar (SPILLWAY_SUPERVISOR=systemd where a runtime image does run it)
export SPILLWAY_SUPERVISOR="${SPILLWAY_SUPERVISOR:-loop}"

# shellcheck source=SCRIPTDIR/../platform/spillway-node.sh
. "$SPILLWAY_DEPLOY_DIR/spillway-node.sh"
spillway_node_install

# Executors (and the driver, and their Python workers) inherit the environment spark-env.sh
# exports; the block between spillway's markers is replaced, never added twice.
spillway_executor_env | sed 's/^/export /' |
  spillway_block "$R/databricks/spark/conf/spark-env.sh"
spillway_log "executors: $(spillway_executor_env | head -n 1) in $R/databricks/spark/conf/spark-env.sh"
