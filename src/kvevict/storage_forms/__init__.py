"""KV storage forms: how a cache holds each kept entry, one file each, registered here by spec family.

A spec's storage prefix is `<family><number>[:options]+<policy>`: `q4+h2o` (`integer.KvQuant`, 4-bit
codes), `fp8:scale=head+window` (`fp8.Fp8`), llama.cpp's `q8_0+full` (`ggml.GgmlBlocks`, family `q_0`: a variant
after the number joins the family word), `vllmfp8+full` (`vllm_fp8.VllmFp8`, vLLM's own fp8 rule). The family
names the class; the number is its first field (the width); the options are its other fields, read off its
constructor like a policy's. A new form is one file holding a `StorageForm` subclass and one line in `FORMS`;
the cache's storage (`cache/storage/quantized.py`) drives every form through `StorageForm`'s codec.
"""

from __future__ import annotations

from .base import StorageForm
from .fp8 import Fp8
from .ggml import GgmlBlocks, GgmlFloat
from .integer import KvQuant
from .vllm_fp8 import VllmFp8

#: spec family -> form class (the number after the family is the class's first field)
FORMS: dict[str, type[StorageForm]] = {
    "q": KvQuant,
    "fp": Fp8,
    "q_0": GgmlBlocks,  # llama.cpp's q8_0, q4_0
    "f": GgmlFloat,  # llama.cpp's f16, f32
    "vllmfp": VllmFp8,
}

__all__ = ["FORMS", "Fp8", "GgmlBlocks", "GgmlFloat", "KvQuant", "StorageForm", "VllmFp8"]
