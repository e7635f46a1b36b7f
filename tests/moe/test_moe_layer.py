"""The MoE layer against a naive per-token loop reference in fp64 (outputs and gradients)."""
import pytest
import torch
import torch.nn.functional as F

from moep_ds.layers.ffn import FFNConfig
from moep_ds.moe.dispatch import ExpertBatch, LocalDispatcher
from moep_ds.moe.experts import GroupedExperts
from moep_ds.moe.layer import MoEConfig, MoELayer, shard_experts
from moep_ds.moe.plan import ExpertParallelPlan
from moep_ds.routing.expert_choice import ExpertChoiceConfig, expert_choice_capacity
from moep_ds.routing.topk import TopKConfig, topk_capacity
from moep_ds.schema import ConfigError, parse

D, E, H = 8, 4, 12
ACT = {"swiglu": F.silu, "geglu": lambda h: F.gelu(h, approximate="tanh"), "gelu": F.gelu}


def make_layer(router, expert=None, seed=0) -> MoELayer:
    torch.manual_seed(seed)
    cfg = MoEConfig(num_experts=E, expert=expert or FFNConfig(type="swiglu", hidden_size=H), router=router)
    layer = MoELayer(cfg, d_model=D).double()
    with torch.no_grad():
        for p in layer.experts.parameters():  # biases too, so that they are checked
            p.normal_(std=0.3)
        layer.router.weight.normal_(std=0.5)
    return layer


def expert_on_token(layer: MoELayer, i: int, x_D: torch.Tensor) -> torch.Tensor:
    ex = layer.experts
    h = x_D @ ex.w1_EDF[i] + (ex.b1_EF[i] if ex.b1_EF is not None else 0)
    h = ACT[ex.kind](h)
    if ex.w3_EDF is not None:
        h = h * (x_D @ ex.w3_EDF[i] + (ex.b3_EF[i] if ex.b3_EF is not None else 0))
    return h @ ex.w2_EFD[i] + (ex.b2_ED[i] if ex.b2_ED is not None else 0)


def naive_expert_choice(layer: MoELayer, x_BTD: torch.Tensor) -> dict[int, list[tuple[int, torch.Tensor]]]:
    """token -> [(expert, weight)] by the literal definition: each expert ranks its group's tokens."""
    cfg = layer.router.cfg
    B, T, _ = x_BTD.shape
    groups = [list(range(b * T, (b + 1) * T)) for b in range(B)] if cfg.scope == "sequence" else [list(range(B * T))]
    x = x_BTD.reshape(B * T, D)
    logit = {(t, i): x[t] @ layer.router.weight[i] for t in range(B * T) for i in range(E)}
    routes = {t: [] for t in range(B * T)}
    for group in groups:
        k = expert_choice_capacity(len(group), E, cfg.capacity_factor, cfg.rounding)
        for i in range(E):
            if cfg.score == "softmax_tokens":
                norm = sum(torch.exp(logit[s, i]) for s in group)
                affinity = {t: torch.exp(logit[t, i]) / norm for t in group}
            else:
                affinity = {t: torch.exp(logit[t, i]) / sum(torch.exp(logit[t, j]) for j in range(E)) for t in group}
            for t in sorted(group, key=lambda t: -affinity[t].item())[:k]:
                routes[t].append((i, affinity[t]))
    return routes


def naive_topk(layer: MoELayer, x_BTD: torch.Tensor) -> dict[int, list[tuple[int, torch.Tensor]]]:
    cfg = layer.router.cfg
    x = x_BTD.reshape(-1, D)
    N = x.shape[0]
    routes, prob = {}, {}
    for t in range(N):
        logits = [x[t] @ layer.router.weight[i] for i in range(E)]
        z = sum(torch.exp(v) for v in logits)
        p = [torch.exp(v) / z for v in logits]
        chosen = sorted(range(E), key=lambda i: -p[i].item())[: cfg.k]
        total = sum(p[i] for i in chosen)
        routes[t] = [(i, p[i] / total if cfg.renormalize else p[i]) for i in chosen]
        prob.update({(t, i): p[i].item() for i in chosen})
    if cfg.capacity_factor is not None:
        capacity = topk_capacity(N, E, cfg.k, cfg.capacity_factor)
        for i in range(E):
            takers = sorted((t for t in range(N) if (t, i) in prob), key=lambda t: -prob[t, i])
            for t in takers[capacity:]:
                routes[t] = [(j, w) for j, w in routes[t] if j != i]
    return routes


