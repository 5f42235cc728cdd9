#!/usr/bin/env bash
# Multi-node launcher (SLURM + torchrun, NCCL).
#   sbatch --nodes=4 --gpus-per-node=8 recipes/slurm_train.sh recipes/cola_llama2_7b.toml [--key value ...]
#SBATCH --job-name=boost_titan
#SBATCH --ntasks-per-node=1
#SBATCH --exclusive
set -euo pipefail
CONFIG_FILE=${1:?usage: slurm_train.sh CONFIG_FILE [overrides...]}; shift
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
PYTHON=${PYTHON:-python}
srun "$PYTHON" -m torch.distributed.run \
  --nnodes "$SLURM_NNODES" --nproc_per_node "$GPUS_PER_NODE" \
  --rdzv_id "$SLURM_JOB_ID" --rdzv_backend c10d --rdzv_endpoint "$head_node:29500" \
  -m boost_titan.train --job.config_file "$CONFIG_FILE" "$@"
