"""H2O's prefill with its attention statistics timed inside it (one RULER context, SmolLM2), for one source tree.

Window and H2O each prefill the same 2,000-token `niah_single_2` context twice at 50%;
the time spent in `attention_mass` (H2O's statistics) is printed beside each prefill.
Run it once per tree to compare two versions:

    PYTHONPATH=<tree>/src OMP_NUM_THREADS=2 .venv/bin/python benchmarks/ruler_h2o_statistics.py
"""

from __future__ import annotations

import time

import kvevict.cache.statistics.measure as statistics
from kvevict.eval.ruler.framing import framing
from kvevict.eval.ruler.grid import check_budget
from kvevict.eval.ruler.protocols import prefill
from kvevict.eval.ruler.registry import get_task
from kvevict.eval.ruler.sample import fit
from kvevict.eval.ruler.words import Material
from kvevict.loading import load_model


def main() -> None:
    spent = {"seconds": 0.0, "calls": 0}
    inner = statistics.attention_mass

    def timed(*args):
        t0 = time.perf_counter()
        out = inner(*args)
        spent["seconds"] += time.perf_counter() - t0
        spent["calls"] += 1
        return out

    statistics.attention_mass = timed
    model, tokenizer = load_model("smollm2-135m")
    prompt = fit(get_task("niah_single_2"), 2128, 1, 0, framing(tokenizer), Material())
    entries = check_budget(prompt, "agnostic", ["h2o"], "50%", "requests", "original")
    for spec in ["window", "h2o", "window", "h2o"]:
        spent.update(seconds=0.0, calls=0)
        t0 = time.perf_counter()
        prefill(model, prompt.context, [spec], entries, "original")
        total = time.perf_counter() - t0
        print(f"{spec}: prefill {total:.2f} s, attention_mass {spent['seconds']:.2f} s in {spent['calls']} calls")


if __name__ == "__main__":
    main()
