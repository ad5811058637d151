#!/usr/bin/env bash
# Container smoke run: build the CPU image, bring the compose stack up (CPU override) on a small
# collection that the container's own `prepare` service builds from nothing but the data folder,
# wait for /readyz, send one /search/images and one /annotate, tear everything down (volume included)
# and record the run in docs/results/container-smoke.json. A command to run by hand, not part of CI.
#
#   bash bench/container_smoke.sh
#
# Needs a container engine with the Docker API (Docker, or `podman system service`, which this
# script starts when DOCKER_HOST is unset and podman is there) and a Compose v2 client
# (`docker compose`, or the `docker-compose` of the project's venv). First it tries the default build
# (the Dockerfile's own arguments: VARIANT=gpu, onnxruntime-gpu and faiss-gpu-cuvs with CUDA 13) and records the
# step where it stopped, if it did; then it builds the CPU image it runs. Settings (environment):
#   SMOKE_LIMIT=100          FRAGSEARCH_LIMIT of the run: images of each split prepared
#   SMOKE_PORT=18000         where the service listens (loopback)
#   SMOKE_DATA=../shared/data/flickr8k   the data folder (FRAGSEARCH_DATA_HOST of the run)
#   SMOKE_BUILD_MOUNTS=""    what the builds need from this machine, not build arguments, e.g. where
#                            only a registry mirror is reachable: "-v /etc/pip.conf:/etc/pip.conf:ro
#                            -v /etc/ssl/certs/ca-certificates.crt:/etc/ssl/certs/ca-certificates.crt:ro ..."
#   SMOKE_BUILD_ARGS=""      extra arguments of the CPU build, e.g. "--build-arg EXTRAS=milvus"
#   SMOKE_TRY_DEFAULT=1      0: skip the default-build attempt
#   SMOKE_BUILDER=podman     podman (uses --format docker, --pull=never) or docker
#   SMOKE_TIMEOUT=3600       seconds to wait for readiness
set -euo pipefail
cd "$(dirname "$0")/.."

LIMIT="${SMOKE_LIMIT:-100}"
PORT="${SMOKE_PORT:-18000}"
DATA="$(cd "${SMOKE_DATA:-../shared/data/flickr8k}" && pwd)"
BUILDER="${SMOKE_BUILDER:-podman}"
TIMEOUT="${SMOKE_TIMEOUT:-3600}"
PROJECT=fragsearch-smoke
OUT=docs/results/container-smoke.json
WORK="$(mktemp -d)"
LOG="$WORK/compose.log"
say() { echo "[$(date -u +%H:%M:%S)] $*" >&2; }
now() { date +%s.%N; }

if [ -n "${COMPOSE:-}" ]; then read -r -a compose_cmd <<< "$COMPOSE"
elif docker compose version >/dev/null 2>&1; then compose_cmd=(docker compose)
else
  venv_compose=$(ls -d "$HOME"/.cache/fragsearch/venv-*/bin/docker-compose 2>/dev/null | head -n1 || true)
  [ -n "$venv_compose" ] || { echo "no Compose v2 client (docker compose / docker-compose)" >&2; exit 2; }
  compose_cmd=("$venv_compose")
fi

service_pid=""
if [ -z "${DOCKER_HOST:-}" ] && [ "$BUILDER" = podman ]; then
  export DOCKER_HOST="unix://$WORK/podman.sock"
  podman system service --time=0 "$DOCKER_HOST" >"$WORK/podman-service.log" 2>&1 &
  service_pid=$!
  for _ in $(seq 50); do [ -S "$WORK/podman.sock" ] && break; sleep 0.2; done
fi

# the service listens on loopback only, in the host's network (no port mapping needed)
cat > "$WORK/smoke.yml" <<EOF
services:
  prepare:
    network_mode: host
  fragsearch:
    network_mode: host
    ports: !reset []
    environment:
      FRAGSEARCH_HOST: 127.0.0.1
      FRAGSEARCH_PORT: "$PORT"
EOF
compose() {
  FRAGSEARCH_DATA_HOST="$DATA" FRAGSEARCH_LIMIT="$LIMIT" FRAGSEARCH_PROGRESS_EVERY=20 \
    "${compose_cmd[@]}" -p "$PROJECT" -f docker-compose.yml -f docker-compose.cpu.yml -f "$WORK/smoke.yml" "$@"
}

