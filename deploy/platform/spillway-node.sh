#!/usr/bin/env bash
# spillway on one node, the part every platform recipe shares (docs/DEPLOY.md, "Platform
# recipes"). deploy/databricks/init.sh, deploy/emr/bootstrap.sh and deploy/dataproc/init.sh
# source this file and call spillway_node_install; on a plain systemd host run it yourself:
#
#   SPILLWAY_WHEELHOUSE=/srv/spillway/wheelhouse SPILLWAY_BOOTSTRAP_SERVERS=kafka:9092 \
#     bash spillway-node.sh install
#
#   spillway-node.sh install     install the wheels, write the configuration, start the sidecar
#                                (systemd, else a restart loop) and wait until it is SERVING
#   spillway-node.sh supervise   the restart loop itself, in the foreground (one per node)
#   spillway-node.sh stop        stop the restart loop and its sidecar
#   spillway-node.sh health      exit 0 when the sidecar answers SERVING on grpc.health.v1
#
# Every step is idempotent: a second run installs nothing new, rewrites no file whose content
# is unchanged, adds no second line anywhere and starts no second sidecar; it restarts the
# sidecar only when its wheels or its configuration changed.
#
# Settings (environment; platform scripts set the platform's defaults):
#   SPILLWAY_WHEELHOUSE        local directory of wheels: spillway_{client,sidecar,spark}-*.whl,
#                              their dependencies, and optionally constraints.txt (pins)
#   SPILLWAY_PYTHON            Python >= 3.11 for the sidecar's venv (default python3)
#   SPILLWAY_SPARK_PYTHON      the executors' Python (PYSPARK_PYTHON): gets spillway-client and
#                              spillway-spark ('' : leave it alone)
#   SPILLWAY_BOOTSTRAP_SERVERS Kafka for the DLQ (bootstrap.servers)
#   SPILLWAY_PORT              TCP port (default 50051)
#   SPILLWAY_NODE_ADDRESS      this node's address (cluster mode: listen and advertise on it;
#                              the platform scripts default to its private IP; fqdn: its host
#                              name, for one wildcard certificate such as *.ec2.internal)
#   SPILLWAY_TLS_DIR           cluster mode: tls.crt, tls.key, ca.crt (optional node.token,
#                              admin.token; client.crt, client.key for sandboxed executors).
#                              Unset: single-node mode (loopback and the Unix socket only)
#   SPILLWAY_HOME_ALLOWED_ADDRESSES  cluster mode: the sidecars' network, e.g. 10.0.0.0/8:50051
#   SPILLWAY_PEER_IDENTITIES   cluster mode: peers' certificate name (default spillway-sidecar)
#   SPILLWAY_EXECUTOR_TRANSPORT  socket (default) or node: executors dial the node address with
#                              TLS (platforms that sandbox UDFs; needs SPILLWAY_TLS_DIR)
#   SPILLWAY_SOCKET_GROUP      group of the Unix socket (mode 0660); unset: mode 0666, as open as
#                              the loopback port
#   SPILLWAY_SIDECAR_ID        the sidecar's name (default: host name)
#   SPILLWAY_EXTRA_PROPERTIES  a properties file appended to the generated one
#   SPILLWAY_SUPERVISOR        systemd, loop, or auto (systemd when it runs, else loop)
#   SPILLWAY_USER              systemd: the sidecar's user, created if missing (default spillway)
#   SPILLWAY_START_TIMEOUT     seconds to wait for SERVING (default 90)
#   SPILLWAY_ROOT              prefix of every path written (/etc, /opt, /var, /run; tests)
set -euo pipefail

spillway_log() { printf 'spillway-node: %s\n' "$*" >&2; }
spillway_die() { spillway_log "error: $*"; exit 1; }

