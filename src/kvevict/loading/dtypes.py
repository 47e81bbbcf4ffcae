"""The floating dtypes a model is measured in: their names, the check, and the default per device.

A deployment serves in bf16 or fp16 and holds its KV cache in the same dtype, so the
dtype is part of what a figure was measured on: the cache stores keys and values in
whatever dtype the model hands it, and `kv_bytes` counts that dtype's bytes.

The default is float32 on the CPU (where bf16 is rounding, not a saving worth its noise,
and fp16 has no fast kernels: a 512x512 matmul took 0.10 s in float16 against 0.0017 s in
float32 and 0.0007 s in bfloat16, torch 2.13 on x86), and the checkpoint's own dtype on a
GPU (what `config.json` names; a GGUF file, dequantised by transformers, is float32).
"""

from __future__ import annotations

import torch

from ..errors import KvevictError

#: the dtypes a model can be loaded in, by the name the CLI and `load_model` take
DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def check_dtype(dtype: str | None) -> str | None:
    """`dtype` as given (None: the device's default, see `resolve_dtype`) once it is a name of `DTYPES`."""
    if dtype is None or dtype in DTYPES:
        return dtype
    raise KvevictError(f"--dtype must be one of {', '.join(DTYPES)} (or left out: float32 on cpu, the "
                       f"checkpoint's own on cuda), got '{dtype}'")


def dtype_name(dtype: torch.dtype | str | None) -> str | None:
    """The `DTYPES` name of a torch dtype or of a config's spelling of one (`"bfloat16"`, `torch.float16`);
    None for anything else (a checkpoint that names no dtype, or one outside `DTYPES`)."""
    if isinstance(dtype, torch.dtype):
        return next((name for name, value in DTYPES.items() if value == dtype), None)
    if isinstance(dtype, str):
        name = dtype.removeprefix("torch.")
        return name if name in DTYPES else None
    return None


def resolve_dtype(dtype: str | None, device: str, checkpoint: str | None) -> str:
    """The dtype a model is loaded in: `dtype` when given; otherwise float32 on the CPU and
    `checkpoint` (the checkpoint's own dtype, None when it names none) on a GPU."""
    check_dtype(dtype)
    if dtype is not None:
        return dtype
    if torch.device(device).type == "cpu" or checkpoint is None:
        return "float32"
    return checkpoint


def cast_weights(model, dtype: torch.dtype):
    """`model` with its floating parameters in `dtype` and its buffers as they were built.

    Not `model.to(dtype)`: that casts buffers too, and RoPE's `inv_freq` (float32, and
    used in float32 by the rotary forward) rounded to bf16 moves every rotation angle
    (frequency 0.6978 becomes 0.6992 in SmolLM2's second pair). This leaves the model as
    `from_pretrained(..., dtype=dtype)` builds it: parameters cast, `inv_freq` float32.
    """
    for module in model.modules():
        for param in module.parameters(recurse=False):
            if param.is_floating_point() and param.dtype != dtype:
                param.data = param.data.to(dtype)
    model.config.dtype = dtype
    return model
