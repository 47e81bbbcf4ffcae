"""Where a RULER answer's time goes: the shared 4-row prefill and decode vs each policy alone.

One `niah_single_2` prompt (2,000 tokens) at 50% on the embedded model: the context
prefill of the 4 policy rows fed once, the question, the batched answers; then each
policy (and the full cache) prefilled and decoded alone. Each part is timed on its own.

    .venv/bin/python benchmarks/ruler_prefill_profile.py
"""

from __future__ import annotations

import time

from kvevict.eval.prompts import stop_ids
from kvevict.eval.ruler.framing import framing
from kvevict.eval.ruler.grid import check_budget
from kvevict.eval.ruler.protocols import decode, prefill
from kvevict.eval.ruler.registry import get_task
from kvevict.eval.ruler.sample import fit
from kvevict.eval.ruler.words import Material
from kvevict.loading import load_model

POLICIES = ["window", "streamingllm", "h2o", "snapkv"]


def timed(work, *args):
    t0 = time.perf_counter()
    result = work(*args)
    return result, time.perf_counter() - t0


def main() -> None:
    model, tokenizer = load_model("smollm2-135m")
    prompt = fit(get_task("niah_single_2"), 2128, 1, 0, framing(tokenizer), Material())
    stops = stop_ids(tokenizer)
    entries = check_budget(prompt, "agnostic", POLICIES, "50%", "requests", "original")
    state, seconds = timed(lambda: prefill(model, prompt.context, POLICIES, entries, "original"))
    print(f"shared prefill 4 rows: {seconds:.2f} s")
    state.cache.freeze(final=True)
    _, seconds = timed(lambda: state.feed(model, prompt.question))
    print(f"question 4 rows: {seconds:.2f} s")
    out, seconds = timed(lambda: decode(model, tokenizer, state, 128, stops))
    print(f"decode 4 rows: {seconds:.2f} s, lengths {[len(o) for o in out]}")
    for spec in ["full", *POLICIES]:
        budget = None if spec == "full" else entries
        state, seconds = timed(prefill, model, prompt.context, [spec], budget, "original")
        state.cache.freeze(final=True)
        state.feed(model, prompt.question)
        out, answer_seconds = timed(decode, model, tokenizer, state, 128, stops)
        print(f"{spec}: prefill {seconds:.2f} s, decode {answer_seconds:.2f} s for {len(out[0])} tokens")


if __name__ == "__main__":
    main()
