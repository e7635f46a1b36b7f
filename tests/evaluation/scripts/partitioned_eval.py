"""Evaluate model directories with the lm-eval model `moep_ds` on every rank of a launcher (torchrun) and record,
per rank, what the rank holds of the model and what it scored and generated.

    torchrun ... partitioned_eval.py SPEC.json OUT_DIR

SPEC: {"requests": [[context ids, continuation ids], ...], "contexts": [str, ...], "batch_size": int,
       "runs": [{"name": str, "dir": model directory, "dtype": torch dtype name, "expert_parallel": bool}, ...]}
Writes OUT_DIR/rank<r>.json: {name: {"scores": [[logp, greedy], ...], "generated": [str, ...] (greedy),
"sampled": [str, ...] (drawn with a different seed on each rank),
"held": elements of this rank's partitions, "total": elements of the whole model, "whole": names of parameters
held whole, "params": number of parameters, "experts_held": elements of the expert parameters held here,
"different_work": the error when each rank is given different requests, "padded": ZeRO-3 parameters whose
last partition is padded}}.
"""
import json
import os
import pathlib
import sys

import torch
import torch.distributed as dist
from lm_eval.api.instance import Instance

from moep_ds.checkpointing.model_state import zero3_partition
from moep_ds.errors import SharedUserError
from moep_ds.evaluation.harness import MoepLM


def main() -> None:
    spec, out = json.loads(pathlib.Path(sys.argv[1]).read_text()), pathlib.Path(sys.argv[2])
    record = {}
    for run in spec["runs"]:
        lm = MoepLM(pretrained=run["dir"], batch_size=spec["batch_size"], dtype=run["dtype"],
                    expert_parallel=run.get("expert_parallel", False))
        params = list(lm.model.named_parameters())
        requests = [(None, ctx, cont) for ctx, cont in spec["requests"]]
        generate = [Instance("generate_until", {}, (c, {"until": ["."], "max_gen_toks": 6}), i)
                    for i, c in enumerate(spec["contexts"])]
        sample = [Instance("generate_until", {}, (c, {"until": ["."], "max_gen_toks": 6, "do_sample": True}), i)
                  for i, c in enumerate(spec["contexts"])]
        torch.manual_seed(dist.get_rank())  # each rank draws differently: the ranks must follow rank 0's tokens
        record[run["name"]] = {
            "scores": lm._loglikelihood_tokens(requests, disable_tqdm=True),
            "generated": lm.generate_until(generate, disable_tqdm=True),
            "sampled": lm.generate_until(sample, disable_tqdm=True),
            "held": sum(zero3_partition(p)[1] for _, p in params if hasattr(p, "ds_id")),
            "total": sum(p.ds_numel if hasattr(p, "ds_id") else p.numel() for _, p in params),
            "whole": [n for n, p in params if not hasattr(p, "ds_id")],
            "params": len(params),
            "padded": sum(p.ds_numel % dist.get_world_size() != 0 for _, p in params if hasattr(p, "ds_id")),
            "experts_held": sum(p.numel() for _, p in params if getattr(p, "allreduce", True) is False),
        }
        try:  # ranks given different requests: refused on every rank before any forward pass
            lm._loglikelihood_tokens(requests[:1 + dist.get_rank()], disable_tqdm=True)
        except SharedUserError as err:
            record[run["name"]]["different_work"] = str(err)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(record))
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


if __name__ == "__main__":
    main()
