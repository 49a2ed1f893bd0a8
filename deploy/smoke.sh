#!/usr/bin/env bash
# A real container run of docker-compose.yml: builds the images (make images), brings the CPU profile up on
# host networking bound to loopback (deploy/compose/host-network.yml), sends a chat request through the
# gateway, restarts the worker container and checks that a request after it still works, kills the scheduler's
# process (SIGKILL from the host, as a crash or the OOM killer would) and waits for Docker to restart it; then
# two replicas on host networking (replicas.yml + replicas-host-network.yml): stops each scheduler in turn and
# checks the gateway still answers. Takes everything down (volumes too). Prints build times, image sizes, time
# to healthy, each recovery time and the replies.
#   deploy/smoke.sh                   # environment: BASE_IMAGE, TORCH_SPEC, TORCH_INDEX, CA_BUNDLE (see Makefile)
# Exits non-zero on any failure, and (2) where no Docker engine or compose v2 is available.
set -euo pipefail
cd "$(dirname "$0")/.."

no_engine() {
  cat >&2 <<'HOW'
deploy/smoke.sh needs a running Docker engine and Docker Compose v2. On Debian:
  apt-get update && apt-get install -y docker.io debootstrap
  # without bridge networking (containers here use the host's network, loopback only):
  echo '{"bridge": "none", "iptables": false, "ip6tables": false}' > /etc/docker/daemon.json
  dockerd &                          # or: systemctl start docker
  # compose v2 (Debian trixie's docker-compose package ships it as a CLI plugin):
  #   ~/.docker/cli-plugins/docker-compose  (docker compose version: 2.x)
  # where no registry is reachable, a base image from Debian's mirror:
  deploy/docker/make-base-image.sh   # then BASE_IMAGE=steploop/base:bookworm deploy/smoke.sh
HOW
  exit 2
}
docker info >/dev/null 2>&1 || { echo "no Docker engine answers (docker info failed)" >&2; no_engine; }
docker compose version >/dev/null 2>&1 || { echo "no Docker Compose v2 (docker compose)" >&2; no_engine; }

now() { date +%s.%N; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN {printf "%.1f", b - a}'; }
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

export BASE_IMAGE="${BASE_IMAGE:-python:3.11-slim}"
if ! docker image inspect "$BASE_IMAGE" >/dev/null 2>&1 && ! docker pull -q "$BASE_IMAGE" >/dev/null 2>&1; then
  echo "base image $BASE_IMAGE not available and not pullable: making steploop/base:bookworm (debootstrap)"
  deploy/docker/make-base-image.sh steploop/base:bookworm
  BASE_IMAGE=steploop/base:bookworm
fi
# The classic builder with the host's network (no bridge networks here; buildx may be absent).
export DOCKER_BUILDKIT="${DOCKER_BUILDKIT:-0}"
build=(make --no-print-directory DOCKER_BUILD="docker build --network host -q" BASE_IMAGE="$BASE_IMAGE"
       CA_BUNDLE="${CA_BUNDLE:-}")
[ -n "${TORCH_SPEC:-}" ] && build+=(TORCH_SPEC="$TORCH_SPEC")
[ -n "${TORCH_INDEX+x}" ] && build+=(TORCH_INDEX="$TORCH_INDEX")
# SMOKE_SKIP_BUILD=1: run the images already built (make images) as they are.
[ -n "${SMOKE_SKIP_BUILD:-}" ] && echo "using the images already built (SMOKE_SKIP_BUILD)"
for image in scheduler worker-cpu model gateway; do
  [ -n "${SMOKE_SKIP_BUILD:-}" ] && continue
  start=$(now)
  "${build[@]}" "image-$image" >/dev/null
  size=$(docker image inspect -f '{{.Size}}' "steploop/$image:$(sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)")
  echo "build steploop/$image: $(since "$start") s, $((size / 1000000)) MB"
done

tag="$(sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)"
for image in scheduler worker-cpu model gateway; do
  echo "image steploop/$image:$tag: $(( $(docker image inspect -f '{{.Size}}' "steploop/$image:$tag") / 1000000 )) MB"
done

work="$(mktemp -d /tmp/steploop-smoke.XXXXXX)"
project="steploop-smoke-$$"
export STEPLOOP_CERTS="$work/certs" COMPOSE_PROFILES=cpu
deploy/make-certs.sh "$STEPLOOP_CERTS" >/dev/null
export STEPLOOP_API_KEY="$(cat "$STEPLOOP_CERTS/api-key")"
export STEPLOOP_PUBLISH_PORT="$(free_port)" STEPLOOP_SCHEDULER_PORT="$(free_port)" STEPLOOP_SCHEDULER_2_PORT="$(free_port)"
compose=(docker compose -p "$project" -f docker-compose.yml -f deploy/compose/host-network.yml)
single=("${compose[@]}")
down() {
  status=$?
  if [ "$status" -ne 0 ]; then "${compose[@]}" logs --no-color --tail 40 >&2 || true; fi
  "${compose[@]}" down -v --remove-orphans >/dev/null 2>&1 || true
  rm -rf "$work"
  echo "down (exit $status)"
}
trap down EXIT
url="http://127.0.0.1:$STEPLOOP_PUBLISH_PORT"

wait_healthy() {   # seconds; gateway /health 200 (a scheduler serving, its worker attached)
  local deadline=$(( $(date +%s) + $1 ))
  until curl -fsS "$url/health" >/dev/null 2>&1; do
    [ "$(date +%s)" -lt "$deadline" ] || { echo "not healthy within $1 s" >&2; return 1; }
    sleep 1
  done
}
chat() {
  curl -fsS "$url/v1/chat/completions" -H "Authorization: Bearer $STEPLOOP_API_KEY" \
    -H 'Content-Type: application/json' \
    -d '{"model": "SmolLM2-135M-Instruct", "temperature": 0, "max_tokens": 24,
         "messages": [{"role": "user", "content": "What is the capital of France?"}]}' |
    python3 -c 'import json, sys; print(json.load(sys.stdin)["choices"][0]["message"]["content"])'
}