def naive_moe(layer: MoELayer, x_BTD: torch.Tensor) -> torch.Tensor:
    routes = naive_expert_choice(layer, x_BTD) if hasattr(layer.router, "threshold") else naive_topk(layer, x_BTD)
    x = x_BTD.reshape(-1, D)
    rows = []
    for t in range(x.shape[0]):
        y = torch.zeros(D, dtype=x.dtype)
        for i, w in routes[t]:
            y = y + w * expert_on_token(layer, i, x[t])
        rows.append(y)
    return torch.stack(rows).view_as(x_BTD)


def grads(layer: MoELayer, x: torch.Tensor, y: torch.Tensor, g: torch.Tensor) -> dict[str, torch.Tensor]:
    params = dict(layer.named_parameters())
    out = torch.autograd.grad((y * g).sum(), [x, *params.values()], allow_unused=True)
    return {"x": out[0], **{n: v for n, v in zip(params, out[1:])}}


def check_against_reference(layer: MoELayer, B: int = 2, T: int = 5) -> None:
    x = torch.randn(B, T, D, dtype=torch.float64, requires_grad=True)
    g = torch.randn(B, T, D, dtype=torch.float64)
    out = layer(x)
    ref = naive_moe(layer, x)
    torch.testing.assert_close(out.y, ref, rtol=1e-10, atol=1e-12)
    ours, expected = grads(layer, x, out.y, g), grads(layer, x, ref, g)
    for name in expected:
        assert ours[name] is not None, name
        torch.testing.assert_close(ours[name], expected[name], rtol=1e-10, atol=1e-12, msg=name)
    assert ours["router.weight"].abs().sum() > 0


EXPERTS = {
    "swiglu": FFNConfig(type="swiglu", hidden_size=H),
    "gelu_bias": FFNConfig(type="gelu", hidden_size=H, bias=True),
    "geglu_bias": FFNConfig(type="geglu", hidden_size=H, bias=True),
}


@pytest.mark.parametrize("capacity_factor", [0.75, float(E)], ids=["drops", "no_drops"])
@pytest.mark.parametrize("scope", ["batch", "sequence"])
@pytest.mark.parametrize("score", ["softmax_experts", "softmax_tokens"])
def test_expert_choice_matches_naive_loop(score, scope, capacity_factor):
    router = ExpertChoiceConfig(score=score, scope=scope, capacity_factor=capacity_factor, rounding="ceil")
    layer = make_layer(router)
    dropped = layer(torch.randn(2, 5, D, dtype=torch.float64)).stats["dropped_fraction"].item()
    assert (dropped > 0) == (capacity_factor < 1)
    check_against_reference(layer)


@pytest.mark.parametrize("expert", list(EXPERTS))
@pytest.mark.parametrize(
    "router",
    [TopKConfig(k=2), TopKConfig(k=1, capacity_factor=0.5), TopKConfig(k=2, renormalize=True, capacity_factor=0.75)],
    ids=["dropless_k2", "drops_k1", "drops_k2_renorm"],
)
def test_topk_matches_naive_loop(router, expert):
    layer = make_layer(router, EXPERTS[expert])
    check_against_reference(layer, B=3, T=4)


@pytest.mark.parametrize("expert", ["gelu_bias", "geglu_bias"])
def test_expert_choice_other_expert_kinds(expert):
    check_against_reference(make_layer(ExpertChoiceConfig(capacity_factor=1.5), EXPERTS[expert]))


def test_sequence_scope_output_independent_of_batch():
    router = ExpertChoiceConfig(scope="sequence", score="softmax_tokens", capacity_factor=1.25, rounding="ceil")
    layer = make_layer(router)
    x = torch.randn(16, 7, D, dtype=torch.float64)
    together = layer(x).y
    for b in (0, 9):
        torch.testing.assert_close(layer(x[b : b + 1]).y[0], together[b], rtol=0, atol=1e-13)
    batch_scope = make_layer(ExpertChoiceConfig(scope="batch", score="softmax_tokens"))
    assert not torch.allclose(batch_scope(x[:1]).y[0], batch_scope(x).y[0])  # the test above can fail


