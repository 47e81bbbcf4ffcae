"""Loading a causal LM + tokenizer, and refusing models kvevict cannot bound.

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

from .errors import KvevictError
from .gguf import EMBEDDED, cache_root, embedded_gguf, load_gguf, load_gguf_tokenizer, package_dir

# re-exported: data.py finds its text package the same way
__all__ = ["EMBEDDED", "cache_root", "check_model", "load_model", "load_tokenizer", "package_dir", "text_config"]


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


def load_tokenizer(name: str = "smollm2-135m", allow_download: bool = False):
    """Just the tokenizer (cheap): for validating inputs before loading weights.

    Offline unless `allow_download`: see the module docstring for why.
    """
    from transformers import AutoTokenizer

    local = _gguf_path(name)
    if name in EMBEDDED or local is not None:
        gguf = local or embedded_gguf(name)
        with _offline():
            return load_gguf_tokenizer(_label(name, gguf), gguf)
    source, offline = _source(name, allow_download)
    try:
        with _offline(offline):
            return AutoTokenizer.from_pretrained(source, local_files_only=offline)
    except (OSError, ValueError) as exc:
        raise _load_error(name, exc, allow_download) from None


def load_model(name: str = "smollm2-135m", device: str = "cpu", allow_download: bool = False):
    """(model, tokenizer) for the embedded name, a local directory or an HF model id.

    An HF id is read from the local cache only, unless `allow_download=True`: a name
    that is not there fails at once with a `KvevictError` instead of retrying the network.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

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
                model = AutoModelForCausalLM.from_pretrained(source, local_files_only=offline, dtype=torch.float32)
        except (OSError, ValueError) as exc:
            raise _load_error(name, exc, allow_download) from None
    model.to(device).eval()
    check_model(model)
    return model, tokenizer


def check_model(model):
    """The config of `model` if kvevict can bound its cache; a KvevictError naming the fix otherwise."""
    config = getattr(model, "config", None)
    if config is None:
        raise KvevictError("not a transformers model: pass a model from AutoModelForCausalLM / kvevict.load_model")
    if getattr(config, "is_encoder_decoder", False):
        raise KvevictError(
            f"{type(model).__name__} is an encoder-decoder (its cross-attention cache is not a stream): {_SUPPORTED}"
        )
    text = text_config(config)
    layer_kinds(text, type(model).__name__)
    if not getattr(model, "_supports_attention_backend", False):
        raise KvevictError(
            f"{type(model).__name__} does not route attention through transformers' AttentionInterface "
            f"(state-space models, older architectures), so kvevict cannot attach to it: {_SUPPORTED}"
        )
    if getattr(text, "attn_logit_softcapping", None) is not None:
        raise KvevictError(
            f"{type(model).__name__} soft-caps its attention logits (attn_logit_softcapping="
            f"{text.attn_logit_softcapping}), which kvevict's attention does not implement: {_SUPPORTED}"
        )
    return config


#: the architectures the test matrix covers (tests/test_architectures.py), named in refusals
_SUPPORTED = (
    "kvevict supports decoder-only causal LMs whose attention goes through AttentionInterface "
    "(Llama, Mistral, Qwen2/3, Gemma 3, Phi-3, GPT-NeoX, GPT-2, OPT)"
)
#: kinds of layers kvevict has a layer class for (cache.LAYER_KINDS); the rest hold no KV cache to bound
ATTENTION_KINDS = ("full_attention", "sliding_attention")


def layer_kinds(text, name: str = "this model") -> list[str]:
    """The kind of each layer (`config.layer_types`; a model-wide `sliding_window` makes
    every layer sliding), or a KvevictError for kinds no budget can bound."""
    layers = text.num_hidden_layers
    kinds = getattr(text, "layer_types", None)
    if not kinds:
        kinds = ["sliding_attention" if getattr(text, "sliding_window", None) else "full_attention"] * layers
    other = sorted(set(kinds) - set(ATTENTION_KINDS))
    if other:
        raise KvevictError(
            f"{name} has {', '.join(other)} layers (state-space or linear attention keep a fixed-size state, "
            f"not a KV cache), so no budget can bound them: {_SUPPORTED}"
        )
    if "full_attention" not in kinds:
        raise KvevictError(
            f"every layer of {name} is sliding-window (window {text.sliding_window}), so a budget would bound "
            "nothing: set config.sliding_window=None to run it with full attention, or use a model with "
            "full-attention layers"
        )
    return list(kinds)


def text_config(model_or_config):
    """The decoder's text config of a model or a config.

    Multimodal configs nest the language model's settings (layer count, heads, context
    length) in a sub-config; plain decoder configs are their own text config. Every
    reader of those settings goes through here so that the two cases are told apart once.
    """
    config = model_or_config if hasattr(model_or_config, "get_text_config") else getattr(
        model_or_config, "config", model_or_config
    )
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
