"""The recipes train as their sources did: Pythia-1B's protocol in the 1B recipes (values, unchanged
parameter counts), GPT-NeoX initialisation, weight-decay groups, the seeds' corpora, MoE-Stream's renormalised
top-2 weights."""
import math

import pytest
import torch

from moep_ds import build_model, load_config
from moep_ds.config import config_from_dict
from moep_ds.models.accounting import meta_param_report
from moep_ds.routing.topk import TopKRouter
from moep_ds.schema import to_dict
from moep_ds.training.optim import param_groups

from repo_paths import CONFIGS

PYTHIA = {"pythia_1b_dense": 1_011_781_632, "pythia_1b_moep": 1_014_268_928, "pythia_1b_ffn_moe": 1_012_273_152}


@pytest.mark.parametrize("recipe", sorted(PYTHIA))
def test_pythia_recipes_carry_pythias_protocol(recipe):
    cfg = load_config(CONFIGS / f"{recipe}.yaml")
    train, data = cfg.train, cfg.data
    opt, sched = train.optimizer, train.schedule
    assert (opt.lr, opt.betas, opt.eps, opt.weight_decay, opt.no_decay) == (2.5e-4, [0.9, 0.95], 1e-8, 0.1, ["1d"])
    # GPT-NeoX v1.0's AnnealingLR (tests/training/test_schedule.py holds it to a transcription of get_lr)
    assert (sched.kind, sched.warmup_steps, sched.min_lr_ratio, sched.rewarmup_steps) == \
        ("neox_annealing", 1430, 0.1, 0)
    assert sched.warmup_steps == 0.01 * train.max_steps and opt.lr * sched.min_lr_ratio == pytest.approx(2.5e-5)
    assert (train.max_steps, train.global_batch_size, train.micro_batch_size, train.grad_clip) == \
        (143_000, 1024, 16, 1.0)
    assert train.activation_checkpointing is True  # Pythia's checkpoint-activations
    assert train.eval_batches == 10  # eval-iters
    assert (data.seq_len, data.order, data.tokenizer.path) == (2048, "sequential", "hf:EleutherAI/pythia-1b")
    assert data.source == "megatron:shared:pile-standard-pythia-preshuffled/document"
    assert (cfg.model.vocab_size, data.tokenizer.vocab_size) == (50304, 50277)
    # small_init / wang_init with Pythia's L = 16 (the MoEP stack is one paths block as deep as 16 layers)
    assert cfg.model.init == "gpt_neox"
    std, out_scale = cfg.model.init_scales(len(cfg.model.expanded_layers()))
    assert (std, std * out_scale) == pytest.approx((math.sqrt(2 / (5 * 2048)), 2 / (16 * math.sqrt(2048))))
    assert train.start_step is None and getattr(cfg.model, "init_from", None) is None  # from scratch, at step 0
    # the released Pythia-1B trained in bf16 (Pythia's README), Pythia-1B-deduped in fp16
    assert "ds_configs/zero1_bf16.json" in (CONFIGS / f"{recipe}.yaml").read_text().split("\nmodel:")[0]
    assert meta_param_report(cfg.model).params_total == PYTHIA[recipe]


def test_pythia_deduped_recipe_is_the_dense_one_on_the_deduped_pile_in_fp16():
    dense, deduped = (to_dict(load_config(CONFIGS / f"{r}.yaml")) for r in ("pythia_1b_dense", "pythia_1b_deduped_dense"))
    assert deduped["data"].pop("source") == "megatron:shared:pile-deduped-pythia-preshuffled/document"
    dense["data"].pop("source")
    assert deduped["train"].pop("output_dir") == "runs/pythia_1b_deduped_dense"
    dense["train"].pop("output_dir")
    assert deduped == dense
    header = (CONFIGS / "pythia_1b_deduped_dense.yaml").read_text().split("\nmodel:")[0]
    assert "ds_configs/zero1_fp16.json" in header and "zero1_bf16" not in header


def test_pythia_recipes_differ_only_in_the_model():
    configs = {r: to_dict(load_config(CONFIGS / f"{r}.yaml")) for r in PYTHIA}
    for cfg in configs.values():
        cfg.pop("model")
        cfg["train"].pop("output_dir")
    dense = configs.pop("pythia_1b_dense")
    assert all(other == dense for other in configs.values())


def test_gpt_neox_initialisation_small_init_and_wang_init():
    raw = {"model": {"flavour": "pythia", "vocab_size": 512, "d_model": 320, "max_seq_len": 16, "init": "gpt_neox",
                     "layers": [{"type": "dense", "repeat": 5, "attention": {"num_heads": 4}}]}}
    torch.manual_seed(0)
    model = build_model(config_from_dict(raw).model)
    small, wang = math.sqrt(2 / (5 * 320)), 2 / (5 * math.sqrt(320))
    params = {n: p.detach() for n, p in model.named_parameters()}
    for name, expected in [("embed.weight", small), ("head.weight", small),
                           ("blocks.0.attention.attn.w_qkv.weight", small),
                           ("blocks.2.ffn.w_in.weight", small), ("blocks.1.attention.attn.w_o.weight", wang),
                           ("blocks.4.ffn.w_out.weight", wang)]:
        assert float(params[name].std()) == pytest.approx(expected, rel=0.03), name
    assert float(params["blocks.0.attention.attn.w_qkv.bias"].abs().max()) == 0.0
    deeper = config_from_dict({"model": {**raw["model"], "init_num_layers": 16}}).model
    assert deeper.init_scales(5) == pytest.approx((small, (2 / (16 * math.sqrt(320))) / small))
    gpt2 = config_from_dict({"model": {**raw["model"], "init": "normal"}}).model
    assert gpt2.init_scales(5) == (0.02, 1 / math.sqrt(10))


