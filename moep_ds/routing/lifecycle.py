"""Expert lifecycle manager (MoE-Stream): find dead experts of a top-k MoE layer and re-birth them.

# T tokens, S assignments (token, expert) pairs, D model dim, E experts

Per expert, updated once per optimizer step from the step's (data-parallel reduced) sums:

    frequency f_i  <- EMA of the share of the step's assignments routed to i           (sums to 1 over i)
    impact    m_i  <- EMA of mean over i's routed tokens of -(dL/dy . y), y = expert i's output for the
                      token: the first-order loss increase if the expert's output were removed; taken from a
                      gradient hook on the expert outputs, so it uses this step's gradients
    value     v_i  =  (1 - w) f_i / max_j f_j + w c_i / max_j c_j,  c_i = f_i max(m_i, 0)  (in [0, 1])
    boost     b_i  =  0.35 max(0, 1 - age_i / (2 min_tokens))   (age: tokens the layer routed since i's birth)
    score     s_i  =  v_i + b_i

Every `check_interval` steps: threshold = `threshold_ratio` x median_j v_j (adaptive, per layer); expert i is
dead if s_i < threshold and age_i >= min_tokens (probation). The best expert (largest v) is never replaced,
and at most floor(E / 2) experts are replaced per check, lowest score first. A dead expert becomes a clone of
the best expert plus Gaussian noise (expert weights and its router row), its optimizer moments and
statistics are reset, and its router logit gets an exploration bias that decays by x0.99 per step.

Wiring: `router: {type: topk, lifecycle: {...}}` gives that router an `ExpertLifecycle` (`router.lifecycle`);
the router adds its biases and counts its plans, the MoE layer passes the expert outputs through
`track_impact`, and the trainer calls `lifecycle_step(model, io, all_reduce=...)` after every optimizer step.
Model code here never imports deepspeed or torch.distributed: the data-parallel reduction is a callable, and
master weights and optimizer state are reached through a `ParamStateIO` (`TorchParamStateIO` below for a
plain torch optimizer; `moep_ds.training.lifecycle_state` for DeepSpeed ZeRO, where both are partitioned).
"""
from __future__ import annotations

import dataclasses
import logging
import zlib
from typing import Annotated, Any, Callable, Protocol

import torch
from torch import nn

from moep_ds.recompute import is_recomputing
from moep_ds.schema import Between, NonNegativeFloat, NonNegativeInt, PositiveInt

log = logging.getLogger(__name__)

Fraction01 = Annotated[float, Between(0.0, 1.0)]


@dataclasses.dataclass(kw_only=True)
class LifecycleConfig:
    min_tokens: PositiveInt = 5000  # probation, in tokens routed by the layer since the expert's birth
    check_interval: PositiveInt = 100  # optimizer steps between dead-expert checks
    ema_decay: Annotated[float, Between(0.0, 1.0, hi_open=True)] = 0.99
    impact_weight: Fraction01 = 0.5  # w in the value score
    threshold_ratio: Fraction01 = 0.25  # dead below this fraction of the layer's median value
    birth_boost: NonNegativeFloat = 0.35  # score boost at birth, gone at 2 x min_tokens
    noise_std: NonNegativeFloat = 0.01  # clone noise, relative to the std of each cloned tensor
    exploration_bias: float = 1.0  # added to a newborn's router logit
    bias_decay: Fraction01 = 0.99  # per optimizer step
    seed: NonNegativeInt = 0  # clone noise is drawn from (seed, layer, step): identical on every rank


# ---------------------------------------------------------------------------------------------------------
# the math, as plain functions


def ema_update(old: torch.Tensor, new: torch.Tensor, decay: float) -> torch.Tensor:
    return decay * old + (1.0 - decay) * new


def birth_boost(age_tokens_E: torch.Tensor, min_tokens: int, max_boost: float) -> torch.Tensor:
    """max_boost at age 0, falling linearly to 0 at 2 x min_tokens, 0 after."""
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


