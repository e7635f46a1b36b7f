"""What the four dense Hugging Face families (interop/families/gpt2.py, llama.py, gemma.py, gpt_neox.py) share:
a recipe's dense model as a Spec, the Expected table each family states for a config.json (what the recipe must
hold, field by field), the recipe and the one-line-per-field check built from that table, and `DenseFamily`, the
adapter base that turns a family's table, config keys and tensor rules into the protocol (interop/adapter.py).

# H query heads, G key/value heads, Dh head dim, D model dim, F FFN hidden dim

    expected(hf)        {field: (accepted values, the canonical first; where config.json says so)}
    dense_recipe(e)     the model section from each field's canonical value (what moep-import writes)
    expected_differences(e, spec)   one line per field the recipe's model does not hold; accepted alternatives
                        (Pythia's gelu for our gelu_tanh) are warned about, not refused

A family is one block repeated (spec_of refuses anything else). Older checkpoints carry buffers that are no weights
(GPT-2's causal mask `attn.bias`, GPT-NeoX's `masked_bias` and `rotary_emb.inv_freq`): each family names them
(`buffers`), they are recognised and skipped; any other tensor the rules do not know is an error.
"""
from __future__ import annotations

import dataclasses
import logging
import re
from typing import Any


from moep_ds.errors import UserError
from moep_ds.interop.adapter import ROTARY_BUFFERS, Family, Inexpressible, Raw
from moep_ds.interop.rules import Rule, same, with_bias

log = logging.getLogger(__name__)

# what the recipe must hold, by field: (accepted values, the first the canonical one; where config.json says so)
Expected = dict[str, tuple[tuple[Any, ...], str]]

FIELD_PATHS = {
    "block_type": "model.layers[*].type", "vocab_size": "model.vocab_size", "d_model": "model.d_model",
    "num_layers": "model.layers (number of blocks)", "num_heads": "model.layers[*].attention.num_heads",
    "num_kv_heads": "model.layers[*].attention.num_kv_heads", "head_dim": "model.layers[*].attention.head_dim",
    "attention_bias": "model.layers[*].attention.bias", "window": "model.layers[*].attention.window",
    "rotary": "model.layers[*].attention.rope (set or null)", "rope_base": "model.layers[*].attention.rope.base",
    "rope_fraction": "model.layers[*].attention.rope.fraction", "ffn_type": "model.layers[*].ffn.type",
    "ffn_hidden": "model.layers[*].ffn.hidden_size", "ffn_bias": "model.layers[*].ffn.bias",
    "norm_type": "model.layers[*].norm.type", "norm_eps": "model.layers[*].norm.eps",
    "norm_bias": "model.layers[*].norm.bias", "final_norm_type": "model.final_norm.type",
    "final_norm_eps": "model.final_norm.eps", "final_norm_bias": "model.final_norm.bias",
    "parallel_residual": "model.layers[*].parallel_residual", "tie_embeddings": "model.tie_embeddings",
    "position_embedding": "model.position_embedding", "embedding_scale": "model.embedding_scale",
    "max_seq_len": "model.max_seq_len",
}


@dataclasses.dataclass(frozen=True)
class Spec:
    """A homogeneous dense model as the recipe builds it, in the terms the architectures are compared in."""

    values: dict[str, Any]

    def __getitem__(self, key: str) -> Any:
        return self.values[key]


