"""Sparse upcycling: a dense checkpoint (a Hugging Face one, or ours) into an FFN-MoE of the same backbone computes
the dense model at step 0 under top-2 with renormalised weights and no drops; trained on, its experts part; the
same under expert parallelism 2 and ZeRO-3 on 2 processes.

# B batch, T tokens, V vocabulary, E experts
"""
from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import pytest
import torch
import yaml

from hf_models import D, NUM_LAYERS, hf_model, recipe, save, tokens
from moep_ds.checkpointing.model_dir import load_model_dir, load_recipe, stored_weights
from moep_ds.config import config_from_dict
from moep_ds.errors import UserError
from moep_ds.interop.importer import import_checkpoint
from moep_ds.interop.sources import source_weights

transformers = pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "training"))
from tiny import DS_CONFIGS, metrics, run_jobs  # noqa: E402

TOLERANCE = {"rtol": 1e-5, "atol": 1e-5}
TOP2 = {"type": "topk", "k": 2, "renormalize": True, "capacity_factor": None, "load_balancing_weight": 0.01}


def moe_recipe(case: str, src: Path, router: dict | None = None, **upcycle) -> dict:
    """The case's dense recipe with every block an ffn_moe of 4 copies of its FFN, upcycled from `src`."""
    raw = recipe(case)
    dense = raw["model"]["layers"][0]
    expert = copy.deepcopy(dense.get("ffn", {"type": "gelu_tanh", "bias": True, "hidden_size": 4 * D}))
    raw["model"]["layers"] = [{"type": "ffn_moe", "repeat": NUM_LAYERS, "attention": dense["attention"],
                               "moe": {"num_experts": 4, "expert": expert, "router": router or TOP2}}]
    raw["model"].update(init_from=str(src), upcycle=upcycle)
    return raw


def logits(run: Path) -> torch.Tensor:
    with torch.no_grad():
        return load_model_dir(run)[0](tokens()).logits


@pytest.mark.parametrize("case", ["gpt_neox", "llama_gqa"])
def test_upcycled_top2_computes_the_dense_model_at_step_0(tmp_path, case):
    """GPT-NeoX straight from its Hugging Face folder; Llama from our import of it (a moep_ds dense checkpoint)."""
    reference = hf_model(case)
    src = save(reference, tmp_path / "hf", "safetensors")
    if case == "llama_gqa":
        import_checkpoint(str(src), config_from_dict(recipe(case)), tmp_path / "dense")
        src = tmp_path / "dense"
    import_checkpoint(str(src), config_from_dict(moe_recipe(case, src)), tmp_path / "moe")
    with torch.no_grad():
        dense_BTV = reference(tokens()).logits
    upcycled_BTV = logits(tmp_path / "moe")
    assert float(upcycled_BTV.std()) > 0.1
    torch.testing.assert_close(upcycled_BTV, dense_BTV, **TOLERANCE)
    ckpt, cfg = load_recipe(tmp_path / "moe")
    weights = {e.name: e.read() for e in stored_weights(ckpt, cfg)[0]}
    w1_EDF = weights["blocks.0.moe.experts.w1_EDF"]
    assert all(torch.equal(w1_EDF[e], w1_EDF[0]) for e in range(4))  # exact copies (no noise asked for)
    assert weights["blocks.0.moe.router.weight"].std() > 0  # the router: seeded, not zero
    # the stored recipe is the MoE's, with nothing left to import
    assert cfg.model.init_from is None and cfg.model.upcycle is None


def test_renormalisation_is_what_makes_step_0_exact(tmp_path):
    """Without renormalisation each token's output is scaled by its two probabilities' sum: near, not equal."""
    reference = hf_model("gpt_neox")
    src = save(reference, tmp_path / "hf", "safetensors")
    import_checkpoint(str(src), config_from_dict(moe_recipe("gpt_neox", src, {**TOP2, "renormalize": False})),
                      tmp_path / "moe")
    with torch.no_grad():
        dense_BTV = reference(tokens()).logits
    assert not torch.allclose(logits(tmp_path / "moe"), dense_BTV, **TOLERANCE)