spillway_paths() {
  SW_ROOT="${SPILLWAY_ROOT:-}"
  SW_OPT="$SW_ROOT/opt/spillway"
  SW_ETC="$SW_ROOT/etc/spillway"
  SW_VAR="$SW_ROOT/var/lib/spillway"
  SW_RUN="$SW_ROOT/run/spillway"
  SW_LOG="$SW_ROOT/var/log/spillway"
  SW_CONF="$SW_ETC/sidecar.properties"
  SW_ENV="$SW_ETC/spillway.env"
  SW_SOCKET="$SW_RUN/sidecar.sock"
  SW_PORT="${SPILLWAY_PORT:-50051}"
  SW_UNIT="$SW_ROOT/etc/systemd/system/spillway.service"
}

# Where this file's companions are: beside it (an uploaded bundle) or in the repository layout.
spillway_companion() {
  local here name="$1"
  here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
  for candidate in "$here/$name" "$here/../systemd/$name"; do
    if [ -f "$candidate" ]; then printf '%s\n' "$candidate"; return 0; fi
  done
  spillway_die "$name not found beside $here/spillway-node.sh (copy it there)"
}

# Write stdin to FILE only when it differs; prints "changed" or "same".
spillway_write() {
  local file="$1" mode="$2" tmp
  mkdir -p "$(dirname "$file")"
  tmp="$(mktemp "$file.XXXXXX")"
  cat >"$tmp"
  chmod "$mode" "$tmp"
  if [ -f "$file" ] && cmp -s "$tmp" "$file"; then
    rm -f "$tmp"; echo same
  else
    mv -f "$tmp" "$file"; echo changed
  fi
}

# Replace the block between spillway's markers in FILE with stdin (added once, at the end).
spillway_block() {
  local file="$1" begin="# >>> spillway (deploy/platform/spillway-node.sh) >>>"
  local end="# <<< spillway <<<" body current
  body="$(cat)"
  mkdir -p "$(dirname "$file")"
  current=""
  [ -f "$file" ] && current="$(awk -v b="$begin" -v e="$end" \
    '$0==b{skip=1;next} $0==e{skip=0;next} !skip' "$file")"
  {
    [ -n "$current" ] && printf '%s\n' "$current"
    printf '%s\n%s\n%s\n' "$begin" "$body" "$end"
  } | spillway_write "$file" 0644 >/dev/null
}

# NAME=value lines of FILE (e.g. node.env in an uploaded bundle) as defaults: a variable already
# set in the environment wins.
spillway_load_settings() {
  local file="$1" line name
  [ -f "$file" ] || return 0
  while IFS= read -r line || [ -n "$line" ]; do
    case "$line" in ''|'#'*) continue ;; esac
    name="${line%%=*}"
    case "$name" in SPILLWAY_[A-Z0-9_]*) ;; *) spillway_die "$file: '$line' is not SPILLWAY_NAME=value" ;; esac
    [ -n "${!name+x}" ] || export "$name=${line#*=}"
  done <"$file"
}

# YARN (EMR, Dataproc, any Hadoop cluster): a container gets the environment its application
# asks for, not the NodeManager's, so the executors' variables go in spark-defaults.conf
# (spark.executorEnv.*, and spark.yarn.appMasterEnv.* for a cluster-mode driver); spark-env.sh
# exports them for client-mode drivers, which spark-submit starts in its own environment.
spillway_yarn_spark_conf() {
  local conf_dir="$1" name value
  spillway_executor_env | while IFS='=' read -r name value; do
    printf 'spark.executorEnv.%s %s\nspark.yarn.appMasterEnv.%s %s\n' \
      "$name" "$value" "$name" "$value"
  done | spillway_block "$conf_dir/spark-defaults.conf"
  spillway_executor_env | sed 's/^/export /' | spillway_block "$conf_dir/spark-env.sh"
  spillway_log "executors: $(spillway_executor_env | head -n 1) in $conf_dir/spark-defaults.conf"
}

spillway_python_ok() {
  "$1" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null
}

