"""Public names of a package imported on first use (PEP 562 `__getattr__`), so that importing the package,
or one light submodule of it, does not import torch and transformers through its neighbours.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable


def exports(package: str, names: dict[str, str]) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """The `__getattr__` and `__dir__` of `package`, whose public `names` map to the submodule (relative, `.x`)
    that defines each; the submodule is imported when its name is first read."""

    def attribute(name: str) -> object:
        if name not in names:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(names[name], package), name)

    def listing() -> list[str]:
        return sorted({*vars(importlib.import_module(package)), *names})

    return attribute, listing
