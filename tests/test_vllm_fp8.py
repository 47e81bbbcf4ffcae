"""vLLM's fp8 KV rule (`vllmfp8+P`) against vLLM's own kernel and against independent images.

Two references, neither of them kvevict code:

* vLLM's CPU kernel itself: the codes `cpu_attn_reshape_and_cache` wrote for 18,432 entries over 18
  decades, per format and scale (`tests/data/vllm_fp8_codes.npz`, written by `tools/vllm_fp8_dump.py` in
  `.venv-vllm`); the form's codes must be those bytes.
* the architecture matrix's eager attention masked to what the policy keeps, reading images of every key
  and value computed here from the rule as arithmetic (`image`: the exponent from `torch.frexp`, the
  value floored on that exponent's grid; no bit masks), through `test_quantized`'s reference.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import test_quantized
from architectures import ARCHS
from kvevict.errors import KvevictError
from kvevict.policies import parse_policy
from kvevict.storage_forms import Fp8, VllmFp8
from test_quantized import CASES, RULES, exact_build, matches_images, quant_reference_nll

DUMP = Path(__file__).parent / "data" / "vllm_fp8_codes.npz"
#: format -> (mantissa bits, exponent of the smallest normal, largest finite value)
GRIDS = {"e4m3": (3, -6, 448.0), "e5m2": (2, -14, 57344.0)}
FORMAT_OF = {"fp8": "e4m3", "fp8_e5m2": "e5m2"}


def image(x: torch.Tensor, fmt: str = "e4m3", scale: float = 1.0) -> torch.Tensor:
    """vLLM's fp8 image of `x`, as arithmetic: y = x * (1/scale) in float32, clamped; its step is 2^(e - m) for
    its binary exponent e (never below the smallest normal's), and it keeps the whole steps toward zero."""
    mantissa, smallest, limit = GRIDS[fmt]
    inverse = torch.tensor(1.0, dtype=torch.float32) / torch.tensor(scale, dtype=torch.float32)
    y = (x.to(torch.float32) * inverse).clamp(-limit, limit).double()
    _, exponent = torch.frexp(y)  # |y| = f * 2^exponent, f in [0.5, 1)
    step = torch.pow(2.0, (exponent - 1).clamp(min=smallest) - mantissa)
    code = torch.sign(y) * torch.floor(y.abs() / step) * step  # on the format's grid: exact in float32
    return (code.float() * torch.tensor(scale, dtype=torch.float32)).to(x.dtype)


@pytest.fixture(scope="module")
def dump():
    return np.load(DUMP)


def test_codes_are_vllms_own_bit_for_bit(dump):
    """Every case vLLM's kernel wrote: the form's bytes equal vLLM's, for keys and values alike; kvevict's
    calibrated `fp8` form (rounding to nearest, scale amax / 448) differs from them on nearly half."""
    key, value = torch.from_numpy(dump["key"]), torch.from_numpy(dump["value"])
    x = torch.stack([key, value])[:, None, None]  # [2, 1, 1, T, D]
    for i, case in enumerate(dump["cases"]):
        dtype, k_scale, v_scale = str(case).split(":")
        form = VllmFp8(8, FORMAT_OF[dtype], float(k_scale), float(v_scale))
        codes = form.encode(x, {})["codes"][:, 0, 0].numpy()
        np.testing.assert_array_equal(codes[0], dump[f"key_codes_{i}"], err_msg=str(case))
        np.testing.assert_array_equal(codes[1], dump[f"value_codes_{i}"], err_msg=str(case))
        ours = form.decode(form.encode(x, {}), torch.float32, {})
        np.testing.assert_array_equal(ours[0, 0, 0].numpy(), image(key, FORMAT_OF[dtype], float(k_scale)).numpy())
    calibrated = Fp8(8).encode(x, {})["codes"][:, 0, 0].numpy()
    assert (calibrated[0] != dump["key_codes_0"]).mean() > 0.4  # 47%: the tiniest entries are 0 in both


def test_the_rule_cuts_toward_zero_and_saturates():
    """Hand-worked e4m3 values: 1.1 lies between 1.0 and 1.125 (steps of 1/8 in [1, 2)): vLLM keeps 1.0 where
    rounding would too, 1.12 keeps 1.0 where rounding gives 1.125; -3.7 keeps -3.5; 500 saturates at 448;
    0.003 lies on the subnormal grid (steps of 2^-9): 1 step (0.001953125); e5m2's 1.2 keeps 1.0 (steps of 1/4)."""
    x = torch.tensor([1.1, 1.12, -3.7, 500.0, 0.003])
    held = VllmFp8(8).encode(torch.stack([x, x]).view(2, 1, 1, 1, 5), {})
    got = VllmFp8(8).decode(held, torch.float32, {})[0].flatten().tolist()
    assert got == [1.0, 1.0, -3.5, 448.0, 0.001953125]
    e5m2 = VllmFp8(8, "e5m2")
    y = torch.tensor([1.2, 1.2]).view(2, 1, 1, 1, 1)
    assert e5m2.decode(e5m2.encode(y, {}), torch.float32, {}).flatten().tolist() == [1.0, 1.0]


@pytest.mark.parametrize("arch,positions", CASES, ids=[f"{a.name}-{p}" for a, p in CASES])
def test_vllmfp8_matrix_matches_masked_reference_of_images(arch, positions, monkeypatch):
    """The matrix: `test_quantized`'s reference with its image taken by vLLM's rule (scale 1.0, e4m3)."""
    monkeypatch.setattr(test_quantized, "image", lambda x, bits: image(x))
    model = exact_build(arch)
    for spec, rule in RULES.items():
        ref = quant_reference_nll(model, rule, positions == "cache", bits=8)
        plain = matches_images(model, f"vllmfp8+{spec}", positions, ref)
        assert (plain - ref).abs().max() > 1e-3  # the images moved the NLL: not the unquantized cache again


def test_e5m2_matches_its_images(monkeypatch):
    monkeypatch.setattr(test_quantized, "image", lambda x, bits: image(x, "e5m2"))
    model = exact_build(ARCHS[0])
    ref = quant_reference_nll(model, RULES["sink4+window"], False, bits=8)
    plain = matches_images(model, "vllmfp8:format=e5m2+sink4+window", "original", ref)
    assert (plain - ref).abs().max() > 1e-3


@pytest.mark.parametrize("spec,needle", [
    ("vllmfp16+window", "use vllmfp8"),
    ("vllmfp8:format=e3m4+window", "format=e4m3"),
    ("vllmfp8:kscale=0+window", "above 0"),
    ("vllmfp8:scale=head+window", "valid options are bits, format, kscale, vscale"),
])
def test_bad_vllmfp8_specs_are_one_line(spec, needle):
    with pytest.raises(KvevictError, match=needle) as info:
        parse_policy(spec)
    assert "\n" not in str(info.value)
