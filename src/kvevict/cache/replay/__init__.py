"""A forward of many tokens that evicts exactly as one-token forwards would.

`paths.py` (the reference stepping and its registered fast paths), `chunk.py` (the closed-form plan and
the stepping for keys that keep their rotation), `by_slot.py` (static and slot-local policies scored by
slot), `stepping.py` (what every stepping algorithm shares: `Stepper`, virtual slots).
"""