def spec_of(model_cfg: Any) -> Spec:
    """The recipe's dense model as a Spec; one line when it is not one block repeated (what the HF classes are)."""
    from moep_ds.layers.ffn import ffn_hidden_size
    from moep_ds.schema import to_dict

    layers = model_cfg.expanded_layers()
    first = layers[0]
    other = not_dense(model_cfg)
    if other is not None:
        raise UserError(other)
    for i, layer in enumerate(layers):
        if {**to_dict(layer), "repeat": 1} != {**to_dict(first), "repeat": 1}:
            raise UserError(f"model.layers: block {i} differs from block 0; the Hugging Face architectures repeat "
                            "one block")
    check_dense_attention(first.attention)
    if first.ffn.type not in ("gelu", "gelu_tanh", "swiglu", "geglu"):
        raise UserError(f"model.layers[*].ffn.type ({first.ffn.type!r}): the dense Hugging Face architectures have no "
                        "such FFN")
    d, att, rope = model_cfg.d_model, first.attention, first.attention.rope
    return Spec({
        "block_type": "dense", "vocab_size": model_cfg.vocab_size, "d_model": d, "num_layers": len(layers),
        "num_heads": att.num_heads, "num_kv_heads": att.kv_heads, "head_dim": att.resolved_head_dim(d),
        "attention_bias": att.bias, "window": att.window, "rotary": rope is not None,
        "rope_base": rope.base if rope else None, "rope_fraction": rope.fraction if rope else None,
        "ffn_type": first.ffn.type, "ffn_hidden": ffn_hidden_size(first.ffn, d), "ffn_bias": first.ffn.bias,
        "norm_type": first.norm.type, "norm_eps": first.norm.eps, "norm_bias": first.norm.bias,
        "final_norm_type": model_cfg.final_norm.type, "final_norm_eps": model_cfg.final_norm.eps,
        "final_norm_bias": model_cfg.final_norm.bias, "parallel_residual": first.parallel_residual,
        "tie_embeddings": model_cfg.tie_embeddings, "position_embedding": model_cfg.position_embedding,
        "embedding_scale": model_cfg.embedding_scale, "max_seq_len": model_cfg.max_seq_len,
    })


def not_dense(model_cfg: Any) -> str | None:
    """One line naming the model's first block that is not a dense one; None when all are."""
    for i, layer in enumerate(model_cfg.expanded_layers()):
        if getattr(layer, "type", None) != "dense":
            return (f"model.layers (block {i}) is {getattr(layer, 'type', layer)!r}: the Hugging Face architectures "
                    "(GPT-2, Llama, Gemma, GPT-NeoX) are of dense blocks only (a dense one becomes an MoE by "
                    "model.upcycle)")
    return None


def check_dense_attention(att: Any) -> None:
    """What the dense architectures' attention has: causal, no QK-norm, biases on all projections or none."""
    where = "the dense Hugging Face architectures (GPT-2, Llama, Gemma, GPT-NeoX)"
    if att.type != "causal":
        raise UserError(f"model.layers[*].attention.type ({att.type!r}): {where} have causal attention")
    if att.qk_norm is not None:
        raise UserError(f"model.layers[*].attention.qk_norm is set: {where} have no QK-norm")
    if att.sinks:
        raise UserError(f"model.layers[*].attention.sinks is set: {where} have no attention sinks")
    if att.qkv_bias is not None and att.qkv_bias != att.bias:
        raise UserError(f"model.layers[*].attention.qkv_bias ({att.qkv_bias}) differs from attention.bias "
                        f"({att.bias}): {where} have biases on every projection or on none")
    if att.rope is not None and att.rope.yarn is not None:
        raise UserError(f"model.layers[*].attention.rope.yarn is set: {where} are read with plain RoPE here")


# ---- tensors ------------------------------------------------------------------------------------------------


def norm_rules(ours: str, theirs: str, has_bias: bool) -> list[Rule]:
    return with_bias(same, ours, theirs, has_bias)


# ---- config.json -> what the recipe must hold ----------------------------------------------------------------


def get(hf: dict[str, Any], *keys: str, default: Any = None) -> tuple[Any, str]:
    """The first of `keys` that config.json holds (older and newer spellings), and which; else the default."""
    for key in keys:
        if key in hf:
            return hf[key], key
    return default, f"{keys[0]}, default"


def rope_parameters(hf: dict[str, Any], default_fraction: float = 1.0) -> tuple[Expected, dict[str, Any]]:
    """Rotary base and share from transformers 5's rope_parameters or the older rope_theta / rotary_pct keys; a
    scaled rotary (rope_scaling, Llama 3.1's) has no counterpart here."""
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or {}
    kind = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    theta, theta_key = (params["rope_theta"], "rope_parameters.rope_theta") if "rope_theta" in params else get(
        hf, "rope_theta", "rotary_emb_base", default=10000.0)
    fraction, fraction_key = ((params["partial_rotary_factor"], "rope_parameters.partial_rotary_factor")
                              if "partial_rotary_factor" in params else
                              get(hf, "partial_rotary_factor", "rotary_pct", default=default_fraction))
    out = {"rotary": ((True,), "rotary embedding"), "rope_base": ((float(theta),), theta_key),
           "rope_fraction": ((float(fraction),), fraction_key)}
    return out, {"rope_type": kind}


