"""The cache's layers: the three peers behind `CacheLayer` and what each is built with.

`interface.py` (`CacheLayer`), `slots.py` (`SlotLayer`, shared by the uniform and the sliding layer),
`uniform.py` (`EvictingLayer`), `sliding.py` (`SlidingLayer`), `per_head/` (`RaggedLayer`: Ada-KV's
per-head budgets), `settings.py` (`LayerSettings`, `Forward`), `setup.py` (each kind's class and settings).
"""
