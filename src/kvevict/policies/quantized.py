"""`qB+P`, `fp8+P`: policy P, its kept entries held in a storage form. A storage request, not a policy.

Quantization changes how each kept entry is stored, never which entries are kept, so it is a
wrapper that is its inner policy in every declaration and every hook (by the wrapper's one rule,
`wrapper.py`; nothing is forwarded here by hand) and adds one declaration: `kv_storage`,
the `StorageForm` (`storage_forms/`) the cache reads to give its layers that storage
(`cache/storage/quantized.py`). Which tokens stay is the inner policy's decision, made on what attention
actually reads (the dequantized keys).

Spec: `q4+sink4+h2o`, `q8+full`, `fp8+h2o`, with options after the width: `q4:group=64,residual=32+snapkv`.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import KvevictError
from ..storage_forms import KvQuant, StorageForm
from .base import Policy
from .capabilities import Capabilities, with_fields
from .wrapper import Wrapper

__all__ = ["KvQuant", "Quantized"]


@dataclass(eq=False)
class Quantized(Wrapper):
    """Policy `inner`, every entry it keeps held as `storage` asks."""

    storage: StorageForm
    inner: Policy

    def __post_init__(self) -> None:
        if self.inner.kv_storage is not None:
            raise KvevictError(f"'{self.spec()}' quantizes twice: write one storage prefix (qN+, fp8+), e.g. "
                               f"{self.storage.prefix()}+<policy>")
        if self.inner.varies_by_head:
            raise KvevictError(
                f"'{self.spec()}': per-head layers (adakv) hold ragged segments that have no quantized storage form "
                f"yet: run {self.inner.spec()} unquantized, or quantize a uniform policy (e.g. q4+snapkv)"
            )

    def wrap(self, inner: Capabilities) -> Capabilities:
        """A storage form changes nothing about which entries stay: every declaration is the inner policy's,
        its own rule's (`wrapper.RULE`) included; it adds how entries are held (`kv_storage`). Every hook is the
        inner policy's too (`Wrapper`): it defines none."""
        return with_fields(inner, kv_storage=self.storage)

    def spec(self) -> str:
        return f"{self.storage.prefix()}+{self.inner.spec()}"
