#!/usr/bin/env bash
# A real two-node SLURM cluster on this one machine, for tests of slurm/*.sbatch:
#   scripts/slurm_local_cluster.sh start DIR [BASE_PORT]   # writes DIR/slurm.conf, prints `export SLURM_CONF=...`
#   scripts/slurm_local_cluster.sh stop DIR                # kills the daemons it started (by pid), nothing else
# Nodes n1 and n2 (1 CPU each) share this machine's hostname and 127.0.0.1; slurmctld listens on BASE_PORT,
# the nodes on BASE_PORT+1 and +2. Everything (munge key and socket, state, spool, logs, pid files) lives
# under DIR, so it touches no system daemon. Needs root (SlurmUser=root) and the Debian packages slurm-wlm
# and munge; installs nothing. The only system change: "127.0.0.1 n1 n2" in /etc/hosts if the names don't
# resolve (scripts use the first node name as the rendezvous address, as on a real cluster).
set -euo pipefail

die() { echo "slurm_local_cluster: $*" >&2; exit 2; }

cmd="${1:-}"
dir="${2:-}"
if [[ "$cmd" != start && "$cmd" != stop ]] || [[ -z "$dir" ]]; then die "usage: $0 start|stop DIR [BASE_PORT]"; fi

stop() {
  local f pid
  # slurmd before slurmctld so nodes don't report to a dead controller; munged last (the others use it)
  for f in slurmd-n1.pid slurmd-n2.pid slurmctld.pid munged.pid; do
    [[ -f "$dir/$f" ]] || continue
    pid="$(<"$dir/$f")"
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$pid" 2>/dev/null || true
    rm -f "$dir/$f"
  done
}

if [[ "$cmd" == stop ]]; then
  stop
  exit 0
fi

base="${3:-17000}"
[[ "$(id -u)" == 0 ]] || die "needs root (SlurmUser=root; jobs run as the submitting user)"
for tool in munged slurmctld slurmd sbatch scontrol sinfo; do
  command -v "$tool" >/dev/null || die "$tool not found: apt-get install -y slurm-wlm munge"
done
mkdir -p "$dir"
dir="$(cd "$dir" && pwd)"
chmod 700 "$dir"  # munged refuses a key or socket directory others can write to
mkdir -p "$dir/state" "$dir/spool" "$dir/log"

# --- munge: a private daemon with its own key and socket ---------------------------------------------
head -c 1024 /dev/urandom >"$dir/munge.key"
chmod 400 "$dir/munge.key"
munged --force --key-file="$dir/munge.key" --socket="$dir/munge.socket" --pid-file="$dir/munged.pid" \
  --log-file="$dir/log/munged.log" --seed-file="$dir/munged.seed"
for _ in $(seq 50); do [[ -S "$dir/munge.socket" ]] && break; sleep 0.1; done
munge -S "$dir/munge.socket" -n | unmunge -S "$dir/munge.socket" >/dev/null || die "munge self-test failed (see $dir/log/munged.log)"

# --- names: the first node of an allocation is the rendezvous host ---------------------------------------
if ! getent hosts n1 >/dev/null || ! getent hosts n2 >/dev/null; then
  echo "127.0.0.1 n1 n2" >>/etc/hosts
fi

host="$(hostname -s)"
cat >"$dir/slurm.conf" <<EOF
ClusterName=zerotune-local
SlurmctldHost=$host
SlurmctldPort=$base
SlurmUser=root
AuthType=auth/munge
CredType=cred/munge
# cred_expire also sets how long a requeued job waits before it may start again (default 120 s)
AuthInfo=socket=$dir/munge.socket,cred_expire=10
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
MpiDefault=none
# a requeued job starts as soon as it is eligible, not at the next 30 s backfill pass
SchedulerParameters=bf_interval=1
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
JobRequeue=1
ReturnToService=2
StateSaveLocation=$dir/state
SlurmctldPidFile=$dir/slurmctld.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdSpoolDir=$dir/spool/%n
SlurmdPidFile=$dir/slurmd-%n.pid
SlurmdLogFile=$dir/log/slurmd-%n.log
NodeName=n1 NodeHostname=$host NodeAddr=127.0.0.1 Port=$((base + 1)) CPUs=1 RealMemory=10000
NodeName=n2 NodeHostname=$host NodeAddr=127.0.0.1 Port=$((base + 2)) CPUs=1 RealMemory=10000
PartitionName=debug Nodes=n1,n2 Default=YES MaxTime=INFINITE State=UP
EOF
export SLURM_CONF="$dir/slurm.conf"

slurmctld -f "$SLURM_CONF" -i  # -i: ignore saved state from an earlier cluster in DIR
slurmd -f "$SLURM_CONF" -N n1
slurmd -f "$SLURM_CONF" -N n2
for _ in $(seq 300); do
  if [[ "$(sinfo -h -N -t idle -o %N 2>/dev/null | sort -u | wc -l)" == 2 ]]; then
    echo "export SLURM_CONF=$SLURM_CONF"
    exit 0
  fi
  sleep 0.2
done
sinfo -N >&2 || true
stop
die "nodes did not become idle in 60 s (logs in $dir/log)"
