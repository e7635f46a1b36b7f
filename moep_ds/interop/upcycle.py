"""Sparse upcycling (Komatsuzaki et al. 2023; Megatron-Core's `--moe-use-upcycling`): a dense checkpoint into an
FFN-MoE of the same backbone.

# E experts, D model dim, F expert hidden dim

    model:
      init_from: runs/pythia_1b_import          # the dense checkpoint (ours, or a Hugging Face one: hf:REPO@REV)
      upcycle: {noise_std: 0.0, seed: 0}        # this recipe's ffn_moe blocks are built from its dense FFNs

Every `ffn_moe` block of the recipe takes the dense block at the same depth: attention, norms and embeddings are
copied, each of its E experts is a copy of the dense FFN (w1_EDF[e] = W_in^T, w2_EFD[e] = W_out^T, biases alike;
plus N(0, noise_std) noise on the matrices, drawn per expert from `seed`, so that a rank builds only its own
experts and gets the same ones at any expert-parallel size), and the router keeps the recipe's seeded
initialisation, as Megatron-Core's upcycling does. Since all experts are equal, any routing gives every token
sum_k w_k FFN(x) = FFN(x) when the chosen weights sum to 1: top-k with renormalised weights and no dropped tokens
(capacity_factor null) computes the dense model exactly at step 0. Without renormalisation the output is scaled
by the chosen probabilities' sum; expert choice's training rule gives a token the sum of its affinities over the
experts that chose it (0 for one chosen by none): both train from near, not at, the dense model (expert choice's
threshold evaluation before any step, every expert taking every token, is the dense model; docs/FIDELITY.md).
"""
from __future__ import annotations

import logging
import zlib
from typing import Any

import torch

from moep_ds.errors import UserError
from moep_ds.interop.weights import Weight
from moep_ds.models.config import UpcycleConfig

log = logging.getLogger(__name__)


# dense FFN tensor -> expert stack tensor; the dense Linear weights [out, in] become [in, out] per expert
EXPERT_OF_DENSE = {
    "w_in.weight": ("w1_EDF", True), "w_in.bias": ("b1_EF", False),
    "w_out.weight": ("w2_EFD", True), "w_out.bias": ("b2_ED", False),
    "w1.weight": ("w1_EDF", True), "w1.bias": ("b1_EF", False), "w3.weight": ("w3_EDF", True),
    "w3.bias": ("b3_EF", False), "w2.weight": ("w2_EFD", True), "w2.bias": ("b2_ED", False),
}


def dense_model_config(model_cfg: Any) -> Any:
    """The dense model an FFN-MoE recipe upcycles from: each ffn_moe block as a dense block whose FFN is the expert
    FFN (same attention, norms, residual layout); every other block as it is."""
    from moep_ds.checkpointing.model_dir import StoredRecipe
    from moep_ds.schema import to_dict

    raw = to_dict(model_cfg)
    raw.pop("init_from", None)
    raw.pop("upcycle", None)
    raw["layers"] = [densified(entry, f"model.layers[{i}]") for i, entry in enumerate(raw["layers"])]
    return StoredRecipe.parse({"model": raw}).model


def densified(entry: dict[str, Any], path: str) -> dict[str, Any]:
    kind = entry.get("type")
    if kind == "group":
        return {**entry, "layers": [densified(e, f"{path}.layers[{i}]") for i, e in enumerate(entry["layers"])]}
    if kind == "ffn_moe":
        return {"type": "dense", "repeat": entry["repeat"], "attention": entry["attention"], "norm": entry["norm"],
                "parallel_residual": entry["parallel_residual"], "ffn": entry["moe"]["expert"]}
    if kind != "dense":
        raise UserError(f"{path}.type ({kind!r}): model.upcycle builds ffn_moe blocks from dense ones; a {kind} block "
                        "has no dense counterpart")
    return entry


def check_routing(model_cfg: Any) -> None:
    """Say where step 0 will not be the dense model (the recipe may want that: it is no error)."""
    moe_layers = [(i, layer) for i, layer in enumerate(model_cfg.expanded_layers()) if layer.type == "ffn_moe"]
    if not moe_layers:
        raise UserError("model.upcycle is set, but model.layers has no ffn_moe block to upcycle into")
    for i, layer in moe_layers:
        router = layer.moe.router
        if router.type != "topk" or not getattr(router, "renormalize", False) or router.capacity_factor is not None:
            log.warning("model.layers (block %d): %s router%s: the upcycled model starts near, not at, the dense "
                        "model (exact with top-k, renormalize: true, capacity_factor: null)", i, router.type,
                        "" if router.type != "topk" else
                        f" (renormalize {getattr(router, 'renormalize', None)}, capacity_factor "
                        f"{router.capacity_factor})")
            return


def upcycled_weights(dense: dict[str, Weight], model_cfg: Any, upcycle: UpcycleConfig) -> dict[str, Weight]:
    """The MoE recipe's weights from the dense ones (the routers are not among them: `router_names`). Each expert
    stack reads the dense tensor once and builds only the experts asked for."""
    check_routing(model_cfg)
    out = dict(dense)
    for i, layer in enumerate(model_cfg.expanded_layers()):
        if layer.type != "ffn_moe":
            continue
        prefix = f"blocks.{i}.ffn."
        for name in [n for n in out if n.startswith(prefix)]:
            dense_weight = out.pop(name)
            suffix = name.removeprefix(prefix)
            if suffix not in EXPERT_OF_DENSE:
                raise UserError(f"the dense checkpoint's {name!r} has no place in an expert")
            expert_name, matrix = EXPERT_OF_DENSE[suffix]
            out[f"blocks.{i}.moe.experts.{expert_name}"] = expert_stack(
                dense_weight, layer.moe.num_experts, matrix, upcycle, f"blocks.{i}.moe.experts.{expert_name}")
    return out


def expert_stack(dense: Weight, num_experts: int, matrix: bool, upcycle: UpcycleConfig, name: str) -> Weight:
    shape = tuple(reversed(dense.shape)) if matrix else tuple(dense.shape)

    def rows(first: int, end: int) -> torch.Tensor:
        t = dense.read()
        t = t.t() if matrix else t
        experts = [t + expert_noise(upcycle, name, e, t.shape) if matrix and upcycle.noise_std else t
                   for e in range(first, end)]
        return torch.stack(experts).contiguous()

    return Weight((num_experts, *shape), lambda: rows(0, num_experts), rows)


def expert_noise(upcycle: UpcycleConfig, name: str, expert: int, shape: torch.Size) -> torch.Tensor:
    """The noise of one expert's tensor: a function of (seed, tensor, expert) alone, whichever rank draws it."""
    generator = torch.Generator().manual_seed(zlib.crc32(f"{upcycle.seed}/{name}/{expert}".encode()))
    return torch.randn(shape, generator=generator) * upcycle.noise_std


def router_names(shapes: dict[str, tuple[int, ...]], model_cfg: Any) -> set[str]:
    """Tensors of the MoE blocks that are not experts (routers, their statistics): the recipe initialises them."""
    moe = [f"blocks.{i}.moe." for i, layer in enumerate(model_cfg.expanded_layers()) if layer.type == "ffn_moe"]
    return {n for n in shapes if any(n.startswith(p) and not n.startswith(p + "experts.") for p in moe)}


__all__ = ["UpcycleConfig", "dense_model_config", "upcycled_weights", "router_names"]