def unsupported(arch: str, hf: dict[str, Any], flags: dict[str, Any]) -> None:
    """One line for a config.json setting that changes the computation in a way no recipe can express."""
    for key, fine in flags.items():
        if key in hf and hf[key] != fine and hf[key] is not None:
            raise UserError(f"config.json: {key} = {hf[key]!r} ({arch}) has no moep_ds counterpart (supported: "
                            f"{fine!r})")


MLP_ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}
GATED_ACTIVATIONS = {"silu": "swiglu", "swish": "swiglu", "gelu_pytorch_tanh": "geglu", "gelu_new": "geglu"}


@dataclasses.dataclass(frozen=True)
class AtMost:
    """A rotary model runs at any length up to the one it was trained for."""

    limit: int


def at_most_positions(hf: dict[str, Any]) -> Expected:
    positions = hf.get("max_position_embeddings")
    return {"max_seq_len": ((AtMost(positions),), "max_position_embeddings")} if positions else {}


def activation(table: dict[str, str], value: Any, key: str) -> str:
    if value not in table:
        raise UserError(f"config.json: {key} = {value!r} has no moep_ds FFN (supported: {', '.join(table)})")
    return table[value]


def common(hf: dict[str, Any], d: int, heads: int, layers: int) -> Expected:
    return {"block_type": (("dense",), "a dense architecture"), "vocab_size": ((hf.get("vocab_size"),), "vocab_size"),
            "d_model": ((d,), "hidden size"), "num_layers": ((layers,), "number of layers"),
            "num_heads": ((heads,), "attention heads"), "window": ((None,), "no sliding window"),
            "embedding_scale": ((False,), "unscaled embeddings")}


# what an accepted difference changes in the numbers, and how to get transformers' (docs/FIDELITY.md)
ACCEPTED_NOTES = {
    ("ffn_type", "gelu_tanh", "gelu"):
        "computed with GELU's tanh approximation, the formula Pythia trained with (GPT-NeoX's fused bias-GELU), "
        "where transformers computes the exact GELU config.json names: each activation differs by up to 4.7e-4, the "
        "logits by about 1e-3 (1.7e-3 for Pythia-1B); for transformers' logits set the recipe's FFN type to gelu "
        "(--set model.layers[0].ffn.type=gelu in the Pythia recipes)",
}


def expected_differences(expected: Expected, spec: Spec) -> tuple[list[str], list[tuple[str, Any, Any, str]]]:
    """(one line per field where the recipe's model is none of the accepted values, naming both; the accepted
    alternatives the model holds instead of the canonical value: (field, ours, canonical, where))."""
    lines, accepted_instead = [], []
    for field, (accepted, where) in expected.items():
        ours = spec[field]
        if field in ("rope_base", "rope_fraction") and not spec["rotary"]:
            continue  # reported once, as `rotary`
        if isinstance(accepted[0], AtMost):
            if ours > accepted[0].limit:
                lines.append(f"{FIELD_PATHS[field]}: {ours!r} in the recipe, longer than {accepted[0].limit} in "
                             f"config.json ({where})")
            continue
        if ours not in accepted:
            theirs = accepted[0] if len(accepted) == 1 else " or ".join(map(repr, accepted))
            lines.append(f"{FIELD_PATHS[field]}: {ours!r} in the recipe, {theirs!r} in config.json ({where})")
        elif ours != accepted[0]:
            accepted_instead.append((field, ours, accepted[0], where))
    return lines, accepted_instead




