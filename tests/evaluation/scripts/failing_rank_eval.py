"""`moep-eval` under a launcher where the last rank cannot read the checkpoint (torchrun, 2 processes).

    torchrun ... failing_rank_eval.py MOEP_EVAL_ARGS...

The last rank's read raises DamagedCheckpoint; exits with `moep-eval`'s status.
"""
import os
import sys

from moep_ds.checkpointing import model_dir
from moep_ds.checkpointing.sharded import DamagedCheckpoint
from moep_ds.evaluation import run_eval

read = model_dir.load_weights


def load_weights(model, path, cfg, **kwargs):
    if int(os.environ["RANK"]) == int(os.environ["WORLD_SIZE"]) - 1:
        raise DamagedCheckpoint(f"checkpoint {str(path)!r} could not be read: simulated on this rank")
    return read(model, path, cfg, **kwargs)


if __name__ == "__main__":
    model_dir.load_weights = load_weights
    sys.exit(run_eval.main(sys.argv[1:]))
