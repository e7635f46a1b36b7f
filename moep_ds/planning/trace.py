"""One micro-batch of training traced on the meta device: the model's own forward and backward (the code training
runs, activation checkpointing included), no memory allocated, and the bytes of every tensor it creates followed
from allocation to release.

# B micro-batch, T sequence length, S routed assignments, E experts

    trace = trace_step(cfg.model, micro_batch=16, seq_len=2048, dtype=torch.bfloat16, checkpointing=True)
    trace.peak            bytes of activations at the step's highest point
    trace.with_gradients(policy)   the same with the gradients a ZeRO stage keeps during backward
    trace.saved           bytes alive at the end of the forward: what backward needs
    trace.saved_by        the same, by block type and its part ("ffn_moe.moe", "msit.experts", "head")

What the meta device cannot run is replaced by what the target runs:
- attention: `scaled_dot_product_attention` becomes the flash / memory-efficient kernel's footprint (saves q, k, v,
  the output and the fp32 log-sum-exp; an explicit mask is saved as an additive bias in q's dtype; backward holds an
  fp32 dq accumulator), not the math fallback's T x T scores that meta would otherwise trace;
- routing: a router whose expert loads depend on the data (top-k) hands its experts the expected, balanced loads
  (S / E each, `static_counts`), which is what the plan's memory and communication are sized for;
- gradients of parameters are released as soon as they are accumulated, and the moment each is ready is recorded:
  what DeepSpeed keeps of them is a `GradPolicy`'s to say (planning/memory.py), replayed beside the activations.
Kernel workspaces, the allocator's rounding and fragmentation are not modelled.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from moep_ds.layers import glu
from moep_ds.layers import routed_attention as routed_attention_module
from moep_ds.models.causal_lm import CausalLM, build_model
from moep_ds.models.config import ModelConfig
from moep_ds.planning.dedup import Choice, choice_of
from moep_ds.planning.inventory import expert_param_ids
from moep_ds.moe.dispatch import ExpertStage
from moep_ds.registry import ROUTERS
from moep_ds.routing.plan import RoutingPlan
from moep_ds.training.blocks import apply_block_options

use_count = torch._C._storage_Use_Count  # references to a storage (ours included)


class GradPolicy:
    """Which parameter gradients stay allocated during backward (DeepSpeed's habit of each ZeRO stage): `retained`
    bytes at every moment. This base keeps none (each gradient is copied away as soon as it is ready)."""

    retained = 0

    def on_grad(self, numel: int, expert: bool) -> None:
        """A gradient of `numel` elements is ready; `expert`: of one of a routed stage's experts."""


@dataclasses.dataclass
class StepTrace:
    saved: int  # activations alive at the end of forward
    saved_by: dict[str, int]  # `saved` by "<block type>.<part>" (and "embedding", "head")
    routed: tuple  # RoutedStage of every routed stage, in model order
    aux_keys: tuple[str, ...]  # the model's auxiliary losses (the trainer all-reduces one value each)
    timeline: list[int]  # activation bytes alive after each operation
    grad_events: list[tuple[int, int, bool]]  # (operations done, numel, expert) as each parameter gradient is ready

    @property
    def peak(self) -> int:
        """Activations at their highest, no gradient kept."""
        return max(self.timeline, default=0)

    def with_gradients(self, policy: GradPolicy) -> tuple[int, int]:
        """(peak of activations + the gradients `policy` keeps, gradients kept at the end of backward). A gradient
        ready after `done` operations is kept from the operation at index `done` on; between two gradients the kept
        bytes are constant, so each stretch of the timeline needs only its highest point."""
        peak, first, timeline = 0, 0, self.timeline
        for done, numel, expert in self.grad_events:
            if done > first and first < len(timeline):
                peak = max(peak, max(timeline[first:done]) + policy.retained)
                first = done
            policy.on_grad(numel, expert)
        if first < len(timeline):
            peak = max(peak, max(timeline[first:]) + policy.retained)
        return max(peak, timeline[-1] + policy.retained if timeline else 0), policy.retained


class Live(TorchDispatchMode):
    """Bytes of the storages created under it that are still referenced, after every operation (`timeline`).
    Storages that existed before (parameters, buffers) are not counted."""

    def __init__(self, existing: list[torch.Tensor]):
        super().__init__()
        self.timeline: list[int] = []
        self.existing = {t.untyped_storage()._cdata for t in existing}  # views of these are no new memory
        self.live: dict[int, tuple[torch.UntypedStorage, str]] = {}
        self.now = 0
        self.label = "embedding"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                if storage._cdata not in self.live and storage._cdata not in self.existing and storage.nbytes():
                    self.live[storage._cdata] = (storage, self.label)
                    self.now += storage.nbytes()
        self.timeline.append(self.now)
        self.release()
        return out

    def release(self) -> None:
        for key in [k for k in self.live if use_count(k) <= 1]:  # only our own reference is left
            self.now -= self.live.pop(key)[0].nbytes()

    def by_label(self) -> dict[str, int]:
        out: collections.Counter = collections.Counter()
        for storage, label in self.live.values():
            out[label] += storage.nbytes()
        return dict(out)


class FlashAttention(torch.autograd.Function):
    """The memory of a fused attention kernel (FlashAttention-2 / memory-efficient SDPA) on the meta device."""

    @staticmethod
    def forward(ctx, q, k, v, bias):  # noqa: ANN001, ANN205
        out = q.new_empty((*q.shape[:-1], v.shape[-1]))
        lse = q.new_empty(q.shape[:-1], dtype=torch.float32)
        ctx.save_for_backward(q, k, v, out, lse, *([] if bias is None else [bias]))
        return out

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        q, k, v, *_ = ctx.saved_tensors
        dq_accum = q.new_empty(q.shape, dtype=torch.float32)  # noqa: F841 - held while the kernel runs
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), None


