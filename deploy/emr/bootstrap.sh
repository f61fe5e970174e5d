#!/bin/bash
# spillway on Amazon EMR (on EC2): a bootstrap action. EMR runs it on every node, as the hadoop
# user, before it installs Spark and YARN (docs/DEPLOY.md, "Amazon EMR").
#
#   --bootstrap-actions Name=spillway,Path=s3://<bucket>/spillway/emr/bootstrap.sh,\
#       Args=[s3://<bucket>/spillway,SPILLWAY_BOOTSTRAP_SERVERS=<kafka>]
#   --configurations file://configurations.json     (deploy/emr/configurations.json)
#
# Argument 1: where the bundle is (deploy/platform/make-bundle.sh): an S3 URI, copied to the
# node, or a local directory. Further arguments: SPILLWAY_NAME=value settings
# (deploy/platform/spillway-node.sh); a node.env in the bundle gives defaults.
# Spark is not installed yet when this runs: the executors' environment comes from the
# cluster's configurations (configurations.json); on a node where Spark is already installed
# (running this again by hand) it is also written to /etc/spark/conf.
set -euo pipefail

if [ "$(id -u)" != 0 ]; then exec sudo -E bash "$0" "$@"; fi
[ $# -ge 1 ] || { echo "usage: $0 s3://bucket/prefix|DIR [SPILLWAY_NAME=value ...]" >&2; exit 2; }
source_uri="$1"; shift
for setting in "$@"; do
  case "$setting" in
    SPILLWAY_[A-Z0-9_]*=*) export "${setting?}" ;;
    *) echo "$0: '$setting' is not SPILLWAY_NAME=value" >&2; exit 2 ;;
  esac
done
R="${SPILLWAY_ROOT:-}"

case "$source_uri" in
  s3://*)
    SPILLWAY_DEPLOY_DIR="$R/mnt/spillway-deploy"
    aws s3 cp --recursive --only-show-errors "$source_uri" "$SPILLWAY_DEPLOY_DIR"
    ;;
  *) SPILLWAY_DEPLOY_DIR="$source_uri" ;;
esac
export SPILLWAY_DEPLOY_DIR
export SPILLWAY_WHEELHOUSE="${SPILLWAY_WHEELHOUSE:-$SPILLWAY_DEPLOY_DIR/wheelhouse}"

# shellcheck source=SCRIPTDIR/../platform/spillway-node.sh
. "$SPILLWAY_DEPLOY_DIR/spillway-node.sh"
spillway_load_settings "$SPILLWAY_DEPLOY_DIR/node.env"

# Amazon Linux 2023's python3 is 3.9: the sidecar and the executors get Python 3.11
# (configurations.json sets PYSPARK_PYTHON to it)
if [ -z "${SPILLWAY_PYTHON:-}" ]; then
  command -v python3.11 >/dev/null || dnf install -y -q python3.11
  SPILLWAY_PYTHON="$(command -v python3.11)"
fi
export SPILLWAY_PYTHON
export SPILLWAY_SPARK_PYTHON="${SPILLWAY_SPARK_PYTHON-$SPILLWAY_PYTHON}"

info="$R/mnt/var/lib/info"
[ -f "$info/instance.json" ] || spillway_die "$info/instance.json not found: not an EMR node?"
emr_field() {  # a top-level field of one of EMR's node description files
  "$SPILLWAY_PYTHON" -c 'import json, sys; print(json.load(open(sys.argv[1])).get(sys.argv[2], ""))' "$@"
}
if [ "$(emr_field "$info/instance.json" isMaster)" = True ]; then role=primary; else role=core; fi
cluster="$(emr_field "$info/job-flow.json" jobFlowId 2>/dev/null || echo emr)"
export SPILLWAY_NODE_ADDRESS="${SPILLWAY_NODE_ADDRESS:-$(hostname -I | awk '{print $1}')}"
export SPILLWAY_SIDECAR_ID="${SPILLWAY_SIDECAR_ID:-${cluster:-emr}-$role-$(hostname -s)}"
# YARN containers run as yarn (group hadoop) unless Kerberos maps them to the submitting users;
# the socket keeps mode 0666 by default: the hadoop group does not exist yet at bootstrap

spillway_node_install

if [ -f "$R/etc/spark/conf/spark-defaults.conf" ]; then
  spillway_yarn_spark_conf "$R/etc/spark/conf"
else
  spillway_log "executors: Spark is not installed yet; the cluster's configurations carry $(spillway_executor_env | head -n 1) (deploy/emr/configurations.json)"
fi
