#!/bin/bash
# spillway on Google Cloud Dataproc (on Compute Engine): an initialization action. Dataproc runs
# it as root on every node once the cluster is set up, and again on each node a scale-up adds
# (docs/DEPLOY.md, "Dataproc").
#
#   gcloud dataproc clusters create <name> --region=<region> \
#     --initialization-actions=gs://<bucket>/spillway/dataproc/init.sh \
#     --metadata=spillway-deploy-uri=gs://<bucket>/spillway,spillway-bootstrap-servers=<kafka>
#
# Metadata: spillway-deploy-uri (the bundle of deploy/platform/make-bundle.sh: a gs:// URI,
# copied to the node, or a local directory), spillway-bootstrap-servers (Kafka); other settings
# (deploy/platform/spillway-node.sh) from node.env in the bundle.
set -euo pipefail

R="${SPILLWAY_ROOT:-}"
metadata() {  # an instance attribute, '' when absent
  "$R/usr/share/google/get_metadata_value" "$1" 2>/dev/null || true
}

source_uri="$(metadata attributes/spillway-deploy-uri)"
[ -n "$source_uri" ] || { echo "$0: set the cluster metadata spillway-deploy-uri (gs://bucket/prefix)" >&2; exit 1; }
case "$source_uri" in
  gs://*)
    SPILLWAY_DEPLOY_DIR="$R/var/tmp/spillway-deploy"
    mkdir -p "$SPILLWAY_DEPLOY_DIR"
    gcloud storage cp --recursive "$source_uri/*" "$SPILLWAY_DEPLOY_DIR/"
    ;;
  *) SPILLWAY_DEPLOY_DIR="$source_uri" ;;
esac
export SPILLWAY_DEPLOY_DIR
export SPILLWAY_WHEELHOUSE="${SPILLWAY_WHEELHOUSE:-$SPILLWAY_DEPLOY_DIR/wheelhouse}"
servers="$(metadata attributes/spillway-bootstrap-servers)"
[ -n "$servers" ] && export SPILLWAY_BOOTSTRAP_SERVERS="${SPILLWAY_BOOTSTRAP_SERVERS:-$servers}"

# shellcheck source=SCRIPTDIR/../platform/spillway-node.sh
. "$SPILLWAY_DEPLOY_DIR/spillway-node.sh"
spillway_load_settings "$SPILLWAY_DEPLOY_DIR/node.env"

# Dataproc 2.2 images: conda's Python 3.11 is PYSPARK_PYTHON; the sidecar's venv is its own
export SPILLWAY_PYTHON="${SPILLWAY_PYTHON:-/opt/conda/default/bin/python3}"
export SPILLWAY_SPARK_PYTHON="${SPILLWAY_SPARK_PYTHON-/opt/conda/default/bin/python3}"
role="$(metadata attributes/dataproc-role)"
export SPILLWAY_NODE_ADDRESS="${SPILLWAY_NODE_ADDRESS:-$(metadata network-interfaces/0/ip)}"
export SPILLWAY_SIDECAR_ID="${SPILLWAY_SIDECAR_ID:-$(metadata attributes/dataproc-cluster-name)-${role:-node}-$(hostname -s)}"

if [ -z "${SPILLWAY_TLS_DIR:-}" ] && [ "$(metadata attributes/dataproc-worker-count)" != 0 ]; then
  spillway_log "warning: this cluster has workers; without SPILLWAY_TLS_DIR (cluster mode) jobs whose executors run on several nodes are refused"
fi
spillway_node_install
spillway_yarn_spark_conf "$R/etc/spark/conf"
