"""MoEP layer-level paths: the block's equations against a naive loop reference, balancing loss, gradients,
causality / batch invariance / caching of the recipes, and their parameter budgets.

# B batch, T tokens, D full width, P path width, E projection experts, N paths
"""
from __future__ import annotations

import copy
import dataclasses
import pathlib

import pytest
import torch

from moep_ds import build_model, load_config
from moep_ds.blocks.paths import LinearExperts, PathsBlock, PathsBlockConfig
from moep_ds.layers.attention import AttentionConfig
from moep_ds.layers.rope import RopeConfig, apply_rope, rope_cos_sin
from moep_ds.models.accounting import meta_param_report
from moep_ds.moe.dispatch import ExpertBatch, shard_experts
from moep_ds.moe.plan import ExpertParallelPlan
from moep_ds.routing.topk import TopKConfig
from moep_ds.schema import ConfigError

CONFIGS = pathlib.Path(__file__).resolve().parents[2] / "configs"
TINY = [  # the recipes' structure at toy width
    "model.vocab_size=64", "model.d_model=32", "model.max_seq_len=32", "model.layers[0].attention.num_heads=4",
    "model.layers[0].d_path=16", "model.layers[0].path_depth=2", "model.layers[0].path_ffn.hidden_size=24",
]
MOEP_RECIPES = ["moep_gpt2", "moep_llama", "moep_gemma", "pythia_1b_moep"]
ALPHA = 0.01


def tiny_block(k=2, parallel=False, full_layer=True, num_paths=3) -> PathsBlock:
    cfg = PathsBlockConfig(
        attention=AttentionConfig(num_heads=3, rope=RopeConfig()),
        parallel_residual=parallel,
        full_layer=full_layer,
        d_path=16,
        num_paths=num_paths,
        path_depth=2,
        num_projection_experts=3,
        path_router=TopKConfig(k=k, load_balancing_weight=ALPHA),
        projection_router=TopKConfig(k=k, load_balancing_weight=ALPHA),
    )
    torch.manual_seed(0)
    block = PathsBlock(cfg, d_model=24, layer_idx=0).double()
    with torch.no_grad():  # distinct gate probabilities, so top-k has no near-ties
        for router in (block.contract_router, block.path_router, block.expand_router):
            router.weight.normal_(std=1.0)
    return block


def naive_topk(p_TE: torch.Tensor, k: int) -> list[dict[int, torch.Tensor]]:
    return [{int(e): p[e] for e in p.topk(k).indices} for p in p_TE]


