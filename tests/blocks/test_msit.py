"""MoEP-MSIT block: equations 1-7 against a naive loop reference, isolation, causality, caching, the preset.

# B batch, T tokens, D model dim, F thin dim, E experts
"""
from __future__ import annotations

import copy
import pathlib

import pytest
import torch
import torch.nn.functional as F

from moep_ds import build_model, load_config
from moep_ds.blocks.msit import MSITBlock, MSITBlockConfig, MSITExpertConfig
from moep_ds.layers.attention import AttentionConfig
from moep_ds.layers.rope import RopeConfig, apply_rope, rope_cos_sin
from moep_ds.models.accounting import meta_param_report
from moep_ds.moe.dispatch import shard_experts
from moep_ds.moe.plan import ExpertParallelPlan
from moep_ds.routing.expert_choice import ExpertChoiceConfig
from moep_ds.schema import ConfigError

RECIPE = pathlib.Path(__file__).resolve().parents[2] / "configs" / "msit_babylm.yaml"
TINY_RECIPE = [  # msit_babylm's structure at toy width
    "model.vocab_size=64", "model.d_model=32", "model.max_seq_len=32", "model.layers[0].repeat=2",
    "model.layers[0].attention.num_heads=2", "model.layers[0].experts.d_thin=24",
    "model.layers[0].experts.num_heads=2",
]


def tiny_block(windows=(3, 1, 5), capacity=1.5, scope="batch", eval_mode="threshold") -> MSITBlock:
    cfg = MSITBlockConfig(
        attention=AttentionConfig(num_heads=2, rope=RopeConfig()),
        router=ExpertChoiceConfig(capacity_factor=capacity, scope=scope, eval_mode=eval_mode),
        experts=MSITExpertConfig(d_thin=12, num_heads=2, windows=list(windows)),
    )
    torch.manual_seed(0)
    block = MSITBlock(cfg, d_model=16, layer_idx=0).double()
    with torch.no_grad():  # larger router weights: distinct affinities, so top-k has no near-ties
        block.router.weight.normal_(std=1.0)
    return block


