"""Build the tests' mixed model as a ZeRO-3 rank does and record what it holds (torchrun, 2 processes).

    torchrun ... zero3_build.py OUT.json PRECISION

Writes, from rank 0: the elements of every parameter held whole during and after construction on this rank,
its partition's elements, the whole model's elements, and whether every gathered weight equals the one the
unpartitioned build (same seed) gets, rounded to the working precision. Buffers are compared too (dtype
included).
"""
import copy
import json
import os
import pathlib
import sys

import deepspeed
import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "training"))
from tiny import LAYERS  # noqa: E402

from moep_ds.config import config_from_dict  # noqa: E402
from moep_ds.models.causal_lm import build_model  # noqa: E402
from moep_ds.training.config import OptimizerConfig  # noqa: E402
from moep_ds.distributed.process_group import init_distributed  # noqa: E402
from moep_ds.training.optim import param_groups  # noqa: E402
from moep_ds.training.startup import build_rank_model  # noqa: E402
from moep_ds.distributed.zero3 import PRECISION_DTYPES  # noqa: E402


def main() -> None:
    out, precision = pathlib.Path(sys.argv[1]), sys.argv[2]
    init_distributed()
    cfg = config_from_dict({"model": {"flavour": "llama", "vocab_size": 64, "d_model": 32, "max_seq_len": 32,
                                      "tie_embeddings": True, "layers": copy.deepcopy(LAYERS["mixed"])}}).model
    ds = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "zero_optimization": {"stage": 3}}
    if precision != "fp32":
        ds[precision] = {"enabled": True}
    # elements held whole (not partitioned) by the parameters built so far, at every registration
    whole_during_build, registered = [], []

    def watch(module, name, p):
        if p is not None:
            registered.append(p)
            whole_during_build.append(sum(q.data.numel() for q in registered if q is not p))

    handle = nn.modules.module.register_module_parameter_registration_hook(watch)
    model = build_rank_model(cfg, ds, seed=5)
    handle.remove()
    params = dict(model.named_parameters())
    torch.manual_seed(5)
    reference = build_model(cfg, initialise=False)
    torch.manual_seed(5)
    reference.init_weights()
    dtype = PRECISION_DTYPES[precision]
    held_after = sum(p.data.numel() for p in params.values())
    mismatches = []
    for name, ref in reference.named_parameters():
        p = params[name]
        with deepspeed.zero.GatheredParameters([p]):
            if not torch.equal(p.data, ref.detach().to(dtype)):
                mismatches.append(name)
    for (name, b), (_, ref) in zip(model.named_buffers(), reference.named_buffers()):
        if b.dtype != ref.dtype or not torch.equal(b, ref):
            mismatches.append(name)
    def groups(m):  # weight decay or not, decided from the whole shapes (a partition is 1-D)
        names = {id(p): n for n, p in m.named_parameters()}
        return [sorted(names[id(p)] for p in g["params"]) for g in param_groups(m, OptimizerConfig())]

    result = {
        "decay_groups_equal": groups(model) == groups(reference),
        "whole_elements_at_registration_max": max(whole_during_build),
        "whole_elements_after": held_after,
        "partition_elements": sum(p.ds_tensor.numel() for p in params.values()),
        "model_elements": sum(p.numel() for p in reference.parameters()),
        "largest_parameter": max(p.numel() for p in reference.parameters()),
        "mismatches": mismatches,
        "all_partitioned": all(hasattr(p, "ds_id") for p in params.values()),
    }
    if dist.get_rank() == 0:
        out.write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


if __name__ == "__main__":
    main()