def naive_path_layer(layer, z: dict[int, torch.Tensor], pos_T: torch.Tensor, T: int) -> dict[int, torch.Tensor]:
    """One path layer over the path's tokens {flat index: vector}, attention by explicit loops."""
    attn = layer.attn
    H, Dh = attn.num_heads, attn.head_dim
    a, out = {}, {}
    for t, z_t in z.items():
        q, kk, v = (u.view(H, Dh) for u in (layer.attn_norm(z_t) @ attn.w_qkv.weight.T).split(H * Dh))
        cos, sin = rope_cos_sin(pos_T[t], attn.rot_dim, 10000.0)
        a[t] = (apply_rope(q, cos, sin), apply_rope(kk, cos, sin), v)
    for t in z:
        keys = [s for s in z if s // T == t // T and pos_T[s] <= pos_T[t]]
        scores = torch.stack([(a[t][0] * a[s][1]).sum(-1) for s in keys], -1) / Dh**0.5
        att = torch.einsum("hs,shd->hd", scores.softmax(-1), torch.stack([a[s][2] for s in keys]))
        attn_out = att.reshape(-1) @ attn.w_o.weight.T
        if layer.parallel_residual:  # x + Attn(N1(x)) + FFN(N2(x))
            out[t] = z[t] + attn_out + layer.ffn(layer.ffn_norm(z[t]))
        else:  # h = x + Attn(N1(x)); h + FFN(N2(h))
            h = z[t] + attn_out
            out[t] = h + layer.ffn(layer.ffn_norm(h))
    return out


def naive_paths(block: PathsBlock, x_BTD: torch.Tensor, pos_BT: torch.Tensor, k: int) -> torch.Tensor:
    B, T, D = x_BTD.shape
    pos_T = pos_BT.reshape(-1)
    h1 = x_BTD if block.pre is None else block.pre(x_BTD, positions_BT=pos_BT).x  # dense block: tested on its own
    h1 = h1.reshape(B * T, D)
    c = block.contract_norm(h1)
    gates = naive_topk(torch.softmax(c @ block.contract_router.weight.T, -1), k)
    z = torch.stack([sum(g * (block.contract.w_EOI[e] @ c[t]) for e, g in gates[t].items()) for t in range(B * T)])
    gates = naive_topk(torch.softmax(block.path_norm(z) @ block.path_router.weight.T, -1), k)
    y = z.clone()
    for j in range(block.paths.num_experts):
        path = block.paths.paths.expert_module(j)  # path j's slice of the stacked parameters
        members = {t: z[t] for t in range(B * T) if j in gates[t]}
        for layer in path.layers:
            members = naive_path_layer(layer, members, pos_T, T)
        for t, out_t in members.items():
            y[t] = y[t] + gates[t][j] * (out_t - z[t])
    u = block.expand_norm(y)
    gates = naive_topk(torch.softmax(u @ block.expand_router.weight.T, -1), k)
    e = torch.stack([sum(g * (block.expand.w_EOI[i] @ u[t]) for i, g in gates[t].items()) for t in range(B * T)])
    return block.post((h1 + e).view(B, T, D), positions_BT=pos_BT).x


@pytest.mark.parametrize("k,parallel", [(2, False), (1, True)])
def test_block_matches_naive_equations(k, parallel):
    block = tiny_block(k=k, parallel=parallel)
    B, T = 2, 9
    x_BTD = torch.randn(B, T, 24, dtype=torch.float64)
    pos_BT = torch.arange(T).expand(B, T) + torch.tensor([[0], [13]])
    out = block(x_BTD, positions_BT=pos_BT)
    torch.testing.assert_close(out.x, naive_paths(block, x_BTD, pos_BT, k))
    assert set(out.aux_losses) == {f"{n}.load_balancing_loss" for n in ("contraction", "paths", "expansion")}


def test_projection_experts_library_kernel_equals_the_per_expert_matmuls():
    """fp32 (F.grouped_mm's CPU dtype): the contraction and expansion experts through torch's grouped GEMM on
    the device counts give the per-expert matmuls' outputs and gradients, idle experts included."""
    torch.manual_seed(0)
    experts = LinearExperts(4, d_in=16, d_out=24, active_experts_per_token=2, residual_output=False)
    x_SD = torch.randn(11, 16)
    counts_E = torch.tensor([4, 0, 5, 2])
    results = []
    for library in (True, False):
        experts.use_library = library
        x = x_SD.clone().requires_grad_()
        y = experts.run_experts(ExpertBatch(x, counts_E))
        results.append((y, *torch.autograd.grad(y.square().sum(), [x, experts.w_EOI])))
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert results[0][2][1].abs().sum() == 0  # expert 1 had no tokens


def test_a_paths_layers_share_one_flex_attention_mask(monkeypatch):
    """The FlexAttention path (CUDA; forced here, FlexAttention has a CPU forward): each path builds its block mask
    once for its `path_depth` layers, and the block's output equals the SDPA path's."""
    import moep_ds.blocks.paths as paths_module
    import moep_ds.layers.routed_attention as ra

    block = tiny_block(k=2).float()  # path_depth 2, 3 paths
    x_BTD = torch.randn(2, 9, 24)
    pos_BT = torch.arange(9).expand(2, 9)
    with torch.no_grad():
        want = block(x_BTD, positions_BT=pos_BT).x
        built, build = [], ra.routed_block_mask
        counting = lambda *args: built.append(args[0].numel()) or build(*args)  # noqa: E731
        for module in (ra, paths_module):  # the attention's own builder too: a layer must not build another
            monkeypatch.setattr(module, "uses_flex", lambda x, kernel=None: True)
            monkeypatch.setattr(module, "routed_block_mask", counting)
        got = block(x_BTD, positions_BT=pos_BT).x
    assert len(built) == 3 and all(n > 0 for n in built)  # one per path, not one per layer
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_without_full_layer_the_block_starts_at_the_contraction():
    block = tiny_block(k=2, full_layer=False)
    assert block.pre is None and not [n for n, _ in block.named_parameters() if n.startswith("pre.")]
    x_BTD = torch.randn(2, 9, 24, dtype=torch.float64)
    pos_BT = torch.arange(9).expand(2, 9) + torch.tensor([[0], [5]])
    torch.testing.assert_close(block(x_BTD, positions_BT=pos_BT).x, naive_paths(block, x_BTD, pos_BT, 2))


def test_full_layer_false_drops_exactly_one_full_width_layer():
    with_full = meta_param_report(load_config(CONFIGS / "moep_gpt2.yaml").model)
    recipe = load_config(CONFIGS / "moep_gpt2.yaml", overrides=["model.layers[0].full_layer=false"])
    without = meta_param_report(recipe.model)
    d, hidden = 512, 4 * 512  # gpt2 flavour: LayerNorms with bias, attention and GELU MLP with biases
    dense_layer = 2 * 2 * d + (4 * d * d + 4 * d) + (2 * d * hidden + hidden + d)
    assert with_full.params_total - without.params_total == dense_layer


def test_balancing_loss_is_minimal_at_uniform_routing():
    """alpha * E * sum_i f_i P_i: exactly alpha for uniform gates, above it for any skewed ones (identical tokens,
    so f is the top-k indicator of P), and alpha * E / k when every token picks the same k experts."""
    block = tiny_block(k=2)
    routers = [(block.contract_router, 24), (block.path_router, 16), (block.expand_router, 16)]
    for router, d in routers:
        with torch.no_grad():
            router.weight.zero_()
        uniform = router(torch.randn(2, 8, d, dtype=torch.float64)).aux_losses["load_balancing_loss"]
        torch.testing.assert_close(uniform, torch.tensor(ALPHA, dtype=torch.float64))
        g = torch.Generator().manual_seed(d)
        for scale in (0.01, 0.3, 1.0, 5.0):
            with torch.no_grad():
                router.weight.copy_(torch.randn(router.weight.shape, generator=g, dtype=torch.float64) * scale)
            same = torch.randn(d, generator=g, dtype=torch.float64).expand(2, 8, d)
            skewed = router(same).aux_losses["load_balancing_loss"]
            assert skewed > uniform
        with torch.no_grad():
            router.weight.zero_()
            router.weight[:2] = same[0, 0] * 100.0  # every token's top-2 are experts 0 and 1
        collapsed = router(same).aux_losses["load_balancing_loss"]
        torch.testing.assert_close(collapsed, torch.tensor(ALPHA * 3 / 2, dtype=torch.float64))


def test_paths_do_not_depend_on_the_plan_order_within_an_expert():
    """A plan may list an expert's tokens in any order (e.g. by probability under a capacity)."""
    block = tiny_block(k=2)
    z_BTP = torch.randn(2, 40, 16, dtype=torch.float64)
    pos_BT = torch.arange(40).expand(2, 40)
    plan = block.path_router(block.path_norm(z_BTP))
    perms = [torch.randperm(n, generator=torch.Generator().manual_seed(n)) for n in plan.counts()]
    idx = [i[p] for i, p in zip(plan.token_idx_S.split(plan.counts()), perms)]
    weights = [w[p] for w, p in zip(plan.weight_S.split(plan.counts()), perms)]
    reordered = dataclasses.replace(plan, token_idx_S=torch.cat(idx), weight_S=torch.cat(weights))
    torch.testing.assert_close(block.paths(z_BTP, reordered, pos_BT), block.paths(z_BTP, plan, pos_BT))


def test_paths_split_over_two_ranks_decode_like_the_whole_block():
    """Decoding with the paths sharded over 2 expert-parallel ranks (the trainer's split, here in one process):
    each rank adds its paths' gated deltas (which the dispatcher sums) to z, token by token."""
    block = tiny_block(k=2, num_paths=4).eval()
    z_BTP = torch.randn(2, 10, 16, dtype=torch.float64)
    pos_BT = torch.arange(10).expand(2, 10)
    stages = [block.paths]
    for rank in range(2):
        stages.append(copy.deepcopy(block.paths))
        shard_experts(stages[-1], ExpertParallelPlan(size=2, rank=rank))
    outs = []
    with torch.no_grad():
        for stage in stages:
            caches = stage.new_caches()
            steps = [z_BTP[:, t : t + 1] for t in range(10)]
            outs.append(torch.cat([stage.forward_cached(z, block.path_router(block.path_norm(z)), pos_BT[:, t : t + 1],
                                                        caches) for t, z in enumerate(steps)], 1))
        full, rank0, rank1 = outs
        torch.testing.assert_close(rank0 + rank1 - z_BTP, full)  # each rank's output carries z once
        torch.testing.assert_close(full, block.paths(z_BTP, block.path_router(block.path_norm(z_BTP)), pos_BT))


@pytest.mark.parametrize("heads,kv_heads,d_path,expected", [(8, 2, 32, (4, 1)), (8, 4, 32, (4, 2)), (8, None, 16, (2, 2))])
def test_path_attention_keeps_the_head_dim_and_the_query_to_kv_ratio(heads, kv_heads, d_path, expected):
    """path_attention null: the full-width attention's head dim (8 here) at d_path, with as many query heads per
    key/value head as the full-width layer (GQA stays GQA; at least one key/value head)."""
    cfg = PathsBlockConfig(attention=AttentionConfig(num_heads=heads, num_kv_heads=kv_heads), d_path=d_path)
    path = cfg.resolved_path_attention(64)
    assert (path.num_heads, path.kv_heads) == expected and path.resolved_head_dim(d_path) == 8


def test_every_path_and_projection_expert_gets_gradients():
    block = tiny_block(k=2)
    x_BTD = torch.randn(3, 20, 24, dtype=torch.float64)
    out = block(x_BTD, positions_BT=torch.arange(20).expand(3, 20))
    (out.x.square().mean() + sum(out.aux_losses.values())).backward()
    for name, p in block.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    for w in (block.contract.w_EOI, block.expand.w_EOI):  # every projection expert, not just the tensor
        assert (w.grad.flatten(1).abs().sum(1) > 0).all()


def tiny_recipe_model(name: str, overrides=()):
    cfg = load_config(CONFIGS / f"{name}.yaml", overrides=[*TINY, *overrides])
    torch.manual_seed(0)
    return build_model(cfg.model).double().eval()


ALTERNATING = [  # issue 15's alternating reading: path stages without a leading full-width layer, repeated
    "model.layers[0].full_layer=false", "model.layers[0].repeat=2"]


@pytest.mark.parametrize("name,overrides", [*((n, ()) for n in MOEP_RECIPES), ("moep_gpt2", ALTERNATING)])
def test_recipe_eval_is_causal_batch_invariant_and_caches(name, overrides):
    model = tiny_recipe_model(name, overrides)
    ids = torch.randint(0, 64, (3, 18))
    full = model(ids).logits
    torch.testing.assert_close(model(ids[2:3]).logits[0], full[2])  # batch-invariant
    changed = ids.clone()
    changed[:, 10:] = torch.randint(0, 64, (3, 8))
    torch.testing.assert_close(model(changed).logits[:, :10], full[:, :10])  # causal
    cache = model.new_cache()
    steps = [model(ids[:, :5], cache=cache).logits]
    steps += [model(ids[:, t : t + 1], cache=cache).logits for t in range(5, 18)]
    torch.testing.assert_close(torch.cat(steps, 1), full)  # decoding with caches = full recompute


@pytest.mark.parametrize(
    "recipe,baseline",
    [
        ("moep_gpt2", "gpt2_small"),
        ("moep_llama", "llama_small"),
        ("moep_gemma", "gemma_small"),
        ("pythia_1b_moep", "pythia_1b_dense"),
        ("pythia_1b_ffn_moe", "pythia_1b_dense"),
    ],
)
def test_recipes_match_their_baseline_budget(recipe, baseline):
    ours = meta_param_report(load_config(CONFIGS / f"{recipe}.yaml").model).params_total
    base = meta_param_report(load_config(CONFIGS / f"{baseline}.yaml").model).params_total
    assert abs(ours / base - 1) <= 0.02, (ours, base)


def test_config_errors_name_the_path():
    with pytest.raises(ConfigError, match=r"layers\[0\].d_path \(100\) must be a multiple of the head dim \(64\)"):
        load_config(CONFIGS / "moep_llama.yaml", overrides=["model.layers[0].d_path=100"])
    with pytest.raises(ConfigError, match=r"model.layers\[0\].path_router.k \(5\) must be <= num_experts \(4\)"):
        load_config(CONFIGS / "moep_llama.yaml", overrides=["model.layers[0].path_router.k=5"])
    with pytest.raises(ConfigError, match=r"^model.layers\[0\].path_attention.output_gate \(True\) is not available "
                                          r"in path attention$"):  # path attention projects q, k, v alone
        load_config(CONFIGS / "moep_llama.yaml", overrides=["model.layers[0].attention.output_gate=true"])
    sets = ["train.expert_parallel_size=4", "model.layers[0].num_projection_experts=2"]
    with pytest.raises(ConfigError, match=r"^model.layers\[0\].num_projection_experts \(2\) must be divisible by "
                                          r"expert_parallel_size \(4\)$"):
        load_config(CONFIGS / "moep_llama.yaml", overrides=sets)
