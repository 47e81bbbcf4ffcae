"""The storage forms' decode four ways inside the decode step: `decode_overhead.py` with the decode swapped.

`fp8_decode_passes.py` times the decodes alone on warm buffers: fp8's `to_float` and q4's `dequantize` in
pieces of `pieces.PIECE` numbers (as kvevict decodes), over the whole buffer at once (`to_float_at_once`,
`dequantize_at_once`), and with `--compile` fp8's five passes as one `torch.compile` function. This runs
`decode_overhead.py`'s step (its arguments pass through) with the forms' decode as `--decode` says, so they
are read the same way: each against DynamicCache in its own process (a swap lasts its process only), the
processes run one after the other. `compiled` swaps fp8's decode alone; `before` is both forms at once with
q4's nibbles each both shifted and masked (`fp8_decode_passes.q4_masked_both`), the decode before the pieces.

    PYTHONPATH=src:benchmarks .venv/bin/python benchmarks/storage_decode_step.py --decode whole \
        --models llama-3.1-8b@4096 --steps 48 --rounds 2 --arms "window,fp8+window,q4:group=64,residual=128+window"
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from contextlib import ExitStack
from unittest import mock

import decode_overhead
import torch
from fp8_decode_passes import five_passes, q4_masked_both  # beside this script

from kvevict.storage_forms import float8, fp8, hqq_codes


def compiled_to_float() -> Callable[..., torch.Tensor]:
    """`float8.to_float` with its in-place e4m3 case compiled; every other case as it is."""
    fused = torch.compile(five_passes, dynamic=False)

    def to_float(codes: torch.Tensor, fmt: str, scale: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        if out is None or fmt != "e4m3" or out.dtype != scale.dtype:
            return float8.to_float(codes, fmt, scale, out)
        fused(codes, scale * float8.E4M3_SHIFT, out)
        return out

    return to_float


TITLES = {"pieces": "in pieces (as kvevict decodes)", "whole": "over the whole buffer at once (fp8 and q4)",
          "before": "at once, q4's nibbles each both shifted and masked (the code before the pieces)",
          "compiled": "fp8's five passes compiled (torch.compile, inductor)"}


def main() -> None:
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--decode", choices=list(TITLES), default="pieces")
    args, rest = parser.parse_known_args()
    print(f"the storage forms' decode: {TITLES[args.decode]}")
    with ExitStack() as swaps, mock.patch("sys.argv", [__file__, *rest]):
        if args.decode in ("whole", "before"):
            swaps.enter_context(mock.patch.object(fp8, "to_float", float8.to_float_at_once))
            swaps.enter_context(mock.patch.object(hqq_codes, "dequantize", hqq_codes.dequantize_at_once
                                                  if args.decode == "whole" else q4_masked_both))
        elif args.decode == "compiled":
            swaps.enter_context(mock.patch.object(fp8, "to_float", compiled_to_float()))
        decode_overhead.main()


if __name__ == "__main__":
    main()
