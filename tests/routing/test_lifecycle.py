"""Expert lifecycle manager: schedule and selection rules (ages in tokens routed to the expert), impact from
this step's gradients, replacement (weights, optimizer state, statistics, exploration bias) by the trainer
callback, a starved expert re-born in a short run, checkpoint round trip and resume, and replacement under
DeepSpeed ZeRO-2 on two gloo processes, with all experts on every rank and with the replaced expert and its
source on different expert-parallel ranks.

Run as a script (`torchrun --nproc_per_node 2 test_lifecycle.py --zero2-worker OUT`) it is that test's worker.
"""
from __future__ import annotations

import copy
import pathlib

import pytest
import torch

from moep_ds.config import config_from_dict
from moep_ds.models.causal_lm import build_model
from moep_ds.routing.lifecycle import (
    adaptive_threshold,
    birth_boost,
    clone_with_noise,
    fold_step_statistics,
    lifecycle_layers,
    log_expert_utilization,
    select_dead_experts,
    value_scores,
)
from moep_ds.schema import ConfigError
from moep_ds.training.lifecycle import LifecycleRunner

from ranks import run_ranks

# B batch, T tokens, E experts, S routed (token, expert) pairs

VOCAB, D_MODEL, E = 32, 16, 4


def tiny_model(lifecycle: dict | None, *, block: str = "ssm_moe", seed: int = 0, plan=None):
    torch.manual_seed(seed)
    return build_model(tiny_model_cfg(lifecycle, block), **({} if plan is None else {"plan": plan}))


def tiny_model_cfg(lifecycle: dict | None, block: str = "ssm_moe"):
    layer = {
        "type": block,
        "moe": {
            "num_experts": E,
            "expert": {"type": "gelu", "hidden_size": 16},
            "router": {"type": "topk", "k": 2, "lifecycle": lifecycle},
        },
    }
    if block == "ssm_moe":
        layer["mixer"] = {"type": "ssm", "state_size": 4, "chunk_size": 8}
    else:
        layer["attention"] = {"num_heads": 2}
    return config_from_dict({"model": {"vocab_size": VOCAB, "d_model": D_MODEL, "max_seq_len": 16,
                                       "layers": [layer]}}).model


def batch(step: int, rank: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (4, 17), generator=torch.Generator().manual_seed(1000 * rank + step))
    return ids[:, :-1], ids[:, 1:]


def moe_of(model):
    return model.blocks[0].moe


def starve(model, expert: int) -> None:
    """Router logit of `expert` = -D for every token: the MoE norm's output is x_hat + 1 (x_hat sums to 0 over
    features), and the expert's router row is -1 everywhere, while the other logits are ~N(0, 0.1^2)."""
    block = model.blocks[0]
    with torch.no_grad():
        block.moe_norm.bias.fill_(1.0)
        block.moe.router.weight[expert] = -1.0


def lifecycle_step(model, optimizer=None) -> list[dict]:
    return LifecycleRunner(model, optimizer).after_optimizer_step()


def rows_of(moe) -> list:
    rows = moe.expert_rows()
    return rows.local + rows.replicated


def train(model, optimizer, steps: range, stats: list | None = None) -> list[dict]:
    events = []
    for step in steps:
        inputs, labels = batch(step)
        out = model(inputs, labels=labels)
        optimizer.zero_grad()
        out.loss.backward()
        optimizer.step()
        if stats is not None:
            stats.append(out.stats["layers.0.tokens_per_expert"].clone())
        events += lifecycle_step(model, optimizer)
    return events


# ---------------------------------------------------------------------------------------------------------
# the rules, as plain functions


def test_birth_boost_decays_linearly_to_zero_at_twice_min_tokens():
    ages = torch.tensor([0, 2500, 5000, 7500, 10000, 20000])
    torch.testing.assert_close(birth_boost(ages, 5000, 0.35), torch.tensor([0.35, 0.2625, 0.175, 0.0875, 0.0, 0.0]))


