#!/usr/bin/env bash
# torchft replica groups on SLURM (docs/fault-tolerance.md, "Replica groups (torchft)"):
# the lighthouse on the first node, one replica group per NODES_PER_GROUP nodes (each its
# own torchrun over its nodes, its own rendezvous on its first node), TORCHFT_LIGHTHOUSE
# exported to every group. A group that dies leaves the others training; resubmitting
# it, or MAX_RESTARTS, brings it back from a live group.
#   sbatch --nodes=4 --gpus-per-node=8 recipes/slurm_replicas.sh recipes/cola_llama2_7b.toml [--key value ...]
#   NODES_PER_GROUP=2 MIN_REPLICAS=2 sbatch --nodes=8 recipes/slurm_replicas.sh ...  (4 groups of 2 nodes)
# Environment: GPUS_PER_NODE (8), NODES_PER_GROUP (1), MIN_REPLICAS (1: live groups a step
# needs), LIGHTHOUSE_PORT (29510), RDZV_PORT (29500), JOIN_TIMEOUT_MS (5000), MAX_RESTARTS
# (3, per group: torchrun restarts a group's ranks, which then recover from a live group),
# LOG_DIR (replicas_<job id>: one log per group), PYTHON, LIGHTHOUSE (torchft_lighthouse).
#SBATCH --job-name=boost_titan_ft
#SBATCH --ntasks-per-node=1
#SBATCH --exclusive
#SBATCH --signal=TERM@300
set -euo pipefail
CONFIG_FILE=${1:?usage: slurm_replicas.sh CONFIG_FILE [overrides...]}; shift
for arg in "$CONFIG_FILE" "$@"; do
  case "$arg" in
    --job.config_file|--job.config_file=*)
      echo "slurm_replicas.sh: give the config as the first argument, not as --job.config_file" >&2
      exit 2 ;;
    --fault_tolerance.enable|--fault_tolerance.group_size*|--fault_tolerance.replica_id*|--fault_tolerance.min_replica_size*)
      echo "slurm_replicas.sh: $arg is this script's to set (NODES_PER_GROUP, MIN_REPLICAS)" >&2
      exit 2 ;;
  esac
