"""The accelerator kernels against their CPU references: the fused gated activation (Triton-generated on CUDA),
torch's grouped GEMM for uneven expert loads (bf16 on CUDA), fused AdamW, FlexAttention is in
tests/layers/test_routed_attention.py. Each runs on CUDA and skips without it; MOEP_TEST_DEVICE=cpu runs the same
checks on the CPU kernels (the CPU paths' own tests live beside their modules)."""
import copy
import os

import pytest
import torch

from moep_ds.layers import glu
from moep_ds.layers.ffn import FFNConfig
from moep_ds.moe.experts import GroupedExperts, choose_kernel

DEVICE = os.environ.get("MOEP_TEST_DEVICE", "cuda")
pytestmark = pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(),
                                reason="accelerator kernels: no CUDA device (MOEP_TEST_DEVICE=cpu runs them on CPU)")
LIBRARY_DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float32  # what F.grouped_mm takes there


@pytest.mark.parametrize("kind", ["swiglu", "geglu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_gated_activation_matches_the_unfused_expression(kind, dtype, monkeypatch):
    """SwiGLU's forward bit-identical (README), GeGLU's forward eager; gradients as autograd's to rounding."""
    monkeypatch.setattr(glu, "FUSED_MIN_NUMEL", 0)
    torch.manual_seed(0)
    gate, up, grad = (torch.randn(257, 96, device=DEVICE).to(dtype) for _ in range(3))
    gate, up = (3 * gate).requires_grad_(), up.requires_grad_()
    out = glu.gated_activation(kind, gate, up)
    assert type(out.grad_fn).__name__ == "FusedGatedActivationBackward"
    assert torch.equal(out, glu.unfused(kind, gate, up))
    fused = torch.autograd.grad(out, (gate, up), grad)
    unfused = torch.autograd.grad(glu.unfused(kind, gate, up), (gate, up), grad)
    for f, u in zip(fused, unfused):
        torch.testing.assert_close(f, u)


@pytest.mark.parametrize("counts", [[40, 0, 72, 16], [128, 0, 0, 0]], ids=["uneven_with_idle", "one_expert"])
def test_library_grouped_mm_matches_the_expert_loop_in_float32(counts):
    """Uneven loads take torch's grouped GEMM (CUDA: bf16); the per-expert loop in fp32 on the CPU is the
    reference for outputs and every gradient."""
    torch.manual_seed(0)
    reference = GroupedExperts(FFNConfig(type="swiglu", hidden_size=64), d_model=32, num_experts=4)
    with torch.no_grad():
        for p in reference.parameters():
            p.normal_(std=0.2)
    experts = copy.deepcopy(reference).to(device=DEVICE, dtype=LIBRARY_DTYPE)
    reference.kernel = "loop"
    x = torch.randn(sum(counts), 32)
    g = torch.randn(sum(counts), 32)
    x_dev = x.to(device=DEVICE, dtype=LIBRARY_DTYPE).requires_grad_()
    assert choose_kernel(x_dev, experts.w1_EDF, counts) == "library"
    y = experts(x_dev, counts)
    grads = torch.autograd.grad(y, [x_dev, *experts.parameters()], g.to(y))
    x_ref = x.clone().requires_grad_()
    y_ref = reference(x_ref, counts)
    grads_ref = torch.autograd.grad(y_ref, [x_ref, *reference.parameters()], g)
    tol = {"rtol": 2e-2, "atol": 2e-2} if LIBRARY_DTYPE == torch.bfloat16 else {}
    torch.testing.assert_close(y.float().cpu(), y_ref, **tol)
    for got, want in zip(grads, grads_ref):
        torch.testing.assert_close(got.float().cpu(), want, **tol)


def test_fused_adamw_matches_the_cpu_update():
    """The recipe's optimizer (torch AdamW, fused=True) on the device against the same on the CPU."""
    from moep_ds.training.optim import build_optimizer
    from moep_ds.train_config import OptimizerConfig

    torch.manual_seed(0)
    cpu = [torch.nn.Parameter(torch.randn(33, 17)), torch.nn.Parameter(torch.randn(17))]
    dev = [torch.nn.Parameter(p.detach().to(DEVICE)) for p in cpu]
    cfg = OptimizerConfig(lr=1e-2, weight_decay=0.1)
    opts = [build_optimizer([{"params": ps, "weight_decay": cfg.weight_decay}], cfg) for ps in (cpu, dev)]
    for step in range(3):
        grads = [torch.randn_like(p) for p in cpu]
        for params, opt in zip((cpu, dev), opts):
            for p, g in zip(params, grads):
                p.grad = g.to(p.device)
            opt.step()
    for a, b in zip(dev, cpu):
        torch.testing.assert_close(a.detach().cpu(), b.detach(), rtol=1e-5, atol=1e-6)
