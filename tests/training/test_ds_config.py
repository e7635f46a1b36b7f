"""DeepSpeed JSON reconciliation, schedule, parameter groups, and layout errors (no processes started)."""
import math

import pytest
import torch

from moep_ds import build_model
from moep_ds.config import config_from_dict
from moep_ds.schema import ConfigError
from moep_ds.train_config import ScheduleConfig, TrainConfig
from moep_ds.distributed.ds_validation import check_with_deepspeed
from moep_ds.training.ds_config import DeepSpeedConfigError, DeepSpeedConfigFileError, read_ds_config, reconcile
from moep_ds.distributed.expert_parallel import ParallelLayoutError, check_parallel_layout
from moep_ds.training.optim import lr_multiplier, param_groups
from repo_paths import REPO

DS_CONFIGS = REPO / "ds_configs"


def train(**kw):
    return TrainConfig(max_steps=10, **kw)


def test_auto_values_are_filled_from_the_recipe_and_batch_derived():
    ds = reconcile({"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
                    "train_batch_size": "auto", "gradient_clipping": "auto"},
                   train(micro_batch_size=4, global_batch_size=32, grad_clip=0.5), world_size=2)
    assert (ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"], ds["train_batch_size"]) == (4, 4, 32)
    assert ds["gradient_clipping"] == 0.5
    assert ds["zero_allow_untested_optimizer"] is True


def test_defaults_without_a_ds_config():
    ds = reconcile({}, train(), world_size=3)
    assert ds["train_batch_size"] == 8 * 1 * 3 and ds["zero_optimization"] == {"stage": 0}


@pytest.mark.parametrize("ds,tc,world,message", [
    ({"train_micro_batch_size_per_gpu": 8}, {"micro_batch_size": 4}, 1,
     "train.micro_batch_size (4) conflicts with ds_config train_micro_batch_size_per_gpu (8); set it in one place"),
    ({"gradient_clipping": 1.0}, {"grad_clip": 0.5}, 1,
     "train.grad_clip (0.5) conflicts with ds_config gradient_clipping (1.0); set it in one place"),
    ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}, {}, 2,
     "ds_config train_batch_size (32) != train_micro_batch_size_per_gpu (4) x gradient_accumulation_steps (2) x "
     "data-parallel size (2) = 16"),
    ({"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4}, {}, 2,
     "ds_config train_batch_size (30) is not a multiple of train_micro_batch_size_per_gpu (4) x data-parallel size (2)"),
    ({"optimizer": {"type": "Adam"}}, {}, 1,
     "ds_config 'optimizer': the recipe's train.optimizer owns it; remove the section from the DeepSpeed config"),
    ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, {}, 1, "ds_config enables both fp16 and bf16; choose one"),
])
def test_conflicts_are_one_line_errors(ds, tc, world, message):
    with pytest.raises(DeepSpeedConfigError) as info:
        reconcile(ds, train(**tc), world_size=world)
    assert str(info.value) == message


@pytest.mark.parametrize("ds,message", [
    ({"gradient_accumulation_steps": "two"},
     'ds_config gradient_accumulation_steps ("two") must be a positive integer or "auto"'),
    ({"train_micro_batch_size_per_gpu": 0},
     'ds_config train_micro_batch_size_per_gpu (0) must be a positive integer or "auto"'),
    ({"train_batch_size": 8.5}, 'ds_config train_batch_size (8.5) must be a positive integer or "auto"'),
    ({"gradient_clipping": "1.0"}, 'ds_config gradient_clipping ("1.0") must be a number >= 0 or "auto"'),
    ({"zero_optimization": {"stage": 7}}, "ds_config zero_optimization.stage (7) must be 0, 1, 2 or 3"),
    ({"zero_optimization": 2}, "ds_config zero_optimization (2) must be a JSON object"),
    ({"bf16": True}, "ds_config bf16 (true) must be a JSON object"),
])
def test_values_reconcile_computes_with_are_checked_first(ds, message):
    """(These were tracebacks: TypeError for a string batch size, AttributeError for `"bf16": true`.)"""
    with pytest.raises(DeepSpeedConfigError) as info:
        reconcile(ds, train(), world_size=1)
    assert str(info.value) == message


