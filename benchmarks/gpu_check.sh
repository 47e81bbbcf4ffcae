#!/usr/bin/env bash
# The engine on CUDA: the CLI and the three benchmarks with --device cuda, one table at the end.
# Not run on a GPU yet (docs/benchmarks.md, "Not measured"). The test suite builds
# its tiny models on the CPU and has no device switch, so the exactness tests below run on the CPU
# beside the CUDA runs (they prove the engine's numbers, not that CUDA gives the same ones); the CLI
# run and the benchmarks are what exercise the CUDA paths (tensors, generators and meters on the device).
#
#   bash benchmarks/gpu_check.sh [python]   (default: .venv/bin/python; about 5 minutes on one GPU)
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${1:-.venv/bin/python}
export PYTHONPATH=$PWD/src:$PWD/benchmarks
OUT=$(mktemp -d)
"$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name(0))" || exit 2
"$PY" -m pytest -q -p no:cacheprovider -m "not model and not browser" tests/test_cache_exact.py \
  tests/test_chunked_exact.py tests/test_policy_contract.py tests/test_new_policies.py tests/test_adakv.py \
  tests/test_memory_fit.py tests/test_device_option.py > "$OUT/tests.txt" 2>&1
echo "tests (cpu): $(tail -1 "$OUT/tests.txt")"
# the CLI's own path onto the device: one short stream per position mode, an attention-driven policy
for positions in original cache; do
  "$PY" -m kvevict.cli ppl --device cuda --tokens 600 --budget 128 --policy h2o --positions "$positions" --json \
    > "$OUT/cli-$positions.txt" 2>&1
  echo "cli ppl --device cuda ($positions): exit $? $(tail -c 300 "$OUT/cli-$positions.txt" | tail -1)"
done
"$PY" benchmarks/decode_overhead.py --device cuda --budget 512 --steps 48 --rounds 2 > "$OUT/decode.txt" 2>&1
"$PY" benchmarks/chunked_vs_stepwise.py --device cuda --tokens 2000 --budget 256 --single "" > "$OUT/chunked.txt" 2>&1
"$PY" benchmarks/compress_memory.py --device cuda --tokens 2048 --budget 512 > "$OUT/memory.txt" 2>&1
for name in decode chunked memory; do
  echo "== $name (benchmarks/*.py --device cuda: its table, or the traceback it ended with)"
  tail -15 "$OUT/$name.txt"
done
