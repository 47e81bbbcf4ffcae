"""Defaults shared by the library and the CLI, importable without torch (the CLI starts fast)."""

#: Tokens per forward after the prefill in streaming evaluation (exact at any size);
#: chosen by benchmarks/chunked_vs_stepwise.py --chunks, see docs/benchmarks.md.
DEFAULT_CHUNK = 256
