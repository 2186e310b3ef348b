#!/bin/sh
# A development PKI for specmesh's mTLS (docker-compose.tls.yml, deploy/k8s/overlays/mtls), and its keys:
#
#   deploy/tls/make-dev-certs.sh [DIR]          (default .tls; needs openssl)
#
#   ca.pem ca.key            the CA every service trusts (keep ca.key off the machines that serve)
#   specmesh.pem specmesh.key  one certificate for every service, server and client alike; it names
#                            specmesh-internal (what the services expect of each other, --tls-server-name),
#                            the compose and Kubernetes service names, localhost and 127.0.0.1
#   client.pem client.key    a client certificate, for curl / grpcurl against a gateway with --tls-client-auth
#   api-keys                 one API key (clients send Authorization: Bearer <key>)
#   service-key              the key the services present to each other
#
# For production use your own CA (cert-manager, Vault, ...); the file names are all that matters here.
set -eu
DIR=${1:-.tls}
DAYS=${SPECMESH_CERT_DAYS:-365}
SANS="DNS:specmesh-internal,DNS:verify,DNS:draft,DNS:gateway,DNS:specmesh-verify-headless,DNS:specmesh-draft,\
DNS:specmesh-gateway,DNS:localhost,IP:127.0.0.1"

mkdir -p "$DIR"
chmod 700 "$DIR"   # nobody else on the host lists or opens what is inside
cd "$DIR"
ext=$(mktemp)
trap 'rm -f "$ext" ./*.csr' EXIT

openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -sha256 -days "$DAYS" \
    -subj "/CN=specmesh development CA" -keyout ca.key -out ca.pem 2>/dev/null

issue() {  # name, common name, subjectAltName (empty: none)
    openssl req -new -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -subj "/CN=$2" \
        -keyout "$1.key" -out "$1.csr" 2>/dev/null
    {
        echo "basicConstraints=critical,CA:FALSE"
        echo "keyUsage=critical,digitalSignature,keyEncipherment"
        echo "extendedKeyUsage=serverAuth,clientAuth"
        [ -z "$3" ] || echo "subjectAltName=$3"
    } >"$ext"
    openssl x509 -req -in "$1.csr" -CA ca.pem -CAkey ca.key -CAcreateserial -days "$DAYS" -sha256 \
        -extfile "$ext" -out "$1.pem" 2>/dev/null
}
issue specmesh specmesh-internal "$SANS"
issue client specmesh-client ""

printf 'sk-%s\n' "$(openssl rand -hex 24)" >api-keys
printf 'svc-%s\n' "$(openssl rand -hex 24)" >service-key
# The containers run as uid 10001 and see each file through its own bind mount (compose secrets): the
# files must be readable to it; the directory (700) keeps other users of the host out.
chmod 644 ca.pem specmesh.pem specmesh.key client.pem client.key api-keys service-key
chmod 600 ca.key
rm -f ca.srl
echo "specmesh development PKI and keys in $(pwd)"