def fused_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,  # noqa: ANN001
                    enable_gqa=False):  # noqa: ANN001, ANN201
    bias = None
    if attn_mask is not None:  # a boolean mask reaches the kernel as an additive bias in q's dtype
        bias = query.new_empty(attn_mask.shape)
    return FlashAttention.apply(query, key, value, bias)


def fused_routed_attention(q_NHd, k_NHd, v_NHd, seq_N, pos_N, window, kernel=None,  # noqa: ANN001
                           block_mask=None):  # noqa: ANN001, ANN201
    """Routed attention as the GPU runs it (layers/routed_attention.py: one FlexAttention call, a fused kernel)."""
    q, k, v = (x.transpose(0, 1).unsqueeze(0) for x in (q_NHd, k_NHd, v_NHd))
    return FlashAttention.apply(q, k, v, None).squeeze(0).transpose(0, 1)


def fused_glu_kernels(kind: str) -> tuple[Callable, Callable]:
    """layers/glu.py's compiled kernels as they allocate: the forward its output, the backward both gradients."""
    return (lambda gate, up: torch.empty_like(gate)), (lambda grad, gate, up: (torch.empty_like(gate),
                                                                              torch.empty_like(up)))


@contextlib.contextmanager
def target_kernels() -> Iterator[None]:
    """The kernels the target GPU runs, in forward and in a checkpointed block's recomputation, by the names the
    model calls them: `F.scaled_dot_product_attention` and layers/routed_attention.py's `routed_attention` (fused
    attention), and layers/glu.py's fused gated activation (compiled per device; meta counts as a device where it
    runs, as CUDA does). Restored when the trace ends."""
    patches = [(F, "scaled_dot_product_attention", fused_attention),
               (routed_attention_module, "routed_attention", fused_routed_attention),
               (glu, "kernels", fused_glu_kernels),
               (glu, "in_place_backward", lambda kind: (lambda grad, gate, up: None))]
    saved = [(module, name, getattr(module, name)) for module, name, _ in patches]
    available = glu._available.get("meta")
    glu._available["meta"] = True
    for module, name, replacement in patches:
        setattr(module, name, replacement)
    try:
        yield
    finally:
        for module, name, original in saved:
            setattr(module, name, original)
        glu._available.pop("meta") if available is None else glu._available.update(meta=available)