cleanup() {
  say "tearing down"
  compose down -v --timeout 20 >>"$LOG" 2>&1 || true
  [ -n "$service_pid" ] && kill "$service_pid" 2>/dev/null || true
}
trap cleanup EXIT

default_rc=""
if [ "${SMOKE_TRY_DEFAULT:-1}" = 1 ]; then
  say "trying the default build (the Dockerfile's own build arguments) with $BUILDER"
  t0=$(now)
  # shellcheck disable=SC2086  # SMOKE_BUILD_MOUNTS is a list of arguments
  if [ "$BUILDER" = podman ]; then
    podman build --format docker --pull=never --network host ${SMOKE_BUILD_MOUNTS:-} -t fragsearch:gpu . \
      >"$WORK/default-build.log" 2>&1 && default_rc=0 || default_rc=$?
  else
    docker build ${SMOKE_BUILD_MOUNTS:-} -t fragsearch:gpu . >"$WORK/default-build.log" 2>&1 \
      && default_rc=0 || default_rc=$?
  fi
  default_s=$(echo "$(now) - $t0" | bc)
  say "default build: exit $default_rc after ${default_s}s; $(grep -E '^(STEP|#[0-9]+ \[)' "$WORK/default-build.log" | tail -n1 | cut -c1-120)"
fi

say "building fragsearch:cpu with $BUILDER"
t0=$(now)
# shellcheck disable=SC2086  # SMOKE_BUILD_MOUNTS and SMOKE_BUILD_ARGS are lists of arguments
if [ "$BUILDER" = podman ]; then
  podman build --format docker --pull=never --network host --build-arg VARIANT=cpu ${SMOKE_BUILD_MOUNTS:-} \
    ${SMOKE_BUILD_ARGS:-} -t fragsearch:cpu . >"$WORK/build.log" 2>&1
  size=$(podman image inspect fragsearch:cpu --format '{{.Size}}')
else
  docker build --build-arg VARIANT=cpu ${SMOKE_BUILD_ARGS:-} -t fragsearch:cpu . >"$WORK/build.log" 2>&1
  size=$(docker image inspect fragsearch:cpu --format '{{.Size}}')
fi
build_s=$(echo "$(now) - $t0" | bc)
say "built in ${build_s}s, image size $size bytes"

compose down -v >/dev/null 2>&1 || true  # nothing prepared beforehand: a fresh artifacts volume
say "compose up (the prepare service extracts, trains and indexes first)"
t_up=$(now)
compose up -d --no-build >>"$LOG" 2>&1 &
up_pid=$!
compose_logs_started=0
ready_s=""
prepare_done_s=""
deadline=$(( $(date +%s) + TIMEOUT ))
while [ "$(date +%s)" -lt "$deadline" ]; do
  if [ "$compose_logs_started" = 0 ] && compose ps -a --format '{{.Service}}' 2>/dev/null | grep -q prepare; then
    compose logs -f --no-log-prefix prepare >"$WORK/prepare.log" 2>&1 &
    compose_logs_started=1
  fi
  if [ -z "$prepare_done_s" ] && ! kill -0 "$up_pid" 2>/dev/null; then
    wait "$up_pid" || { say "compose up failed"; tail -n 40 "$LOG" "$WORK/prepare.log" >&2; exit 1; }
    prepare_done_s=$(echo "$(now) - $t_up" | bc)
    say "prepare finished after ${prepare_done_s}s; fragsearch started"
  fi
  code=$(curl -s -o "$WORK/readyz.json" -w '%{http_code}' "http://127.0.0.1:$PORT/readyz" || true)
  if [ "$code" = 200 ]; then ready_s=$(echo "$(now) - $t_up" | bc); break; fi
  grep -h "preparing" "$WORK/prepare.log" 2>/dev/null | tail -n 1 | cut -c1-200 >&2 || true
  sleep 20
done
[ -n "$ready_s" ] || { say "not ready after ${TIMEOUT}s"; tail -n 40 "$LOG" "$WORK/prepare.log" >&2; exit 1; }
say "ready ${ready_s}s after compose up: $(cat "$WORK/readyz.json")"

