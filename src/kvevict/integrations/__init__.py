"""kvevict inside other tools: lm-evaluation-harness and Ray.

* `lmeval` — `--model kvevict` for lm-eval (registered when imported), and `evaluate`;
* `lmeval_args` — its `model_args`, parsed and checked without importing lm-eval;
* `lmeval_tasks` — the tasks and their datasets, checked before the model loads;
* `hub` — the Hugging Face libraries kept offline (unless allowed) and quiet while lm-eval runs;
* `ray_executor` — a sweep's batches on Ray workers;
* `executor_choice` — the executor `--executor NAME` names (local or Ray).

Both tools are optional extras, imported only inside these modules. The package sits
below `ab/` and `eval/` (it builds on them) and above `cli/` (the commands call it);
nothing in `ab/` or `eval/` imports it.
"""