def dense_recipe(expected: Expected) -> Raw:
    """The model section of the recipe that builds the model a config.json describes (each field's canonical value
    in its Expected table: what moep-import without --config writes)."""
    e = {field: accepted[0] for field, (accepted, _) in expected.items()}
    positions = e.get("max_seq_len", AtMost(2048))
    rope = {"base": e["rope_base"], "fraction": e["rope_fraction"]} if e["rotary"] else None
    attention = {"num_heads": e["num_heads"], "num_kv_heads": e["num_kv_heads"], "head_dim": e["head_dim"],
                 "bias": e["attention_bias"], "window": e["window"], "rope": rope}
    # a LayerNorm's bias as config.json says; an RMSNorm has none (the field keeps its default)
    norm = {"type": e["norm_type"], "eps": e["norm_eps"], **({"bias": e["norm_bias"]} if "norm_bias" in e else {})}
    final_norm = {"type": e["final_norm_type"], "eps": e["final_norm_eps"],
                  **({"bias": e["final_norm_bias"]} if "final_norm_bias" in e else {})}
    layer = {"type": "dense", "repeat": e["num_layers"], "attention": attention, "norm": norm,
             "ffn": {"type": e["ffn_type"], "hidden_size": e["ffn_hidden"], "bias": e["ffn_bias"]},
             "parallel_residual": e["parallel_residual"]}
    return {"vocab_size": e["vocab_size"], "d_model": e["d_model"],
            "max_seq_len": positions.limit if isinstance(positions, AtMost) else positions,
            "tie_embeddings": e["tie_embeddings"], "position_embedding": e["position_embedding"],
            "embedding_scale": e["embedding_scale"], "final_norm": final_norm, "layers": [layer]}


class DenseFamily(Family):
    """A dense family: its Expected table (`expected`), its own config.json keys (`config`), what it refuses to
    write (`refuse`) and its tensors (`outer_rules`, `layer_rules`) make the protocol's methods."""

    buffers = ROTARY_BUFFERS  # tensors of older checkpoints that are no weights

    def expected(self, hf: Raw) -> Expected:
        raise NotImplementedError

    def config(self, spec: Spec) -> Raw:
        """The family's own config.json keys for the model."""
        raise NotImplementedError

    def refuse(self, spec: Spec) -> None:
        """Inexpressible when the model is another family's (positions, residual, norm)."""

    def outer_rules(self, spec: Spec) -> list[Rule]:
        """Embeddings and final norm (the untied head is added from head_keys)."""
        raise NotImplementedError

    def layer_rules(self, spec: Spec, i: int) -> list[Rule]:
        raise NotImplementedError

    def recipe(self, hf: Raw) -> Raw:
        return dense_recipe(self.expected(hf))

    def to_hf(self, model_cfg: Any) -> Raw:
        other = not_dense(model_cfg)
        if other is not None:
            raise Inexpressible(other, other_kind=True)
        spec = spec_of(model_cfg)
        self.refuse(spec)
        return {"vocab_size": spec["vocab_size"], "tie_word_embeddings": spec["tie_embeddings"], **self.config(spec)}

    def rules(self, model_cfg: Any, hf: Raw) -> list[Rule]:
        spec = spec_of(model_cfg)
        out = self.outer_rules(spec)
        if not spec["tie_embeddings"]:
            out.append(same("head.weight", self.head_keys[0]))
        for i in range(spec["num_layers"]):
            out.extend(self.layer_rules(spec, i))
        return out

    def ignored(self, hf: Raw) -> re.Pattern:
        return self.buffers

    def check(self, hf: Raw, model_cfg: Any, source: str) -> None:
        """Every field where config.json and the recipe's model differ, one line each naming both values; an
        accepted alternative is a warning saying what it changes in the numbers."""
        lines, accepted = expected_differences(self.expected(hf), spec_of(model_cfg))
        for field, ours, canonical, where in accepted:
            log.warning("%s: %r in the recipe, %r in %s's config.json (%s): accepted, the same weights; %s",
                        FIELD_PATHS[field], ours, canonical, source, where,
                        ACCEPTED_NOTES.get((field, ours, canonical), "computed as the recipe says"))
        if lines:
            raise UserError(f"{source} ({self.hf_class}) does not match the recipe's model:\n  " + "\n  ".join(lines))

    def differences(self, model_cfg: Any) -> list[str]:
        """The model against the Expected table of its own config.json (an accepted alternative is no difference)."""
        return expected_differences(self.expected(self.hf_config(model_cfg)), spec_of(model_cfg))[0]


__all__ = ["AtMost", "DenseFamily", "Expected", "GATED_ACTIVATIONS", "MLP_ACTIVATIONS", "Spec", "activation",
           "at_most_positions", "common", "dense_recipe", "expected_differences", "get", "norm_rules", "not_dense",
           "rope_parameters", "spec_of", "unsupported"]
