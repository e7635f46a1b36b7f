"""Attention sinks (gpt-oss): CausalSelfAttention with `sinks: true` against transformers' GptOssAttention (eager)
on the same weights, sliding and full layers, GQA, YaRN; and KV-cache decoding against the full forward."""
import pytest
import torch
from transformers.masking_utils import sliding_window_causal_mask_function, causal_mask_function
from transformers.models.gpt_oss.configuration_gpt_oss import GptOssConfig
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssAttention, GptOssRotaryEmbedding

from moep_ds.layers.attention import AttentionConfig, CausalSelfAttention
from moep_ds.layers.rope import RopeConfig, YarnConfig

D, H, G, DH, T, WINDOW = 32, 4, 2, 8, 7, 3


def hf_config() -> GptOssConfig:
    return GptOssConfig(
        hidden_size=D, num_attention_heads=H, num_key_value_heads=G, head_dim=DH, sliding_window=WINDOW,
        num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"], attention_bias=True,
        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 4096},
        max_position_embeddings=131072, attn_implementation="eager")


def our_config(window: int | None) -> AttentionConfig:
    yarn = YarnConfig(factor=32.0, original_max_seq_len=4096, truncate=False)
    return AttentionConfig(num_heads=H, num_kv_heads=G, head_dim=DH, window=window, bias=True, sinks=True,
                           rope=RopeConfig(base=150000.0, yarn=yarn))


def copy_weights(ours: CausalSelfAttention, hf: GptOssAttention) -> None:
    with torch.no_grad():
        ours.w_qkv.weight.copy_(torch.cat([hf.q_proj.weight, hf.k_proj.weight, hf.v_proj.weight]))
        ours.w_qkv.bias.copy_(torch.cat([hf.q_proj.bias, hf.k_proj.bias, hf.v_proj.bias]))
        ours.w_o.weight.copy_(hf.o_proj.weight)
        ours.w_o.bias.copy_(hf.o_proj.bias)
        ours.sinks.copy_(hf.sinks)


def hf_mask(window: int | None) -> torch.Tensor:
    """Additive [1, 1, T, T] mask as transformers' eager path receives it."""
    allow = sliding_window_causal_mask_function(window) if window else causal_mask_function
    idx = torch.arange(T)
    keep = allow(torch.tensor(0), torch.tensor(0), idx[:, None], idx[None, :])
    return torch.zeros(T, T).masked_fill(~keep, torch.finfo(torch.float32).min)[None, None]


@pytest.fixture(scope="module")
def pairs():
    torch.manual_seed(0)
    config = hf_config()
    out = {}
    for layer_idx, window in ((0, WINDOW), (1, None)):
        hf = GptOssAttention(config, layer_idx)
        for p in hf.parameters():
            torch.nn.init.normal_(p, std=0.2)
        torch.nn.init.normal_(hf.sinks, std=1.0)  # sinks that take a real share of each row
        ours = CausalSelfAttention(our_config(window), d_model=D)
        copy_weights(ours, hf)
        out[window] = (ours, hf, GptOssRotaryEmbedding(config))
    return out


@pytest.mark.parametrize("window", [WINDOW, None], ids=["sliding", "full"])
def test_sink_attention_equals_gpt_oss_forward_and_gradients(pairs, window):
    ours, hf, rotary = pairs[window]
    assert hf.sliding_window == window
    x = torch.randn(2, T, D)
    positions = torch.arange(T).expand(2, T)
    x_ours, x_hf = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_ours = ours(x_ours, positions)
    y_hf, _ = hf(x_hf, rotary(x_hf, positions), hf_mask(window))
    torch.testing.assert_close(y_ours, y_hf, atol=1e-5, rtol=1e-5)
    g = torch.randn_like(y_hf)
    (y_ours * g).sum().backward()
    (y_hf * g).sum().backward()
    torch.testing.assert_close(x_ours.grad, x_hf.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours.sinks.grad, hf.sinks.grad, atol=1e-5, rtol=1e-5)
    H_DH = H * DH
    torch.testing.assert_close(ours.w_qkv.weight.grad[:H_DH], hf.q_proj.weight.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours.w_qkv.weight.grad[-G * DH:], hf.v_proj.weight.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours.w_o.weight.grad, hf.o_proj.weight.grad, atol=1e-5, rtol=1e-5)
    ours.zero_grad(), hf.zero_grad()


@pytest.mark.parametrize("window", [WINDOW, None], ids=["sliding", "full"])
def test_sink_attention_decoding_token_by_token_equals_full_forward(pairs, window):
    ours = pairs[window][0]
    x = torch.randn(2, T, D)
    positions = torch.arange(T).expand(2, T)
    with torch.no_grad():
        full = ours(x, positions)
        cache = ours.new_cache()
        steps = [ours(x[:, :2], positions[:, :2], cache)]  # a prompt, then one token at a time
        steps += [ours(x[:, t:t + 1], positions[:, t:t + 1], cache) for t in range(2, T)]
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-5, rtol=1e-5)


def test_sinks_are_a_parameter_per_head_initialised_normal():
    torch.manual_seed(0)
    layer = CausalSelfAttention(AttentionConfig(num_heads=H, num_kv_heads=G, sinks=True), d_model=D)
    assert dict(layer.named_parameters())["sinks"].shape == (H,)
    assert 0 < layer.sinks.abs().max() < 0.2  # normal(0, 0.02), not left at zero
    plain = CausalSelfAttention(AttentionConfig(num_heads=H), d_model=D)
    assert "sinks" not in dict(plain.named_parameters())
