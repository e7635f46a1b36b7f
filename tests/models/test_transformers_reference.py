"""Each dense flavour against the architecture it names, as transformers implements it: an independent reference
(GPT2LMHeadModel, LlamaForCausalLM, GemmaForCausalLM, GPTNeoXForCausalLM), not our HF export, which wraps our own
code. Our weights, copied over by the name/layout map that moep-import and the native export use
(moep_ds/interop/families/), must give the same logits.

# B batch, T tokens, D model dim, H query heads, G key/value heads, Dh head dim, F FFN hidden dim, V vocabulary

The reference configs state each architecture's own choices (activation, norm eps, rotary share and base,
residual form, tying) as constants here, never read from our model, so a flavour that drifts from them fails.
Only sizes come from the case. Every parameter is moved off its initial value first (norm scales off 1, biases
off 0, Gemma's (1 + w) offsets off 0), so a mapping that drops or swaps a norm, a bias or a projection fails too.
"""
from __future__ import annotations

from typing import Any, Callable

import pytest
import torch

from moep_ds import build_model
from moep_ds.config import config_from_dict
from moep_ds.layers.ffn import ffn_hidden_size
from moep_ds.models.causal_lm import CausalLM

transformers = pytest.importorskip("transformers")

V, D, T, B, NUM_LAYERS, NUM_HEADS = 97, 64, 16, 2, 2, 4
TOLERANCE = {"rtol": 1e-5, "atol": 1e-5}  # float32; a real difference (GELU variant, rotary layout) is far above
NO_SPECIAL_TOKENS = {"bos_token_id": None, "eos_token_id": None, "pad_token_id": None}  # ids beyond a tiny vocab


def moep_model(flavour: str, attention: dict[str, Any], model: dict[str, Any]) -> CausalLM:
    raw = {"model": {"flavour": flavour, "vocab_size": V, "d_model": D, "max_seq_len": T, **model,
                     "layers": [{"type": "dense", "repeat": NUM_LAYERS,
                                 "attention": {"num_heads": NUM_HEADS, **attention}}]}}
    torch.manual_seed(0)
    ours = build_model(config_from_dict(raw).model)
    with torch.no_grad():
        for p in ours.parameters():  # tied embeddings are one parameter: perturbed once
            p.add_(0.05 * torch.randn_like(p))
    return ours.eval()


def sizes(ours: CausalLM) -> dict[str, int]:
    """The sizes the case asked for, from our config (not our modules, so a block that ignored one would fail)."""
    layer = ours.cfg.layers[0]
    return {"num_heads": layer.attention.num_heads, "num_kv_heads": layer.attention.kv_heads,
            "head_dim": layer.attention.resolved_head_dim(D), "hidden": ffn_hidden_size(layer.ffn, D)}


def build_reference(class_name: str, config: Any, ours: CausalLM, architecture: str) -> torch.nn.Module:
    """The transformers model with our weights; strict loading: every reference tensor mapped, nothing left over."""
    if not hasattr(transformers, class_name):
        pytest.skip(f"transformers {transformers.__version__} has no {class_name}")
    config._attn_implementation = "eager"  # the plain softmax(q k^T * scale + mask) v, not SDPA
    reference = getattr(transformers, class_name)(config).float().eval()
    keys = set(reference.state_dict())
    reference.load_state_dict(hf_state_dict(ours, architecture, keys), strict=True)
    return reference


def hf_state_dict(ours: CausalLM, architecture: str, reference_keys: set[str]) -> dict[str, torch.Tensor]:
    """Our weights under the architecture's names and layouts, by the one map that import and export use
    (moep_ds/interop/families/). The head goes under whichever of its spellings the reference class has."""
    from moep_ds.interop.families import families

    family = families()[architecture]
    state = dict(ours.named_parameters())
    sd = {key: t for rule in family.rules(ours.cfg, family.hf_config(ours.cfg))
          for key, t in zip(rule.theirs, rule.to_theirs(state[rule.ours].detach()))}
    head = next(k for k in family.head_keys if k in reference_keys)
    sd.update({head: sd.pop(k) for k in family.head_keys if k in sd})
    if ours.cfg.tie_embeddings:  # the map stores a tied head once; the reference's state dict names it twice
        sd[head] = ours.head.weight.detach()
    return sd


def gpt2_reference(ours: CausalLM) -> torch.nn.Module:
    """GPT-2: learned positions, pre-LN, LayerNorm eps 1e-5, gelu_new (tanh GELU) MLP with biases, tied head."""
    s = sizes(ours)
    config = transformers.GPT2Config(
        vocab_size=V, n_positions=T, n_embd=D, n_layer=NUM_LAYERS, n_head=s["num_heads"], n_inner=s["hidden"],
        activation_function="gelu_new", layer_norm_epsilon=1e-5, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        tie_word_embeddings=True, **NO_SPECIAL_TOKENS)
    return build_reference("GPT2LMHeadModel", config, ours, "gpt2")


def llama_like_config(ours: CausalLM, rope_theta: float, tie_word_embeddings: bool) -> dict[str, Any]:
    s = sizes(ours)
    return dict(vocab_size=V, hidden_size=D, intermediate_size=s["hidden"], num_hidden_layers=NUM_LAYERS,
                num_attention_heads=s["num_heads"], num_key_value_heads=s["num_kv_heads"], head_dim=s["head_dim"],
                max_position_embeddings=T, attention_bias=False, tie_word_embeddings=tie_word_embeddings,
                rope_parameters={"rope_type": "default", "rope_theta": rope_theta}, **NO_SPECIAL_TOKENS)


