#!/usr/bin/env bash
# Cost and memory at real attention shapes on a GPU, one table: `scale.py`'s streams (8K/32K/128K tokens, every
# policy family, each beside the SDPA baseline), its chunked-prefill compression (32K/128K) and the decode steps of
# `decode_overhead.py` (SmolLM2 and the Llama-3.1-8B shape against DynamicCache), in bf16; peak memory from
# torch.cuda.max_memory_allocated (every arm in one process: the allocator's figure is reset per arm). Sized to
# finish within 10 minutes on one H100 (an estimate until it is run on one; docs/benchmarks.md).
#
# The same script runs on the CPU at smoke sizes (--device cpu: shapes divided by 16, a few hundred tokens),
# which is how the test suite keeps it working (tests/test_gpu_scale.py). Options after the device go to scale.py
# and win over these sizes (e.g. --models llama-3.1-8b, --json out.jsonl).
#
#   bash benchmarks/gpu_scale.sh [--device cuda|cpu] [--python PY] [scale.py options ...]
set -euo pipefail
cd "$(dirname "$0")/.."
DEVICE=cuda
PY=.venv/bin/python
while [ $# -gt 0 ]; do
  case "$1" in
    --device) DEVICE=$2; shift 2 ;;
    --python) PY=$2; shift 2 ;;
    *) break ;;
  esac
done
export PYTHONPATH=$PWD/src:$PWD/benchmarks
case "$DEVICE" in
  cpu)
    SIZES=(--scale 16 --dtype float32 --lengths 640,1024 --budget 256 --chunk 128 --compress-lengths 512
           --prefill-chunk 128 --tbt-max 320 --decode-models llama-3.1-8b --decode-budget 64 --decode-steps 4
           --decode-rounds 1) ;;
  cuda*)
    "$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name(0))" \
      || exit 2
    SIZES=(--dtype bfloat16 --lengths 8192,32768,131072 --budget 4096 --chunk 256 --compress-lengths 32768,131072
           --prefill-chunk 4096 --tbt-max 6144 --decode-budget 4096 --decode-steps 48 --decode-rounds 2) ;;
  *) echo "error: --device takes cpu or cuda[:N], got '$DEVICE'" >&2; exit 2 ;;
esac
exec "$PY" benchmarks/scale.py --device "$DEVICE" --isolate none "${SIZES[@]}" "$@"
