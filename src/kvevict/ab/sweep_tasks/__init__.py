"""The protocols beyond perplexity a sweep runs, as objects: `base.SweepTask`, one module per task, `registry`."""
