"""Per-block activation checkpointing and compile (training/blocks.py) and the recompute guard
(moep_ds/recompute.py): same losses, gradients and running statistics as the plain model, same parameter names."""
from __future__ import annotations

import pathlib

import pytest
import torch
from torch import nn

from moep_ds import build_model
from moep_ds.config import config_from_dict
from moep_ds.layers import glu
from moep_ds.moe.experts import GroupedExperts
from moep_ds.recompute import add_recording_flag
from moep_ds.training.blocks import apply_block_options, checkpointed
from tiny import recipe


def tiny(layers: str, seed: int = 0):
    torch.manual_seed(seed)
    return build_model(config_from_dict(recipe(layers, pathlib.Path("unused"))).model)


def train(model: nn.Module, steps: int, one_batch: bool = False) -> tuple[list[float], dict[str, torch.Tensor]]:
    """`steps` AdamW steps on fixed random batches (`one_batch`: the first each time, so the loss must fall); losses
    and every gradient of the last step."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    losses = []
    for step in range(steps):
        if step == 0 or not one_batch:
            ids = torch.randint(0, 512, (4, 33), generator=g)
        optimizer.zero_grad()
        loss = model(ids[:, :-1], labels=ids[:, 1:]).loss
        loss.backward()
        losses.append(loss.item())
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        optimizer.step()
    return losses, grads


def running_statistics(model: nn.Module) -> dict[str, torch.Tensor]:
    """Expert-choice thresholds and update counts, and the lifecycle manager's per-step token counts."""
    names = ("threshold", "log_norm", "num_threshold_updates", "step_sums")
    return {n: b.clone() for n, b in model.named_buffers() if n.rsplit(".", 1)[-1] in names}


def test_recording_flags_are_off_only_in_the_recomputation():
    seen = []

    class Probe(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = nn.Module()
            add_recording_flag(self.inner)  # a submodule's flag: the whole block is switched

        def forward(self, x):
            seen.append(bool(self.inner.recording_statistics))
            return x.sin()

    probe = Probe()
    probe.forward = checkpointed(probe.forward, probe)
    x = torch.randn(3, requires_grad=True)
    probe(x).sum().backward()
    assert seen == [True, False]  # forward, then the recomputation in backward
    with torch.no_grad():
        probe(x)
    assert seen == [True, False, True] and bool(probe.inner.recording_statistics)
    torch.testing.assert_close(x.grad, x.detach().cos())
    assert "inner.recording_statistics" not in probe.state_dict()


@pytest.mark.parametrize("layers,kernel", [("nova_moe", "grouped"), ("top2", "library"), ("msit", None),
                                          ("ssm_moe", "library")])
def test_routed_blocks_trace_as_one_graph(layers, kernel):
    """What `train.compile` gets on a GPU (bf16; the kernels chosen there for equal / uneven loads): each routed
    block's training forward traces as one graph, so no device-to-host copy of expert counts and no statistics
    update outside it (the lifecycle's impact hook included). MoEP paths are the exception: their per-path loop
    takes the counts to the host."""
    model = tiny(layers).to(torch.bfloat16).train()
    for module in model.modules():
        if isinstance(module, GroupedExperts):
            module.kernel = kernel
    block = model.blocks[-1]
    x, positions = torch.randn(2, 32, 32, dtype=torch.bfloat16), torch.arange(32).repeat(2, 1)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(lambda x, pos: block(x, positions_BT=pos))(x, positions)
    torch._dynamo.reset()
    assert explained.graph_count == 1, [str(r.reason).splitlines()[0] for r in explained.break_reasons]


def test_activation_checkpointing_keeps_losses_gradients_statistics_and_names():
    """Every routed block type (expert choice, top-2, MSIT, lifecycle): identical numbers, statistics counted once."""
    plain, ckpt = tiny("mixed"), tiny("mixed")
    apply_block_options(ckpt, activation_checkpointing=True, compile=False)
    assert list(ckpt.state_dict()) == list(plain.state_dict())
    losses_plain, grads_plain = train(plain, 3)
    losses_ckpt, grads_ckpt = train(ckpt, 3)
    assert losses_ckpt == losses_plain
    assert grads_ckpt.keys() == grads_plain.keys()
    for name, grad in grads_plain.items():
        torch.testing.assert_close(grads_ckpt[name], grad, rtol=0, atol=0, msg=name)
    stats_plain, stats_ckpt = running_statistics(plain), running_statistics(ckpt)
    assert any(n.endswith("step_sums") for n in stats_plain) and any(n.endswith("threshold") for n in stats_plain)
    for name, value in stats_plain.items():
        assert torch.equal(stats_ckpt[name], value), name
    assert all(v.item() == 3 for n, v in stats_ckpt.items() if n.endswith("num_threshold_updates"))


@pytest.mark.slow
def test_activation_checkpointing_with_compile_keeps_losses_statistics_and_names(monkeypatch):
    """Both switches (the checkpoint outside, each block's forward compiled inside it): every routed block type
    trains as with compile alone (its recomputation runs the forward's compiled graphs: same gradients), within
    1e-5 of eager, running statistics counted once per step. Compiled by dynamo and AOTAutograd without inductor's
    code generation (backend aot_eager): which graph the recomputation selects and what it saves are decided there;
    inductor's kernels (minutes of C++ compilation for this stack on 2 cores) are held to eager by
    test_compile_keeps_names_and_losses and tests/training/test_compile_eval.py."""
    from torch._dynamo.utils import counters

    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile", lambda model=None, **options: compile_(model, **{"backend": "aot_eager",
                                                                                           **options}))
    torch._dynamo.reset()
    plain, compiled, both = tiny("mixed"), tiny("mixed"), tiny("mixed")
    apply_block_options(compiled, activation_checkpointing=False, compile=True)
    apply_block_options(both, activation_checkpointing=True, compile=True)
    assert list(both.state_dict()) == list(plain.state_dict())
    losses_plain, _ = train(plain, 3)
    graphs = counters["stats"]["unique_graphs"]
    try:  # `both` first: its blocks compile their graphs while checkpointed
        losses_both, grads_both = train(both, 3)
        assert counters["stats"]["unique_graphs"] > graphs  # the blocks did run compiled
        losses_compiled, grads_compiled = train(compiled, 3)
    finally:
        torch._C._dynamo.eval_frame._set_lru_cache(True)  # process-wide, set by apply_block_options
        torch._dynamo.reset()
    assert losses_both == pytest.approx(losses_plain, abs=1e-5, rel=0)
    assert losses_both == losses_compiled
    for name, grad in grads_compiled.items():
        torch.testing.assert_close(grads_both[name], grad, rtol=0, atol=0, msg=name)
    stats_compiled, stats_both = running_statistics(compiled), running_statistics(both)
    for name, value in stats_compiled.items():
        assert torch.equal(stats_both[name], value), name
    assert all(v.item() == 3 for n, v in stats_both.items() if n.endswith("num_threshold_updates"))


