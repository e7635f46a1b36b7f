"""AllToAllDispatcher with 2 gloo processes equals LocalDispatcher on the same global batch (fp64)."""
import os

import pytest
import torch
import torch.distributed as dist

from moep_ds.layers.ffn import FFNConfig
from moep_ds.moe.all_to_all import SEQ_ID_STRIDE, AllToAllDispatcher, source_to_expert_order
from moep_ds.moe.dispatch import in_token_order
from moep_ds.moe.layer import MoEConfig, MoELayer, shard_experts
from moep_ds.moe.plan import ExpertParallelPlan
from moep_ds.routing.expert_choice import ExpertChoiceConfig
from moep_ds.routing.topk import TopKConfig

from ranks import run_ranks

WORLD, B_GLOBAL, T, D, H = 2, 4, 6, 8, 12
# Routing is per rank; these routers give the same plan for a rank's tokens whether routed alone or within the
# global batch (token-local top-k, dropless; expert choice per sequence), so the global batch is the reference.
CASES = [
    (4, TopKConfig(k=2)),
    (8, TopKConfig(k=2, renormalize=True)),
    (4, ExpertChoiceConfig(scope="sequence", score="softmax_tokens", capacity_factor=1.25, rounding="ceil")),
    (8, ExpertChoiceConfig(scope="sequence", score="softmax_experts", capacity_factor=2.0)),
]


def build(num_experts: int, router) -> MoELayer:
    torch.manual_seed(0)
    cfg = MoEConfig(num_experts=num_experts, expert=FFNConfig(type="swiglu", hidden_size=H), router=router)
    layer = MoELayer(cfg, d_model=D).double()
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(std=0.3)
    return layer


def global_batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return torch.randn(2, B_GLOBAL, T, D, generator=gen, dtype=torch.float64).unbind(0)


def received_tokens_are_right(layer: MoELayer, x_local: torch.Tensor, x_global: torch.Tensor, rank: int) -> bool:
    """Tokens arrive with sequence ids (source rank * stride + seq) and positions that name them in the global
    batch; with the plan in token order, sequence ids do not decrease within an expert."""
    B = x_local.shape[0]
    plan = layer.router(x_local)
    seq = torch.arange(B).repeat_interleave(T)
    pos = torch.arange(T).repeat(B)
    batch, _ = layer.dispatcher.dispatch(x_local.reshape(B * T, D), in_token_order(plan), seq, pos)
    source_b = batch.seq_ids_S // SEQ_ID_STRIDE * B + batch.seq_ids_S % SEQ_ID_STRIDE
    ordered = all((ids.diff() >= 0).all() for ids in batch.seq_ids_S.split(batch.counts))
    counts_agree = list(batch.known_counts) == batch.counts_E.tolist()  # host copy made once for the splits
    return (torch.equal(batch.x_SD, x_global[source_b, batch.positions_S]) and batch.x_SD.shape[0] > 0 and ordered
            and counts_agree)


def _worker(out_dir: str) -> None:
    dist.init_process_group("gloo")  # a rank of tests/ranks.py: the launcher's environment
    rank = dist.get_rank()
    results = []
    for num_experts, router in CASES:
        layer = build(num_experts, router)
        plan = ExpertParallelPlan(size=WORLD, rank=rank, group=dist.group.WORLD)
        shard_experts(layer, plan)
        layer.set_dispatcher(AllToAllDispatcher(plan, num_experts))
        x, g = global_batch()
        B = B_GLOBAL // WORLD
        x_local = x[rank * B : (rank + 1) * B].clone().requires_grad_()
        out = layer(x_local)
        (out.y * g[rank * B : (rank + 1) * B]).sum().backward()
        grads = {n: p.grad for n, p in layer.named_parameters()}
        results.append({"y": out.y.detach(), "x_grad": x_local.grad, "grads": grads,
                        "meta_ok": received_tokens_are_right(layer, x_local.detach(), x, rank)})
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.mark.slow
def test_all_to_all_matches_local_dispatch(tmp_path):
    run_ranks(WORLD, _worker, str(tmp_path))
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]
    for c, (num_experts, router) in enumerate(CASES):
        layer = build(num_experts, router)
        x, g = global_batch()
        x.requires_grad_()
        y = layer(x).y
        (y * g).sum().backward()
        got = [r[c] for r in ranks]
        assert all(r["meta_ok"] for r in got), f"case {c}: tokens arrived with wrong sequence ids / positions"
        torch.testing.assert_close(torch.cat([r["y"] for r in got]), y.detach(), msg=f"case {c} output")
        torch.testing.assert_close(torch.cat([r["x_grad"] for r in got]), x.grad, msg=f"case {c} input grad")
        local = num_experts // WORLD
        for name, p in layer.experts.named_parameters():
            for rank, r in enumerate(got):
                expected = p.grad[rank * local : (rank + 1) * local]
                torch.testing.assert_close(r["grads"][f"experts.{name}"], expected, msg=f"case {c} {name} rank {rank}")
        router_grad = sum(r["grads"]["router.weight"] for r in got)
        torch.testing.assert_close(router_grad, layer.router.weight.grad, msg=f"case {c} router grad")


def test_source_to_expert_order():
    # rank 0 sent [2, 1] tokens for local experts (0, 1), rank 1 sent [0, 3]
    received = torch.arange(6)  # rows: r0e0 r0e0 r0e1 | r1e1 r1e1 r1e1
    perm = source_to_expert_order(torch.tensor([[2, 1], [0, 3]]))
    assert received[perm].tolist() == [0, 1, 2, 3, 4, 5][:2] + [2, 3, 4, 5]
    perm = source_to_expert_order(torch.tensor([[1, 2], [2, 1]]))  # r0e0 r0e1 r0e1 | r1e0 r1e0 r1e1
    assert torch.arange(6)[perm].tolist() == [0, 3, 4, 1, 2, 5]
