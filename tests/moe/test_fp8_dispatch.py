"""FP8 dispatch (`train.expert_comm.fp8_dispatch`): the dispatched rows travel as float8 e4m3 with one fp32 scale per
128 values (scale = the block's amax / 448), packed in one uint8 row; the combine and every gradient stay in the model
dtype (a straight-through rule, as DeepSeek-V3). On 2 gloo processes in bf16: the layer output within e4m3's rounding
of the bf16 dispatch, only forward dispatches carry FP8, and the rows' bytes are moep-plan's (about half of bf16's,
the scales counted). Training 200 steps: tests/training/test_expert_comm.py."""
import os
import pathlib
import sys

import pytest
import torch
import torch.distributed as dist

from moep_ds.config import config_from_dict, load_config
from moep_ds.distributed.expert_parallel import ParallelLayoutError, check_parallel_layout
from moep_ds.layers.ffn import FFNConfig
from moep_ds.moe import all_to_all as a2a
from moep_ds.moe import fp8
from moep_ds.moe.all_to_all import AllToAllDispatcher, ExpertCommConfig
from moep_ds.moe.dispatch import ExpertStage, shard_experts
from moep_ds.moe.layer import MoEConfig, MoELayer
from moep_ds.moe.plan import ExpertParallelPlan
from moep_ds.planning.comm import row_collectives
from moep_ds.planning.layout import Cluster, Layout
from moep_ds.routing.topk import TopKConfig
from moep_ds.schema import ConfigError

from ranks import run_ranks

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "training"))
from tiny import recipe  # noqa: E402

WORLD, B, T, D = 2, 2, 8, 256
CHUNKS = ExpertCommConfig().overlap_chunks  # the layer is built with the defaults: its rows go in chunks
# a group per rank, one group a token: each token to exactly one rank (the rows are fixed: T a rank)
LAYER = MoEConfig(num_experts=4, expert=FFNConfig(type="swiglu", hidden_size=64), router=TopKConfig(
    k=2, score="sigmoid", renormalize=True, num_groups=2, group_topk=1))
QUICKSTART = "configs/quickstart.yaml"


def test_pack_keeps_e4m3_values_with_a_scale_per_128():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 256, generator=gen) * torch.tensor([1e-3, 1.0, 300.0])[:, None]
    x[1, 128:] = 0  # a block of zeros: scale 1, zeros back
    packed = fp8.pack(x)
    assert packed.dtype == torch.uint8 and packed.shape == (3, 256 + 2 * 4) == (3, fp8.packed_width(256))
    scales = packed[:, 256:].contiguous().view(torch.float32)
    blocks = x.view(3, 2, 128)
    expected = torch.where(blocks.abs().amax(-1) > 0, blocks.abs().amax(-1) / 448, torch.ones(3, 2))
    assert torch.equal(scales, expected)
    values = packed[:, :256].contiguous().view(torch.float8_e4m3fn).float().view(3, 2, 128)
    assert torch.equal(values, (blocks / expected[..., None]).to(torch.float8_e4m3fn).float())
    back = fp8.unpack(packed, 256, torch.float32)
    assert torch.equal(back[1, 128:], torch.zeros(128))
    torch.testing.assert_close(back.view(3, 2, 128).abs().amax(-1), blocks.abs().amax(-1), rtol=1e-6, atol=0)
    assert ((back - x).abs() <= x.abs() * 2**-4 + expected.repeat_interleave(128, 1) * 2**-9).all()  # e4m3 rounding


def run(rank: int, fp8_dispatch: bool) -> dict:
    torch.manual_seed(0)
    layer = MoELayer(LAYER, d_model=D)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(std=0.3)
    layer.to(torch.bfloat16)
    plan = ExpertParallelPlan(size=WORLD, rank=rank, group=dist.group.WORLD)
    for stage in [m for m in layer.modules() if isinstance(m, ExpertStage)]:
        shard_experts(stage, plan)
        stage.set_dispatcher(AllToAllDispatcher(plan, stage.num_experts, ExpertCommConfig(fp8_dispatch=fp8_dispatch)))
    gen = torch.Generator().manual_seed(1 + rank)
    x, g = torch.randn(2, B, T, D, generator=gen).to(torch.bfloat16).unbind(0)
    x.requires_grad_()
    calls, original, phase = [], a2a.all_to_all, ["forward"]

    def counted(t, group, out_splits, in_splits, *async_op):
        calls.append((phase[0], t.dtype, tuple(t.shape), t.numel() * t.element_size()))
        return original(t, group, out_splits, in_splits, *async_op)

    a2a.all_to_all = counted
    try:
        out = layer(x)
        phase[0] = "backward"
        (out.y.float() * g.float()).sum().backward()
    finally:
        a2a.all_to_all = original
    return {"y": out.y.detach().float(), "x_grad": x.grad.float(), "calls": calls}


def _worker(out_dir: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.save({mode: run(rank, mode) for mode in (False, True)}, os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.mark.slow
def test_fp8_dispatch_sends_e4m3_rows_forward_and_the_model_dtype_back(tmp_path):
    run_ranks(WORLD, _worker, str(tmp_path))
    layout = Layout(cluster=Cluster(WORLD, WORLD), expert_parallel=WORLD, zero_stage=2, precision="bf16",
                    micro_batch=B, grad_accum=1, activation_checkpointing=False, seq_len=T, zero={},
                    expert_fp8_dispatch=True)
    planned = {c.what: c for c in row_collectives("moe: tokens", B * T, D, layout, WORLD, "expert")}
    there, back = planned["moe: tokens to experts (fp8 and scales)"], planned["moe: tokens back, and gradients"]
    back_bytes = 0
    for rank in range(WORLD):
        bf16, fp8_ = (torch.load(tmp_path / f"rank{rank}.pt")[mode] for mode in (False, True))
        for key in ("y", "x_grad"):  # within e4m3's rounding of the experts' inputs (2^-4 at most, a value)
            error = (fp8_[key] - bf16[key]).norm() / bf16[key].norm()
            assert 0 < error < 0.05, (rank, key, error)
        packed = [c for c in fp8_["calls"] if c[1] == torch.uint8]
        # the dispatch of rows, once per chunk (overlap_chunks, 2 by default); everything else in bf16
        assert [c[0] for c in packed] == ["forward"] * CHUNKS
        assert {c[2][1:] for c in packed} == {(D + 4 * D // 128,)} and sum(c[2][0] for c in packed) == B * T
        assert sum(c[3] for c in packed) == there.total
        rows = [c for c in fp8_["calls"] if c[1] == torch.bfloat16]
        assert all(c[2][1:] == (D,) for c in rows)
        back_bytes += sum(c[3] for c in rows)  # what a rank returns: the rows the others sent it
        bf16_there = [c for c in bf16["calls"] if c[1] == torch.bfloat16 and c[0] == "forward"][:CHUNKS]
        assert sum(c[2][0] for c in bf16_there) == B * T
        # half of bf16's, and the scales
        assert sum(c[3] for c in packed) / sum(c[3] for c in bf16_there) == (1 + 4 / 128) / 2
    assert back_bytes == WORLD * back.total


def test_fp8_dispatch_is_opt_in_and_needs_rows_of_whole_blocks_of_128():
    assert load_config(QUICKSTART).train.expert_comm.fp8_dispatch is False
    with pytest.raises(ConfigError, match=r"^train\.expert_comm\.fp8_dispatch \(2\) must be true or false$"):
        load_config(QUICKSTART, ["train.expert_comm.fp8_dispatch=2"])
    zero2 = {"zero_optimization": {"stage": 2}}

    def tiny(layers, d_model):
        raw = recipe(layers, pathlib.Path("/nonexistent"), expert_parallel_size=2, expert_comm={"fp8_dispatch": True})
        raw["model"]["d_model"] = d_model
        return config_from_dict(raw)

    check_parallel_layout(tiny("top2", 128), zero2, 2, 2)
    with pytest.raises(ParallelLayoutError, match=r"^train\.expert_comm\.fp8_dispatch \(true\) needs model\.d_model "
                                                  r"\(32\) to be a multiple of 128: one fp32 scale per 128 values of a "
                                                  r"dispatched row$"):
        check_parallel_layout(tiny("top2", 32), zero2, 2, 2)
    with pytest.raises(ParallelLayoutError, match=r"^train\.expert_comm\.fp8_dispatch \(true\) needs "
                                                  r"model\.layers\[0\]\.experts\.d_thin \(48\) to be a multiple "
                                                  r"of 128"):
        check_parallel_layout(tiny("msit", 128), zero2, 2, 2)  # MSIT's branches receive d_thin wide rows
