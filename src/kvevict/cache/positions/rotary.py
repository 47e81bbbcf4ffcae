"""RoPE at any position, from the model's own rotary module (position-shift mode).

StreamingLLM re-numbers kept entries 0..L-1. Rotating an already-rotated key by the
difference of positions, step after step, accumulates floating-point error; instead the
cache keeps every key un-rotated and rotates it from scratch to its current slot. The
cos/sin come from the model's own rotary module, so scaled RoPE variants (linear,
llama3, yarn with its attention factor) stay exactly what the model would compute.

Partial rotary (GPT-NeoX / Pythia, Phi: the module's cos/sin cover only the first
`rot` of the `D` dimensions) rotates those and leaves the rest as they are, as the
models do. A model whose rotary module serves several layer kinds (Gemma 3: a local
and a global base) gets one `Rotary` per kind (`layer_type`).
"""

from __future__ import annotations

import torch
from torch import nn


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotation(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`x` `[..., D]` rotated by cos/sin `[..., rot]`, `rot <= D`: only the first `rot` dimensions turn."""
    rot = cos.shape[-1]
    if rot == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    head = x[..., :rot]
    return torch.cat((head * cos + rotate_half(head) * sin, x[..., rot:]), dim=-1)


def undo_rotation(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, scale: float) -> torch.Tensor:
    """The inverse of `apply_rotation` when the module multiplied cos and sin by `scale`."""
    rot = cos.shape[-1]
    head = x[..., :rot]
    head = (head * cos - rotate_half(head) * sin) / (scale * scale)
    return head if rot == x.shape[-1] else torch.cat((head, x[..., rot:]), dim=-1)


class Rotary:
    """cos/sin lookup at arbitrary positions, with a table for the small ones."""

    def __init__(
        self,
        rotary_emb: nn.Module,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        layer_type: str | None = None,
    ) -> None:
        self.module = rotary_emb
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = device
        self.layer_type = layer_type
        # The module multiplies cos and sin by this factor; undoing a rotation must
        # divide it out twice (once for the forward rotation, once for the inverse).
        scale = getattr(rotary_emb, f"{layer_type}_attention_scaling", None) if layer_type else None
        self.scale = float(scale if scale is not None else getattr(rotary_emb, "attention_scaling", 1.0))
        self._cos, self._sin = self._compute(torch.arange(1, device=device))

    @torch.no_grad()
    def _compute(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin `[m, rot]` at `positions` `[m]`, from the model's module (`rot < D`: partial rotary)."""
        probe = torch.empty(1, 1, self.head_dim, dtype=self.dtype, device=self.device)
        at = positions.reshape(1, -1).to(self.device)
        cos, sin = self.module(probe, at, self.layer_type) if self.layer_type else self.module(probe, at)
        return cos[0].to(self.dtype), sin[0].to(self.dtype)

    def table(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin for positions 0..length-1, `[length, D]`, grown on demand."""
        if length > self._cos.shape[0]:
            grown = max(length, 2 * self._cos.shape[0], 64)
            self._cos, self._sin = self._compute(torch.arange(grown, device=self.device))
        return self._cos[:length], self._sin[:length]

    def at(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin for any positions of shape `[..., m]` -> `[..., m, D]` (table lookups:
        calling the rotary module per layer and step costs more than the attention)."""
        flat = positions.reshape(-1)
        cos, sin = self.table(int(flat.max()) + 1 if flat.numel() else 0)
        shape = (*positions.shape, cos.shape[-1])
        return cos[flat].reshape(shape), sin[flat].reshape(shape)

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return apply_rotation(x, cos, sin)

    def unrotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return undo_rotation(x, cos, sin, self.scale)

    def move(self, x: torch.Tensor, used: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """`x` `[..., m, D]` rotated at positions `used` `[m]`, re-rotated to `target` `[m]`.

        Undone and redone from scratch rather than rotated by the difference, so moving a
        vector many times never accumulates error.
        """
        raw = self.unrotate(x, *self.at(used))
        return self.rotate(raw, *self.at(target))
