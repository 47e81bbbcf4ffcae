"""The per-head layer's attention where every head holds the same run of entries: SDPA over its segments.

A prefill into ragged storage, a held-back one and KVzip's repeat forwards over it leave every KV head with the
same number of entries, the first slots of its own segment (`RaggedStorage.dense`). There a forward of many
tokens is plain causal attention, and `ragged_attention` hands it to SDPA (`causal_sdpa`) instead of attending
by hand with a mask. Checked here against attention written out per row, head and query with a softmax, on a
layout with room left in every segment, with the mask in blocks of queries, and after the latest tokens are
taken back out (`drop_latest`, what `RaggedLayer.crop` does after a repeat forward): their slots are written
again, so the run stays dense. A hole makes the layout ragged again, and the hand path answers.
"""

from __future__ import annotations

import torch

from kvevict.attention_stats import Workspace
from kvevict.cache.layers.per_head.attention import ragged_attention
from kvevict.cache.layers.per_head.storage import RaggedStorage

ROWS, KV_HEADS, GROUP, D = 2, 3, 2, 8
SCALE = D**-0.5


def by_hand(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, first: int) -> torch.Tensor:
    """query `[B, H_q, m, D]` at positions `first ..`, keys/values `[B, H_kv, n, D]` at positions `0 .. n - 1`:
    each query over the keys at positions up to its own, one softmax per row, head and query."""
    out = torch.empty_like(query)
    for b in range(query.shape[0]):
        for h in range(query.shape[1]):
            kv = h // GROUP
            for i in range(query.shape[2]):
                seen = first + i + 1
                p = torch.softmax(keys[b, kv, :seen] @ query[b, h, i] * SCALE, dim=0)
                out[b, h, i] = p @ values[b, kv, :seen]
    return out


def storage_with(tokens: list[int], generator: torch.Generator) -> tuple[RaggedStorage, torch.Tensor, torch.Tensor]:
    """Ragged storage (room for 10 + 6 entries a head) fed forwards of `tokens` tokens; every key and value fed."""
    storage = RaggedStorage(ROWS, KV_HEADS, D, torch.float32, torch.device("cpu"), (), 10, 6)
    keys = torch.randn(ROWS, KV_HEADS, sum(tokens), D, generator=generator)
    values = torch.randn(ROWS, KV_HEADS, sum(tokens), D, generator=generator)
    first = 0
    for m in tokens:
        storage.append(keys[:, :, first : first + m], values[:, :, first : first + m], first)
        first += m
    return storage, keys, values


def attended(storage: RaggedStorage, query: torch.Tensor, first: int, workspace: Workspace, by_mask: bool):
    """The output of `ragged_attention`; `by_mask` asks for the last query's attention too, which only the hand
    path gives, so it attends by hand."""
    return ragged_attention(storage, query, SCALE, ~storage.members(), first, False, by_mask, workspace)[0]


def test_a_dense_layout_attends_as_plain_causal_attention():
    generator = torch.Generator().manual_seed(5)
    storage, keys, values = storage_with([6, 5], generator)
    assert storage.dense() == 11
    query = torch.randn(ROWS, KV_HEADS * GROUP, 5, D, generator=generator)
    expected = by_hand(query, keys, values, 6)
    whole = Workspace(1 << 20)
    torch.testing.assert_close(attended(storage, query, 6, whole, False), expected)
    torch.testing.assert_close(attended(storage, query, 6, Workspace(4 * 2 * 11), False), expected)  # 2 queries a block
    torch.testing.assert_close(attended(storage, query, 6, whole, True), expected)  # the hand path agrees


def test_the_latest_tokens_taken_back_out_leave_the_run_dense():
    generator = torch.Generator().manual_seed(6)
    storage, keys, values = storage_with([8, 4], generator)
    storage.drop_latest(4)  # a repeat forward of 4 tokens taken back out
    assert storage.dense() == 8
    assert storage.held.tolist() == [[8] * KV_HEADS] * ROWS and storage.most_held == KV_HEADS * 8
    again_k = torch.randn(ROWS, KV_HEADS, 5, D, generator=generator)
    again_v = torch.randn(ROWS, KV_HEADS, 5, D, generator=generator)
    storage.append(again_k, again_v, 8)  # the next forward writes where the dropped one was
    assert storage.dense() == 13
    query = torch.randn(ROWS, KV_HEADS * GROUP, 5, D, generator=generator)
    expected = by_hand(query, torch.cat([keys[:, :, :8], again_k], 2), torch.cat([values[:, :, :8], again_v], 2), 8)
    torch.testing.assert_close(attended(storage, query, 8, Workspace(1 << 20), False), expected)


def test_a_hole_makes_the_layout_ragged_and_the_hand_path_attends():
    generator = torch.Generator().manual_seed(7)
    storage, keys, values = storage_with([7, 3], generator)
    keep = storage.members().clone()
    keep[0, 1, storage.start[0, 1] + 2] = False  # row 0's second head drops its entry of position 2
    storage.evict(keep, int(keep.sum(dim=(1, 2)).max()))
    assert storage.dense() is None
    query = torch.randn(ROWS, KV_HEADS * GROUP, 3, D, generator=generator)
    expected = by_hand(query, keys, values, 7)
    for h in (2, 3):  # that head's two query heads see the others' keys but position 2
        seen = [p for p in range(10) if p != 2]
        for i in range(3):
            reach = [p for p in seen if p <= 7 + i]
            p = torch.softmax(keys[0, 1, reach] @ query[0, h, i] * SCALE, dim=0)
            expected[0, h, i] = p @ values[0, 1, reach]
    torch.testing.assert_close(attended(storage, query, 7, Workspace(1 << 20), False), expected)