@pytest.mark.parametrize("ds,message", [
    ({"zero_optimization": {"stage": 2, "overlap_comm": "maybe"}},
     'ds_config zero_optimization.overlap_comm ("maybe"): Input should be a valid boolean, unable to interpret input'),
    ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "gpu"}}},
     "ds_config zero_optimization.offload_optimizer.device (\"gpu\"): Input should be 'none', 'cpu' or 'nvme'"),
    ({"tensorboard": {"enabled": 3}}, "ds_config tensorboard.enabled (3): Input should be a valid boolean, unable to "
                                      "interpret input"),
    ({"bf16": {"enabled": True, "loss_scale": 1, "extra": 2}},
     "ds_config bf16.loss_scale (1): Extra inputs are not permitted (and 1 more)"),
])
def test_deepspeeds_validation_errors_are_one_line_naming_the_field(ds, message):
    """DeepSpeed's pydantic models report a field relative to their section; the message names it in the file."""
    with pytest.raises(DeepSpeedConfigError) as info:
        check_with_deepspeed(reconcile(ds, train(), world_size=1))
    assert str(info.value) == message


@pytest.mark.parametrize("key, suggestion", [("gradient_acumulation_steps", "gradient_accumulation_steps"),
                                             ("tensorbaord", "tensorboard"), ("zero_optimisation", "zero_optimization")])
def test_a_misspelled_key_deepspeed_would_ignore_is_refused(key, suggestion):
    """DeepSpeed skips top-level keys it does not read; one close to a key it reads is a typo."""
    ds = {**read_ds_config(str(DS_CONFIGS / "zero1_fp32.json")), key: 4}
    with pytest.raises(DeepSpeedConfigError) as info:
        check_with_deepspeed(reconcile(ds, train(micro_batch_size=2), world_size=1))
    assert str(info.value) == f"ds_config {key}: unknown key (DeepSpeed would ignore it); did you mean {suggestion!r}?"
    unrelated = {**read_ds_config(str(DS_CONFIGS / "zero1_fp32.json")), "my_launcher_note": "kept as it is"}
    check_with_deepspeed(reconcile(unrelated, train(micro_batch_size=2), world_size=1))  # not close to any: passes


def test_deepspeeds_own_cross_field_checks_are_one_line():
    ds = {**read_ds_config(str(DS_CONFIGS / "zero3_fp32.json")), "gradient_allreduce_op": "sum"}
    with pytest.raises(DeepSpeedConfigError) as info:
        check_with_deepspeed(reconcile(ds, train(micro_batch_size=2), world_size=1))
    assert str(info.value) == "ds_config refused by DeepSpeed: gradient_allreduce_op='sum' is not supported with ZeRO " \
                              "stage 3"


def test_a_key_given_twice_is_refused(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text('{"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 1, "stage": 2}}')
    with pytest.raises(DeepSpeedConfigFileError) as info:
        read_ds_config(str(path))
    assert str(info.value) == (f"--ds_config {str(path)!r}: key 'stage' is given twice in one object (JSON readers "
                               "keep the last silently)")


def test_deepspeed_accepts_every_shipped_config():
    for path in sorted(DS_CONFIGS.glob("*.json")):
        check_with_deepspeed(reconcile(read_ds_config(str(path)), train(micro_batch_size=2), world_size=1))


def test_warmup_then_cosine_to_floor():
    cfg = ScheduleConfig(kind="cosine", warmup_steps=4, min_lr_ratio=0.1)
    lrs = [lr_multiplier(s, cfg, 14) for s in range(16)]
    assert lrs[:4] == [0.25, 0.5, 0.75, 1.0]
    assert lrs[4] == 1.0
    assert math.isclose(lrs[9], 0.1 + 0.9 * 0.5)  # halfway through the decay
    assert lrs[14] == lrs[15] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(lrs[4:], lrs[5:]))


def naive_multiplier(step: int, kind: str, warmup: int, floor: float, max_steps: int) -> float:
    """Piecewise-linear interpolation through the schedule's corners (linear warmup reaching 1 at step
    warmup - 1; then 1 for constant, or a straight line from 1 at step `warmup` to `floor` at `max_steps`)."""
    import numpy as np

    if step < warmup:
        return float(np.interp(step, [-1, warmup - 1], [0.0, 1.0]))
    if kind == "constant":
        return 1.0
    return float(np.interp(step, [warmup, max_steps], [1.0, floor]))


@pytest.mark.parametrize("kind", ["linear", "constant"])
def test_linear_and_constant_schedules_warm_up_then_follow_their_shape(kind):
    cfg = ScheduleConfig(kind=kind, warmup_steps=3, min_lr_ratio=0.2)
    got = [lr_multiplier(s, cfg, 13) for s in range(16)]
    assert got == pytest.approx([naive_multiplier(s, kind, 3, 0.2, 13) for s in range(16)], abs=1e-12)
    assert got[0] < got[1] < got[2] == 1.0  # warmup for every kind


DENSE = [{"type": "dense", "attention": {"num_heads": 2}}]


