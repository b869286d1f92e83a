#!/usr/bin/env bash
# A Docker daemon for the scripts that need one (image builds, the kind e2e): started only where none answers,
# and stopped only by the script that started it. A daemon someone else runs is used as it is and never touched.
#
#   bash scripts/docker.sh start    # a daemon answers afterwards; exit 0 (prints what it did on stderr)
#   bash scripts/docker.sh stop     # stops the daemon `start` started (its pid file), and nothing else
#   bash scripts/docker.sh status   # who runs the daemon that answers: "ours", "theirs" or "none"
#
# Where none answers: installs Debian's docker.io if dockerd is missing (apt-get, as root), then starts dockerd in
# the background with a config file, pid file and log of its own under $PARATRAIN_DOCKER_STATE (default
# /run/paratrain-docker); the machine's /etc/docker/daemon.json is left alone.
# Where the capability bounding set (CapBnd in /proc/self/status) lacks capabilities the kernel has, as in some
# sandboxes (seen: CAP_SYS_RESOURCE), privileged containers such as kind's nodes fail with "unable to apply caps";
# there, and only there, the daemon's default runtime is a wrapper around runc that removes those capabilities
# from each container's OCI spec first (scripts/runc-drop-caps.py).
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
STATE="${PARATRAIN_DOCKER_STATE:-/run/paratrain-docker}"
PIDFILE="$STATE/dockerd.pid"

log() { printf 'docker.sh: %s\n' "$*" >&2; }

answers() { docker info >/dev/null 2>&1; }

ours() { [[ -f "$PIDFILE" ]] && kill -0 "$(cat "$PIDFILE")" 2>/dev/null; }

missing_caps() {  # capability numbers the kernel has and this process's bounding set lacks, space-separated
  local bounding last cap out=()
  bounding=$((16#$(awk '/^CapBnd:/ {print $2}' /proc/self/status)))
  last=$(cat /proc/sys/kernel/cap_last_cap)
  for ((cap = 0; cap <= last; cap++)); do
    (( (bounding >> cap) & 1 )) || out+=("$cap")
  done
  echo "${out[*]}"
}

start() {
  if answers; then
    log "a Docker daemon already answers ($(status)); using it as it is"
    return 0
  fi
  if ! command -v dockerd >/dev/null; then
    log "installing Debian's docker.io (dockerd is missing)"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker.io >/dev/null
  fi
  command -v docker >/dev/null || { log "no docker client after installing docker.io"; exit 2; }
  mkdir -p "$STATE"
  local missing config="$STATE/daemon.json"
  missing="$(missing_caps)"
  if [[ -n "$missing" ]]; then
    log "the capability bounding set lacks capabilities ${missing// /, } (by number):" \
      "containers run through a runc wrapper that drops them"
    # A runtime of the daemon's own: a copy of the wrapper and a launcher with its settings, both under $STATE, so
    # nothing the daemon runs refers back into this checkout.
    cp "$HERE/runc-drop-caps.py" "$STATE/runc-drop-caps.py"
    printf '#!/bin/bash\nexec python3 %q --runc=%q --drop=%q "$@"\n' \
      "$STATE/runc-drop-caps.py" "$(command -v runc)" "${missing// /,}" > "$STATE/runc"
    chmod 755 "$STATE/runc"
    printf '{"runtimes": {"paratrain-runc": {"path": "%s"}}, "default-runtime": "paratrain-runc"}\n' \
      "$STATE/runc" > "$config"
  else
    echo '{}' > "$config"
  fi
  log "starting dockerd (log: $STATE/dockerd.log)"
  setsid dockerd --config-file "$config" --pidfile "$PIDFILE" >"$STATE/dockerd.log" 2>&1 < /dev/null &
  local deadline=$((SECONDS + 60))
  until answers; do
    if (( SECONDS > deadline )) || ! kill -0 $! 2>/dev/null; then
      log "dockerd did not answer within 60 s; the end of its log:"
      tail -n 20 "$STATE/dockerd.log" >&2
      exit 1
    fi
    sleep 1
  done
  log "dockerd answers (pid $(cat "$PIDFILE"))"
}

stop() {
  if ! ours; then
    log "no daemon of ours to stop"
    return 0
  fi
  local pid
  pid="$(cat "$PIDFILE")"
  kill -TERM "$pid"
  for _ in $(seq 60); do
    kill -0 "$pid" 2>/dev/null || break
    sleep 1
  done
  if kill -0 "$pid" 2>/dev/null; then
    log "dockerd (pid $pid) still running after 60 s; killing it"
    kill -KILL "$pid"
  fi
  rm -f "$PIDFILE"
  log "stopped dockerd (pid $pid)"
}

status() {
  if ours; then echo ours; elif answers; then echo theirs; else echo none; fi
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  status) status ;;
  *) echo "usage: $0 start|stop|status" >&2; exit 2 ;;
esac
