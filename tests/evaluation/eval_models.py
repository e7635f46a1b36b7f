"""Tiny models of every block type for the evaluation tests (export, generation, harness), and directories the
loaders refuse (a truncated checkpoint, a consolidated export) with the one line each gives, and `export_hf`:
`moep-export --hf` of a model in memory.

Adding a block type is one line in TINY_LAYERS; `test_every_block_type_is_covered` fails until it is added.
"""
from __future__ import annotations

import os

import torch

from moep_ds.config import config_from_dict
from moep_ds.models.causal_lm import CausalLM, build_model

ATTN = {"num_heads": 2, "num_kv_heads": 1}
MLA = {"type": "mla", "num_heads": 2, "q_lora_rank": 8, "kv_lora_rank": 8, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4,
       "v_head_dim": 6, "rope": {"yarn": {"factor": 4.0, "original_max_seq_len": 4, "mscale_all_dim": 1.0}}}
EC_ROUTER = {"type": "expert_choice", "capacity_factor": 1.25, "rounding": "ceil", "score": "softmax_tokens",
             "eval_mode": "threshold"}

# name -> (model-level settings, layers); dims are filled in by tiny_config
TINY_LAYERS: dict[str, tuple[dict, list]] = {
    "dense_gpt2": ({"flavour": "gpt2"}, [{"type": "dense", "repeat": 2, "attention": {"num_heads": 2}}]),
    "dense_llama_window": ({"flavour": "llama"}, [{"type": "dense", "repeat": 2, "attention": {**ATTN, "window": 5}}]),
    "dense_pythia": ({"flavour": "pythia"}, [{"type": "dense", "repeat": 2, "attention": {"num_heads": 2}}]),
    "ffn_moe_nova": ({"flavour": "llama"}, [
        {"type": "dense", "attention": ATTN},
        {"type": "ffn_moe", "attention": ATTN,
         "moe": {"num_experts": 4, "expert": {"type": "swiglu", "hidden_size": 32}, "router": EC_ROUTER}},
    ]),
    "ffn_moe_topk": ({"flavour": "llama"}, [
        {"type": "ffn_moe", "repeat": 2, "attention": ATTN,
         "moe": {"num_experts": 4, "expert": {"type": "swiglu", "hidden_size": 32}, "router": {"type": "topk", "k": 2}}},
    ]),
    "ffn_moe_routing_menu": ({"flavour": "llama"}, [  # DeepSeek-V3 / Qwen2-MoE / DeepSpeed residual options
        {"type": "ffn_moe", "attention": ATTN,
         "moe": {"num_experts": 8, "expert": {"type": "swiglu", "hidden_size": 16},
                 "shared_expert": {"hidden_size": 16},
                 "router": {"type": "topk", "k": 2, "score": "sigmoid", "renormalize": True, "scaling_factor": 2.5,
                            "bias_update_rate": 0.01, "num_groups": 4, "group_topk": 2,
                            "load_balancing_scope": "sequence"}}},
        {"type": "ffn_moe", "attention": ATTN,
         "moe": {"num_experts": 4, "expert": {"type": "swiglu", "hidden_size": 16},
                 "shared_expert": {"hidden_size": 32, "gate": "sigmoid"},
                 "router": {"type": "topk", "k": 2, "load_balancing_scope": "global"}}},
        {"type": "ffn_moe", "attention": ATTN,
         "moe": {"num_experts": 4, "expert": {"type": "swiglu", "hidden_size": 16},
                 "shared_expert": {"hidden_size": 16, "gate": "residual_mix"},
                 "router": {"type": "topk", "k": 2, "renormalize": True}}},
    ]),
    "ffn_moe_mla": ({"flavour": "llama"}, [  # DeepSeek-V3's attention: the cache keeps the latent
        {"type": "dense", "attention": MLA},
        {"type": "ffn_moe", "attention": MLA,
         "moe": {"num_experts": 4, "expert": {"type": "swiglu", "hidden_size": 16}, "router": {"type": "topk", "k": 2}}},
    ]),
    # Qwen3-Next's linear attention, the cache keeps its states. Decoding (recurrent form) and the full forward
    # (chunked form) differ by fp32 rounding, more with short keys: greedy decoding repeats a token for 40 steps, and
    # with head_k_dim 8 the logits differed by 2.8e-5, 2.4e-6 with 32
    "dense_gated_deltanet": ({"flavour": "llama"}, [
        {"type": "dense", "attention": {"type": "gated_deltanet", "num_k_heads": 1, "num_v_heads": 2, "head_k_dim": 32,
                                        "head_v_dim": 8, "chunk_size": 16}},
        {"type": "dense", "attention": ATTN},
    ]),
    "msit": ({"final_norm": {"type": "layernorm"}}, [
        {"type": "msit", "repeat": 2, "attention": {"num_heads": 2, "rope": {}}, "norm": {"type": "layernorm"},
         "router": {"type": "expert_choice", "capacity_factor": 2.0, "eval_mode": "threshold"},
         "experts": {"d_thin": 16, "num_heads": 2, "windows": [6, 3, 2, 1]}},
    ]),
    "paths": ({"flavour": "llama"}, [{"type": "paths", "repeat": 2, "attention": ATTN, "d_path": 16, "num_paths": 2,
                                      "num_projection_experts": 2}]),
    "ssm_moe": ({"final_norm": {"type": "layernorm"}}, [
        {"type": "ssm_moe", "repeat": 2, "mixer": {"type": "ssm", "state_size": 4, "chunk_size": 4},
         "moe": {"num_experts": 4, "expert": {"type": "gelu", "hidden_size": 32}, "router": {"type": "topk", "k": 2}}},
    ]),
    "ssm_moe_lifecycle": ({"final_norm": {"type": "layernorm"}}, [
        {"type": "ssm_moe", "mixer": {"type": "ssm", "state_size": 4, "chunk_size": 8},
         "moe": {"num_experts": 4, "expert": {"type": "gelu", "hidden_size": 32},
                 "router": {"type": "topk", "k": 2, "lifecycle": {"min_tokens": 8, "check_interval": 1}}}},
    ]),
}
BLOCK_TYPES_COVERED = {layer["type"] for _, layers in TINY_LAYERS.values() for layer in layers}