def tiny_cfg(layers=DENSE, **train_kw):
    raw = {"model": {"flavour": "gpt2", "vocab_size": 32, "d_model": 16, "max_seq_len": 8, "layers": layers},
           "train": {"max_steps": 2, **train_kw}}
    return config_from_dict(raw)


def test_no_weight_decay_on_norms_biases_and_embeddings():
    model = build_model(tiny_cfg().model)
    decay, keep = param_groups(model, tiny_cfg().train.optimizer)
    names = {id(p): n for n, p in model.named_parameters()}
    decayed = {names[id(p)] for p in decay["params"]}
    kept = {names[id(p)] for p in keep["params"]}
    assert decayed == {"blocks.0.attention.attn.w_qkv.weight", "blocks.0.attention.attn.w_o.weight",
                       "blocks.0.ffn.w_in.weight", "blocks.0.ffn.w_out.weight"}
    assert {"embed.weight", "pos_embed.weight", "norm.weight", "norm.bias", "blocks.0.ffn.w_in.bias"} <= kept
    assert keep["weight_decay"] == 0.0 and decay["weight_decay"] == 0.1


def test_the_experts_biases_are_exempt_from_weight_decay_as_per_expert_1d_parameters():
    """gpt-oss's experts have biases ([E, F], [E, D]: one 1-D bias per expert); their weights ([E, D, F]) decay."""
    experts = {"type": "clamped_swiglu", "limit": 7.0, "bias": True}
    moe = [{"type": "ffn_moe", "attention": {"num_heads": 2, "sinks": True},
            "moe": {"num_experts": 4, "expert": experts, "router": {"type": "topk", "k": 2, "bias": True}}}]
    model = build_model(tiny_cfg(moe).model)
    decay, keep = param_groups(model, tiny_cfg(moe).train.optimizer)
    names = {id(p): n for n, p in model.named_parameters()}
    decayed = {names[id(p)] for p in decay["params"]}
    kept = {names[id(p)] for p in keep["params"]}
    experts_of = "blocks.0.moe.experts."
    assert {experts_of + n for n in ("w1_EDF", "w3_EDF", "w2_EFD")} <= decayed
    assert {experts_of + n for n in ("b1_EF", "b3_EF", "b2_ED")} | {"blocks.0.moe.router.bias",
                                                                     "blocks.0.attention.attn.sinks"} <= kept
    assert "blocks.0.moe.router.weight" in decayed


def test_expert_parallel_layout_errors():
    msit = [{"type": "msit", "attention": {"num_heads": 2}, "experts": {"d_thin": 8, "num_heads": 2, "windows": [4, 2]}}]
    cfg = tiny_cfg(msit, expert_parallel_size=2)
    with pytest.raises(ParallelLayoutError, match=r"^train.expert_parallel_size \(2\) must divide the world size \(3\)$"):
        check_parallel_layout(cfg, {"zero_optimization": {"stage": 2}}, 3)
    with pytest.raises(ParallelLayoutError, match=r"not supported with ZeRO stage 3"):
        check_parallel_layout(cfg, {"zero_optimization": {"stage": 3}}, 2)
    with pytest.raises(ParallelLayoutError) as err:
        check_parallel_layout(cfg, {"zero_optimization": {"stage": 0}, "bf16": {"enabled": True}}, 2)
    assert str(err.value) == ("train.expert_parallel_size (2) > 1 is not supported with ZeRO stage 0 in bf16 "
                              "(DeepSpeed's optimizer there leaves expert gradients out of the gradient norm it "
                              "clips by); use ZeRO 1-2, or fp32")
    check_parallel_layout(cfg, {"zero_optimization": {"stage": 2}}, 4)
    check_parallel_layout(cfg, {"zero_optimization": {"stage": 0}}, 2)  # fp32: distributed/grad_norm.py
    check_parallel_layout(cfg, {"zero_optimization": {"stage": 2}, "fp16": {"enabled": True}}, 2)


def test_experts_not_divisible_by_expert_parallel_size():
    raw = {"model": {"flavour": "llama", "vocab_size": 32, "d_model": 16, "max_seq_len": 8,
                     "layers": [{"type": "dense", "attention": {"num_heads": 2}},
                                {"type": "ffn_moe", "attention": {"num_heads": 2},
                                 "moe": {"num_experts": 6, "router": {"type": "topk", "k": 2}}}]},
           "train": {"max_steps": 2, "expert_parallel_size": 4}}
    with pytest.raises(ConfigError) as info:
        config_from_dict(raw)
    assert str(info.value) == "model.layers[1].moe.num_experts (6) must be divisible by expert_parallel_size (4)"


