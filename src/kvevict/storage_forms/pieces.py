"""A decode's elementwise passes run one piece at a time, so each piece stays in a core's cache between them.

A storage form's decode is several passes over the numbers (fp8: five, `float8.to_float`; q4: the nibbles,
the zero point, the scale, `hqq_codes.dequantize`). Over a whole layer at Llama-3.1-8B's attention shape
(8.4M numbers at 4,096 entries) each pass goes to memory before the next begins. Cut into pieces of
`PIECE` numbers (one KV head's keys or values there), a piece's temporaries and output sit in the core's
L2 from one pass to the next, and no temporary of the layer's size is made (fp8's int16 widening is half
the entries' bytes). In the decode step on the 2-core CPU of docs/benchmarks.md this took fp8 from
1.24-1.26x to 1.18-1.21x DynamicCache's step and left q4 where it was (`benchmarks/storage_decode_step.py`).
Elementwise work done in pieces is the same numbers bit for bit (`tests/test_decode_pieces.py`).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import torch

#: numbers per piece: a piece's int16 temporary (1 MB) and float32 output (2 MB), split over two threads,
#: fit one core's L2 each
PIECE = 1 << 19


def cut(out: torch.Tensor) -> bool:
    """Whether a decode into `out` goes piece by piece: on a CPU, when it is larger than one piece (a
    GPU's kernels gain nothing from it, and each piece would be a launch)."""
    return out.device.type == "cpu" and out.numel() > PIECE and out.shape[-1] <= PIECE


def by_piece(out: torch.Tensor, *inputs: torch.Tensor) -> Iterator[tuple[torch.Tensor, ...]]:
    """`out` `[..., D]` and the tensors that broadcast against it, `[..., width]` (codes, scales), piece by
    piece along the leading dimensions, each entry's last dimension whole: `(out's piece, input pieces...)`."""
    n = out.dim()
    for index in pieces(out.shape[:-1], PIECE // out.shape[-1]):
        yield tuple(part(x, index, n) for x in (out, *inputs))


def pieces(shape: torch.Size | tuple[int, ...], numbers: int = PIECE) -> Iterator[tuple[slice, ...]]:
    """Index tuples over the leading dimensions of `shape` that cut it into pieces of at most `numbers`
    elements, each a block of whole trailing dimensions (so a piece of a strided view is still one strided
    block), together covering every element once. A shape of at most `numbers` elements is one piece, `()`."""
    inner, k = 1, len(shape)
    while k and inner * shape[k - 1] <= numbers:  # the trailing dimensions a piece holds whole
        k -= 1
        inner *= shape[k]
    if k == 0:
        yield ()
        return
    per = max(1, numbers // inner)  # how much of dimension k - 1 one piece takes
    for lead in itertools.product(*(range(size) for size in shape[: k - 1])):
        for start in range(0, shape[k - 1], per):
            yield tuple(slice(i, i + 1) for i in lead) + (slice(start, start + per),)


def part(x: torch.Tensor, index: tuple[slice, ...], ndim: int) -> torch.Tensor:
    """The piece `index` of `x`, a tensor that broadcasts against a shape of `ndim` dimensions (a scale
    `[2, 1, H, 1, 1]`, say): a dimension it broadcasts along (size 1, or missing) is taken whole."""
    x = x.view((1,) * (ndim - x.dim()) + tuple(x.shape))
    return x[tuple(span if x.shape[d] > 1 else slice(None) for d, span in enumerate(index))]
