"""Model config: embedding, a list of block configs (with `repeat:` and nested groups), final norm.

A `flavour` (gpt2, llama, gemma, pythia) fills in the defaults of that architecture family, model-wide and
in every layer entry; anything written in the recipe wins over the flavour.
"""
from __future__ import annotations

import copy
import dataclasses
import math
from typing import Annotated, Any, Iterator, Literal

from moep_ds.layers.norm import NormConfig
from moep_ds.registry import ATTENTIONS, BLOCKS, NORMS
from moep_ds.schema import (
    ConfigError, NonNegativeFloat, NonNegativeInt, OneOf, PositiveFloat, PositiveInt, fail, join,
)

FLAVOURS: dict[str, dict[str, dict[str, Any]]] = {
    "gpt2": {
        "model": {"position_embedding": "learned", "final_norm": {"type": "layernorm"}},
        # GPT-2's gelu_new: the tanh approximation of GELU
        "block": {"norm": {"type": "layernorm"}, "ffn": {"type": "gelu_tanh", "bias": True},
                  "attention": {"bias": True}},
    },
    "llama": {
        "model": {"final_norm": {"type": "rmsnorm"}},
        "block": {"norm": {"type": "rmsnorm"}, "ffn": {"type": "swiglu"}, "attention": {"rope": {}}},
    },
    "gemma": {  # Gemma's rms_norm_eps is 1e-6 (the others' 1e-5)
        "model": {"final_norm": {"type": "gemma_rmsnorm", "eps": 1e-6}, "embedding_scale": True},
        "block": {"norm": {"type": "gemma_rmsnorm", "eps": 1e-6}, "ffn": {"type": "geglu"}, "attention": {"rope": {}}},
    },
    "pythia": {
        "model": {"final_norm": {"type": "layernorm"}, "tie_embeddings": False},
        "block": {
            "norm": {"type": "layernorm"},
            "ffn": {"type": "gelu_tanh", "bias": True},  # GPT-NeoX's fused bias-GELU, as Pythia trained
            "attention": {"bias": True, "rope": {"fraction": 0.25}},
            "parallel_residual": True,
        },
    },
}


def merge_defaults(defaults: dict[str, Any], given: dict[str, Any]) -> dict[str, Any]:
    """Deep merge: values in `given` win; nested mappings merge key by key."""
    out = copy.deepcopy(defaults)
    for key, value in given.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge_defaults(out[key], value)
        else:
            out[key] = value
    return out


def apply_flavour_to_layer(entry: Any, flavour: str | None, path: str) -> Any:
    if not isinstance(entry, dict):
        return entry
    flavour = entry.get("flavour", flavour)
    entry = {k: v for k, v in entry.items() if k != "flavour"}
    if entry.get("type") == "group" and isinstance(entry.get("layers"), list):
        layers = entry["layers"]
        entry["layers"] = [apply_flavour_to_layer(e, flavour, join(join(path, "layers"), i)) for i, e in enumerate(layers)]
        return entry
    if flavour is None or entry.get("type") not in BLOCKS:
        return entry
    fields = {f.name for f in dataclasses.fields(BLOCKS.config_class(entry["type"]))}
    preset = {k: v for k, v in flavour_preset(flavour, join(path, "flavour"))["block"].items() if k in fields}
    return merge_defaults(attention_preset_for(preset, entry.get("attention")), entry)


def attention_preset_for(preset: dict[str, Any], attention: Any) -> dict[str, Any]:
    """A flavour's attention preset (RoPE, biases) is given to the attention kinds that have those fields; a kind
    without them (gated_deltanet: no positions, no biases) takes the keys it has."""
    kind = attention.get("type") if isinstance(attention, dict) else attention
    if "attention" not in preset or kind not in ATTENTIONS or ATTENTIONS.config_class(kind) is None:
        return preset
    fields = {f.name for f in dataclasses.fields(ATTENTIONS.config_class(kind))}
    return {**preset, "attention": {k: v for k, v in preset["attention"].items() if k in fields}}


def flavour_preset(name: str, path: str) -> dict[str, dict[str, Any]]:
    if name not in FLAVOURS:
        raise ConfigError(f"{path}: unknown flavour {name!r}; known: {', '.join(sorted(FLAVOURS))}")
    return FLAVOURS[name]


@dataclasses.dataclass(kw_only=True)
class BlockGroupConfig:
    """A repeated pattern of blocks, e.g. `{type: group, repeat: 4, layers: [dense, ffn_moe]}`."""

    type: str = "group"
    repeat: PositiveInt = 1
    layers: list[Annotated[Any, OneOf(BLOCKS)]]

    def validate(self, path: str) -> None:
        if not self.layers:
            fail(f"{path}.layers", self.layers, "must not be empty")

    def check_dims(self, path: str, d_model: int) -> None:
        for i, layer in enumerate(self.layers):
            if hasattr(layer, "check_dims"):
                layer.check_dims(join(join(path, "layers"), i), d_model)


BLOCKS.register("group", config=BlockGroupConfig)(None)


