"""How a stream is cut into forwards: the chunk size checked, and each forward's span.

Kept apart from `streaming` so the command line checks `--chunk` without importing the engine.
"""

from __future__ import annotations

from ..defaults import DEFAULT_CHUNK
from ..errors import KvevictError


def check_chunk(chunk: object) -> int:
    """A chunk is a whole number of tokens per forward, at least 1."""
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise KvevictError(f"chunk must be a whole number of tokens >= 1 (1 = token by token), got {chunk!r}")
    return chunk


def prefill_piece(chunk: int) -> int:
    """Tokens per forward of a stream's prefill (the budget's first tokens, which nothing evicts, so any cut is
    exact): the stream's chunk, at least `DEFAULT_CHUNK` (token by token would only be slower)."""
    return max(chunk, DEFAULT_CHUNK)


def boundaries(length: int, prefill: int, chunk: int, piece: int | None = None) -> list[tuple[int, int]]:
    """`(start, stop)` of every forward: the prefill (in pieces of `piece` tokens, or one forward), then chunks
    of `chunk` tokens."""
    piece = piece or max(prefill, 1)
    head = [(t, min(t + piece, prefill)) for t in range(0, prefill, piece)] or [(0, 0)]
    return head + [(t, min(t + chunk, length)) for t in range(prefill, length, chunk)]
