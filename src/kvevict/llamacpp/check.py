"""The llama.cpp check: the same tokens through llama.cpp and through kvevict's `llamacpp` preset.

llama.cpp multiplies with the GGUF's quantized weights; kvevict runs the same weights
dequantized to float32. The two are never bit-equal, so the check calibrates on the full
cache first and then asks three things of the shifted runs:

* the same shift points (tokens seen at each context shift): exact, since both follow
  llama-server's arithmetic on the same token count;
* the same ratio of shifted to full-cache perplexity, within `tolerance`: each side's
  ratio is its own shifted PPL over its own full PPL, so the quantization gap both runs
  share cancels; what remains is bounded by the gap of the full caches (`full_gap`, the
  absolute log of their PPL ratio). The tolerance is twice that gap (one for each PPL
  of the ratio), and never below 2%;
* a per-token NLL correlation of at least 0.99 between the two shifted runs.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

from ..cache import Eviction, Observer
from ..eval.streaming import compare, full_reference
from ..position_modes import SHIFTED
from .stream import EngineStream, LlamaCppModel

#: the per-token NLL correlation the shifted runs must reach
MIN_CORRELATION = 0.99
#: the least tolerance on the PPL ratio (log scale): 2%
MIN_TOLERANCE = 0.02


class ShiftRecorder(Observer):
    """Tokens seen at each eviction of layer 0: the cache's shift points."""

    def __init__(self) -> None:
        self.shifts: list[int] = []

    def reset(self) -> None:
        self.shifts = []

    def on_evict(self, event: Eviction) -> None:
        if event.layer == 0:
            self.shifts.append(event.seen)


@dataclass
class CheckResult:
    """One (model, budget, keep) comparison. PPLs over the same `tokens - 1` predictions."""

    model: str
    budget: int
    keep: int
    bos: int
    tokens: int
    engine_full_ppl: float
    engine_ppl: float
    kvevict_full_ppl: float
    kvevict_ppl: float
    full_correlation: float
    correlation: float
    engine_shifts: list[int] = field(default_factory=list)
    kvevict_shifts: list[int] = field(default_factory=list)

    @property
    def full_gap(self) -> float:
        return abs(math.log(self.engine_full_ppl / self.kvevict_full_ppl))

    @property
    def tolerance(self) -> float:
        return max(2 * self.full_gap, MIN_TOLERANCE)

    @property
    def engine_ratio(self) -> float:
        return self.engine_ppl / self.engine_full_ppl

    @property
    def kvevict_ratio(self) -> float:
        return self.kvevict_ppl / self.kvevict_full_ppl

    @property
    def ratio_gap(self) -> float:
        return abs(math.log(self.engine_ratio / self.kvevict_ratio))

    def failures(self) -> list[str]:
        """What did not hold, in words (empty: the check passed)."""
        out = []
        if self.engine_shifts != self.kvevict_shifts:
            out.append(
                f"shift points differ: llama.cpp {self.engine_shifts[:6]}..., kvevict {self.kvevict_shifts[:6]}..."
            )
        if self.ratio_gap > self.tolerance:
            out.append(
                f"PPL ratio to the full cache differs: llama.cpp {self.engine_ratio:.4f}, "
                f"kvevict {self.kvevict_ratio:.4f} (log gap {self.ratio_gap:.4f} > tolerance {self.tolerance:.4f})"
            )
        if self.correlation < MIN_CORRELATION:
            out.append(f"per-token NLL correlation {self.correlation:.4f} < {MIN_CORRELATION}")
        return out

    def summary(self) -> dict:
        row = asdict(self)
        row.update(
            full_gap=self.full_gap, tolerance=self.tolerance, engine_ratio=self.engine_ratio,
            kvevict_ratio=self.kvevict_ratio, ratio_gap=self.ratio_gap, shifts=len(self.engine_shifts),
            same_shifts=self.engine_shifts == self.kvevict_shifts, passed=not self.failures(), failures=self.failures(),
        )
        return row


def correlation(a: np.ndarray, b: np.ndarray) -> float:
    """Pearson correlation of two per-token NLL series."""
    return float(np.corrcoef(a, b)[0, 1])


def engine_check(
    model_name: str, gguf, model, tokens: torch.Tensor, budget: int, keeps: list[int], chunk: int, threads: int = 2
) -> list[CheckResult]:
    """One `CheckResult` per `keep`: llama.cpp (GGUF file `gguf`) against kvevict's `llamacpp:keep=K,bos=B`
    on `model` (the same GGUF, dequantized), both over `tokens` `[T]` at context `budget`."""
    ids = tokens.tolist()
    with LlamaCppModel(gguf, threads=threads) as engine:
        engine_full = engine.stream(ids, None)
        shifted = {keep: engine.stream(ids, budget, keep) for keep in keeps}
        bos = int(engine.add_bos)
    reference = full_reference(model, tokens, progress=False)
    full_nll = reference.result.nll.double().numpy()
    results = []
    for keep in keeps:
        recorder = ShiftRecorder()
        rows, _ = compare(
            model, tokens, [f"llamacpp:keep={keep},bos={bos}"], budget, SHIFTED.name, reference=reference,
            progress=False, chunk=chunk, observers=[recorder],
        )
        results.append(_result(model_name, budget, keep, bos, len(ids), engine_full, shifted[keep], full_nll,
                               rows[0].nll.double().numpy(), recorder.shifts))
    return results


def _result(name, budget, keep, bos, count, engine_full: EngineStream, engine: EngineStream, full_nll, nll, shifts):
    return CheckResult(
        model=name, budget=budget, keep=keep, bos=bos, tokens=count,
        engine_full_ppl=engine_full.ppl, engine_ppl=engine.ppl,
        kvevict_full_ppl=float(np.exp(full_nll.mean())), kvevict_ppl=float(np.exp(nll.mean())),
        full_correlation=correlation(engine_full.nll, full_nll), correlation=correlation(engine.nll, nll),
        engine_shifts=engine.shifts, kvevict_shifts=shifts,
    )


def engine_side(
    model_name: str, gguf, tokens: torch.Tensor, budget: int, keeps: list[int], threads: int = 2
) -> list[dict]:
    """llama.cpp alone: per `keep`, its PPL with llama-server's context shift at n_ctx `budget` against its
    own full cache over `tokens` `[T]` (no transformers model loaded)."""
    ids = tokens.tolist()
    with LlamaCppModel(gguf, threads=threads) as engine:
        full = engine.stream(ids, None)
        runs = {keep: engine.stream(ids, budget, keep) for keep in keeps}
        bos = int(engine.add_bos)
    return [
        {
            "model": model_name, "budget": budget, "keep": keep, "bos": bos, "tokens": len(ids),
            "keeps_token0": keep + bos > 0, "engine_ppl": run.ppl, "engine_full_ppl": full.ppl,
            "engine_ratio": run.ppl / full.ppl, "shifts": len(run.shifts),
        }
        for keep, run in runs.items()
    ]
