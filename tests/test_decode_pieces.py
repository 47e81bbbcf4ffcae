"""A storage form's decode into a large buffer goes piece by piece on a CPU (`storage_forms/pieces.py`).

The pieces must cover every element once, within the bound, and a decode in pieces must write the numbers
of an independent computation into exactly the part of the buffer it is given: fp8 against torch's own
float8 cast, q4 against its nibbles unpacked and `(code - zero) * scale` written out here by hand.
"""

from __future__ import annotations

import pytest
import torch

from kvevict.storage_forms import hqq_codes
from kvevict.storage_forms.float8 import to_float
from kvevict.storage_forms.pieces import PIECE, pieces

FLOAT8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
SHAPE = (2, 1, 3, 1500, 128)  # keys and values, one row, 3 KV heads, 1,500 entries: 1.15M numbers
assert 2 * 3 * 1500 * 128 > PIECE


@pytest.mark.parametrize("shape", [SHAPE, (5, 7), (3, 700_000), (2, 2, 1, 1 << 18), (1 << 19,)])
def test_pieces_cover_every_element_once_within_the_bound(shape):
    numbers = 1 << 19
    seen = torch.zeros(shape, dtype=torch.int32)
    for index in pieces(shape, numbers):
        assert seen[index].numel() <= numbers
        seen[index] += 1
    assert bool((seen == 1).all())


def a_buffer(dtype: torch.dtype) -> torch.Tensor:
    """A working buffer with room past the entries, filled with a number no decode writes."""
    return torch.full((*SHAPE[:3], SHAPE[3] + 100, SHAPE[4]), 7.0, dtype=dtype)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_in_pieces_into_a_part_of_a_buffer_matches_the_cast(fmt, dtype):
    g = torch.Generator().manual_seed(5)
    codes = torch.randint(0, 256, SHAPE, generator=g, dtype=torch.uint8)
    top = 0x7F if fmt == "e4m3" else 0x7C  # e5m2's all-ones exponent: infinities and NaNs
    codes[(codes & top) == top] = 0x7E if fmt == "e4m3" else 0x7B  # finite codes only
    scale = torch.rand(2, 1, 3, 1, 1, generator=g) + 0.25  # per side and head
    buffer = a_buffer(dtype)
    to_float(codes, fmt, scale, buffer[:, :, :, : SHAPE[3]])
    expected = (codes.view(FLOAT8[fmt]).to(torch.float32) * scale).to(dtype)  # the product, then the cast
    assert torch.equal(buffer[:, :, :, : SHAPE[3]], expected)
    assert bool((buffer[:, :, :, SHAPE[3]:] == 7).all())  # nothing written past the part given


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_q4_in_pieces_into_a_part_of_a_buffer_matches_the_arithmetic_by_hand(dtype):
    g = torch.Generator().manual_seed(6)
    group = 64
    packed = torch.randint(0, 256, (*SHAPE[:-1], SHAPE[-1] // 2), generator=g, dtype=torch.uint8)
    scale = (torch.rand(*SHAPE[:-1], SHAPE[-1] // group, generator=g) + 0.1).to(dtype)
    zero = (torch.rand(*SHAPE[:-1], SHAPE[-1] // group, generator=g) * 15).to(dtype)
    buffer = a_buffer(dtype)
    hqq_codes.dequantize(hqq_codes.Codes(packed, scale, zero), 4, group, dtype, buffer[:, :, :, : SHAPE[3]])
    # HQQ's 4-bit layout: a byte's high nibble is channel i, its low nibble channel i + D/2
    codes = torch.cat([packed >> 4, packed & 0xF], dim=-1).to(dtype).unflatten(-1, (-1, group))
    expected = ((codes - zero[..., None]) * scale[..., None]).flatten(-2)
    assert torch.equal(buffer[:, :, :, : SHAPE[3]], expected)
    assert bool((buffer[:, :, :, SHAPE[3]:] == 7).all())
