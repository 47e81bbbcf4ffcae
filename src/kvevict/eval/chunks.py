"""How a stream is cut into forwards: the chunk size checked, and each forward's span.

Kept apart from `streaming` so the command line checks `--chunk` without importing the engine.
"""

from __future__ import annotations

from ..errors import KvevictError


def check_chunk(chunk: object) -> int:
    """A chunk is a whole number of tokens per forward, at least 1."""
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise KvevictError(f"chunk must be a whole number of tokens >= 1 (1 = token by token), got {chunk!r}")
    return chunk


def boundaries(length: int, prefill: int, chunk: int) -> list[tuple[int, int]]:
    """`(start, stop)` of every forward: the prefill, then chunks of `chunk` tokens."""
    return [(0, prefill)] + [(t, min(t + chunk, length)) for t in range(prefill, length, chunk)]
