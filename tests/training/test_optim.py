"""The recipe's optimizer: torch's fused AdamW, against a naive AdamW in float64."""
from __future__ import annotations

import torch

from moep_ds.train_config import OptimizerConfig
from moep_ds.training.optim import build_optimizer


def naive_adamw(p, grads, lr, betas, eps, wd):
    """Loshchilov & Hutter's AdamW (decoupled decay), bias-corrected, one float64 step per gradient."""
    p, m, v = p.double().clone(), torch.zeros_like(p, dtype=torch.float64), torch.zeros_like(p, dtype=torch.float64)
    for t, g in enumerate(grads, start=1):
        g = g.double()
        p = p * (1 - lr * wd)
        m = betas[0] * m + (1 - betas[0]) * g
        v = betas[1] * v + (1 - betas[1]) * g * g
        p = p - lr * (m / (1 - betas[0] ** t)) / ((v / (1 - betas[1] ** t)).sqrt() + eps)
    return p


def test_fused_adamw_matches_the_naive_update_per_group():
    cfg = OptimizerConfig(lr=1e-2, betas=[0.9, 0.95], eps=1e-8, weight_decay=0.1)
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(7, 5, generator=gen), torch.randn(11, generator=gen)
    pa, pb = torch.nn.Parameter(a.clone()), torch.nn.Parameter(b.clone())
    opt = build_optimizer([{"params": [pa], "weight_decay": cfg.weight_decay},
                           {"params": [pb], "weight_decay": 0.0}], cfg)
    assert all(group["fused"] for group in opt.param_groups)
    grads_a = [torch.randn(7, 5, generator=gen) for _ in range(4)]
    grads_b = [torch.randn(11, generator=gen) for _ in range(4)]
    for ga, gb in zip(grads_a, grads_b):
        pa.grad, pb.grad = ga.clone(), gb.clone()
        opt.step()
    torch.testing.assert_close(pa.detach().double(), naive_adamw(a, grads_a, 1e-2, (0.9, 0.95), 1e-8, 0.1),
                               rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(pb.detach().double(), naive_adamw(b, grads_b, 1e-2, (0.9, 0.95), 1e-8, 0.0),
                               rtol=1e-5, atol=1e-6)
