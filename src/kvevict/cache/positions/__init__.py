"""Where a key's rotation comes from: the two position modes and RoPE at any position.

`modes.py` (`PositionMode`: original positions, or positions shifted into the cache), `rotary.py`
(the model's rotary module evaluated at any position).
"""
