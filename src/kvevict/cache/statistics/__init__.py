"""The attention statistics policies ask for, measured once per forward and handed back.

`measure.py` (`Statistics`: requests by kind, measured through the kernel `kvevict.attention_stats`),
`probabilities.py` (the engine's side of that kernel: its default bound, SDPA's call), `query_window.py`
(the last queries of a layer: SnapKV's observation window).
"""
