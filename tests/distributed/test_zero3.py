"""ZeRO-3 construction (distributed/zero3.py): no rank holds the whole model, and the weights are the unpartitioned
model's. Both precisions are built on the same 2 ranks of this test (tests/ranks.py)."""
from __future__ import annotations

import copy
import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "training"))
from ranks import run_ranks  # noqa: E402
from tiny import LAYERS  # noqa: E402

PRECISIONS = ("fp32", "bf16")


@pytest.fixture(scope="module")
def builds():
    return run_ranks(2, build_as_a_zero3_rank, PRECISIONS)[0].result


@pytest.mark.slow
@pytest.mark.parametrize("precision", PRECISIONS)
def test_zero3_ranks_build_only_their_partitions_with_the_unpartitioned_weights(builds, precision):
    """Every routed block type (stacked MSIT branches and MoEP paths included) on two processes: after the build
    every parameter is partitioned and no element is held whole; during it, never more than a module's worth; each
    gathered weight and every buffer (dtype too: zero.Init would turn fp32 buffers into bf16) equals the plain
    build's from the same seed, and so do the weight-decay groups."""
    result = builds[precision]
    assert result["mismatches"] == []
    assert result["decay_groups_equal"]
    assert result["all_partitioned"] and result["whole_elements_after"] == 0
    model = result["model_elements"]
    assert model / 2 <= result["partition_elements"] <= model / 2 + 1000  # half each, plus padding
    assert result["whole_elements_at_registration_max"] < model / 4


def build_as_a_zero3_rank(precisions) -> dict[str, dict]:
    """Build the tests' mixed model as a ZeRO-3 rank does, in each precision, and record what this rank holds: the
    elements of every parameter held whole during and after construction, its partition's elements, the whole
    model's elements, and whether every gathered weight equals the one the unpartitioned build (same seed) gets,
    rounded to the working precision. Buffers are compared too (dtype included)."""
    import deepspeed
    import torch
    from torch import nn

    from moep_ds.config import config_from_dict
    from moep_ds.distributed.process_group import init_distributed
    from moep_ds.distributed.zero3 import PRECISION_DTYPES
    from moep_ds.models.causal_lm import build_model
    from moep_ds.train_config import OptimizerConfig
    from moep_ds.training.optim import param_groups
    from moep_ds.training.startup import build_rank_model

    init_distributed()
    cfg = config_from_dict({"model": {"flavour": "llama", "vocab_size": 64, "d_model": 32, "max_seq_len": 32,
                                      "tie_embeddings": True, "layers": copy.deepcopy(LAYERS["mixed"])}}).model
    results = {}
    for precision in precisions:
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

        results[precision] = {
            "decay_groups_equal": groups(model) == groups(reference),
            "whole_elements_at_registration_max": max(whole_during_build),
            "whole_elements_after": sum(p.data.numel() for p in params.values()),
            "partition_elements": sum(p.ds_tensor.numel() for p in params.values()),
            "model_elements": sum(p.numel() for p in reference.parameters()),
            "mismatches": mismatches,
            "all_partitioned": all(hasattr(p, "ds_id") for p in params.values()),
        }
    return results
