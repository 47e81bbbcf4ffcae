"""The A/B harness: every policy at every budget on one model and text, side by side, resumable.

* `plan` — the sweep's settings (`SweepConfig`), its cells, and every check made
  before a model is loaded;
* `run` — the run folder, batching the cells of one budget as rows of one forward,
  writing each finished batch to `results.jsonl`, and resuming;
* `tasks` — the protocols beyond perplexity (needle, generation, sink map) inside a sweep.

The harness writes typed records (`records.schema`) and knows nothing of how they are
drawn; the report knows nothing of the harness.

`run` is imported on first use (PEP 562): a command that describes its run with one light submodule
(`ruler.RulerRun`, `executors`) checks it before its model load without importing every sweep task, and
transformers with them. `plan` is imported here: the function shares the submodule's name, and only an
import here keeps `kvevict.ab.plan` the function.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..lazy import exports
from .plan import Cell, SweepConfig, plan

if TYPE_CHECKING:
    from .run import prepare_folder, run_sweep

__getattr__, __dir__ = exports(__name__, {"prepare_folder": ".run", "run_sweep": ".run"})
__all__ = ["Cell", "SweepConfig", "plan", "prepare_folder", "run_sweep"]
