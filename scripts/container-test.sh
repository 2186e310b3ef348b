#!/usr/bin/env bash
# The container test (`make container-test`): build the image from the Dockerfile as it is, bring up
# docker-compose.yml's verify, draft and gateway containers, answer the README's curl, a streamed chat
# request and a gRPC call through the published ports, probe every container with the image's own
# HEALTHCHECK command, and tear the stack down (on success and on failure alike).
#
#   CONTAINER_ENGINE=podman (default)  podman + podman-compose, from Debian's packages. Made to work on a
#       machine with no image registry and no systemd: the base image is built with debootstrap from
#       Debian's packages (cached in local storage), the engine uses runc with `default_ulimits = []`
#       (a containers.conf of its own, nothing system-wide is changed), the host's CA bundle is mounted
#       into the build so pip trusts the same TLS as the host, and healthchecks are run by this script
#       (podman schedules them with systemd timers otherwise).
#   CONTAINER_ENGINE=docker            Docker with the compose plugin: `docker compose build` and
#       `docker compose up --wait`, the Dockerfile's own pinned base and torch index.
#
# Knobs: SPECMESH_TORCH_WHEELS (a folder holding torch-2.13.0+cpu's wheel; used when
# download.pytorch.org cannot be resolved, default /opt/wheels), CONTAINER_TEST_TIMEOUT_S (readiness
# wait, default 600), CONTAINER_TEST_KEEP=1 (leave the stack up for a look). Logs: .work/container/.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
ENGINE=${CONTAINER_ENGINE:-podman}
WORK=$ROOT/.work/container
mkdir -p "$WORK"
PROJECT=specmesh-ct
IMAGE=localhost/specmesh:container-test
BASE_TAG=localhost/specmesh-base:bookworm-debootstrap
TIMEOUT_S=${CONTAINER_TEST_TIMEOUT_S:-600}
PY=${PYTHON:-$ROOT/.venv/bin/python}
START=$(date +%s)

