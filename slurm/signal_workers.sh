#!/bin/bash
# SIGUSR1 to this job's training workers on this node, and to nothing else (a `pkill -f` pattern also hits
# other jobs' workers on a shared node). slurm/finetune.sbatch runs it on every node with `srun --overlap`.
# Each worker registered its pid in PID_DIR as NODE.LOCAL_RANK.pid after installing its handler, so a
# registered worker never dies of the signal.
#   bash slurm/signal_workers.sh PID_DIR
set -uo pipefail
dir="${1:?usage: signal_workers.sh PID_DIR}"
node="${SLURMD_NODENAME:-$(hostname -s)}"
for f in "$dir/$node".*.pid; do
  [[ -f "$f" ]] || continue
  pid="$(<"$f")"
  # A finished worker's pid may have been reused: signal it only if it still carries this job's id.
  if tr '\0' '\n' <"/proc/$pid/environ" 2>/dev/null | grep -qx "SLURM_JOB_ID=$SLURM_JOB_ID"; then
    kill -USR1 "$pid" && echo "finetune: SIGUSR1 -> worker pid $pid on $node"
  fi
done
exit 0