@dataclasses.dataclass(kw_only=True)
class UpcycleConfig:
    """Sparse upcycling of `init_from` (a dense checkpoint) into this recipe's ffn_moe blocks (interop/upcycle.py)."""

    noise_std: NonNegativeFloat = 0.0  # absolute std of Gaussian noise on each expert's matrices (0: exact copies)
    seed: NonNegativeInt = 0  # of that noise, drawn per (tensor, expert)


@dataclasses.dataclass(kw_only=True)
class ModelConfig:
    flavour: str | None = None
    vocab_size: PositiveInt
    d_model: PositiveInt
    max_seq_len: PositiveInt
    layers: list[Annotated[Any, OneOf(BLOCKS)]]
    tie_embeddings: bool = True
    position_embedding: Literal["none", "learned"] = "none"
    embedding_scale: bool = False  # multiply embeddings by sqrt(d_model) (Gemma)
    final_norm: Annotated[Any, OneOf(NORMS)] = dataclasses.field(default_factory=NormConfig)
    init_std: PositiveFloat = 0.02
    # "normal": N(0, init_std), output projections of residual branches times 1/sqrt(2 x blocks) (GPT-2).
    # "gpt_neox": GPT-NeoX's small_init N(0, sqrt(2 / (5 d))) for embeddings, input projections and the head, and
    # wang_init N(0, 2 / (L sqrt(d))) for output projections (Pythia's init_method / output_layer_init_method)
    init: Literal["normal", "gpt_neox"] = "normal"
    init_num_layers: PositiveInt | None = None  # L of wang_init; null: the number of blocks
    # weights to start from instead of `init` (interop/): a Hugging Face folder or hf:REPO[@REVISION] of the same
    # architecture, or a moep_ds run / checkpoint; read when a run starts fresh (not on --resume) and by moep-import
    init_from: str | None = None
    upcycle: UpcycleConfig | None = None  # init_from is dense: build this recipe's ffn_moe blocks from it

    def init_scales(self, num_blocks: int) -> tuple[float, float]:
        """(std of input-side weights, factor for output projections) of the `init` scheme."""
        if self.init == "gpt_neox":
            small = math.sqrt(2.0 / (5 * self.d_model))
            wang = 2.0 / ((self.init_num_layers or num_blocks) * math.sqrt(self.d_model))
            return small, wang / small
        return self.init_std, 1.0 / math.sqrt(2 * num_blocks)

    @classmethod
    def preprocess(cls, raw: dict[str, Any], path: str) -> dict[str, Any]:
        flavour = raw.get("flavour")
        if flavour is None:
            out = dict(raw)
        else:
            out = merge_defaults(flavour_preset(flavour, join(path, "flavour"))["model"], raw)
        if isinstance(out.get("layers"), list):
            out["layers"] = [
                apply_flavour_to_layer(e, flavour, join(join(path, "layers"), i)) for i, e in enumerate(out["layers"])
            ]
        return out

    def validate(self, path: str) -> None:
        if not self.layers:
            fail(join(path, "layers"), self.layers, "must not be empty")
        check_init_from(self, path)
        for i, layer in enumerate(self.layers):
            if hasattr(layer, "check_dims"):
                layer.check_dims(join(join(path, "layers"), i), self.d_model)

    def expanded_layers(self) -> list[Any]:
        """One block config per layer, `repeat` and groups unrolled."""
        return list(expand(self.layers))


def check_init_from(cfg: ModelConfig, path: str) -> None:
    """The form of init_from only: whether it exists is checked when it is read (a recipe stored in a checkpoint
    keeps naming it after the folder is gone)."""
    if cfg.init_from is not None and cfg.init_from.startswith("hf:"):
        from moep_ds.errors import UserError
        from moep_ds.models.source_spec import split_hub_spec

        try:
            split_hub_spec(cfg.init_from)
        except UserError:
            fail(join(path, "init_from"), cfg.init_from, "is not hf:ORG/NAME[@REVISION] (e.g. "
                 "hf:EleutherAI/pythia-1b@step13000)")
    if cfg.init_from is not None and not cfg.init_from.strip():
        fail(join(path, "init_from"), cfg.init_from, "must name a folder or hf:REPO[@REVISION]")
    if cfg.upcycle is not None and cfg.init_from is None:
        fail(join(path, "upcycle"), "set", "needs model.init_from (the dense checkpoint to upcycle)")


def layer_entries(layers: list[Any], path: str) -> Iterator[tuple[str, Any]]:
    """(dotted path, block config) for every entry of a layer list, groups opened, repeats not unrolled."""
    for i, layer in enumerate(layers):
        entry_path = join(join(path, "layers"), i)
        if isinstance(layer, BlockGroupConfig):
            yield from layer_entries(layer.layers, entry_path)
        else:
            yield entry_path, layer


def expand(layers: list[Any]) -> Iterator[Any]:
    for layer in layers:
        for _ in range(layer.repeat):
            if isinstance(layer, BlockGroupConfig):
                yield from expand(layer.layers)
            else:
                yield layer