spillway_install_sidecar() {
  local py="${SPILLWAY_PYTHON:-python3}" wh="$SPILLWAY_WHEELHOUSE" stamp constraints=()
  command -v "$py" >/dev/null || spillway_die "SPILLWAY_PYTHON=$py: not found"
  spillway_python_ok "$py" || spillway_die "SPILLWAY_PYTHON=$py is older than 3.11 (the sidecar needs 3.11+)"
  [ -f "$wh/constraints.txt" ] && constraints=(-c "$wh/constraints.txt")
  # what is installed: the interpreter, the wheelhouse's files, and our wheels' contents (a
  # rebuilt bundle keeps their version numbers)
  stamp="$({ "$py" -c 'import sys; print(sys.version)'; ls -1 "$wh"; \
             cat "$wh/constraints.txt" 2>/dev/null || true; sha256sum "$wh"/spillway_*.whl; } |
           sha256sum | cut -d' ' -f1)"
  if [ -x "$SW_OPT/bin/spillway" ] && [ "$(cat "$SW_OPT/.wheelhouse" 2>/dev/null)" = "$stamp" ]; then
    spillway_log "sidecar: $SW_OPT already has these wheels"
    return 0
  fi
  [ -x "$SW_OPT/bin/python" ] || "$py" -m venv "$SW_OPT"
  # the wheelhouse alone decides what is installed: no index, no pip configuration of the host;
  # not byte-compiled (the first start compiles; the unit keeps that in /var/cache/spillway)
  PIP_CONFIG_FILE=/dev/null "$SW_OPT/bin/python" -m pip install -q --disable-pip-version-check \
    --no-compile --no-index --find-links "$wh" "${constraints[@]}" --upgrade \
    spillway-sidecar spillway-client
  PIP_CONFIG_FILE=/dev/null "$SW_OPT/bin/python" -m pip install -q --disable-pip-version-check \
    --no-compile --no-index --no-deps --force-reinstall \
    "$wh"/spillway_client-*.whl "$wh"/spillway_sidecar-*.whl
  echo "$stamp" >"$SW_OPT/.wheelhouse"
  SW_RESTART=1
  spillway_log "sidecar: installed into $SW_OPT"
}

# spillway-client and spillway-spark into the executors' Python. spillway-spark goes in without
# its dependencies: the platform's Spark provides pyspark (often not as a pip distribution, and
# a second PySpark must not shadow it); the rest are resolved within their ranges, keeping what
# the Python already has when it fits.
spillway_install_executor_python() {
  local spy="${SPILLWAY_SPARK_PYTHON:-}" wh="$SPILLWAY_WHEELHOUSE" stamp file
  [ -n "$spy" ] || return 0
  command -v "$spy" >/dev/null || spillway_die "SPILLWAY_SPARK_PYTHON=$spy: not found"
  "$spy" -c 'import sys; sys.exit(sys.version_info < (3, 10))' ||
    spillway_die "SPILLWAY_SPARK_PYTHON=$spy is older than 3.10 (spillway-spark needs 3.10+)"
  stamp="$({ echo "$spy"; "$spy" -c 'import sys; print(sys.prefix, sys.version)'; \
             ls -1 "$wh"; sha256sum "$wh"/spillway_*.whl; } | sha256sum | cut -d' ' -f1)"
  file="$SW_OPT/.executor-python.$(printf '%s' "$spy" | sha256sum | cut -c1-12)"
  if [ "$(cat "$file" 2>/dev/null)" = "$stamp" ]; then
    spillway_log "executors: $spy already has spillway-client and spillway-spark"
    return 0
  fi
  # pip of the sidecar's venv, run for the target interpreter (which may have no pip)
  PIP_CONFIG_FILE=/dev/null "$SW_OPT/bin/python" -m pip --python "$spy" install -q \
    --disable-pip-version-check --no-compile --no-index --find-links "$wh" \
    spillway-client 'opentelemetry-sdk>=1.27,<2'
  PIP_CONFIG_FILE=/dev/null "$SW_OPT/bin/python" -m pip --python "$spy" install -q \
    --disable-pip-version-check --no-compile --no-index --no-deps --force-reinstall \
    "$wh"/spillway_client-*.whl "$wh"/spillway_spark-*.whl
  echo "$stamp" >"$file"
  spillway_log "executors: spillway-client and spillway-spark installed for $spy"
}