def test_uneven_loads_with_an_idle_expert():
    torch.manual_seed(0)
    experts = GroupedExperts(FFNConfig(type="swiglu", hidden_size=H), d_model=D, num_experts=E).double()
    x = torch.randn(7, D, dtype=torch.float64, requires_grad=True)
    counts = [3, 0, 4, 0]
    y = experts(x, counts)
    y.square().sum().backward()
    ref_layer = type("L", (), {"experts": experts})
    owner = [0, 0, 0, 2, 2, 2, 2]  # expert of each row
    expected = torch.stack([expert_on_token(ref_layer, i, x[t]) for t, i in enumerate(owner)])
    torch.testing.assert_close(y, expected)
    assert experts.w1_EDF.grad[1].abs().sum() == 0 and experts.w1_EDF.grad[2].abs().sum() > 0


@pytest.mark.parametrize("kernel", ["library", "grouped", "loop"])
@pytest.mark.parametrize("expert", ["swiglu", "gelu_bias"])
def test_counts_as_a_device_tensor_give_the_same_result(kernel, expert):
    """Data-dependent loads reach the experts as the router's [E] tensor (no copy to the host for the library
    kernel; the others copy): outputs and gradients equal those for the same counts as Python ints."""
    torch.manual_seed(0)
    experts = GroupedExperts(EXPERTS[expert], d_model=D, num_experts=E)
    for p in experts.parameters():
        torch.nn.init.normal_(p, std=0.3)
    experts.kernel = kernel
    x = torch.randn(9, D)
    results = []
    for counts in ([3, 0, 4, 2], torch.tensor([3, 0, 4, 2])):
        xi = x.clone().requires_grad_()
        y = experts(xi, counts)
        results.append((y, *torch.autograd.grad(y.square().sum(), [xi, *experts.parameters()])))
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_dropless_topk_layer_keeps_its_counts_on_the_device():
    """Dropless top-k with the library kernel: routing, dispatch, experts, combine and backward trace as one
    graph (`fullgraph=True`; a device-to-host copy of the counts would split it), and give eager's results.
    bf16: torch traces F.grouped_mm only in bf16 (its grouped GEMM dtype on CUDA)."""
    torch.manual_seed(0)
    cfg = MoEConfig(num_experts=E, expert=FFNConfig(type="swiglu", hidden_size=32),
                    router=TopKConfig(k=2, load_balancing_weight=0.01, z_loss_weight=0.001))
    layer = MoELayer(cfg, d_model=16).to(torch.bfloat16)  # rows of 16 x 2 bytes: what F.grouped_mm takes
    layer.experts.kernel = "library"
    x = torch.randn(2, 24, 16, dtype=torch.bfloat16)

    def step(model):
        xi = x.clone().requires_grad_()
        out = model(xi)
        loss = out.y.float().square().sum() + sum(out.aux_losses.values())
        return (out.y, *torch.autograd.grad(loss, [xi, *layer.parameters()]))

    torch._dynamo.reset()
    compiled = step(torch.compile(layer, backend="aot_eager", fullgraph=True))
    eager = step(layer)
    assert len(eager) == 2 + len(list(layer.parameters()))
    for got, want in zip(compiled, eager):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch._dynamo.reset()


def test_expert_choice_counts_reach_the_experts_as_known_ints():
    """Expert choice knows its counts in advance (static_counts): the dispatcher hands them to the experts as
    Python ints, so the layer waits for no device-to-host copy of the counts."""
    layer = make_layer(ExpertChoiceConfig(capacity_factor=1.5))
    seen = []
    forward = layer.experts.forward
    layer.experts.forward = lambda x, counts: seen.append(counts) or forward(x, counts)
    layer(torch.randn(2, 6, D, dtype=torch.float64))
    assert seen == [(expert_choice_capacity(12, E, 1.5, "nearest"),) * E]


def test_aux_losses_and_stats_are_returned():
    layer = make_layer(TopKConfig(k=2, z_loss_weight=1e-3))
    out = layer(torch.randn(2, 5, D, dtype=torch.float64))
    assert set(out.aux_losses) == {"load_balancing_loss", "router_z_loss"}
    assert set(out.stats) == {"tokens_per_expert", "dropped_fraction", "router_entropy"}
    assert out.stats["tokens_per_expert"].sum().item() == 2 * 5 * 2
    assert not hasattr(layer, "aux_losses") and not hasattr(layer.router, "aux_losses")


