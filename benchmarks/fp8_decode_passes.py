"""What a storage form's decode costs pass by pass, and what it cannot be folded into, on this CPU.

`float8.to_float` reads fp8 codes back through float16's layout in five passes over the numbers: the widening
of the codes to int16, a shift, a mask, float16 to float32 into the working buffer, and the scale multiplied
in place, on a CPU one piece of `pieces.PIECE` numbers at a time. This times each pass alone on warm
buffers, the whole `to_float` in pieces (as kvevict decodes) and at once (`float8.to_float_at_once`), the
ways of doing it in fewer passes that torch offers (its own float8 cast; a float16 x float32 product written
as float32; a 256-entry table read with `index_select`; with `--compile`, the five passes as one
`torch.compile` function, which inductor turns into one C++ loop), and the floor of any decode that writes
its entries: one pass from the codes to float32 (an int8 copy). Then q4's decode (`hqq_codes.dequantize`:
two nibble copies into the buffer, the zero point subtracted and the scale multiplied in place), in pieces
and at once, against the one way to spare a pass, the nibbles subtracted from the zero point straight into
the buffer (one mixed uint8-float32 operation in place of a copy and a subtraction), and the decode with
both nibbles shifted and masked (two passes that `hqq_codes.code_at` spares). The numbers are one
layer's keys and values at Llama-3.1-8B's attention shape and 4,096 entries (8.4M). Every timing is the
median of `--repeats`, the cases taking turns; every alternative is checked equal to the decode at once
without a buffer first.

    PYTHONPATH=src .venv/bin/python benchmarks/fp8_decode_passes.py --compile
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from kvevict.storage_forms import hqq_codes
from kvevict.storage_forms.float8 import E4M3_SHIFT, to_float, to_float_at_once

Case = Callable[[torch.Tensor], object]  # a decode written into the buffer it is given


def timed(cases: dict[str, Case], buffer: torch.Tensor, repeats: int) -> dict[str, float]:
    """Median seconds of each case over `repeats` turns, the cases rotating, every one writing into the same
    `buffer` (two buffers of the same size can differ in speed, by how their pages were mapped); a first
    turn warms every buffer."""
    times: dict[str, list[float]] = {name: [] for name in cases}
    names = list(cases)
    for turn in range(repeats + 1):
        for k in range(len(names)):
            name = names[(turn + k) % len(names)]
            t0 = time.perf_counter()
            cases[name](buffer)
            if turn:
                times[name].append(time.perf_counter() - t0)
    return {name: sorted(values)[len(values) // 2] for name, values in times.items()}


def checked(cases: dict[str, Case], names: list[str], expected: torch.Tensor, what: str) -> None:
    """Each case of `names`, written into a fresh buffer, equals `expected`."""
    for name in names:
        into = torch.zeros_like(expected)
        cases[name](into)
        assert torch.equal(into, expected), f"{what}: {name!r} differs"


def five_passes(codes: torch.Tensor, factor: torch.Tensor, out: torch.Tensor) -> None:
    """`to_float`'s e4m3 passes as one function, for `torch.compile`, written into `out` (a part of the
    working buffer; `factor` is the scale times `E4M3_SHIFT`)."""
    half = (codes.view(torch.int8).to(torch.int16) << 7) & ~(1 << 14)
    out.copy_(half.view(torch.float16).to(out.dtype) * factor)


def fp8_cases(shape: tuple[int, ...], compile_: bool) -> dict[str, Case]:
    codes = torch.randint(0, 256, shape, dtype=torch.uint8) & 0x77  # finite e4m3 codes
    scale = torch.rand(shape[0], 1, shape[2], 1, 1) + 0.5
    wide = codes.view(torch.int8).to(torch.int16)
    index = torch.empty(shape, dtype=torch.int32)
    table = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    factor = scale * E4M3_SHIFT

    def lookup(into: torch.Tensor) -> None:
        torch.index_select(table, 0, index.copy_(codes).view(-1), out=into.view(-1))
        into.mul_(scale)

    cases: dict[str, Case] = {
        "1 widen codes to int16 (into a warm buffer)": lambda into: wide.copy_(codes.view(torch.int8)),
        "2 shift": lambda into: wide.bitwise_left_shift_(0),
        "3 mask": lambda into: wide.bitwise_and_(~(1 << 14)),
        "4 float16 to float32 into the buffer": lambda into: into.copy_(wide.view(torch.float16)),
        "5 scale in place": lambda into: into.mul_(factor),
        "to_float into the buffer in pieces (as kvevict decodes)": lambda into: to_float(codes, "e4m3", scale, into),
        "to_float's passes over the whole buffer at once": lambda into: to_float_at_once(codes, "e4m3", scale, into),
        "torch's float8 cast to float32": lambda into: into.copy_(codes.view(torch.float8_e4m3fn)),
        "float16 x float32 product into float32": lambda into: torch.mul(wide.view(torch.float16), factor, out=into),
        "256-entry table: widen to int32, index_select, scale": lookup,
        "floor: int8 to float32, one pass": lambda into: into.copy_(codes.view(torch.int8)),
    }
    if compile_:
        fused = torch.compile(five_passes, dynamic=False)
        t0 = time.perf_counter()
        fused(codes, factor, torch.empty(shape))
        print(f"torch.compile of the five passes: first call (the compile) {time.perf_counter() - t0:.1f} s")
        cases["the five passes compiled (torch.compile, inductor)"] = lambda into: fused(codes, factor, into)
    alternatives = [name for name in cases if name.startswith(("to_float", "256-entry", "the five passes"))]
    checked(cases, alternatives, to_float_at_once(codes, "e4m3", scale), "fp8")
    return cases


def q4_masked_both(held: hqq_codes.Codes, bits: int, group: int, dtype: torch.dtype,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """q4's decode into `out` at once with each nibble both shifted and masked, as `hqq_codes` did before
    `code_at` (the same numbers, two passes more); `hqq_codes.dequantize`'s arguments, so it can stand in for
    it, and its other cases (no `out`, other widths) as `dequantize_at_once`."""
    if out is None or bits != 4:
        return hqq_codes.dequantize_at_once(held, bits, group, dtype, out)
    for place, shift in zip(out.chunk(2, dim=-1), (4, 0), strict=True):
        place.copy_((held.codes >> shift) & 0xF)
    out.unflatten(-1, (-1, group)).sub_(held.zero[..., None]).mul_(held.scale[..., None])
    return out


def q4_cases(shape: tuple[int, ...], group: int = 64) -> dict[str, Case]:
    lead, dim = shape[:-1], shape[-1]
    held = hqq_codes.Codes(torch.randint(0, 256, (*lead, dim // 2), dtype=torch.uint8),
                           torch.rand(*lead, dim // group) + 0.1, torch.rand(*lead, dim // group) * 15)
    halves = dim // 2  # channels of one nibble: the high nibbles are the first half (hqq_codes._SHIFTS)

    def into_place(into: torch.Tensor) -> None:
        for half, shift in enumerate((4, 0)):
            nibbles = (held.codes >> shift) & 0xF
            groups = slice(half * halves // group, (half + 1) * halves // group)
            place = into[..., half * halves:(half + 1) * halves].unflatten(-1, (halves // group, group))
            torch.sub(nibbles.unflatten(-1, (halves // group, group)), held.zero[..., groups, None], out=place)
            place.mul_(held.scale[..., groups, None])

    cases: dict[str, Case] = {
        "dequantize into the buffer in pieces (as kvevict decodes)":
            lambda into: hqq_codes.dequantize(held, 4, group, into.dtype, into),
        "dequantize over the whole buffer at once":
            lambda into: hqq_codes.dequantize_at_once(held, 4, group, into.dtype, into),
        "nibbles minus the zero point straight into the buffer, then the scale": into_place,
        "at once, each nibble both shifted and masked (the high one needs no mask, the low one no shift)":
            lambda into: q4_masked_both(held, 4, group, into.dtype, into),
    }
    checked(cases, list(cases), hqq_codes.dequantize_at_once(held, 4, group, torch.float32), "q4")
    return cases


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--entries", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--compile", action="store_true", help="also time the five passes as one torch.compile "
                        "function (needs a C++ compiler; the first call compiles)")
    args = parser.parse_args()
    if args.head_dim % 128:
        parser.error(f"--head-dim {args.head_dim}: q4's case splits each entry's nibbles into groups of 64, so "
                     "give a multiple of 128")
    torch.manual_seed(0)
    shape = (2, 1, args.heads, args.entries, args.head_dim)
    numbers = 2 * args.heads * args.entries * args.head_dim
    for title, cases in (("fp8 (e4m3)", fp8_cases(shape, args.compile)), ("q4, groups of 64", q4_cases(shape))):
        print(f"{title} decode of {numbers:,} numbers ({args.heads} KV heads x {args.entries} entries x "
              f"{args.head_dim}, keys and values), {torch.get_num_threads()} threads; median ms of {args.repeats}")
        for name, seconds in timed(cases, torch.empty(shape), args.repeats).items():
            print(f"{name:56} {seconds * 1e3:7.2f}")


if __name__ == "__main__":
    main()
