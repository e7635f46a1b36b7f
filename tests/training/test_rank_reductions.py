"""The trainer's per-step reductions over data-parallel ranks, on 2 ranks simulated in one process: each rank's
all-reduce is answered with the element-wise SUM of what both ranks contribute (recorded first from the other
rank), as gloo/NCCL's all_reduce(SUM) would. Expert-choice thresholds are averaged (training/hooks.py); the step's
losses are averaged and a stop request or a due time-based checkpoint of ANY rank stops / checkpoints every rank
(TrainModule.reduce_step, with the flags of the stop and checkpointing callbacks)."""
import copy
import types

import pytest
import torch

from moep_ds.routing.expert_choice import ExpertChoiceConfig, ExpertChoiceRouter
from moep_ds.training import hooks
from moep_ds.training import train_module as train_module_mod
from moep_ds.training.balancing import LossFreeBalancing
from moep_ds.training.callbacks.builtin import Checkpointing, CheckpointingConfig
from moep_ds.training.train_module import TrainModule

WORLD = 2


class SimulatedSum:
    """all_reduce(SUM) over WORLD ranks run one after another: `record(rank)` keeps what a rank sends without
    changing it; `reduce(rank)` adds the other ranks' recorded tensors into the caller's."""

    def __init__(self):
        self.sent: dict[int, torch.Tensor] = {}
        self.rank = 0
        self.recording = True

    def __call__(self, tensor: torch.Tensor, op=None, *args, **kwargs) -> None:
        assert op in (None, torch.distributed.ReduceOp.SUM), op  # a sum is what this simulates
        if self.recording:
            self.sent[self.rank] = tensor.detach().clone()
            return
        for rank, other in self.sent.items():
            if rank != self.rank:
                tensor.add_(other.to(tensor.dtype))


def router(seed: int) -> ExpertChoiceRouter:
    torch.manual_seed(seed)
    r = ExpertChoiceRouter(ExpertChoiceConfig(score="softmax_tokens"), d_model=8, num_experts=4)
    with torch.no_grad():
        r.threshold.copy_(torch.rand(4))
        r.log_norm.copy_(torch.randn(4))
        r.num_threshold_updates.fill_(3)
    return r


def test_expert_choice_thresholds_are_averaged_over_the_ranks(monkeypatch):
    """Each rank's EMA saw only its tokens; after the sync every rank holds the mean (not the sum) of the ranks'
    thresholds and normalisers, so that evaluation routes alike whichever rank's copy is saved."""
    reduce = SimulatedSum()
    monkeypatch.setattr(hooks.dist, "get_world_size", lambda group=None: WORLD)
    monkeypatch.setattr(hooks.dist, "all_reduce", reduce)
    ranks = [torch.nn.ModuleList([router(10 + r), router(20 + r)]) for r in range(WORLD)]
    before = [{n: b.clone() for n, b in m.named_buffers()} for m in ranks]
    for rank, model in enumerate(ranks):
        reduce.rank = rank
        hooks.sync_router_thresholds(copy.deepcopy(model))  # what the rank sends
    reduce.recording = False
    for rank, model in enumerate(ranks):
        reduce.rank = rank
        hooks.sync_router_thresholds(model)
    for rank, model in enumerate(ranks):
        for name, b in model.named_buffers():
            if b.is_floating_point():
                want = sum(before[r][name].double() for r in range(WORLD)) / WORLD
                torch.testing.assert_close(b.double(), want, rtol=1e-6, atol=1e-7, msg=f"rank {rank} {name}")
                assert b.dtype == torch.float32
            else:  # update counters are the same on every rank and are not averaged
                assert torch.equal(b, before[rank][name]), name


def fake_module(rank: int, **attributes) -> TrainModule:
    """A TrainModule of rank `rank` without an engine or a model: what reduce_step reads."""
    fake = object.__new__(TrainModule)
    vars(fake).update({"world": WORLD, "rank": rank, "device": torch.device("cpu"), "step_grad_norm": None,
                       "balancing": LossFreeBalancing(torch.nn.Module()), **attributes})
    return fake


def checkpointing_flags(minutes: float | None, trained: float) -> dict[str, bool]:
    """The flags the built-in checkpointing callback contributes on a rank that has trained `trained` seconds since
    its last every_minutes save."""
    callback = Checkpointing(CheckpointingConfig(every_minutes=minutes))
    callback.trainer = types.SimpleNamespace(checkpointer=types.SimpleNamespace(failed=lambda: False))
    callback.load_state_dict({"trained_seconds": trained})
    return callback.flags()


