"""Two models compared setting by setting: what moep-import checks a source against the recipe with (a moep_ds
checkpoint's recipe, or the recipe a Hugging Face MoE's config.json stands for), and what the native export checks
a model against the architectures with.

    lines = model_differences(saved_model_cfg, recipe_model_cfg)   # ["model.layers[1].moe.num_experts: 8 in SRC, ..."]

How a model is initialised (INIT_KEYS) and how its routers train (TRAINING_KEYS) are not compared: a run may change
them, the weights mean the same. Of a router's loss-free balancing only whether it has the bias is compared (its
update rate is how it trains), and a router's logits_dtype is a precision choice (the same function in fp32).
"""
from __future__ import annotations

from typing import Any

INIT_KEYS = ("init", "init_std", "init_num_layers", "init_from", "upcycle")  # how to initialise, not the model
# how a router trains (its losses, noise, capacity, expert lifecycle) and evaluates: a run may change them, the
# weights mean the same
TRAINING_KEYS = ("load_balancing_weight", "load_balancing_scope", "z_loss_weight", "jitter", "capacity_factor",
                 "drop_policy", "lifecycle", "threshold_ema_decay", "eval_mode", "logits_dtype")
# compared by what they say about the weights: a router with a selection bias or without
PRESENCE_KEYS = ("bias_update_rate",)


def model_description(model_cfg: Any, keep_length: bool = True) -> dict[str, Any]:
    """The model's settings as a tree of dicts and lists, one resolved entry per block (without max_seq_len unless
    `keep_length`: a rotary model runs at any length up to its own)."""
    from moep_ds.schema import to_dict

    raw = {k: v for k, v in to_dict(model_cfg).items() if k not in INIT_KEYS and k not in ("layers", "flavour")}
    if not keep_length:
        raw.pop("max_seq_len", None)
    layers = [resolved(layer, model_cfg.d_model) for layer in model_cfg.expanded_layers()]
    return {**raw, "layers": layers}


def resolved(layer: Any, d_model: int) -> dict[str, Any]:
    """A block's settings with the sizes its defaults stand for (an FFN's hidden_size null is 4d for a GELU MLP,
    num_kv_heads null is num_heads, qkv_bias null is bias, a router that keeps all its groups has none, ...): two
    recipes that build the same block compare equal."""
    from moep_ds.layers.ffn import ffn_hidden_size
    from moep_ds.schema import to_dict

    out = without(to_dict(layer), ("repeat",))
    if isinstance(out.get("ffn"), dict):
        out["ffn"]["hidden_size"] = ffn_hidden_size(layer.ffn, d_model)
    router = out.get("moe", {}).get("router") if isinstance(out.get("moe"), dict) else None
    if isinstance(router, dict) and "num_groups" in router:  # all groups kept: no group limit, however written
        groups = router["num_groups"]
        if (router.get("group_topk") or groups) == groups:
            router.update(num_groups=1, group_topk=None, group_score=None)
    attention = getattr(layer, "attention", None)
    if isinstance(out.get("attention"), dict) and hasattr(attention, "kv_heads"):
        out["attention"].update(num_kv_heads=attention.kv_heads, head_dim=attention.resolved_head_dim(d_model))
        if "qkv_bias" in out["attention"]:
            out["attention"]["qkv_bias"] = attention.bias if attention.qkv_bias is None else attention.qkv_bias
    return out


def without(tree: Any, keys: tuple[str, ...]) -> Any:
    """`tree` (dicts and lists) without `keys` at the top and TRAINING_KEYS at any depth, PRESENCE_KEYS as
    set / not set."""
    if isinstance(tree, dict):
        return {k: (v is not None) if k in PRESENCE_KEYS else without(v, ())
                for k, v in tree.items() if k not in keys and k not in TRAINING_KEYS}
    return [without(v, ()) for v in tree] if isinstance(tree, list) else tree


def differences(saved: Any, now: Any, path: str, names: tuple[str, str] = ("SRC", "the recipe")) -> list[str]:
    """'path: X in SRC, Y in the recipe' for every leaf that differs between two nested dict/list trees."""
    if isinstance(saved, dict) and isinstance(now, dict):
        return [d for key in sorted(set(saved) | set(now), key=str)
                for d in differences(saved.get(key), now.get(key), f"{path}.{key}", names)]
    if isinstance(saved, list) and isinstance(now, list):
        if len(saved) != len(now):
            return [f"{path}: {len(saved)} blocks in {names[0]}, {len(now)} in {names[1]}"]
        return [d for i, (a, b) in enumerate(zip(saved, now)) for d in differences(a, b, f"{path}[{i}]", names)]
    return [] if saved == now else [f"{path}: {saved!r} in {names[0]}, {now!r} in {names[1]}"]


def model_differences(saved: Any, target: Any, names: tuple[str, str] = ("SRC", "the recipe"),
                      keep_length: bool = True) -> list[str]:
    """Every setting of model `saved` that differs from `target`'s, one line each (module docstring)."""
    return differences(model_description(saved, keep_length), model_description(target, keep_length), "model",
                       names)


def report(lines: list[str], limit: int = 20) -> str:
    return "\n  ".join(lines[:limit]) + (f"\n  (and {len(lines) - limit} more)" if len(lines) > limit else "")


__all__ = ["INIT_KEYS", "TRAINING_KEYS", "differences", "model_description", "model_differences", "report",
           "resolved", "without"]
