#!/usr/bin/env bash
# Stop the one-machine cluster of setup_cluster.sh: its jobs, then slurmd, slurmctld and munged, each by
# the pid in its pid file (waiting up to 30 s for each to exit). The packages and the config stay.
set -uo pipefail
if command -v scancel >/dev/null && [ -s /run/slurmctld.pid ] && kill -0 "$(cat /run/slurmctld.pid)" 2>/dev/null; then
  scancel --full --quiet --user "$(id -un)" 2>/dev/null
  for _ in $(seq 60); do [ -z "$(squeue -h 2>/dev/null)" ] && break; sleep 0.5; done   # their steps end first
fi
for pidfile in /run/slurmd.pid /run/slurmctld.pid /run/munge/munged.pid; do
  [ -s "$pidfile" ] || continue
  pid=$(cat "$pidfile")
  kill "$pid" 2>/dev/null || continue
  for _ in $(seq 300); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
  kill -0 "$pid" 2>/dev/null && echo "teardown_cluster.sh: error: pid $pid ($pidfile) still running after 30 s" >&2 && exit 1
done
exit 0