class ExpertLifecycle(nn.Module):
    """Statistics, ages, exploration biases and event log of one top-k MoE layer's experts.

    Owned by the layer's router (`router.lifecycle`), which calls `bias_logits` and `observe_plan`; the MoE
    layer passes its expert outputs through `track_impact`. All of it is in `state_dict()`: the tensors as
    buffers (kept in their own dtype when the model is cast to bf16/fp16), the event log as extra state.
    """

    def __init__(self, cfg: LifecycleConfig, num_experts: int):
        super().__init__()
        self.cfg = cfg
        self.num_experts = E = num_experts
        self.register_buffer("freq_ema_E", torch.full((E,), 1.0 / E, dtype=torch.float32))
        self.register_buffer("impact_ema_E", torch.zeros(E, dtype=torch.float32))
        self.register_buffer("age_tokens_E", torch.zeros(E, dtype=torch.int64))  # layer tokens since birth
        self.register_buffer("tokens_seen_E", torch.zeros(E, dtype=torch.int64))  # own tokens since birth
        self.register_buffer("births_E", torch.zeros(E, dtype=torch.int64))  # times replaced
        self.register_buffer("logit_bias_E", torch.zeros(E, dtype=torch.float32))  # exploration bias
        self.register_buffer("num_steps", torch.zeros((), dtype=torch.int64))
        # this step's sums over micro-batches: counts [E], impact sums [E], tokens [1] (fp64: exact counts)
        self.register_buffer("step_sums", torch.zeros(2 * E + 1, dtype=torch.float64), persistent=False)
        self.events: list[dict[str, Any]] = []  # every replacement so far (returned by `lifecycle_step` too)

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> nn.Module:
        # model.half()/.bfloat16() (DeepSpeed does it) would round the EMAs and ages; keep our dtypes
        dtypes = {name: buf.dtype for name, buf in self._buffers.items() if buf is not None}
        super()._apply(fn, recurse)
        for name, dtype in dtypes.items():
            self._buffers[name] = self._buffers[name].to(dtype)
        return self

    # ---- hooks called during forward / backward

    def bias_logits(self, logits_TE: torch.Tensor) -> torch.Tensor:
        """Router logits plus the exploration biases of newborn experts."""
        return logits_TE + self.logit_bias_E.to(logits_TE.dtype)

    def observe_plan(self, plan: Any) -> Any:
        """Count the plan's tokens per expert (training only); returns the plan."""
        if self.training and torch.is_grad_enabled() and not is_recomputing():  # not twice under act. ckpt
            with torch.no_grad():
                E = self.num_experts
                self.step_sums[:E] += plan.counts_E.to(torch.float64)
                self.step_sums[-1] += plan.num_tokens
        return plan

    def track_impact(self, y_SD: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Identity on the expert outputs (grouped by expert, counts[e] rows for expert e); in training, a
        gradient hook adds -(dL/dy . y) of each row to its expert's impact sum once backward has produced
        dL/dy (this step's gradient: no lag)."""
        if len(counts) != self.num_experts:
            raise NotImplementedError(
                f"the lifecycle manager needs all {self.num_experts} experts on one rank, got {len(counts)} "
                "(expert parallelism is not supported with a lifecycle)"
            )
        if not (self.training and y_SD.requires_grad):
            return y_SD
        experts_S = torch.repeat_interleave(
            torch.arange(self.num_experts, device=y_SD.device), torch.tensor(counts, device=y_SD.device)
        )
        y_detached = y_SD.detach()

        def accumulate_impact(grad_SD: torch.Tensor) -> None:
            with torch.no_grad():
                impact_S = -(grad_SD.double() * y_detached.double()).sum(-1)
                self.step_sums[self.num_experts : 2 * self.num_experts].index_add_(0, experts_S, impact_S)

        y_SD.register_hook(accumulate_impact)
        return y_SD

    # ---- once per optimizer step

    @torch.no_grad()
    def end_step(self, sums: torch.Tensor | None = None, impact_scale: float = 1.0) -> None:
        """Fold this step's sums (default: the local `step_sums`; pass the data-parallel sum under DP) into the
        EMAs and ages, decay the exploration biases, advance the step count, clear the sums.

        `impact_scale` multiplies the impact sums (1 / loss scale under fp16 loss scaling)."""
        E, cfg = self.num_experts, self.cfg
        sums = (self.step_sums if sums is None else sums).to(self.step_sums.device, torch.float64)
        counts_E, impact_E, tokens = sums[:E], sums[E : 2 * E] * impact_scale, sums[-1]
        total = counts_E.sum()
        if total > 0:
            self.freq_ema_E.copy_(ema_update(self.freq_ema_E.double(), counts_E / total, cfg.ema_decay))
        # an fp16 overflow step has inf/nan gradients (and is skipped by the optimizer): no impact observation
        routed_E = (counts_E > 0) & torch.isfinite(impact_E).all()
        mean_impact_E = impact_E / counts_E.clamp(min=1)
        updated = ema_update(self.impact_ema_E.double(), mean_impact_E, cfg.ema_decay)
        self.impact_ema_E.copy_(torch.where(routed_E, updated, self.impact_ema_E.double()))
        self.age_tokens_E += tokens.round().long()
        self.tokens_seen_E += counts_E.round().long()
        self.logit_bias_E.mul_(cfg.bias_decay)
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

    def find_dead_experts(self) -> tuple[list[int], int, float]:
        """(experts to replace, best expert, threshold) for the current statistics."""
        value_E, _, score_E = self.scores()
        threshold = adaptive_threshold(value_E, self.cfg.threshold_ratio)
        dead, best = select_dead_experts(score_E, value_E, self.age_tokens_E, threshold, self.cfg.min_tokens)
        return dead, best, threshold

    @torch.no_grad()
    def reset_expert(self, expert: int) -> None:
        """Statistics of a newborn expert: fresh EMAs, age 0, exploration bias on its logit."""
        self.freq_ema_E[expert] = 0.0
        self.impact_ema_E[expert] = 0.0
        self.age_tokens_E[expert] = 0
        self.tokens_seen_E[expert] = 0
        self.births_E[expert] += 1
        self.logit_bias_E[expert] = self.cfg.exploration_bias

    def noise_generator(self, layer_name: str) -> torch.Generator:
        """Same stream on every rank and in a resumed run: seeded by (seed, layer, step)."""
        key = f"{self.cfg.seed}/{layer_name}/{int(self.num_steps)}".encode()
        return torch.Generator().manual_seed(zlib.crc32(key))

    # ---- reporting and checkpoint state

    def log_expert_utilization(self) -> dict[str, list[float]]:
        """Per expert: frequency and impact EMAs, value, boost, score, ages, tokens seen, births, bias."""
        value_E, boost_E, score_E = self.scores()
        report = {
            "frequency": self.freq_ema_E,
            "impact": self.impact_ema_E,
            "value": value_E,
            "boost": boost_E,
            "score": score_E,
            "age_tokens": self.age_tokens_E,
            "tokens_seen": self.tokens_seen_E,
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
# replacement: weights, optimizer state


class ParamStateIO(Protocol):
    """Full-size access to a parameter's fp32 master value and optimizer state, wherever they live."""

    def get_master(self, p: nn.Parameter) -> torch.Tensor: ...  # full fp32 tensor, p's shape

    def set_master(self, p: nn.Parameter, value: torch.Tensor) -> None: ...  # master and module copy

    def moment_keys(self, p: nn.Parameter) -> list[str]: ...  # optimizer state tensors shaped like p

    def get_state(self, p: nn.Parameter, key: str) -> torch.Tensor: ...

    def set_state(self, p: nn.Parameter, key: str, value: torch.Tensor) -> None: ...


class TorchParamStateIO:
    """A plain torch optimizer (or none): the module parameter is the master, its state is `optimizer.state`."""

    def __init__(self, optimizer: torch.optim.Optimizer | None = None):
        self.optimizer = optimizer

    def get_master(self, p: nn.Parameter) -> torch.Tensor:
        return p.detach().float().clone()

    def set_master(self, p: nn.Parameter, value: torch.Tensor) -> None:
        with torch.no_grad():
            p.copy_(value)

    def moment_keys(self, p: nn.Parameter) -> list[str]:
        state = self.optimizer.state.get(p, {}) if self.optimizer is not None else {}
        return [k for k, v in state.items() if torch.is_tensor(v) and v.shape == p.shape]

    def get_state(self, p: nn.Parameter, key: str) -> torch.Tensor:
        return self.optimizer.state[p][key]

    def set_state(self, p: nn.Parameter, key: str, value: torch.Tensor) -> None:
        target = self.optimizer.state[p][key]
        if value is not target:
            target.copy_(value)


def per_expert_parameters(experts: nn.Module, router: nn.Module, num_experts: int) -> list[nn.Parameter]:
    """Parameters whose leading axis is the expert: every stacked expert weight, and the router's rows."""
    params = list(experts.parameters())
    for p in params:
        if full_shape(p)[0] != num_experts:
            raise ValueError(f"expert parameter of shape {tuple(full_shape(p))} is not stacked over {num_experts} experts")
    return params + [p for p in router.parameters() if full_shape(p)[:1] == (num_experts,)]


def full_shape(p: nn.Parameter) -> torch.Size:
    """The parameter's shape, also when ZeRO-3 holds only a partition of it (`ds_shape`)."""
    return getattr(p, "ds_shape", p.shape)


@torch.no_grad()
def clone_experts(
    params: list[nn.Parameter],
    replacements: list[tuple[int, int]],
    io: ParamStateIO,
    noise_std: float,
    generator: torch.Generator,
) -> None:
    """For each (dead, best): row `dead` of every param := row `best` + noise, in the fp32 master and the
    module; row `dead` of every optimizer moment := 0. Every rank must call this with the same arguments
    (under ZeRO the reads and writes are collective)."""
    dead_rows = [dead for dead, _ in replacements]
    for p in params:
        master = io.get_master(p)
        for dead, best in replacements:
            master[dead] = clone_with_noise(master[best], noise_std, generator)
        io.set_master(p, master)
        for key in io.moment_keys(p):
            state = io.get_state(p, key)
            state[dead_rows] = 0
            io.set_state(p, key, state)


def replace_dead_experts(layer_name: str, layer: nn.Module, io: ParamStateIO) -> list[dict[str, Any]]:
    """The dead-expert check of one MoE layer (`.router.lifecycle`, `.experts`): replace, record, return events."""
    lifecycle: ExpertLifecycle = layer.router.lifecycle
    dead, best, threshold = lifecycle.find_dead_experts()
    if not dead:
        return []
    value_E, _, score_E = lifecycle.scores()
    step = int(lifecycle.num_steps)
    events = [
        {
            "event": "replace",
            "step": step,
            "layer": layer_name,
            "expert": e,
            "source": best,
            "score": float(score_E[e]),
            "value": float(value_E[e]),
            "threshold": threshold,
            "frequency": float(lifecycle.freq_ema_E[e]),
            "impact": float(lifecycle.impact_ema_E[e]),
            "age_tokens": int(lifecycle.age_tokens_E[e]),
        }
        for e in dead
    ]
    params = per_expert_parameters(layer.experts, layer.router, lifecycle.num_experts)
    clone_experts(params, [(e, best) for e in dead], io, lifecycle.cfg.noise_std, lifecycle.noise_generator(layer_name))
    for event in events:
        lifecycle.reset_expert(event["expert"])
        lifecycle.record(event)
    return events


# ---------------------------------------------------------------------------------------------------------
# the whole model


def lifecycle_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, MoE layer) for every layer whose router carries a lifecycle manager, in module order."""
    return [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(getattr(getattr(module, "router", None), "lifecycle", None), ExpertLifecycle)
        and hasattr(module, "experts")
    ]


def lifecycle_step(
    model: nn.Module,
    io: ParamStateIO | None = None,
    *,
    all_reduce: Callable[[torch.Tensor], None] | None = None,
    impact_scale: float = 1.0,
) -> list[dict[str, Any]]:
    """Call after every optimizer step: fold the step's statistics, run due checks, return new events.

    `all_reduce` sums a tensor in place over the data-parallel group (one call per step for all layers), so
    that every rank makes the same decisions; `io` reaches the optimizer state (default: weights only).
    """
    layers = lifecycle_layers(model)
    if not layers:
        return []
    io = io or TorchParamStateIO()
    lifecycles = [layer.router.lifecycle for _, layer in layers]
    sums = torch.cat([lifecycle.step_sums for lifecycle in lifecycles])
    if all_reduce is not None:
        all_reduce(sums)
    events = []
    per_layer_sums = sums.split([lifecycle.step_sums.numel() for lifecycle in lifecycles])
    for (name, layer), lifecycle, layer_sums in zip(layers, lifecycles, per_layer_sums):
        lifecycle.end_step(layer_sums, impact_scale)
        if lifecycle.check_due():
            events += replace_dead_experts(name, layer, io)
    return events


def log_expert_utilization(model: nn.Module) -> dict[str, dict[str, list[float]]]:
    """Per lifecycle-managed layer and expert: frequency, impact, value, boost, score, ages, births, bias."""
    return {name: layer.router.lifecycle.log_expert_utilization() for name, layer in lifecycle_layers(model)}


__all__ = [
    "ExpertLifecycle",
    "LifecycleConfig",
    "ParamStateIO",
    "TorchParamStateIO",
    "adaptive_threshold",
    "birth_boost",
    "clone_experts",
    "clone_with_noise",
    "ema_update",
    "lifecycle_layers",
    "lifecycle_step",
    "log_expert_utilization",
    "per_expert_parameters",
    "replace_dead_experts",
    "select_dead_experts",
    "value_scores",
]
