"""`expected-attention`: the attention future queries are expected to pay each entry (Devoto et al.,
2025, "Expected Attention: KV Cache Compression by Estimating Attention from Future Queries
Distribution"), as kvpress's `ExpectedAttentionPress` computes it (NVIDIA/kvpress,
`kvpress/presses/expected_attention_press.py`, with `get_prerope_query_states` of `kvpress/utils.py`).

The queries of the prompt, before the rotary embedding and after the first `n_sink` tokens (whose
queries are outliers), are summarised per query head by their mean `mu` and covariance `S` (divided by
their count). The queries to come will be rotated at the next `n_future_positions` positions, so the
rotation is averaged over them (`R`, one `D x D` matrix) and applied: `mu' = R mu`, `S' = R S R^T`. A
query `q ~ N(mu', S')` gives the key `k` the expected logit term `exp(k.mu'/sqrt(D) + k^T S' k / (2D))`
(the moment-generating function of a Gaussian); soft-maxed over the held entries after the sinks and
averaged over the query group, it is each entry's expected attention. Rescaled by the L2 norm of the
entry's value (what the entry adds to the output scales with it), it is the score; the first `n_sink`
tokens always stay. kvpress divides by `sqrt(D)` whatever the model's attention scaling; so does this.

The engine hands the queries over through a `kind="queries"` request (`QueryBatch`): attention sees
them rotated, and the layer un-rotates them with the model's own rotary module, which gives back the
projected (and, Gemma 3, normed) queries kvpress computes from the hidden states. A prompt compressed in
one forward uses all its queries, as kvpress does; a decode step under a hard budget has one query, so
the statistics come from the last `window` queries seen (kvpress's `DecodingPress` keeps a buffer of
recent hidden states for the same reason). The score is recomputed at each eviction from the queries and
the entries held; the only state across steps is the engine's window of recent queries.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..attention_stats import covariance_bias, query_probs
from ..errors import KvevictError
from .base import AttentionRequest, Policy, QueryBatch, SlotView

STAT = "expected_attention"


@dataclass(eq=False)
class ExpectedAttention(Policy):
    n_future_positions: int = 512
    n_sink: int = 4
    use_covariance: bool = True
    use_vnorm: bool = True
    epsilon: float = 0.0
    window: int = 128

    stats = (STAT,)
    needs_attention = True  # it asks for the queries (not their attention), at the step that evicts
    requests = ("queries",)
    reads_keys = False  # keys are read where the queries arrive (`absorb`), as attention is for other policies

    def __post_init__(self) -> None:
        for name in ("n_future_positions", "window"):
            if getattr(self, name) < 1:
                raise KvevictError(f"expected-attention:{name} must be >= 1, got {getattr(self, name)}")
        if self.n_sink < 0:
            raise KvevictError(f"expected-attention:n_sink must be >= 0, got {self.n_sink}")

    @property
    def query_window(self) -> int:  # decode steps take their statistics from the last `window` queries
        return self.window

    def spec(self) -> str:
        return (
            f"expected-attention:n_future_positions={self.n_future_positions},n_sink={self.n_sink},"
            f"use_covariance={str(self.use_covariance).lower()},use_vnorm={str(self.use_vnorm).lower()},"
            f"epsilon={self.epsilon},window={self.window}"
        )

    def check_budget(self, budget: int) -> None:
        if self.n_sink >= budget:
            raise KvevictError(
                f"expected-attention:n_sink={self.n_sink} keeps at least as many sinks as the budget ({budget}): "
                f"use n_sink in [0, {budget - 1}] or raise the budget"
            )

    def new_state(self, layer: int) -> Gathered:
        return Gathered()

    def request(self, view: SlotView, will_evict: bool) -> AttentionRequest | None:
        if will_evict:
            return AttentionRequest(kind="queries", stat=STAT, size=self.window, accumulate=False)
        if view.held_back:  # a chunk of a context evicted after its last: its queries are gathered (`absorb`)
            return AttentionRequest(kind="queries", stat=STAT, size=self.window, accumulate=True)
        return None

    def absorb(self, view: SlotView, request: AttentionRequest, mass: torch.Tensor | QueryBatch) -> torch.Tensor:
        """`[b, H_kv, n]` expected attention of each held entry, times its value's norm (sinks and pads 0)."""
        if not isinstance(mass, QueryBatch):
            raise KvevictError(f"expected-attention asked for the queries and got {request.kind!r} attention")
        gathered = view.state
        if request.accumulate:  # a chunk of a held-back context: nothing scored until its last chunk
            gathered.add(mass, self.n_sink)
            return view.stats[STAT]
        mu, cov = self._moments(mass, gathered if view.held_back else None)  # [b, H_q, D], [b, H_q, D, D] or None
        gathered.clear()
        keys = view.keys().float()  # [b, H_kv, n, D]
        b, h_kv, n, d = keys.shape
        group = mu.shape[1] // h_kv
        judged = (view.positions >= self.n_sink)[:, :, None, :]  # [b, H_kv, 1, n]; pads sit at -1
        # the covariance's term of each expected logit, `k^T S' k / (2D)`: a bias on the attention logits
        bias = None
        if cov is not None:
            bias = covariance_bias(keys, cov.view(b, h_kv, group, d, d)) / d / 2  # in blocks of keys
        # the expected query's attention over the judged entries (the kernel's one-query path), kvpress's
        # `/ sqrt(D)` as a scale
        probs = query_probs(mu[:, :, None], keys, d**-0.5, ~judged, bias)  # [b, H_kv, g, n]
        probs = probs.nan_to_num(0.0).mean(dim=2)
        if self.use_vnorm:
            probs = (probs + self.epsilon) * torch.linalg.vector_norm(view.values().float(), dim=-1)
        return probs.masked_fill(~judged[:, :, 0], 0.0)

    def _moments(self, batch: QueryBatch, gathered: Gathered | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Mean `[b, H_q, D]` and covariance `[b, H_q, D, D]` of the queries after the sinks, turned by the
        rotation averaged over the next `n_future_positions` positions. The queries are `batch`'s, and where
        earlier chunks of a held-back context were `gathered`, theirs with them (the moments merged, so the
        result is that of the whole context's queries, as one forward over it gives)."""
        if gathered is not None and gathered.count:
            gathered.add(batch, self.n_sink)
            mu, cov = gathered.mean.float(), gathered.scatter.float() / gathered.count
            cov = cov if self.use_covariance else None
        else:
            raw = batch.raw[:, :, batch.stream >= self.n_sink]
            if raw.shape[2] == 0:  # only sinks so far: every query counts
                raw = batch.raw
            mu = raw.mean(dim=2)
            cov = None
            if self.use_covariance:
                centred = raw - mu[:, :, None]
                cov = centred.transpose(-1, -2) @ centred / raw.shape[2]
        turn = _mean_rotation(batch, self.n_future_positions, batch.raw.shape[-1])  # [D, D] = mean R^T
        mu = mu @ turn
        if cov is not None:
            cov = turn.transpose(-1, -2) @ cov @ turn
        return mu, cov

    def scores(self, view: SlotView) -> torch.Tensor:
        """The stored expected attention; the first `n_sink` tokens always stay."""
        return view.stats[STAT].masked_fill((view.positions >= 0) & (view.positions < self.n_sink), float("inf"))


@dataclass
class Gathered:
    """The queries of a held-back context's chunks so far, as moments: one layer's state (`new_state`).

    A context read in several forwards and evicted after the last (`SlotView.held_back`) is scored on the
    queries of all of them, as one forward over it would be; holding them would cost `[b, H_q, T, D]`, so
    each chunk's are folded in as they come: their count, mean `[b, H_q, D]` and scatter (the sum of outer
    products about the mean) `[b, H_q, D, D]`, merged pairwise (Chan, Golub and LeVeque's update) in float64.
    `upto`: the stream position below which every query is in (a short chunk's batch repeats earlier ones).
    """

    count: int = 0
    mean: torch.Tensor | None = None
    scatter: torch.Tensor | None = None
    upto: int = 0

    def add(self, batch: QueryBatch, n_sink: int) -> None:
        """Fold in `batch`'s queries at stream positions from `max(upto, n_sink)` on."""
        fresh = batch.stream >= max(self.upto, n_sink)
        if batch.stream.numel():
            self.upto = max(self.upto, int(batch.stream.max()) + 1)
        raw = batch.raw[:, :, fresh]
        m = raw.shape[2]
        if m == 0:
            return
        mean = raw.mean(dim=2)
        centred = raw - mean[:, :, None]
        scatter = (centred.transpose(-1, -2) @ centred).double()
        mean = mean.double()
        if not self.count:
            self.count, self.mean, self.scatter = m, mean, scatter
            return
        total = self.count + m
        delta = mean - self.mean  # [b, H_q, D]
        self.scatter = self.scatter + scatter + delta[..., :, None] * delta[..., None, :] * (self.count * m / total)
        self.mean = self.mean + delta * (m / total)
        self.count = total

    def clear(self) -> None:
        self.count, self.mean, self.scatter, self.upto = 0, None, None, 0


def _mean_rotation(batch: QueryBatch, count: int, d: int) -> torch.Tensor:
    """`[D, D]` the transpose of the rotary rotation averaged over positions `next .. next + count - 1`:
    a row vector `x` turned by the mean rotation is `x @ result`. Built by rotating the identity's rows
    with the layer's own cos/sin, so partial rotary turns only the first `rot` dimensions."""
    positions = torch.arange(batch.next_position, batch.next_position + count, device=batch.raw.device)
    cos, sin = (t.float() for t in batch.rotation(positions))  # [count, rot]
    rot = cos.shape[-1]
    eye = torch.eye(d, device=batch.raw.device)
    head = eye[:, :rot]  # rows of the identity, rotated dimensions only
    half = rot // 2
    swapped = torch.cat((-head[:, half:], head[:, :half]), dim=-1)  # rotate_half of each row
    turned = head * cos.mean(dim=0) + swapped * sin.mean(dim=0)  # mean over positions (linear in cos, sin)
    return torch.cat((turned, eye[:, rot:]), dim=-1)
