"""`fp8`: each key and value as float8 e4m3, one scale per layer (`scale=tensor`) or per KV head (`scale=head`).

What vLLM deploys as `--kv-cache-dtype fp8` (docs/features/quantization/quantized_kvcache.md: e4m3,
"per-tensor quantization: a single scale ... for each Q, K and V tensor (k/v_scale = [1])" or
"per-attention-head quantization: k/v_scale = [num_kv_heads]"; the entry stored is fp8(x / scale),
read as fp8 * scale). The scale is calibrated once, on the first entries the layer stores, as
`amax / 448` (448: e4m3's largest finite value), and frozen: transformers' `Fp8QuantizedLayer`
(cache_utils.py) and vLLM's on-the-fly calibration (`calculate_kv_scales`) both take the first
forward's amax. Later entries beyond the calibrated range saturate at ±448 (vLLM's conversion
saturates; torch's cast on a CPU does too, the clamp makes it so on every device).

Held per entry: the key's and value's D codes, one byte each (`torch.float8_e4m3fn`, kept as its
bytes in a uint8 view because torch has no scatter for float8 on a CPU); per layer the float32
scales (2, or 2 per KV head; float64 in a float64 model). At head_dim 64 that is 128 bytes per
entry, half of bf16's 256.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..errors import KvevictError
from .base import StorageForm
from .float8 import to_float

FP8 = torch.float8_e4m3fn
#: e4m3's largest finite value
FP8_MAX = torch.finfo(FP8).max
#: what one scale covers: a layer's keys (values) as a whole, or each KV head's
SCALES = ("tensor", "head")


@dataclass(frozen=True)
class Fp8(StorageForm):
    """`fp8[:scale=tensor|head]+P`: P's kept entries held as float8 e4m3 with calibrated scales."""

    family: ClassVar[str] = "fp"

    bits: int = 8
    scale: str = "tensor"

    def __post_init__(self) -> None:
        if self.bits != 8:
            raise KvevictError(f"fp{self.bits} is not a supported KV float: use fp8 (e4m3, as vLLM's fp8 KV cache)")
        if self.scale not in SCALES:
            raise KvevictError(f"fp8 scale={self.scale} is not a scale granularity: use scale=tensor or scale=head")

    def number(self) -> int:
        return self.bits

    def parts(self, head_dim: int, dtype: torch.dtype) -> dict[str, tuple[int, torch.dtype]]:
        return {"codes": (head_dim, torch.uint8)}

    def calibrated(self, x: torch.Tensor, state: dict) -> torch.Tensor:
        """The scales `[2, 1, H or 1, 1, 1]`, set from `x` `[2, B, H, q, D]` the first time: float32 (vLLM's
        and transformers' scales), float64 for a float64 model (whose float noise float32 would round up)."""
        if "scale" not in state:
            dims = (1, 3, 4) if self.scale == "head" else (1, 2, 3, 4)
            amax = x.abs().amax(dim=dims, keepdim=True).to(torch.promote_types(x.dtype, torch.float32))
            state["scale"] = (amax / FP8_MAX).clamp(min=torch.finfo(torch.float32).tiny)  # an all-zero tensor
        return state["scale"]

    def encode(self, x: torch.Tensor, state: dict) -> dict[str, torch.Tensor]:
        if x.shape[3] == 0:  # nothing to calibrate on yet
            return {"codes": torch.zeros(x.shape, dtype=torch.uint8, device=x.device)}
        scale = self.calibrated(x, state)
        codes = (x.to(scale.dtype) / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
        return {"codes": codes.view(torch.uint8)}

    def decode(self, held: dict[str, torch.Tensor], dtype: torch.dtype, state: dict) -> torch.Tensor:
        codes = held["codes"]
        if "scale" not in state:  # nothing stored yet
            return torch.zeros(codes.shape, dtype=dtype, device=codes.device)
        return to_float(codes, "e4m3", state["scale"]).to(dtype)

    def decode_into(self, held: dict[str, torch.Tensor], out: torch.Tensor, state: dict) -> None:
        if "scale" not in state:
            out.zero_()
        else:
            to_float(held["codes"], "e4m3", state["scale"], out)

    def entry_bytes(self, head_dim: int, number: int) -> int:
        return 2 * head_dim  # one byte per channel, key and value

    def state_bytes(self, state: dict) -> int:
        scale = state.get("scale")
        return 0 if scale is None else scale.numel() * scale.element_size()