@pytest.mark.parametrize("stopping_rank", [None, 0, 1])
@pytest.mark.parametrize("due_rank", [None, 0, 1])
def test_reduce_step_averages_losses_and_any_ranks_flag_stops_or_checkpoints_every_rank(
        monkeypatch, stopping_rank, due_rank):
    """A signal reaches one rank (SLURM preemption sends it to one task; the launcher watch fires on one node) and
    clocks differ between ranks: every rank must then checkpoint and stop together at the same step, or the ranks
    would leave each other in mismatched collectives."""
    reduce = SimulatedSum()
    monkeypatch.setattr(train_module_mod.dist, "all_reduce", reduce)
    sums = [{"loss": torch.tensor(2.0 + r), "ce_loss": torch.tensor(1.5 * (r + 1)), "aux/x": torch.tensor(0.25 * r)}
            for r in range(WORLD)]
    fakes = [fake_module(r) for r in range(WORLD)]
    # 2 minutes since the last save on `due_rank`: a save is due there
    flags = [{"stop": r == stopping_rank, **checkpointing_flags(1.0, 120 if r == due_rank else 0)}
             for r in range(WORLD)]
    results = []
    for phase in ("record", "reduce"):
        reduce.recording = phase == "record"
        for rank in range(WORLD):
            reduce.rank = rank
            results.append(TrainModule.reduce_step(fakes[rank], sums[rank], flags[rank]))
    for rank, (losses, agreed, nonfinite) in enumerate(results[WORLD:]):
        assert nonfinite is None
        assert sorted(losses) == ["aux/x", "ce_loss", "loss"]
        for key, value in losses.items():
            assert float(value) == pytest.approx(sum(float(s[key]) for s in sums) / WORLD), (rank, key)
        assert agreed == {"stop": stopping_rank is not None, "checkpoint_due": due_rank is not None,
                          "checkpoint_failed": False}, (rank, stopping_rank, due_rank)


def test_reduce_step_sums_the_balancing_counts_over_ranks_and_updates_every_bias_alike(monkeypatch):
    """Loss-free balancing travels in the step's one collective: each rank's step counts (summed over its
    micro-batches) are summed over the ranks, and every rank applies b += u sign(mean - c) to the global counts,
    so the bias stays replicated; counts beyond fp32's 2^24 stay exact."""
    from moep_ds.routing.balancing import loss_free_bias_update
    from moep_ds.routing.topk import TopKConfig, TopKRouter

    reduce = SimulatedSum()
    monkeypatch.setattr(train_module_mod.dist, "all_reduce", reduce)
    big = 2.0 ** 25
    local = [torch.tensor([big + 3, 1, 5, 7], dtype=torch.float64), torch.tensor([1, 9, 0, 1], dtype=torch.float64)]
    fakes, routers = [], []
    for rank in range(WORLD):
        r = TopKRouter(TopKConfig(k=1, bias_update_rate=0.5), d_model=4, num_experts=4)
        r.balancer.bias_E.copy_(torch.tensor([0.5, 0.0, -0.5, 1.0]))
        r.balancer.step_counts_E.copy_(local[rank])
        fake = fake_module(rank)
        fake.balancing = LossFreeBalancing(torch.nn.ModuleList([r]))
        fakes.append(fake)
        routers.append(r)
    sums = {"loss": torch.tensor(1.0)}
    for phase in ("record", "reduce"):
        reduce.recording = phase == "record"
        for rank in range(WORLD):
            reduce.rank = rank
            if phase == "record":  # what the rank sends, without updating its bias
                TrainModule.reduce_step(fake_module(rank, balancing=types.SimpleNamespace(
                    local_counts=fakes[rank].balancing.local_counts, end_step=lambda c: None)), sums, {"stop": False})
            else:
                TrainModule.reduce_step(fakes[rank], sums, {"stop": False})
    want = loss_free_bias_update(torch.tensor([0.5, 0.0, -0.5, 1.0]), local[0] + local[1], 0.5)
    assert torch.equal(want, torch.tensor([0.0, 0.5, 0.0, 1.5]))  # [2^25+4, 10, 5, 8]: only expert 0 above the mean
    for r in routers:
        assert torch.equal(r.balancer.bias_E, want)
        assert not r.balancer.step_counts_E.any()


NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize("losses,norm,found", [
    ((2.0, NAN), 1.0, "loss (nan on rank 1)"),
    ((INF, 2.0), 1.0, "loss (inf on rank 0)"),
    ((NAN, -INF), None, "loss (nan on 2 ranks)"),
    ((2.0, 3.0), INF, "gradient norm (inf)"),
    ((2.0, 3.0), -1.0, "gradient norm"),  # DeepSpeed's group norms' mark of a non-finite gradient
    ((2.0, NAN), NAN, "loss (nan on rank 1) and gradient norm (nan)"),
    ((2.0, 3.0), 5.0, None),
    ((2.0, 3.0), None, None),  # no norm kept (or a step the fp16 loss scaler skipped: TrainModule.train_step)
])
def test_reduce_step_agrees_on_a_non_finite_loss_of_any_rank_or_gradient_norm(monkeypatch, losses, norm, found):
    """Megatron's --check-for-nan-in-loss-and-grad, in the step's one all-reduce: a loss that is not finite on one
    rank only is named on every rank, with that rank; the gradient norm (DeepSpeed's global one) alike. The losses and
    flags travel as before."""
    reduce, calls = SimulatedSum(), []
    monkeypatch.setattr(train_module_mod.dist, "all_reduce", lambda *args, **kwargs: calls.append(reduce(*args)))
    fakes = [fake_module(r, step_grad_norm=None if norm is None else torch.tensor(norm)) for r in range(WORLD)]
    results = []
    for phase in ("record", "reduce"):
        reduce.recording = phase == "record"
        for rank in range(WORLD):
            reduce.rank = rank
            sums = {"loss": torch.tensor(losses[rank]), "ce_loss": torch.tensor(1.0 + rank)}
            results.append(TrainModule.reduce_step(fakes[rank], sums, {"stop": rank == 1}))
    assert len(calls) == 2 * WORLD  # one collective per rank and phase
    for reduced, flags, nonfinite in results[WORLD:]:
        assert nonfinite == found
        assert flags == {"stop": True} and float(reduced["ce_loss"]) == 1.5