spillway_cluster_mode() { [ -n "${SPILLWAY_TLS_DIR:-}" ]; }

# The address executors and the driver on this node use.
spillway_executor_address() {
  if [ "${SPILLWAY_EXECUTOR_TRANSPORT:-socket}" = node ]; then
    printf '%s:%s\n' "$SPILLWAY_NODE_ADDRESS" "$SW_PORT"
  else
    printf 'unix://%s\n' "$SW_SOCKET"
  fi
}

# NAME=VALUE lines for the executors' environment (each platform puts them where its executors
# read them).
spillway_executor_env() {
  echo "SPILLWAY_SIDECAR_ADDRESS=$(spillway_executor_address)"
  if spillway_cluster_mode; then
    [ -f "$SW_ETC/tls/node.token" ] && echo "SPILLWAY_TOKEN_FILE=$SW_ETC/tls/node.token"
    if [ "${SPILLWAY_EXECUTOR_TRANSPORT:-socket}" = node ]; then
      echo "SPILLWAY_TLS_CA_FILE=$SW_ETC/tls/ca.crt"
      echo "SPILLWAY_TLS_CERT_FILE=$SW_ETC/tls/client.crt"
      echo "SPILLWAY_TLS_KEY_FILE=$SW_ETC/tls/client.key"
    fi
  fi
  return 0
}

spillway_copy_tls() {
  local src="$SPILLWAY_TLS_DIR" dst="$SW_ETC/tls" name group="${SPILLWAY_SOCKET_GROUP:-}"
  for name in tls.crt tls.key ca.crt; do
    [ -f "$src/$name" ] || spillway_die "SPILLWAY_TLS_DIR=$src has no $name"
  done
  mkdir -p "$dst"; chmod 0755 "$dst"
  for name in tls.crt ca.crt client.crt; do
    [ -f "$src/$name" ] && spillway_write "$dst/$name" 0644 <"$src/$name" >/dev/null
  done
  # secrets: the sidecar's key and tokens for its user; what executors read, for their group
  for name in tls.key admin.token; do
    [ -f "$src/$name" ] && spillway_write "$dst/$name" 0600 <"$src/$name" >/dev/null
  done
  for name in node.token client.key; do
    if [ -f "$src/$name" ]; then
      spillway_write "$dst/$name" "$([ -n "$group" ] && echo 0640 || echo 0644)" \
        <"$src/$name" >/dev/null
      [ -n "$group" ] && chgrp "$group" "$dst/$name"
    fi
  done
  if [ "${SW_SUPERVISOR}" = systemd ] && [ "${SPILLWAY_USER:-spillway}" != root ]; then
    chown "${SPILLWAY_USER:-spillway}" "$dst/tls.key"
    [ -f "$dst/admin.token" ] && chown "${SPILLWAY_USER:-spillway}" "$dst/admin.token"
  fi
  return 0
}

