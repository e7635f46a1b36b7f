import torch

from moep_ds.layers.ffn import FFNConfig, build_ffn, ffn_hidden_size
from moep_ds.layers.norm import NormConfig, build_norm


def test_rmsnorm_matches_formula_and_gemma_scale_is_one_plus_w():
    x = torch.randn(3, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    rms = build_norm(NormConfig(type="rmsnorm", eps=1e-6), 8).double()
    gemma = build_norm(NormConfig(type="gemma_rmsnorm", eps=1e-6), 8).double()
    scale = torch.linspace(0.5, 2.0, 8, dtype=torch.float64)  # the float64 values themselves, not float32 ones
    with torch.no_grad():
        rms.weight.copy_(scale)
        gemma.weight.copy_(scale - 1.0)
    ref = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * scale
    torch.testing.assert_close(rms(x), ref)
    torch.testing.assert_close(gemma(x), ref)


def test_norms_use_the_configured_eps():
    x = torch.randn(3, 8, dtype=torch.float64) * 0.3  # small activations: a large eps changes the output
    layer = build_norm(NormConfig(type="layernorm", eps=0.5), 8).double()
    centred = x - x.mean(-1, keepdim=True)
    torch.testing.assert_close(layer(x), centred / torch.sqrt(centred.pow(2).mean(-1, keepdim=True) + 0.5))
    rms = build_norm(NormConfig(type="rmsnorm", eps=0.5), 8).double()
    torch.testing.assert_close(rms(x), x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 0.5))


def test_layernorm_without_bias():
    norm = build_norm(NormConfig(type="layernorm", bias=False), 8)
    assert norm.bias is None


def test_ffn_hidden_size_rule():
    assert ffn_hidden_size(FFNConfig(type="swiglu"), 256) == 680  # 682.7 -> nearest multiple of 8
    assert ffn_hidden_size(FFNConfig(type="geglu"), 512) == 1368  # 1365.3 -> 1368
    assert ffn_hidden_size(FFNConfig(type="gelu"), 512) == 2048
    assert ffn_hidden_size(FFNConfig(type="swiglu", hidden_size=100), 512) == 100


def test_swiglu_and_geglu_formulas():
    torch.manual_seed(0)
    x = torch.randn(5, 16, dtype=torch.float64)
    for kind, act in [("swiglu", torch.nn.functional.silu),
                      ("geglu", lambda h: torch.nn.functional.gelu(h, approximate="tanh"))]:
        ffn = build_ffn(FFNConfig(type=kind, hidden_size=24), 16).double()
        ref = (act(x @ ffn.w1.weight.T) * (x @ ffn.w3.weight.T)) @ ffn.w2.weight.T
        torch.testing.assert_close(ffn(x), ref)
    for kind, approximate in [("gelu", "none"), ("gelu_tanh", "tanh")]:
        gelu = build_ffn(FFNConfig(type=kind, bias=True), 16).double()
        h = x @ gelu.w_in.weight.T + gelu.w_in.bias
        ref = torch.nn.functional.gelu(h, approximate=approximate) @ gelu.w_out.weight.T + gelu.w_out.bias
        torch.testing.assert_close(gelu(x), ref)
    # GPT-NeoX's bias_gelu (pythia-1b.yml: bias-gelu-fusion) and GPT-2's gelu_new, written out
    tanh_gelu = 0.5 * h * (1 + torch.tanh(0.7978845608028654 * h * (1 + 0.044715 * h * h)))
    torch.testing.assert_close(gelu(x), tanh_gelu @ gelu.w_out.weight.T + gelu.w_out.bias)