def balanced(num_assignments: int, num_experts: int) -> tuple[int, ...]:
    base, extra = divmod(num_assignments, num_experts)
    return tuple(base + (e < extra) for e in range(num_experts))


def expected_loads(router: nn.Module) -> None:
    """Give `router`'s plans balanced static counts (its own forward still runs: logits, scores, losses)."""
    forward = router.forward

    def run(*args: Any, **kwargs: Any) -> RoutingPlan:
        plan = forward(*args, **kwargs)
        if plan.static_counts is None:
            plan = dataclasses.replace(plan, static_counts=balanced(plan.token_idx_S.numel(), plan.num_experts))
        return plan

    router.forward = run


@contextlib.contextmanager
def labelled_blocks(model: CausalLM, live: Live) -> Iterator[None]:
    """Name what each block's parts allocate "<block type>.<part>"; the head and loss "head"."""
    handles = []

    def enter(label: str) -> Callable:
        def hook(*args: Any) -> None:  # (module, args) before forward, (module, args, output) after
            live.label = label
        return hook

    for block, cfg in zip(model.blocks, model.cfg.expanded_layers()):
        handles.append(block.register_forward_pre_hook(enter(f"{cfg.type}.block")))
        for name, part in block.named_children():
            handles.append(part.register_forward_pre_hook(enter(f"{cfg.type}.{name}")))
            handles.append(part.register_forward_hook(enter(f"{cfg.type}.block")))
        handles.append(block.register_forward_hook(enter("head")))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def traced_model(cfg: ModelConfig, dtype: torch.dtype, checkpointing: bool, device: str) -> CausalLM:
    """The whole model (every expert) in the training dtype, blocks checkpointed as training does it
    (training/blocks.py). On the meta device routers hand their experts the expected loads; on the CPU (to check the
    trace against real kernels) the model is initialised and routes by its weights."""
    with torch.device(device):
        model = build_model(cfg, initialise=device != "meta")
    model.to(dtype).train()
    apply_block_options(model, activation_checkpointing=checkpointing, compile=False)
    if device == "meta":
        router_types = tuple(ROUTERS.get(name) for name in ROUTERS.names())
        for module in model.modules():
            if isinstance(module, router_types):
                expected_loads(module)
    return model


def trace_step(cfg: ModelConfig, *, micro_batch: int, seq_len: int, dtype: torch.dtype, checkpointing: bool,
               device: str = "meta") -> StepTrace:
    """Forward and backward of one micro-batch of `micro_batch` x `seq_len` tokens on the meta device (the target's
    attention kernels, expected loads), or on the CPU with its own kernels and real routing (`device="cpu"`: what
    the meta trace is checked against; token ids 0)."""
    model = traced_model(cfg, dtype, checkpointing, device)
    experts = expert_param_ids(model)
    grad_events: list[tuple[int, int, bool]] = []

    def hand_over(p: nn.Parameter) -> None:
        grad_events.append((len(live.timeline), p.numel(), id(p) in experts))
        p.grad = None

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(hand_over)
    routed: dict[str, RoutedStage] = {}
    choices = record_choices(model)
    for name, module in model.named_modules():
        if isinstance(module, ExpertStage):
            record_dispatch(name, module, routed, choices)
    live = Live([*model.parameters(), *model.buffers()])
    ids = torch.zeros(micro_batch, seq_len, dtype=torch.long, device=device)
    kernels = target_kernels() if device == "meta" else contextlib.nullcontext()
    with kernels, live, labelled_blocks(model, live):
        out = model(ids, labels=ids)
        live.release()
        saved, saved_by = live.now, live.by_label()
        aux_keys = tuple(sorted(out.aux_losses))
        loss = out.loss
        del out  # the trainer drops the [B, T, V] logits before backward
        live.label = "backward"
        loss.backward()
        del loss
        live.release()
    return StepTrace(saved=saved, saved_by=saved_by, routed=tuple(routed.values()), aux_keys=aux_keys,
                     timeline=live.timeline, grad_events=grad_events)


