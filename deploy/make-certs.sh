#!/usr/bin/env bash
# The TLS material for steploop's internal gRPC links (mutual TLS), and an API key, with the openssl CLI:
#   deploy/make-certs.sh [DIR] [SCHEDULER_NAME...]     (default DIR deploy/certs)
#   ca.pem/ca.key            the CA that signs every service (keep ca.key offline in production)
#   scheduler.pem/.key       server certificate (serverAuth + clientAuth: its own health probe uses it)
#                            for localhost, 127.0.0.1, scheduler, scheduler-2, engine, the Kubernetes names
#                            engine[-headless].steploop.svc(.cluster.local) and their pod names
#                            (*.engine-headless...), plus any SCHEDULER_NAME given
#   gateway.pem/.key, worker.pem/.key   client certificates (clientAuth)
#   api-key                  a random key clients send as `Authorization: Bearer <key>`
# Compose reads them from DIR as secrets; Kubernetes: deploy/k8s/README.md (kubectl create secret ...).
# Existing files are kept (delete DIR to rotate). Certificates last DAYS (default 365) days.
set -euo pipefail
dir="${1:-deploy/certs}"; shift || true
days="${DAYS:-365}"; ns="${NAMESPACE:-steploop}"
mkdir -p "$dir" && chmod 700 "$dir" && cd "$dir"
[ -f ca.pem ] || openssl req -x509 -newkey rsa:3072 -nodes -keyout ca.key -out ca.pem -days "$days" \
  -subj "/CN=steploop-ca" -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" \
  2>/dev/null

sign() {   # name, CN, extended key usage, subjectAltName
  [ -f "$1.pem" ] && return 0
  openssl req -newkey rsa:2048 -nodes -keyout "$1.key" -out "$1.csr" -subj "/CN=$2" 2>/dev/null
  printf 'basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\nextendedKeyUsage=%s\n%s\n' \
    "$3" "${4:+subjectAltName=$4}" > "$1.ext"
  openssl x509 -req -in "$1.csr" -CA ca.pem -CAkey ca.key -CAcreateserial -out "$1.pem" -days "$days" \
    -extfile "$1.ext" 2>/dev/null
  rm -f "$1.csr" "$1.ext"
}

sans="DNS:localhost,IP:127.0.0.1,DNS:scheduler,DNS:scheduler-2,DNS:engine,DNS:engine-headless"
# *.engine.NS...: a LeaderWorkerSet's leader pods (overlays/tp, pd), which its other pods dial at $LWS_LEADER_ADDRESS
sans="$sans,DNS:*.engine.$ns"
for d in "$ns.svc" "$ns.svc.cluster.local"; do
  sans="$sans,DNS:engine.$d,DNS:engine-headless.$d,DNS:*.engine-headless.$d,DNS:*.engine.$d"
done
for extra in "$@"; do sans="$sans,DNS:$extra"; done
sign scheduler steploop-scheduler serverAuth,clientAuth "$sans"
sign gateway steploop-gateway clientAuth ""
sign worker steploop-worker clientAuth ""
[ -f api-key ] || openssl rand -hex 24 > api-key
# The containers run as uid 10001 and read these through bind mounts; the folder itself stays 0700.
chmod 644 ./*.pem ./*.key api-key
chmod 600 ca.key
echo "TLS material and API key in $dir: $(ls | tr '\n' ' ')"
echo "compose: export STEPLOOP_API_KEY=\$(cat $dir/api-key)"
