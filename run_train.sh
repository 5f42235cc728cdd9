#!/usr/bin/env bash
# torchtitan-style launcher:
#   CONFIG_FILE=train_configs/X.toml NGPU=2 ./run_train.sh [--section.key value ...]
# NGPU = processes on this machine (GPUs, or CPU ranks on gloo when no GPU is visible).
set -euo pipefail
cd "$(dirname "$0")"

NGPU=${NGPU:-2}
export LOG_RANK=${LOG_RANK:-0}
CONFIG_FILE=${CONFIG_FILE:-./train_configs/debug_cola_btp_tp2.toml}
TRAIN_FILE=${TRAIN_FILE:-boost_titan.train}
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python; fi
fi

PYTORCH_ALLOC_CONF=${PYTORCH_ALLOC_CONF:-expandable_segments:True} \
HF_DATASETS_OFFLINE=${HF_DATASETS_OFFLINE:-1} \
"$PYTHON" -m torch.distributed.run --nproc_per_node="$NGPU" \
  --rdzv_backend c10d --rdzv_endpoint="localhost:0" \
  --local-ranks-filter "$LOG_RANK" --role rank --tee 3 \
  -m "$TRAIN_FILE" --job.config_file "$CONFIG_FILE" "$@"
