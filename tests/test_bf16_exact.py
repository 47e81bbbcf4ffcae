"""bf16: the engine against the masked-attention reference of `test_architectures.py`, run in bf16 too.

Tolerances. bf16 keeps 8 significant bits, so every rounding moves a value by up to 2^-9
of itself. The engine and the reference round at different places (SDPA against eager
attention, slots in kept order against positions in stream order), so even with the same
kept set their NLLs differ by about as much as either differs from float32. Each test
measures that spread on the reference itself, the same masked forward in bf16 and in
float32 (`noise`), and allows the engine twice its mean and three times its largest
per-token value. A wrong kept set moves far more than that: the same comparison
against a reference that keeps one entry fewer fails (see `test_a_wrong_kept_set_is_caught`).

H2O is not compared by NLL: which entry it evicts among near-equal cumulative scores is
decided by the last bits, which bf16 rounds differently in the two computations. It is
compared where the answer does not depend on rounding order: layer 0's running sums
(its queries and keys are the same tensors in both runs, being computed from the token
embeddings alone) against the reference's float32 sums, and the kept set.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AttentionInterface, DynamicCache

from architectures import ARCHS, VOCAB
from kvevict import EvictingCache, compare
from test_architectures import BUDGET, CACHE_KWARG, SINKS, TOKENS, Reference, reference_nll

from support import attn

BAND = {"window": ("band", 0), f"sink{SINKS}+window": ("band", SINKS)}
CASES = [(a, p) for a in ARCHS for p in a.positions]


def _within_noise(got: torch.Tensor, ref16: torch.Tensor, ref32: torch.Tensor, what: str) -> None:
    """`got` (the engine in bf16) is as close to the bf16 reference as bf16 itself moves the reference."""
    noise = (ref16 - ref32).abs()
    err = (got - ref16).abs()
    assert err.mean() <= 2 * noise.mean(), f"{what}: mean {err.mean():.4f} > 2 x {noise.mean():.4f}"
    assert err.max() <= 3 * noise.max(), f"{what}: max {err.max():.4f} > 3 x {noise.max():.4f}"


@pytest.mark.parametrize("arch,positions", CASES, ids=[f"{a.name}-{p}" for a, p in CASES])
def test_bf16_matches_the_bf16_reference(arch, positions):
    model16, model32 = arch.build(seed=3, dtype=torch.bfloat16), arch.build(seed=3)
    specs = list(BAND)
    rows, _ = compare(model16, TOKENS, specs, BUDGET, positions, reference=False, progress=False, chunk=7)
    for spec, row in zip(specs, rows):
        cache_mode = positions == "cache"
        ref16 = reference_nll(model16, BAND[spec], cache_mode)
        ref32 = reference_nll(model32, BAND[spec], cache_mode)
        _within_noise(row.nll, ref16, ref32, f"{arch.name} {positions} {spec}")


def test_a_wrong_kept_set_is_caught():
    """The tolerance separates: a reference that keeps one entry fewer is outside it."""
    arch = next(a for a in ARCHS if a.name == "llama3")
    model16, model32 = arch.build(seed=3, dtype=torch.bfloat16), arch.build(seed=3)
    rows, _ = compare(model16, TOKENS, ["window"], BUDGET, reference=False, progress=False)
    ref16 = reference_nll(model16, ("band", 0), False)
    ref32 = reference_nll(model32, ("band", 0), False)
    _within_noise(rows[0].nll, ref16, ref32, "window")
    fewer = reference_nll(model16, ("band", 0), False, budget=BUDGET - 1)
    with pytest.raises(AssertionError):
        _within_noise(rows[0].nll, fewer, reference_nll(model32, ("band", 0), False, budget=BUDGET - 1), "fewer")


# --- H2O's running sums: float32, whatever the model's dtype -------------------------------------------------

STREAM = torch.randint(0, VOCAB, (120,), generator=torch.Generator().manual_seed(5))
H2O_BUDGET = 16


def _reference_sums(model, acc_dtype: torch.dtype) -> Reference:
    ref = Reference(model, ("h2o", 0.5), False, H2O_BUDGET, acc_dtype)
    AttentionInterface.register("bf16_reference", ref)
    with attn(model, "bf16_reference"), torch.inference_mode():
        full = DynamicCache()
        for piece in [STREAM[:H2O_BUDGET]] + [STREAM[t : t + 1] for t in range(H2O_BUDGET, STREAM.numel())]:
            model(piece[None], use_cache=True, **{CACHE_KWARG(model): full})
    return ref


FIRST_FULL = [a for a in ARCHS if a.name != "gemma3"]  # gemma3's layer 0 slides: no policy, no sums


@pytest.mark.parametrize("arch", FIRST_FULL, ids=[a.name for a in FIRST_FULL])
def test_h2o_sums_are_float32_in_a_bf16_model(arch):
    """Layer 0's cumulative attention after 120 tokens equals the reference's float32 sums of its own
    probabilities, to float32's rounding (2^-24 per addition, 120 additions: under 2e-5 relative; measured
    1-2e-7 on the eight architectures). The same increments summed in bf16 are off by 1e-2 to 4e-2 (the check
    below keeps this case one where bf16 loses them), so a bf16 accumulator fails the test. The kept set is the
    reference's too."""
    model = arch.build(seed=3, dtype=torch.bfloat16)
    cache = EvictingCache(model, policy="h2o:recent=0.5", budget=H2O_BUDGET)
    with torch.inference_mode():
        for piece in [STREAM[:H2O_BUDGET]] + [STREAM[t : t + 1] for t in range(H2O_BUDGET, STREAM.numel())]:
            model(piece[None], use_cache=True, **{CACHE_KWARG(model): cache})
    exact, rounded = _reference_sums(model, torch.float32), _reference_sums(model, torch.bfloat16)
    kept = cache.kept_positions()[0][0]  # [H_kv, budget] positions, ascending
    for head, positions in enumerate(kept.tolist()):
        assert positions == torch.nonzero(~exact.evicted[0][0, head]).flatten().tolist(), f"head {head}"
    layer = cache.layers[0]
    slots = layer.storage.pos[0, :, : layer.n]  # [H_kv, n]
    sums = next(iter(layer.storage.stats.values()))[0, :, : layer.n]
    want = exact.acc[0][0].gather(-1, slots)
    in_bf16 = rounded.acc[0][0].gather(-1, slots).float()
    assert ((in_bf16 - want).abs() / want).max() > 1e-3  # the case loses increments in bf16
    assert ((sums - want).abs() / want).max() < 2e-5


@pytest.mark.model
@pytest.mark.parametrize("name", ["smollm2-135m", "gemma3-270m"])
def test_embedded_models_in_bf16_match_the_bf16_reference(name):
    """Both embedded models, loaded with `dtype="bfloat16"`, on 64 essay tokens at budget 32: sink4+window
    against the same reference and the same measured tolerance as the matrix (Gemma's sliding layers,
    window 512, hold every token here). Streamed in chunks of 16, as a sweep streams (chunked equals
    token-by-token: test_chunked_exact.py); bf16 on the CPU is slow, and 32 one-token steps cost most of it."""
    from kvevict import load_model, load_tokens

    model16, tokenizer = load_model(name, dtype="bfloat16")
    model32, _ = load_model(name)
    assert model16.dtype == torch.bfloat16 and model32.dtype == torch.float32
    tokens, _ = load_tokens("pg-essays", tokenizer, 64)
    rows, _ = compare(model16, tokens, ["sink4+window"], 32, reference=False, progress=False, chunk=16)
    ref16 = reference_nll(model16, ("band", SINKS), False, tokens, 32)
    ref32 = reference_nll(model32, ("band", SINKS), False, tokens, 32)
    _within_noise(rows[0].nll, ref16, ref32, name)
