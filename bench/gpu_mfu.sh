#!/usr/bin/env bash
# MFU of pythia_1b_dense, pythia_1b_moep, pythia_1b_ffn_moe (each eager and with activation checkpointing +
# compile) and msit_babylm on one GPU (bf16, ZeRO-2, 20 timed steps each): one command, sized to finish in under
# 8 minutes on one H200 (killed at 7m50s at the latest; rows print as they finish).
#   bench/gpu_mfu.sh --variants eager ckpt compile ckpt+compile --recipes pythia_1b_dense   # each switch alone
#   bench/gpu_mfu.sh                       # prints the table (paste it into bench/RESULTS.md)
#   bench/gpu_mfu.sh --dry_run             # CPU, toy sizes
# Extra arguments go to bench/gpu_mfu.py; PYTHON selects the interpreter (default: python).
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-8}" TOKENIZERS_PARALLELISM=false
exec timeout --signal=TERM --kill-after=10 470 "${PYTHON:-python}" bench/gpu_mfu.py "$@"