@pytest.mark.parametrize("section,owner", [("activation_checkpointing", "train.activation_checkpointing"),
                                           ("compile", "train.compile")])
def test_recipe_owned_sections_are_refused(section, owner):
    with pytest.raises(DeepSpeedConfigError) as err:
        reconcile({section: {}}, train(), world_size=1)
    assert str(err.value) == (f"ds_config '{section}': the recipe's {owner} owns it; "
                              "remove the section from the DeepSpeed config")


def test_values_the_user_wrote_are_never_replaced():
    written = {"zero_allow_untested_optimizer": False, "steps_per_print": 7,
               "zero_optimization": {"stage": 2, "contiguous_gradients": True, "reduce_scatter": False}}
    ds = reconcile(written, train(), world_size=1)
    assert ds["zero_allow_untested_optimizer"] is False and ds["steps_per_print"] == 7
    assert ds["zero_optimization"] == written["zero_optimization"]


def test_optimizer_offload_accepts_the_recipes_adamw_unless_the_user_says_otherwise():
    offload = {"stage": 2, "offload_optimizer": {"device": "cpu"}}
    assert reconcile({"zero_optimization": dict(offload)}, train(), world_size=1)["zero_force_ds_cpu_optimizer"] is False
    written = {"zero_optimization": dict(offload), "zero_force_ds_cpu_optimizer": True}
    assert reconcile(written, train(), world_size=1)["zero_force_ds_cpu_optimizer"] is True
    assert "zero_force_ds_cpu_optimizer" not in reconcile({"zero_optimization": {"stage": 2}}, train(), world_size=1)


@pytest.mark.parametrize("stage,ep,expected", [(1, 1, False), (2, 1, False), (1, 2, True), (2, 2, True)])
def test_auto_contiguous_gradients_is_false_unless_expert_parallelism_needs_it(stage, ep, expected):
    ds = reconcile({"zero_optimization": {"stage": stage, "contiguous_gradients": "auto"}},
                   train(expert_parallel_size=ep), world_size=2)
    assert ds["zero_optimization"]["contiguous_gradients"] is expected


def test_absent_zero_settings_stay_absent():
    ds = reconcile({"zero_optimization": {"stage": 2}}, train(), world_size=1)
    assert "contiguous_gradients" not in ds["zero_optimization"]


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("key", ["contiguous_gradients", "reduce_scatter"])
def test_expert_parallel_zero12_refuses_settings_that_mix_experts_gradients(stage, key):
    with pytest.raises(DeepSpeedConfigError) as err:
        reconcile({"zero_optimization": {"stage": stage, key: False}}, train(expert_parallel_size=2), world_size=2)
    assert str(err.value) == (f"ds_config zero_optimization.{key} (false) must be true for ZeRO stage {stage} "
                              "with train.expert_parallel_size (2); DeepSpeed averages expert gradients over their "
                              "expert-data-parallel group only then")


@pytest.mark.parametrize("name", ["zero1_fp32", "zero2_fp32", "zero2_bf16", "quickstart"])
def test_shipped_configs_resolve_to_the_fast_settings(name):
    ds = reconcile(read_ds_config(str(DS_CONFIGS / f"{name}.json")), train(micro_batch_size=2), world_size=1)
    assert ds["zero_optimization"]["contiguous_gradients"] is False


@pytest.mark.parametrize("text, message", [
    ("{not json", "is not valid JSON"),
    ('{"train_micro_batch_size_per_gpu": 3}', "train_micro_batch_size_per_gpu"),
    ('{"optimizer": {"type": "AdamW"}}', "ds_config 'optimizer': the recipe's"),
])
def test_a_bad_ds_config_fails_before_the_ranks_meet(tmp_path, monkeypatch, text, message):
    """The Trainer reads and reconciles the file (at the launcher's WORLD_SIZE) before init_distributed, which waits
    for every rank; nothing is created."""
    from moep_ds.training import assemble
    from moep_ds.training import trainer as trainer_mod

    def joined():
        raise AssertionError("init_distributed was called")

    monkeypatch.setattr(assemble, "init_distributed", joined)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    path = tmp_path / "ds.json"
    path.write_text(text)
    cfg = config_from_dict({"model": {"vocab_size": 64, "d_model": 32, "max_seq_len": 16,
                                      "layers": [{"type": "dense", "attention": {"num_heads": 2}}]},
                            "train": {"max_steps": 1, "micro_batch_size": 2, "output_dir": str(tmp_path / "run")}})
    with pytest.raises((DeepSpeedConfigError, DeepSpeedConfigFileError), match=message):
        trainer_mod.build_trainer(cfg, str(path), None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds.json"]
