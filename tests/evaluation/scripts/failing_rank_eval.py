"""`moep-eval` under a launcher where one rank fails (torchrun, 2 processes).

    torchrun ... failing_rank_eval.py read|write|score MOEP_EVAL_ARGS...

read: the last rank cannot read the checkpoint (DamagedCheckpoint); write: rank 0 cannot write the results
(OSError, after every rank evaluated); score: the last rank fails alone on its first batch of scores (a RuntimeError,
as from a bug or running out of memory) while the others go on to their next forward pass. Exits with `moep-eval`'s status.
"""
import os
import sys

from moep_ds.checkpointing import model_dir
from moep_ds.checkpointing.sharded import DamagedCheckpoint
from moep_ds.cli import eval as run_eval
from moep_ds.evaluation import harness

read, write, score = model_dir.load_weights, run_eval.write_record, harness.continuation_logprobs
RANK, WORLD = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])


def load_weights(model, path, **kwargs):
    if RANK == WORLD - 1:
        raise DamagedCheckpoint(f"checkpoint {str(path)!r} could not be read: simulated on this rank")
    return read(model, path, **kwargs)


def write_record(record, out_dir):
    raise OSError(f"simulated: cannot write {out_dir}")


def continuation_logprobs(*args, **kwargs):
    if RANK == WORLD - 1:
        raise RuntimeError("simulated: this rank cannot score")
    return score(*args, **kwargs)


if __name__ == "__main__":
    if sys.argv[1] == "read":
        model_dir.load_weights = load_weights
    elif sys.argv[1] == "score":
        harness.continuation_logprobs = continuation_logprobs
    else:
        run_eval.write_record = write_record
    sys.exit(run_eval.main(sys.argv[2:]))
