"""Defaults shared by the library and the CLI, importable without torch (the CLI starts fast)."""

#: Tokens per forward after the prefill in streaming evaluation (exact at any size);
#: chosen by benchmarks/chunked_vs_stepwise.py --chunks, see docs/benchmarks.md.
DEFAULT_CHUNK = 256

#: The recompute oracle scores every K-th token unless `--oracle-stride` says otherwise; where the oracle is
#: not defined (a hybrid model) a default run leaves it out and its report says why.
DEFAULT_ORACLE_STRIDE = 8
