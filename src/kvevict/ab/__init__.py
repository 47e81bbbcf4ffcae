"""The A/B harness: every policy at every budget on one model and text, side by side, resumable.

* `plan` — the sweep's settings (`SweepConfig`), its cells, and every check made
  before a model is loaded;
* `run` — the run folder, batching the cells of one budget as rows of one forward,
  writing each finished batch to `results.jsonl`, and resuming;
* `tasks` — the protocols beyond perplexity (needle, generation, sink map) inside a sweep.

The harness writes typed records (`records.schema`) and knows nothing of how they are
drawn; the report knows nothing of the harness.
"""

from .plan import Cell, SweepConfig, plan
from .run import prepare_folder, run_sweep

__all__ = ["Cell", "SweepConfig", "plan", "prepare_folder", "run_sweep"]
