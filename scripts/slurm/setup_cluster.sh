#!/usr/bin/env bash
# A one-machine Slurm cluster from Debian's packages: one controller and one compute node (this host, its
# CPUs and memory as `slurmd -C` reports them), munge for authentication, daemons started directly (no
# systemd needed). Idempotent: a second run installs nothing, keeps the config and starts only what is not
# running. Needs root. For tests and trying the sbatch templates here; a real cluster has its own admins.
# Stop it with scripts/slurm/teardown_cluster.sh.
set -euo pipefail
die() { echo "setup_cluster.sh: error: $*" >&2; exit 1; }
[ "$(id -u)" = 0 ] || die "needs root (it installs packages and starts munged, slurmctld, slurmd)"

# 1. packages (Debian 12 ships Slurm 22.05): controller, node daemon, client commands, munge
if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v sbatch >/dev/null \
   || ! command -v munged >/dev/null; then
  command -v apt-get >/dev/null || die "no apt-get: install slurmctld, slurmd, slurm-client and munge by hand"
  apt-get update -qq || die "apt-get update failed"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurmctld slurmd slurm-client munge >/dev/null \
    || die "apt-get install slurmctld slurmd slurm-client munge failed"
fi

# 2. munge key (the packages may ship one; otherwise make it), owned by the munge user
mkdir -p /etc/munge /var/log/munge /var/lib/munge /run/munge
[ -s /etc/munge/munge.key ] || dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
chown -R munge:munge /etc/munge /var/log/munge /var/lib/munge /run/munge
chmod 0400 /etc/munge/munge.key

# 3. slurm.conf: this host as controller and only node. Root runs the daemons (no slurm-user file
# permissions to get right); linuxproc/none plugins need no cgroups (containers often lack them).
# JobRequeue=1 lets a preempted job (scontrol requeue, Lightning's SIGUSR1 handler) run again.
host=$(hostname -s)
node=$(slurmd -C | head -1)                   # "NodeName=HOST CPUs=2 ... RealMemory=M"
[[ $node == NodeName=* ]] || die "slurmd -C printed no node line: $node"
mkdir -p /etc/slurm /var/lib/slurm/slurmctld /var/lib/slurm/slurmd /var/log/slurm
conf=$(cat <<EOF
# written by lit-ess scripts/slurm/setup_cluster.sh
ClusterName=litess
SlurmctldHost=$host
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
ReturnToService=2
JobRequeue=1
KillWait=30
StateSaveLocation=/var/lib/slurm/slurmctld
SlurmdSpoolDir=/var/lib/slurm/slurmd
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
$node State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
)
if [ "$(cat /etc/slurm/slurm.conf 2>/dev/null)" != "$conf" ]; then
  printf '%s\n' "$conf" > /etc/slurm/slurm.conf
  changed=1
fi

# 4. daemons, each started unless its pid file names a live process
running() { [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }
running /run/munge/munged.pid || runuser -u munge -- munged || die "munged did not start (see /var/log/munge/munged.log)"
if [ -n "${changed:-}" ]; then              # a new config: restart what runs on the old one
  for pidfile in /run/slurmd.pid /run/slurmctld.pid; do
    running $pidfile || continue
    kill "$(cat $pidfile)"
    for _ in $(seq 100); do running $pidfile || break; sleep 0.1; done
    running $pidfile && die "$(basename $pidfile .pid) (pid $(cat $pidfile)) did not stop for the new slurm.conf"
  done
fi
running /run/slurmctld.pid || slurmctld || die "slurmctld did not start (see /var/log/slurm/slurmctld.log)"
running /run/slurmd.pid || slurmd || die "slurmd did not start (see /var/log/slurm/slurmd.log)"

# 5. wait (bounded) for the node to take jobs
for _ in $(seq 60); do
  state=$(sinfo -h -n "$host" -o %t 2>/dev/null || true)
  case $state in idle*|mix*|alloc*) echo "slurm: node $host $state ($(sinfo -V))"; exit 0;; esac
  sleep 1
done
die "node $host not ready after 60 s (sinfo state '${state:-none}'; see /var/log/slurm/)"
