"""tools/isa_check.py, the portability gate of the llama.cpp builds, on objects compiled here for one ISA each.

The expected answer is the compiler's: code built from AVX-512 or AMX intrinsics must be flagged, and the same
kind of loop built for AVX2 must pass. AVX-512VL on ymm registers is the case a register-name test misses.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(not (shutil.which("gcc") and shutil.which("objdump")), reason="needs gcc and objdump")

SOURCES = {
    "avx2": ("-mavx2", "_mm256_storeu_ps(a, _mm256_add_ps(_mm256_loadu_ps(a), _mm256_loadu_ps(b)));"),
    "avx512f": ("-mavx512f", "_mm512_storeu_ps(a, _mm512_add_ps(_mm512_loadu_ps(a), _mm512_loadu_ps(b)));"),
    "avx512vl_ymm": ("-mavx512vl", "__m256i x = _mm256_loadu_si256((const __m256i *) b); "
                     "_mm256_storeu_si256((__m256i *) a, _mm256_ternarylogic_epi32(x, x, x, 0x96));"),
    "amx": ("-mamx-tile", "_tile_release();"),
}


def _object(tmp_path: Path, name: str) -> Path:
    flag, body = SOURCES[name]
    source = tmp_path / f"{name}.c"
    source.write_text("#include <immintrin.h>\nvoid f(float *a, const float *b) { " + body + " }\n")
    out = tmp_path / f"{name}.o"
    subprocess.run(["gcc", "-O2", flag, "-c", str(source), "-o", str(out)], check=True)
    return out


def _run(*paths: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "tools" / "isa_check.py"), *map(str, paths)],
                          capture_output=True, text=True)


def test_avx2_object_passes(tmp_path):
    found = _run(_object(tmp_path, "avx2"))
    assert found.returncode == 0, found.stdout


@pytest.mark.parametrize("name,kind", [("avx512f", "avx512"), ("avx512vl_ymm", "avx512"), ("amx", "amx")])
def test_beyond_baseline_is_flagged(tmp_path, name, kind):
    found = _run(_object(tmp_path, name))
    assert found.returncode == 1
    assert f"{kind}: " in found.stdout


def test_missing_path_is_one_line_exit_2(tmp_path):
    found = _run(tmp_path / "absent")
    assert found.returncode == 2 and "build it first" in found.stderr