done
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
NODES_PER_GROUP=${NODES_PER_GROUP:-1}
MIN_REPLICAS=${MIN_REPLICAS:-1}
LIGHTHOUSE_PORT=${LIGHTHOUSE_PORT:-29510}
RDZV_PORT=${RDZV_PORT:-29500}
PYTHON=${PYTHON:-python}
LIGHTHOUSE=${LIGHTHOUSE:-torchft_lighthouse}
LOG_DIR=${LOG_DIR:-replicas_${SLURM_JOB_ID}}
mapfile -t nodes < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
if (( ${#nodes[@]} == 0 )); then
  echo "slurm_replicas.sh: scontrol show hostnames '$SLURM_JOB_NODELIST' named no node" >&2
  exit 2
fi
if ! [[ "$NODES_PER_GROUP" =~ ^[1-9][0-9]*$ ]] || (( ${#nodes[@]} % NODES_PER_GROUP )); then
  echo "slurm_replicas.sh: NODES_PER_GROUP=$NODES_PER_GROUP must divide the job's" \
    "${#nodes[@]} nodes" >&2
  exit 2
fi
groups=$(( ${#nodes[@]} / NODES_PER_GROUP ))
if ! [[ "$MIN_REPLICAS" =~ ^[0-9]+$ ]] || (( MIN_REPLICAS < 1 || MIN_REPLICAS > groups )); then
  echo "slurm_replicas.sh: MIN_REPLICAS=$MIN_REPLICAS must be in 1..$groups (the groups)" >&2
  exit 2
fi
ft() {  # the [fault_tolerance] options of group $1
  echo --fault_tolerance.enable --fault_tolerance.group_size "$groups" \
    --fault_tolerance.replica_id "$1" --fault_tolerance.min_replica_size "$MIN_REPLICAS"
}

# the lighthouse: on this (the first) node, for the whole job
# (--min_replicas 1: MIN_REPLICAS is each group's min_replica_size, which decides whether
# a step is applied; a quorum short of the lighthouse's minimum fails the waiting groups)
"$LIGHTHOUSE" --min_replicas 1 --bind "[::]:$LIGHTHOUSE_PORT" \
  --join_timeout_ms "${JOIN_TIMEOUT_MS:-5000}" &
lighthouse=$!
trap 'kill "$lighthouse" 2>/dev/null || true' EXIT
export TORCHFT_LIGHTHOUSE="http://${nodes[0]}:$LIGHTHOUSE_PORT"
for _ in $(seq 100); do  # up within 20 s (the config check below needs it)
  if (exec 3<>"/dev/tcp/${nodes[0]}/$LIGHTHOUSE_PORT") 2>/dev/null; then break; fi
  kill -0 "$lighthouse" 2>/dev/null || { echo "slurm_replicas.sh: $LIGHTHOUSE exited" >&2; exit 1; }
  sleep 0.2
done

# one group's config, checked once here (its lighthouse included) before any node starts
if [[ "${BOOST_TITAN_PRECHECK:-1}" != 0 ]]; then
  rc=0
  # shellcheck disable=SC2046  # ft's words
  "$PYTHON" -m boost_titan.train.launch_check $(( GPUS_PER_NODE * NODES_PER_GROUP )) \
    --job.config_file "$CONFIG_FILE" "$@" $(ft 0) || rc=$?
  if (( rc != 0 )); then
    echo "slurm_replicas.sh: WORLD_SIZE $(( GPUS_PER_NODE * NODES_PER_GROUP )) per group =" \
      "GPUS_PER_NODE $GPUS_PER_NODE x NODES_PER_GROUP $NODES_PER_GROUP" >&2
    exit "$rc"
  fi
fi

export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1  # restarts: slurm_train.sh's reason
mkdir -p "$LOG_DIR"
pids=()
for (( g = 0; g < groups; g++ )); do
  members=("${nodes[@]:g*NODES_PER_GROUP:NODES_PER_GROUP}")
  list=$(IFS=,; echo "${members[*]}")
  # shellcheck disable=SC2046
  srun --nodes "$NODES_PER_GROUP" --ntasks "$NODES_PER_GROUP" --ntasks-per-node 1 \
    --nodelist "$list" --exact --output "$LOG_DIR/replica_$g.log" \
    "$PYTHON" -m torch.distributed.run \
    --nnodes "$NODES_PER_GROUP" --nproc_per_node "$GPUS_PER_NODE" \
    --rdzv_id "${SLURM_JOB_ID}_replica_$g" --rdzv_backend c10d \
    --rdzv_endpoint "${members[0]}:$RDZV_PORT" \
    --max-restarts "${MAX_RESTARTS:-3}" --shutdown-timeout "${SHUTDOWN_TIMEOUT:-240}" \
    --local-ranks-filter "${LOG_RANK:-0}" --role rank --tee 3 \
    -m boost_titan.train --job.config_file "$CONFIG_FILE" "$@" $(ft "$g") &
  pids+=($!)
done
echo "slurm_replicas.sh: lighthouse $TORCHFT_LIGHTHOUSE; $groups group(s) of $NODES_PER_GROUP" \
  "node(s) x $GPUS_PER_NODE; logs $LOG_DIR/replica_<i>.log"
# preemption: every group gets SIGTERM (srun passes it to the ranks: group 0 saves)
trap 'kill -TERM "${pids[@]}" 2>/dev/null || true' TERM
status=0
for (( g = 0; g < groups; g++ )); do
  rc=0
  while true; do
    wait "${pids[g]}" && rc=0 || rc=$?
    kill -0 "${pids[g]}" 2>/dev/null || break  # (wait also returns on a trapped signal)
  done
  if (( rc != 0 )); then
    echo "slurm_replicas.sh: replica group $g exited with status $rc (log: $LOG_DIR/replica_$g.log)" >&2
    status=1
  fi
done
exit "$status"
