#!/bin/bash
# Pre-train with NPROC processes on this machine (CPU or GPU), through the deepspeed launcher.
#
#   CONFIG=configs/quickstart.yaml DS_CONFIG=ds_configs/quickstart.json NPROC=2 launchers/local.sh [--set a.b=v ...]
#
# `kill -USR1 <pid of this script>`: the trainers checkpoint and stop; run again with RESUME=auto to continue.
# Ctrl-C: the same, and the script exits with the launch's status, 0 (a second Ctrl-C aborts the trainers).
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
# Ctrl-C signals every process of the terminal's foreground process group. The deepspeed runner would print its
# KeyboardInterrupt traceback and exit 130, and its per-node launcher would SIGTERM the trainers one at a time and
# SIGKILL one still there 30 s later, in the middle of its checkpoint. So the launch runs in a session of its own
# (setsid), out of the terminal's reach, and each Ctrl-C this script gets goes to the trainers alone: the first
# makes them checkpoint and exit 0, and then the launch exits 0; a second one, a second or more later, aborts them.
interrupt_trainers() {
    INTERRUPTED=1  # run_preemptible waits for the launch again
    log "received SIGINT: passing it on to the trainers (the first checkpoints and stops them, a second aborts)"
    bash "$ROOT/launchers/signal_trainers.sh" INT "$MASTER_PORT" || log "passing SIGINT on failed with status $?"
}
trap 'interrupt_trainers || true' INT
run_preemptible stop_local_trainers setsid --wait \
    deepspeed --num_gpus "$NPROC" --master_port "$MASTER_PORT" "${DEEPSPEED_EXTRA[@]}" pretrain.py "${PRETRAIN_ARGS[@]}"
