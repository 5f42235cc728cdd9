#!/usr/bin/env bash
# torchtitan-style launcher:
#   CONFIG_FILE=train_configs/X.toml NGPU=2 ./run_train.sh [--section.key value ...]
#   NGPU=2 ./run_train.sh --job.config_file train_configs/X.toml [...]   (the same)
# NGPU = processes on this machine (GPUs, or CPU ranks on gloo when no GPU is visible).
#   Unset: 2 when 2 or more GPUs are visible, 1 with one GPU, 2 CPU ranks without a GPU.
#   More than the visible GPUs: refused before torchrun starts.
# CONFIG_FILE unset: the CoLA + BTP TP2 debug config (debug_cola_btp_tp2.toml) for 2 or
#   more ranks, its one-process twin (debug_cola.toml) for NGPU=1.
# RUN_TRAIN_PRINT_ONLY=1: print the trainer's arguments, the chosen NGPU, CONFIG_FILE and
#   GPU count, then exit
#   (no torchrun). BOOST_TITAN_VISIBLE_GPUS=N stands in for the GPU count (tests).
# MAX_RESTARTS = times torchrun restarts the ranks after one dies (they resume from the
#   newest complete checkpoint); SHUTDOWN_TIMEOUT = seconds the ranks get, after SIGTERM,
#   to finish their step and save a checkpoint before SIGKILL.
# SIGTERM (e.g. SLURM preemption) to this script, to torchrun or to the ranks: the ranks
# save a checkpoint of the current step and the script exits 0 (README: "When things go
# wrong").
# Several machines (docs/multi-node.md): on every node, with the same arguments,
#   NNODES=2 RDZV_ENDPOINT=node0:29500 NGPU=8 ./run_train.sh ...
# (torchrun --nnodes NNODES, c10d rendezvous at RDZV_ENDPOINT, RDZV_ID the job's name).
# Before torchrun starts, the config is checked once, in one process, for NGPU x NNODES
# ranks (boost_titan.train.launch_check): a bad value is one line and exit status 2.
# BOOST_TITAN_PRECHECK=0 skips that (the ranks still check it).
set -euo pipefail
cd "$(dirname "$0")"

