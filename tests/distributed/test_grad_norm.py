"""ZeRO-0 fp32 clipping by the norm of the whole gradient (distributed/grad_norm.py); the expert-parallel case runs
in test_train_distributed.py (expert parallel 2 == 1 under ZeRO-0)."""
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from moep_ds.distributed.grad_norm import ExactClipping, model_grad_norm


def model_with_grads(scale: float) -> nn.Module:
    torch.manual_seed(0)
    model = nn.ModuleDict({"dense": nn.Linear(5, 7), "experts": nn.Linear(7, 3, bias=False)})
    model.experts.weight.allreduce = False  # DeepSpeed's mark of an expert parameter
    model.dense.bias.requires_grad_(False)
    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.randn_like(p) * scale
    return model


def test_norm_covers_replicated_and_expert_gradients():
    model = model_with_grads(1.0)
    grads = [p.grad.reshape(-1) for p in model.parameters() if p.grad is not None]
    want = torch.linalg.vector_norm(torch.cat(grads).double())
    params = [p for p in model.parameters() if p.requires_grad]
    torch.testing.assert_close(model_grad_norm(params).double(), want, rtol=1e-6, atol=0)
    only_experts = [model.experts.weight]
    torch.testing.assert_close(model_grad_norm(only_experts).double(),
                               torch.linalg.vector_norm(model.experts.weight.grad.double()), rtol=1e-6, atol=0)


@pytest.mark.parametrize("scale,clipped", [(10.0, True), (1e-3, False)])
def test_clipping_scales_to_max_norm_and_keeps_the_norm(scale, clipped):
    model = model_with_grads(scale)
    before = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    engine = SimpleNamespace(module=model, gradient_clipping=lambda: 0.5)
    clipping = ExactClipping.install(engine)
    assert engine.clip_fp32_gradients is clipping and clipping.last_norm is None
    engine.clip_fp32_gradients()
    norm = float(torch.linalg.vector_norm(torch.cat([g.reshape(-1) for g in before.values()])))
    assert float(clipping.last_norm) == pytest.approx(norm, rel=1e-6)
    coef = min(1.0, 0.5 / (norm + 1e-6))
    assert (coef < 1.0) == clipped
    for name, p in model.named_parameters():
        if name in before:
            torch.testing.assert_close(p.grad, before[name] * coef)
    after = float(model_grad_norm([p for p in model.parameters() if p.requires_grad]))
    assert after == pytest.approx(0.5 if clipped else norm, rel=1e-5)
