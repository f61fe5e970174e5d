#!/bin/sh
# TEST certificates and tokens: for the docker-compose demo stack (its one-shot `certs` service
# runs this into the `spillway-tls` volume at start-up) and for trying TLS on one host
# (docs/SECURITY.md, "Single host, step by step"). Never for production: the CA is created here
# and its key thrown away; nothing secret is in the repository.
#
#   gen-test-certs.sh OUT_DIR          (sh deploy/gen-test-certs.sh /tmp/spillway-tls)
#
# OUT_DIR/ca.pem                      the CA bundle (every party verifies the others with it)
# OUT_DIR/sidecar/tls.crt, tls.key    the sidecar's certificate, names from SIDECAR_SAN
#                                     (default DNS:sidecar,DNS:localhost,IP:127.0.0.1)
# OUT_DIR/sidecar/node.token          the node token (auth.token.file)
# OUT_DIR/sidecar/admin.token         the operator token (auth.admin.token.file, spillway status)
# OUT_DIR/spark/tls.crt, tls.key      the Spark driver's and executors' client certificate
# OUT_DIR/spark/node.token            the same node token, for the Spark side
# Files are mode 0400 and owned by whoever runs this. Only with CHOWN_CERTS=1 (the compose
# `certs` service sets it; needs root) does sidecar/ go to uid SIDECAR_UID (10001) and spark/ to
# SPARK_UID (185), the users of the compose images.
# An existing OUT_DIR/ca.pem means OUT_DIR is already provisioned: nothing is changed.
set -eu

out=${1:?usage: gen-test-certs.sh OUT_DIR}
sidecar_uid=${SIDECAR_UID:-10001}
spark_uid=${SPARK_UID:-185}
days=${CERT_DAYS:-30}
sidecar_san=${SIDECAR_SAN:-DNS:sidecar,DNS:localhost,IP:127.0.0.1}
chown_certs=${CHOWN_CERTS:-0}

case "$chown_certs" in
    0|"") chown_certs=0 ;;
    1)
        if [ "$(id -u)" != 0 ]; then
            echo "gen-test-certs: CHOWN_CERTS=1 hands the files to uids $sidecar_uid and" \
                 "$spark_uid and needs root; run without it to keep them yours" >&2
            exit 2
        fi ;;
    *) echo "gen-test-certs: CHOWN_CERTS must be 0 or 1, got '$chown_certs'" >&2; exit 2 ;;
esac

if [ -s "$out/ca.pem" ]; then
    echo "gen-test-certs: $out already holds certificates"
    exit 0
fi
umask 077
mkdir -p "$out"
out=$(cd "$out" && pwd)  # absolute: the work below happens in a temporary directory
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cd "$work"

ec() { openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$1" 2>/dev/null; }

ec ca.key
openssl req -x509 -new -key ca.key -sha256 -days "$days" -subj "/CN=spillway-compose-test-ca" \
    -addext "basicConstraints=critical,CA:TRUE" \
    -addext "keyUsage=critical,keyCertSign,cRLSign" -out ca.pem

leaf() {  # name, subjectAltName
    ec "$1.key"
    openssl req -new -key "$1.key" -subj "/CN=$1" -out "$1.csr"
    printf 'subjectAltName=%s\nbasicConstraints=critical,CA:FALSE\nextendedKeyUsage=serverAuth,clientAuth\n' \
        "$2" > "$1.ext"
    openssl x509 -req -in "$1.csr" -CA ca.pem -CAkey ca.key -CAcreateserial -sha256 \
        -days "$days" -extfile "$1.ext" -out "$1.crt" 2>/dev/null
}
leaf sidecar "$sidecar_san"
leaf spark "DNS:spark-client"
token=$(openssl rand -hex 32)
admin=$(openssl rand -hex 32)

for who in sidecar spark; do
    mkdir -p "$out/$who"
    cp "$who.crt" "$out/$who/tls.crt"
    cp "$who.key" "$out/$who/tls.key"
    printf '%s\n' "$token" > "$out/$who/node.token"
    chmod 0400 "$out/$who/tls.crt" "$out/$who/tls.key" "$out/$who/node.token"
    if [ "$who" = sidecar ]; then
        printf '%s\n' "$admin" > "$out/$who/admin.token"
        chmod 0400 "$out/$who/admin.token"
    fi
    chmod 0500 "$out/$who"
done
if [ "$chown_certs" = 1 ]; then
    chown -R "$sidecar_uid:$sidecar_uid" "$out/sidecar"
    chown -R "$spark_uid:$spark_uid" "$out/spark"
fi
chmod 0755 "$out"
cp ca.pem "$out/ca.pem.tmp"
chmod 0444 "$out/ca.pem.tmp"
mv "$out/ca.pem.tmp" "$out/ca.pem"  # last: marks the volume as provisioned
echo "gen-test-certs: test CA, certificates and node token written to $out"