def test_value_scores_match_a_loop():
    freq = torch.tensor([0.4, 0.3, 0.2, 0.1], dtype=torch.float64)
    impact = torch.tensor([0.5, -0.2, 1.0, 0.3], dtype=torch.float64)
    contribution = [f * max(m, 0.0) for f, m in zip(freq.tolist(), impact.tolist())]
    expected = [0.7 * f / 0.4 + 0.3 * c / max(contribution) for f, c in zip(freq.tolist(), contribution)]
    torch.testing.assert_close(value_scores(freq, impact, 0.3), torch.tensor(expected, dtype=torch.float64))


def test_fold_step_statistics_matches_a_loop():
    """EMAs of share and mean impact; age grows by the tokens routed to that expert; an expert without tokens
    keeps its impact EMA; a step with a non-finite impact (fp16 overflow) updates no impact."""
    freq, impact, age = torch.tensor([0.25] * 4), torch.tensor([0.1, 0.2, 0.3, 0.4]), torch.tensor([0, 5, 10, 15])
    counts, sums = torch.tensor([6.0, 2.0, 0.0, 8.0]), torch.tensor([3.0, -1.0, 0.0, 4.0])
    new_freq, new_impact, new_age = fold_step_statistics(freq, impact, age, counts, sums, 0.9)
    shares = [c / 16 for c in counts.tolist()]
    torch.testing.assert_close(new_freq, torch.tensor([0.9 * 0.25 + 0.1 * s for s in shares], dtype=torch.float64))
    expected = [0.9 * 0.1 + 0.1 * 0.5, 0.9 * 0.2 + 0.1 * -0.5, 0.3, 0.9 * 0.4 + 0.1 * 0.5]
    torch.testing.assert_close(new_impact, torch.tensor(expected, dtype=torch.float64))
    assert new_age.tolist() == [6, 7, 10, 23]
    _, skipped, _ = fold_step_statistics(freq, impact, age, counts, torch.tensor([1.0, float("inf"), 0, 0]), 0.9)
    torch.testing.assert_close(skipped, impact.double())


def test_probation_protects_young_experts():
    score = torch.tensor([0.9, 0.01, 0.02, 0.8])
    dead, best = select_dead_experts(score, score, torch.tensor([9000, 4999, 5000, 9000]), 0.5, 5000)
    assert best == 0 and dead == [2]


def test_best_expert_is_never_replaced():
    value = torch.tensor([0.1, 0.3, 0.2, 0.05])
    dead, best = select_dead_experts(value, value, torch.full((4,), 10**6), threshold=10.0, min_tokens=5000)
    assert best == 1 and 1 not in dead


def test_the_best_expert_is_the_one_of_largest_value_not_score():
    """A newborn's birth boost can lift its score above every other; the best expert (protected, and the source
    of clones) is still the one of largest value."""
    value = torch.tensor([0.2, 0.9, 0.05, 0.6])
    score = value + torch.tensor([0.0, 0.0, 0.0, 0.35])  # expert 3 is young: boosted above expert 1
    dead, best = select_dead_experts(score, value, torch.full((4,), 10**6), threshold=1.0, min_tokens=5000)
    assert best == 1 and dead == [2, 0]