def test_expert_choice_upcycles_and_trains_from_near_the_dense_model(tmp_path):
    """Expert choice (docs/FIDELITY.md): under its training rule a token gets the sum of its affinities over the
    experts that chose it, so the output is the dense FFN's scaled per token, not equal to it. Its evaluation rule
    before any training step (thresholds 0: every expert takes every token, softmax over experts sums to 1) is the
    dense model exactly."""
    reference = hf_model("gpt_neox")
    src = save(reference, tmp_path / "hf", "safetensors")
    router = {"type": "expert_choice", "capacity_factor": 1.0, "score": "softmax_experts", "scope": "sequence"}
    import_checkpoint(str(src), config_from_dict(moe_recipe("gpt_neox", src, router)), tmp_path / "moe")
    model = load_model_dir(tmp_path / "moe")[0]
    with torch.no_grad():
        dense_BTV = reference(tokens()).logits
        torch.testing.assert_close(model(tokens()).logits, dense_BTV, **TOLERANCE)  # eval_mode threshold, fresh
        trained_rule_BTV = model.train()(tokens()).logits
    assert torch.isfinite(trained_rule_BTV).all() and not torch.allclose(trained_rule_BTV, dense_BTV, **TOLERANCE)


def test_noise_is_per_expert_and_the_same_for_any_rank_that_builds_it(tmp_path):
    src = save(hf_model("gpt_neox"), tmp_path / "hf", "safetensors")
    cfg = config_from_dict(moe_recipe("gpt_neox", src, noise_std=0.01, seed=3))
    weights, keep, _ = source_weights(str(src), cfg.model)
    assert keep == {f"blocks.{i}.moe.router.weight" for i in range(NUM_LAYERS)}
    stack = weights["blocks.1.moe.experts.w2_EFD"]
    full = stack.read()
    assert full.shape == (4, 4 * D, D)
    torch.testing.assert_close(stack.rows(2, 4), full[2:4], rtol=0, atol=0)  # expert-parallel rank 1 of 2
    again = weights["blocks.1.moe.experts.w2_EFD"].read()
    noise = full - full.mean(0, keepdim=True)
    assert 0.005 < float(noise.std()) < 0.015 and not torch.equal(full[0], full[1])
    assert torch.equal(again, full)  # drawn from the seed: the same again
    assert torch.equal(weights["blocks.1.moe.experts.b2_ED"].read()[0], weights["blocks.1.moe.experts.b2_ED"].read()[3])


def test_a_dense_checkpoint_of_another_backbone_is_refused(tmp_path):
    src = save(hf_model("gpt_neox"), tmp_path / "hf", "safetensors")
    import_checkpoint(str(src), config_from_dict(recipe("gpt_neox")), tmp_path / "dense")
    raw = moe_recipe("gpt_neox", tmp_path / "dense")
    raw["model"]["layers"][0]["moe"]["expert"]["hidden_size"] = 128
    with pytest.raises(UserError) as err:
        import_checkpoint(str(tmp_path / "dense"), config_from_dict(raw), tmp_path / "moe")
    assert str(err.value).splitlines() == [
        f"SRC ({str(tmp_path / 'dense')!r}) does not match the recipe's model:",
        "  model.layers[0].moe.expert.hidden_size: 256 in SRC, 128 in the recipe",  # the recipe's field (issue 40)
        "  model.layers[1].moe.expert.hidden_size: 256 in SRC, 128 in the recipe"]
    raw = moe_recipe("gpt_neox", src)  # from the Hugging Face folder itself
    raw["model"]["layers"][0]["moe"]["expert"]["type"] = "swiglu"
    with pytest.raises(UserError) as err:
        import_checkpoint(str(src), config_from_dict(raw), tmp_path / "moe")
    assert "  model.layers[*].moe.expert.type: 'swiglu' in the recipe, 'gelu_tanh' in config.json" in str(err.value)
    raw = moe_recipe("gpt_neox", tmp_path / "dense")
    raw["model"]["layers"].append({"type": "msit", "attention": {"num_heads": 4},
                                   "experts": {"d_thin": 16, "num_heads": 2, "windows": [4, 2, 1, 1]}})
    with pytest.raises(UserError, match=r"^model.layers\[1\].type \('msit'\): model.upcycle builds ffn_moe blocks "
                                        r"from dense ones; a msit block has no dense counterpart$"):
        import_checkpoint(str(tmp_path / "dense"), config_from_dict(raw), tmp_path / "moe")


