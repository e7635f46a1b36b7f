"""Strict parsing of plain YAML data into typed, kw_only dataclasses.

Every error names the dotted path and the offending value, e.g.
`model.layers[3].attention.num_heads (6) must divide d_model (256)`.

Field types understood: bool, int, float (finite: YAML's .inf, -.inf and .nan are refused), str, `X | None`,
`Literal[...]`, `list[X]`, `dict[str, X]`, nested dataclasses, `Annotated[X, Check(...)]` for range checks, and
`Annotated[Any, OneOf(REGISTRY)]` for polymorphic components selected by their `type:` key (a bare string is
shorthand for `{type: name}`). A dataclass may define `validate(self, path)` for checks across its fields, and a
classmethod `preprocess(raw, path)` that fills defaults into the raw mapping before parsing (e.g. flavour presets).
"""
from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from typing import Annotated, Any, Callable, Literal, Union

from moep_ds.errors import UserError
from moep_ds.registry import Registry


class ConfigError(UserError, ValueError):
    """A config value that cannot be used; the message is one line with the dotted path."""


def fail(path: str, value: Any, problem: str) -> typing.NoReturn:
    raise ConfigError(f"{path} ({value!r}) {problem}")


@dataclasses.dataclass(frozen=True)
class Check:
    predicate: Callable[[Any], bool]
    problem: str


@dataclasses.dataclass(frozen=True)
class OneOf:
    registry: Registry
    default: str | None = None  # the `type` assumed when a mapping names none


def Gt(bound: float) -> Check:  # noqa: N802 - reads like a type in annotations
    return Check(lambda v: v > bound, f"must be > {bound}")


def Ge(bound: float) -> Check:  # noqa: N802
    return Check(lambda v: v >= bound, f"must be >= {bound}")


def Between(lo: float, hi: float, *, lo_open: bool = False, hi_open: bool = False) -> Check:  # noqa: N802
    def ok(v: float) -> bool:
        return (v > lo if lo_open else v >= lo) and (v < hi if hi_open else v <= hi)

    interval = f"{'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}"
    return Check(ok, f"must be in {interval}")


PositiveInt = Annotated[int, Gt(0)]
NonNegativeInt = Annotated[int, Ge(0)]
PositiveFloat = Annotated[float, Gt(0)]
NonNegativeFloat = Annotated[float, Ge(0)]


def join(path: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else key


def parse(tp: Any, value: Any, path: str) -> Any:
    """Parse `value` as type `tp`, raising ConfigError at `path`."""
    origin = typing.get_origin(tp)
    if origin is Annotated:
        base, *marks = typing.get_args(tp)
        for mark in marks:
            if isinstance(mark, OneOf):
                return parse_registered(mark.registry, value, path, mark.default)
        out = parse(base, value, path)
        for mark in marks:
            if isinstance(mark, Check) and out is not None and not mark.predicate(out):
                fail(path, out, mark.problem)
        return out
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None:
            if type(None) in args:
                return None
            fail(path, value, "must not be null")
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return parse(arg, value, path)
            except ConfigError as err:
                errors.append(err)
        raise errors[0]
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            fail(path, value, f"must be one of {', '.join(map(str, choices))}")
        return value
    if origin is list:
        if not isinstance(value, list):
            fail(path, value, "must be a list")
        (item,) = typing.get_args(tp)
        return [parse(item, v, join(path, i)) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            fail(path, value, "must be a mapping")
        _, item = typing.get_args(tp)
        return {str(k): parse(item, v, join(path, str(k))) for k, v in value.items()}
    if dataclasses.is_dataclass(tp):
        return parse_dataclass(tp, value, path)
    return parse_scalar(tp, value, path)


def parse_scalar(tp: Any, value: Any, path: str) -> Any:
    if tp is Any:
        return value
    if tp is bool:
        if not isinstance(value, bool):
            fail(path, value, "must be true or false")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            fail(path, value, "must be an integer")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            fail(path, value, "must be a number")
        # YAML's .inf / -.inf / .nan: no setting means them, and range checks let some through (inf > 0)
        if not math.isfinite(value):
            fail(path, value, "must be a finite number")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            fail(path, value, "must be a string")
        return value
    raise TypeError(f"unsupported config field type {tp!r} at {path}")


def parse_registered(registry: Registry, value: Any, path: str, default: str | None = None) -> Any:
    if isinstance(value, str):
        value = {"type": value}
    if not isinstance(value, dict):
        fail(path, value, f"must be a mapping with a 'type' key (one of {', '.join(registry.names())})")
    if "type" not in value and default is not None:
        value = {"type": default, **value}
    name = value.get("type")
    if name not in registry:
        raise ConfigError(f"{join(path, 'type')}: {registry.unknown(name)}")
    cls = registry.config_class(name)
    return parse_dataclass(cls, value, path)


def parse_dataclass(cls: type, value: Any, path: str) -> Any:
    if isinstance(value, cls):
        return value
    if not isinstance(value, dict):
        fail(path, value, f"must be a mapping of {cls.__name__} fields")
    if hasattr(cls, "preprocess"):
        value = cls.preprocess(value, path)
    hints = typing.get_type_hints(cls, include_extras=True)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    for key in value:
        if key not in fields:
            close = difflib.get_close_matches(str(key), list(fields), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else f"; known keys: {', '.join(fields)}"
            raise ConfigError(f"{join(path, str(key))}: unknown key{hint}")
    kwargs = {}
    for name, f in fields.items():
        if name in value:
            kwargs[name] = parse(hints[name], value[name], join(path, name))
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError(f"{join(path, name)}: required key is missing")
    obj = cls(**kwargs)
    if hasattr(obj, "validate"):
        obj.validate(path)
    return obj


def to_dict(obj: Any) -> Any:
    """Plain data (for YAML/JSON dumps and checkpoints) from a parsed config tree."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, list):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj
