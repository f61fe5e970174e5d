#!/usr/bin/env bash
# promtool for tests/deploy/test_monitoring.py (the alert rules and the dashboard's queries,
# checked offline): the one binary of Debian's package `prometheus`, fetched with
# `apt-get download` and unpacked into DEST_DIR (`make venv`: the venv's bin). Nothing is
# installed system-wide and no Prometheus server is set up or started. Exits non-zero, saying
# why, where it cannot; the tests then skip with a note (and fail under CI=true).
set -euo pipefail
dest=${1:?usage: scripts/install-promtool.sh DEST_DIR}
for cmd in apt-get dpkg-deb; do
  command -v "$cmd" >/dev/null || { echo "install-promtool: no $cmd here" >&2; exit 1; }
done
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
chmod 0755 "$tmp"   # apt's download user writes here when run as root
fetch() { (cd "$tmp" && apt-get download -qq prometheus >/dev/null 2>&1); }
# a machine whose package lists were never fetched knows no package yet: fetch them (root only)
fetch || { [ "$(id -u)" = 0 ] && apt-get update -qq >/dev/null && fetch; } || {
  echo "install-promtool: apt-get download prometheus failed" >&2; exit 1; }
debs=("$tmp"/prometheus_*.deb)
dpkg-deb --fsys-tarfile "${debs[0]}" | tar -xO ./usr/bin/promtool > "$dest/promtool.part"
chmod 0755 "$dest/promtool.part"
"$dest/promtool.part" --version >/dev/null
mv "$dest/promtool.part" "$dest/promtool"