# ---- training from an upcycled start, 2 processes --------------------------------------------------------------


TINY = {"vocab_size": 512, "d_model": 32, "max_seq_len": 32, "heads": 4, "hidden": 48}


def tiny_llama(folder: Path) -> Path:
    """A dense Llama of the tiny training recipes' sizes (no tokenizer: the run trains its own of 512 ids)."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=TINY["vocab_size"], hidden_size=TINY["d_model"],
                                      intermediate_size=TINY["hidden"], num_hidden_layers=2,
                                      num_attention_heads=TINY["heads"], max_position_embeddings=TINY["max_seq_len"],
                                      rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=None,
                                      eos_token_id=None, pad_token_id=None)
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    model.save_pretrained(folder)
    return folder


def training_recipe(path: Path, out: Path, src: Path, moe: bool, **train) -> Path:
    attention = {"num_heads": TINY["heads"]}
    ffn = {"type": "swiglu", "hidden_size": TINY["hidden"]}
    layer = ({"type": "ffn_moe", "attention": attention, "moe": {"num_experts": 4, "expert": ffn, "router": TOP2}}
             if moe else {"type": "dense", "attention": attention, "ffn": ffn})
    model = {"flavour": "llama", "vocab_size": TINY["vocab_size"], "d_model": TINY["d_model"],
             "max_seq_len": TINY["max_seq_len"], "layers": [{**layer, "repeat": 2}], "init_from": str(src),
             **({"upcycle": {}} if moe else {})}
    raw = {"model": model,
           "data": {"source": "builtin", "tokenizer": {"kind": "bpe", "vocab_size": 512}, "seq_len": 32},
           "train": {"output_dir": str(out), "max_steps": 5, "log_every": 1, "micro_batch_size": 4,
                     "checkpoint": {"every_steps": None, "at_end": True},
                     "optimizer": {"lr": 1.0e-2, "weight_decay": 0.0}, "schedule": {"warmup_steps": 1}, **train}}
    path.write_text(yaml.safe_dump(raw))
    return path


@pytest.mark.slow
def test_upcycled_training_under_expert_parallelism_and_zero3(tmp_path):
    """One run of 2 ranks (tests/ranks.py): the dense model continued (ZeRO-2), and upcycled under expert parallelism 2
    (ZeRO-2) and under ZeRO-3. The first step's loss is computed by the step-0 weights: the upcycled runs' cross
    entropy equals the dense run's. After 5 steps the experts of each layer differ from each other, and the two
    upcycled runs' curves agree."""
    src = tiny_llama(tmp_path / "hf")
    runs = {"dense": ("zero2_fp32", False, {}), "ep2": ("zero2_fp32", True, {"expert_parallel_size": 2}),
            "zero3": ("zero3_fp32", True, {})}
    jobs = [{"recipe": str(training_recipe(tmp_path / f"{name}.yaml", tmp_path / name, src, moe, **train)),
             "ds_config": str(DS_CONFIGS / f"{ds}.json")} for name, (ds, moe, train) in runs.items()]
    run_jobs(2, jobs, timeout=900)
    first = {name: next(m for m in metrics(tmp_path / name) if m["step"] == 1) for name in runs}
    for name in ("ep2", "zero3"):
        assert first[name]["ce_loss"] == pytest.approx(first["dense"]["ce_loss"], abs=1e-5), name
        ckpt, cfg = load_recipe(tmp_path / name)
        weights = {e.name: e.read() for e in stored_weights(ckpt, cfg)[0]}
        for i in range(2):
            w1_EDF = weights[f"blocks.{i}.moe.experts.w1_EDF"]
            for a in range(4):
                for b in range(a + 1, 4):
                    assert not torch.allclose(w1_EDF[a], w1_EDF[b], rtol=0, atol=1e-6), (name, i, a, b)
    assert first["dense"]["ce_loss"] > 1.0  # a real loss of the imported model, not a constant
    # the later steps compute with what the optimizer's fp32 masters became: upcycled into ZeRO-2's fragments under
    # expert parallelism and into ZeRO-3's partitions alike, the two runs train alike (ZeRO-3 vs 2: within 1e-4)
    curves = {name: {m["step"]: m["loss"] for m in metrics(tmp_path / name) if "loss" in m}
              for name in ("ep2", "zero3")}
    assert sorted(curves["ep2"]) == sorted(curves["zero3"]) == [1, 2, 3, 4, 5]
    for step in range(1, 6):
        assert curves["zero3"][step] == pytest.approx(curves["ep2"][step], abs=1e-4), (step, curves)


