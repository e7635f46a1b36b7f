"""Small randomly initialised transformers models of the four architectures, saved as transformers saves them,
and the recipes that describe them.

# V vocabulary, D model dim, T tokens

Every parameter is moved off its initial value (norm scales off 1, biases off 0), so that an import that drops
or swaps a norm, a bias or a projection changes the logits.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

transformers = __import__("pytest").importorskip("transformers")

V, D, T, NUM_LAYERS, NUM_HEADS = 300, 64, 16, 2, 4  # V: at least what a trained tokenizer of a recipe may have
NO_SPECIAL_TOKENS = {"bos_token_id": None, "eos_token_id": None, "pad_token_id": None}


def hf_config(case: str) -> Any:
    if case == "gpt2":
        return transformers.GPT2Config(vocab_size=V, n_positions=T, n_embd=D, n_layer=NUM_LAYERS, n_head=NUM_HEADS,
                                       activation_function="gelu_new", resid_pdrop=0.0, embd_pdrop=0.0,
                                       attn_pdrop=0.0, **NO_SPECIAL_TOKENS)
    if case == "llama_gqa":
        return transformers.LlamaConfig(vocab_size=V, hidden_size=D, intermediate_size=96, num_hidden_layers=NUM_LAYERS,
                                        num_attention_heads=NUM_HEADS, num_key_value_heads=2, max_position_embeddings=T,
                                        rms_norm_eps=1e-5, tie_word_embeddings=False,
                                        rope_parameters={"rope_type": "default", "rope_theta": 5e5},
                                        **NO_SPECIAL_TOKENS)
    if case == "gemma":
        return transformers.GemmaConfig(vocab_size=V, hidden_size=D, intermediate_size=96, num_hidden_layers=NUM_LAYERS,
                                        num_attention_heads=NUM_HEADS, num_key_value_heads=1, head_dim=32,
                                        max_position_embeddings=T, hidden_activation="gelu_pytorch_tanh",
                                        **NO_SPECIAL_TOKENS)
    if case == "gpt_neox":
        return transformers.GPTNeoXConfig(vocab_size=V, hidden_size=D, intermediate_size=4 * D,
                                          num_hidden_layers=NUM_LAYERS, num_attention_heads=NUM_HEADS,
                                          hidden_act="gelu_new", max_position_embeddings=T, use_parallel_residual=True,
                                          rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                           "partial_rotary_factor": 0.25},
                                          hidden_dropout=0.0, attention_dropout=0.0, **NO_SPECIAL_TOKENS)
    raise KeyError(case)


CLASSES = {"gpt2": "GPT2LMHeadModel", "llama_gqa": "LlamaForCausalLM", "gemma": "GemmaForCausalLM",
           "gpt_neox": "GPTNeoXForCausalLM"}
CASES = list(CLASSES)


def recipe(case: str, **model: Any) -> dict[str, Any]:
    """Our recipe for the case's model (sizes and the architecture's choices as the flavour and a few fields)."""
    attention: dict[str, Any] = {"num_heads": NUM_HEADS}
    layer: dict[str, Any] = {"type": "dense", "repeat": NUM_LAYERS, "attention": attention}
    base: dict[str, Any] = {"vocab_size": V, "d_model": D, "max_seq_len": T}
    if case == "gpt2":
        base["flavour"] = "gpt2"
    elif case == "llama_gqa":
        base.update(flavour="llama", tie_embeddings=False)
        attention.update(num_kv_heads=2, rope={"base": 5e5})
        layer.update(ffn={"type": "swiglu", "hidden_size": 96})
    elif case == "gemma":
        base["flavour"] = "gemma"
        attention.update(num_kv_heads=1, head_dim=32)
        layer.update(ffn={"type": "geglu", "hidden_size": 96})
    else:
        base["flavour"] = "pythia"
    return {"model": {**base, "layers": [layer], **model}, "data": {"tokenizer": {"vocab_size": V}}}


def hf_model(case: str, seed: int = 0) -> torch.nn.Module:
    return perturbed(CLASSES[case], hf_config(case), seed)


def perturbed(class_name: str, config, seed: int, scale=lambda name: 0.05) -> torch.nn.Module:
    """transformers' `class_name` of `config` (eager attention, float32, eval) with every parameter moved off its
    initial value by scale(name) x N(0, 1)."""
    torch.manual_seed(seed)
    config._attn_implementation = "eager"
    model = getattr(transformers, class_name)(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.add_(scale(name) * torch.randn_like(p))
    return model


def save(model: torch.nn.Module, folder: Path, fmt: str) -> Path:
    """save_pretrained (safetensors; "sharded": several files and model.safetensors.index.json); "bin": config.json
    and pytorch_model.bin of the state dict, as transformers 4's save_pretrained(safe_serialization=False) wrote it
    (transformers 5 writes safetensors only)."""
    model.save_pretrained(folder, **({"max_shard_size": "100KB"} if fmt == "sharded" else {}))
    if fmt == "sharded":
        assert (folder / "model.safetensors.index.json").is_file() and not (folder / "model.safetensors").exists()
    if fmt == "bin":
        (folder / "model.safetensors").unlink()
        torch.save({k: v.contiguous() for k, v in model.state_dict().items()}, folder / "pytorch_model.bin")
    return folder


def tokens(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, V, (2, T), generator=torch.Generator().manual_seed(seed))
