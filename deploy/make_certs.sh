#!/usr/bin/env bash
# A development certificate authority and one certificate per pdserve role,
# for a local or test cluster (Kubernetes: see deploy/ for Secrets made the
# same way). Idempotent: an existing CA is kept, and so are certificates it
# signed that are not about to expire.
#
#   deploy/make_certs.sh [DIR]        (default: ${PDSERVE_CERTS_DIR:-/tmp/pdserve-certs})
#
# Writes DIR/ca.pem (the cluster CA: every service trusts it), DIR/ca.key,
# and for each role in router, prefill, decode: DIR/ROLE.pem (its
# certificate, with the CA after it) and DIR/ROLE.key; and DIR/kv_grant.key,
# the KV handoff grant key of the router and the decode workers. A role's
# certificate names it as the DNS name ROLE.pdserve.internal, which is how
# services check each other's role (router/README: "TLS"); it also holds
# localhost, 127.0.0.1 and ::1 so that clients on this machine can check
# the router by the address they dial, and the Kubernetes Service names
# pdserve-ROLE, pdserve-ROLE.NS, pdserve-ROLE.NS.svc and
# pdserve-ROLE.NS.svc.cluster.local (NS: $PDSERVE_K8S_NAMESPACE, default
# pdserve, deploy/k8s) so that clients in a cluster can check the router by
# its Service name. Keys are ECDSA P-256; certificates last 30 days; keys
# are readable by their owner only, and a directory the script makes is
# too (0700). A directory another user owns is refused: its owner could
# replace what is written there (a CA of its own for ca.pem).
set -euo pipefail
DIR=${1:-${PDSERVE_CERTS_DIR:-/tmp/pdserve-certs}}
DAYS=30
NS=${PDSERVE_K8S_NAMESPACE:-pdserve}
umask 077
mkdir -p "$DIR"
if [[ ! -O "$DIR" ]]; then
  echo "make_certs.sh: $DIR is owned by another user ($(stat -c %U "$DIR")); refusing to write keys into it" >&2
  exit 1
fi

if [[ ! -s "$DIR/ca.pem" || ! -s "$DIR/ca.key" ]]; then
  openssl ecparam -name prime256v1 -genkey -noout -out "$DIR/ca.key"
  openssl req -x509 -new -key "$DIR/ca.key" -sha256 -days 3650 -subj "/O=pdserve/CN=pdserve development CA" \
    -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" \
    -out "$DIR/ca.pem" 2>/dev/null
  rm -f "$DIR"/router.pem "$DIR"/prefill.pem "$DIR"/decode.pem
fi

for role in router prefill decode; do
  service=pdserve-$role
  # Kept while it verifies against this CA, has a day left and names this
  # namespace's Service.
  if [[ -s "$DIR/$role.pem" && -s "$DIR/$role.key" ]] &&
     openssl verify -CAfile "$DIR/ca.pem" "$DIR/$role.pem" > /dev/null 2>&1 &&
     openssl x509 -checkend 86400 -noout -in "$DIR/$role.pem" > /dev/null 2>&1 &&
     openssl x509 -noout -ext subjectAltName -in "$DIR/$role.pem" 2>/dev/null |
       grep -q "DNS:$service.$NS.svc.cluster.local"; then
    continue
  fi
  openssl ecparam -name prime256v1 -genkey -noout -out "$DIR/$role.key.new"
  openssl req -new -key "$DIR/$role.key.new" -subj "/O=pdserve/OU=$role/CN=$role.pdserve.internal" \
    -out "$DIR/$role.csr" 2>/dev/null
  cat > "$DIR/$role.ext" <<EOF
basicConstraints=critical,CA:FALSE
keyUsage=critical,digitalSignature,keyEncipherment
extendedKeyUsage=serverAuth,clientAuth
subjectAltName=DNS:$role.pdserve.internal,DNS:localhost,IP:127.0.0.1,IP:::1,DNS:$service,DNS:$service.$NS,DNS:$service.$NS.svc,DNS:$service.$NS.svc.cluster.local
EOF
  openssl x509 -req -in "$DIR/$role.csr" -CA "$DIR/ca.pem" -CAkey "$DIR/ca.key" -CAcreateserial -days "$DAYS" \
    -sha256 -extfile "$DIR/$role.ext" -out "$DIR/$role.crt.new" 2>/dev/null
  cat "$DIR/$role.crt.new" "$DIR/ca.pem" > "$DIR/$role.pem.new"
  # Renamed into place, key first: a service reloading its files never sees
  # a half-written one.
  mv "$DIR/$role.key.new" "$DIR/$role.key"
  mv "$DIR/$role.pem.new" "$DIR/$role.pem"
  rm -f "$DIR/$role.csr" "$DIR/$role.ext" "$DIR/$role.crt.new"
done
chmod 644 "$DIR"/ca.pem "$DIR"/router.pem "$DIR"/prefill.pem "$DIR"/decode.pem
# The KV handoff grant key (kv_transfer/grant.h): 32 random bytes as hex,
# for the router and the decode workers only (--kv_grant_key). Kept if
# present: rotating it invalidates the grants in flight.
if [[ ! -s "$DIR/kv_grant.key" ]]; then
  openssl rand -hex 32 > "$DIR/kv_grant.key.new"
  mv "$DIR/kv_grant.key.new" "$DIR/kv_grant.key"
fi
echo "$DIR"
