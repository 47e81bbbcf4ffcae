"""Choosing the executor `--executor NAME` names: the one module that knows every executor.

It sits beside the Ray executor, not in `ab/`: the local executor and the interface are
in `ab/executors.py`, the Ray executor builds on them here, and `ab/` never imports this
package, so neither executor module imports the other.
"""

from __future__ import annotations

from ..ab.executors import Executor, LocalExecutor
from ..errors import KvevictError

#: the names `--executor` accepts
EXECUTORS = ("local", "ray")


def make_executor(name: str, address: str | None = None, workers: int = 2, retries: int = 2) -> Executor:
    """The executor `--executor NAME` asks for, checked before any work: Ray's absence and an
    unreachable `address` are one line each, not a hang or a traceback."""
    if name not in EXECUTORS:
        raise KvevictError(f"--executor must be one of {', '.join(EXECUTORS)}, got '{name}'")
    if workers < 1:
        raise KvevictError(f"--workers must be at least 1, got {workers}")
    if retries < 0:
        raise KvevictError(f"--retries must be 0 or more, got {retries}")
    if name == "local":
        if address:
            raise KvevictError("--address is for --executor ray: drop it, or add --executor ray")
        return LocalExecutor()
    from .ray_executor import RayExecutor, check_reachable, import_ray

    import_ray()
    if address:
        check_reachable(address)
    return RayExecutor(address=address, workers=workers, retries=retries)
