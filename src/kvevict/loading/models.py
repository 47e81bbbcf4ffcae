"""Loading a causal LM + tokenizer by name; `cache.model_info.check_model` refuses what kvevict cannot bound.

The embedded models (`smollm2-135m`, the default, and `gemma3-270m`) and any local
`.gguf` file are read and dequantised by `gguf.py`, which caches the float32 result.

Any other name is a local model folder or a Hugging Face id, resolved offline by
default: local folders and the local HF cache only, so a mistyped name fails at once
with one line instead of retrying the network for most of a minute. Downloading is an
explicit opt-in (`allow_download=True`, the CLI's `--allow-download`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from ..cache.model_info import check_model
from ..errors import KvevictError
from .dtypes import DTYPES, cast_weights, dtype_name, resolve_dtype
from .gguf import EMBEDDED, embedded_gguf, load_gguf, load_gguf_config, load_gguf_tokenizer

#: what a user can pass instead of a name that did not resolve (ends every loading error)
_CHOICES = (
    "use 'smollm2-135m' or 'gemma3-270m', a local model directory, a .gguf file, or an HF id already in the "
    "local cache"
)
_DOWNLOAD = "or allow downloading it (--allow-download; load_model(..., allow_download=True))"


@contextmanager
def _offline(offline: bool = True) -> Iterator[None]:
    """Keep huggingface_hub off the network while loading, unless downloading was allowed.

    `local_files_only=True` alone is not enough: building request headers can still
    fetch a registry from the Hub. `HF_HUB_OFFLINE` stops every request, but the hub
    reads that variable once, at import; its module constant is what it checks at call
    time, so that is what is switched here, and put back afterwards.
    """
    if not offline:
        yield
        return
    from huggingface_hub import constants

    before = constants.HF_HUB_OFFLINE
    constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        constants.HF_HUB_OFFLINE = before


def _source(name: str, allow_download: bool) -> tuple[str, bool]:
    """What to hand `from_pretrained` for `name`, and whether it must stay offline.

    A name that looks like a path (it exists, starts with '.', '~' or '/', holds a
    backslash or more than one '/') is a local folder: a missing one is a typo, never an
    HF id, so it fails here in one line. Anything else is an HF id (`org/name`), read
    from the local cache unless downloading was allowed.
    """
    path = Path(name).expanduser()
    if path.exists():
        return str(path), True
    if name.startswith((".", "~", "/")) or "\\" in name or name.count("/") > 1:
        raise KvevictError(f"cannot load model '{name}' (no such folder): {_CHOICES}")
    return name, not allow_download


def _load_error(name: str, exc: Exception, allow_download: bool) -> KvevictError:
    # OSError is transformers' "files not found"; a ValueError (say, an unknown architecture)
    # comes from a model that was found, and its own first line says more than ours would.
    if isinstance(exc, OSError) and not allow_download and not Path(name).expanduser().exists():
        return KvevictError(
            f"cannot load model '{name}' (not a local folder, and not in the local Hugging Face cache): "
            f"{_CHOICES}, {_DOWNLOAD}"
        )
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return KvevictError(f"cannot load model '{name}' ({first}): {_CHOICES}")


def _gguf_path(name: str) -> Path | None:
    """`name` as a local GGUF file, or None; a `.gguf` name that is not a file is a typo."""
    if not name.lower().endswith(".gguf"):
        return None
    path = Path(name).expanduser()
    if not path.is_file():
        raise KvevictError(f"cannot load model '{name}' (no such .gguf file): {_CHOICES}")
    return path.resolve()


def _label(name: str, gguf: Path) -> str:
    """The cache folder's prefix: the embedded name, or the GGUF file's stem."""
    return name if name in EMBEDDED else gguf.stem


def _read_small(name: str, allow_download: bool, from_gguf, auto_class):
    """What loads without the weights (a tokenizer, a config): `from_gguf(label, path)` for an embedded name or
    a `.gguf` file, else `auto_class.from_pretrained`, offline unless `allow_download`; one error line either way."""
    local = _gguf_path(name)
    if name in EMBEDDED or local is not None:
        gguf = local or embedded_gguf(name)
        with _offline():
            return from_gguf(_label(name, gguf), gguf)
    source, offline = _source(name, allow_download)
    try:
        with _offline(offline):
            return auto_class.from_pretrained(source, local_files_only=offline)
    except (OSError, ValueError) as exc:
        raise _load_error(name, exc, allow_download) from None


def load_tokenizer(name: str = "smollm2-135m", allow_download: bool = False):
    """Just the tokenizer (cheap): for validating inputs before loading weights.

    Offline unless `allow_download`: see the module docstring for why.
    """
    from transformers import AutoTokenizer

    return _read_small(name, allow_download, load_gguf_tokenizer, AutoTokenizer)


def load_config(name: str = "smollm2-135m", allow_download: bool = False):
    """Just the model's config (cheap): what a sweep decides before the weights load (is it hybrid?)."""
    from transformers import AutoConfig

    return _read_small(name, allow_download, load_gguf_config, AutoConfig)


def checkpoint_dtype(name: str, allow_download: bool = False) -> str | None:
    """The dtype the checkpoint `name` is stored in, as its config names it (None: it names none, or one
    outside `DTYPES`); a GGUF file (an embedded model too) is dequantised to float32, so it is float32."""
    if name in EMBEDDED or _gguf_path(name) is not None:
        return "float32"
    config = load_config(name, allow_download)
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    return dtype_name(getattr(text, "dtype", None) or getattr(config, "dtype", None))


def model_dtype(name: str, dtype: str | None = None, device: str = "cpu", allow_download: bool = False) -> str:
    """The dtype `load_model(name, device, dtype=dtype)` loads in (see `dtypes.resolve_dtype`): known before
    the weights load, so a run folder can pin it. Reads the checkpoint's config only when it decides."""
    if dtype is None and torch.device(device).type != "cpu":
        return resolve_dtype(None, device, checkpoint_dtype(name, allow_download))
    return resolve_dtype(dtype, device, None)


def load_model(
    name: str = "smollm2-135m", device: str = "cpu", allow_download: bool = False, dtype: str | None = None
):
    """(model, tokenizer) for the embedded name, a local directory or an HF model id.

    An HF id is read from the local cache only, unless `allow_download=True`: a name
    that is not there fails at once with a `KvevictError` instead of retrying the network.
    `dtype` (`float32`, `bfloat16`, `float16`; None: `model_dtype`'s default, float32 on the CPU,
    the checkpoint's own on a GPU) is what the weights, and so the KV cache, are held in. A GGUF
    model is cast from its cached float32 copy (one cache for every dtype).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    chosen = DTYPES[model_dtype(name, dtype, device, allow_download)]
    local = _gguf_path(name)
    if name in EMBEDDED or local is not None:
        gguf = local or embedded_gguf(name)
        with _offline():
            model, tokenizer = load_gguf(_label(name, gguf), gguf)
    else:
        # Loading a local directory is instant: its progress bar would only clutter stderr.
        hf_logging.disable_progress_bar()
        source, offline = _source(name, allow_download)
        try:
            with _offline(offline):
                tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=offline)
                model = AutoModelForCausalLM.from_pretrained(source, local_files_only=offline, dtype=chosen)
        except (OSError, ValueError) as exc:
            raise _load_error(name, exc, allow_download) from None
    cast_weights(model, chosen).to(device).eval()
    check_model(model)
    return model, tokenizer
