"""ZeRO-3 construction: the model is built partitioned and initialised one module at a time.

    with partitioned_construction(ds):           # deepspeed.zero.Init
        model = build_model(cfg, initialise=False)
    model.init_weights(gathered_for_init)       # each module's parameters whole only while it is initialised

No rank ever holds the whole model, at Pythia-1B scale 4 GB of fp32 per rank: `deepspeed.zero.Init` partitions
a module's parameters over the data-parallel group as soon as that module is built. A parameter set on a module
that is already built is partitioned when it is registered (stacked experts, `moe/stacked.py`, replace the
parameters of an expert module with [E, ...] stacks; `zero.Init` would leave those whole until the engine).
Initialisation runs through `CausalLM.init_weights` like the unpartitioned model's, in fp32 on the CPU, each module's
parameters gathered meanwhile: with the same seed the weights equal the unpartitioned model's (rounded to the
working precision).
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import nn

from moep_ds.distributed.ds_fields import precision

PRECISION_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@contextlib.contextmanager
def partitioned_construction(ds: dict) -> Iterator[None]:
    """Build modules inside with every parameter partitioned under the ZeRO-3 config `ds`, in its precision."""
    import deepspeed
    from deepspeed.runtime.zero import DeepSpeedTensorOverride
    from deepspeed.runtime.zero.partition_parameters import is_zero_param

    dtype = PRECISION_DTYPES[precision(ds)]

    def on_register(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is None or is_zero_param(param):
            return
        if param.is_floating_point():
            param.data = param.data.to(dtype)  # what the engine expects of a ZeRO-3 parameter
        built = [p for p in module.parameters(recurse=False) if is_zero_param(p)]
        if built:  # set on a module already built (and partitioned): zero.Init would not see it
            built[0].convert_to_zero_parameters([param])

    # zero.Init by default also turns every floating tensor made inside into the working precision, buffers
    # included (fp32 rotary frequencies, fp64 accumulators), which the engine leaves as they are otherwise;
    # and its memory_efficient_linear replaces torch's F.linear for the rest of the process.
    zero = {"memory_efficient_linear": False, **ds.get("zero_optimization", {})}
    with deepspeed.zero.Init(config_dict_or_path={**ds, "zero_optimization": zero},
                             tensor_overrides=[DeepSpeedTensorOverride.device]):
        handle = nn.modules.module.register_module_parameter_registration_hook(on_register)
        try:
            yield
        finally:
            handle.remove()


@contextlib.contextmanager
def gathered_for_init(module: nn.Module) -> Iterator[None]:
    """`module`'s parameters whole, in fp32 and on the CPU inside (where the unpartitioned model is initialised:
    a GPU's random stream differs); afterwards rank 0's values are every rank's partitions (every rank draws the
    same values from the same seed)."""
    import deepspeed

    params = list(module.parameters())
    with deepspeed.zero.GatheredParameters(params, modifier_rank=0):
        working = [p.data for p in params]
        for p in params:
            p.data = p.data.to("cpu", torch.float32)
        try:
            yield
        finally:
            for p, w in zip(params, working):
                w.copy_(p.data)
                p.data = w


def check_partitioned(model: nn.Module) -> None:
    from deepspeed.runtime.zero.partition_parameters import is_zero_param

    whole = [name for name, p in model.named_parameters() if not is_zero_param(p)]
    if whole:
        raise RuntimeError(f"{len(whole)} parameters were built outside ZeRO-3's partitioning, e.g. {whole[0]!r}")


__all__ = ["check_partitioned", "gathered_for_init", "partitioned_construction"]
