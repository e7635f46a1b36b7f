#!/bin/bash
# One srun task = one trainer: torch.distributed's rank variables from SLURM's, then pretrain.py with the
# launcher's arguments. MASTER_ADDR, MASTER_PORT and MOEP_ROOT come from the batch script's environment.
set -euo pipefail
export RANK=$SLURM_PROCID WORLD_SIZE=$SLURM_NTASKS LOCAL_RANK=$SLURM_LOCALID
: "${MASTER_ADDR:?not set: run through slurm_multi_node.sbatch}" "${MASTER_PORT:?not set}" "${MOEP_ROOT:?not set}"
exec "${PYTHON:-python3}" "$MOEP_ROOT/pretrain.py" "$@"
