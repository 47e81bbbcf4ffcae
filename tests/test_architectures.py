"""The architecture matrix: every family against an independent masked-attention reference.

For each tiny model (tests/architectures.py) and each position mode it supports, the
streaming NLL of `window`, `sink4+window` and `h2o` — token by token and chunked —
must equal a reference that knows nothing of kvevict: the model's own forward with a
full `DynamicCache`, its attention replaced by eager attention written here, where
each query sees exactly the keys the policy would have kept (a sliding-window layer:
its own window, whatever the policy), and in position-shift mode every visible key
and the query are re-rotated to their rank among what the query sees. H2O's kept set
is recomputed step by step from the reference's own attention probabilities.
"""

from __future__ import annotations

import inspect
import json

import pytest
import torch
from transformers import AttentionInterface, DynamicCache

from architectures import ARCHS, GEMMA_WINDOW, VOCAB
from kvevict import EvictingCache, attach, compare
from kvevict.errors import KvevictError

from support import attn, nll_from_logits, plain_nll

BUDGET = 12


def CACHE_KWARG(model) -> str:
    """transformers 5.x renamed `past_key_values` to `cache` (5.24 warns on the old name)."""
    return "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"

SINKS = 4
TOKENS = torch.randint(0, VOCAB, (60,), generator=torch.Generator().manual_seed(5))


def _half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