search_code=$(curl -s -o "$WORK/search.json" -w '%{http_code}' -H 'Content-Type: application/json' \
  -d '{"sentence": "a dog runs through the grass", "k": 5}' "http://127.0.0.1:$PORT/search/images")
image="$DATA/images/$(head -n1 "$DATA/dev.txt")"
annotate_code=$(curl -s -o "$WORK/annotate.json" -w '%{http_code}' -F "file=@$image;type=image/jpeg" -F k=5 \
  "http://127.0.0.1:$PORT/annotate")
url=$(python3 -c "import json,sys; r=json.load(open(sys.argv[1])).get('results') or [{}]; print(r[0].get('url', ''))" \
  "$WORK/search.json" 2>/dev/null || true)
file_code=$(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$PORT$url" || true)
say "/search/images $search_code (its top image's file: $file_code), /annotate $annotate_code"
health=""
if [ "$BUILDER" = podman ]; then
  cid=$(compose ps -q fragsearch)
  health=$(podman healthcheck run "$cid" >/dev/null 2>&1 && echo healthy || echo unhealthy)
fi

python3 - "$OUT" "$WORK" <<EOF
import json, platform, re, subprocess, sys
from pathlib import Path
out, work = Path(sys.argv[1]), Path(sys.argv[2])


def default_build():
    """How far the default build got: its exit status, the step it stopped at and that step's last lines."""
    if "$default_rc" == "":
        return None
    log = (work / "default-build.log").read_text(errors="replace").splitlines()
    steps = [i for i, line in enumerate(log) if re.match(r"^(STEP \\d+/\\d+|#\\d+ \\[)", line)]
    last = steps[-1] if steps else 0
    record = {"build_args": "the Dockerfile's defaults", "exit": int("$default_rc"),
              "seconds": round(float("${default_s:-0}"), 1)}
    if int("$default_rc") != 0:
        record["stopped_at"] = log[last][:300] if log else ""
        record["last_lines"] = [line[:300] for line in log[last + 1:] if line.strip()][-8:]
    return record


search = json.loads((work / "search.json").read_text() or "null")
annotate = json.loads((work / "annotate.json").read_text() or "null")
progress = [l.strip() for l in (work / "prepare.log").read_text().splitlines() if "preparing" in l]
cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "")
record = {
    "command": "bash bench/container_smoke.sh",
    "settings": {"SMOKE_LIMIT": "$LIMIT", "SMOKE_BUILD_MOUNTS": """${SMOKE_BUILD_MOUNTS:-}""",
                 "SMOKE_BUILD_ARGS": """${SMOKE_BUILD_ARGS:-}""", "builder": "$BUILDER",
                 "compose": "${compose_cmd[*]}", "data": "$DATA"},
    "machine": {"cpu": cpu, "cores": __import__("os").cpu_count(), "system": platform.platform()},
    "engine": subprocess.run(["$BUILDER", "--version"], capture_output=True, text=True).stdout.strip(),
    "default_build": default_build(),
    "image": "fragsearch:cpu", "image_bytes": int("$size"), "build_seconds": round(float("$build_s"), 1),
    "prepare_seconds": round(float("${prepare_done_s:-0}"), 1), "ready_seconds_after_up": round(float("$ready_s"), 1),
    "readyz": json.loads((work / "readyz.json").read_text()),
    "search_images": {"sentence": "a dog runs through the grass", "status": int("$search_code"),
                      "top": [(r["name"], round(r["score"], 4)) for r in (search or {}).get("results", [])[:3]],
                      "top_image_file_status": int("$file_code")},
    "annotate": {"upload": "$(basename "$image")", "status": int("$annotate_code"),
                 "top": [(r["text"], round(r["score"], 4)) for r in (annotate or {}).get("results", [])[:3]]},
    "healthcheck": "$health",
    "prepare_progress_lines": progress[:3] + (["..."] if len(progress) > 6 else []) + progress[-3:],
}
out.write_text(json.dumps(record, indent=2) + "\n")
EOF
say "recorded in $OUT"
[ "$search_code" = 200 ] && [ "$annotate_code" = 200 ]