spillway_properties() {
  local group="${SPILLWAY_SOCKET_GROUP:-}"
  echo "# Written by spillway-node.sh: change its settings (docs/DEPLOY.md), not this file."
  echo "# KIP property names: docs/CONFIGURATION.md"
  echo "listen.unix.socket=$SW_SOCKET"
  if [ -n "$group" ]; then
    echo "listen.unix.socket.mode=0660"
    echo "listen.unix.socket.group=$group"
  else
    echo "listen.unix.socket.mode=0666"
  fi
  if spillway_cluster_mode; then
    echo "listen.address=$SPILLWAY_NODE_ADDRESS:$SW_PORT"
    echo "advertised.address=$SPILLWAY_NODE_ADDRESS:$SW_PORT"
    echo "tls.cert.file=$SW_ETC/tls/tls.crt"
    echo "tls.key.file=$SW_ETC/tls/tls.key"
    echo "tls.ca.file=$SW_ETC/tls/ca.crt"
    echo "tls.client.auth=require"
    echo "auth.peer.identities=${SPILLWAY_PEER_IDENTITIES:-spillway-sidecar}"
    echo "home.allowed.addresses=$SPILLWAY_HOME_ALLOWED_ADDRESSES"
    [ -f "$SPILLWAY_TLS_DIR/node.token" ] && echo "auth.token.file=$SW_ETC/tls/node.token"
    [ -f "$SPILLWAY_TLS_DIR/admin.token" ] && echo "auth.admin.token.file=$SW_ETC/tls/admin.token"
  else
    # single node: jobs whose executors run on other nodes need cluster mode (their sidecars
    # must reach the driver's sidecar, the run's home)
    echo "listen.address=127.0.0.1:$SW_PORT"
    echo "auth.local.token.file=$SW_VAR/credentials/local.token"
  fi
  [ -n "${SPILLWAY_SIDECAR_ID:-}" ] && echo "sidecar.id=$SPILLWAY_SIDECAR_ID"
  [ -n "${SPILLWAY_BOOTSTRAP_SERVERS:-}" ] && echo "bootstrap.servers=$SPILLWAY_BOOTSTRAP_SERVERS"
  echo "spool.enable=true"
  echo "spool.dir=$SW_VAR/spool"
  echo "shutdown.grace.ms=10000"
  echo "dlq.topic.required.prefix=dlq."
  echo "errors.deadletterqueue.context.headers.enable=true"
  if [ -n "${SPILLWAY_EXTRA_PROPERTIES:-}" ]; then
    echo "# from $SPILLWAY_EXTRA_PROPERTIES"
    cat "$SPILLWAY_EXTRA_PROPERTIES"
  fi
  return 0
}

spillway_write_config() {
  local props envfile conf_result env_result
  mkdir -p "$SW_VAR/spool" "$SW_LOG" "$SW_RUN"
  chmod 0755 "$SW_RUN"
  if spillway_cluster_mode; then spillway_copy_tls; fi
  props="$(spillway_properties)"
  envfile="$(spillway_companion spillway.env)"
  conf_result="$(printf '%s\n' "$props" | spillway_write "$SW_CONF" 0644)"
  env_result="$(spillway_write "$SW_ENV" 0644 <"$envfile")"
  if ! spillway_cluster_mode; then
    spillway_log "single-node mode: a job whose executors run on other nodes is refused there; multi-node clusters need cluster mode (SPILLWAY_TLS_DIR)"
  fi
  if [ "$conf_result" = changed ] || [ "$env_result" = changed ]; then
    SW_RESTART=1
    spillway_log "configuration: $SW_CONF written"
  else
    spillway_log "configuration: $SW_CONF unchanged"
  fi
}

spillway_health_target() {
  printf 'unix://%s\n' "$SW_SOCKET"
}

spillway_health() {
  [ -x "$SW_OPT/bin/python" ] || return 1
  "$SW_OPT/bin/python" - "$(spillway_health_target)" <<'PY'
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

with grpc.insecure_channel(sys.argv[1]) as channel:
    try:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=""), timeout=2)
    except grpc.RpcError:
        sys.exit(1)
sys.exit(reply.status != health_pb2.HealthCheckResponse.SERVING)
PY
}

spillway_wait_healthy() {
  local deadline=$((SECONDS + ${SPILLWAY_START_TIMEOUT:-90}))
  # the socket appears when the sidecar binds; only then is a health call worth its start-up
  until [ -S "$SW_SOCKET" ] && spillway_health; do
    if [ "$SECONDS" -ge "$deadline" ]; then
      spillway_log "the sidecar did not answer SERVING at $(spillway_health_target) within ${SPILLWAY_START_TIMEOUT:-90} s"
      [ -f "$SW_LOG/sidecar.log" ] && tail -n 20 "$SW_LOG/sidecar.log" >&2
      return 1
    fi
    sleep 0.5
  done
  spillway_log "sidecar SERVING at $(spillway_health_target)"
}