@pytest.mark.parametrize("num_experts", [8, 5])
def test_at_most_half_the_experts_per_check(num_experts):
    value = torch.linspace(1.0, 0.0, num_experts)
    dead, _ = select_dead_experts(value, value, torch.full((num_experts,), 10**6), threshold=2.0, min_tokens=1)
    assert dead == list(range(num_experts - 1, num_experts - 1 - num_experts // 2, -1))  # lowest scores first


def test_clone_noise_is_gaussian_at_the_relative_scale():
    src = torch.randn(200, 100) * 3.0
    noise = clone_with_noise(src, 0.01, torch.Generator().manual_seed(0)) - src
    assert abs(float(noise.std()) - 0.01 * float(src.std())) < 0.002 * float(src.std())
    assert abs(float(noise.mean())) < 0.002


# ---------------------------------------------------------------------------------------------------------
# the manager inside a model


@pytest.mark.parametrize("block", ["ssm_moe", "ffn_moe"])
def test_impact_ema_is_this_steps_first_order_loss_change(block):
    """impact_i <- EMA of mean over i's tokens of -(dL/dy . y), with dL/dy from torch.autograd.grad; the EMA
    holds this step's value as soon as the step ends (no lag), on any top-k MoE layer built from YAML."""
    model = tiny_model({"ema_decay": 0.9}, block=block)
    assert [name for name, _ in lifecycle_layers(model)] == ["blocks.0.moe"]
    lifecycle = moe_of(model).router.lifecycle
    captured = []
    track = lifecycle.track_impact
    lifecycle.track_impact = lambda y, counts, first: captured.append((y, counts)) or track(y, counts, first)
    inputs, labels = batch(0)
    out = model(inputs, labels=labels)  # reference pass
    y_SD, counts = captured[-1]
    counts = torch.as_tensor(counts).tolist()  # the layer passes top-k's counts as the device tensor
    (grad_SD,) = torch.autograd.grad(out.loss, y_SD)
    impact_S = -(grad_SD.double() * y_SD.double()).sum(-1)
    experts_S = torch.repeat_interleave(torch.arange(E), torch.tensor(counts))
    mean_E = torch.stack([impact_S[experts_S == e].mean() if counts[e] else torch.zeros((), dtype=torch.float64)
                          for e in range(E)])
    lifecycle.step_sums.zero_()  # forget the reference pass
    model(inputs, labels=labels).loss.backward()  # the training pass
    lifecycle_step(model)
    expected = torch.where(torch.tensor(counts) > 0, 0.1 * mean_E, torch.zeros_like(mean_E)).float()
    assert expected.abs().max() > 0
    torch.testing.assert_close(lifecycle.impact_ema_E, expected, rtol=1e-5, atol=1e-10)
    shares = torch.tensor(counts, dtype=torch.float64) / sum(counts)
    torch.testing.assert_close(lifecycle.freq_ema_E, (0.9 / E + 0.1 * shares).float())
    assert lifecycle.age_tokens_E.tolist() == counts  # the tokens each expert saw, not the layer's
    torch.testing.assert_close(lifecycle.scores()[1], birth_boost(torch.tensor(counts), 5000, 0.35).double())


def test_replacement_clones_best_plus_noise_and_resets_optimizer_state_and_statistics():
    cfg = {"min_tokens": 8, "check_interval": 3, "ema_decay": 0.5, "noise_std": 0.05, "exploration_bias": 2.0}
    model = tiny_model(cfg)
    moe = moe_of(model)
    lifecycle = moe.router.lifecycle
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    assert train(model, optimizer, range(1)) == []  # expert 1 still gets tokens: its moments are not zero
    starve(model, 1)
    assert train(model, optimizer, range(1, 2)) == []
    inputs, labels = batch(2)
    optimizer.zero_grad()
    model(inputs, labels=labels).loss.backward()
    optimizer.step()
    params = rows_of(moe)
    assert len(params) == 3  # w1, w2 of the experts and the router's rows
    before = [p.detach().clone() for p in params]
    moments = [{k: v.clone() for k, v in optimizer.state[p].items() if k != "step"} for p in params]
    events = lifecycle_step(model, optimizer)  # step 3: a check

    # the other experts' values are untouched by the replacement: the source is the best of them
    assert [(e["expert"], e["source"]) for e in events] == [(1, int(lifecycle.scores()[0].argmax()))]
    best = events[0]["source"]
    generator = lifecycle.noise_generator("blocks.0.moe")  # the stream the replacement drew from
    for p, old, moment in zip(params, before, moments):
        keep = [e for e in range(E) if e != 1]
        torch.testing.assert_close(p[keep], old[keep], rtol=0, atol=0)
        torch.testing.assert_close(p[1], clone_with_noise(old[best], 0.05, generator))
        noise = (p[1] - old[best]).detach()
        assert 0 < float(noise.abs().max()) and float(noise.std()) < 0.1 * float(old[best].std())
        for key in ("exp_avg", "exp_avg_sq"):
            assert float(moment[key][1].abs().max()) > 0  # there was something to reset
            assert torch.equal(optimizer.state[p][key][1], torch.zeros_like(p[1]))
            torch.testing.assert_close(optimizer.state[p][key][keep], moment[key][keep], rtol=0, atol=0)
    report = log_expert_utilization(model)["blocks.0.moe"]
    assert report["frequency"][1] == 0.0 and report["impact"][1] == 0.0 and report["age_tokens"][1] == 0
    assert report["births"] == [0, 1, 0, 0] and report["logit_bias"] == [0.0, 2.0, 0.0, 0.0]
    assert lifecycle.events == events


def test_exploration_bias_decays_by_099_per_step_and_enters_the_logits():
    model = tiny_model({"exploration_bias": 3.0})
    lifecycle = moe_of(model).router.lifecycle
    lifecycle.reset_expert(2)
    for _ in range(7):
        lifecycle.end_step()
    torch.testing.assert_close(lifecycle.logit_bias_E, torch.tensor([0.0, 0.0, 3.0 * 0.99**7, 0.0]))
    logits = torch.randn(5, E)
    torch.testing.assert_close(lifecycle.bias_logits(logits), logits + lifecycle.logit_bias_E)


def test_impact_of_a_shard_goes_to_its_global_experts_and_is_unscaled_at_the_step():
    """Under expert parallelism a rank holds experts [first, first + L): track_impact adds their -(dL/dy . y) to
    those global experts; end_step multiplies the impact sums by impact_scale (1 / fp16 loss scale)."""
    model = tiny_model({"ema_decay": 0.5})
    lifecycle = moe_of(model).router.lifecycle
    y = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    grad = torch.randn(5, 3, dtype=torch.float64)
    lifecycle.track_impact(y, [2, 3], first_expert=2).backward(grad)
    impact = -(grad * y.detach()).sum(-1)
    expected_sums = torch.tensor([0.0, 0.0, impact[:2].sum(), impact[2:].sum()], dtype=torch.float64)
    torch.testing.assert_close(lifecycle.step_sums[E:], expected_sums)
    lifecycle.step_sums[:E] = torch.tensor([0.0, 0.0, 2.0, 3.0], dtype=torch.float64)
    lifecycle.end_step(impact_scale=0.25)
    means = torch.tensor([0.0, 0.0, impact[:2].sum() / 2, impact[2:].sum() / 3], dtype=torch.float64)
    torch.testing.assert_close(lifecycle.impact_ema_E, (0.5 * 0.25 * means).float())


def test_starved_expert_is_replaced_and_then_receives_tokens():
    model = tiny_model({"min_tokens": 16, "check_interval": 5, "ema_decay": 0.5})
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    stats: list[torch.Tensor] = []
    train(model, optimizer, range(2), stats)
    assert sum(int(s[2]) for s in stats) >= 32  # out of probation, boost gone: it saw 2 x min_tokens tokens
    starve(model, 2)
    stats.clear()
    events = train(model, optimizer, range(2, 5), stats)
    assert all(s[2] == 0 for s in stats), "the starved expert got tokens"
    assert 2 in [e["expert"] for e in events] and all(e["step"] == 5 for e in events)
    stats.clear()
    train(model, optimizer, range(5, 8), stats)
    assert all(s[2] > 0 for s in stats), f"the re-born expert gets no tokens: {stats}"


def test_probation_counts_the_tokens_routed_to_that_expert():
    """An expert starved from birth sees no tokens: however many tokens the layer routes, it stays on probation
    (under a layer-token age it would have been replaced at the first check)."""
    model = tiny_model({"min_tokens": 16, "check_interval": 2, "ema_decay": 0.5, "threshold_ratio": 1.0})
    starve(model, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    events = train(model, optimizer, range(6))
    lifecycle = moe_of(model).router.lifecycle
    assert lifecycle.age_tokens_E[2] == 0 and lifecycle.age_tokens_E.sum() == 6 * 2 * batch(0)[0].numel()
    value, _, score = lifecycle.scores()
    assert score[2] < adaptive_threshold(value, 1.0)  # it would be dead but for probation
    assert events == []  # the others are at or above the median: expert 2 was the only candidate


# every check replaces the experts below the layer's median: decisions in every stretch of a short run
CHURN = {"min_tokens": 16, "check_interval": 2, "threshold_ratio": 1.0, "ema_decay": 0.5}


def test_state_dict_round_trip():
    model = tiny_model(CHURN)
    train(model, torch.optim.AdamW(model.parameters(), lr=1e-3), range(4))
    lifecycle = moe_of(model).router.lifecycle
    assert lifecycle.events, "expected replacements to round-trip"
    state = model.state_dict()
    other = tiny_model(CHURN, seed=1)
    other.load_state_dict(copy.deepcopy(state))
    restored = moe_of(other).router.lifecycle
    for name, buf in lifecycle.named_buffers():
        if not name.startswith("step_sums"):
            assert torch.equal(buf, dict(restored.named_buffers())[name]), name
    assert restored.events == lifecycle.events and restored.events is not lifecycle.events


def test_resumed_run_makes_the_same_decisions():
    model = tiny_model(CHURN)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    train(model, optimizer, range(6))
    saved = copy.deepcopy((model.state_dict(), optimizer.state_dict()))
    later = train(model, optimizer, range(6, 12))
    assert later, "expected replacements after the checkpoint"

    resumed = tiny_model(CHURN, seed=1)
    resumed.load_state_dict(saved[0])
    resumed_optimizer = torch.optim.AdamW(resumed.parameters(), lr=1e-3)
    resumed_optimizer.load_state_dict(saved[1])
    assert train(resumed, resumed_optimizer, range(6, 12)) == later
    assert moe_of(resumed).router.lifecycle.events == moe_of(model).router.lifecycle.events
    for (name, a), b in zip(model.state_dict().items(), resumed.state_dict().values()):
        if torch.is_tensor(a):
            assert torch.equal(a, b), name


def test_statistics_keep_their_dtype_when_the_model_is_cast():
    model = tiny_model({}).bfloat16()
    lifecycle = moe_of(model).router.lifecycle
    assert lifecycle.freq_ema_E.dtype == torch.float32 and lifecycle.step_sums.dtype == torch.float64
    assert moe_of(model).router.weight.dtype == torch.bfloat16


def test_config_errors_name_the_path():
    with pytest.raises(ConfigError, match=r"model.layers\[0\].moe.router.lifecycle.min_tokens \(0\) must be > 0"):
        tiny_model({"min_tokens": 0})
    with pytest.raises(ConfigError, match=r"lifecycle.check_intervall: unknown key; did you mean 'check_interval'"):
        tiny_model({"check_intervall": 5})


def test_a_lifecycle_outside_an_moe_layer_fails_when_the_config_is_read():
    msit = {"type": "msit", "attention": {"num_heads": 2}, "experts": {"d_thin": 8, "num_heads": 2, "windows": [4, 2]},
            "router": {"type": "topk", "k": 1, "lifecycle": {"min_tokens": 8}}}
    with pytest.raises(ConfigError) as err:
        config_from_dict({"model": {"vocab_size": VOCAB, "d_model": D_MODEL, "max_seq_len": 16, "layers": [msit]}})
    assert str(err.value) == (
        "model.layers[0].router.lifecycle is set, but an expert lifecycle manager works only on the router of an MoE "
        "layer (moe.router.lifecycle of an ffn_moe or ssm_moe block); remove it here")


# ---------------------------------------------------------------------------------------------------------
# DeepSpeed ZeRO-2, two gloo processes, expert parallel 1 (all experts on both ranks) and 2 (experts 0-1 on
# rank 0, 2-3 on rank 1: the replaced expert 1 and its source, the dominant expert 3, live on different ranks)

LR, BETAS, EPS = 1e-2, (0.9, 0.999), 1e-8
ZERO2_LIFECYCLE = {"min_tokens": 16, "check_interval": 3, "ema_decay": 0.5, "impact_weight": 0.2,
                   "threshold_ratio": 0.5}


def zero2_run(ep: int, out_dir: str) -> None:
    """Train under ZeRO-2; expert 3 takes every token's first slot; after step 0 (which leaves expert 1 out of
    probation) expert 1 is starved. At the check (step 3) record the rows of the module, the fp32 master and the
    Adam moments; then one more step (with its full gradient) and record them again."""
    import deepspeed
    import torch.distributed as dist
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
    from deepspeed.utils import safe_get_full_grad

    from moep_ds.distributed import optimizer_state as st
    from moep_ds.distributed.engine import Engine
    from moep_ds.train_config import OptimizerConfig
    from moep_ds.distributed.expert_parallel import expert_parallel_plan, setup_expert_parallel
    from moep_ds.training.optim import param_groups

    rank = dist.get_rank()
    plan = expert_parallel_plan(tiny_model_cfg(ZERO2_LIFECYCLE), ep)
    model = tiny_model(ZERO2_LIFECYCLE, plan=plan)
    block = model.blocks[0]
    with torch.no_grad():
        block.moe_norm.bias.fill_(1.0)  # router input x_hat + 1: a constant row gives a constant logit
        block.moe.router.weight[3] = 0.3
    setup_expert_parallel(model, plan)
    groups = param_groups(model, OptimizerConfig(weight_decay=0.0))
    if plan.size > 1:
        groups = split_params_into_different_moe_groups_for_optimizer(groups)
    optimizer = torch.optim.AdamW(groups, lr=LR, betas=BETAS, eps=EPS, weight_decay=0.0)
    ds_config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
                 "zero_optimization": {"stage": 2, "contiguous_gradients": True}, "zero_allow_untested_optimizer": True}
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config, dist_init_required=False)
    callback = LifecycleRunner.for_engine(Engine(engine, None, ds_config), plan.group)
    moe = moe_of(engine.module)
    rows = moe.expert_rows()
    params = rows.local + rows.replicated

    def snapshot() -> dict:
        return {
            "module": [p.detach().clone() for p in params],
            "master": [st.get_fp32_param(p) for p in params],
            "exp_avg": [st.get_optimizer_state(p, engine.optimizer, "exp_avg") for p in params],
            "exp_avg_sq": [st.get_optimizer_state(p, engine.optimizer, "exp_avg_sq") for p in params],
        }

    def step(step_idx: int, with_grads: bool = False) -> tuple[list[dict], list[torch.Tensor]]:
        inputs, labels = batch(step_idx, rank)
        engine.backward(engine(inputs, labels=labels).loss)
        grads = [safe_get_full_grad(p).clone() for p in params] if with_grads else []
        engine.step()
        return callback.after_optimizer_step(step_idx + 1), grads

    events = step(0)[0]
    router = moe.router.weight
    starved = st.get_fp32_param(router)
    starved[1] = -1.0
    st.set_fp32_param(router, starved)  # the master too: the next step would restore the module from it
    for i in (1, 2):
        events += step(i)[0]
    after_replace = snapshot()
    _, grads = step(3, with_grads=True)
    result = {"events": events, "replaced": after_replace, "stepped": snapshot(), "grads": grads,
              "adam_step": st.optimizer_step_count(engine.optimizer), "num_local": rows.num_local_experts,
              "first": [rows.first_expert] * len(rows.local) + [0] * len(rows.replicated)}
    torch.save(result, pathlib.Path(out_dir) / f"ep{ep}_rank{rank}.pt")


def zero2_worker(out_dir: str) -> None:
    import deepspeed
    import torch.distributed as dist

    deepspeed.init_distributed(dist_backend="gloo")
    for ep in (1, 2):
        zero2_run(ep, out_dir)
    dist.barrier()
    dist.destroy_process_group()


def held_row(ranks: list[dict], key: str, i: int, expert: int) -> torch.Tensor:
    """Row `expert` of parameter i's fp32 master right after the replacement, as recorded by a rank holding it."""
    for result in ranks:
        first, rows = result["first"][i], result["replaced"][key][i]
        if first <= expert < first + rows.shape[0]:
            return rows[expert - first]
    raise AssertionError(f"no rank holds expert {expert}")


@pytest.mark.slow
def test_replacement_under_zero2_survives_the_next_step(tmp_path):
    """On 2 ranks of this test (tests/ranks.py), at expert parallel 1 and 2."""
    run_ranks(2, zero2_worker, str(tmp_path), env={"DS_ACCELERATOR": "cpu"}, timeout=540)
    runs = {ep: [torch.load(tmp_path / f"ep{ep}_rank{r}.pt", weights_only=True) for r in range(2)] for ep in (1, 2)}
    for ep, ranks in runs.items():
        events = ranks[0]["events"]
        assert [(e["expert"], e["source"], e["step"]) for e in events] == [(1, 3, 3)], (ep, events)
        assert ranks[1]["events"] == events
        holders = [r for r, res in enumerate(ranks) if res["first"][0] <= 1 < res["first"][0] + res["num_local"]]
        assert holders == ([0, 1] if ep == 1 else [0])  # at ep 2 the source (3) is on rank 1, the clone on rank 0
        for r, result in enumerate(ranks):
            replaced, stepped, t = result["replaced"], result["stepped"], result["adam_step"]
            for i, grad in enumerate(result["grads"]):
                first = result["first"][i]
                if not first <= 1 < first + replaced["master"][i].shape[0]:
                    continue
                row = 1 - first
                clone = replaced["master"][i][row]
                # right after the replacement: module = master = best + noise; moments of the row are zero
                torch.testing.assert_close(replaced["module"][i][row], clone)
                source = held_row(ranks, "master", i, 3)
                assert 0 < float((clone - source).abs().max()) < 0.1 * float(clone.abs().max())
                assert float(replaced["exp_avg"][i][row].abs().max()) == 0.0
                assert float(replaced["exp_avg_sq"][i][row].abs().max()) == 0.0
                # one step later: Adam from zero moments, applied to the clone, in the master and the module
                g = grad[row]
                torch.testing.assert_close(stepped["exp_avg"][i][row], (1 - BETAS[0]) * g)
                torch.testing.assert_close(stepped["exp_avg_sq"][i][row], (1 - BETAS[1]) * g * g)
                m_hat = (1 - BETAS[0]) * g / (1 - BETAS[0] ** t)
                v_hat = (1 - BETAS[1]) * g * g / (1 - BETAS[1] ** t)
                expected = clone - LR * m_hat / (v_hat.sqrt() + EPS)
                torch.testing.assert_close(stepped["master"][i][row], expected)
                torch.testing.assert_close(stepped["module"][i][row], expected)
                # the same clone as with every expert on every rank
                torch.testing.assert_close(clone, held_row(runs[1], "master", i, 1), rtol=1e-4, atol=1e-6)
    for key in ("module", "master", "exp_avg", "exp_avg_sq"):
        for a, b in zip(runs[1][0]["stepped"][key], runs[1][1]["stepped"][key]):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        replicated = slice(-1, None)  # the router's rows: the same on both expert-parallel ranks
        for a, b in zip(runs[2][0]["stepped"][key][replicated], runs[2][1]["stepped"][key][replicated]):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