def test_fused_gated_activation_in_every_block_type(monkeypatch):
    """layers/glu.py's kernels, forced on for these small buffers, in the dense, expert and MSIT SwiGLUs: losses and
    gradients as unfused to rounding; with activation checkpointing (recomputing the fused forward) identical."""
    losses_unfused, grads_unfused = train(tiny("mixed"), 3)
    calls = []
    for name in ("kernels", "in_place_backward"):
        real = getattr(glu, name)
        monkeypatch.setattr(glu, name, lambda kind, real=real: calls.append(kind) or real(kind))
    monkeypatch.setattr(glu, "FUSED_MIN_NUMEL", 0)
    losses_fused, grads_fused = train(tiny("mixed"), 3)
    assert calls.count("swiglu") >= 2 * 3 * 4  # forward and backward, 3 steps, 4 blocks with SwiGLU
    assert losses_fused == pytest.approx(losses_unfused, abs=1e-5, rel=0)
    for name, grad in grads_unfused.items():
        torch.testing.assert_close(grads_fused[name], grad, rtol=1e-4, atol=1e-6, msg=name)
    ckpt = tiny("mixed")
    apply_block_options(ckpt, activation_checkpointing=True, compile=False)
    losses_ckpt, grads_ckpt = train(ckpt, 3)
    assert losses_ckpt == losses_fused
    for name, grad in grads_fused.items():
        torch.testing.assert_close(grads_ckpt[name], grad, rtol=0, atol=0, msg=name)


def test_activation_checkpointing_saves_activation_memory():
    """The recomputed blocks keep only their inputs for backward."""
    def saved_bytes(model: nn.Module) -> int:
        total = 0

        def pack(t: torch.Tensor) -> torch.Tensor:
            nonlocal total
            total += t.numel() * t.element_size()
            return t

        ids = torch.randint(0, 512, (4, 32))
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(ids, labels=ids)
        return total

    plain, ckpt = tiny("nova_moe"), tiny("nova_moe")
    apply_block_options(ckpt, activation_checkpointing=True, compile=False)
    assert saved_bytes(ckpt) < 0.5 * saved_bytes(plain)


def save_module(model: nn.Module, path: pathlib.Path) -> None:
    """The model part of a sharded checkpoint, from one process (the trainer's canonical names and shapes)."""
    from moep_ds.checkpointing import model_state

    model_state.save_module(model, path)


def assert_same_state(a: nn.Module, b: nn.Module) -> None:
    assert list(a.state_dict()) == list(b.state_dict())
    for name, tensor in a.state_dict().items():
        torch.testing.assert_close(b.state_dict()[name], tensor, rtol=0, atol=0, msg=name)


def test_compile_keeps_names_and_losses(tmp_path):
    """Also train.compile on <-> off at resume, in one process (compiling in both processes of a resumed 2-process
    run would add about a minute to CI): a checkpoint of the compiled model loads into an eager one and one of
    the eager model into the compiled one, and each then trains on within 1e-5 of the model that saved it."""
    from torch._dynamo.utils import counters

    from moep_ds.checkpointing.model_state import load_module

    torch._dynamo.reset()  # compiled graphs of other tests would serve these blocks too
    plain, compiled = tiny("nova_moe"), tiny("nova_moe")
    apply_block_options(compiled, activation_checkpointing=False, compile=True)
    assert list(compiled.state_dict()) == list(plain.state_dict())
    losses_plain, _ = train(plain, 2)
    graphs = counters["stats"]["unique_graphs"]
    losses_compiled, _ = train(compiled, 2)
    assert counters["stats"]["unique_graphs"] > graphs  # the blocks did run compiled
    assert losses_compiled == pytest.approx(losses_plain, abs=1e-5, rel=0)
    assert running_statistics(compiled)["blocks.1.moe.router.num_threshold_updates"].item() == 2
    save_module(compiled, tmp_path / "compiled")
    save_module(plain, tmp_path / "eager")
    eager = tiny("nova_moe", seed=1)
    load_module(eager, tmp_path / "compiled")
    assert_same_state(compiled, eager)
    assert train(eager, 1)[0] == pytest.approx(train(compiled, 1)[0], abs=1e-5, rel=0)
    load_module(compiled, tmp_path / "eager")
    assert_same_state(plain, compiled)
    assert train(compiled, 1)[0] == pytest.approx(train(plain, 1)[0], abs=1e-5, rel=0)
