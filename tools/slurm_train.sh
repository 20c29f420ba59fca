#!/bin/bash
# fnmoe training on several nodes under SLURM: one torchrun agent per node, which starts one process
# per GPU; the agents meet at a c10d rendezvous on the job's first node. The mesh must cover every
# process: nodes x processes per node = mesh.fsdp x mesh.ep.
#
#   sbatch --nodes 2 tools/slurm_train.sh --config configs/tiny.toml --mesh.fsdp 2 --mesh.ep 8
#
# Environment: NPROC_PER_NODE (default: the node's GPUs, else 1), RDZV_PORT (default 29500),
# MAX_RESTARTS (default 0; torchrun restarts every process after a failure: pass --resume auto and
# --checkpoint.every N so they continue from the newest checkpoint).
#
# Stopping: SLURM sends this script (B:, the batch shell alone) SIGUSR1 300 s before the time limit;
# the script passes it to srun, which passes it to each node's task, which passes it to every
# worker (torchrun itself ignores it: its default would end it at once and orphan the workers).
# The workers agree on a step, save one checkpoint and exit 0, so torchrun neither reports a
# failure nor restarts them, and the job ends COMPLETED; `--resume auto` continues it. SIGTERM,
# SIGHUP and SIGINT to this script do the same. Give the save more time with
# `sbatch --signal=B:USR1@600 ...`. A signal may reach a worker twice (SLURM can signal every
# process of a job step itself): within 2 s that is one request, later a second one aborts the save.
#SBATCH --job-name=fnmoe
#SBATCH --ntasks-per-node=1
#SBATCH --exclusive
#SBATCH --signal=B:USR1@300
set -euo pipefail

nproc=${NPROC_PER_NODE:-${SLURM_GPUS_ON_NODE:-1}}
# sed reads the whole list: `head -n 1` would exit after one line, and a longer list written after
# that would end scontrol with SIGPIPE, which pipefail makes the script's failure (exit 141)
head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p)
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

# One node's task: torchrun, started with SIGUSR1 ignored (its workers set their own handlers), and
# SIGUSR1 to this task passed on to torchrun's children, the workers; its exit status is torchrun's.
node_task='
trap "" USR1
torchrun "$@" &
agent=$!
trap "pkill -USR1 -P \"\$agent\" || true" USR1
while :; do
    status=0
    wait "$agent" || status=$?
    kill -0 "$agent" 2>/dev/null || break
done
exit "$status"
'

srun bash -c "$node_task" fnmoe-node \
    --nnodes "$SLURM_JOB_NUM_NODES" --nproc-per-node "$nproc" \
    --rdzv-backend c10d --rdzv-endpoint "$head_node:${RDZV_PORT:-29500}" --rdzv-id "$SLURM_JOB_ID" \
    --max-restarts "${MAX_RESTARTS:-0}" \
    -m fnmoe train "$@" &
step=$!

forward() {
    echo "slurm_train.sh: $1: asking every worker to stop after the step in progress and save" >&2
    kill -USR1 "$step" 2>/dev/null || true
}
for sig in USR1 TERM HUP INT; do
    trap "forward SIG$sig" "$sig"
done
# bash runs a trap only between commands, and `wait` returns when one ran: wait until srun ends
while :; do
    status=0
    wait "$step" || status=$?
    kill -0 "$step" 2>/dev/null || break
done
exit "$status"
