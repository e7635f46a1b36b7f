"""Every routed block's experts behind the dispatcher: MSIT branches and MoEP paths / projection experts, stacked
[E, ...], sharded over 2 gloo processes with the all-to-all dispatcher, equal the single-process block (fp64)."""
import os

import pytest
import torch
import torch.distributed as dist

from moep_ds.blocks.msit import MSITBlock, MSITBlockConfig, MSITExpertConfig
from moep_ds.blocks.paths import PathsBlock, PathsBlockConfig
from moep_ds.layers.attention import AttentionConfig
from moep_ds.layers.rope import RopeConfig
from moep_ds.moe.all_to_all import AllToAllDispatcher
from moep_ds.moe.dispatch import ExpertStage, shard_experts
from moep_ds.moe.plan import ExpertParallelPlan
from moep_ds.routing.expert_choice import ExpertChoiceConfig
from moep_ds.routing.topk import TopKConfig

from ranks import run_ranks

WORLD, B_GLOBAL, T, D = 2, 4, 10, 16


def msit_block() -> MSITBlock:
    # Per-sequence expert choice: a rank's routing of its sequences equals their routing within the global batch.
    cfg = MSITBlockConfig(
        attention=AttentionConfig(num_heads=2, rope=RopeConfig()),
        router=ExpertChoiceConfig(capacity_factor=1.5, scope="sequence"),
        experts=MSITExpertConfig(d_thin=12, num_heads=2, windows=[3, 1, 5, 2]),
    )
    return MSITBlock(cfg, d_model=D, layer_idx=0)


def paths_block(k: int, full_layer: bool = True) -> PathsBlock:
    cfg = PathsBlockConfig(
        attention=AttentionConfig(num_heads=2, rope=RopeConfig()), full_layer=full_layer, d_path=8, num_paths=4,
        path_depth=2, num_projection_experts=2, path_router=TopKConfig(k=k), projection_router=TopKConfig(k=k),
    )
    return PathsBlock(cfg, d_model=D, layer_idx=0)


BLOCKS = {"msit": msit_block, "paths_top2": lambda: paths_block(2), "paths_top1": lambda: paths_block(1, False)}


def build(name: str):
    torch.manual_seed(0)
    block = BLOCKS[name]().double()
    with torch.no_grad():  # distinct affinities: no near-ties in any top-k
        for n, p in block.named_parameters():
            if n.endswith("router.weight"):
                p.normal_(std=1.0)
    return block


def global_batch():
    gen = torch.Generator().manual_seed(1)
    x, g = torch.randn(2, B_GLOBAL, T, D, generator=gen, dtype=torch.float64).unbind(0)
    pos = torch.arange(T).expand(B_GLOBAL, T) + torch.arange(B_GLOBAL)[:, None] * 3  # original positions
    return x, g, pos


def stages(block) -> list[ExpertStage]:
    return [m for m in block.modules() if isinstance(m, ExpertStage)]


def _worker(out_dir: str) -> None:
    dist.init_process_group("gloo")  # a rank of tests/ranks.py: the launcher's environment
    rank = dist.get_rank()
    results = {}
    for name in BLOCKS:
        block = build(name)
        for stage in stages(block):
            plan = ExpertParallelPlan(size=WORLD, rank=rank, group=dist.group.WORLD)
            shard_experts(stage, plan)
            stage.set_dispatcher(AllToAllDispatcher(plan, stage.num_experts))
        x, g, pos = global_batch()
        rows = slice(rank * B_GLOBAL // WORLD, (rank + 1) * B_GLOBAL // WORLD)
        x_local = x[rows].clone().requires_grad_()
        out = block(x_local, positions_BT=pos[rows])
        (out.x * g[rows]).sum().backward()
        results[name] = {"y": out.x.detach(), "x_grad": x_local.grad,
                         "grads": {n: p.grad for n, p in block.named_parameters()},
                         "shapes": {n: tuple(p.shape) for n, p in block.named_parameters()}}
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.mark.slow
def test_sharded_routed_blocks_match_the_single_process_block(tmp_path):
    run_ranks(WORLD, _worker, str(tmp_path))
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]
    for name in BLOCKS:
        block = build(name)
        x, g, pos = global_batch()
        x.requires_grad_()
        out = block(x, positions_BT=pos)
        (out.x * g).sum().backward()  # (aux losses are batch-local means: not comparable across layouts)
        got = [r[name] for r in ranks]
        torch.testing.assert_close(torch.cat([r["y"] for r in got]), out.x.detach(), msg=f"{name} output")
        torch.testing.assert_close(torch.cat([r["x_grad"] for r in got]), x.grad, msg=f"{name} input grad")
        expert_params = {f"{prefix}.{n}" for prefix, stage in block.named_modules() if isinstance(stage, ExpertStage)
                         for n, _ in stage.experts.named_parameters(prefix=stage_prefix(stage))}
        assert any(".branches." in n or ".paths." in n for n in expert_params), expert_params
        for pname, p in block.named_parameters():
            if pname in expert_params:  # rank r holds experts [r*L, (r+1)*L) of the stack
                assert got[0]["shapes"][pname] == (p.shape[0] // WORLD, *p.shape[1:]), pname
                torch.testing.assert_close(torch.cat([r["grads"][pname] for r in got]), p.grad, msg=f"{name} {pname}")
            else:  # shared (routers, norms, W_down / W_up, full-width layers): the ranks' gradients sum to it
                assert got[0]["shapes"][pname] == tuple(p.shape), pname
                torch.testing.assert_close(sum(r["grads"][pname] for r in got), p.grad, msg=f"{name} {pname}")


def stage_prefix(stage: ExpertStage) -> str:
    """Names of a stage's expert parameters relative to the stage."""
    for name, module in stage.named_modules():
        if module is stage.experts:
            return name
    raise AssertionError("experts not under their stage")
