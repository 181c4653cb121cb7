#!/usr/bin/env bash
# Starts Docker's daemon if none answers, and waits for it (at most DOCKERD_WAIT seconds, 60 by default).
# For CI and for the container tier on a machine like CI's: root, Debian's `docker.io` (apt), no bridge and
# no iptables rules (`--iptables=false --bridge=none`), so containers run with `--network host` or in
# another container's network namespace (`--network container:NAME`, as a pod's containers share one).
# Installs docker.io from apt when dockerd is missing and this is root. Idempotent: a daemon that already
# answers is left as it is. Its log: /var/log/streamwarden-dockerd.log.
set -euo pipefail
wait_s="${DOCKERD_WAIT:-60}"
log=/var/log/streamwarden-dockerd.log
# Debian's client (/usr/bin/docker) before any other on PATH: it matches the daemon's API version.
docker=/usr/bin/docker
[ -x "$docker" ] || docker="$(command -v docker || true)"
if [ -n "$docker" ] && "$docker" info >/dev/null 2>&1; then
  echo "dockerd: already running"
  exit 0
fi
if ! command -v dockerd >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "dockerd: installing docker.io (apt)"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker.io >/dev/null
    docker=/usr/bin/docker
  else
    echo "dockerd: no dockerd, and not root to install docker.io" >&2
    exit 1
  fi
fi
if [ "$(id -u)" != 0 ]; then
  echo "dockerd: not running, and starting it needs root" >&2
  exit 1
fi
echo "dockerd: starting (log: $log)"
# setsid: the daemon outlives this script and the shell that ran it; nohup keeps it off the terminal.
setsid nohup dockerd --iptables=false --bridge=none >>"$log" 2>&1 </dev/null &
pid=$!
deadline=$(( $(date +%s) + wait_s ))
until "$docker" info >/dev/null 2>&1; do
  if ! kill -0 "$pid" 2>/dev/null; then
    echo "dockerd: exited while starting; the end of $log:" >&2
    tail -n 20 "$log" >&2
    exit 1
  fi
  if [ "$(date +%s)" -ge "$deadline" ]; then
    echo "dockerd: not answering after ${wait_s}s; the end of $log:" >&2
    tail -n 20 "$log" >&2
    exit 1
  fi
  sleep 0.5
done
echo "dockerd: running (pid $pid, $("$docker" info --format '{{.Driver}}, cgroup v{{.CgroupVersion}}'))"