log() { printf '[container-test %4ds] %s\n' "$(($(date +%s) - START))" "$*" >&2; }
die() { log "FAILED: $*"; exit 1; }
free_port() { "$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

REST_PORT=$(free_port)
GRPC_PORT=$(free_port)
# The compose file's own variables (docker-compose.yml): published ports and the image to run.
export SPECMESH_REST_PORT=$REST_PORT SPECMESH_GRPC_PORT=$GRPC_PORT SPECMESH_IMAGE=$IMAGE
unset SPECMESH_MODEL_NAME  # the served name must be the compose file's default, the README's `demo`
SERVICES=(verify draft gateway)

if [ "$ENGINE" = podman ]; then
    for tool in podman podman-compose debootstrap runc; do
        command -v "$tool" >/dev/null || die "$tool not found (Debian: apt-get install podman podman-compose runc debootstrap)"
    done
    # A configuration of our own: runc (crun's cgroup handling fails in this kind of VM) and no default
    # ulimits (podman's default nofile limit is above what the sandbox allows a container to set).
    cat >"$WORK/containers.conf" <<'EOF'
[containers]
default_ulimits = []

[engine]
runtime = "runc"
EOF
    export CONTAINERS_CONF=$WORK/containers.conf
    COMPOSE=(podman-compose -p "$PROJECT" -f docker-compose.yml)
else
    command -v docker >/dev/null || die "docker not found"
    COMPOSE=(docker compose -p "$PROJECT" -f docker-compose.yml)
fi

containers() { "$ENGINE" ps -a --filter "label=com.docker.compose.project=$PROJECT" --format '{{.Names}}'; }

teardown() {
    local rc=$?
    if [ "${CONTAINER_TEST_KEEP:-0}" = 1 ]; then
        log "CONTAINER_TEST_KEEP=1: stack left up (REST :$REST_PORT); '${COMPOSE[*]} down' ends it"
        return
    fi
    if [ "$rc" != 0 ]; then
        for c in $(containers); do
            log "--- last log lines of $c ---"
            "$ENGINE" logs --tail 40 "$c" 2>&1 | sed 's/^/    /' >&2 || true
        done
    fi
    log "tearing down"
    "${COMPOSE[@]}" down -t 5 >"$WORK/down.log" 2>&1 || true
    local left
    left=$(containers)
    if [ -n "$left" ]; then
        # shellcheck disable=SC2086
        "$ENGINE" rm -f -t 0 $left >>"$WORK/down.log" 2>&1 || true
    fi
    "$ENGINE" network rm -f "${PROJECT}_default" >>"$WORK/down.log" 2>&1 || true
    [ -z "$(containers)" ] || { log "containers left behind: $(containers)"; exit 1; }
    log "done, exit $rc"
}

# ---------------------------------------------------------------------------------------------------
# 1. The image
if [ "$ENGINE" = podman ]; then
    if ! podman image exists "$BASE_TAG"; then
        log "base image: debootstrap bookworm with python3 + venv (python at /usr/local/bin/python, as in python:3.11-slim)"
        rootfs=$WORK/rootfs
        rm -rf "$rootfs"
        debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates bookworm "$rootfs" \
            http://deb.debian.org/debian >"$WORK/debootstrap.log" 2>&1 || die "debootstrap (see $WORK/debootstrap.log)"
        ln -sf /usr/bin/python3 "$rootfs/usr/local/bin/python"
        chroot "$rootfs" apt-get clean
        rm -rf "$rootfs"/var/lib/apt/lists/*
        tar -C "$rootfs" -c . | podman import --change 'CMD ["python3"]' - "$BASE_TAG" >/dev/null
        rm -rf "$rootfs"
    fi
    # The host's trust store and pip settings for the build's RUN steps only (bind mounts are not part of
    # any layer): pip inside the build then trusts what the host trusts.
    ca=${SSL_CERT_FILE:-/etc/ssl/certs/ca-certificates.crt}
    [ -f "$ca" ] || die "no CA bundle at $ca"
    mounts=(-v "$ca:/run/specmesh-host-ca.crt:ro" -v "$WORK/pip.conf:/etc/pip.conf:ro")
    printf '[global]\ncert = /run/specmesh-host-ca.crt\n' >"$WORK/pip.conf"
    torch_index=https://download.pytorch.org/whl/cpu
    if ! getent hosts download.pytorch.org >/dev/null; then
        # PyTorch's index is out of reach: the same CPU wheel from a local folder, with PyPI for torch's
        # own dependencies (pip prefers 2.13.0+cpu there to PyPI's 2.13.0, a local version sorting higher).
        wheels=${SPECMESH_TORCH_WHEELS:-/opt/wheels}
        ls "$wheels"/torch-2.13.0+cpu-*.whl >/dev/null 2>&1 ||
            die "download.pytorch.org does not resolve and $wheels has no torch-2.13.0+cpu wheel (set SPECMESH_TORCH_WHEELS)"
        log "download.pytorch.org unreachable: torch's CPU wheel from $wheels"
        printf 'find-links = /run/specmesh-wheels\n' >>"$WORK/pip.conf"
        mounts+=(-v "$wheels:/run/specmesh-wheels:ro")
        torch_index=https://pypi.org/simple
    fi
    log "building $IMAGE from Dockerfile (log: $WORK/build.log)"
    # --format docker: the OCI image format has no HEALTHCHECK, and the image's must survive.
    podman build --format docker "${mounts[@]}" \
        --build-arg "BASE_IMAGE=$BASE_TAG" --build-arg "TORCH_INDEX_URL=$torch_index" \
        -t "$IMAGE" -f Dockerfile . >"$WORK/build.log" 2>&1 || { tail -30 "$WORK/build.log" >&2; die "podman build"; }
else
    log "building with docker compose (log: $WORK/build.log)"
    "${COMPOSE[@]}" build verify >"$WORK/build.log" 2>&1 || { tail -30 "$WORK/build.log" >&2; die "docker compose build"; }
fi
"$ENGINE" image inspect "$IMAGE" --format '{{json .Config.Healthcheck}}' | grep -q 'specmesh.healthcheck' ||
    die "the built image has no HEALTHCHECK"
log "image built"

# ---------------------------------------------------------------------------------------------------
# 2. The stack
trap teardown EXIT
trap 'exit 143' TERM INT  # killed: still tear down, and say it failed
"${COMPOSE[@]}" down -t 0 >/dev/null 2>&1 || true  # a stack a killed run left behind
log "compose up: ${SERVICES[*]} (REST :$REST_PORT, gRPC :$GRPC_PORT)"
if [ "$ENGINE" = podman ]; then
    # podman-compose starts the services in dependency order without waiting on `service_healthy`; the
    # gateway health-checks its replicas and answers 503 on /health until they are up, which we wait for.
    "${COMPOSE[@]}" up -d --no-build "${SERVICES[@]}" >"$WORK/up.log" 2>&1 || { cat "$WORK/up.log" >&2; die "compose up"; }
else
    "${COMPOSE[@]}" up -d --no-build --wait --wait-timeout "$TIMEOUT_S" "${SERVICES[@]}" >"$WORK/up.log" 2>&1 ||
        { cat "$WORK/up.log" >&2; die "compose up"; }
fi

health() { "$ENGINE" inspect "$1" --format '{{.State.Health.Status}}' 2>/dev/null || echo none; }
deadline=$(($(date +%s) + TIMEOUT_S))
while :; do
    all=healthy
    for c in $(containers); do
        # No systemd to schedule podman's healthchecks: run each container's check (docker-compose.yml's
        # healthcheck test) by hand; docker runs its own.
        [ "$ENGINE" = podman ] && podman healthcheck run "$c" >/dev/null 2>&1 || true
        [ "$(health "$c")" = healthy ] || all=no
        [ "$("$ENGINE" inspect "$c" --format '{{.State.Running}}')" = true ] || die "container $c is not running"
    done
    [ "$(containers | wc -l)" = 3 ] || die "expected 3 containers, got: $(containers | tr '\n' ' ')"
    if [ $all = healthy ] && curl -fs -o /dev/null "http://127.0.0.1:$REST_PORT/health"; then break; fi
    [ "$(date +%s)" -lt "$deadline" ] || die "the stack was not healthy within ${TIMEOUT_S}s"
    sleep 3
done
log "all three containers healthy, gateway ready"

for c in $(containers); do
    "$ENGINE" exec "$c" python -m specmesh.healthcheck --auto >/dev/null 2>&1 ||
        die "the image's HEALTHCHECK (python -m specmesh.healthcheck --auto) fails in $c"
done
log "the image's HEALTHCHECK command passes in every container"

# ---------------------------------------------------------------------------------------------------
# 3. Requests through the published ports
# The README's curl, with the published port in place of 8000.
curl -fsS "http://127.0.0.1:$REST_PORT/v1/completions" -H 'content-type: application/json' \
    -d '{"model": "demo", "prompt": "def fibonacci(n):\n", "max_tokens": 48, "temperature": 0}' >"$WORK/completion.json" ||
    die "the README's curl"
"$PY" - "$WORK/completion.json" <<'EOF' || die "the README's curl: unexpected answer (see $WORK/completion.json)"
import json, sys
body = json.load(open(sys.argv[1]))
choice = body["choices"][0]
assert body["model"] == "demo", body["model"]
assert choice["text"].strip() and choice["finish_reason"] in ("length", "stop"), choice
assert body["usage"]["completion_tokens"] > 0, body
# Whether it speculated is reported, not required: on a loaded machine the gateway may find the draft
# stalled (a cold first request) and finish target-only, which is the same text by design.
spec = body["specmesh"]
print("completion:", repr(choice["text"][:60]), "...", body["usage"], file=sys.stderr)
print(f"  rounds {spec['rounds']}, accepted {spec['accepted']} of {spec['drafted']}, target_only {spec['target_only']}",
      file=sys.stderr)
EOF

curl -fsSN "http://127.0.0.1:$REST_PORT/v1/chat/completions" -H 'content-type: application/json' \
    -d '{"model": "demo", "messages": [{"role": "user", "content": "Write a function that parses a CSV line."}],
         "max_tokens": 32, "temperature": 0, "stream": true, "stream_options": {"include_usage": true}}' \
    >"$WORK/stream.txt" || die "streamed chat request"
"$PY" - "$WORK/stream.txt" <<'EOF' || die "streamed chat: unexpected events (see $WORK/stream.txt)"
import json, sys
events = [ln[len("data: "):] for ln in open(sys.argv[1]).read().splitlines() if ln.startswith("data: ")]
assert events[-1] == "[DONE]", events[-3:]
chunks = [json.loads(e) for e in events[:-1]]
text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
finish = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
assert text.strip() and finish in (["length"], ["stop"]), (text, finish)
assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] > 0, chunks[-1]
print(f"stream: {len(chunks)} chunks, {text[:60]!r} ...", file=sys.stderr)
EOF

"$PY" - "127.0.0.1:$GRPC_PORT" <<'EOF' || die "gRPC GenerateStream through the published port"
import sys
import grpc
from specmesh.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
with grpc.insecure_channel(sys.argv[1]) as channel:
    stub = gateway_pb2_grpc.GatewayServiceStub(channel)
    request = gateway_pb2.GatewayServiceGenerateStreamRequest(
        prompt="import os\n", params=common_pb2.SamplingParams(temperature=0.0, max_tokens=16)
    )
    chunks = list(stub.GenerateStream(request, timeout=120))
assert chunks[-1].WhichOneof("chunk") == "finished" and chunks[-1].finished.usage.completion_tokens > 0, chunks[-1]
print(f"grpc: {len(chunks)} chunks", file=sys.stderr)
EOF
log "PASSED: README curl, streamed chat and gRPC answered through the published ports"