# --- supervisors -------------------------------------------------------------------------------

spillway_supervisor_kind() {
  case "${SPILLWAY_SUPERVISOR:-auto}" in
    systemd|loop) echo "$SPILLWAY_SUPERVISOR" ;;
    auto) if [ -z "$SW_ROOT" ] && [ -d /run/systemd/system ] && command -v systemctl >/dev/null
          then echo systemd; else echo loop; fi ;;
    *) spillway_die "SPILLWAY_SUPERVISOR=$SPILLWAY_SUPERVISOR: expected systemd, loop or auto" ;;
  esac
}

spillway_loop_running() {
  [ -f "$SW_RUN/supervisor.lock" ] && ! flock -n "$SW_RUN/supervisor.lock" true
}

# SIGTERM to the sidecar (a graceful stop within shutdown.grace.ms), and, as systemd's
# TimeoutStopSec does, SIGKILL if it is still there SW_STOP_TIMEOUT s later (its spool keeps
# whatever Kafka had not acknowledged): first SIGUSR1, which makes it write every thread's stack
# to its log, so that a stop that hung can be diagnosed. The process is recognised by its start
# time, so a pid the kernel gave to another process meanwhile is never signalled.
spillway_term() {
  local pid="$1" born
  [ -n "$pid" ] || return 0
  born="$(spillway_started "$pid")" || return 0
  kill -TERM "$pid" 2>/dev/null || return 0
  (
    sleep "${SW_STOP_TIMEOUT:-30}"
    [ "$(spillway_started "$pid")" = "$born" ] || exit 0
    spillway_log "the sidecar (pid $pid) did not stop within ${SW_STOP_TIMEOUT:-30} s of SIGTERM: its threads' stacks go to its log, then SIGKILL"
    kill -USR1 "$pid" 2>/dev/null
    sleep 1
    [ "$(spillway_started "$pid")" = "$born" ] && kill -KILL "$pid" 2>/dev/null
  ) </dev/null 9>&- &
}

# A process's start time (field 22 of /proc/PID/stat, after the command name): fails once it is gone.
spillway_started() {
  local stat
  stat="$(cat "/proc/$1/stat" 2>/dev/null)" || return 1
  stat="${stat##*) }"
  # shellcheck disable=SC2086  # split on purpose: the fields after the command name
  set -- $stat
  [ "$1" != Z ] || return 1
  echo "${20}"
}

# The restart loop: `spillway serve` again after it exits (1 s, doubling to 30 s while it keeps
# failing; back to 1 s after a minute up); SIGTERM stops both. A restart asked for (new wheels
# or settings) is a file, $SW_RUN/restart, and SIGTERM to the sidecar: the loop then starts the
# next one at once. Not SIGHUP to the loop: a shell cannot trap a signal its parent ignored, and
# init scripts are often run under nohup (SIGHUP ignored), where it would do nothing. SIGHUP
# still restarts it where it can be trapped.
spillway_supervise() {
  local child="" rc started delay=1 stopping=0 now_restart=0
  mkdir -p "$SW_RUN" "$SW_LOG"
  exec 9>"$SW_RUN/supervisor.lock"
  if ! flock -n 9; then spillway_log "a supervisor already runs"; return 0; fi
  echo "$$" >"$SW_RUN/supervisor.pid"
  trap 'stopping=1; spillway_term "$child"' TERM INT
  trap 'now_restart=1; spillway_term "$child"' HUP
  while [ "$stopping" = 0 ]; do
    started=$SECONDS
    # a clean environment: the sidecar's own file, nothing of the platform's or the recipe's
    # shellcheck disable=SC2016  # expanded by the inner shell
    env -i PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
      HOME="$SW_VAR" LANG=C.UTF-8 \
      bash -c 'set -a; . "$1"; set +a; exec "$2" serve --config "$3"' \
      spillway "$SW_ENV" "$SW_OPT/bin/spillway" "$SW_CONF" \
      >>"$SW_LOG/sidecar.log" 2>&1 9>&- &
    child=$!
    echo "$child" >"$SW_RUN/sidecar.pid"
    rc=0
    wait "$child" || rc=$?
    while kill -0 "$child" 2>/dev/null; do wait "$child" || rc=$?; done  # woken by a trap
    child=""
    [ "$stopping" = 1 ] && break
    if [ -f "$SW_RUN/restart" ]; then rm -f "$SW_RUN/restart"; now_restart=1; fi
    if [ "$now_restart" = 1 ]; then now_restart=0; delay=1; continue; fi
    [ $((SECONDS - started)) -ge 60 ] && delay=1
    spillway_log "sidecar exited (status $rc); starting it again in ${delay} s"
    sleep "$delay" & wait $! || true
    delay=$((delay * 2 > 30 ? 30 : delay * 2))
  done
  rm -f "$SW_RUN/supervisor.pid" "$SW_RUN/sidecar.pid"
}