def llama_reference(ours: CausalLM, *, rope_theta: float = 10000.0, tie_word_embeddings: bool) -> torch.nn.Module:
    """Llama: RMSNorm (eps 1e-5, Llama 2's), SiLU-gated MLP, no biases, RoPE on every head dim. Tying is the
    recipe's choice (the flavour leaves it to `tie_embeddings`), so each case states it."""
    config = transformers.LlamaConfig(hidden_act="silu", mlp_bias=False, rms_norm_eps=1e-5,
                                      **llama_like_config(ours, rope_theta, tie_word_embeddings))
    return build_reference("LlamaForCausalLM", config, ours, "llama")


def gemma_reference(ours: CausalLM) -> torch.nn.Module:
    """Gemma: (1 + w) RMSNorm of eps 1e-6 (our norms hold the same offset w), tanh-GELU gated MLP, embeddings
    times sqrt(D), tied head."""
    config = transformers.GemmaConfig(hidden_activation="gelu_pytorch_tanh", rms_norm_eps=1e-6,
                                      **llama_like_config(ours, rope_theta=10000.0, tie_word_embeddings=True))
    return build_reference("GemmaForCausalLM", config, ours, "gemma")


def gpt_neox_reference(ours: CausalLM) -> torch.nn.Module:
    """Pythia (GPT-NeoX): rotary on 25 % of each head's dims, base 10000, parallel residual, LayerNorm eps 1e-5,
    biases everywhere, untied head; gelu_new is the tanh formula of the fused bias-GELU Pythia trained with
    (docs/FIDELITY.md; the released HF config says exact "gelu", for inference)."""
    s = sizes(ours)
    config = transformers.GPTNeoXConfig(
        vocab_size=V, hidden_size=D, intermediate_size=s["hidden"], num_hidden_layers=NUM_LAYERS,
        num_attention_heads=s["num_heads"], hidden_act="gelu_new", max_position_embeddings=T, layer_norm_eps=1e-5,
        use_parallel_residual=True, attention_bias=True, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        hidden_dropout=0.0, attention_dropout=0.0, **NO_SPECIAL_TOKENS)
    return build_reference("GPTNeoXForCausalLM", config, ours, "gpt_neox")


# id: (flavour, attention overrides, model overrides, reference builder with this case's stated choices)
CASES: dict[str, tuple[str, dict[str, Any], dict[str, Any], Callable[[CausalLM], torch.nn.Module]]] = {
    "gpt2": ("gpt2", {}, {}, gpt2_reference),
    "llama": ("llama", {}, {}, lambda ours: llama_reference(ours, tie_word_embeddings=True)),
    # grouped-query attention, untied head, a non-default rotary base (as Mixtral's)
    "llama_gqa_untied": ("llama", {"num_kv_heads": 2, "rope": {"base": 1e6}}, {"tie_embeddings": False},
                         lambda ours: llama_reference(ours, rope_theta=1e6, tie_word_embeddings=False)),
    "gemma_mqa": ("gemma", {"num_kv_heads": 1}, {}, gemma_reference),  # one key/value head, as Gemma-2B
    "gemma_wide_heads": ("gemma", {"head_dim": 32}, {}, gemma_reference),  # H * Dh = 2D, as Gemma-7B (16 x 256)
    "pythia": ("pythia", {}, {}, gpt_neox_reference),
}


@pytest.mark.parametrize("case", CASES)
def test_logits_match_transformers_implementation_of_the_flavour(case):
    flavour, attention, model, reference_of = CASES[case]
    ours = moep_model(flavour, attention, model)
    reference = reference_of(ours)
    ids_BT = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours_BTV, reference_BTV = ours(ids_BT).logits, reference(ids_BT).logits
    assert ours_BTV.shape == reference_BTV.shape == (B, T, V)
    # equal weights would hide a tied head where the architecture has an untied one
    tied = reference.get_output_embeddings().weight is reference.get_input_embeddings().weight
    assert (ours.head.weight is ours.embed.weight) == tied
    assert float(ours_BTV.std()) > 0.1  # logits far from constant: the tolerance below is a real constraint
    torch.testing.assert_close(ours_BTV, reference_BTV, **TOLERANCE)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gemma_embedding_scale_is_rounded_to_the_activation_dtype(dtype):
    """Gemma multiplies embeddings by sqrt(D) cast to their dtype (bf16: sqrt(512) = 22.627 -> 22.625, and at
    Gemma-7B's D 3072, 55.43 -> 55.5), as its JAX and PyTorch releases and transformers do. At D 512 (our
    gemma recipes' width) sqrt(D) is not representable in half precision, unlike the D of the test above."""
    d_model = 512
    raw = {"model": {"flavour": "gemma", "vocab_size": V, "d_model": d_model, "max_seq_len": T,
                     "layers": [{"type": "dense", "attention": {"num_heads": NUM_HEADS}}]}}
    torch.manual_seed(0)
    ours = build_model(config_from_dict(raw).model).to(dtype)
    modeling_gemma = pytest.importorskip("transformers.models.gemma.modeling_gemma")
    reference_class = getattr(modeling_gemma, "GemmaTextScaledWordEmbedding", None)
    if reference_class is None:  # older releases scale inside GemmaModel.forward
        pytest.skip(f"transformers {transformers.__version__} has no GemmaTextScaledWordEmbedding")
    reference = reference_class(V, d_model, padding_idx=0, embed_scale=d_model**0.5).to(dtype)
    reference.weight.data.copy_(ours.embed.weight)
    ids_BT = torch.arange(V)[None]
    with torch.no_grad():
        ours_BTD = ours.embed_tokens(ids_BT, positions_BT=torch.zeros_like(ids_BT))
        torch.testing.assert_close(ours_BTD, reference(ids_BT), rtol=0, atol=0)
