"""One small Registry class and the registries, keyed by the YAML `type` names.

A registry maps a name to a component (a class or factory) and, optionally, the dataclass that configures
it. Configs are parsed through the registry, so an unknown name fails at load time listing the known ones.
"""
from __future__ import annotations

from typing import Any, Callable


class Registry:
    """Name -> (component, config class)."""

    def __init__(self, kind: str):
        self.kind = kind
        self._components: dict[str, Any] = {}
        self._configs: dict[str, type | None] = {}

    def register(self, name: str, config: type | None = None) -> Callable[[Any], Any]:
        def decorator(component: Any) -> Any:
            if name in self._components and self._components[name] is not component:
                raise KeyError(f"{self.kind} '{name}' is already registered")
            self._components[name] = component
            self._configs[name] = config
            return component

        return decorator

    def names(self) -> list[str]:
        return sorted(self._components)

    def __contains__(self, name: str) -> bool:
        return name in self._components

    def unknown(self, name: Any) -> str:
        return f"unknown {self.kind} {name!r}; known: {', '.join(self.names())}"

    def get(self, name: str) -> Any:
        if name not in self._components:
            raise KeyError(self.unknown(name))
        return self._components[name]

    def config_class(self, name: str) -> type | None:
        if name not in self._configs:
            raise KeyError(self.unknown(name))
        return self._configs[name]

    def build(self, cfg: Any, *args: Any, **kwargs: Any) -> Any:
        """Build the component named by `cfg.type`, passing it its own config."""
        return self.get(cfg.type)(cfg, *args, **kwargs)


NORMS = Registry("norm")
ATTENTIONS = Registry("attention kind")
FFNS = Registry("ffn")
BLOCKS = Registry("block")
ROUTERS = Registry("router")
MIXERS = Registry("sequence mixer")