def naive_msit(block: MSITBlock, x_BTD: torch.Tensor, pos_BT: torch.Tensor) -> torch.Tensor:
    """Eqs. 1-7 with explicit loops: per expert, per selected token, attention over earlier selected tokens."""
    B, T, D = x_BTD.shape
    g = block.global_block(x_BTD, positions_BT=pos_BT).x  # eq. 1 (the dense block is tested on its own)
    r = torch.softmax(block.router_norm(g) @ block.router.weight.T, -1).reshape(B * T, -1)  # eq. 2
    E = r.shape[1]
    k = int(1.5 * B * T / E + 0.5)
    u = g.reshape(B * T, D) @ block.experts.w_down.weight.T  # eq. 4
    acc = torch.zeros_like(u)
    for i, w in enumerate(block.experts.windows):
        branch = block.experts.branches.expert_module(i)  # expert i's slice of the stacked parameters
        chosen = set(r[:, i].topk(k).indices.tolist())  # eq. 3
        attn = branch.attn
        H, Dh = attn.num_heads, attn.head_dim
        qkv = branch.attn_norm(u) @ attn.w_qkv.weight.T
        q, kk, v = (z.reshape(B * T, H, Dh) for z in qkv.split(H * Dh, -1))
        cos, sin = rope_cos_sin(pos_BT.reshape(-1), attn.rot_dim, 10000.0)
        q, kk = apply_rope(q, cos[:, None], sin[:, None]), apply_rope(kk, cos[:, None], sin[:, None])
        for t in sorted(chosen):
            b, pos_t = divmod(t, T)[0], pos_BT.reshape(-1)[t]
            keys = [s for s in chosen if s // T == b and pos_t - w < pos_BT.reshape(-1)[s] <= pos_t]
            scores = torch.stack([(q[t] * kk[s]).sum(-1) for s in keys], -1) / Dh**0.5  # [H, keys]
            att = torch.einsum("hs,shd->hd", scores.softmax(-1), v[keys]).reshape(H * Dh)
            b_t = u[t] + att @ attn.w_o.weight.T
            y_t = branch.out_norm(b_t + branch.ffn(branch.ffn_norm(b_t)))  # eq. 5
            acc[t] += r[t, i] * y_t
    o = (acc @ block.experts.w_up.weight.T).reshape(B, T, D)  # eq. 6
    return block.out_norm(g + o)  # eq. 7


def test_block_matches_naive_equations():
    block = tiny_block()
    B, T = 3, 60  # 90 tokens per expert: more than one query chunk of the routed attention
    x_BTD = torch.randn(B, T, 16, dtype=torch.float64)
    pos_BT = torch.arange(T).expand(B, T) + torch.tensor([[0], [7], [30]])  # original positions with offsets
    out = block(x_BTD, positions_BT=pos_BT)
    torch.testing.assert_close(out.x, naive_msit(block, x_BTD, pos_BT))
    assert out.stats["tokens_per_expert"].tolist() == [round(1.5 * B * T / 3)] * 3


def test_scope_sequence_isolates_sequences_and_scope_batch_does_not():
    x_BTD = torch.randn(4, 12, 16, dtype=torch.float64)
    moved = x_BTD.clone()
    moved[2] = torch.randn(12, 16, dtype=torch.float64) * 3
    pos_BT = torch.arange(12).expand(4, 12)
    others = [0, 1, 3]
    seq_block = tiny_block(scope="sequence")
    a, b = seq_block(x_BTD, positions_BT=pos_BT).x, seq_block(moved, positions_BT=pos_BT).x
    torch.testing.assert_close(a[others], b[others], rtol=0, atol=0)
    batch_block = tiny_block(scope="batch")
    a, b = batch_block(x_BTD, positions_BT=pos_BT).x, batch_block(moved, positions_BT=pos_BT).x
    assert not torch.allclose(a[others], b[others])  # batch-wide top-k couples the sequences


def test_every_parameter_gets_gradients():
    block = tiny_block()
    x_BTD = torch.randn(2, 16, 16, dtype=torch.float64)
    block(x_BTD, positions_BT=torch.arange(16).expand(2, 16)).x.square().sum().backward()
    missing = [n for n, p in block.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert not missing


def trained_tiny_model(overrides=()):
    cfg = load_config(RECIPE, overrides=[*TINY_RECIPE, *overrides])
    torch.manual_seed(0)
    model = build_model(cfg.model).double()
    with torch.no_grad():  # a few training-mode forwards set the routers' thresholds (EMA of the k-th affinity)
        for _ in range(3):
            model(torch.randint(0, 64, (4, 24)))
    return model.eval()


def test_recipe_threshold_eval_is_causal_and_batch_invariant():
    model = trained_tiny_model()
    ids = torch.randint(0, 64, (3, 20))
    out = model(ids)
    per_expert = out.stats["layers.0.tokens_per_expert"]
    assert (per_expert > 0).all() and (per_expert < ids.numel()).any()  # thresholds select a real subset

    alone = model(ids[1:2]).logits
    torch.testing.assert_close(alone[0], out.logits[1])  # batch-invariant
    changed = ids.clone()
    changed[:, 12:] = torch.randint(0, 64, (3, 8))
    torch.testing.assert_close(model(changed).logits[:, :12], out.logits[:, :12])  # causal


def test_recipe_topk_eval_is_not_causal():
    """Contrast: the training rule at evaluation lets later tokens change earlier outputs."""
    model = trained_tiny_model(["model.layers[0].router.eval_mode=topk"])
    ids = torch.randint(0, 64, (3, 20))
    changed = ids.clone()
    changed[:, 12:] = torch.randint(0, 64, (3, 8))
    assert not torch.allclose(model(changed).logits[:, :12], model(ids).logits[:, :12])


def test_cached_generation_matches_full_recompute():
    model = trained_tiny_model()
    ids = torch.randint(0, 64, (2, 14))
    full = model(ids).logits
    cache = model.new_cache()
    steps = [model(ids[:, :6], cache=cache).logits]
    steps += [model(ids[:, t : t + 1], cache=cache).logits for t in range(6, 14)]
    torch.testing.assert_close(torch.cat(steps, 1), full)


def test_branches_split_over_two_ranks_decode_with_their_own_windows():
    """Decoding with the branches sharded over 2 expert-parallel ranks (the trainer's split, here in one process):
    each rank runs its branches against caches with their windows; the ranks' shares (which the dispatcher sums)
    give the unsharded output, token by token."""
    block = tiny_block(windows=(1, 6, 2, 4))
    with torch.no_grad():
        for _ in range(3):  # thresholds that select a real subset
            block(torch.randn(2, 20, 16, dtype=torch.float64), positions_BT=torch.arange(20).expand(2, 20))
    block.eval()
    x_BTD = torch.randn(2, 12, 16, dtype=torch.float64)
    pos_BT = torch.arange(12).expand(2, 12)
    with torch.no_grad():
        g_BTD = block.global_block(x_BTD, positions_BT=pos_BT).x
        plan = block.router(block.router_norm(g_BTD))
        stages = [block.experts]
        for rank in range(2):
            stages.append(copy.deepcopy(block.experts))
            shard_experts(stages[-1], ExpertParallelPlan(size=2, rank=rank))
        assert [c.window for s in stages[1:] for c in s.new_caches()] == [1, 6, 2, 4]
        caches = [s.new_caches() for s in stages]
        outs = [[s.forward_cached(g_BTD[:, t : t + 1], block.router(block.router_norm(g_BTD[:, t : t + 1])),
                                  pos_BT[:, t : t + 1], c) for t in range(12)] for s, c in zip(stages, caches)]
    full, rank0, rank1 = (torch.cat(o, 1) for o in outs)
    torch.testing.assert_close(rank0 + rank1, full)
    torch.testing.assert_close(full, block.experts(g_BTD, plan, pos_BT))  # decoding = the routed forward


def test_cache_requires_threshold_routing():
    model = trained_tiny_model(["model.layers[0].router.eval_mode=topk"])
    with pytest.raises(ValueError, match=r"eval_mode \('topk'\) must be 'threshold'"):
        model(torch.randint(0, 64, (1, 4)), cache=model.new_cache())


def test_msit_babylm_parameter_counts():
    cfg = load_config(RECIPE)
    report = meta_param_report(cfg.model)
    assert report.params_total - report.params_non_embedding == 16384 * 256  # tied: one table
    assert abs(report.params_non_embedding - 48.4e6) <= 0.1e6
    assert abs(report.params_total - 52.6e6) <= 0.1e6
    block = cfg.model.layers[0]
    assert (block.repeat, cfg.model.d_model, block.attention.num_heads, block.experts.d_thin) == (6, 256, 4, 384)
    assert (block.experts.num_heads, block.experts.windows, block.router.capacity_factor) == (6, [64, 16, 8, 4], 2.0)
    # active: the router's count of experts per token, c = 2 of the 4 branches (the MSIT method's bound)
    assert block.router.active_experts == "capacity" and report.params_active == 31_360_512
    one = meta_param_report(load_config(RECIPE, overrides=["model.layers[0].router.active_experts=one"]).model)
    branch = 1_771_776  # per expert (arithmetic in moep_ds/blocks/msit.py)
    assert report.params_active - one.params_active == 6 * (2 * branch - branch)


@pytest.mark.parametrize(
    "override,message",
    [
        ("model.layers[0].experts.windows=[]", r"model.layers\[0\].experts.windows \(\[\]\) must list one window"),
        ("model.layers[0].experts.num_heads=5", r"experts.num_heads \(5\) must divide d_thin \(384\)"),
        ("model.layers[0].experts.windows=[4, 0]", r"model.layers\[0\].experts.windows\[1\] \(0\) must be > 0"),
        ("train.expert_parallel_size=3", r"^model.layers\[0\].experts.windows \(\[64, 16, 8, 4\]\) must have a length "
         r"divisible by expert_parallel_size \(3\): one expert per window$"),
    ],
)
def test_config_errors_name_the_path(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(RECIPE, overrides=[override])
