"""Does fp8's decode, compiled, make the decode step faster? `decode_overhead.py` with the five passes swapped.

`fp8_decode_passes.py --compile` times `float8.to_float`'s five passes as one `torch.compile` function alone,
on warm buffers. This runs `decode_overhead.py`'s step (its arguments pass through) with that function in
the fp8 form's decode (`--compiled`), or as kvevict decodes (without), so the two are read the same way:
each against DynamicCache in its own process, run one after the other. The swap lasts this process only.

    PYTHONPATH=src:benchmarks .venv/bin/python benchmarks/fp8_compiled_step.py --compiled \
        --models llama-3.1-8b@4096 --steps 48 --rounds 2 --arms window,fp8+window
"""

from __future__ import annotations

import sys
from unittest import mock

import decode_overhead
import torch
from fp8_decode_passes import five_passes  # beside this script

from kvevict.storage_forms import float8, fp8


def compiled_to_float():
    """`float8.to_float` with its in-place e4m3 case compiled; every other case as it is."""
    fused = torch.compile(five_passes, dynamic=False)

    def to_float(codes: torch.Tensor, fmt: str, scale: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        if out is None or fmt != "e4m3" or out.dtype != scale.dtype:
            return float8.to_float(codes, fmt, scale, out)
        fused(codes, scale * float8.E4M3_SHIFT, out)
        return out

    return to_float


def main() -> None:
    compiled = "--compiled" in sys.argv
    if not compiled:
        decode_overhead.main()
        return
    sys.argv.remove("--compiled")
    print("fp8's decode: the five passes compiled (torch.compile, inductor)")
    with mock.patch.object(fp8, "to_float", compiled_to_float()):
        decode_overhead.main()


if __name__ == "__main__":
    main()
