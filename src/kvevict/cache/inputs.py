"""What the model hands the cache, checked: the positions it used, and the errors for inputs the cache refuses."""

from __future__ import annotations

import torch

from ..errors import KvevictError


def attach_error() -> KvevictError:
    return KvevictError(
        "EvictingCache needs kvevict's attention function, but the model ran another one: "
        "call kvevict.attach(model) (or model.set_attn_implementation('kvevict'))"
    )


def model_positions(
    kwargs: dict, q: int, default_start: int, device: torch.device, check_rows: bool = True
) -> torch.Tensor:
    """The positions the model rotated this forward's tokens with, `[q]`.

    transformers passes `position_ids` down to the attention layer; rows that disagree
    mean a padded batch, which the cache cannot bound correctly.
    """
    position_ids = kwargs.get("position_ids")
    if position_ids is None:
        return torch.arange(default_start, default_start + q, device=device)
    position_ids = position_ids.reshape(-1, position_ids.shape[-1])
    if check_rows and position_ids.shape[0] > 1 and not bool((position_ids == position_ids[:1]).all()):
        raise padded_batch_error()
    return position_ids[0, -q:].to(device)


def padded_batch_error() -> KvevictError:
    return KvevictError(
        "padded batches are not supported: every row must be a full sequence of the same length "
        "(drop the attention_mask padding, or run rows of different lengths as separate batches)"
    )
