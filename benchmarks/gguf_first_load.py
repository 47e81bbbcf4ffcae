"""The first load of an embedded GGUF model: transformers' parse with `PlainReader` vs gguf's own reader.

A first load reads the GGUF file three times (tokenizer, config, weights), dequantises it
and caches float32 safetensors (`loading/gguf.py`); a fresh machine (CI, a user's first
`make demo`) pays it once per model. Both arms run in this process, taking turns, each
into an empty cache folder of its own, `--rounds` times per model:

    .venv/bin/python benchmarks/gguf_first_load.py --rounds 2
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import tempfile
import time

import kvevict.loading.gguf as gguf_loading
from kvevict import load_model


def first_load(name: str, plain: bool, folder: str) -> float:
    """Seconds to load `name` into an empty cache under `folder`, with or without the plain parse."""
    shutil.rmtree(folder, ignore_errors=True)
    os.environ["KVEVICT_CACHE"] = folder
    lend = gguf_loading.plain_reader
    if not plain:
        gguf_loading.plain_reader = contextlib.nullcontext  # gguf's memmap reader, as transformers uses it
    try:
        start = time.perf_counter()
        load_model(name)
        return time.perf_counter() - start
    finally:
        gguf_loading.plain_reader = lend


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--models", default="smollm2-135m,gemma3-270m")
    args = parser.parse_args()
    root = tempfile.mkdtemp(prefix="kvevict-first-load-")
    print("| model | memmap reader (s) | plain reader (s) | ratio |")
    print("|---|---|---|---|")
    for name in args.models.split(","):
        times: dict[bool, list[float]] = {True: [], False: []}
        for _ in range(args.rounds):
            for plain in (True, False):
                times[plain].append(first_load(name, plain, os.path.join(root, "plain" if plain else "memmap")))
        slow, fast = statistics.median(times[False]), statistics.median(times[True])
        print(f"| {name} | {slow:.1f} ({', '.join(f'{t:.1f}' for t in times[False])}) "
              f"| {fast:.1f} ({', '.join(f'{t:.1f}' for t in times[True])}) | {slow / fast:.2f}x |")
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