# --job.config_file on the command line (torchtitan users' habit) is CONFIG_FILE: the
# ranks take the first --job.config_file they see, this script's, so a second one was
# silently ignored and the default config trained. Both given and different: refused.
args=()
cli_config=""
while (( $# )); do
  case "$1" in
    --job.config_file)
      if (( $# < 2 )); then echo "run_train.sh: --job.config_file needs a path" >&2; exit 2; fi
      cli_config=$2
      shift 2
      ;;
    --job.config_file=*) cli_config=${1#*=}; shift ;;
    *) args+=("$1"); shift ;;
  esac
done
set -- ${args[@]+"${args[@]}"}
if [[ -n "$cli_config" ]]; then
  if [[ -n "${CONFIG_FILE:-}" ]] && [[ "$(realpath -m "$CONFIG_FILE")" != "$(realpath -m "$cli_config")" ]]; then
    echo "run_train.sh: CONFIG_FILE=$CONFIG_FILE and --job.config_file $cli_config name" \
      "different configs; give one of them" >&2
    exit 2
  fi
  CONFIG_FILE=$cli_config
fi

export LOG_RANK=${LOG_RANK:-0}
TRAIN_FILE=${TRAIN_FILE:-boost_titan.train}
MAX_RESTARTS=${MAX_RESTARTS:-0}
SHUTDOWN_TIMEOUT=${SHUTDOWN_TIMEOUT:-120}
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python; fi
fi

# GPUs the ranks will see: none without an NVIDIA driver (nvidia-smi ships with it: a
# CPU machine pays no torch import here), else what torch counts (CUDA_VISIBLE_DEVICES
# honoured; a CPU-only torch build counts 0)
visible_gpus() {
  if [[ -n "${BOOST_TITAN_VISIBLE_GPUS:-}" ]]; then
    echo "$BOOST_TITAN_VISIBLE_GPUS"
  elif ! command -v nvidia-smi >/dev/null 2>&1; then
    echo 0
  else
    "$PYTHON" -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)'
  fi
}
GPUS=$(visible_gpus)
if ! [[ "$GPUS" =~ ^[0-9]+$ ]]; then
  echo "run_train.sh: could not count the visible GPUs (got '$GPUS'); set NGPU" >&2
  exit 2
fi
if [[ -z "${NGPU:-}" ]]; then
  if (( GPUS == 1 )); then NGPU=1; else NGPU=2; fi  # 0 GPUs: 2 CPU ranks on gloo
  echo "run_train.sh: NGPU=$NGPU ($GPUS GPU(s) visible; set NGPU to choose)"
fi
if ! [[ "$NGPU" =~ ^[1-9][0-9]*$ ]]; then
  echo "run_train.sh: NGPU must be a positive integer, got '$NGPU'" >&2
  exit 2
fi
if (( GPUS > 0 && NGPU > GPUS )); then
  echo "run_train.sh: NGPU=$NGPU needs $NGPU GPUs but $GPUS visible (one rank per GPU);" \
    "set NGPU=$GPUS or fewer with a CONFIG_FILE whose parallel degrees multiply to it" \
    "(one GPU: CONFIG_FILE=train_configs/debug_cola.toml NGPU=1)" >&2
  exit 2
fi
NNODES=${NNODES:-1}
if ! [[ "$NNODES" =~ ^[1-9][0-9]*$ ]]; then
  echo "run_train.sh: NNODES must be a positive integer, got '$NNODES'" >&2
  exit 2
fi
if (( NNODES > 1 )) && ! [[ "${RDZV_ENDPOINT:-}" =~ ^[^:]+:[1-9][0-9]*$ ]]; then
  echo "run_train.sh: NNODES=$NNODES needs RDZV_ENDPOINT=HOST:PORT (the first node's" \
    "address and a free port, the same on every node), got '${RDZV_ENDPOINT:-}'" >&2
  exit 2
fi
RDZV_ENDPOINT=${RDZV_ENDPOINT:-localhost:0}
RDZV_ID=${RDZV_ID:-boost_titan}
if [[ -z "${CONFIG_FILE:-}" ]]; then
  if (( NGPU == 1 )); then
    CONFIG_FILE=./train_configs/debug_cola.toml
  else
    CONFIG_FILE=./train_configs/debug_cola_btp_tp2.toml
  fi
fi
if [[ "${RUN_TRAIN_PRINT_ONLY:-0}" == 1 ]]; then
  echo "ARGS=$*"
  echo "NGPU=$NGPU CONFIG_FILE=$CONFIG_FILE GPUS=$GPUS"
  exit 0
fi

# every rank would fail on a bad config, each with its own report: check it here, once
if [[ "${BOOST_TITAN_PRECHECK:-1}" != 0 ]]; then
  rc=0
  HF_DATASETS_OFFLINE=${HF_DATASETS_OFFLINE:-1} "$PYTHON" -m boost_titan.train.launch_check \
    $(( NGPU * NNODES )) --job.config_file "$CONFIG_FILE" "$@" || rc=$?
  if (( rc != 0 )); then
    if (( NNODES > 1 )); then  # the error's NGPU means all ranks; here NGPU is per node
      echo "run_train.sh: WORLD_SIZE $(( NGPU * NNODES )) = NGPU $NGPU per node x NNODES $NNODES" >&2
    fi
    exit "$rc"
  fi
fi

# torchrun gives every process 1 thread when NGPU > 1: CPU ranks get their share of the
# cores instead (set OMP_NUM_THREADS yourself to override)
if [[ -z "${OMP_NUM_THREADS:-}" ]]; then
  cores=$(nproc 2>/dev/null || echo 1)
  export OMP_NUM_THREADS=$(( cores / NGPU > 0 ? cores / NGPU : 1 ))
fi

# rank 0 writes "preempted step=N checkpoint=PATH" here once a preemption checkpoint is saved
export BOOST_TITAN_STATUS_FILE
BOOST_TITAN_STATUS_FILE=$(mktemp "${TMPDIR:-/tmp}/boost_titan_status.XXXXXX")
export BOOST_TITAN_LAUNCHER_PID=$$
if [[ "$MAX_RESTARTS" != 0 ]]; then
  # torchrun's shared rendezvous TCPStore keeps the previous attempt's process-group keys:
  # restarted ranks then connect to dead peers (pytorch#135712, #167288). Unshared, worker
  # rank 0 hosts a fresh store on every attempt.
  export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
fi
trap 'rm -f "$BOOST_TITAN_STATUS_FILE"' EXIT

PYTORCH_ALLOC_CONF=${PYTORCH_ALLOC_CONF:-expandable_segments:True} \
HF_DATASETS_OFFLINE=${HF_DATASETS_OFFLINE:-1} \
"$PYTHON" -m boost_titan.train.torchrun --nnodes="$NNODES" --nproc_per_node="$NGPU" \
  --rdzv_id "$RDZV_ID" --rdzv_backend c10d --rdzv_endpoint="$RDZV_ENDPOINT" \
  --max-restarts "$MAX_RESTARTS" --shutdown-timeout "$SHUTDOWN_TIMEOUT" \
  --local-ranks-filter "$LOG_RANK" --role rank --tee 3 \
  -m "$TRAIN_FILE" --job.config_file "$CONFIG_FILE" "$@" &
launcher=$!
# torchrun runs in the background so that a SIGTERM to this script is forwarded at once
# (bash runs traps only between foreground commands)
trap 'kill -TERM "$launcher" 2>/dev/null || true' TERM
rc=0
while true; do
  wait "$launcher" && rc=0 || rc=$?
  kill -0 "$launcher" 2>/dev/null || break  # wait also returns when a trapped signal arrives
done
if [[ $rc -ne 0 ]] && grep -q '^preempted' "$BOOST_TITAN_STATUS_FILE"; then
  echo "run_train.sh: $(cat "$BOOST_TITAN_STATUS_FILE"); exiting 0 (rerun the same command to resume)"
  rc=0
elif [[ $rc -ne 0 ]] && grep -q '^failed: ' "$BOOST_TITAN_STATUS_FILE"; then
  # a failure the ranks explained in one line (a damaged checkpoint, a data position, a full
  # disk): torchrun's report left out (boost_titan/train/torchrun.py), the line repeated last
  echo "run_train.sh: $(sed -n 's/^failed: //p' "$BOOST_TITAN_STATUS_FILE")" >&2
fi
exit "$rc"
