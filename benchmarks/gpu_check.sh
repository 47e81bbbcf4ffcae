#!/usr/bin/env bash
# The engine on CUDA: the three benchmarks with --device cuda, one table at the end.
# Not run yet: no GPU machine was lent to issue 22 (see docs/benchmarks.md). The test suite
# builds its tiny models on the CPU and has no device switch, so the exactness matrix runs
# here on the CPU beside the CUDA benchmarks (what it proves about CUDA is nothing).
#
#   bash benchmarks/gpu_check.sh [python]   (default: .venv/bin/python)
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${1:-.venv/bin/python}
export PYTHONPATH=$PWD/src:$PWD/benchmarks
OUT=$(mktemp -d)
"$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name(0))" || exit 2
"$PY" -m pytest -q -p no:cacheprovider -m "not model and not browser" tests/test_cache_exact.py \
  tests/test_chunked_exact.py tests/test_adakv.py tests/test_memory_fit.py > "$OUT/tests.txt" 2>&1
echo "tests (cpu): $(tail -1 "$OUT/tests.txt")"
"$PY" benchmarks/decode_overhead.py --device cuda --budget 512 --steps 48 --rounds 2 > "$OUT/decode.txt" 2>&1
"$PY" benchmarks/chunked_vs_stepwise.py --device cuda --tokens 2000 --budget 256 --single "" > "$OUT/chunked.txt" 2>&1
"$PY" benchmarks/compress_memory.py --device cuda --tokens 2048 --budget 512 > "$OUT/memory.txt" 2>&1
for name in decode chunked memory; do
  echo "== $name (benchmarks/*.py --device cuda; exit status in the last line if it failed)"
  tail -15 "$OUT/$name.txt"
done
