"""`storage_forms.float8.to_float` reads float8 codes through float16's layout: it must equal torch's own cast.

The reference is torch's float8 dtypes (`codes.view(torch.float8_e4m3fn).to(float32)`), an independent
conversion; every one of the 256 codes of each format is checked, then random codes times scales (float32
and float64, per tensor and per head) bit for bit, and that `fp8` and `vllmfp8` never write a NaN code,
the one place the two reads differ.
"""

from __future__ import annotations

import pytest
import torch

from kvevict.storage_forms import Fp8, VllmFp8
from kvevict.storage_forms.float8 import to_float

DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
EVERY = torch.arange(256, dtype=torch.uint8)


def cast(codes: torch.Tensor, fmt: str, scale: torch.Tensor) -> torch.Tensor:
    return codes.view(DTYPES[fmt]).to(scale.dtype) * scale


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int64 if a.dtype == torch.float64 else torch.int32),
                       b.view(torch.int64 if b.dtype == torch.float64 else torch.int32))


def test_every_e5m2_code_reads_as_torch_casts_it_infinities_and_nans_included():
    one = torch.tensor(1.0)
    assert same_bits(to_float(EVERY, "e5m2", one), cast(EVERY, "e5m2", one))


def test_every_e4m3_code_but_the_two_nans_reads_as_torch_casts_it():
    one = torch.tensor(1.0)
    ours, theirs = to_float(EVERY, "e4m3", one), cast(EVERY, "e4m3", one)
    nan = theirs.isnan()
    assert EVERY[nan].tolist() == [0x7F, 0xFF]
    assert same_bits(ours[~nan], theirs[~nan])  # subnormals (codes 1..7) and ±448 among them


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_codes_times_a_scale_match_the_cast_bit_for_bit(fmt, dtype):
    g = torch.Generator().manual_seed(3)
    codes = torch.randint(0, 256, (2, 2, 3, 40, 16), generator=g, dtype=torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x7E if fmt == "e4m3" else 0x7B  # finite codes only
    for scale in (torch.tensor([0.0123, 3.7], dtype=dtype).view(2, 1, 1, 1, 1),
                  torch.rand(2, 1, 3, 1, 1, generator=g, dtype=dtype) * 1e-3):
        assert same_bits(to_float(codes, fmt, scale), cast(codes, fmt, scale))


@pytest.mark.parametrize("form", [Fp8(), Fp8(scale="head"), VllmFp8(), VllmFp8(format="e5m2", kscale=0.01)])
def test_the_fp8_forms_never_write_a_nan_code(form):
    x = torch.randn(2, 1, 2, 64, 8, dtype=torch.float32) * 1e4  # far past the calibrated and the fixed range
    x[..., 0] = float("inf")
    state = {}
    if isinstance(form, Fp8):
        form.encode(torch.randn(2, 1, 2, 4, 8), state)  # calibrated on small entries first
    codes = form.encode(x, state)["codes"]
    assert not codes.view(DTYPES[getattr(form, "format", "e4m3")]).to(torch.float32).isnan().any()
