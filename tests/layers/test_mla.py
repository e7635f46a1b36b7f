"""Multi-head latent attention against transformers' DeepseekV3Attention on the same weights (float32, with and
without a low-rank query, with and without YaRN), latent-cache decoding against the full forward, and activation
checkpointing.

# B batch, T tokens, D model dim
"""
from __future__ import annotations

import pytest
import torch

from moep_ds.layers.mla import MLAConfig, MultiHeadLatentAttention
from moep_ds.layers.rope import RopeConfig, YarnConfig

transformers = pytest.importorskip("transformers")

D, H, C, Q, N, R, V = 32, 4, 12, 16, 8, 4, 6
B, T = 2, 40  # beyond YaRN's original length (16): the stretched frequencies matter
YARN = {"rope_type": "yarn", "rope_theta": 500.0, "factor": 4.0, "original_max_position_embeddings": 16,
        "mscale": 1.0, "mscale_all_dim": 0.8, "beta_fast": 8.0, "beta_slow": 1.0}
PLAIN = {"rope_type": "default", "rope_theta": 500.0}


def our_config(q_lora_rank: int | None, yarn: bool) -> MLAConfig:
    scaling = YarnConfig(factor=4.0, original_max_seq_len=16, mscale=1.0, mscale_all_dim=0.8, beta_fast=8.0,
                         beta_slow=1.0) if yarn else None
    return MLAConfig(num_heads=H, q_lora_rank=q_lora_rank, kv_lora_rank=C, qk_nope_head_dim=N, qk_rope_head_dim=R,
                     v_head_dim=V, rope=RopeConfig(base=500.0, yarn=scaling))


def hf_attention(q_lora_rank: int | None, yarn: bool):
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as m

    config = transformers.DeepseekV3Config(
        hidden_size=D, num_attention_heads=H, num_key_value_heads=H, q_lora_rank=q_lora_rank, kv_lora_rank=C, qk_nope_head_dim=N,
        qk_rope_head_dim=R, v_head_dim=V, rope_interleave=False, max_position_embeddings=64,
        rope_parameters=dict(YARN if yarn else PLAIN))
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    attention = m.DeepseekV3Attention(config, layer_idx=0).float().eval()
    with torch.no_grad():
        for p in attention.parameters():
            p.copy_(torch.randn_like(p) * 0.3 + (1.0 if p.dim() == 1 else 0.0))  # norm scales near 1
    return attention, m.DeepseekV3RotaryEmbedding(config)


@torch.no_grad()
def copied(hf, q_lora_rank: int | None, yarn: bool) -> MultiHeadLatentAttention:
    ours = MultiHeadLatentAttention(our_config(q_lora_rank, yarn), d_model=D).float().eval()
    names = {"w_kv_a": "kv_a_proj_with_mqa", "kv_norm": "kv_a_layernorm", "w_kv_b": "kv_b_proj", "w_o": "o_proj"}
    names.update({"w_q": "q_proj"} if q_lora_rank is None else
                 {"w_q_a": "q_a_proj", "q_norm": "q_a_layernorm", "w_q_b": "q_b_proj"})
    for ours_name, theirs in names.items():
        getattr(ours, ours_name).weight.copy_(getattr(hf, theirs).weight)
    return ours


def hf_forward(hf, rotary, x_BTD: torch.Tensor) -> torch.Tensor:
    positions = torch.arange(T)[None].expand(B, T)
    mask = torch.full((T, T), float("-inf")).triu(1)[None, None].expand(B, 1, T, T)
    return hf(x_BTD, position_embeddings=rotary(x_BTD, positions), attention_mask=mask)[0]


@pytest.mark.parametrize("yarn", [False, True])
@pytest.mark.parametrize("q_lora_rank", [Q, None])
def test_mla_equals_transformers_deepseek_v3_attention(q_lora_rank, yarn):
    hf, rotary = hf_attention(q_lora_rank, yarn)
    ours = copied(hf, q_lora_rank, yarn)
    x_BTD = torch.randn(B, T, D)
    positions = torch.arange(T)[None].expand(B, T)
    with torch.no_grad():
        out = ours(x_BTD, positions)
        torch.testing.assert_close(out, hf_forward(hf, rotary, x_BTD), rtol=1e-5, atol=1e-5)
        if yarn:  # YaRN's frequencies, attention factor and softmax mscale all took part
            assert ours.scale != (N + R) ** -0.5
            plain = copied(hf, q_lora_rank, yarn=False)
            assert not torch.allclose(plain(x_BTD, positions), out, atol=1e-3)


@pytest.mark.parametrize("q_lora_rank", [Q, None])
def test_latent_cache_decoding_equals_full_forward(q_lora_rank):
    torch.manual_seed(1)
    layer = MultiHeadLatentAttention(our_config(q_lora_rank, yarn=True), d_model=D).double()
    x = torch.randn(B, 10, D, dtype=torch.float64)
    positions = torch.arange(10).expand(B, 10)
    full = layer(x, positions)
    cache = layer.new_cache()
    pieces = [layer(x[:, a:b], positions[:, a:b], cache) for a, b in [(0, 4), (4, 5), (5, 9), (9, 10)]]
    torch.testing.assert_close(torch.cat(pieces, dim=1), full)
    # the cache keeps the latent and the one rotary key per token, not per-head keys and values
    assert cache.k_BGSd.shape == (B, 1, 10, C) and cache.v_BGSd.shape == (B, 1, 10, R)
    assert layer.cache_numbers_per_token() == C + R < 2 * H * (N + R)


def test_mla_block_under_activation_checkpointing_has_the_same_gradients():
    from moep_ds.blocks.dense import DenseBlock, DenseBlockConfig
    from moep_ds.layers.ffn import FFNConfig
    from moep_ds.layers.norm import NormConfig
    from moep_ds.training.blocks import checkpointed

    cfg = DenseBlockConfig(attention=our_config(Q, yarn=True), ffn=FFNConfig(type="swiglu", hidden_size=48),
                           norm=NormConfig(type="rmsnorm"))
    torch.manual_seed(2)
    block = DenseBlock(cfg, d_model=D, layer_idx=0).double().train()
    x = torch.randn(B, 12, D, dtype=torch.float64)
    positions = torch.arange(12).expand(B, 12)

    def grads(forward):
        block.zero_grad()
        forward(x, positions_BT=positions).x.square().sum().backward()
        return {n: p.grad.clone() for n, p in block.named_parameters()}

    plain, recomputed = grads(block.forward), grads(checkpointed(block.forward, block))
    assert plain.keys() == recomputed.keys() and any(n.endswith("w_kv_b.weight") for n in plain)
    for name in plain:
        torch.testing.assert_close(recomputed[name], plain[name], msg=name)
