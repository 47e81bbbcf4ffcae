"""Where a decode step's wall time goes, per arm: kvevict's parts timed with `perf_counter`.

`profile_decode.py` counts Python calls (cProfile), which inflates every small call. This
script times the parts themselves: each is wrapped once, and the time inside it is summed per
decode step (ms per step, summed over the layers, the median step), next to the same step's total. Arms take
turns step by step as in `decode_overhead.py`; DynamicCache's own parts (`DynamicCache.update`:
its concatenation, and SDPA) are timed the same way.

    PYTHONPATH=src:benchmarks .venv/bin/python benchmarks/decode_breakdown.py --arms knorm,h2o
    PYTHONPATH=src:benchmarks .venv/bin/python benchmarks/decode_breakdown.py --model llama-3.1-8b --budget 4096 \
      --arms window,adakv:snapkv

Parts (nested ones are inside their parent's time): `update` (the cache writes the new entry),
`attention` (kvevict's attention function: everything below), `sdpa` / `query_attention` (the
attention itself: SDPA, or the kernel's one-query path where the policy keeps the probabilities), `plan`, `finish`
(statistics, the eviction, the observers), then the eviction by the step path that took it
(`cache/step/paths.py`): `step: in place` (the statistics measured, the scores, `victim`, the slot chosen
with ties broken by position, and `fill_hole`, the newest slot moved into it), `step: ring` (the
ring's slot moved, nothing measured or scored), `step: reference` (a compaction).
A storage form's layer (`fp8+P`, `q4+P`) adds `form.decode` (its held codes decoded into the working buffer,
inside `update`) and `form.encode` (the new entry encoded once).
The per-head layer (`adakv:P`) does all of it in `ragged.replay`: `ragged.append` (the new entry
at each head's tail), `ragged.views` (each head's entries as the policies see them),
`ragged.attend` (attention by hand over the row's buffer, masked per head), `ragged.evict`
(scores and `ragged.allocate`, the joint top-k). Each wrapper adds about a microsecond per
call: compare parts, not the totals, to `decode_overhead.py`.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from collections import Counter

import torch
import torch.nn.functional as F
from decode_overhead import load, make, use
from replay_breakdown import timed
from transformers import AttentionInterface, DynamicCache

import kvevict.cache.attention as attention
import kvevict.cache.step.paths as step_paths
from kvevict.cache.cache import EvictingCache
from kvevict.cache.layers import slots
from kvevict.cache.layers.interface import NAME
from kvevict.cache.layers.per_head import layer as ragged
from kvevict.cache.layers.per_head.storage import RaggedStorage
from kvevict.cache.layers.uniform import EvictingLayer
from kvevict.cache.step import selection
from kvevict.cache.storage.quantized import QuantizedStorage
from kvevict.cache.storage.slots import SlotStorage
from kvevict.cli.common import split_specs
from kvevict.eval.forward import body

# (owner, attribute, label): the parts timed
PARTS = [
    (EvictingCache, "update", "update"),
    (DynamicCache, "update", "update"),
    (attention, "kvevict_attention", "attention"),
    (F, "scaled_dot_product_attention", "sdpa"),
    (slots, "query_attention", "query_attention"),
    (EvictingLayer, "plan", "plan"),
    (EvictingLayer, "finish", "finish"),
    (selection, "victim", "victim"),
    (SlotStorage, "fill_hole", "fill_hole"),
    # a storage form (`fp8+P`, `q4+P`): the held codes decoded into the working buffer, the new entry encoded
    (QuantizedStorage, "begin", "form.decode"),
    (QuantizedStorage, "written", "form.encode"),
    # the per-head layer (Ada-KV): every forward is its `replay`
    (ragged.RaggedLayer, "replay", "ragged.replay"),
    (RaggedStorage, "append", "ragged.append"),
    (ragged.RaggedLayer, "_views", "ragged.views"),
    (ragged, "ragged_attention", "ragged.attend"),
    (ragged.RaggedLayer, "_evict", "ragged.evict"),
    (ragged, "allocate", "ragged.allocate"),
]
#: the eviction step paths (`step_paths.PATHS` and the reference), each timed under `step: NAME`
STEP_LABELS = [f"step: {path.name}" for path in (*step_paths.PATHS, step_paths.REFERENCE)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--budget", type=int, default=512)
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--model", default="smollm2-135m",
                        help="an embedded model (read on pg-essays) or a real attention shape (shapes.py, random ids)")
    parser.add_argument("--arms", default="window,knorm,h2o")
    args = parser.parse_args()
    spent: Counter = Counter()
    for owner, name, label in PARTS:
        setattr(owner, name, timed(getattr(owner, name), label, spent))
    # a layer binds its paths at its first forward, from these
    step_paths.PATHS = tuple(dataclasses.replace(p, run=timed(p.run, f"step: {p.name}", spent))
                             for p in step_paths.PATHS)
    step_paths.REFERENCE = dataclasses.replace(step_paths.REFERENCE, run=timed(step_paths.REFERENCE.run,
                                               "step: reference", spent))
    AttentionInterface.register(NAME, attention.kvevict_attention)  # the wrapped function
    arms = ["dynamic", *(a for a in split_specs(args.arms) if a and a != "dynamic")]
    model, tokens, _ = load(args.model, "cpu", None, args.budget + args.steps + 1)
    steps: dict[str, list[float]] = {arm: [] for arm in arms}
    parts: dict[str, dict[str, list[float]]] = {arm: {} for arm in arms}  # per part, its time in each step
    with torch.inference_mode():
        caches = {arm: make(model, arm, args.budget, args.steps, tokens) for arm in arms}
        for step in range(args.steps):
            for k in range(len(arms)):
                arm = arms[(step + k) % len(arms)]
                cache, at = caches[arm]
                use(model, arm)
                spent.clear()
                start = time.perf_counter()
                body(model, tokens[None, at + step : at + step + 1], cache)
                steps[arm].append(time.perf_counter() - start)
                for label, seconds in spent.items():
                    parts[arm].setdefault(label, [0.0] * args.steps)[step] = seconds
    print(f"decode step, {args.model}, budget {args.budget}, batch 1, {args.steps} steps per arm; ms per step, "
          "medians over the steps (a part: its time summed over the layers of a step)")
    labels = [label for label in [*(part[2] for part in PARTS), *STEP_LABELS]
              if any(label in parts[arm] for arm in arms)]
    labels = list(dict.fromkeys(labels))
    print(f"{'arm':<14}{'median':>8}" + "".join(f"{label:>18}" for label in labels))
    for arm in arms:
        row = "".join(f"{statistics.median(parts[arm][label]) * 1000:>18.2f}" if label in parts[arm] else f"{'':>18}"
                      for label in labels)
        print(f"{arm:<14}{statistics.median(steps[arm]) * 1000:>8.1f}{row}")


if __name__ == "__main__":
    main()