def tiny_raw(name: str, vocab_size: int = 61, max_seq_len: int = 48, **model) -> dict:
    settings, layers = TINY_LAYERS[name]
    return {"model": {"vocab_size": vocab_size, "d_model": 32, "max_seq_len": max_seq_len, "init_std": 0.2,
                      **settings, "layers": layers, **model},
            "train": {"max_steps": 1}}


def tiny_config(name: str, **model):
    return config_from_dict(tiny_raw(name, **model))


def tiny_model(name: str, seed: int = 0, **model) -> tuple[CausalLM, object]:
    """A randomly initialised model in eval mode whose routers have seen one training batch, so that
    expert-choice thresholds select some tokens and not others."""
    cfg = tiny_config(name, **model)
    torch.manual_seed(seed)
    model_ = build_model(cfg.model)
    model_.train()
    with torch.no_grad():
        model_(torch.randint(0, cfg.model.vocab_size, (4, 24)))
    return model_.eval(), cfg


def truncated_model_dir(root):
    """A model directory whose data file is cut short, and the one line that names it."""
    from moep_ds.checkpointing.model_dir import save_model_dir

    model, cfg = tiny_model("dense_gpt2")
    out = save_model_dir(model, cfg, root / "m")
    data = out / "__0_0.distcp"
    size = data.stat().st_size
    os.truncate(data, 100)
    return out, f"checkpoint '{out}' is damaged: '{data}' is truncated (100 of {size} bytes)"


def export_hf(model: CausalLM, cfg, out, tokenizer_dir=None, meta=None):
    """`moep-export --hf` of a model in memory: saved beside `out` as a checkpoint first (save_model_dir), as a run
    would have saved it."""
    from moep_ds.checkpointing.model_dir import save_model_dir
    from moep_ds.cli.export import main as export_main

    ckpt = save_model_dir(model, cfg, out.parent / f"{out.name}_checkpoint", tokenizer_dir=tokenizer_dir, meta=meta)
    assert export_main([str(ckpt), "--out", str(out), "--hf"]) == 0
    return out


def consolidated_export(root):
    """A consolidated directory (a Hugging Face export), which the loaders refuse naming moep-convert."""
    model, cfg = tiny_model("dense_gpt2")
    out = export_hf(model, cfg, root / "hf")
    return out, (f"'{out}' is a consolidated checkpoint (model.safetensors), a format moep_ds no longer loads: "
                 f"run moep-convert {out} --out DST once and use DST")
