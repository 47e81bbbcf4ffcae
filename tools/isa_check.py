"""Refuse a native binary that carries AVX-512 or AMX instructions: the check behind `make llama-server`'s portability.

A build for the building CPU (llama.cpp's default `GGML_NATIVE=ON`) runs only on CPUs like it; on a VM that
advertises AVX-512 or AMX without letting a process use them it dies with "Illegal instruction" at model load.
The Makefile builds llama.cpp for a stated baseline (x86-64-v3: AVX2, FMA, F16C, BMI2), and this tool proves
the result, instruction by instruction, from `objdump -d`:

* AVX-512 is every EVEX-encoded instruction: in 64-bit mode the byte 0x62 after the legacy prefixes opens an
  EVEX prefix and nothing else (it was BOUND in 32-bit mode), so a 0x62 first opcode byte is AVX-512 whatever
  registers it names (AVX-512VL on xmm/ymm registers included);
* AMX is a tile instruction (`ldtilecfg`, `tileloadd`, `tdpbssd`, ...: VEX-encoded, so named by mnemonic).

Usage: `python tools/isa_check.py FILE_OR_FOLDER ...` (a folder: every `*.so*` file in it). Exit 0 when clean,
1 naming the first offending instructions, 2 when objdump is missing or a path does not exist.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

#: legacy prefixes (operand/address size, segment overrides, rep) that may come before an opcode or EVEX prefix
LEGACY_PREFIXES = {0x66, 0x67, 0xF2, 0xF3, 0x2E, 0x3E, 0x26, 0x36, 0x64, 0x65}
AMX = re.compile(r"^(ldtilecfg|sttilecfg|tileloadd|tileloaddt1|tilestored|tilerelease|tilezero|tdp\w+)\b")
# objdump -d lines: "  4011d6:\t62 f1 7c 48 58 c1 \tvaddps %zmm1,%zmm0,%zmm0"
LINE = re.compile(r"^\s*[0-9a-f]+:\t([0-9a-f ]+)\t(\S.*)$")


def offending(line: str) -> str | None:
    """The kind of forbidden instruction on one line of `objdump -d` ('avx512', 'amx'), or None."""
    found = LINE.match(line)
    if not found:
        return None
    code = [int(b, 16) for b in found.group(1).split()]
    mnemonic = found.group(2).strip()
    if AMX.match(mnemonic):
        return "amx"
    rest = list(code)
    while rest and rest[0] in LEGACY_PREFIXES:
        rest.pop(0)
    return "avx512" if rest and rest[0] == 0x62 and not mnemonic.startswith("(bad)") else None


def check(path: Path) -> list[str]:
    """The offending instructions of one file, as 'kind: objdump line' (at most 5 listed; empty when clean)."""
    listing = subprocess.run(["objdump", "-d", str(path)], capture_output=True, text=True, check=True).stdout
    bad = []
    for line in listing.splitlines():
        kind = offending(line)
        if kind:
            bad.append(f"{kind}: {line.strip()}")
            if len(bad) == 5:
                break
    return bad


def targets(paths: list[str]) -> list[Path]:
    out = []
    for name in paths:
        path = Path(name)
        if not path.exists():
            raise FileNotFoundError(name)
        out += sorted(p for p in path.glob("*.so*") if p.is_file()) if path.is_dir() else [path]
    return out


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: isa_check.py FILE_OR_FOLDER ...", file=sys.stderr)
        return 2
    if shutil.which("objdump") is None:
        print("isa_check: objdump is missing: install binutils", file=sys.stderr)
        return 2
    try:
        files = targets(argv)
    except FileNotFoundError as exc:
        print(f"isa_check: {exc} does not exist: build it first", file=sys.stderr)
        return 2
    status = 0
    for path in files:
        bad = check(path)
        if bad:
            status = 1
            print(f"{path}: carries instructions beyond x86-64-v3 (rebuild with the Makefile's GGML_PORTABLE):")
            for line in bad:
                print(f"  {line}")
        else:
            print(f"{path}: no AVX-512 or AMX instruction")
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
