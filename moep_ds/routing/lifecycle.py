"""Expert lifecycle manager (MoE-Stream): the statistics of a top-k MoE layer's experts and the decisions.

# T tokens, S assignments (token, expert) pairs, D model dim, E experts, L experts held by this rank

Per expert, updated once per optimizer step from the step's sums over all ranks:

    frequency f_i  <- EMA of the share of the step's assignments routed to i           (sums to 1 over i)
    impact    m_i  <- EMA of mean over i's routed tokens of -(dL/dy . y), y = expert i's output for the
                      token: the first-order loss increase if the expert's output were removed; taken from a
                      gradient hook on the expert outputs, so it uses this step's gradients
    age       a_i  <- a_i + tokens routed to expert i this step           (tokens the expert saw since birth)
    value     v_i  =  (1 - w) f_i / max_j f_j + w c_i / max_j c_j,  c_i = f_i max(m_i, 0)  (in [0, 1])
    boost     b_i  =  0.35 max(0, 1 - a_i / (2 min_tokens))
    score     s_i  =  v_i + b_i

Every `check_interval` steps: threshold = `threshold_ratio` x median_j v_j (adaptive, per layer); expert i is
dead if s_i < threshold and a_i >= min_tokens (probation). The best expert (largest v) is never replaced,
and at most floor(E / 2) experts are replaced per check, lowest score first. A dead expert becomes a clone of
the best expert plus Gaussian noise (expert weights and its router row), its optimizer moments and
statistics are reset, and its router logit gets an exploration bias that decays by x0.99 per step.
The seed gives no formulas for the value score, the threshold, the check interval or the bias size: those
are this project's choices.

Homes: the math is the plain functions below; `ExpertLifecycle` holds one layer's state (EMAs, ages, biases,
event log: module buffers and extra state, so in every state_dict) and makes the decisions; a routed layer
offers itself to the manager through the `LifecycleManaged` interface; applying a replacement to the model
and the optimizer (fp32 masters and Adam moments under ZeRO, experts on other ranks) is the trainer callback
`moep_ds.training.lifecycle.LifecycleRunner`.
"""
from __future__ import annotations

import dataclasses
import logging
import zlib
from typing import Annotated, Any, Sequence

import torch
from torch import nn

from moep_ds.routing.buffers import KeepBufferDtypes
from moep_ds.recompute import add_recording_flag
from moep_ds.routing.plan import counts_on
from moep_ds.schema import Between, NonNegativeFloat, NonNegativeInt, PositiveInt

log = logging.getLogger(__name__)

Fraction01 = Annotated[float, Between(0.0, 1.0)]


@dataclasses.dataclass(kw_only=True)
class LifecycleConfig:
    min_tokens: PositiveInt = 5000  # probation, in tokens routed to the expert since its birth
    check_interval: PositiveInt = 100  # optimizer steps between dead-expert checks
    ema_decay: Annotated[float, Between(0.0, 1.0, hi_open=True)] = 0.99
    impact_weight: Fraction01 = 0.5  # w in the value score
    threshold_ratio: Fraction01 = 0.25  # dead below this fraction of the layer's median value
    birth_boost: NonNegativeFloat = 0.35  # score boost at birth, gone at 2 x min_tokens
    noise_std: NonNegativeFloat = 0.01  # clone noise, relative to the std of each cloned tensor row
    exploration_bias: float = 1.0  # added to a newborn's router logit
    bias_decay: Fraction01 = 0.99  # per optimizer step
    seed: NonNegativeInt = 0  # clone noise is drawn from (seed, layer, step): identical on every rank


# ---------------------------------------------------------------------------------------------------------
# the math, as plain functions


def ema_update(old: torch.Tensor, new: torch.Tensor, decay: float) -> torch.Tensor:
    return decay * old + (1.0 - decay) * new