def test_init_from_an_moe_checkpoint_may_change_how_its_routers_train(tmp_path):
    """A run started from an MoE checkpoint (not upcycled) may change loss weights and capacity, not the model."""
    from moep_ds.interop.sources import check_same_model

    src = save(hf_model("gpt_neox"), tmp_path / "hf", "safetensors")
    saved = config_from_dict(moe_recipe("gpt_neox", src)).model
    now = config_from_dict(moe_recipe("gpt_neox", src, {**TOP2, "load_balancing_weight": 0.1,
                                                        "capacity_factor": 1.25})).model
    check_same_model(saved, now, "SRC")
    other = config_from_dict(moe_recipe("gpt_neox", src, {**TOP2, "k": 1})).model
    with pytest.raises(UserError, match=r"model.layers\[0\].moe.router.k: 2 in SRC, 1 in the recipe"):
        check_same_model(saved, other, "SRC")


def test_an_upcycled_llama_exports_as_mixtral(tmp_path):
    """Top-2 renormalised SwiGLU experts over Llama's blocks are Mixtral: the native export loads in transformers
    without remote code and gives the dense source's logits (step 0 of the upcycling is exact)."""
    from moep_ds.cli.export import main as export_main

    reference = hf_model("llama_gqa")
    src = save(reference, tmp_path / "hf", "safetensors")
    import_checkpoint(str(src), config_from_dict(moe_recipe("llama_gqa", src)), tmp_path / "moe")
    assert export_main([str(tmp_path / "moe"), "--out", str(tmp_path / "out"), "--hf", "--native"]) == 0
    assert json.loads((tmp_path / "out" / "config.json").read_text())["architectures"] == ["MixtralForCausalLM"]
    mixtral = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", attn_implementation="eager")
    with torch.no_grad():
        expected = reference(tokens()).logits
        torch.testing.assert_close(mixtral.float().eval()(tokens()).logits, expected, **TOLERANCE)
    torch.testing.assert_close(logits(tmp_path / "moe"), expected, **TOLERANCE)


def test_an_moe_no_architecture_expresses_is_refused_naming_the_nearest(tmp_path, capsys):
    """An upcycled GPT-NeoX (LayerNorm, GELU experts, parallel residual) is none of the MoE architectures: one line
    naming the nearest and the first setting where it differs; nothing written."""
    from moep_ds.cli.export import main as export_main

    src = save(hf_model("gpt_neox"), tmp_path / "hf", "safetensors")
    import_checkpoint(str(src), config_from_dict(moe_recipe("gpt_neox", src)), tmp_path / "moe")
    assert export_main([str(tmp_path / "moe"), "--out", str(tmp_path / "out"), "--hf", "--native"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "error: no Hugging Face architecture expresses this model: the nearest, Qwen3MoeForCausalLM, differs first at "
        "model.final_norm.type: 'rmsnorm' in Qwen3MoeForCausalLM, 'layernorm' in the model (13 setting(s) differ)")
    assert not (tmp_path / "out").exists()