class Reference:
    """Eager attention over a full cache, masked to what `rule` keeps, per layer.

    rule: ("band", sinks) keeps the first `sinks` tokens and the most recent ones
    (window / sinkN+window); ("h2o", recent) keeps the `recent` share of the budget most
    recent tokens and the highest accumulated attention among the rest.
    """

    def __init__(self, model, rule: tuple[str, float], cache_mode: bool, budget: int = BUDGET,
                 acc_dtype: torch.dtype = torch.float32) -> None:
        self.model, self.rule, self.cache_mode = model, rule, cache_mode
        self.budget, self.acc_dtype = budget, acc_dtype  # acc_dtype: H2O's running sums (float32 unless a test
        # shows what a narrower accumulator would do)
        text = model.config.get_text_config(decoder=True)
        self.kinds = getattr(text, "layer_types", None) or ["full_attention"] * text.num_hidden_layers
        self.window = getattr(text, "sliding_window", None) or GEMMA_WINDOW  # sliding layers' own window
        self.rotary = getattr(model.base_model, "rotary_emb", None)
        self.acc: dict[int, torch.Tensor] = {}
        self.evicted: dict[int, torch.Tensor] = {}

    def cos_sin(self, kind: str, positions: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        probe = torch.zeros(1, 1, dim, dtype=self.model.dtype)  # cos/sin in the model's dtype, as its own forward
        if hasattr(self.rotary, "layer_types"):
            return self.rotary(probe, positions[None], kind)
        return self.rotary(probe, positions[None])

    def turn(self, x, cos, sin, sign: float):
        rot = cos.shape[-1]
        x = x.expand(*torch.broadcast_shapes(x.shape[:-1], cos.shape[:-1]), x.shape[-1])
        head = x[..., :rot]
        return torch.cat((head * cos + sign * _half(head) * sin, x[..., rot:]), dim=-1)

    def visible(self, layer: int, b: int, h: int, q: int, total: int) -> torch.Tensor:
        i = torch.arange(total - q, total)[:, None]
        j = torch.arange(total)[None, :]
        causal = j <= i
        if self.kinds[layer] == "sliding_attention":
            return (causal & (i - j < self.window)).expand(b, h, q, total)
        if self.rule[0] == "band":
            sinks = int(self.rule[1])
            return (causal & ((j < sinks) | (i - j <= self.budget - sinks))).expand(b, h, q, total)
        evicted = self.evicted.setdefault(layer, torch.zeros(b, h, 0, dtype=torch.bool))
        evicted = torch.cat([evicted, torch.zeros(b, h, total - evicted.shape[2], dtype=torch.bool)], dim=2)
        self.evicted[layer] = evicted
        return causal[None, None] & ~evicted[:, :, None, :]

    def __call__(self, module, query, key, value, attention_mask, scaling=None, **kwargs):
        layer = module.layer_idx
        b, hq, q, d = query.shape
        h, total = key.shape[1], key.shape[2]
        group = hq // h
        seen = self.visible(layer, b, h, q, total)  # [b, h, q, total]
        k = key.repeat_interleave(group, 1)
        v = value.repeat_interleave(group, 1)
        vis = seen.repeat_interleave(group, 1)
        if self.cache_mode:
            kind = self.kinds[layer]
            cos, sin = self.cos_sin(kind, torch.arange(total), d)
            scale = getattr(self.rotary, "attention_scaling", 1.0)
            raw_k = self.turn(k, cos[0], sin[0], -1.0) / scale**2
            raw_q = self.turn(query, cos[0, total - q :], sin[0, total - q :], -1.0) / scale**2
            rank = vis.long().cumsum(-1) - 1  # [b, hq, q, total]: a key's rank among what query i sees
            cr, sr = self.cos_sin(kind, rank.clamp(min=0).reshape(-1), d)
            cr, sr = cr.reshape(*rank.shape, -1), sr.reshape(*rank.shape, -1)
            keys = self.turn(raw_k[:, :, None], cr, sr, 1.0)  # [b, hq, q, total, d]
            me = rank[..., -q:].diagonal(dim1=-2, dim2=-1)  # [b, hq, q]: the query's own rank
            cq, sq = self.cos_sin(kind, me.reshape(-1), d)
            qs = self.turn(raw_q, cq.reshape(*me.shape, -1), sq.reshape(*me.shape, -1), 1.0)
            logits = torch.einsum("bhqd,bhqnd->bhqn", qs, keys)
        else:
            logits = query @ k.transpose(-1, -2)
        logits = logits.float() * (scaling if scaling is not None else d**-0.5)
        probs = torch.softmax(logits.masked_fill(~vis, float("-inf")), dim=-1)
        out = probs.to(v.dtype) @ v
        if self.rule[0] == "h2o" and self.kinds[layer] != "sliding_attention":
            self.h2o_evict(layer, probs.view(b, h, group, q, total).sum(dim=(2, 3)), total)
        return out.transpose(1, 2).contiguous(), probs

    def h2o_evict(self, layer: int, mass: torch.Tensor, total: int) -> None:
        acc = self.acc.get(layer, torch.zeros(*mass.shape[:2], 0, dtype=self.acc_dtype))
        acc = torch.cat([acc, torch.zeros(*mass.shape[:2], total - acc.shape[2], dtype=self.acc_dtype)], dim=2)
        acc = (acc + mass).to(self.acc_dtype)
        self.acc[layer] = acc
        evicted = self.evicted[layer]
        budget = self.budget
        recent = int(round(self.rule[1] * budget))
        for row in range(acc.shape[0]):
            for head in range(acc.shape[1]):
                alive = [p for p in range(total) if not evicted[row, head, p]]
                if len(alive) <= budget:
                    continue
                newest = [p for p in alive if p >= total - recent]
                ranked = sorted((p for p in alive if p < total - recent), key=lambda p: float(acc[row, head, p]),
                                reverse=True)
                keep = set(newest) | set(ranked[: budget - len(newest)])
                for p in alive:
                    evicted[row, head, p] = p not in keep


def reference_nll(model, rule, cache_mode: bool, tokens: torch.Tensor = TOKENS, budget: int = BUDGET,
                  acc_dtype: torch.dtype = torch.float32, prefill: int | None = None) -> torch.Tensor:
    """Prefill the budget (or `prefill` tokens), then one token per forward (H2O's kept set moves at every step)."""
    ref = Reference(model, rule, cache_mode, budget, acc_dtype)
    AttentionInterface.register("matrix_reference", ref)
    logits = []
    first = budget if prefill is None else prefill
    with attn(model, "matrix_reference"), torch.inference_mode():
        cache = DynamicCache()
        pieces = [tokens[:first]] + [tokens[t : t + 1] for t in range(first, tokens.numel())]
        for piece in pieces:
            logits.append(model(piece[None], use_cache=True, **{CACHE_KWARG(model): cache}).logits[0])
    lp = torch.log_softmax(torch.cat(logits)[:-1].float(), -1)
    return -lp.gather(-1, tokens[1:, None])[:, 0]


RULES = {"window": ("band", 0), f"sink{SINKS}+window": ("band", SINKS), "h2o:recent=0.5": ("h2o", 0.5)}
CASES = [(a, p) for a in ARCHS for p in a.positions]


@pytest.mark.parametrize("arch,positions", CASES, ids=[f"{a.name}-{p}" for a, p in CASES])
def test_matrix_matches_masked_reference(arch, positions):
    model = arch.build(seed=3)
    specs = list(RULES)
    for chunk in (1, 7):
        rows, _ = compare(model, TOKENS, specs, BUDGET, positions, reference=False, progress=False, chunk=chunk)
        for spec, row in zip(specs, rows):
            ref = reference_nll(model, RULES[spec], positions == "cache")
            err = ((row.nll - ref).abs() / ref.abs().clamp(min=1.0)).max()
            assert err < 1e-4, f"{arch.name} {positions} {spec} chunk {chunk}: {err:.2e}"


# --- what cannot be bounded is refused in one line ------------------------------------------------------------


def _tiny(cls_name: str, config_name: str, **options):
    import transformers as tf

    torch.manual_seed(0)
    return getattr(tf, cls_name)(getattr(tf, config_name)(**options)).eval()


REFUSED = {
    "encoder-decoder": (
        lambda: _tiny("T5ForConditionalGeneration", "T5Config", vocab_size=50, d_model=32, d_kv=8, d_ff=64,
                      num_layers=1, num_heads=2),
        "encoder-decoder",
    ),
    "state-space": (
        lambda: _tiny("MambaForCausalLM", "MambaConfig", vocab_size=50, hidden_size=32, num_hidden_layers=1,
                      state_size=4),
        "linear_attention layers",  # transformers declares Mamba's blocks as linear attention
    ),
    "linear-attention": (
        lambda: _tiny("Qwen3NextForCausalLM", "Qwen3NextConfig", vocab_size=50, hidden_size=32,
                      intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                      head_dim=16, linear_num_value_heads=2, linear_num_key_heads=1, linear_key_head_dim=8,
                      linear_value_head_dim=8, num_experts=2, num_experts_per_tok=1, moe_intermediate_size=16,
                      shared_expert_intermediate_size=16, layer_types=["linear_attention", "full_attention"]),
        "linear_attention layers",
    ),
    "no-attention-interface": (
        lambda: _tiny("BloomForCausalLM", "BloomConfig", vocab_size=50, hidden_size=32, n_layer=1, n_head=2),
        "does not route attention through transformers' AttentionInterface",
    ),
    "logit-softcap": (
        lambda: _tiny("Gemma2ForCausalLM", "Gemma2Config", vocab_size=50, hidden_size=32, intermediate_size=64,
                      num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16),
        "soft-caps its attention logits",
    ),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_unboundable_architectures_are_refused(case):
    build, needle = REFUSED[case]
    with pytest.raises(KvevictError, match=needle) as info:
        EvictingCache(build(), "window", budget=8)
    assert "\n" not in str(info.value) and "Llama" in str(info.value)


def test_learned_sink_logits_are_refused_at_attention():
    """GPT-OSS hands its learned sinks to the attention function (s_aux); attending without them would be wrong."""
    model = _tiny("GptOssForCausalLM", "GptOssConfig", vocab_size=50, hidden_size=32, intermediate_size=32,
                  num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                  num_local_experts=2, num_experts_per_tok=1, sliding_window=4,
                  layer_types=["sliding_attention", "full_attention"])
    with pytest.raises(KvevictError, match="learned attention-sink logits"):
        compare(model, TOKENS[:20] % 50, ["window"], 8, reference=False, progress=False)


@pytest.mark.parametrize("name", ["gpt2", "opt"])
def test_absolute_positions_refuse_the_position_shift(name):
    model = next(a for a in ARCHS if a.name == name).build()
    with pytest.raises(KvevictError, match="no rotation to shift") as info:
        EvictingCache(model, "window", budget=8, positions="cache")
    assert "positions='original'" in str(info.value)


def test_all_sliding_model_is_refused():
    """A model whose every layer slides (Mistral v0.1's config) gives a budget nothing to bound."""
    model = _tiny("MistralForCausalLM", "MistralConfig", vocab_size=50, hidden_size=32, intermediate_size=64,
                  num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, sliding_window=16)
    with pytest.raises(KvevictError, match="sliding_window=None"):
        EvictingCache(model, "window", budget=8)


def test_hybrid_memory_per_layer_kind():
    """Full-attention layers hold the budget, sliding ones their window less one; bytes against the full cache,
    whose sliding layers hold their window less one too."""
    model = next(a for a in ARCHS if a.name == "gemma3").build()
    cache = EvictingCache(model, ["window", "h2o"], budget=BUDGET)
    with torch.inference_mode():
        model(TOKENS[None].expand(2, -1), use_cache=True, **{CACHE_KWARG(model): cache})
    memory = cache.memory()
    assert memory.held == {"sliding_attention": GEMMA_WINDOW - 1, "full_attention": BUDGET}
    assert memory.layers == {"sliding_attention": 2, "full_attention": 2}
    cell = 2 * 2 * 2 * 16 * 4  # keys+values x rows x KV heads x head_dim x float32
    assert memory.kv_bytes == cell * 2 * (GEMMA_WINDOW - 1 + BUDGET)
    # a full cache: the 2 full-attention layers hold every token, the 2 sliding ones their window less one, as
    # transformers' sliding layers do
    assert TOKENS.numel() > GEMMA_WINDOW - 1  # the precondition: the window bounds the sliding layers
    assert memory.full_kv_bytes == cell * 2 * (TOKENS.numel() + GEMMA_WINDOW - 1)
    assert [k.shape[-1] for k in cache.kept_positions()] == [BUDGET, BUDGET]  # the policy's layers only


def test_final_logit_softcap_is_applied():
    """Gemma's `final_logit_softcapping` is part of the model's logits: kvevict's LM head must apply it too."""
    import transformers as tf

    torch.manual_seed(0)
    config = tf.Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, sliding_window=GEMMA_WINDOW, final_logit_softcapping=2.0,
        layer_types=["sliding_attention", "full_attention"], initializer_range=0.3,
    )
    model = tf.Gemma3ForCausalLM(config).eval()
    rows, _ = compare(model, TOKENS, ["full"], None, reference=False, progress=False)
    assert (rows[0].nll - plain_nll(model, TOKENS)).abs().max() < 1e-4


def test_attached_model_without_kvevict_cache_keeps_its_sliding_window():
    """After attach, a plain forward (no EvictingCache) must still honour the sliding window it is handed."""
    model = next(a for a in ARCHS if a.name == "gemma3").build()
    expected = plain_nll(model, TOKENS)
    attach(model)
    with torch.inference_mode():
        logits = model(TOKENS[None]).logits[0]
    assert (nll_from_logits(logits, TOKENS) - expected).abs().max() < 1e-4


def test_summary_json_reports_memory_per_layer_kind():
    model = next(a for a in ARCHS if a.name == "gemma3").build()
    rows, _ = compare(model, TOKENS, ["window", "h2o"], BUDGET, reference=False, progress=False)
    summary = rows[1].summary()
    assert summary["held_per_layer_kind"] == {"sliding_attention": GEMMA_WINDOW - 1, "full_attention": BUDGET}
    row_cell = 2 * 2 * 16 * 4  # keys+values x KV heads x head_dim x float32, one row
    assert summary["kv_bytes"] == row_cell * 2 * (GEMMA_WINDOW - 1 + BUDGET)
    assert summary["full_kv_bytes"] == row_cell * 2 * (TOKENS.numel() + GEMMA_WINDOW - 1)


@pytest.mark.model
def test_gemma3_embedded_starts_with_bos_and_chunks_exactly(tmp_path):
    """The second embedded model: its stream starts with BOS (SmolLM2's does not), and the
    hybrid cache's chunked path equals token-by-token feeding in both position modes."""
    from kvevict import load_model, load_tokens
    from kvevict.ab import SweepConfig
    from kvevict.ab.run import prepare_folder, record_stream_start
    from kvevict.data import stream_start
    from kvevict.eval.prompts import frame
    from kvevict.loading import load_tokenizer
    from kvevict.report.runs import stream_start_label

    assert stream_start(load_tokenizer("smollm2-135m")) == []
    model, tokenizer = load_model("gemma3-270m")
    assert type(model).__name__ == "Gemma3ForCausalLM"
    tokens, _ = load_tokens("pg-essays", tokenizer, 64)  # short: CI pays the first load too
    assert stream_start(tokenizer) == [tokenizer.bos_token_id] and int(tokens[0]) == tokenizer.bos_token_id
    assert tokenizer.decode([int(tokens[0])]) == "<bos>"  # Gemma's vocabulary, not kvevict's
    # the retrieval and generation prompts start the same way (the GGUF tokenizer has no chat template)
    assert frame(tokenizer).before.tolist() == [tokenizer.bos_token_id]
    config = SweepConfig(model="gemma3-270m", out=str(tmp_path), name="bos")
    prepare_folder(config)
    record_stream_start(config, tokenizer)  # what a sweep writes: the run says how its text was tokenised
    recorded = json.loads((tmp_path / "bos" / "run.json").read_text())["config"]
    assert (recorded["stream_start"], recorded["stream_start_ids"]) == ("<bos>", [tokenizer.bos_token_id])
    assert stream_start_label(recorded) == "stream starts with <bos>"
    for positions in ("original", "cache"):
        specs = ["sink4+window", "h2o"]
        ref, _ = compare(model, tokens, specs, 32, positions, reference=False, progress=False, chunk=1)
        got, _ = compare(model, tokens, specs, 32, positions, reference=False, progress=False, chunk=28)
        for a, b in zip(ref, got):
            assert torch.allclose(b.nll, a.nll, rtol=1e-4, atol=1e-4), f"{a.policy} ({positions})"
            # 64 tokens have not filled a 512-token window: the sliding layers hold them all
            assert a.summary()["held_per_layer_kind"] == {"sliding_attention": 64, "full_attention": 32}