start=$(now)
"${compose[@]}" up -d --no-build --quiet-pull 2>&1 | grep -v '^\s*$' || true
wait_healthy 600
echo "time to healthy (up -> gateway /health 200): $(since "$start") s"
echo "health: $(docker ps --filter "label=com.docker.compose.project=$project" --format '{{.Names}}={{.Status}}' | tr '\n' ' ')"
code=$(curl -s -o /dev/null -w '%{http_code}' "$url/v1/models")
[ "$code" = 401 ] || { echo "expected 401 without the API key, got $code" >&2; exit 1; }
echo "without the API key: HTTP $code"
start=$(now)
reply="$(chat)"
echo "chat reply ($(since "$start") s): $reply"

start=$(now)
"${compose[@]}" restart worker >/dev/null
sleep 1
wait_healthy 300
echo "worker restarted, healthy again after $(since "$start") s"
start=$(now)
reply="$(chat)"
echo "chat reply after the worker restart ($(since "$start") s): $reply"

# A crash, not an operator's stop: `docker kill` counts as a stop under every restart policy (never restarted);
# a process killed from the host is what a crash or the OOM killer looks like to Docker.
scheduler_id="$("${compose[@]}" ps -q scheduler)"
restarts() { docker inspect -f '{{.RestartCount}}' "$scheduler_id"; }
before="$(restarts)"
start=$(now)
kill -KILL "$(docker inspect -f '{{.State.Pid}}' "$scheduler_id")"
deadline=$(( $(date +%s) + 60 ))
until [ "$(restarts)" -gt "$before" ]; do   # Docker noticed the death and started it again
  [ "$(date +%s)" -lt "$deadline" ] || { echo "the scheduler was not restarted within 60 s" >&2; exit 1; }
  sleep 0.2
done
echo "scheduler SIGKILLed: restarted by Docker after $(since "$start") s"
wait_healthy 300
until [ "$(docker inspect -f '{{.State.Health.Status}}' "$scheduler_id")" = healthy ]; do
  [ "$(date +%s)" -lt $(( deadline + 300 )) ] || { echo "the scheduler is not healthy again" >&2; exit 1; }
  sleep 1
done
echo "scheduler healthy again (its worker re-attached) after $(since "$start") s"
reply="$(chat)"
echo "chat reply after the scheduler crash: $reply"

# Two replicas on host networking; each scheduler stopped in turn, the gateway routes to the other.
"${compose[@]}" down -v --remove-orphans >/dev/null 2>&1
compose=("${single[@]}" -f deploy/compose/replicas.yml -f deploy/compose/replicas-host-network.yml)
start=$(now)
"${compose[@]}" up -d --no-build --quiet-pull 2>&1 | grep -v '^\s*$' || true
wait_healthy 600
wait_container_healthy() {   # service seconds
  local deadline=$(( $(date +%s) + $2 ))
  until [ "$(docker inspect -f '{{.State.Health.Status}}' "$("${compose[@]}" ps -q "$1")")" = healthy ]; do
    [ "$(date +%s)" -lt "$deadline" ] || { echo "$1 not healthy within $2 s" >&2; return 1; }
    sleep 1
  done
}
wait_container_healthy scheduler 600
wait_container_healthy scheduler-2 600
echo "two replicas healthy after $(since "$start") s: $(docker ps --filter "label=com.docker.compose.project=$project" \
  --format '{{.Names}}={{.Status}}' | tr '\n' ' ')"
for victim in scheduler scheduler-2; do
  "${compose[@]}" stop "$victim" >/dev/null
  start=$(now)
  reply="$(chat)"
  echo "$victim stopped: chat reply through the other replica ($(since "$start") s): $reply"
  "${compose[@]}" start "$victim" >/dev/null
  wait_container_healthy "$victim" 300
done
echo "smoke passed"
