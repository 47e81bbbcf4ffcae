"""What an fp8 decode costs pass by pass, and what it cannot be folded into, on this CPU.

`float8.to_float` reads fp8 codes back through float16's layout in five passes over the numbers: the widening
of the codes to int16, a shift, a mask, float16 to float32 into the working buffer, and the scale multiplied
in place. This times each pass alone on warm buffers, the whole `to_float`, the two ways of doing it in fewer
passes that torch offers (its own float8 cast; a float16 x float32 product written as float32), and the
floor of any decode that writes its entries: one pass from the codes to float32 (an int8 copy). The numbers
are one layer's keys and values at Llama-3.1-8B's attention shape and 4,096 entries (8.4M). Every timing is
the median of `--repeats`, the cases taking turns.

    PYTHONPATH=src .venv/bin/python benchmarks/fp8_decode_passes.py
"""

from __future__ import annotations

import argparse
import time

import torch

from kvevict.storage_forms.float8 import E4M3_SHIFT, to_float


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--entries", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    torch.manual_seed(0)
    shape = (2, 1, args.heads, args.entries, args.head_dim)
    codes = torch.randint(0, 256, shape, dtype=torch.uint8) & 0x77  # finite e4m3 codes
    scale = torch.rand(2, 1, args.heads, 1, 1) + 0.5
    out = torch.empty(shape)
    wide = codes.view(torch.int8).to(torch.int16)
    factor = scale * E4M3_SHIFT
    cases = {
        "1 widen codes to int16 (into a warm buffer)": lambda: wide.copy_(codes.view(torch.int8)),
        "2 shift": lambda: wide.bitwise_left_shift_(0),
        "3 mask": lambda: wide.bitwise_and_(~(1 << 14)),
        "4 float16 to float32 into the buffer": lambda: out.copy_(wide.view(torch.float16)),
        "5 scale in place": lambda: out.mul_(factor),
        "to_float into the buffer (as kvevict decodes)": lambda: to_float(codes, "e4m3", scale, out),
        "torch's float8 cast to float32": lambda: out.copy_(codes.view(torch.float8_e4m3fn)),
        "float16 x float32 product into float32": lambda: torch.mul(wide.view(torch.float16), factor, out=out),
        "floor: int8 to float32, one pass": lambda: out.copy_(codes.view(torch.int8)),
    }
    times: dict[str, list[float]] = {name: [] for name in cases}
    names = list(cases)
    for turn in range(args.repeats + 1):
        for k in range(len(names)):
            name = names[(turn + k) % len(names)]
            t0 = time.perf_counter()
            cases[name]()
            if turn:  # the first turn warms every buffer
                times[name].append(time.perf_counter() - t0)
    print(f"fp8 decode of {codes.numel():,} numbers ({args.heads} KV heads x {args.entries} entries x "
          f"{args.head_dim}, keys and values), {torch.get_num_threads()} threads; median ms of {args.repeats}")
    for name in names:
        values = sorted(times[name])
        print(f"{name:48} {values[len(values) // 2] * 1e3:7.2f}")


if __name__ == "__main__":
    main()
