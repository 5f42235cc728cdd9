#!/usr/bin/env bash
# Multi-node launcher (SLURM + torchrun, NCCL).
#   sbatch --nodes=4 --gpus-per-node=8 recipes/slurm_train.sh recipes/cola_llama2_7b.toml [--key value ...]
#SBATCH --job-name=boost_titan
#SBATCH --ntasks-per-node=1
#SBATCH --exclusive
#SBATCH --signal=TERM@300
# Faults (README "When things go wrong"): a dead rank -> torchrun restarts all ranks (up to
# MAX_RESTARTS) from the newest complete checkpoint; SIGTERM (preemption, 300 s before the
# time limit) -> every rank saves a checkpoint of its current step and exits 0; submit with
# --requeue (or resubmit) to resume.
set -euo pipefail
CONFIG_FILE=${1:?usage: slurm_train.sh CONFIG_FILE [overrides...]}; shift
# the ranks take the first --job.config_file they see (this script's): another one among
# the overrides would be silently ignored
for arg in "$CONFIG_FILE" "$@"; do
  if [[ "$arg" == --job.config_file || "$arg" == --job.config_file=* ]]; then
    echo "slurm_train.sh: give the config as the first argument" \
      "(slurm_train.sh CONFIG_FILE [overrides...]), not as --job.config_file" >&2
    exit 2
  fi
done
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
# the first node hosts the rendezvous (not `| head -n 1`: head exits after one line, and
# under pipefail scontrol's SIGPIPE on a longer list ended the script)
nodes=$(scontrol show hostnames "$SLURM_JOB_NODELIST")
head_node=${nodes%%$'\n'*}
if [[ -z "$head_node" ]]; then
  echo "slurm_train.sh: scontrol show hostnames '$SLURM_JOB_NODELIST' named no node" >&2
  exit 2
fi
PYTHON=${PYTHON:-python}
MAX_RESTARTS=${MAX_RESTARTS:-3}
RDZV_PORT=${RDZV_PORT:-29500}  # a free port on the first node
# every rank of every node would fail on a bad config: check it here, once, before the
# nodes start (boost_titan.train.launch_check: one line, exit 2); BOOST_TITAN_PRECHECK=0 skips
if [[ "${BOOST_TITAN_PRECHECK:-1}" != 0 ]]; then
  rc=0
  "$PYTHON" -m boost_titan.train.launch_check $(( GPUS_PER_NODE * SLURM_NNODES )) \
    --job.config_file "$CONFIG_FILE" "$@" || rc=$?
  if (( rc != 0 )); then
    echo "slurm_train.sh: WORLD_SIZE $(( GPUS_PER_NODE * SLURM_NNODES )) =" \
      "GPUS_PER_NODE $GPUS_PER_NODE x SLURM_NNODES $SLURM_NNODES" >&2
    exit "$rc"
  fi
fi
# restarted ranks must not read the previous attempt's keys from torchrun's shared store
# (pytorch#135712, #167288)
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
# one torchrun agent per node (--ntasks-per-node=1); each node's local rank LOG_RANK
# prints, its lines prefixed [rankN]
srun "$PYTHON" -m torch.distributed.run \
  --nnodes "$SLURM_NNODES" --nproc_per_node "$GPUS_PER_NODE" \
  --rdzv_id "$SLURM_JOB_ID" --rdzv_backend c10d --rdzv_endpoint "$head_node:$RDZV_PORT" \
  --max-restarts "$MAX_RESTARTS" --shutdown-timeout "${SHUTDOWN_TIMEOUT:-240}" \
  --local-ranks-filter "${LOG_RANK:-0}" --role rank --tee 3 \
  -m boost_titan.train --job.config_file "$CONFIG_FILE" "$@"
