"""Importing this module registers every built-in component (norms, attention, FFNs, blocks, routers)."""
import importlib
import pkgutil

import moep_ds.blocks
import moep_ds.layers
import moep_ds.models.config  # noqa: F401 - registers the "group" block
import moep_ds.routing


def _import_all(package) -> None:
    for info in pkgutil.iter_modules(package.__path__):
        importlib.import_module(f"{package.__name__}.{info.name}")


for _package in (moep_ds.layers, moep_ds.routing, moep_ds.blocks):
    _import_all(_package)
