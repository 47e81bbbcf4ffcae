"""The context of the kvpress parity check: the first 2,048 tokens of pg-essays under SmolLM2's tokenizer,
written as `.npy` for `tools/kvpress_dump.py` (which runs without kvevict). Loading the model here also
leaves its dequantised folder in kvevict's cache, where the dump reads it: its path is printed.

    .venv/bin/python tools/kvpress_ids.py OUT.npy
"""

from __future__ import annotations

import sys

import numpy as np

from kvevict.data import load_tokens
from kvevict.loading.gguf import converted_dir, embedded_gguf
from kvevict.loading.models import load_model

TOKENS = 2048


def main() -> None:
    _, tokenizer = load_model("smollm2-135m")
    ids, _ = load_tokens("pg-essays", tokenizer, TOKENS)
    np.save(sys.argv[1], ids.numpy().astype(np.int32))
    print(converted_dir("smollm2-135m", embedded_gguf("smollm2-135m")))


if __name__ == "__main__":
    main()
