"""Recipe files as plain data: strict YAML (a key given twice is an error, `1e-3` is a float) and dotted-path
overrides (`--set model.layers[0].repeat=2`). Every floor that reads a stored recipe uses these; parsing the data
into the typed recipe is `moep_ds.config` (the root, at the top of the import graph) or a section's own config
class (e.g. `models.config.ModelConfig` for a checkpoint's model).
"""
from __future__ import annotations

import pathlib
import re
from typing import Any

import yaml

from moep_ds.schema import ConfigError, join


class _Loader(yaml.SafeLoader):
    """SafeLoader that also reads `1e-3` as a float (YAML 1.1 insists on `1.0e-3`) and refuses a key given twice
    in one mapping (PyYAML keeps the last silently, so a recipe's second `d_model:` would hide its first)."""

    def construct_document(self, node: yaml.Node) -> Any:
        check_unique_keys(node, "", set())
        return super().construct_document(node)


def check_unique_keys(node: yaml.Node, path: str, seen: set[int]) -> None:
    """ConstructorError at the second occurrence of a key, naming its dotted path and where the first one is."""
    if id(node) in seen:  # an alias: its node was checked where its anchor is (and aliases can nest exponentially)
        return
    seen.add(id(node))
    if isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            check_unique_keys(item, f"{path}[{i}]", seen)
    elif isinstance(node, yaml.MappingNode):
        first: dict[str, yaml.Node] = {}
        for key, value in node.value:
            if not isinstance(key, yaml.ScalarNode) or key.tag == "tag:yaml.org,2002:merge":
                continue  # `<<: *base` entries may be overridden by the mapping's own keys, as YAML intends
            dotted = join(path, key.value)
            if key.value in first:
                raise yaml.constructor.ConstructorError(
                    "first given", first[key.value].start_mark, f"duplicate key {dotted}", key.start_mark)
            first[key.value] = key
            check_unique_keys(value, dotted, seen)


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?(?:[eE][-+]?[0-9]+)$"),
    list("-+0123456789"),
)


def yaml_load(text: str) -> Any:
    return unshared(yaml.load(text, Loader=_Loader))  # noqa: S506 - a SafeLoader subclass


def unshared(node: Any) -> Any:
    """`node` with every mapping and list its own: PyYAML gives an alias (`*mla`) the anchored object itself, so an
    override of one block's copy (`--set model.layers[0].attention.num_heads=2`) would change every block naming it."""
    if isinstance(node, dict):
        return {k: unshared(v) for k, v in node.items()}
    if isinstance(node, list):
        return [unshared(v) for v in node]
    return node


def yaml_error_text(err: Exception) -> str:
    """The parser's problem with its 1-based line and column (PyYAML spreads them over several lines)."""
    mark, problem = getattr(err, "problem_mark", None), getattr(err, "problem", None)
    if mark is None or problem is None:
        return str(err).strip().splitlines()[0]
    text = f"line {mark.line + 1}, column {mark.column + 1}: {problem}"
    context, context_mark = getattr(err, "context", None), getattr(err, "context_mark", None)
    if context and context_mark is not None:
        text += f" ({context} at line {context_mark.line + 1}, column {context_mark.column + 1})"
    return text


def read_yaml(path: str | pathlib.Path, what: str = "config file") -> dict[str, Any]:
    """The recipe at `path` as plain data; errors name it as `what` (a command's option, e.g. "--config")."""
    name = f"{what} {str(path)!r}"
    path = pathlib.Path(path)
    if path.is_dir():  # `--config configs`: the folder exists, so "does not exist" would mislead
        raise ConfigError(f"{name} is a folder, not a YAML file")
    if not path.is_file():
        raise ConfigError(f"{name} does not exist")
    if path.suffix not in (".yaml", ".yml"):
        raise ConfigError(f"{name} is not a YAML file (expected .yaml or .yml)")
    try:
        raw = yaml_load(path.read_text(encoding="utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError) as err:
        raise ConfigError(f"{name} is not valid YAML: {yaml_error_text(err)}") from None
    except OSError as err:
        raise ConfigError(f"{name} cannot be read: {err.strerror or err}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{name} must hold a mapping of sections, got {type(raw).__name__}")
    return raw


_SEGMENT = re.compile(r"([^.\[\]]+)|\[(\d+)\]")
_DOTTED = re.compile(r"[^.\[\]]+(?:\.[^.\[\]]+|\[\d+\])*")


def split_key(key: str) -> list[str | int]:
    """'model.layers[3].moe.num_experts' -> ['model', 'layers', 3, 'moe', 'num_experts']."""
    if not _DOTTED.fullmatch(key):
        bad_index = re.search(r"\[(?!\d+\])[^\]]*\]?", key)
        why = f"{bad_index.group()} is not a list index like [0]" if bad_index else "it is not a dotted path"
        raise ConfigError(f"override key {key!r}: {why} (e.g. model.layers[0].repeat)")
    parts: list[str | int] = []
    for name, index in _SEGMENT.findall(key):
        if index:
            parts.append(int(index))
        elif name.isdigit():
            parts.append(int(name))
        else:
            parts.append(name)
    return parts


def dotted(parts: list[str | int]) -> str:
    return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in parts).lstrip(".")


def check_step(node: Any, part: str | int, parents: list[str | int], key: str) -> None:
    """`part` can select in `node` (found at `parents`): an index in range of a list, a name in a mapping."""
    where = dotted(parents) or "the recipe"
    if isinstance(part, int):
        if not isinstance(node, list):
            raise ConfigError(f"override {key!r}: {where} is not a list, so [{part}] cannot index it")
        if part >= len(node):
            raise ConfigError(f"override {key!r}: index {part} is out of range ({where} has {len(node)} item(s))")
    elif isinstance(node, list):
        raise ConfigError(f"override {key!r}: {where} is a list; pick an item, e.g. {where}[0].{part}")
    elif not isinstance(node, dict):
        raise ConfigError(f"override {key!r}: {where} ({node!r}) is not a mapping, so it has no key {part!r}")


def apply_override(raw: dict[str, Any], override: str) -> None:
    if "=" not in override:
        raise ConfigError(f"override {override!r} must look like key.path=value")
    key, text = override.split("=", 1)
    key = key.strip()
    parts = split_key(key)
    node: Any = raw
    for depth, part in enumerate(parts[:-1]):
        check_step(node, part, parts[:depth], key)
        if isinstance(part, int):
            node = node[part]
            continue
        if isinstance(parts[depth + 1], str) and not isinstance(node.get(part), (dict, list)):
            node[part] = {}  # a new (or replaced scalar) section; an index needs an existing list
        node = node.get(part)
    check_step(node, parts[-1], parts[:-1], key)
    try:
        node[parts[-1]] = yaml_load(text)
    except yaml.YAMLError as err:
        raise ConfigError(f"override {override!r}: the value is not valid YAML: {yaml_error_text(err)}") from None


def dump_yaml(data: Any) -> str:
    """A recipe (plain data, `schema.to_dict` of a parsed one) as the YAML a checkpoint stores."""
    return yaml.safe_dump(data, sort_keys=False)
