"""Gated DeltaNet against transformers' Qwen3-Next torch path on the same inputs and weights (float32, forward
and gradients): the chunked and recurrent rules, the whole layer; prefill + token-by-token decoding against the
full forward; a tiny model of gated_deltanet blocks trained with activation checkpointing; init and config errors.

# B batch, T tokens, D model dim, G key heads, H value heads, K head_k_dim, V head_v_dim
"""
from __future__ import annotations

import importlib.util

import pytest
import torch

from moep_ds.layers.gated_deltanet import (
    GatedDeltaNet, GatedDeltaNetConfig, chunk_gated_delta_rule, recurrent_gated_delta_rule,
)
import moep_ds.components  # noqa: F401 - registers the block types
from moep_ds.models.causal_lm import build_model
from moep_ds.models.config import ModelConfig
from moep_ds.registry import ATTENTIONS
from moep_ds.schema import ConfigError, parse, parse_registered
from moep_ds.training.blocks import apply_block_options

transformers = pytest.importorskip("transformers")
from transformers.models.qwen3_next import modeling_qwen3_next as hf  # noqa: E402

B, T, D, G, H, K, V, L = 2, 21, 24, 2, 4, 8, 6, 8  # T = 2 L + 5: a partial last chunk


def test_transformers_runs_its_torch_path():
    """Without fla and causal-conv1d (and on CPU) transformers runs the torch functions compared against here."""
    assert importlib.util.find_spec("fla") is None and importlib.util.find_spec("causal_conv1d") is None


def rule_inputs(seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(B, T, G, K, generator=g), torch.randn(B, T, G, K, generator=g)
    v = torch.randn(B, T, H, V, generator=g)
    decay = -torch.rand(B, T, H, generator=g) * 0.5  # log decays: exp in (0.6, 1]
    beta = torch.rand(B, T, H, generator=g)
    state = torch.randn(B, H, K, V, generator=g)
    return [x.requires_grad_() for x in (q, k, v, decay, beta, state)]


def outputs_and_grads(fn, inputs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...]]:
    o, state = fn(*inputs)
    weights = torch.linspace(-1, 1, o.numel()).view_as(o)  # a loss that weighs every output differently
    grads = torch.autograd.grad((o * weights).sum() + state.square().sum(), inputs)
    return o.detach(), state.detach(), grads


def ours_chunked(q, k, v, g, beta, state):
    return chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=L, initial_state_BHKV=state)


def theirs_chunked(q, k, v, g, beta, state):
    return hf.torch_chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=L, initial_state=state,
                                           output_final_state=True, use_qk_l2norm_in_kernel=True)


def ours_recurrent(q, k, v, g, beta, state):
    return recurrent_gated_delta_rule(q, k, v, g, beta, initial_state_BHKV=state)


def theirs_recurrent(q, k, v, g, beta, state):
    return hf.torch_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=state, output_final_state=True,
                                               use_qk_l2norm_in_kernel=True)


@pytest.mark.parametrize("ours,theirs", [(ours_chunked, theirs_chunked), (ours_recurrent, theirs_recurrent),
                                         (ours_chunked, theirs_recurrent)], ids=["chunked", "recurrent", "forms"])
def test_rules_match_transformers(ours, theirs):
    """Outputs, final states and the gradients of all six inputs (the initial state included)."""
    inputs = rule_inputs()
    o, state, grads = outputs_and_grads(ours, inputs)
    o_ref, state_ref, grads_ref = outputs_and_grads(theirs, inputs)
    torch.testing.assert_close(o, o_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state, state_ref, rtol=1e-5, atol=1e-5)
    for name, grad, grad_ref in zip("q k v g beta state".split(), grads, grads_ref):
        torch.testing.assert_close(grad, grad_ref, rtol=1e-5, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}")


def test_chunked_rule_without_initial_state_and_with_one_chunk():
    q, k, v, g, beta, _ = rule_inputs(1)
    o, state = chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=64)
    o_ref, state_ref = recurrent_gated_delta_rule(q, k, v, g, beta)
    torch.testing.assert_close(o, o_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state, state_ref, rtol=1e-5, atol=1e-5)


