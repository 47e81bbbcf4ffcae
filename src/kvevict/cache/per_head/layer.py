"""`RaggedLayer`: a layer whose KV heads hold different numbers of entries (Ada-KV, `adakv:P`).

The layer's allowance is `KV heads x budget` entries per row, shared by its heads
(`allocation.allocate`), and stored for real in ragged per-head segments
(`RaggedStorage`): a head holds exactly its share, no head is padded to the longest.
SDPA wants one length for every head, so this layer attends by hand: a loop over
(row, KV head), each head's query group `[G, q, D]` against its contiguous segment
`[length, D]` (matmul, softmax, matmul). The loop also yields the probabilities that
attention-driven policies (h2o, tova) fold into their statistics, at no extra pass.

Policies score through a padded view: per head its entries padded to the longest
head, pads at position -1 with zero keys and statistics, scored `-inf` after the
policy scored them, so the policies run unchanged (a pad draws no attention, adds
nothing to keydiff's mean, and sits before every token in SnapKV's pooling, where a
zero next to non-negative masses changes neither max- nor average pooling with
zero padding).

Every forward goes through `replay` (the attention function hands it the whole call).
A forward of many tokens under `per_token=True` that would evict steps through its
queries one at a time, doing exactly what one-token forwards do, so chunked
evaluation is exact. Original positions only: in position-shift mode each head would
need its own positions (`EvictingCache` refuses it).
"""

from __future__ import annotations

import torch

from ...policies import SlotView
from ..layer import EvictingLayer
from ..probabilities import attention_mass
from ..rows import RowGroup
from ..selection import LATEST_LAST
from ..statistics import measure
from .allocation import allocate
from .storage import RaggedStorage


