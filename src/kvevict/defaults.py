"""Defaults shared by the library and the CLI, importable without torch (the CLI starts fast)."""

#: Tokens per forward after the prefill in streaming evaluation (exact at any size);
#: chosen by benchmarks/chunked_vs_stepwise.py --chunks, see docs/benchmarks.md.
DEFAULT_CHUNK = 256

#: The recompute oracle scores every K-th token unless `--oracle-stride` says otherwise; where the oracle is
#: not defined (a hybrid model) a default run leaves it out and its report says why.
DEFAULT_ORACLE_STRIDE = 8

#: A task envelope's sequential sampling: a cell is first judged on this many samples and gains as many per look,
#: up to the cap. With 5 points of tolerance at the envelope's level, agreeing answers show "inside" only from 69 on
#: (`stats.tolerance`), so the cap of 80 is what lets an inside cell be found at all (looks 20, 40, 60, 80).
DEFAULT_SAMPLES_START = 20
DEFAULT_SAMPLES_MAX = 80
