"""A faster parse of a GGUF file's metadata, for the first load of a GGUF model.

transformers reads a GGUF file through `gguf.GGUFReader`, three times for a model's
first load (the tokenizer, the config, the weights). The reader slices its numpy
memmap once per element of every metadata array, and a tokenizer's arrays are long
(Gemma 3: 262,144 tokens, scores and types), so memmap's Python-level slicing hooks
(`__getitem__`, `__array_finalize__`) are most of the load: 12.3 s per parse of the
embedded Gemma 3 here, 3.8 s of SmolLM2. `PlainReader` is the same parse over a plain
ndarray view of the same map: 3.2 s and 0.8 s, every field and tensor identical
(`tests/test_gguf_reader.py` holds it to `gguf.GGUFReader` on a file written there).

`plain_reader()` lends it to transformers for one load: transformers looks the class
up on the `gguf` module each time it reads a file, so it is swapped there and put back
after, and a file read twice in the block is parsed once (its map is read-only). Two
loads in two threads at once may see either reader; both parse the same.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import gguf
import numpy as np


class PlainReader(gguf.GGUFReader):
    """`gguf.GGUFReader` whose element reads slice a plain ndarray view of its memmap."""

    def _get(self, offset: int, dtype, count: int = 1, override_order=None) -> np.ndarray:
        plain = self.__dict__.get("_plain")
        if plain is None:  # the parse runs inside GGUFReader.__init__, right after the map is opened
            plain = self.__dict__["_plain"] = self.data.view(np.ndarray)
        count = int(count)
        end = offset + np.dtype(dtype).itemsize * count
        values = plain[offset:end].view(dtype=dtype)[:count]
        return values.view(values.dtype.newbyteorder(self.byte_order if override_order is None else override_order))


@contextmanager
def plain_reader() -> Iterator[None]:
    """transformers' GGUF loads inside this block parse with `PlainReader`, each file once: a read-only
    parse is handed back to every later read of the same file in the block (the config, then the weights)."""
    original = gguf.GGUFReader
    parsed: dict[tuple[str, str], PlainReader] = {}

    def read(path, mode: str = "r") -> PlainReader:
        key = (str(path), mode)
        if key not in parsed or mode != "r":
            parsed[key] = PlainReader(path, mode)
        return parsed[key]

    gguf.GGUFReader = read
    try:
        yield
    finally:
        gguf.GGUFReader = original