class RaggedLayer(EvictingLayer):
    """Per-head budgets: one allowance per layer and row, ragged storage, attention by hand."""

    heads_differ = True

    def _new_storage(self) -> RaggedStorage:
        s = self.settings
        self._incoming: tuple[torch.Tensor, torch.Tensor] | None = None
        return RaggedStorage(
            self.batch_size, self.heads, self.head_dim, self.dtype, self.device, s.stat_names, self.budget or 0, s.slack
        )

    def _store(self, key_states: torch.Tensor, value_states: torch.Tensor, used: torch.Tensor | None):
        # written into the segments by `replay`, one step at a time when the chunk evicts
        rows = self.batch_size
        self._incoming = (key_states.expand(rows, -1, -1, -1), value_states.expand(rows, -1, -1, -1))
        return key_states, value_states

    def reset(self) -> None:
        super().reset()
        if self.storage is not None:
            self.storage.reset()

    def replays(self, q: int) -> bool:
        """Always: this layer computes its own attention (SDPA needs one length for all heads)."""
        return True

    def replay(self, query: torch.Tensor, kwargs: dict, scaling: float) -> torch.Tensor:
        """Attention and eviction of a forward. query `[B or 1, H_q, q, D]` -> output `[B or 1, H_q, q, D]`."""
        self.pending = False
        rows = query.shape[0]
        query = query.expand(self.batch_size, -1, -1, -1)
        keys, values = self._incoming
        self._incoming = None
        q = query.shape[2]
        used = self._query_positions(query, kwargs)
        first = self.seen - q
        stepping = self.settings.per_token and q > 1 and self._overflows(q)
        spans = [(i, i + 1) for i in range(q)] if stepping else [(0, q)]
        outs = [
            self._forward(query[:, :, a:b], keys[:, :, a:b], values[:, :, a:b], used[a:b], first + b, scaling)
            for a, b in spans
        ]
        self.new = 0
        for observer in self.settings.observers:
            observer.on_forward(self.index, self.n)
        out = torch.cat(outs, dim=2) if len(outs) > 1 else outs[0]
        return out[:rows]

    def _overflows(self, q: int) -> bool:
        """Whether `q` more tokens per head would take some row past its allowance `H x budget`."""
        budget = self.budget
        held = self.storage.length.sum(dim=-1)  # [B]
        return budget is not None and bool((held + self.heads * q > self.heads * budget).any())

    def _forward(
        self,
        query: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        used: torch.Tensor,
        seen: int,
        scaling: float,
    ) -> torch.Tensor:
        """One forward of `m` tokens (`seen` counts them): store, attend, feed statistics, allocate.

        query `[B, H_q, m, D]`, keys/values `[B, H_kv, m, D]`, used `[m]` their positions.
        """
        s, storage = self.settings, self.storage
        m = query.shape[2]
        storage.append(keys, values, seen - m)
        self.statistics.remember(query, used, seen)
        will_evict = self._overflows(0)
        flat, valid = storage.padded()
        positions = storage.take(storage.pos, flat).masked_fill(~valid, -1)
        budget = self.budget if self.budget is not None else flat.shape[-1]
        groups = s.layout.groups
        views = [self._ragged_view(g, positions, flat, valid, seen, budget) for g in groups]
        requests = [g.policy.request(v, will_evict) for g, v in zip(groups, views)]
        kinds = {r.kind for r in requests if r is not None}
        out, new_mass, last_mass = self._attend(query, scaling, flat.shape[-1], "new" in kinds, "last" in kinds)
        for g, view, request in zip(groups, views, requests):
            if request is None:
                continue

            def window(size: int) -> torch.Tensor:  # SnapKV's last queries, pads made invisible
                queries, q_pos = self.statistics.window_queries(s.mode, size, seen, flat.shape[-1])
                key_pos = positions.masked_fill(~valid, LATEST_LAST)
                keys_now = storage.take(storage.keys, flat)
                return attention_mass(queries, q_pos, keys_now, key_pos, scaling).nan_to_num(0.0)

            mass = measure(request, new=lambda: new_mass, last=lambda: last_mass, window=window)
            stat = storage.stats[request.stat]
            padded = storage.take(stat, flat).masked_fill(~valid, 0.0)
            updated = g.policy.absorb(view, request, g.take(mass)).to(stat.dtype).masked_fill(~g.take(valid), 0.0)
            g.put(padded, updated)
            stat.view(-1)[flat[valid]] = padded[valid]
            view.stats[request.stat] = updated
        if will_evict:
            scores = s.layout.merge([g.policy.scores(v) for g, v in zip(groups, views)], *flat.shape)
            scores = scores.masked_fill(~valid, float("-inf"))
            floors = torch.tensor([p.head_floor(self.budget) for p in s.layout.row_policies()], device=self.device)
            keep = allocate(scores, positions, valid, self.heads * self.budget, floors)
            storage.compact(keep, flat)
            if m > 1 and storage.capacity > storage.base:  # a long prefill grew the buffer: give it back
                storage.repack(0)
            self.identical = False
            self.report_eviction(seen, self.kept_positions(), None)
        self.n = int(storage.length.max())
        return out

    def _ragged_view(
        self, group: RowGroup, positions: torch.Tensor, flat: torch.Tensor, valid: torch.Tensor, seen: int, budget: int
    ) -> SlotView:
        """What `group`'s policy sees: each head's entries padded to the longest head (position -1,
        zero keys and statistics at the pads)."""
        storage = self.storage
        mask = group.take(valid)

        def keys() -> torch.Tensor:
            return storage.take(storage.keys, group.take(flat)).masked_fill(~mask[..., None], 0.0)

        return SlotView(
            positions=group.take(positions),
            seen=seen,
            budget=budget,
            layer=self.index,
            stats={
                name: storage.take(storage.stats[name], group.take(flat)).masked_fill(~mask, 0.0)
                for name in group.policy.stats
            },
            keys=keys,
        )

    def _attend(
        self, query: torch.Tensor, scaling: float, width: int, want_new: bool, want_last: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Attention over each head's segment; the new tokens (its last `m` entries) causal.

        query `[B, H_q, m, D]`. Returns the output `[B, H_q, m, D]`, and, when asked, the
        attention every entry got `[B, H_kv, width]` (float32, summed over the query group)
        from all `m` queries and from the last one.
        """
        storage = self.storage
        b, hq, m, _ = query.shape
        group = hq // self.heads
        out = torch.empty_like(query)
        new_mass = torch.zeros(b, self.heads, width, device=self.device) if want_new else None
        last_mass = torch.zeros(b, self.heads, width, device=self.device) if want_last else None
        starts, lengths = storage.start.tolist(), storage.length.tolist()
        for r in range(b):
            for h in range(self.heads):
                length = lengths[r][h]
                k, v = storage.segment(r, h, starts[r][h], length)
                heads = slice(h * group, (h + 1) * group)
                logits = torch.matmul(query[r, heads], k.transpose(0, 1)).float().mul_(scaling)  # [G, m, length]
                if m > 1:  # new token i sees the kept entries and new tokens up to itself
                    cols = torch.arange(length, device=self.device)
                    rows = torch.arange(m, device=self.device) + (length - m)
                    logits.masked_fill_(cols[None, :] > rows[:, None], float("-inf"))
                probs = torch.softmax(logits, dim=-1)
                out[r, heads] = torch.matmul(probs.to(v.dtype), v)
                if new_mass is not None:
                    new_mass[r, h, :length] = probs.sum(dim=(0, 1))
                if last_mass is not None:
                    last_mass[r, h, :length] = probs[:, -1].sum(dim=0)
        return out, new_mass, last_mass

    # --- inspection ------------------------------------------------------------------
    def kept_positions(self) -> torch.Tensor:
        """`[B, H_kv, L]` original positions each head holds, ascending, padded with -1 at the
        end to the longest head (`L`); `head_lengths` says how many are real."""
        flat, valid = self.storage.padded()
        pos = self.storage.take(self.storage.pos, flat).masked_fill(~valid, LATEST_LAST).sort(dim=-1).values
        return pos.masked_fill(pos == LATEST_LAST, -1)

    def head_lengths(self) -> torch.Tensor:
        return self.storage.length.clone().cpu()
