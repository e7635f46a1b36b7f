#!/bin/bash
# Pre-train with NPROC processes on this machine (CPU or GPU), through the deepspeed launcher.
#
#   CONFIG=configs/quickstart.yaml DS_CONFIG=ds_configs/quickstart.json NPROC=2 launchers/local.sh [--set a.b=v ...]
#
# `kill -USR1 <pid of this script>`: the trainers checkpoint and stop; run again with RESUME=auto to continue.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
# shellcheck source=SCRIPTDIR/common.sh
source "$ROOT/launchers/common.sh"

build_pretrain_args "$@"
cd "$ROOT"
NPROC=${NPROC:-1}
require_int NPROC "a positive integer (processes on this machine)" 1
if [ -n "${MASTER_PORT:-}" ]; then require_int MASTER_PORT "an integer from 1 to 65535" 1 65535; fi
export MASTER_ADDR=127.0.0.1 MASTER_PORT=${MASTER_PORT:-$(free_port)} OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

deepspeed_extra_args
run_preemptible stop_local_trainers \
    deepspeed --num_gpus "$NPROC" --master_port "$MASTER_PORT" "${DEEPSPEED_EXTRA[@]}" pretrain.py "${PRETRAIN_ARGS[@]}"