def test_forms_agree_in_fp64_and_low_precision_inputs_compute_in_fp32():
    """fp64 stays fp64 (the chunked and recurrent forms agree to 1e-12, a repeated key included, the worst case of
    the triangular solve); bf16 inputs give bf16 outputs of the fp32 computation, and an fp32 state."""
    q, k, v, g, beta, state = (x.detach().double() for x in rule_inputs(2))
    k[:, 5:15] = k[:, 4:5]  # one token repeated over a chunk boundary
    o, s = chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=L, initial_state_BHKV=state)
    o_ref, s_ref = recurrent_gated_delta_rule(q, k, v, g, beta, initial_state_BHKV=state)
    assert o.dtype == s.dtype == torch.float64
    torch.testing.assert_close(o, o_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(s, s_ref, rtol=1e-12, atol=1e-12)
    low = [x.bfloat16() for x in (q, k, v, g, beta)]
    o_low, s_low = chunk_gated_delta_rule(*low, chunk_size=L)
    o_32, _ = chunk_gated_delta_rule(*(x.float() for x in low), chunk_size=L)
    assert o_low.dtype == torch.bfloat16 and s_low.dtype == torch.float32
    assert torch.equal(o_low, o_32.bfloat16())


def our_config(**kw) -> GatedDeltaNetConfig:
    return GatedDeltaNetConfig(num_k_heads=G, num_v_heads=H, head_k_dim=K, head_v_dim=V, chunk_size=L, **kw)


@pytest.fixture(scope="module")
def layers() -> tuple[GatedDeltaNet, torch.nn.Module]:
    config = transformers.Qwen3NextConfig(
        hidden_size=D, linear_num_key_heads=G, linear_num_value_heads=H, linear_key_head_dim=K,
        linear_value_head_dim=V, linear_conv_kernel_dim=4, rms_norm_eps=1e-6, hidden_act="silu",
        num_hidden_layers=1, layer_types=["linear_attention"])
    torch.manual_seed(0)
    theirs = hf.Qwen3NextGatedDeltaNet(config, layer_idx=0).float()
    with torch.no_grad():
        for name, p in theirs.named_parameters():
            p.copy_(torch.randn_like(p) * (0.3 if p.dim() > 1 else 0.5) + (1.0 if name == "norm.weight" else 0.0))
    ours = GatedDeltaNet(our_config(), d_model=D)
    ours.load_state_dict(theirs.state_dict())  # the same names and shapes: an import maps them 1:1
    return ours, theirs


def test_layer_matches_transformers(layers):
    ours, theirs = layers
    x = torch.randn(B, T, D, generator=torch.Generator().manual_seed(2))
    x_ours, x_theirs = x.clone().requires_grad_(), x.clone().requires_grad_()
    y = ours(x_ours, None)
    y_ref = theirs(x_theirs)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    weights = torch.randn(y.shape, generator=torch.Generator().manual_seed(3))
    (y * weights).sum().backward()
    (y_ref * weights).sum().backward()
    # a token's input gradient sums over the chunks after it, in another order than transformers': fp32 rounding
    # relative to the largest entry (53 here; 3.8e-5 apart at worst on an AMD EPYC)
    torch.testing.assert_close(x_ours.grad, x_theirs.grad, rtol=1e-5, atol=1e-5 * x_theirs.grad.abs().max().item())
    theirs_params = dict(theirs.named_parameters())
    for name, p in ours.named_parameters():
        ref = theirs_params[name].grad  # sums over B T tokens: fp32 rounding relative to its largest entry
        torch.testing.assert_close(p.grad, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item(),
                                   msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("prefill", [0, 2, 9])
@torch.no_grad()
def test_prefill_then_decoding_equals_full_forward(layers, prefill):
    """A prefill shorter than the convolution's W - 1 inputs (2), one beyond a chunk (9), and none (0: the first
    token opens the cache): every decoded position equals the full forward's."""
    ours, _ = layers
    x = torch.randn(B, T, D, generator=torch.Generator().manual_seed(4))
    full = ours(x, None)
    cache = ours.new_cache()
    steps = [ours(x[:, :prefill], None, cache)] if prefill else []
    steps += [ours(x[:, t:t + 1], None, cache) for t in range(prefill, T)]
    # the recurrence and the chunked form sum in other orders: fp32 rounding relative to the largest output (9.7 here;
    # 1.3e-5 apart at worst on an AMD EPYC)
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-5, atol=1e-5 * full.abs().max().item())
    assert cache.conv_BCW.shape == (B, our_config().conv_channels, 3) and cache.state_BHKV.shape == (B, H, K, V)


def tiny_model():
    """Two llama-flavoured dense blocks (the flavour's RoPE preset does not reach gated_deltanet)."""
    attention = {"type": "gated_deltanet", "num_k_heads": 2, "num_v_heads": 4, "head_k_dim": 8, "head_v_dim": 8,
                 "chunk_size": 8}
    raw = {"flavour": "llama", "vocab_size": 64, "d_model": 32, "max_seq_len": 24,
           "layers": [{"type": "dense", "attention": attention, "ffn": {"type": "swiglu", "hidden_size": 48}}] * 2}
    return build_model(parse(ModelConfig, raw, "model"))


def test_tiny_model_trains_with_activation_checkpointing():
    """From scratch, blocks checkpointed: the loss falls on a fixed batch; gradients equal the plain model's."""
    torch.manual_seed(0)
    model, plain = tiny_model(), tiny_model()
    plain.load_state_dict(model.state_dict())
    apply_block_options(model, activation_checkpointing=True, compile=False)
    ids = torch.randint(0, 64, (2, 21), generator=torch.Generator().manual_seed(5))
    plain(ids[:, :-1], labels=ids[:, 1:]).loss.backward()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(5):
        optimizer.zero_grad()
        loss = model(ids[:, :-1], labels=ids[:, 1:]).loss
        loss.backward()
        if step == 0:
            for (name, p), q in zip(model.named_parameters(), plain.parameters()):
                torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=lambda m, name=name: f"{name}: {m}")
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.2, losses