spillway_start_loop() {
  local restart="$1" self="$SW_OPT/libexec/spillway-node.sh" old born="" \
    deadline=$((SECONDS + 60)) killed_at=$((SECONDS + ${SW_STOP_TIMEOUT:-30}))
  mkdir -p "$SW_OPT/libexec"
  spillway_write "$self" 0755 <"${BASH_SOURCE[0]}" >/dev/null
  if spillway_loop_running; then
    if [ -n "$restart" ]; then
      spillway_log "restart loop: restarting the sidecar (new wheels or configuration)"
      old="$(cat "$SW_RUN/sidecar.pid" 2>/dev/null || true)"
      : >"$SW_RUN/restart"
      born="$(spillway_started "$old")" && kill -TERM "$old" 2>/dev/null
      # SERVING must come from the new sidecar: wait for the old one to be gone (SIGKILL after
      # SW_STOP_TIMEOUT s, as the loop's own stop does)
      while [ -n "$born" ] && [ "$(spillway_started "$old")" = "$born" ]; do
        if [ "$SECONDS" -ge "$killed_at" ]; then
          spillway_log "the sidecar (pid $old) did not stop within ${SW_STOP_TIMEOUT:-30} s of SIGTERM: its threads' stacks go to its log, then SIGKILL"
          kill -USR1 "$old" 2>/dev/null; sleep 1; kill -KILL "$old" 2>/dev/null
          killed_at=$deadline
        fi
        [ "$SECONDS" -ge "$deadline" ] && spillway_die "the sidecar (pid $old) did not stop"
        sleep 0.2
      done
    else
      spillway_log "restart loop: already running (pid $(cat "$SW_RUN/supervisor.pid"))"
    fi
    return 0
  fi
  SPILLWAY_ROOT="$SW_ROOT" setsid "$self" supervise \
    >>"$SW_LOG/supervisor.log" 2>&1 </dev/null &
  spillway_log "restart loop: started (log $SW_LOG/supervisor.log)"
}

spillway_stop_loop() {
  local pid deadline=$((SECONDS + 30))
  [ -f "$SW_RUN/supervisor.pid" ] || return 0
  pid="$(cat "$SW_RUN/supervisor.pid")"
  kill -TERM "$pid" 2>/dev/null || return 0
  while kill -0 "$pid" 2>/dev/null; do
    [ "$SECONDS" -ge "$deadline" ] && { kill -KILL -- "-$pid" 2>/dev/null; break; }
    sleep 0.2
  done
}

# deploy/systemd/spillway.service for USER and GROUP, its paths under SPILLWAY_ROOT
spillway_unit() {
  local template
  template="$(spillway_companion spillway.service)"
  sed -e "s/^User=.*/User=$1/" -e "s/^Group=.*/Group=$2/" \
      -e "s#/opt/spillway/#$SW_OPT/#g" -e "s#/etc/spillway/#$SW_ETC/#g" "$template"
}

