"""Expected Attention's queries and LagKV's scores against independent computations (their kept sets
against kvpress's own are in `test_kvpress_parity.py`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvevict import EvictingCache
from kvevict.eval.forward import body
from kvevict.policies import AttentionRequest, Policy, SlotView
from kvevict.policies.lagkv import LagKV

from conftest import make_tiny, random_tokens


@dataclass(eq=False)
class _Recorder(Policy):
    """Asks for the queries at the step that evicts and keeps what it gets (a window of recent position)."""

    stats = ("seen_queries",)
    needs_attention = True

    def __post_init__(self) -> None:
        self.batches: dict[int, object] = {}

    def spec(self) -> str:
        return "recorder"

    @property
    def query_window(self) -> int:
        return 4

    def request(self, view: SlotView, will_evict: bool) -> AttentionRequest | None:
        return AttentionRequest(kind="queries", stat="seen_queries", size=4, accumulate=False) if will_evict else None

    def absorb(self, view, request, mass):
        self.batches[view.layer] = mass
        return torch.zeros_like(view.positions, dtype=torch.float32)

    def scores(self, view: SlotView) -> torch.Tensor:
        return view.positions.float()


def test_queries_request_hands_over_the_projected_queries():
    """What a `kind="queries"` request gets is the layer's q_proj output before the rotary embedding
    (read off the projection itself by a hook), at the stream positions, in both position modes."""
    for positions in ("original", "cache"):
        model = make_tiny(seed=3)
        projected: dict[int, torch.Tensor] = {}
        for index, layer in enumerate(model.model.layers):
            layer.self_attn.q_proj.register_forward_hook(
                lambda m, i, out, index=index, seen=projected: seen.__setitem__(index, out.detach())
            )
        policy = _Recorder()
        cache = EvictingCache(model, [policy], budget=12, positions=positions)
        tokens = random_tokens(20)
        with torch.inference_mode():
            body(model, tokens[None, :16], cache)  # a prefill that evicts: all 16 queries
            for layer, batch in policy.batches.items():
                expected = projected[layer].view(1, 16, 4, 16).transpose(1, 2)  # [b, H_q, m, D]
                torch.testing.assert_close(batch.raw, expected, atol=2e-5, rtol=1e-4)
                assert batch.stream.tolist() == list(range(16))
            body(model, tokens[None, 16:17], cache)  # a decode step: the last 4 queries remembered
            for layer, batch in policy.batches.items():
                assert sorted(batch.stream.tolist()) == [13, 14, 15, 16]
                order = batch.stream.argsort()
                torch.testing.assert_close(batch.raw[:, :, order][:, :, -1:], projected[layer].view(1, 1, 4, 16)
                                           .transpose(1, 2), atol=2e-5, rtol=1e-4)


def _lag_reference(keys: torch.Tensor, values: torch.Tensor, n_sink: int, lag: int) -> list[float]:
    """LagKV's score of one sequence `[n, D]`, by hand: loops over partitions and tokens."""
    n = keys.shape[0]
    end = n_sink + ((n - n_sink) // lag) * lag
    score = [1.0] * n
    for start in range(n_sink, end - lag, lag):
        parts = []
        for x in (keys, values):
            ref = x[start + lag : start + 2 * lag]
            low, high = ref.min(dim=0).values, ref.max(dim=0).values
            spread = torch.stack([((x[t] - low) / (high - low)).std() for t in range(start, start + lag)])
            parts.append(torch.exp(spread) / torch.exp(spread).sum())
        mean = (parts[0] + parts[1]) / 2
        for t in range(lag):
            score[start + t] = sum(bool(mean[u] < mean[t]) for u in range(lag)) / lag  # rank within the partition
    return score


def test_lagkv_scores_by_hand_with_slots_out_of_order():
    torch.manual_seed(0)
    n, d, n_sink, lag = 23, 6, 2, 5
    keys, values = torch.randn(1, 2, n, d), torch.randn(1, 2, n, d)
    shuffle = torch.randperm(n)  # the cache may hold slots out of positional order
    view = SlotView(
        positions=shuffle.expand(1, 2, n), seen=n, budget=10, layer=0,
        keys=lambda: keys[:, :, shuffle], values=lambda: values[:, :, shuffle],
    )
    got = LagKV(n_sink=n_sink, lag_size=lag).scores(view)
    for h in range(2):
        expected = torch.tensor(_lag_reference(keys[0, h], values[0, h], n_sink, lag))
        torch.testing.assert_close(got[0, h], expected[shuffle])


def test_a_held_back_prefill_keeps_what_one_compression_keeps():
    """The RULER grid reads a context once and compresses copies of that state later (`defer`); Expected
    Attention's queries are measured in that forward, so each budget keeps what a compression in one call
    keeps (beside another policy's row, as the grid batches them)."""
    from kvevict.eval.compress import compress
    from kvevict.eval.ruler.protocols import compress_at, prefill

    model, ids = make_tiny(seed=2), random_tokens(64)
    for spec in ("expected-attention:n_sink=2", "lagkv:n_sink=2,lag_size=8"):
        alone = compress(model, ids, [spec], 24).cache.kept_positions()
        state = prefill(model, ids, [spec, "tova"], 48, "original", defer=True)
        assert state.cache.deferred
        later = compress_at(state, 24).cache.kept_positions()
        assert all(torch.equal(a[0], b[0]) for a, b in zip(alone, later)), spec


def test_lagkv_holds_one_kv_heads_copies_at_a_time():
    """LagKV scores one KV head at a time: no tensor it makes is the size of every head's keys. Read off
    torch's profiler (the bytes each operator allocated), at 8 heads of 2,048 entries: the in-order copy of
    one head's keys is 0.5 MB, every head's at once 4 MB."""
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(0)
    b, h, n, d = 1, 8, 2048, 64
    shuffle = torch.randperm(n)
    keys, values = torch.randn(b, h, n, d)[:, :, shuffle], torch.randn(b, h, n, d)[:, :, shuffle]  # as held
    view = SlotView(positions=shuffle.expand(b, h, n), seen=n, budget=512, layer=0,
                    keys=lambda: keys, values=lambda: values)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        LagKV(n_sink=4, lag_size=128).scores(view)
    one_head = b * n * d * keys.element_size()
    largest = max(event.cpu_memory_usage for event in prof.events())
    assert one_head <= largest < 2 * one_head  # one head's in-order keys, never every head's