@torch.no_grad()
def test_init_as_transformers():
    model = tiny_model()
    layer = model.blocks[0].attention.attn
    assert torch.equal(layer.dt_bias, torch.ones(4)) and torch.equal(layer.norm.weight, torch.ones(8))
    A = layer.A_log.exp()
    assert A.min() >= 0.01 and A.max() <= 16
    assert layer.conv1d.weight.std().item() == pytest.approx(0.02, rel=0.3)
    assert layer.out_proj.weight.std() < layer.in_proj_qkvz.weight.std()  # a residual output: out_scale < 1


def test_flops_count_the_chunked_rule():
    """The count's matmul part is what torch's FLOP counter sees in a forward (the triangular solve, which it does
    not count, is the rest); linear in T, chunks no longer than T."""
    from torch.utils.flop_counter import FlopCounterMode

    layer = GatedDeltaNet(our_config(), d_model=D)
    q, k, v, g, beta, _ = (x.detach() for x in rule_inputs())
    with FlopCounterMode(display=False) as counter:
        chunk_gated_delta_rule(q[:, :16], k[:, :16], v[:, :16], g[:, :16], beta[:, :16], chunk_size=L)
    solve = H * L * (K + V)
    assert (layer.attention_flops_per_token(16) / 3 - solve) * 16 * B == counter.get_total_flops()
    assert layer.attention_flops_per_token(1000) == layer.attention_flops_per_token(100)
    assert layer.attention_flops_per_token(4) < layer.attention_flops_per_token(L)


def test_config_errors():
    assert "gated_deltanet" in ATTENTIONS.names()
    raw = {"type": "gated_deltanet", "num_k_heads": 3, "num_v_heads": 4, "head_k_dim": 8, "head_v_dim": 8}
    with pytest.raises(ConfigError) as err:
        parse_registered(ATTENTIONS, raw, "model.layers[0].attention").check_dims("model.layers[0].attention", 32)
    assert str(err.value) == "model.layers[0].attention.num_v_heads (4) must be a multiple of num_k_heads (3)"