spillway_start_systemd() {
  local restart="$1" user="${SPILLWAY_USER:-spillway}" unit unit_changed
  if [ "$user" != root ] && ! id "$user" >/dev/null 2>&1; then
    useradd --system --home-dir "$SW_VAR" --no-create-home --shell /usr/sbin/nologin "$user"
  fi
  if [ -n "${SPILLWAY_SOCKET_GROUP:-}" ] && [ "$user" != root ]; then
    usermod -a -G "$SPILLWAY_SOCKET_GROUP" "$user"
  fi
  chown -R "$user:" "$SW_VAR"
  unit="$(spillway_unit "$user" "$(id -gn "$user")")"
  unit_changed="$(printf '%s\n' "$unit" | spillway_write "$SW_UNIT" 0644)"
  systemctl daemon-reload
  systemctl enable spillway.service >/dev/null 2>&1
  if [ -n "$restart" ] || [ "$unit_changed" = changed ]; then
    systemctl restart spillway.service
  else
    systemctl start spillway.service
  fi
}

# --- the recipe ---------------------------------------------------------------------------------

spillway_check_settings() {
  [ -n "${SPILLWAY_WHEELHOUSE:-}" ] || spillway_die "SPILLWAY_WHEELHOUSE is not set (a local directory of wheels)"
  [ -d "$SPILLWAY_WHEELHOUSE" ] || spillway_die "SPILLWAY_WHEELHOUSE=$SPILLWAY_WHEELHOUSE is not a directory"
  compgen -G "$SPILLWAY_WHEELHOUSE/spillway_sidecar-*.whl" >/dev/null ||
    spillway_die "SPILLWAY_WHEELHOUSE=$SPILLWAY_WHEELHOUSE has no spillway_sidecar wheel"
  case "${SPILLWAY_EXECUTOR_TRANSPORT:-socket}" in
    socket) ;;
    node) spillway_cluster_mode ||
            spillway_die "SPILLWAY_EXECUTOR_TRANSPORT=node needs SPILLWAY_TLS_DIR (TLS on the node address)" ;;
    *) spillway_die "SPILLWAY_EXECUTOR_TRANSPORT=$SPILLWAY_EXECUTOR_TRANSPORT: expected socket or node" ;;
  esac
  if [ "${SPILLWAY_NODE_ADDRESS:-}" = fqdn ]; then  # one wildcard certificate for every node
    SPILLWAY_NODE_ADDRESS="$(hostname -f)"
  fi
  if spillway_cluster_mode; then
    [ -n "${SPILLWAY_NODE_ADDRESS:-}" ] ||
      spillway_die "cluster mode (SPILLWAY_TLS_DIR) needs SPILLWAY_NODE_ADDRESS"
    [ -n "${SPILLWAY_HOME_ALLOWED_ADDRESSES:-}" ] ||
      spillway_die "cluster mode (SPILLWAY_TLS_DIR) needs SPILLWAY_HOME_ALLOWED_ADDRESSES (e.g. 10.0.0.0/8:$SW_PORT)"
  fi
  if [ -n "${SPILLWAY_EXTRA_PROPERTIES:-}" ] && [ ! -f "$SPILLWAY_EXTRA_PROPERTIES" ]; then
    spillway_die "SPILLWAY_EXTRA_PROPERTIES=$SPILLWAY_EXTRA_PROPERTIES: no such file"
  fi
  SW_SUPERVISOR="$(spillway_supervisor_kind)"
}

spillway_node_install() {
  SW_RESTART=""
  spillway_paths
  spillway_check_settings
  spillway_install_sidecar
  spillway_install_executor_python
  spillway_write_config
  if [ "$SW_SUPERVISOR" = systemd ]; then
    spillway_start_systemd "$SW_RESTART"
  else
    spillway_start_loop "$SW_RESTART"
  fi
  spillway_wait_healthy
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  spillway_paths
  case "${1:-}" in
    install) spillway_node_install ;;
    supervise) spillway_supervise ;;
    stop) spillway_stop_loop ;;
    health) spillway_health ;;
    *) echo "usage: $0 install|supervise|stop|health" >&2; exit 2 ;;
  esac
fi