@dataclasses.dataclass(frozen=True)
class RoutedStage:
    """What one routed stage dispatches per micro-batch (its first forward; a checkpointed block's recomputation
    repeats it): `assignments` (token, expert) pairs of `width` features, with sequence ids and positions
    (`with_positions`: experts that attend over the original sequence, MSIT branches and MoEP paths), of `tokens`
    routed tokens, picked as `choice` says (how many distinct ranks a token's experts span: planning/dedup.py).
    The FLOPs are what the overlapped all-to-all hides behind (planning/timing.py): 2 per parameter of one expert per
    assignment (attention inside experts, MSIT's and MoEP's, not counted: less to hide behind, never more), and
    2 per shared-expert parameter per routed token."""

    name: str
    num_experts: int
    assignments: int
    width: int
    with_positions: bool
    tokens: int = 0
    choice: Choice = Choice()
    expert_flops: float = 0.0  # forward matmul FLOPs of the routed experts on the micro-batch's assignments
    beside_flops: float = 0.0  # forward FLOPs of the shared expert, which runs while the first dispatch travels


def record_choices(model: nn.Module) -> dict[int, Choice]:
    """How the router behind each plan picks, by the plan's counts tensor (which a plan keeps through
    `in_token_order` and the expected loads), filled as the routers run."""
    choices: dict[int, Choice] = {}
    router_types = tuple(ROUTERS.get(name) for name in ROUTERS.names())
    for module in model.modules():
        if isinstance(module, router_types):
            forward, choice = module.forward, choice_of(module)

            def run(*args: Any, _forward: Callable = forward, _choice: Choice = choice, **kwargs: Any) -> RoutingPlan:
                plan = _forward(*args, **kwargs)
                choices[id(plan.counts_E)] = _choice
                return plan

            module.forward = run
    return choices


def unnamed_choice(plan: RoutingPlan) -> Choice:
    """A plan no router returned as such: its tokens' share of experts, as token choice."""
    return Choice(k=max(1, plan.token_idx_S.numel() // max(1, plan.num_tokens)))


def record_dispatch(name: str, stage: nn.Module, seen: dict[str, RoutedStage], choices: dict[int, Choice]) -> None:
    """Record the stage's first dispatch, whichever way it reaches its dispatcher: `stage.dispatch`, or the
    dispatcher's `start` (a layer that computes beside the tokens' journey: moe/layer.py)."""
    dispatch, dispatcher = stage.dispatch, stage.dispatcher
    start = getattr(dispatcher, "start", None)
    per_expert = sum(p.numel() for p in stage.experts.parameters()) / stage.num_experts  # the traced model holds all
    shared = getattr(stage, "shared", None)
    shared_params = 0 if shared is None else sum(p.numel() for p in shared.parameters())

    def record(x_TD: torch.Tensor, plan: RoutingPlan, seq_ids_T: Any, positions_T: Any) -> None:
        if name not in seen:
            S = plan.token_idx_S.numel()
            seen[name] = RoutedStage(name, stage.num_experts, S, x_TD.shape[-1],
                                     seq_ids_T is not None or positions_T is not None, plan.num_tokens,
                                     choices.get(id(plan.counts_E)) or unnamed_choice(plan), 2.0 * S * per_expert,
                                     2.0 * plan.num_tokens * shared_params)

    def run(x_TD: torch.Tensor, plan: RoutingPlan, seq_ids_T: Any = None, positions_T: Any = None) -> torch.Tensor:
        record(x_TD, plan, seq_ids_T, positions_T)
        return dispatch(x_TD, plan, seq_ids_T, positions_T)

    def run_start(x_TD: torch.Tensor, plan: RoutingPlan, run_experts: Any, seq_ids_T: Any = None,
                  positions_T: Any = None) -> Any:
        record(x_TD, plan, seq_ids_T, positions_T)
        return start(x_TD, plan, run_experts, seq_ids_T, positions_T)

    stage.dispatch = run
    if start is not None:
        dispatcher.start = run_start


__all__ = ["GradPolicy", "RoutedStage", "StepTrace", "balanced", "fused_attention", "trace_step", "traced_model"]
