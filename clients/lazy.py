"""A package that imports its submodules when one of its names is first used (as PEFT and transformers
do): ``from clients.flite.config import FliteConfig`` then imports no torch, so a config is checked
before any model is imported."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping


def lazy_names(package: str, where: Mapping[str, str]) -> Callable[[str], object]:
    """A module ``__getattr__`` for ``package``: each name of ``where`` (name -> submodule) is read from
    its submodule when first asked for, and kept."""
    import sys

    def __getattr__(name: str):
        if name not in where:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{where[name]}"), name)
        setattr(sys.modules[package], name, value)
        return value

    return __getattr__
