"""llama.cpp itself, through `llama-cpp-python` (the optional extra `llamacpp`): the external
check of kvevict's `llamacpp` preset.

`stream.py` streams tokens through llama.cpp with llama-server's context shift done through
llama.cpp's own memory API; `check.py` streams the same tokens through kvevict's preset and
compares the two. Nothing here is imported by the rest of kvevict but the `engine-check`
command, and `llama_cpp` is imported only when a check runs.
"""

from __future__ import annotations

from ..errors import KvevictError

#: the extra, as pyproject.toml names it
EXTRA = "llamacpp"
INSTALL = "pip install 'kvevict[llamacpp]' (make test-llamacpp builds it; a source build, about 5 minutes on 2 cores)"


def require():
    """The low-level `llama_cpp` bindings, or a one-line error naming the install."""
    try:
        import llama_cpp.llama_cpp as bindings
    except ImportError as exc:
        raise KvevictError(
            f"engine-check runs llama.cpp through llama-cpp-python, which is not installed ({exc.name} missing): "
            f"{INSTALL}"
        ) from None
    return bindings