def fold_step_statistics(
    freq_E: torch.Tensor, impact_E: torch.Tensor, age_E: torch.Tensor,
    counts_E: torch.Tensor, impact_sum_E: torch.Tensor, decay: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(frequency, impact, age) after one step with `counts_E` tokens routed to each expert (all ranks) and
    `impact_sum_E` summed -(dL/dy . y) over them. An expert that got no tokens keeps its impact EMA, as does
    every expert on a step with non-finite gradients (fp16 overflow: the optimizer skips that step too)."""
    counts_E = counts_E.double()
    total = counts_E.sum()
    if total > 0:
        freq_E = ema_update(freq_E.double(), counts_E / total, decay)
    observed_E = (counts_E > 0) & torch.isfinite(impact_sum_E).all()
    mean_impact_E = impact_sum_E.double() / counts_E.clamp(min=1)
    impact_E = torch.where(observed_E, ema_update(impact_E.double(), mean_impact_E, decay), impact_E.double())
    return freq_E, impact_E, age_E + counts_E.round().long()


def birth_boost(age_tokens_E: torch.Tensor, min_tokens: int, max_boost: float) -> torch.Tensor:
    """max_boost at age 0, falling linearly to 0 at 2 x min_tokens, 0 after (age: the expert's own tokens)."""
    remaining = 1.0 - age_tokens_E.double() / (2 * min_tokens)
    return (max_boost * remaining.clamp(min=0.0)).float()


def _share_of_max(x_E: torch.Tensor) -> torch.Tensor:
    top = x_E.max()
    return x_E / top if top > 0 else torch.zeros_like(x_E)


def value_scores(freq_E: torch.Tensor, impact_E: torch.Tensor, impact_weight: float) -> torch.Tensor:
    """v in [0, 1]: routing share and expected loss reduction (share x positive impact), each relative to the
    layer's best, so the score is scale-free across layers, loss scales and training phases."""
    contribution_E = freq_E * impact_E.clamp(min=0.0)
    return (1.0 - impact_weight) * _share_of_max(freq_E) + impact_weight * _share_of_max(contribution_E)


def adaptive_threshold(value_E: torch.Tensor, ratio: float) -> float:
    """Per-layer threshold: a fraction of the layer's median value (robust to one dominant expert)."""
    return ratio * float(value_E.median())


def select_dead_experts(
    score_E: torch.Tensor, value_E: torch.Tensor, age_tokens_E: torch.Tensor, threshold: float, min_tokens: int
) -> tuple[list[int], int]:
    """Experts to replace (lowest score first) and the layer's best expert (largest value, never replaced).

    Dead: score < threshold and out of probation (age >= min_tokens). At most floor(E / 2) per call.
    """
    num_experts = score_E.numel()
    best = int(torch.argmax(value_E))
    eligible = (score_E < threshold) & (age_tokens_E >= min_tokens)
    eligible[best] = False
    candidates = [int(i) for i in torch.argsort(score_E, stable=True) if eligible[i]]
    return candidates[: num_experts // 2], best


def clone_with_noise(src: torch.Tensor, noise_std: float, generator: torch.Generator) -> torch.Tensor:
    """src + N(0, (noise_std * std(src))^2), noise drawn on the CPU from `generator` (same on every rank)."""
    src32 = src.detach().float()
    scale = noise_std * float(src32.std()) if src32.numel() > 1 else 0.0
    noise = torch.randn(src32.shape, generator=generator, dtype=torch.float32).to(src32.device)
    return src32 + scale * noise


# ---------------------------------------------------------------------------------------------------------
# per-layer state


class ExpertLifecycle(KeepBufferDtypes):
    """Statistics, ages, exploration biases and event log of one top-k MoE layer's experts (all E of them,
    also when this rank holds only L: the statistics are summed over all ranks before they are folded in).

    Owned by the layer's router (`router.lifecycle`), which calls `bias_logits` and `count_routed_tokens`; the
    MoE layer passes its expert outputs through `track_impact`. All of it is in `state_dict()`: the tensors as
    buffers (kept in their own dtype when the model is cast to bf16/fp16), the event log as extra state.
    """

    def __init__(self, cfg: LifecycleConfig, num_experts: int):
        super().__init__()
        self.cfg = cfg
        self.num_experts = E = num_experts
        self.register_buffer("freq_ema_E", torch.full((E,), 1.0 / E, dtype=torch.float32))
        self.register_buffer("impact_ema_E", torch.zeros(E, dtype=torch.float32))
        self.register_buffer("age_tokens_E", torch.zeros(E, dtype=torch.int64))  # own tokens since birth
        self.register_buffer("births_E", torch.zeros(E, dtype=torch.int64))  # times replaced
        self.register_buffer("logit_bias_E", torch.zeros(E, dtype=torch.float32))  # exploration bias
        self.register_buffer("num_steps", torch.zeros((), dtype=torch.int64))
        # this step's sums over micro-batches: tokens routed [E], impact sums [E] (fp64: exact counts)
        self.register_buffer("step_sums", torch.zeros(2 * E, dtype=torch.float64), persistent=False)
        add_recording_flag(self)  # false while activation checkpointing recomputes a forward
        self.events: list[dict[str, Any]] = []  # every replacement so far


    # ---- called during forward / backward

    def bias_logits(self, logits_TE: torch.Tensor) -> torch.Tensor:
        """Router logits plus the exploration biases of newborn experts."""
        return logits_TE + self.logit_bias_E.to(logits_TE.dtype)

    def count_routed_tokens(self, counts_E: torch.Tensor) -> None:
        """The one place a forward pass adds to the running statistics: tokens routed to each expert by this
        rank's plan (training only). A pass that recomputes a forward (activation checkpointing) adds nothing:
        its recording flag is false (moep_ds/recompute.py)."""
        if self.training and torch.is_grad_enabled():
            with torch.no_grad():
                self.step_sums[: self.num_experts] += counts_E.to(torch.float64) * self.recording_statistics

    def track_impact(
        self, y_SD: torch.Tensor, counts: Sequence[int] | torch.Tensor, first_expert: int = 0
    ) -> torch.Tensor:
        """Identity on the expert outputs (grouped by expert: counts[l] rows for expert first_expert + l, the
        experts this rank holds); in training, a gradient hook adds -(dL/dy . y) of each row to its expert's
        impact sum once backward has produced dL/dy (this step's gradient: no lag)."""
        if first_expert < 0 or first_expert + len(counts) > self.num_experts:
            raise ValueError(f"experts [{first_expert}, {first_expert + len(counts)}) are not among the "
                             f"{self.num_experts} managed")
        if not (self.training and y_SD.requires_grad):
            return y_SD
        experts_S = torch.repeat_interleave(
            torch.arange(len(counts), device=y_SD.device) + self.num_experts + first_expert,
            counts_on(counts, y_SD.device),
            output_size=y_SD.shape[0],
        )
        y_detached = y_SD.detach()

        def accumulate_impact(grad_SD: torch.Tensor) -> None:
            with torch.no_grad():
                impact_S = -(grad_SD.double() * y_detached.double()).sum(-1)
                self.step_sums.index_add_(0, experts_S.to(self.step_sums.device), impact_S.to(self.step_sums.device))

        y_SD.register_hook(accumulate_impact)
        return y_SD

    # ---- once per optimizer step

    @torch.no_grad()
    def end_step(self, sums: torch.Tensor | None = None, impact_scale: float = 1.0) -> None:
        """Fold this step's sums (default: the local `step_sums`; pass the sum over all ranks when distributed)
        into the EMAs and ages, decay the exploration biases, advance the step count, clear the sums.

        `impact_scale` multiplies the impact sums (1 / loss scale under fp16 loss scaling)."""
        E = self.num_experts
        sums = (self.step_sums if sums is None else sums).to(self.step_sums.device, torch.float64)
        freq_E, impact_E, age_E = fold_step_statistics(
            self.freq_ema_E, self.impact_ema_E, self.age_tokens_E, sums[:E], sums[E:] * impact_scale,
            self.cfg.ema_decay,
        )
        self.freq_ema_E.copy_(freq_E)
        self.impact_ema_E.copy_(impact_E)
        self.age_tokens_E.copy_(age_E)
        self.logit_bias_E.mul_(self.cfg.bias_decay)
        self.num_steps += 1
        self.step_sums.zero_()

    def check_due(self) -> bool:
        return int(self.num_steps) % self.cfg.check_interval == 0

    def scores(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """value [E], boost [E], score = value + boost [E]."""
        cfg = self.cfg
        value_E = value_scores(self.freq_ema_E.double(), self.impact_ema_E.double(), cfg.impact_weight)
        boost_E = birth_boost(self.age_tokens_E, cfg.min_tokens, cfg.birth_boost).to(value_E)
        return value_E, boost_E, value_E + boost_E

    def plan_replacements(self, layer_name: str) -> list[dict[str, Any]]:
        """The check: one event per expert to replace (`expert` becomes a noisy clone of `source`), with the
        statistics that decided it. Applying them is the trainer callback's job; then call `reset_expert`."""
        value_E, _, score_E = self.scores()
        threshold = adaptive_threshold(value_E, self.cfg.threshold_ratio)
        dead, best = select_dead_experts(score_E, value_E, self.age_tokens_E, threshold, self.cfg.min_tokens)
        return [
            {
                "event": "replace",
                "step": int(self.num_steps),
                "layer": layer_name,
                "expert": e,
                "source": best,
                "score": float(score_E[e]),
                "value": float(value_E[e]),
                "threshold": threshold,
                "frequency": float(self.freq_ema_E[e]),
                "impact": float(self.impact_ema_E[e]),
                "age_tokens": int(self.age_tokens_E[e]),
            }
            for e in dead
        ]

    @torch.no_grad()
    def reset_expert(self, expert: int) -> None:
        """Statistics of a newborn expert: fresh EMAs, age 0, exploration bias on its logit."""
        self.freq_ema_E[expert] = 0.0
        self.impact_ema_E[expert] = 0.0
        self.age_tokens_E[expert] = 0
        self.births_E[expert] += 1
        self.logit_bias_E[expert] = self.cfg.exploration_bias

    def noise_generator(self, layer_name: str) -> torch.Generator:
        """Same stream on every rank and in a resumed run: seeded by (seed, layer, step)."""
        key = f"{self.cfg.seed}/{layer_name}/{int(self.num_steps)}".encode()
        return torch.Generator().manual_seed(zlib.crc32(key))

    # ---- reporting and checkpoint state

    def log_expert_utilization(self) -> dict[str, list[float]]:
        """Per expert: frequency and impact EMAs, value, boost, score, age, births, bias."""
        value_E, boost_E, score_E = self.scores()
        report = {
            "frequency": self.freq_ema_E,
            "impact": self.impact_ema_E,
            "value": value_E,
            "boost": boost_E,
            "score": score_E,
            "age_tokens": self.age_tokens_E,
            "births": self.births_E,
            "logit_bias": self.logit_bias_E,
        }
        return {name: t.tolist() for name, t in report.items()}

    def record(self, event: dict[str, Any]) -> None:
        self.events.append(event)
        log.info("expert lifecycle: %s", event)

    def get_extra_state(self) -> dict[str, Any]:
        return {"events": [dict(e) for e in self.events]}

    def set_extra_state(self, state: dict[str, Any]) -> None:
        self.events = [dict(e) for e in state["events"]]

    def extra_repr(self) -> str:
        cfg = self.cfg
        return f"num_experts={self.num_experts}, min_tokens={cfg.min_tokens}, check_interval={cfg.check_interval}"


# ---------------------------------------------------------------------------------------------------------
# what a managed layer offers


@dataclasses.dataclass(frozen=True)
class ExpertRows:
    """The parameters a replacement rewrites, all with the expert as leading axis.

    local: stacked over the experts this rank holds (row l is expert first_expert + l); sharded under expert
        parallelism. replicated: stacked over all E experts and the same on every rank (the router's rows).
    """

    local: list[nn.Parameter]
    replicated: list[nn.Parameter]
    first_expert: int
    num_local_experts: int

    def holds(self, expert: int) -> bool:
        return self.first_expert <= expert < self.first_expert + self.num_local_experts


class LifecycleManaged:
    """Interface of a routed layer whose experts an ExpertLifecycle can manage (the MoE layer implements it).

    The trainer finds managed layers by this type (`lifecycle_layers`), not by probing attributes."""

    def expert_lifecycle(self) -> ExpertLifecycle | None:
        raise NotImplementedError

    def expert_rows(self) -> ExpertRows:
        raise NotImplementedError

    def reset_expert(self, expert: int) -> None:
        """The routing state of a replaced expert starts afresh (its statistics; a layer with more per-expert
        router state, such as a loss-free balancing bias, resets that too)."""
        self.expert_lifecycle().reset_expert(expert)


def lifecycle_layers(model: nn.Module) -> list[tuple[str, LifecycleManaged]]:
    """(name, layer) for every managed layer that has a lifecycle manager, in module order."""
    return [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(module, LifecycleManaged) and module.expert_lifecycle() is not None
    ]


def log_expert_utilization(model: nn.Module) -> dict[str, dict[str, list[float]]]:
    """Per lifecycle-managed layer and expert: frequency, impact, value, boost, score, age, births, bias."""
    return {name: layer.expert_lifecycle().log_expert_utilization() for name, layer in lifecycle_layers(model)}


__all__ = [
    "ExpertLifecycle",
    "ExpertRows",
    "LifecycleConfig",
    "LifecycleManaged",
    "adaptive_threshold",
    "birth_boost",
    "clone_with_noise",
    "ema_update",
    "fold_step_statistics",
    "lifecycle_layers",
    "log_expert_utilization",
    "select_dead_experts",
    "value_scores",
]