MATRICES = {f"blocks.0.{m}.weight" for m in ("attention.attn.w_qkv", "attention.attn.w_o", "ffn.w_in", "ffn.w_out")}
VECTORS = {f"blocks.0.{m}.{p}" for m in ("attention.norm", "attention.attn.w_qkv", "attention.attn.w_o", "ffn_norm",
                                         "ffn.w_in", "ffn.w_out") for p in ("weight", "bias")} - MATRICES


@pytest.mark.parametrize("no_decay, decayed", [
    (["1d", "embedding"], MATRICES | {"head.weight"}),
    (["1d"], MATRICES | {"head.weight", "embed.weight"}),  # GPT-NeoX / Pythia decays the embeddings
    ([], MATRICES | VECTORS | {"head.weight", "embed.weight", "norm.weight", "norm.bias"}),
])
def test_weight_decay_exemptions_are_a_setting(no_decay, decayed):
    raw = {"model": {"flavour": "pythia", "vocab_size": 64, "d_model": 32, "max_seq_len": 16,
                     "layers": [{"type": "dense", "attention": {"num_heads": 4}}]},
           "train": {"optimizer": {"weight_decay": 0.1, "no_decay": no_decay}}}
    cfg = config_from_dict(raw)
    model = build_model(cfg.model)
    names = {id(p): n for n, p in model.named_parameters()}
    groups = {g["name"]: ({names[id(p)] for p in g["params"]}, g["weight_decay"])
              for g in param_groups(model, cfg.train.optimizer)}
    assert groups["decay"] == (decayed, 0.1)
    assert groups.get("no_decay", (set(), 0.0)) == (set(names.values()) - decayed, 0.0)


@pytest.mark.parametrize("recipe, source", [
    ("msit_babylm", "shared:babylm/train_10M"), ("moep_gpt2", "shared:babylm/train_10M"),
    ("moep_llama", "shared:babylm/train_10M"), ("moep_gemma", "shared:babylm/train_10M"),
    ("gpt2_small", "shared:babylm/train_10M"), ("nova_moe", "hf:roneneldan/TinyStories"),
    ("nova_dense", "hf:roneneldan/TinyStories"), ("quickstart", "builtin"),
])
def test_recipes_name_their_seeds_corpus(recipe, source):
    assert load_config(CONFIGS / f"{recipe}.yaml").data.source == source


BABYLM = ["msit_babylm", "moep_gpt2", "moep_llama", "moep_gemma", "gpt2_small", "llama_small", "gemma_small"]


@pytest.mark.parametrize("recipe", BABYLM)
def test_babylm_recipes_train_on_all_of_strict_small(recipe):
    """The protocol trains on the whole train_10M folder: no held-out documents (a held-out share takes whole
    documents, and BabyLM's files have few blank lines: it could take a whole file)."""
    data = load_config(CONFIGS / f"{recipe}.yaml").data
    assert (data.source, data.val_fraction, data.val_source) == ("shared:babylm/train_10M", 0.0, None)
    assert load_config(CONFIGS / f"{recipe}.yaml", overrides=["data.val_source=shared:babylm/dev",
                                                                "train.eval_every=500"]).data.val_sources == \
        ["shared:babylm/dev"]


def test_moe_stream_top2_weights_sum_to_one_per_token():
    cfg = load_config(CONFIGS / "moe_stream.yaml")
    router_cfg = cfg.model.layers[0].moe.router
    assert router_cfg.k == 2 and router_cfg.renormalize
    router = TopKRouter(router_cfg, d_model=cfg.model.d_model, num_experts=8)
    torch.manual_seed(0)
    router.init_weights(0.02)
    plan = router(torch.randn(3, 40, cfg.model.d_model))
    sums_T = torch.zeros(plan.num_tokens).index_add_(0, plan.token_idx_S, plan.weight_S.detach().float())
    torch.testing.assert_close(sums_T, torch.ones(120))
    assert int(plan.counts_E.sum()) == 2 * 120


def test_pythia_deepspeed_configs_are_zero1_in_bf16_and_in_fp16_as_the_deduped_run():
    import json

    bf16 = json.loads((CONFIGS.parent / "ds_configs" / "zero1_bf16.json").read_text())
    assert bf16["zero_optimization"]["stage"] == 1 and bf16["bf16"]["enabled"] and "fp16" not in bf16
    ds = json.loads((CONFIGS.parent / "ds_configs" / "zero1_fp16.json").read_text())
    assert ds["zero_optimization"]["stage"] == 1 and ds["fp16"]["enabled"] and not ds.get("bf16", {}).get("enabled")
    # pythia-1b.yml: dynamic loss scaling from 2^12, window 1000, hysteresis 2, floor 1
    assert {k: ds["fp16"][k] for k in ("loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis",
                                         "min_loss_scale")} == {"loss_scale": 0, "initial_scale_power": 12,
                                                                "loss_scale_window": 1000, "hysteresis": 2,
                                                                "min_loss_scale": 1}


def test_nova_moe_total_is_its_active_count_plus_the_inactive_experts():
    """docs/FIDELITY.md: the seed's total (122,610,688) is 512 above active + 4 layers x 7 inactive SwiGLU experts."""
    report = meta_param_report(load_config(CONFIGS / "nova_moe.yaml").model)
    inactive = 4 * 7 * 3 * 512 * 2048
    assert report.params_active == 34_529_792 and report.params_total == 34_529_792 + inactive == 122_610_176
    assert 122_610_688 - report.params_total == 512