def test_bf16_runs_with_fp32_routing():
    layer = make_layer(TopKConfig(k=2)).bfloat16()
    x = torch.randn(2, 5, D, dtype=torch.bfloat16)
    out = layer(x)
    assert out.y.dtype == torch.bfloat16 and out.aux_losses["load_balancing_loss"].dtype == torch.float32
    out.y.float().square().sum().backward()
    assert layer.experts.w1_EDF.grad.dtype == torch.bfloat16 and layer.router.weight.grad.abs().sum() > 0
    with torch.autocast("cpu", dtype=torch.bfloat16):  # fp32 weights, bf16 activations
        y = make_layer(TopKConfig(k=2)).float()(torch.randn(2, 5, D)).y
    assert torch.isfinite(y).all()


def test_num_active_params():
    top2 = make_layer(TopKConfig(k=2), EXPERTS["gelu_bias"])
    per_expert = D * H + H + H * D + D
    assert top2.experts.params_per_expert() == per_expert
    assert top2.num_active_params() == E * D + 2 * per_expert
    ec = make_layer(ExpertChoiceConfig(capacity_factor=2.0))
    assert ec.num_active_params() == E * D + 3 * D * H  # one expert per token (Nova's convention)


def test_shard_experts_keeps_this_ranks_slice():
    layer = make_layer(TopKConfig(k=2))
    full = {n: p.detach().clone() for n, p in layer.experts.named_parameters()}
    shard_experts(layer, ExpertParallelPlan(size=2, rank=1))
    assert layer.experts.num_local_experts == 2 and layer.num_experts == E
    for name, p in layer.experts.named_parameters():
        assert torch.equal(p, full[name][2:4]) and p.requires_grad
    with pytest.raises(RuntimeError, match="delivers tokens for 4 experts but this layer holds 2"):
        layer(torch.randn(1, 3, D, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"^layer is already sharded \(2 of 4 experts\)$"):
        shard_experts(layer, ExpertParallelPlan(size=2, rank=0))


def test_local_dispatcher_carries_sequence_ids_and_positions():
    layer = make_layer(TopKConfig(k=2))
    x = torch.randn(2, 3, D, dtype=torch.float64)
    plan = layer.router(x)
    seq = torch.arange(2).repeat_interleave(3)
    pos = torch.arange(3).repeat(2)
    seen = {}

    def run(batch: ExpertBatch):
        seen["batch"] = batch
        return layer.run_experts(batch)

    LocalDispatcher()(x.reshape(6, D), plan, run, seq, pos)
    batch = seen["batch"]
    assert torch.equal(batch.seq_ids_S * 3 + batch.positions_S, plan.token_idx_S)
    assert torch.equal(batch.x_SD, x.reshape(6, D)[plan.token_idx_S])


def test_moe_config_errors():
    with pytest.raises(ConfigError, match=r"^model.layers\[1\].moe.router.k \(9\) must be <= num_experts \(8\)$"):
        parse(MoEConfig, {"num_experts": 8, "router": {"type": "topk", "k": 9}}, "model.layers[1].moe")
    with pytest.raises(ConfigError, match=r"^moe.num_experts \(0\) must be > 0$"):
        parse(MoEConfig, {"num_experts": 0, "router": "topk"}, "moe")
    with pytest.raises(ConfigError, match=r"^moe.router.type: unknown router 'top2'; known: expert_choice, topk"):
        parse(MoEConfig, {"num_experts": 8, "router": "top2"}, "moe")
    with pytest.raises(ConfigError, match=r"^moe.router: required key is missing$"):
        parse(MoEConfig, {"num_experts": 8}, "moe")
    cfg = parse(MoEConfig, {"num_experts": 6, "router": "expert_choice"}, "moe")
    with pytest.raises(ConfigError, match=r"^moe.num_experts \(6\) must be divisible by expert_parallel_size \(4\)$"):
        ExpertParallelPlan(size=4, stages=tuple(cfg.routed_stages("moe")))
