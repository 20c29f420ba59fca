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
#SBATCH --job-name=fnmoe
#SBATCH --ntasks-per-node=1
#SBATCH --exclusive
set -euo pipefail

nproc=${NPROC_PER_NODE:-${SLURM_GPUS_ON_NODE:-1}}
# sed reads the whole list: `head -n 1` would exit after one line, and a longer list written after
# that would end scontrol with SIGPIPE, which pipefail makes the script's failure (exit 141)
head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p)
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

srun torchrun --nnodes "$SLURM_JOB_NUM_NODES" --nproc-per-node "$nproc" \
    --rdzv-backend c10d --rdzv-endpoint "$head_node:${RDZV_PORT:-29500}" --rdzv-id "$SLURM_JOB_ID" \
    --max-restarts "${MAX_RESTARTS:-0}" \
    -m fnmoe train "$@"
